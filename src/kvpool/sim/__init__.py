"""kvpool.sim."""
