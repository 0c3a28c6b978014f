"""How a client waits for objects loaded from disk (ClientBase._lookup), on a virtual clock
against a scripted master: not-ready keys are looked up again, and keys found early in a
long wait have their (short) leases renewed before the read starts."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace

from kvpool.clock import VirtualClock
from kvpool.store.client.base import ClientBase
from kvpool.store.client.early import Places
from kvpool.store.wire.codes import ErrorCode, LookupResult

E = ErrorCode
LEASE = 0.25


class ScriptedMaster:
    """Stands in for the client (`self` of ClientBase._lookup): answers lookups with
    `ready(key, now)` and records each one."""

    def __init__(self, ready: Callable[[str, float], bool], timeout_s: float = 5.0) -> None:
        self.clock = VirtualClock()
        self.config = SimpleNamespace(rpc_timeout_s=timeout_s)
        self.ready = ready
        self.calls: list[tuple[float, list[str]]] = []
        self._places = Places()
        self.endpoint, self.host = "127.0.0.1:1", "127.0.0.1"

    _remember = ClientBase._remember
    _placed = ClientBase._placed

    def _lookup_once(self, keys: Sequence[str]) -> list[LookupResult]:
        now = self.clock.now()
        self.calls.append((now, list(keys)))
        return [LookupResult(E.OK, 1, (), LEASE, 0) if self.ready(k, now)
                else LookupResult(E.REPLICA_IS_NOT_READY) for k in keys]


def lookup(master: ScriptedMaster, keys: list[str]) -> list[LookupResult]:
    return ClientBase._lookup(master, keys)[0]  # type: ignore[arg-type]


def test_a_quick_load_needs_no_renewal() -> None:
    master = ScriptedMaster(lambda key, now: key == "a" or now >= 0.005)
    out = lookup(master, ["a", "b"])
    assert [r.code for r in out] == [E.OK, E.OK]
    assert all(keys == ["b"] for _, keys in master.calls[1:])


def test_leases_used_up_while_others_load_are_renewed_once() -> None:
    master = ScriptedMaster(lambda key, now: key == "a" or now >= 0.2)
    out = lookup(master, ["a", "b"])
    assert [r.code for r in out] == [E.OK, E.OK]
    last_t, last_keys = master.calls[-1]
    assert last_keys == ["a"] and last_t >= 0.2            # "a" asked again at the end
    assert out[0].lease_ttl_s >= last_t + LEASE - 0.01     # counted from t0, like the rest
    assert sum(keys == ["a"] for _, keys in master.calls) == 1


def test_waiting_ends_at_the_rpc_timeout() -> None:
    master = ScriptedMaster(lambda key, now: False, timeout_s=1.0)
    out = lookup(master, ["a"])
    assert out[0].code == E.REPLICA_IS_NOT_READY
    assert master.clock.now() <= 1.0


def test_a_key_loaded_again_after_its_renewal_is_waited_for_with_the_back_off() -> None:
    """The renewal goes out at once; if it finds "a" being loaded again (its copy's lease
    ran out while "b" loaded), the next lookups wait 2, 4 ... 50 ms again, not none (a busy
    loop on the master's one RPC thread for up to rpc_timeout_s)."""
    def ready(key: str, now: float) -> bool:
        if key == "b":
            return now >= 0.3
        return now < 0.25 or now >= 0.5

    class Timed(ScriptedMaster):
        def _lookup_once(self, keys: Sequence[str]) -> list[LookupResult]:
            self.clock.advance(0.0002)  # a master round trip
            return super()._lookup_once(keys)

    master = Timed(ready)
    assert [r.code for r in lookup(master, ["a", "b"])] == [E.OK, E.OK]
    assert len(master.calls) < 40, len(master.calls)
