"""The emulated engine: the reference engine minus the math.

The scheduler, block manager, prefix hashes, pool connector, push path and HTTP API are the real
ones; a step sleeps for the time an accelerator profile (`profile.EngineProfile`) gives for
exactly that step, and writes KV bytes that are a deterministic function of the tokens
(`kvbytes`), from which every sampled token is derived, so KV that went astray shows as a
wrong output. No torch.
"""
