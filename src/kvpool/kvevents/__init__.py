"""KV-cache events in vLLM's format: codec, block hashing, cache index, ZMQ drivers.

`events` + `codec` are the sans-I/O wire (msgpack batches, both of vLLM's forms); `hashing`
computes an engine's own block-hash chain from token ids; `index` tracks which blocks each
instance holds per medium; `sequence` tracks per-topic sequence numbers; `subscriber` and
`publisher` are the ZMQ drivers (PUB/SUB with a ROUTER replay socket, vLLM's protocol).
"""
