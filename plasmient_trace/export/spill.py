"""Export that never blocks the job and never loses spans: bounded queue, retry, spill file, replay.

``SpillingExporter.submit(batch)`` only enqueues (O(1), no network). A background thread sends each
batch with the trace exporter (:func:`.otlp.send_spans`), retrying transient failures with
exponential backoff and jitter. When a batch still fails, the collector is considered down: that
batch and everything queued behind it are appended to a spill file as OTLP/JSON lines (the
Collector file-exporter format, one line per trace), and while it stays down new batches go
straight to the spill file, with one probe send every ``probe_interval_s`` to notice recovery.

Bounds: the queue holds at most ``max_queue_spans`` spans and ``max_queue_bytes`` of Arrow
memory; a batch that does not fit is spilled by the submitting thread (a local append, no network
wait), so memory stays bounded even when the disk is the only place left. The spill file is
rotated when it reaches ``spill_max_bytes`` (``spill.jsonl`` -> ``spill.jsonl.1``, ``.2``, ...);
rotated files are kept (``max_spill_files`` bounds them, counting what is dropped).

``replay(spill_path, config)`` resends every spill file, oldest first, line by line, and rewrites
each file to hold only the lines not yet delivered (atomically: write a temporary file, then
rename), deleting it when empty: a replay interrupted half-way resumes where it stopped. A line
delivered just before a crash may be delivered again; span and trace ids are deterministic, so the
backend sees the same span twice, not two different spans. ``plasmient replay SPILL`` runs it.
"""

from __future__ import annotations

import argparse
import os
import queue
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from plasmient_trace.conventions import SpanBatch
from plasmient_trace.export.otlp_json import batch_from_otlp_dicts, encode_jsonl_lines

__all__ = ["SpillingExporter", "SpillStats", "replay", "spill_files", "register"]

DEFAULT_SPILL_MAX_BYTES = 256 * 1024 * 1024


@dataclass
class SpillStats:
    submitted_spans: int = 0
    sent_spans: int = 0
    spilled_spans: int = 0
    dropped_spans: int = 0       # only when max_spill_files forced an old spill file out
    send_failures: int = 0
    spill_rotations: int = 0
    last_error: str | None = None


def spill_files(spill_path: str | os.PathLike[str]) -> list[Path]:
    """The spill file and its rotations, oldest first (highest suffix first, the live file last)."""
    path = Path(spill_path)
    rotated = []
    for p in path.parent.glob(path.name + ".*"):
        suffix = p.name[len(path.name) + 1 :]
        if suffix.isdigit():
            rotated.append((int(suffix), p))
    out = [p for _, p in sorted(rotated, reverse=True)]
    if path.exists():
        out.append(path)
    return out


class _SpillWriter:
    """Appends OTLP/JSON lines to the spill file, rotating at a size cap; thread-safe."""

    def __init__(self, path: Path, max_bytes: int, max_files: int | None, stats: SpillStats) -> None:
        self.path, self.max_bytes, self.max_files, self.stats = path, max_bytes, max_files, stats
        self.lock = threading.Lock()

    def write(self, batch: SpanBatch) -> None:
        lines = list(encode_jsonl_lines(batch))
        with self.lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            f = open(self.path, "ab")  # noqa: SIM115 - reopened after a rotation
            try:
                for line in lines:
                    if not line.endswith(b"\n"):
                        line += b"\n"
                    if f.tell() > 0 and f.tell() + len(line) > self.max_bytes:
                        f.close()
                        self._rotate()
                        f = open(self.path, "ab")  # noqa: SIM115
                    f.write(line)
                f.flush()
                os.fsync(f.fileno())
            finally:
                f.close()
            self.stats.spilled_spans += len(batch)

    def _rotate(self) -> None:
        existing = sorted((int(p.name.rsplit(".", 1)[1]), p) for p in spill_files(self.path) if p != self.path)
        for n, p in reversed(existing):
            if self.max_files is not None and n + 1 > self.max_files:
                self.stats.dropped_spans += _count_spans(p)
                p.unlink()
            else:
                p.rename(p.with_name(f"{self.path.name}.{n + 1}"))
        self.path.rename(self.path.with_name(self.path.name + ".1"))
        self.stats.spill_rotations += 1


