"""The KV-event subscriber: one SUB socket for a fleet, per-topic order, replay and resync.

Every engine publishes to one endpoint under its own topic (vLLM's `topic` in
`--kv-events-config`); the subscriber binds that endpoint by default, because vLLM's
publisher connects to a host:port endpoint (it binds only wildcard ones: pass `bind=False`
to connect to those, and `connect(endpoint)` for each further engine that binds its own).
For each message `[topic, seq, payload]` the `SequenceTracker` says what it means, and the
thread acts:

- FIRST (a topic joins) and RESTART (its seq went back: a new process): resync. The instance
  is cleared in the sink and replayed from seq 0 when a replay endpoint is configured for it.
  If that replay reaches back to seq 0 the instance's view is complete, else it is `partial`
  (it learns from now on; blocks cached before stay unknown until they are stored again).
- GAP: the lost range is replayed; when the replay cannot cover it, the instance is resynced.
- A payload that does not decode counts as lost: the instance is resynced.

The sink is anything with `apply(instance, batch)` and `clear(instance)` (a `CacheIndex`). It
is called from the subscriber's thread only. `close()` stops the thread and closes the
sockets; nothing is applied after it returns.

Data-parallel ranks (`ranks` N > 0): a vLLM server of N + 1 ranks runs a publisher per rank,
rank r at the endpoint's port plus r (vLLM's offset, bound or connected alike), all under the
server's topic, each counting its own sequence. The subscriber reads each rank's port with a
socket of its own and gives rank r's messages the topic `rank_topic(r, topic)` (by default
`topic#dpR` for r > 0, the topic itself for rank 0): each rank is an instance, with its own
order, replay and resync.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import xxhash
import zmq

from kvpool.errors import ConfigError, RemoteProtocolError
from kvpool.kvevents.codec import decode_batch
from kvpool.kvevents.events import EventBatch
from kvpool.kvevents.publisher import END_SEQ, bind_socket
from kvpool.kvevents.sequence import SequenceTracker, Verdict
from kvpool.log import get_logger

log = get_logger("kvevents.subscriber")
POLL_MS = 50
QUIET_S = 1.0
"""A batch in order after this long without one is checked against the publisher's replay
(is the batch before it the one applied last?): a publisher that restarted may have lost
exactly the batches that bring its new counter back to where the old one stopped."""


class EventSink(Protocol):
    def apply(self, instance: str, batch: EventBatch) -> None: ...
    def clear(self, instance: str) -> None: ...


@dataclass
class FeedStats:
    """One instance's stream, as the subscriber saw it (`KvEventSubscriber.stats` copies)."""

    num_batches: int = 0
    num_gaps: int = 0
    num_replayed: int = 0
    num_resyncs: int = 0
    num_malformed: int = 0
    partial: bool = False
    """Its view may miss blocks cached before the last resync (the replay did not reach 0)."""
    last_seq: int = -1


