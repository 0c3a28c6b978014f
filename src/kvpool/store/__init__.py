"""kvpool.store."""