def _count_spans(path: Path) -> int:
    n = 0
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                n += len(batch_from_otlp_dicts([orjson.loads(line)]))
    return n


def _default_send(config: Any) -> Callable[[SpanBatch], Any]:
    from plasmient_trace.export import otlp

    return lambda batch: otlp.send_spans(batch, config)


class SpillingExporter:
    """Non-blocking span export with a bounded queue, retries, and a spill file (see module docstring)."""

    def __init__(
        self,
        config: Any = None,
        spill_path: str | os.PathLike[str] = "plasmient-spill.jsonl",
        *,
        send: Callable[[SpanBatch], Any] | None = None,
        max_queue_spans: int = 1_000_000,
        max_queue_bytes: int = 512 * 1024 * 1024,
        max_attempts: int = 4,
        initial_backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
        probe_interval_s: float = 5.0,
        spill_max_bytes: int = DEFAULT_SPILL_MAX_BYTES,
        max_spill_files: int | None = None,
    ) -> None:
        self.config = config
        self.spill_path = Path(spill_path)
        self._send = send or _default_send(config)
        self.max_queue_spans, self.max_queue_bytes = max_queue_spans, max_queue_bytes
        self.max_attempts = max(1, max_attempts)
        self.initial_backoff_s, self.max_backoff_s = initial_backoff_s, max_backoff_s
        self.probe_interval_s = probe_interval_s
        self.stats = SpillStats()
        self._writer = _SpillWriter(self.spill_path, spill_max_bytes, max_spill_files, self.stats)
        self._queue: queue.Queue[SpanBatch | None] = queue.Queue()
        self._lock = threading.Lock()
        self._queued_spans = 0
        self._queued_bytes = 0
        self._down_since: float | None = None
        self._last_probe = 0.0
        self._closed = False
        self._idle = threading.Event()
        self._idle.set()
        self._stop = threading.Event()  # wakes backoff sleeps on close
        self._thread = threading.Thread(target=self._run, name="plasmient-export", daemon=True)
        self._thread.start()

    # ---- producer side
    def submit(self, batch: SpanBatch) -> bool:
        """Queue a batch for export; returns False when it went straight to the spill file. Never waits on the network."""
        if self._closed:
            raise RuntimeError("SpillingExporter is closed")
        n, nbytes = len(batch), batch.table.nbytes
        if n == 0:
            return True
        with self._lock:
            self.stats.submitted_spans += n
            fits = (self._queued_spans + n <= self.max_queue_spans and self._queued_bytes + nbytes <= self.max_queue_bytes) \
                or self._queued_spans == 0
            if fits:
                self._queued_spans += n
                self._queued_bytes += nbytes
                self._idle.clear()
        if not fits:
            self._writer.write(batch)
            return False
        self._queue.put(batch)
        return True

    @property
    def queued_spans(self) -> int:
        return self._queued_spans

    @property
    def collector_down(self) -> bool:
        return self._down_since is not None

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued batch was sent or spilled; False on timeout."""
        return self._idle.wait(timeout)

    def close(self, timeout: float | None = 30.0) -> SpillStats:
        """Stop accepting batches, drain the queue (sending or spilling) and stop the thread."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join(timeout)
            if self._thread.is_alive():
                # The sender is stuck past the timeout: spill what is still queued so nothing is lost.
                self._stop.set()
                self._thread.join(5.0)
        return self.stats

    def __enter__(self) -> SpillingExporter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- sender thread
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._mark_idle()
                return
            try:
                self._handle(item)
            except Exception as err:  # noqa: BLE001 - the thread must survive anything
                self.stats.last_error = f"{type(err).__name__}: {err}"
                self._writer.write(item)
            finally:
                with self._lock:
                    self._queued_spans -= len(item)
                    self._queued_bytes -= item.table.nbytes
                self._mark_idle()

    def _mark_idle(self) -> None:
        with self._lock:
            if self._queued_spans == 0 and self._queue.empty():
                self._idle.set()

    def _handle(self, batch: SpanBatch) -> None:
        if self._stop.is_set():
            self._writer.write(batch)
            return
        if self._down_since is not None:
            now = time.monotonic()
            if now - self._last_probe < self.probe_interval_s:
                self._writer.write(batch)
                return
            self._last_probe = now
            attempts = 1  # a probe: one try, the collector has been failing
        else:
            attempts = self.max_attempts
        if self._try_send(batch, attempts):
            self.stats.sent_spans += len(batch)
            self._down_since = None
        else:
            if self._down_since is None:
                self._down_since = time.monotonic()
                self._last_probe = self._down_since
            self._writer.write(batch)

    def _try_send(self, batch: SpanBatch, attempts: int) -> bool:
        delay = self.initial_backoff_s
        for attempt in range(attempts):
            try:
                self._send(batch)
                return True
            except Exception as err:  # noqa: BLE001 - any failure: retry, then spill
                self.stats.send_failures += 1
                self.stats.last_error = f"{type(err).__name__}: {err}"
            if attempt + 1 < attempts:
                if self._stop.wait(delay * (0.5 + random.random())):
                    return False
                delay = min(delay * 2, self.max_backoff_s)
        return False


