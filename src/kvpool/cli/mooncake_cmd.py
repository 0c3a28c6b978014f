"""Placeholder: this subcommand module registers nothing yet."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    return None
