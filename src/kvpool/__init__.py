"""kvpool: KVCache-centric disaggregated LLM serving (a Mooncake-style architecture in Python)."""

__version__ = "0.1.0"
