"""Lifecycle of the compat store (setup, close, health) and the helpers that translate kvpool's
typed results into Mooncake's integers at this edge."""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvpool.compat.mooncake.config import MooncakeConfig, from_env, from_setup_args
from kvpool.compat.mooncake.lifecycle import attach_teardown
from kvpool.compat.mooncake.types import ReplicateConfig
from kvpool.errors import ConfigError, KvpoolError
from kvpool.log import get_logger
from kvpool.store.client.store_client import StoreClient
from kvpool.store.config import ReplicateConfig as NativeReplicateConfig
from kvpool.store.wire.codes import ErrorCode, PutResult

log = get_logger("compat.store")
E = ErrorCode
INVALID = int(E.INVALID_PARAMS)
SETUP_FAILED = -1
HEALTHY, NOT_INITIALIZED, MASTER_UNREACHABLE = 0, 1, 2
_HEALTH_KEY = "__kvpool_health_probe__"
F = TypeVar("F", bound=Callable[..., Any])
PutCall = Callable[[list[int], NativeReplicateConfig], list[PutResult]]


def needs_setup(fallback: Callable[..., Any]) -> Callable[[F], F]:
    """Answer `fallback(*args)` instead of calling the method before setup / after close."""
    def deco(method: F) -> F:
        @functools.wraps(method)
        def wrapper(self: StoreBase, *args: Any, **kwargs: Any) -> Any:
            if self._client is None:
                log.warning("%s called on a store that is not set up", method.__name__)
                return fallback(*args)
            return method(self, *args, **kwargs)
        return wrapper  # type: ignore[return-value]
    return deco


def code(*_: Any) -> int:
    return INVALID


def per_key(keys: Sequence[Any] = (), *_: Any) -> list[int]:
    return [INVALID] * len(keys)


def scatter(num: int, indices: Sequence[int], values: Sequence[int]) -> list[int]:
    """Per-item results: `values` at `indices`, INVALID_PARAMS elsewhere."""
    out = [INVALID] * num
    for i, value in zip(indices, values, strict=True):
        out[i] = value
    return out


def upsert_once(keys: Sequence[str], indices: list[int], upsert: bool,
                last: bool) -> tuple[list[int], dict[int, int]]:
    """Of `indices` (into `keys`), the ones to put: with `upsert`, one of each key, the last
    or the first (Mooncake's batched upserts that name a key twice answer 0 for each and
    store one value: the last from buffers, the first from values), and for each one left
    out, the index whose result it shares."""
    if not upsert:
        return indices, {}
    kept: dict[str, int] = {}
    for i in (indices if last else reversed(indices)):
        kept[keys[i]] = i
    return [i for i in indices if kept[keys[i]] == i], \
        {i: kept[keys[i]] for i in indices if kept[keys[i]] != i}


def share_results(out: list[int], shared: dict[int, int]) -> list[int]:
    for i, j in shared.items():
        out[i] = out[j]
    return out


class StoreBase:
    """Holds the kvpool StoreClient once `setup` succeeded."""

    def __init__(self) -> None:
        self._client: StoreClient | None = None
        self._teardown: weakref.finalize | None = None
        self.config: MooncakeConfig | None = None

    def setup(self, *args: Any, **kwargs: Any) -> int:
        """Mooncake's 7-positional form (with keywords), `setup(dict)`, or (a kvpool extension)
        no arguments: read `MOONCAKE_CONFIG_PATH` / `MOONCAKE_*`. 0, or -1 on failure; TypeError
        for unknown or missing arguments, as in Mooncake."""
        try:
            config, engine = from_env_or_args(args, kwargs)
        except (ConfigError, ValueError) as exc:
            log.error("setup failed: %s", exc)
            return SETUP_FAILED
        if engine is not None:
            log.info("a shared engine was passed; kvpool's store runs its own engine")
        return self._start(config)

    def _start(self, config: MooncakeConfig) -> int:
        """Connect with `config`: 0, or -1 (already set up, or the client could not start)."""
        if self._client is not None:
            log.warning("setup called on a store that is already set up")
            return SETUP_FAILED
        try:
            client = StoreClient(config.client_config())
        except (ConfigError, KvpoolError, OSError, ValueError) as exc:
            log.error("setup failed: %s", exc)
            return SETUP_FAILED
        self._adopt(client, config)
        return 0

    def _adopt(self, client: StoreClient, config: MooncakeConfig) -> None:
        """Hold `client`, and tear it down (unmount, unpublish) when this store is closed,
        collected, or still alive at interpreter exit (see lifecycle.py)."""
        self._client, self.config = client, config
        self._teardown = attach_teardown(self, client.close, f"store {client.endpoint}")

    def close(self) -> int:
        """Unmount this process's segment and stop its threads; 0. Idempotent, and bounded
        in time (lifecycle.CLOSE_BOUND_S); the store can be set up again afterwards."""
        teardown, self._teardown, self._client = self._teardown, None, None
        if teardown is not None:
            teardown()
        return 0

    def health_check(self) -> int:
        """0 healthy, 1 not set up (or closed), 2 master unreachable."""
        if self._client is None:
            return NOT_INITIALIZED
        status = self._client.exists(_HEALTH_KEY)
        return MASTER_UNREACHABLE if status in (E.RPC_FAIL, E.RPC_TIMEOUT) else HEALTHY

    def get_hostname(self) -> str:
        return self._client.endpoint if self._client is not None else ""

    @property
    def client(self) -> StoreClient:
        if self._client is None:
            raise RuntimeError("store is not set up")
        return self._client

    def _put(self, num: int, config: ReplicateConfig | None, call: PutCall) -> list[int]:
        """Run a put of `num` items; replicas are best effort as in Mooncake: items that find
        no room for `replica_num` copies are retried with fewer, down to one."""
        try:
            native = (config or ReplicateConfig()).to_native()
        except (ConfigError, TypeError, ValueError) as exc:
            log.warning("bad ReplicateConfig: %s", exc)
            return [INVALID] * num
        todo = list(range(num))
        out = [INVALID] * num
        while todo:
            results = call(todo, native)
            for i, result in zip(todo, results, strict=True):
                out[i] = int(result.code)
            todo = [i for i in todo if out[i] == E.NO_AVAILABLE_HANDLE]
            if not todo or native.replica_num == 1:
                break
            native = NativeReplicateConfig(native.replica_num - 1, native.with_hard_pin,
                                           native.with_soft_pin, native.preferred_segment,
                                           native.preferred_segments)
        return out

    def _registered(self, parts: Sequence[tuple[int, int]]) -> bool:
        """Every (addr, size) lies inside memory registered with `register_buffer`."""
        find = self.client.engine.registry.find
        for a, n in parts:  # a loop, not all(generator): once per object on every call
            if type(a) is not int or type(n) is not int or n <= 0 or find(a, n) is None:
                return False
        return True


def from_env_or_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[MooncakeConfig, Any]:
    if not args and not kwargs:
        return from_env(os.environ), None
    return from_setup_args(args, kwargs)
