"""The engine loop on rank 0's main thread, and the thread-safe door the HTTP side uses to reach it.

HTTP handlers (uvicorn's thread) `submit` a request's choices with a sink for their events and `abort` them when
the client goes away; they never touch the engine. The main thread takes what came in at the top of every window,
runs the window (`engine.run_window()`, which sends it to every rank), and hands each event to its request's sink.
Idle, it waits for the next request and sends a heartbeat record at least every `heartbeat_s`. A signal starts the
drain: no new requests, in-flight ones may finish for `serve.drain_s`, then the ranks are told to stop. A failure
anywhere in a window fails every request still in flight before it ends the process.
"""

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..engine.engine import Engine
from ..engine.sampling import BadValue
from ..engine.sequences import Event, Prompt
from .errors import APIError, bad
from .metrics import Metrics
from .protocol import raise_unavailable
from .schema import HTTP_NAMES
from .worker_info import DecodeRate, Load

STALE_S = 60.0  # /health turns 503 when the loop has not come round for this long (a window that hangs)


@dataclass(frozen=True)
class Failure:
    """What a request's sink gets instead of its events when the engine died or the server stopped first."""

    message: str
    status: int = 500

    def error(self) -> APIError:
        return APIError(self.status, self.message, code="engine_failed" if self.status == 500 else "unavailable")


@dataclass
class _Tracked:
    sink: Callable
    arrived: float
    first: float | None = None
    last: float = 0.0


