"""Benchmarks. Each module exposes `register(subparsers)` for `kvpool bench NAME`."""
