"""kvpool.compat."""
