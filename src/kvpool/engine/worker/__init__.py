"""The prefill/decode worker processes: an LLMEngine on a thread, KV through the pool or pushed
with the transfer engine, and the HTTP API of docs/worker-api.md."""
