"""The spill directory: where spans wait while a collector is down, and ``plasmient replay`` that resends them.

Layout of a spill directory (default ``plasmient-spill/`` next to the output file, else in the
working directory; ``PLASMIENT_SPILL_DIR`` names another):

* ``traces.jsonl`` / ``metrics.jsonl``: the open segment of each signal, OTLP/JSON trace lines (the
  Collector file-exporter format). Both hold spans: a metrics line is a trace whose step metrics
  still have to be sent (they are recomputed from its spans at replay), so a trace that reached
  the collector while its metrics did not is never sent twice.
* ``<signal>.<time_ns>-<pid>.jsonl``: sealed segments, oldest first by name. A segment is sealed
  when it reaches ``segment_bytes`` or when a replay claims it; nobody appends to it afterwards.
* ``<segment>.done``: a replay's progress in that segment (bytes delivered), replaced atomically
  after every delivered line, so a replay killed mid-way resumes after the last delivered line.
* ``.lock``: writers append under a shared ``flock``, sealing takes it exclusively, so several
  processes (ranks) can spill into one directory while a replay runs, and no line is lost or torn.

Every line is one ``write`` to an ``O_APPEND`` descriptor. The directory is bounded by ``max_bytes``
(``PLASMIENT_SPILL_MAX_MB``, default 1024): past it new lines are dropped and counted.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import stat
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from plasmient_trace.conventions import SpanBatch
from plasmient_trace.export.files import is_special_file
from plasmient_trace.export.otlp_json import batch_from_otlp_dicts
from plasmient_trace.held_signals import HeldSignals
from plasmient_trace.memory import cyclic_gc_paused
from plasmient_trace.messages import say_error

__all__ = ["SIGNALS", "ShortWrite", "SpillDir", "SpillFull", "append_lines", "default_spill_dir", "open_for_append", "replay",
           "register", "write_whole"]

SIGNALS = ("traces", "metrics")
DEFAULT_MAX_BYTES = 1024 * 1024 * 1024
DEFAULT_SEGMENT_BYTES = 64 * 1024 * 1024


class SpillFull(OSError):
    """The spill directory reached its size bound; the lines were not written."""


class ShortWrite(OSError):
    """A write that took only part of its data (a full disk): a line cut short is in the file."""

    def __init__(self, written: int, size: int) -> None:
        super().__init__(f"short write ({written} of {size} bytes): disk full?")


def append_lines(fd: int, lines: Iterable[bytes]) -> int:
    """Append each line with one ``write`` (O_APPEND: concurrent writers never interleave within a
    line, however long); returns the bytes written. A short write (disk full) raises OSError.

    A line a full disk cut short is ended with a newline, then or before the next line appended to the
    file (by any writer, once the disk has room), so the next line is whole and a reader leaves out only
    the one cut short: glued to it, the next trace's line was lost too, and `plasmient report` refused
    the whole live file."""
    total = 0
    with _appenders_turn(fd):
        for line in lines:
            data = line if line.endswith(b"\n") else line + b"\n"
            try:
                total += write_whole(fd, b"\n" + data if _ends_mid_line(fd) else data)
            except ShortWrite:
                try:
                    os.write(fd, b"\n")
                except OSError:
                    pass  # still full: the next append ends it
                raise
    return total


@contextlib.contextmanager
def _appenders_turn(fd: int) -> Iterator[None]:
    """Other processes appending to the same regular file through here wait while this one reads the file's last
    byte and appends. Without the turn, a line of theirs still being copied read as one a full disk cut short (a
    file's size grows page by page as a write copies): three processes appending 300 KB lines left 332-576
    empty lines among 900. A filesystem that refuses the lock (some NFS mounts) appends as before."""
    try:
        locked = stat.S_ISREG(os.fstat(fd).st_mode)  # stderr's pipe or terminal is no file to repair
        if locked:
            fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        locked = False
    try:
        yield
    finally:
        if locked:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            except OSError:
                pass


def open_for_append(path: str | os.PathLike[str]) -> int:
    """A descriptor appending to ``path`` (created if absent). A regular file's can also read the file's last
    byte, so ``append_lines`` sees a line a full disk cut short; what is not one (a FIFO, /dev/null) is opened
    write-only as before (read-write, a FIFO would not wait for its reader), as is a file that may not be read."""
    write_only = os.O_WRONLY | os.O_APPEND | os.O_CREAT
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return os.open(path, write_only, 0o644)
    except FileNotFoundError:
        pass  # created as a regular file below
    try:
        return os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    except PermissionError:
        return os.open(path, write_only, 0o644)


def _ends_mid_line(fd: int) -> bool:
    """Whether the file's last byte is not a newline (a line a full disk cut short); False for an empty file
    and for what is not a regular file (stderr's pipe or terminal)."""
    try:
        size = os.fstat(fd).st_size
        return size > 0 and os.pread(fd, 1, size - 1) != b"\n"
    except OSError:
        return False


def write_whole(fd: int, data: bytes) -> int:
    """One ``write`` of all of ``data`` (O_APPEND: other writers' data lands before or after it, never
    inside); a short write (disk full) raises OSError."""
    n = os.write(fd, data)
    if n != len(data):
        raise ShortWrite(n, len(data))
    return n


def default_spill_dir(out: str | None, environ: Any = os.environ) -> Path:
    """``PLASMIENT_SPILL_DIR``, else ``plasmient-spill`` beside ``out``, else in the working directory. An
    ``out`` that is no file of the user's (/dev/null, /dev/stdout, a FIFO) has no folder to share: the
    spans spilled into /dev beside /dev/null."""
    named = (environ.get("PLASMIENT_SPILL_DIR") or "").strip()
    if named:
        return Path(named).expanduser()  # as PLASMIENT_OUT: no shell expands "~" in an env file
    beside = out is not None and not _no_place_beside(Path(out))
    base = Path(out).resolve().parent if beside else Path.cwd()
    return base / "plasmient-spill"


def _no_place_beside(path: Path) -> bool:
    """A device, a FIFO or a socket, or anything under /dev or /proc: no place for a folder beside it."""
    # /dev/stdout of a job whose output is redirected resolves to that regular file: its name says it is a stream
    named = str(path).startswith(("/dev/", "/proc/"))
    return named or path.resolve().parts[1:2] in (("dev",), ("proc",)) or is_special_file(path)


@dataclass
class SpillDir:
    """A spill directory shared by every process that spills into it (see the module docstring)."""

    path: Path
    max_bytes: int = DEFAULT_MAX_BYTES
    segment_bytes: int = DEFAULT_SEGMENT_BYTES

    def __post_init__(self) -> None:
        self.path = Path(self.path)

    def live(self, signal_name: str) -> Path:
        return self.path / f"{signal_name}.jsonl"

    def _lock(self, mode: int) -> int:
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, mode)
        return fd

    def size(self) -> int:
        total = 0
        for p in self.path.glob("*.jsonl") if self.path.is_dir() else ():
            try:
                st = p.stat()
            except FileNotFoundError:  # a replay finished the segment and removed it since the listing
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
        return total

    def append(self, signal_name: str, lines: list[bytes]) -> int:
        """Append the lines to the signal's open segment; returns their bytes. Raises SpillFull past
        ``max_bytes`` (nothing written) and OSError when the disk refuses."""
        need = sum(len(line) + 1 for line in lines)
        if self.size() + need > self.max_bytes:
            raise SpillFull(f"spill directory {self.path} is full ({self.max_bytes // (1 << 20)} MiB bound)")
        lock = self._lock(fcntl.LOCK_SH)
        try:
            live = self.live(signal_name)
            fd = open_for_append(live)
            try:
                written = append_lines(fd, lines)
                os.fsync(fd)
                full = os.fstat(fd).st_size >= self.segment_bytes
            finally:
                os.close(fd)
        finally:
            os.close(lock)
        if full:
            self.seal(signal_name)
        return written

    def seal(self, signal_name: str) -> Path | None:
        """Close the open segment (rename it to a sealed name); None when it is empty or absent."""
        lock = self._lock(fcntl.LOCK_EX)
        try:
            live = self.live(signal_name)
            if not live.exists() or live.stat().st_size == 0:
                return None
            sealed = self.path / f"{signal_name}.{time.time_ns():020d}-{os.getpid()}.jsonl"
            os.replace(live, sealed)
            return sealed
        finally:
            os.close(lock)

    def segments(self, signal_name: str) -> list[Path]:
        """Sealed segments of a signal, oldest first."""
        if not self.path.is_dir():
            return []
        return sorted(p for p in self.path.glob(f"{signal_name}.*-*.jsonl") if p.is_file())

    def is_spill_dir(self) -> bool:
        """Whether a spiller wrote here (it takes the lock file before its first line), as opposed to a
        folder that merely holds a traces.jsonl: a live run's own output, say."""
        return (self.path / ".lock").is_file()

    def pending(self) -> bool:
        return any(self.segments(s) or (self.live(s).exists() and self.live(s).stat().st_size) for s in SIGNALS)


# --------------------------------------------------------------------------------------------
# Replay
# --------------------------------------------------------------------------------------------


def _done_path(segment: Path) -> Path:
    return segment.with_name(segment.name + ".done")


def _read_done(segment: Path) -> tuple[int, int, str]:
    """(offset of the first line not wholly sent, requests of that line already sent, the request split they
    were sent with)."""
    try:
        fields = _done_path(segment).read_text().split()
        offset = int(fields[0]) if fields else 0
        return offset, int(fields[1]) if len(fields) > 1 else 0, fields[2] if len(fields) > 2 else ""
    except (FileNotFoundError, ValueError):
        return 0, 0, ""


def _write_done(segment: Path, offset: int, requests: int = 0, split: str = "") -> None:
    tmp = segment.with_name(segment.name + ".done.tmp")
    with open(tmp, "w") as f:
        f.write(f"{offset} {requests} {split}" if requests else str(offset))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, _done_path(segment))