# --------------------------------------------------------------------------------------------
# Replay
# --------------------------------------------------------------------------------------------


def _rewrite(path: Path, lines: list[bytes]) -> None:
    if not lines:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_name(path.name + ".replay-tmp")
    with open(tmp, "wb") as f:
        for line in lines:
            f.write(line)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def replay(
    spill_path: str | os.PathLike[str],
    config: Any = None,
    send: Callable[[SpanBatch], Any] | None = None,
) -> int:
    """Resend every spilled span, oldest file first; returns the spans delivered.

    Delivered lines are removed from their file as soon as the file is done or a send fails; on a
    failure the exception propagates after the file was rewritten with what is still pending, so a
    later replay resumes there. Blank or unparseable lines are kept out of the way in ``*.bad``.
    """
    if send is None:
        if config is None:
            from plasmient_trace.export import otlp

            config = otlp.OtlpConfig.from_env()
        send = _default_send(config)
    delivered = 0
    for path in spill_files(spill_path):
        with open(path, "rb") as f:
            lines = [line if line.endswith(b"\n") else line + b"\n" for line in f if line.strip()]
        pending = list(lines)
        bad: list[bytes] = []
        try:
            while pending:
                line = pending[0]
                try:
                    batch = batch_from_otlp_dicts([orjson.loads(line)])
                except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                    bad.append(pending.pop(0))
                    continue
                send(batch)
                pending.pop(0)
                delivered += len(batch)
        finally:
            _rewrite(path, pending)
            if bad:
                with open(path.with_name(path.name + ".bad"), "ab") as f:
                    f.writelines(bad)
    return delivered


# --------------------------------------------------------------------------------------------
# CLI: plasmient replay SPILL
# --------------------------------------------------------------------------------------------


def _cmd_replay(args: argparse.Namespace) -> int:
    from plasmient_trace.export import otlp

    files = spill_files(args.spill)
    if not files:
        print(f"plasmient: error: no spill file at {args.spill}", file=sys.stderr)
        return 2
    config = otlp.OtlpConfig.from_env(endpoint=args.endpoint, protocol=args.protocol)
    try:
        n = replay(args.spill, config)
    except Exception as err:  # noqa: BLE001 - one line for the user, the spill file keeps the rest
        left = spill_files(args.spill)
        print(f"plasmient: error: replay to {getattr(config, 'endpoint', None)} failed ({err}); "
              f"{len(left)} spill file(s) keep what was not delivered", file=sys.stderr)
        return 1
    print(f"plasmient: replayed {n} spans from {len(files)} file(s) to {getattr(config, 'endpoint', None)}", file=sys.stderr)
    return 0


def register(subparsers: Any) -> None:
    """Add ``plasmient replay SPILL [--endpoint URL] [--protocol P]`` to the CLI."""
    p = subparsers.add_parser("replay", help="resend spans a collector outage left in a spill file, then remove them")
    p.add_argument("spill", metavar="SPILL", help="spill file (its rotations SPILL.1, SPILL.2, ... are replayed too)")
    p.add_argument("--endpoint", help="OTLP endpoint (default $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / $OTEL_EXPORTER_OTLP_ENDPOINT)")
    p.add_argument("--protocol", choices=("grpc", "http/protobuf", "http/json"), help="OTLP protocol (default $OTEL_EXPORTER_OTLP_PROTOCOL, else grpc)")
    p.set_defaults(func=_cmd_replay)
