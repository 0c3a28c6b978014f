"""A KV-event publisher speaking vLLM's ZMQ protocol: PUB messages and a replay ROUTER.

    PUB message      [topic, seq (8 bytes big-endian, from 0), payload (codec.encode_batch)]
    replay request   ROUTER receives [client id, b"", start seq (8 bytes big-endian)]
    replay answer    [client id, b"", topic, seq, payload] for each kept batch with seq >= start,
                     then [client id, b"", b"", (-1 as 8 signed bytes), b""] as the end marker

The socket is an XPUB (a PUB to its subscribers) that also hears subscriptions: each new one
is answered with an empty batch, so a subscriber learns the current seq at once and replays
what it missed (ZMQ drops what a publisher sends before a subscription reaches it, and a
quiet publisher would otherwise leave a new subscriber unaware until its next event). vLLM's
own publisher does not do this; an empty batch is valid in its format.

Like vLLM, the PUB socket binds when the endpoint has a wildcard host ("*", "::") or is ipc://
or inproc://, and connects otherwise (the usual setup: the router binds, publishers connect);
`bind=` overrides. The replay socket always binds. The last `buffer_steps` batches are kept.

A thread owns both sockets. `publish(batch)` queues a batch; `submit(event)` queues one event,
and the events queued between two turns of the thread go out as one batch. Neither blocks
nor raises once the publisher runs (a full queue drops, counted in `num_dropped`). `close()`
sends what is queued, stops the thread and closes the sockets.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Any

import zmq

from kvpool.errors import ConfigError
from kvpool.kvevents.codec import Form, encode_batch
from kvpool.kvevents.events import EventBatch
from kvpool.log import get_logger

log = get_logger("kvevents.publisher")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
POLL_S = 0.02


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: wildcard hosts and ipc/inproc endpoints bind; the rest connect."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def bind_socket(sock: zmq.Socket, endpoint: str) -> str:
    """Bind `sock`; returns the endpoint actually bound (a tcp port 0 resolved)."""
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise ConfigError(f"cannot bind KV-event socket {endpoint}: {exc}") from None
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


class KvEventPublisher:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        form: Form = "map",
        bind: bool | None = None,
        max_queue: int = 100_000,
        data_parallel_rank: int | None = 0,
    ) -> None:
        if buffer_steps < 1 or max_queue < 1:
            raise ConfigError(f"buffer_steps and max_queue must be >= 1 ({buffer_steps}, {max_queue})")
        self._ctx: zmq.Context = zmq.Context.instance()
        self._topic = topic.encode()
        self._form: Form = form
        self._rank = data_parallel_rank
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_queue)
        self._next_seq = 0
        self._running = True
        self.num_dropped = 0
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.LINGER, 1000)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        if bind if bind is not None else is_bind_endpoint(endpoint):
            self.endpoint = bind_socket(self._pub, endpoint)
        else:
            self._pub.connect(endpoint)
            self.endpoint = endpoint
        self._replay: zmq.Socket | None = None
        self.replay_endpoint: str | None = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = bind_socket(self._replay, replay_endpoint)
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    @property
    def next_seq(self) -> int:
        """The seq the next batch will carry (read from another thread: approximate)."""
        return self._next_seq

    def publish(self, batch: EventBatch) -> None:
        self._put(batch)

    def submit(self, event: Any) -> None:
        self._put(("event", event))

    def flush(self, timeout_s: float = 2.0) -> bool:
        """Wait until everything queued so far has been sent; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline or not self._thread.is_alive():
                return False
            time.sleep(0.001)
        return True

    def close(self, timeout_s: float = 2.0) -> None:
        if not self._running:
            return
        self._running = False
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _put(self, item: Any) -> None:
        if not self._running:
            return
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.num_dropped += 1

    def _run(self) -> None:
        try:
            while True:
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                if self._pub.poll(0):
                    self._greet_subscribers()
                try:
                    item = self._queue.get(timeout=POLL_S)
                except queue.Empty:
                    continue
                if not self._send_queued(item):
                    break
        except Exception:  # the thread must not die silently
            log.exception("KV-event publisher thread failed")
        finally:
            self._pub.close()
            if self._replay is not None:
                self._replay.close()

    def _send_queued(self, item: Any) -> bool:
        """Send `item` and whatever else is queued now; False once the stop marker came."""
        events: list[Any] = []
        taken = 1
        while True:
            if item is None or isinstance(item, EventBatch):
                if events:
                    self._send(EventBatch(ts=time.time(), events=events, data_parallel_rank=self._rank))
                    events = []
                if item is None:
                    return False
                self._send(item)
            else:
                events.append(item[1])
            try:
                item = self._queue.get_nowait()
                taken += 1
            except queue.Empty:
                break
        if events:
            self._send(EventBatch(ts=time.time(), events=events, data_parallel_rank=self._rank))
        for _ in range(taken):
            self._queue.task_done()
        return True

    def _send(self, batch: EventBatch) -> None:
        payload = encode_batch(batch, self._form)
        seq = self._next_seq
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self._next_seq = seq + 1

    def _greet_subscribers(self) -> None:
        """Read the subscription messages waiting; one empty batch answers all new ones."""
        joined = False
        while self._pub.poll(0):
            joined |= self._pub.recv()[:1] == b"\x01"
        if joined:
            self._send(EventBatch(ts=time.time(), events=[], data_parallel_rank=self._rank))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("ignored a malformed KV-event replay request (%d frames)", len(frames))
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