@dataclass
class ReplayStats:
    spans: int = 0       # of the trace lines
    traces: int = 0
    metric_lines: int = 0  # step metrics spilled beside the traces (their spans are the traces', not more)
    segments: int = 0
    bad_lines: int = 0   # complete lines that are not OTLP/JSON
    torn_lines: int = 0  # a segment's last line cut short (a failed or interrupted write)


def replay(spill_dir: str | os.PathLike[str], senders: dict[str, Callable[[SpanBatch], Any]]) -> ReplayStats:
    """Resend every spilled line, oldest segment first, each exactly once.

    ``senders`` maps a signal (traces, metrics) to a function that delivers a batch or raises.
    The open segments are sealed first (writers move on to a new one). After each delivered line
    the segment's ``.done`` offset is replaced atomically, with SIGINT/SIGTERM held back from the
    send to that commit (:class:`~plasmient_trace.held_signals.HeldSignals`), so an interrupted replay
    resumes exactly after the last delivered line (or request, for a traces sender marked ``resumable``
    that takes ``skip_requests`` and ``on_request``: a line sent in several requests); only SIGKILL between
    a send and its commit can repeat that one line (request). A finished segment is deleted. Unparseable lines, and a segment's last line when a
    write cut it short, are moved to ``bad.jsonl``, skipped and counted (``bad_lines``, ``torn_lines``).
    """
    spill = SpillDir(Path(spill_dir))
    stats = ReplayStats()
    with HeldSignals() as deferred:
        for signal_name in SIGNALS:
            if signal_name not in senders:
                continue
            spill.seal(signal_name)
            for segment in spill.segments(signal_name):
                _replay_segment(spill, segment, signal_name, senders[signal_name], stats, deferred)
    return stats


