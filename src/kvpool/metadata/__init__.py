"""kvpool.metadata."""
