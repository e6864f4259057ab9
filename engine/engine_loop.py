"""Runs an LLMEngine on one thread; other threads reach it only through call().

The engine is not thread-safe. Workers and servers (HTTP handlers, Ray actor methods, KV
receivers) hand closures to `call()`, which the loop thread runs between steps, and get
each request's outputs through a sink callback invoked on the loop thread.
"""
from __future__ import annotations

import contextlib
import logging
import queue
import threading
import traceback
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput

T = TypeVar("T")
Sink = Callable[[RequestOutput | BaseException], None]
log = logging.getLogger(__name__)


class EngineDied(RuntimeError):
    """The loop stopped on an exception in a step that is no one request's (the model's forward
    over the whole batch, the loop's own bookkeeping): every request it held failed with this, and
    so does every later call. Callers treat it as a dead worker (the router migrates the request)."""


class RequestFailed(RuntimeError):
    """One request failed in a step (an exception in its own scheduling, prefix matching, inputs,
    sampling, stop checks, detokenizing, or its own sink); the engine goes on. The message is
    safe to show a client: a log id, no internal text."""


class EngineLoop:
    def __init__(self, engine: LLMEngine, name: str = "engine-loop"):
        self.engine = engine
        self.error: BaseException | None = None  # set when a step failed: the engine is dead
        self._inbox: queue.Queue[tuple[Callable, Future]] = queue.Queue()
        self._sinks: dict[str, Sink] = {}  # loop thread only
        self._fault: Exception | None = None  # fail_next_step(): raised by the next step
        self._dying = threading.Lock()  # call() never queues after the loop stopped taking calls
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def health(self) -> dict:
        """What a worker reports to the router's health check."""
        return {"role": self.engine.config.role.value, "alive": self.alive,
                "error": repr(self.error) if self.error else None}

    def call(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        """Run fn(engine) on the loop thread before its next step."""
        fut: Future[T] = Future()
        with self._dying:
            if self.error is not None:
                fut.set_exception(self._died())
            else:
                self._inbox.put((fn, fut))
        return fut

    def fail_next_step(self, exc: Exception) -> None:
        """Chaos tests only (worker/faults.py): the next step raises `exc`, even with nothing to
        run, so the engine dies by the same path as a real failed step."""
        self._fault = exc

    def watch_now(self, request_id: str, sink: Sink) -> None:
        """Deliver a request's outputs to `sink` until it finishes or its KV is ready. For code
        already running on the loop thread (inside a call())."""
        self._sinks[request_id] = sink

    def unwatch_now(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)

    def add_request(self, request_id: str, prompt, params, sink: Sink, cache_salt: str | None = None, *,
                    checked: bool = False) -> Future[None]:
        """Queue a request (LLMEngine.add_request; `checked` as there); its outputs go to `sink`."""
        def add(engine: LLMEngine) -> None:
            engine.add_request(request_id, prompt, params, cache_salt, checked=checked)
            self._sinks[request_id] = sink
        return self.call(add)

    def abort(self, request_id: str) -> Future:
        def abort(engine: LLMEngine):
            self._sinks.pop(request_id, None)
            return engine.abort(request_id)
        return self.call(abort)

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # a bug in the loop itself: its callers must not wait forever
            self._die(exc)
        if self.error is not None:  # calls queued before the failure would otherwise wait forever
            while not self._inbox.empty():
                _, fut = self._inbox.get_nowait()
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(self._died())

    def _serve(self) -> None:
        while not self._stop.is_set():
            idle = not self.engine.has_runnable()
            try:
                fn, fut = self._inbox.get(timeout=0.05) if idle else self._inbox.get_nowait()
                self._run_call(fn, fut)
                while True:
                    self._run_call(*self._inbox.get_nowait())
            except queue.Empty:
                pass
            if self.engine.has_runnable() or self._fault is not None:
                self._step()

    def _run_call(self, fn: Callable, fut: Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            result = fn(self.engine)
        except BaseException as exc:  # handed to the caller; the loop goes on
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    def _step(self) -> None:
        try:
            if self._fault is not None:
                fault, self._fault = self._fault, None
                raise fault
            outputs = self.engine.step()
        except Exception as exc:  # fail every in-flight request rather than hang its caller
            self._die(exc)
            return
        for out in outputs:
            done = out.finished or out.kv_ready
            sink = self._sinks.pop(out.request_id, None) if done else self._sinks.get(out.request_id)
            if sink is not None:
                self._deliver(out, sink)

    def _deliver(self, out: RequestOutput, sink: Sink) -> None:
        """Hand one output to its sink. A sink that raises fails its own request (aborted here,
        its caller told once more with RequestFailed), never the loop."""
        try:
            sink(RequestFailed(out.error) if out.error else out)
        except Exception as exc:
            log_id = uuid.uuid4().hex[:12]
            log.error("the sink of request %s failed (log id %s)", out.request_id, log_id, exc_info=exc)
            self._sinks.pop(out.request_id, None)
            self.engine.abort(out.request_id)
            with contextlib.suppress(Exception):
                sink(RequestFailed(f"the request failed in its worker; log id {log_id}"))

    def _die(self, exc: BaseException) -> None:
        traceback.print_exception(exc)
        with self._dying:
            self.error = exc
        sinks, self._sinks = list(self._sinks.values()), {}
        for sink in sinks:
            with contextlib.suppress(Exception):  # one broken sink must not keep the others waiting
                sink(self._died())
        self._stop.set()

    def _died(self) -> EngineDied:
        died = EngineDied(f"engine failed: {self.error!r}")
        died.__cause__ = self.error
        return died