def bad_lines_path(spill: SpillDir) -> Path:
    """Where replay keeps the lines it cannot send, one per line."""
    return spill.path / "bad.jsonl"


def _keep_bad(spill: SpillDir, line: bytes) -> None:
    with open(bad_lines_path(spill), "ab") as bad:
        bad.write(line if line.endswith(b"\n") else line + b"\n")


def _replay_segment(spill: SpillDir, segment: Path, signal_name: str, send: Callable[[SpanBatch], Any],
                    stats: ReplayStats, deferred: HeldSignals) -> None:
    offset, sent_requests, split = _read_done(segment)
    resumable = getattr(send, "resumable", None)   # the sender's request split: protocol, size, encoder version
    if split != resumable:
        # a line's requests counted under another split (a changed PLASMIENT_OTLP_MAX_REQUEST_MIB, protocol or
        # version) name other spans now: the line is sent whole again (some spans twice, none lost)
        sent_requests = 0
    with open(segment, "rb") as f:
        f.seek(offset)
        for line in f:
            end = offset + len(line)
            if not line.endswith(b"\n"):
                # A torn tail (a write cut short: disk full, a writer killed mid-line) is never sent, and
                # never deleted unseen: it is kept with the unparseable lines and counted.
                _keep_bad(spill, line)
                stats.torn_lines += 1
                break
            try:
                with cyclic_gc_paused():  # a line is a whole trace: the GC would rescan its dicts for no cycle
                    batch = batch_from_otlp_dicts([orjson.loads(line)])
                if not len(batch):  # JSON, but no spans in it ({"x": 1}): sent as nothing, then deleted
                    raise ValueError("no spans")
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                _keep_bad(spill, line)
                stats.bad_lines += 1
                _write_done(segment, end)
                offset = end
                continue
            if resumable:
                # a line over one request's size goes in several: each one that went through is committed
                # before the next is sent, so a replay resumed inside the line sends none of them twice
                start = offset

                def committed(k: int) -> None:
                    _write_done(segment, start, k, resumable)
                    deferred.check()   # Ctrl-C between the requests of a long line, not only between lines

                send(batch, skip_requests=sent_requests, on_request=committed)
            else:
                send(batch)
            sent_requests = 0
            _write_done(segment, end)
            offset = end
            if signal_name == "traces":
                stats.spans += len(batch)
                stats.traces += 1
            else:
                stats.metric_lines += 1
            deferred.check()
    stats.segments += 1
    segment.unlink()
    _done_path(segment).unlink(missing_ok=True)


