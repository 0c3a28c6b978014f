"""Named plug-ins (policies, transports) are looked up by name through one helper."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from kvpool.errors import InvalidArgument, KvpoolError

T = TypeVar("T")


def lookup(registry: Mapping[str, T], kind: str, name: str,
           error: type[KvpoolError] = InvalidArgument) -> T:
    """`registry[name]`, or `error` naming the choices: "unknown <kind> 'x'; choose one of [...]"."""
    try:
        return registry[name]
    except KeyError:
        raise error(f"unknown {kind} {name!r}; choose one of {sorted(registry)}") from None