class EngineLoop:
    def __init__(self, engine: Engine, metrics: Metrics, max_waiting: int, drain_s: float, kv_events=None):
        """`kv_events`: a KV-event publisher (kv_events.py) told after every window what its snapshots changed."""
        self.engine, self.metrics, self.kv_events = engine, metrics, kv_events
        self.max_waiting, self.drain_s = max_waiting, drain_s
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._queued = 0  # prompts submitted, not yet handed to the engine
        self._active = 0  # HTTP responses still being written
        self._tracked: dict[str, _Tracked] = {}  # main thread only
        self.state = "serving"  # serving -> draining -> stopped, or dead
        self.failure: str | None = None
        self.last_tick = time.monotonic()
        self._drain_at: float | None = None
        self.signum: int | None = None
        self.load = Load(slots=engine.cache.batch, cap=engine.cache.cap)  # /v1/loads: made here, read by HTTP
        self._rate, self._prompted = DecodeRate(), 0  # the decode steps' rate; prompt tokens handed to the engine

    # ------------------------------------------------------------------ any thread

    def submit(self, prompts: list[Prompt], sink: Callable, arrived: float) -> None:
        """Queue a request's choices; refused with a 503 when draining, dead or the waiting queue is full, and with a
        400 when it has more choices than the slots and the queue together hold (no retry would ever get it in)."""
        for p in prompts:  # the engine's own check, on this side: a slip of the front is a 400, never a dead window
            try:
                self.engine.check(p)
            except BadValue as exc:
                raise bad(f"{exc}", HTTP_NAMES.get(exc.field, exc.field)) from None
        room = self.max_waiting + self.engine.cache.batch
        if len(prompts) > room:
            raise bad(
                f"n={len(prompts)} choices can never be queued: the slots and the queue hold {room} "
                f"(generate.batch={self.engine.cache.batch} + serve.max_waiting={self.max_waiting})",
                "n",
            )
        with self._lock:
            if self.state != "serving":
                raise_unavailable("the server is shutting down" if self.state != "dead" else f"{self.failure}")
            waiting = self._queued + len(self.engine.waiting)
            if waiting + len(prompts) > self.max_waiting + len(self.engine.free):
                raise_unavailable(f"{waiting} requests are waiting (serve.max_waiting={self.max_waiting})")
            self._queued += len(prompts)
            self._inbox.put(("add", prompts, sink, arrived))
        self._wake.set()

    def abort(self, ids: list[str]) -> None:
        self._inbox.put(("abort", ids))
        self._wake.set()

    def drain(self, signum: int) -> None:
        """A signal: stop taking requests; in-flight ones get `drain_s` to finish."""
        with self._lock:
            if self.state == "serving":
                self.state, self.signum = "draining", signum
                self._drain_at = time.monotonic() + self.drain_s
        self._wake.set()

    @property
    def healthy(self) -> bool:
        return self.state == "serving" and time.monotonic() - self.last_tick < STALE_S

    def responding(self, delta: int) -> None:
        """The HTTP side counts the responses it is still writing, so the process ends only after they are sent."""
        with self._lock:
            self._active += delta

    def flushed(self, timeout_s: float = 3.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self._active > 0 and time.monotonic() < deadline:
            time.sleep(0.02)

    # ------------------------------------------------------------------ the main thread

    def run(self) -> int:
        """Serve until a signal's drain is over; returns the exit code (128 + the signal). A failure in a window fails
        every request in flight and is raised again."""
        try:
            while True:
                self._take_inbox()
                if self.state == "draining" and (not self.engine.busy or time.monotonic() > self._drain_at):
                    break
                if self.engine.busy:
                    events = self.engine.run_window()
                    self._gauges()  # before any answer leaves: whoever has the answer sees it in /metrics too
                    if self.kv_events is not None:  # and a router hears of the window's snapshots
                        self.kv_events.flush()
                    self._dispatch(events)
                elif not self._wake.wait(self.engine.channel.heartbeat_s):
                    self.engine.heartbeat()
                    if self.kv_events is not None:  # a subscriber that joined while idle gets the state now
                        self.kv_events.flush()
                self._wake.clear()
                self.last_tick = time.monotonic()
                self._gauges()
            self._fail_all("the server shut down before the request finished", status=503)
            self.engine.shutdown(128 + self.signum)
            self.state = "stopped"
            return 128 + self.signum
        except BaseException as exc:
            self.state, self.failure = "dead", f"the engine failed: {type(exc).__name__}: {exc}"
            self._fail_all(self.failure)
            raise

    def _take_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item[0] == "add":
                _, prompts, sink, arrived = item
                with self._lock:
                    self._queued -= len(prompts)
                for p in prompts:
                    self._tracked[p.id] = _Tracked(sink, arrived)
                    self.engine.add(p)
                    self.metrics.prompt_tokens.inc(len(p.ids))
                    self._prompted += len(p.ids)
            else:
                for request_id in item[1]:
                    self.engine.abort(request_id)

    def _dispatch(self, events: list[Event]) -> None:
        now, m = time.monotonic(), self.metrics
        for ev in events:
            t = self._tracked.get(ev.id)
            if t is None:
                continue
            if ev.tokens:
                m.generation_tokens.inc(len(ev.tokens))
                if t.first is None:
                    t.first = now
                    m.ttft.observe(now - t.arrived)
                else:  # a window's tokens arrive together: its time is split among them
                    gap = (now - t.last) / len(ev.tokens)
                    for _ in ev.tokens:
                        m.itl.observe(gap)
                t.last = now
            if ev.finished:
                del self._tracked[ev.id]
                m.requests.labels(ev.finish_reason).inc()
                m.e2e.observe(now - t.arrived)
            if ev.finish_reason != "abort":
                t.sink(ev)

    def _gauges(self) -> None:
        filling = self.engine.admission.filling
        live = len(self.engine.live) + (filling is not None and filling.prompt is not None)
        self.metrics.running.set(live)
        self.metrics.slots_used.set(live)
        self.metrics.prefill_pending.set(self.engine.admission.pending_tokens)
        self.metrics.waiting.set(len(self.engine.waiting) + self._queued)
        self.metrics.prefix_report(self.engine.prefix.report() if self.engine.prefix else None)
        self.metrics.prefill_seconds.set(self.engine.timings.prefill_seconds)
        self.metrics.decode_seconds.set(self.engine.timings.decode_seconds)
        self.metrics.memory_report(self.engine.watch)
        self._rate.update(self.engine.timings.decode_tokens, self.engine.timings.decode_seconds)
        self.load = Load.of(self.engine, self._queued, self._rate.per_s(), self._prompted)

    def _fail_all(self, message: str, status: int = 500) -> None:
        """Every request still in flight (queued, waiting or in a slot) gets `message` instead of its end."""
        with self._lock:
            if self.state == "serving":
                self.state = "draining"
        self._take_inbox()
        failure = Failure(message, status)
        for request_id, t in list(self._tracked.items()):
            self.engine.abort(request_id)
            t.sink(failure)
        self._tracked.clear()
        self._gauges()
