"""The one delivery path of ``plasmient ingest`` and live capture: local sinks at once, network sinks
behind one bounded batch processor that retries, spills to disk and never blocks its caller.

``Delivery.submit(batch)`` first writes the local sinks (the OTLP/JSON lines file, stderr, Parquet) in
the calling thread, so the file never waits for the network, then queues the batch for the network
sinks (OTLP traces, OTLP step metrics with trace exemplars). One background thread exports each
queued batch to each network sink through that sink's persistent client, whose retry loop
(:meth:`.otlp.OtlpClient.export`) is the only one: backoff with jitter, sane Retry-After, a deadline
per request, all cut short by ``shutdown``. A batch a sink cannot take is appended to the spill
directory (:mod:`.spill`) and the outage is reported once; while the sink stays down, batches go
straight to the spill, with one probe export every ``probe_interval_s``. A batch that does not fit
the bounded queue is spilled by the submitter (a local append). A backend that does not serve a
signal (a traces-only backend asked for metrics: UNIMPLEMENTED, HTTP 404/405) is no outage: that
sink is switched off, reported once with how to turn the signal off, and nothing is spilled for it.

The contract is the OpenTelemetry SDK's BatchSpanProcessor: ``force_flush(timeout)`` waits for what
is queued, ``shutdown(timeout)`` flushes within the timeout and then interrupts the exporter and
spills the rest, and a forked child starts with an empty queue and fresh clients (gRPC channels
must not cross a fork).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from plasmient_trace.conventions import SpanBatch
from plasmient_trace.export.sinks import os_problem
from plasmient_trace.export.spill import SpillDir, SpillFull

__all__ = ["Delivery", "DeliveryStats"]

Say = Callable[[str, str], None]  # (key, message): the caller prints each key once


@dataclass
class DeliveryStats:
    submitted_spans: int = 0
    sent: dict[str, int] = field(default_factory=dict)       # signal -> spans delivered
    requests: dict[str, int] = field(default_factory=dict)   # signal -> requests sent
    spilled: dict[str, int] = field(default_factory=dict)    # signal -> spans in the spill directory
    dropped: dict[str, int] = field(default_factory=dict)    # signal -> spans lost (spill full or off)
    errors: dict[str, str] = field(default_factory=dict)     # signal -> first export error
    unsupported: dict[str, str] = field(default_factory=dict)  # signal -> why the backend does not take it
    local_errors: int = 0                                    # failed local writes (live only)


def _stderr_once() -> Say:
    said: set[str] = set()

    def say(key: str, message: str) -> None:
        if key not in said:
            said.add(key)
            print(f"plasmient: {message}", file=sys.stderr, flush=True)

    return say


class Delivery:
    """Local sinks written at submit, network sinks behind one bounded queue and thread (module docstring)."""

    def __init__(self, local: list[Any] | None = None, remote: list[Any] | None = None, spill: SpillDir | None = None, *,
                 max_queue_spans: int = 2_000_000, max_queue_bytes: int = 512 << 20, probe_interval_s: float = 5.0,
                 say: Say | None = None, strict_local: bool = True, wait_when_full: bool = False) -> None:
        self.local = list(local or [])
        self.remote = list(remote or [])
        self.spill = spill
        self.max_queue_spans, self.max_queue_bytes = max_queue_spans, max_queue_bytes
        self.probe_interval_s = probe_interval_s
        self.say = say or _stderr_once()
        # strict (ingest): a local sink's OutputError propagates. Not strict (live): it is reported
        # once per sink and counted, and the other sinks still get the batch.
        self.strict_local = strict_local
        # Ingest waits for room in a full queue (the input can wait; memory stays bounded). Live never waits:
        # what does not fit is spilled, the job goes on.
        self.wait_when_full = wait_when_full
        self.stats = DeliveryStats()
        self._down: dict[tuple[str, str], float] = {}  # (sink name, signal) -> when its last probe failed
        self._init_state()
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (d := ref()) is not None and d._after_fork())

    def _init_state(self) -> None:
        self._cond = threading.Condition()
        self._queue: deque[SpanBatch] = deque()
        self._queued_spans = 0
        self._queued_bytes = 0
        self._busy = False
        self._closed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _after_fork(self) -> None:
        # A forked child (DataLoader worker, multiprocessing) inherits neither the thread nor usable
        # channels; what the parent had queued is the parent's to deliver.
        self._init_state()
        for sink in self.remote:
            sink.reset()

    # ---- producer side -------------------------------------------------------------------------

    def submit(self, batch: SpanBatch) -> None:
        """Write the local sinks now (OutputError propagates: the caller decides how to report),
        then queue the batch for the network sinks without waiting on them."""
        if self._closed:
            raise RuntimeError("Delivery is shut down")
        if len(batch) == 0:
            return
        self.stats.submitted_spans += len(batch)
        for sink in self.local:
            if self.strict_local:
                sink.write(batch)
                continue
            try:
                sink.write(batch)
            except Exception as err:  # noqa: BLE001 - live: no sink may break the job or the others
                self.stats.local_errors += 1
                self.say(f"local-{sink.name}", f"export to {sink.name} failed ({type(err).__name__}: {err}); "
                                               "the job continues, later steps are still attempted")
        if not self.remote:
            return
        nbytes = batch.table.nbytes
        with self._cond:
            def room() -> bool:
                return not self._queue or (self._queued_spans + len(batch) <= self.max_queue_spans
                                           and self._queued_bytes + nbytes <= self.max_queue_bytes)

            if self.wait_when_full:
                # the processor thread notifies as it takes each batch; every export has its deadline
                self._cond.wait_for(lambda: room() or self._closed)
            fits = room()
            if fits:
                self._queue.append(batch)
                self._queued_spans += len(batch)
                self._queued_bytes += nbytes
                self._ensure_thread()
                self._cond.notify_all()
        if not fits:
            self.say("queue-full", "the export queue is full (the collector is slower than the job): "
                                   f"later batches go to {self._spill_where()}")
            for sink in self.remote:
                self._spill(sink, batch, "export queue full")

    def close_local(self, commit: bool = True) -> None:
        """Finish the local sinks that write a file in parts (ingest's FileSink): move it into place, or
        remove it when ``commit`` is False (the input failed half-way: no partial file)."""
        for sink in self.local:
            close = getattr(sink, "close", None)
            if close is not None:
                close(commit=commit)

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="plasmient-delivery", daemon=True)
            self._thread.start()

    # ---- the processor thread ------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                batch = self._queue.popleft()
                self._busy = True
            try:
                for sink in self.remote:
                    self._export(sink, batch)
            finally:
                with self._cond:
                    self._queued_spans -= len(batch)
                    self._queued_bytes -= batch.table.nbytes
                    self._busy = False
                    self._cond.notify_all()

    def _export(self, sink: Any, batch: SpanBatch) -> None:
        from plasmient_trace.export.otlp import ExportError, UnsupportedSignal, redact

        if sink.signal in self.stats.unsupported:
            return
        if self._stop.is_set():
            self._spill(sink, batch, "shut down before it was sent")
            return
        # Keyed by signal too: over gRPC both signals share one endpoint name, and metrics the
        # backend refuses must not send the traces to the spill.
        key = (sink.name, sink.signal)
        # A collector that no server answers for is down for every signal sent to it: the metrics of a batch
        # whose traces found it refused go to the spill at once, not through a retry loop of their own.
        collector = getattr(sink, "collector", None)
        down = max((t for t in (self._down.get(key), self._down.get(collector)) if t is not None), default=None)
        if down is not None and time.monotonic() - down < self.probe_interval_s:
            self._spill(sink, batch, "collector down")
            return
        try:
            # while it is down, each probe is one attempt: a batch that finds it still down costs one request,
            # not another full retry loop (ingest of a long trace took 12 s a batch against a refused port)
            result = sink.export(batch, self._stop, probe=down is not None)
        except UnsupportedSignal as err:
            self.stats.unsupported[sink.signal] = str(err)
            off = {"metrics": "OTEL_METRICS_EXPORTER=none", "traces": "OTEL_TRACES_EXPORTER=none"}.get(sink.signal, "")
            self.say(f"unsupported-{sink.signal}", f"{sink.name} takes no {sink.signal} ({err}); "
                                                   f"{sink.signal} are not sent (set {off} to stop trying)")
            return
        except Exception as err:  # an ExportError, or a bug of ours or a library's: never the thread's end
            if not isinstance(err, (ExportError, OSError, ValueError)):
                # what a library put in its message may quote a URL or a header: redacted as ours are
                text = redact(f"export to {sink.name} failed for {sink.signal}: {type(err).__name__}: {err}",
                              getattr(sink, "config", None))
                err = ExportError(text)
            outage_known = bool(self._down)
            self._down[key] = time.monotonic()
            if getattr(err, "retried_out", False) and collector is not None:
                # down or busy past the budget: its other signal would spend the budget again (an ingest
                # against an always-busy collector took 35 s of a 20 s budget, traces then metrics)
                self._down[collector] = self._down[key]
            self.stats.errors.setdefault(sink.signal, str(err))
            hint = f" (resend them with `plasmient replay {self.spill.path}`)" if self.spill is not None else ""
            if not outage_known:  # one line for the whole outage, whichever signal notices it first
                self.say("down", f"{err}; {self._remote_signals()} go to {self._spill_where()} until it answers{hint}")
            unsent = getattr(err, "unsent", None)
            if unsent is not None and len(unsent) < len(batch):
                # the traces the collector took before it failed are not spilled: replayed, they came twice
                self.stats.sent[sink.signal] = self.stats.sent.get(sink.signal, 0) + len(batch) - len(unsent)
                batch = unsent
            self._count_requests(sink.signal, getattr(err, "requests", 0))
            self._spill(sink, batch, str(err))
            return
        if down is not None:
            self._down.pop(key, None)
            self._down.pop(collector, None)
            self.say("up", f"{sink.name} answers again; what is spilled stays for `plasmient replay`")
        self.stats.sent[sink.signal] = self.stats.sent.get(sink.signal, 0) + len(batch)
        self._count_requests(sink.signal, getattr(result, "requests", 0))

    def _count_requests(self, signal: str, requests: Any) -> None:
        self.stats.requests[signal] = self.stats.requests.get(signal, 0) + int(requests or 0)

    def _remote_signals(self) -> str:
        """The signals sent to collectors, in words ("traces and metrics")."""
        return " and ".join(dict.fromkeys(s.signal for s in self.remote))

    def _spill_where(self) -> str:
        return f"the spill directory {self.spill.path}" if self.spill is not None else "nowhere (spilling is off): they are dropped"

    def _spill(self, sink: Any, batch: SpanBatch, why: str) -> None:
        from plasmient_trace.export.otlp_json import encode_jsonl_lines

        signal = sink.signal
        if self.spill is not None:
            try:
                self.spill.append(signal, list(encode_jsonl_lines(batch)))
                self.stats.spilled[signal] = self.stats.spilled.get(signal, 0) + len(batch)
                return
            except SpillFull as err:
                # one line for every signal sent: whichever fills it first, the others find it full too
                self.say("spill-full", f"{err}: further {self._remote_signals() or signal} are dropped")
            except OSError as err:
                self.say("spill-error", f"cannot spill to {self.spill.path} ({os_problem(err)}): {signal} are dropped")
        self.stats.dropped[signal] = self.stats.dropped.get(signal, 0) + len(batch)

    # ---- flush and shutdown --------------------------------------------------------------------

    def force_flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued batch was exported or spilled; False when ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def shutdown(self, timeout: float | None = None) -> DeliveryStats:
        """Flush for at most ``timeout`` seconds (None: until done), then interrupt the exporter and
        spill what is still queued; idempotent. Returns the stats."""
        if self._closed:
            return self.stats
        flushed = self.force_flush(timeout)
        with self._cond:
            self._closed = True
            if not flushed:
                self._stop.set()  # ends a backoff wait or an in-flight request at once
            left = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(2.0)
        for batch in left:
            for sink in self.remote:
                self._spill(sink, batch, "shut down before it was sent")
        for sink in self.remote:
            sink.close()
        return self.stats
