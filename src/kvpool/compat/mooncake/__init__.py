"""Mooncake's Python API on kvpool: `kvpool.compat.mooncake.store` and
`kvpool.compat.mooncake.engine` mirror `mooncake.store` and `mooncake.engine`, so the Mooncake
connectors of vLLM, SGLang and LMCache run on kvpool unchanged (see docs/mooncake.md and
`kvpool mooncake activate`)."""
