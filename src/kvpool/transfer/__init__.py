"""kvpool.transfer."""
