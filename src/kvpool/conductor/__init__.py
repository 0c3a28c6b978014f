"""kvpool.conductor."""
