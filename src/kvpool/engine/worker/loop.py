"""The engine's own thread: it alone touches the EngineCore. Other threads (the HTTP server's
event loop) hand it functions with `call` and hear about their requests through `subscribe`:
a listener gets each step's outputs of its request as one list, and `on_step` runs once after
every step's outputs are handed out (engine/worker/mailbox.py wakes the event loop there)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from kvpool.engine.core import EngineCore, StepOutput
from kvpool.errors import ShuttingDown
from kvpool.log import get_logger
from kvpool.thread_name import name_os_thread

log = get_logger("engine.loop")
Listener = Callable[[list[StepOutput]], None]
ENGINE_THREAD = "kvpool-engine"
"""The engine thread's name, in Python and in the OS (a benchmark charges its CPU apart)."""


class EngineLoop:
    def __init__(self, engine: EngineCore, idle_tick_s: float = 0.5,
                 on_idle: Callable[[], None] | None = None,
                 on_step: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self._commands: queue.Queue[tuple[Callable[[EngineCore], Any], Future[Any]]] = queue.Queue()
        self._listeners: dict[str, Listener] = {}
        self._idle_tick_s, self._on_idle, self._on_step = idle_tick_s, on_idle, on_step
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=ENGINE_THREAD)

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._commands.put((lambda e: None, Future()))
        self._thread.join(timeout=10)

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def call(self, fn: Callable[[EngineCore], Any]) -> Future[Any]:
        """Run `fn(engine)` on the engine thread between steps; its result or exception comes
        back through the future."""
        future: Future[Any] = Future()
        if self._stop.is_set():
            future.set_exception(ShuttingDown("the worker is shutting down"))
        else:
            self._commands.put((fn, future))
        return future

    def subscribe(self, request_id: str, listener: Listener) -> None:
        """Called on the engine thread (from inside `call`) before the request is added."""
        self._listeners[request_id] = listener

    def unsubscribe(self, request_id: str) -> None:
        self._listeners.pop(request_id, None)

    def _run(self) -> None:
        name_os_thread(ENGINE_THREAD)
        while not self._stop.is_set():
            self._drain(block=not self.engine.has_work)
            if self.engine.has_work:
                try:
                    with self.engine.state_lock:
                        outputs = self.engine.step()
                except Exception:
                    log.exception("engine step failed; aborting every request")
                    outputs = self._abort_all()
                self._dispatch(outputs)

    def _drain(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=self._idle_tick_s) if block else self._commands.get_nowait()
        except queue.Empty:
            if self._on_idle is not None:
                self._on_idle()
            return
        while True:
            fn, future = item
            if future.set_running_or_notify_cancel():
                try:
                    with self.engine.state_lock:
                        result = fn(self.engine)
                    future.set_result(result)
                except Exception as exc:
                    future.set_exception(exc)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                break
        if self._on_idle is not None:
            self._on_idle()

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        """Each request's outputs of the step, in order, to its listener in one call."""
        mine: dict[str, list[StepOutput]] = {}
        for out in outputs:  # once per token: no setdefault's list made for every output
            outs = mine.get(out.request_id)
            if outs is None:
                mine[out.request_id] = [out]
            else:
                outs.append(out)
        listeners = self._listeners
        for request_id, outs in mine.items():
            listener = listeners.get(request_id)
            if listener is not None:
                listener(outs)
            for o in outs:
                if o.finish_reason is not None or o.error is not None:
                    listeners.pop(request_id, None)
                    break
        if self._on_step is not None:
            self._on_step()

    def _abort_all(self) -> list[StepOutput]:
        for seq in [*self.engine.scheduler.running, *self.engine.scheduler.waiting]:
            self.engine.abort(seq.request_id, "engine step failed")
        return self.engine.step() if self.engine.has_work else []
