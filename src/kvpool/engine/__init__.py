"""kvpool.engine: the reference inference engine (torch) and its prefill/decode workers."""
