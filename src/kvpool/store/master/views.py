"""Read-only views of the master's tables for the admin HTTP server."""

from __future__ import annotations

from kvpool.store.master.core import MasterCore
from kvpool.store.wire.codes import ObjectInfo


def object_info(core: MasterCore, key: str) -> ObjectInfo | None:
    obj = core.objects.get(key)
    if obj is None:
        return None
    now = core.clock.now()
    return ObjectInfo(key, obj.size, tuple(r.desc() for r in obj.replicas),
                      obj.lease_until > now, obj.hard_pinned, obj.soft_pin_until > now)


def list_keys(core: MasterCore, prefix: str = "", limit: int = 1000) -> list[str]:
    """Up to `limit` stored keys starting with `prefix`, in insertion order."""
    out = []
    for key in core.objects:
        if key.startswith(prefix):
            out.append(key)
            if len(out) >= limit:
                break
    return out