# --------------------------------------------------------------------------------------------
# CLI: plasmient replay [DIR]
# --------------------------------------------------------------------------------------------


def _cmd_replay(args: argparse.Namespace) -> int:
    from plasmient_trace.export import metrics, otlp

    spill = SpillDir(Path(args.spill))
    if not Path(args.spill).is_dir():
        say_error("plasmient", f"{args.spill}: no such directory")
        return 2
    if not spill.pending():
        say_error("plasmient", f"{args.spill}: no spilled spans there (a spill directory holds traces*.jsonl)")
        return 2
    if not spill.is_spill_dir():
        # replay renames what it sends and deletes it once sent: never a run's own traces.jsonl
        say_error("plasmient", f"{args.spill}: not a spill directory (plasmient leaves a .lock in the ones it spills "
                               "to); replay deletes what it sends, so it does not touch other files")
        return 2
    try:
        config = otlp.OtlpConfig.from_env(endpoint=args.endpoint, protocol=args.protocol)
    except ValueError as err:
        say_error("plasmient", otlp.redact(str(err)))
        return 2
    with otlp.OtlpClient(config) as traces, otlp.OtlpClient(config.for_signal("metrics")) as metrics_client:
        def send_traces(batch: SpanBatch, skip_requests: int = 0, on_request: Callable[[int], None] | None = None) -> Any:
            return otlp.export_spans(traces, batch, skip_requests=skip_requests, on_request=on_request)

        # what decides how a line is split into requests: progress inside a line is kept only under the same
        send_traces.resumable = f"{config.protocol}/{config.max_request_bytes}/{otlp.package_version()}"  # type: ignore[attr-defined]
        senders = {"traces": send_traces, "metrics": lambda b: metrics.export_metrics(metrics_client, b)}
        try:
            stats = replay(spill.path, senders)
        except otlp.ExportError as err:
            say_error("plasmient", f"replay stopped: {err}; run it again to resume (nothing is sent twice)")
            return 1
    metrics_part = f" and {stats.metric_lines} metrics line(s)" if stats.metric_lines else ""
    print(f"plasmient: replayed {stats.traces} trace line(s), {stats.spans} spans{metrics_part} from {stats.segments} "
          f"segment(s) to {otlp.redact_url(config.endpoint)}", file=sys.stderr)
    if stats.bad_lines or stats.torn_lines:
        print(f"plasmient: {stats.bad_lines + stats.torn_lines} line(s) could not be sent ({stats.bad_lines} not OTLP/JSON, "
              f"{stats.torn_lines} cut short by a failed write): kept in {bad_lines_path(spill)}", file=sys.stderr)
    return 0


def register(subparsers: Any) -> None:
    """Add ``plasmient replay [DIR] [--endpoint URL] [--protocol P]`` to the CLI."""
    p = subparsers.add_parser("replay", help="resend what a collector outage left in a spill directory, exactly once")
    p.add_argument("spill", metavar="DIR", nargs="?", default=str(default_spill_dir(None)) if os.environ.get("PLASMIENT_SPILL_DIR") else "plasmient-spill",
                   help="spill directory (default $PLASMIENT_SPILL_DIR, else ./plasmient-spill)")
    p.add_argument("--endpoint", help="OTLP endpoint (default $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / $OTEL_EXPORTER_OTLP_ENDPOINT)")
    p.add_argument("--protocol", choices=("grpc", "http/protobuf", "http/json"), help="OTLP protocol (default $OTEL_EXPORTER_OTLP_PROTOCOL, else grpc)")
    p.set_defaults(func=_cmd_replay)