class KvEventSubscriber:
    def __init__(
        self,
        endpoint: str,
        sink: EventSink,
        *,
        bind: bool = True,
        replay_endpoints: Mapping[str, str] | None = None,
        instance_of: Callable[[bytes], str] | None = None,
        replay_timeout_s: float = 1.0,
        ranks: int = 0,
        rank_topic: Callable[[int, bytes], bytes] | None = None,
    ) -> None:
        """`replay_endpoints` maps an instance name to its replay ROUTER endpoint;
        `instance_of` names the instance a topic belongs to (default: the topic text);
        `ranks`, `rank_topic`: data-parallel ranks 1..ranks read too (the module's text)."""
        self._sink = sink
        self._replay_endpoints = dict(replay_endpoints or {})
        self._instance_of = instance_of or (lambda t: t.decode("utf-8", "replace"))
        self._replay_timeout_ms = int(replay_timeout_s * 1000)
        self._tracker = SequenceTracker()
        self._stats: dict[str, FeedStats] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._to_connect: list[tuple[int, str]] = []
        """(rank, endpoint) to connect that rank's socket to."""
        self._to_forget: list[bytes] = []
        self._last: dict[bytes, tuple[int, int, float]] = {}
        """Topic -> (seq, xxh3_64 of the payload, time.monotonic()) of the batch applied
        last: what a replay of that seq must show unless the publisher restarted."""
        self._ctx: zmq.Context = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        if bind:
            self.endpoint = bind_socket(self._sub, endpoint)
        else:
            self._sub.connect(endpoint)
            self.endpoint = endpoint
        self._rank_topic = rank_topic or _rank_topic
        self._subs = [self._sub]
        """Rank r's socket at index r (rank 0's is `_sub`)."""
        try:
            for r in range(1, ranks + 1):
                self._subs.append(self._rank_socket(offset_port(self.endpoint, r), bind))
        except (ConfigError, zmq.ZMQError):
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="kv-event-subscriber", daemon=True)

    def _rank_socket(self, endpoint: str, bind: bool) -> zmq.Socket:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            if bind:
                bind_socket(sock, endpoint)
            else:
                sock.connect(endpoint)
        except (ConfigError, zmq.ZMQError):
            sock.close()
            raise
        return sock

    def start(self) -> KvEventSubscriber:
        self._thread.start()
        return self

    def close(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        else:
            self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in self._subs:
            if not sock.closed:
                sock.close()

    def connect(self, endpoint: str) -> None:
        """Also read a publisher that binds its own endpoint (vLLM given `tcp://*:PORT`),
        and its ranks' at that port plus each rank; the subscriber's thread connects at its
        next turn. ConfigError for an endpoint whose port cannot be offset, with ranks."""
        ranked = [(r, offset_port(endpoint, r)) for r in range(len(self._subs))]
        with self._lock:
            self._to_connect.extend(ranked)

    def forget(self, topic: str) -> None:
        """The instance publishing under `topic` may have restarted (it left and came back):
        drop what the index holds for it now, and treat its next batch as a join (a replay
        from seq 0 where it keeps one), so blocks it no longer holds are not routed to."""
        self._sink.clear(self._instance_of(topic.encode()))
        with self._lock:
            self._to_forget.append(topic.encode())

    def set_replay_endpoint(self, instance: str, endpoint: str | None) -> None:
        with self._lock:
            if endpoint is None:
                self._replay_endpoints.pop(instance, None)
            else:
                self._replay_endpoints[instance] = endpoint

    def stats(self, instance: str) -> FeedStats:
        with self._lock:
            return FeedStats(**vars(self._stats.get(instance, FeedStats())))

    def instances(self) -> list[str]:
        with self._lock:
            return sorted(self._stats)

    # -- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        rank_of = {sock: rank for rank, sock in enumerate(self._subs)}
        for sock in self._subs:
            poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                with self._lock:
                    endpoints, self._to_connect = self._to_connect, []
                for rank, endpoint in endpoints:
                    self._subs[rank].connect(endpoint)
                for sock, _ in poller.poll(POLL_MS):
                    frames = sock.recv_multipart()
                    if frames:
                        frames[0] = self._rank_topic(rank_of[sock], frames[0])
                    self._on_message(frames)
        except Exception:
            log.exception("KV-event subscriber thread failed")
        finally:
            self._close_sockets()

    def _on_message(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            log.warning("ignored a KV-event message of %d frames", len(frames))
            return
        topic, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big")
        instance = self._instance_of(topic)
        with self._lock:  # (asked for before this batch came: it counts as a join)
            forgotten, self._to_forget = self._to_forget, []
        for gone in forgotten:
            self._tracker.forget(gone)
            self._last.pop(gone, None)
        seen = self._tracker.observe(topic, seq)
        verdict = seen.verdict
        if verdict is Verdict.GAP or (verdict is Verdict.IN_ORDER and self._quiet(topic)):
            if self._restarted(instance, topic):
                verdict = Verdict.RESTART
        if verdict in (Verdict.FIRST, Verdict.RESTART):
            self._resync(instance, topic, seq, f"{verdict.value} at seq {seq}")
        elif verdict is Verdict.GAP:
            self._fill_gap(instance, topic, seen.missing_from, seq)
        self._apply(instance, topic, seq, payload)

    def _quiet(self, topic: bytes) -> bool:
        last = self._last.get(topic)
        return last is not None and time.monotonic() - last[2] >= QUIET_S

    def _restarted(self, instance: str, topic: bytes) -> bool:
        """Whether the publisher's replay shows another batch at the seq applied last than
        the one applied (a new process counting again, whose first batches were lost while
        it connected, so its counter passed the old one's unnoticed); False when it cannot
        tell (no replay, or that batch no longer kept)."""
        last = self._last.get(topic)
        if last is None:
            return False
        frames, complete = self._fetch(instance, last[0], last[0] + 1)
        return complete and xxhash.xxh3_64_intdigest(frames[0][1]) != last[1]

    def _apply(self, instance: str, topic: bytes, seq: int, payload: bytes) -> bool:
        try:
            batch = decode_batch(payload)
        except RemoteProtocolError as exc:
            log.warning("KV events of %s: seq %d does not decode (%s); resyncing", instance, seq, exc)
            self._bump(instance, num_malformed=1)
            self._resync(instance, topic, seq + 1, "a malformed batch", replay=False)
            return False
        self._sink.apply(instance, batch)
        self._tracker.advance(topic, seq)
        self._last[topic] = (seq, xxhash.xxh3_64_intdigest(payload), time.monotonic())
        with self._lock:
            stats = self._stats.setdefault(instance, FeedStats())
            stats.num_batches += 1
            stats.last_seq = seq
        return True

    def _fill_gap(self, instance: str, topic: bytes, start: int, stop: int) -> None:
        self._bump(instance, num_gaps=1)
        frames, complete = self._fetch(instance, start, stop)
        if not complete:
            log.warning("KV events of %s: seqs %d..%d lost and not replayable; resyncing",
                        instance, start, stop - 1)
            self._resync(instance, topic, stop, "an unreplayable gap", replay=False)
        self._apply_replayed(instance, topic, frames)

    def _resync(self, instance: str, topic: bytes, stop: int, reason: str, replay: bool = True) -> None:
        """Clear `instance` and rebuild it from a replay of [0, stop) where one is kept."""
        self._sink.clear(instance)
        frames, complete = self._fetch(instance, 0, stop) if replay else ([], False)
        partial = not complete and stop > 0
        log.info("KV events of %s: resync (%s), %d batches replayed%s", instance, reason,
                 len(frames), ", view partial" if partial else "")
        self._bump(instance, num_resyncs=1)
        with self._lock:
            self._stats[instance].partial = partial
        self._apply_replayed(instance, topic, frames)

    def _apply_replayed(self, instance: str, topic: bytes, frames: list[tuple[int, bytes]]) -> None:
        for seq, payload in frames:
            if not self._apply(instance, topic, seq, payload):
                return
            self._bump(instance, num_replayed=1)

    def _fetch(self, instance: str, start: int, stop: int) -> tuple[list[tuple[int, bytes]], bool]:
        """Batches [start, stop) from the instance's replay socket: the contiguous run that
        ends at stop - 1, and whether it begins at `start`."""
        if start >= stop:
            return [], True
        with self._lock:
            endpoint = self._replay_endpoints.get(instance)
        if endpoint is None:
            return [], False
        got = fetch_replay(self._ctx, endpoint, start, self._replay_timeout_ms)
        wanted = [(s, p) for s, p in got if start <= s < stop]
        run: list[tuple[int, bytes]] = []
        for s, p in reversed(wanted):
            if s != stop - 1 - len(run):
                break
            run.append((s, p))
        run.reverse()
        return run, bool(run) and run[0][0] == start

    def _bump(self, instance: str, **deltas: int) -> None:
        with self._lock:
            stats = self._stats.setdefault(instance, FeedStats())
            for name, delta in deltas.items():
                setattr(stats, name, getattr(stats, name) + delta)


def _rank_topic(rank: int, topic: bytes) -> bytes:
    return topic + b"#dp%d" % rank if rank else topic


def offset_port(endpoint: str, rank: int) -> str:
    """Rank `rank`'s endpoint, as vLLM offsets a data-parallel rank's: a tcp port plus the
    rank, an inproc name with `_dpR` after it; ConfigError for another endpoint."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    head, sep, port = endpoint.rpartition(":")
    if not endpoint.startswith("tcp://") or not sep or not port.isdigit() or int(port) == 0:
        raise ConfigError(f"data-parallel ranks need a tcp://HOST:PORT (or inproc://) KV-event "
                          f"endpoint, not {endpoint!r}")
    return f"{head}:{int(port) + rank}"


def fetch_replay(ctx: zmq.Context, endpoint: str, start: int, timeout_ms: int) -> list[tuple[int, bytes]]:
    """Ask a replay ROUTER for every kept batch from `start` on; [] when it does not answer
    within `timeout_ms` (between two frames). Stops at the end marker. A batch comes as
    [b"", topic, seq, payload] (vLLM's publisher since it names the topic in replays, and
    kvpool's) or [b"", seq, payload] (earlier vLLM releases)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    out: list[tuple[int, bytes]] = []
    try:
        sock.connect(endpoint)
        sock.send_multipart((b"", start.to_bytes(8, "big")))
        while sock.poll(timeout_ms):
            frames = sock.recv_multipart()
            if len(frames) not in (3, 4) or len(frames[-2]) != 8:
                log.warning("malformed KV-event replay frame from %s (%d parts)", endpoint, len(frames))
                return out
            if frames[-2] == END_SEQ:
                return out
            out.append((int.from_bytes(frames[-2], "big"), frames[-1]))
        log.warning("KV-event replay from %s timed out after %d batches", endpoint, len(out))
        return out
    finally:
        sock.close()
