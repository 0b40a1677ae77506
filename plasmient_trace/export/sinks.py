"""The sinks a :class:`.delivery.Delivery` writes to: local ones (the OTLP/JSON lines file, written to a
temporary file beside it and renamed at the end; stderr; Parquet; a callable) take a batch in the caller's
thread, network ones (:class:`OtlpSink`, one persistent client per signal) export from the delivery thread
and can be interrupted by its stop event. :func:`write_output_file` writes the outputs made whole at once
(an HTML report, a diff's JSON or Parquet) the same way: beside the final name, then renamed."""

from __future__ import annotations

import gzip
import os
import stat
import sys
import tempfile
import threading
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from plasmient_trace.conventions import SpanBatch
from plasmient_trace.export.files import is_special_file
from plasmient_trace.export.page_cache import DropBehind, DropBehindFile
from plasmient_trace.export.spill import append_lines, open_for_append, write_whole

__all__ = [
    "CallableSink",
    "ConsoleSink",
    "FileSink",
    "LocalSink",
    "MetricsConsoleSink",
    "OtlpSink",
    "OutputError",
    "ParquetSink",
    "RemoteSink",
    "check_output_dir",
    "check_output_path",
    "chosen_sinks",
    "write_output_file",
]


class OutputError(OSError):
    """A local output cannot be written: one line naming the path and the problem."""


class OutputClosed(OutputError):
    """The output is a pipe whose reader has gone (``--out - | head``): not a failure to report, the
    reader took what it wanted."""


def _output_failed(path: Path, err: OSError) -> OutputError:
    return OutputClosed(f"{path}: its reader closed it") if isinstance(err, BrokenPipeError) else \
        OutputError(output_problem(path, err))


class LocalSink(Protocol):
    name: str

    def write(self, batch: SpanBatch) -> None: ...


class RemoteSink(Protocol):
    name: str
    signal: str

    # probe: the collector is known to be down; one attempt tells whether it is back, no retries
    def export(self, batch: SpanBatch, stop: threading.Event, probe: bool = False) -> Any: ...
    def reset(self) -> None: ...
    def close(self) -> None: ...


def check_output_path(path: str | os.PathLike[str]) -> None:
    """Raise OutputError when ``path`` cannot be an output file (a directory, an unwritable folder)."""
    p = Path(path)
    if p.is_dir():
        raise OutputError(f"{p}: is a directory, not a file")
    _check_folder_above(p)
    if p.exists() and not os.access(p, os.W_OK):
        raise OutputError(f"{p}: permission denied")


def check_not_an_input(path: str | os.PathLike[str], inputs: list[Any]) -> None:
    """Raise OutputError when the output ``path`` is one of the ``inputs`` (the same file, by any name):
    the output would replace it, and a profile is often the only copy there is."""
    try:
        out = os.stat(path)
    except (OSError, ValueError):
        return  # not there yet, so none of the inputs
    if not stat.S_ISREG(out.st_mode):
        return  # /dev/stdout, /dev/null, a FIFO: written in place, never renamed over
    for source in inputs:
        try:
            st = os.stat(source)
        except (OSError, ValueError, TypeError):
            continue
        if (st.st_dev, st.st_ino) == (out.st_dev, out.st_ino):
            raise OutputError(f"{path}: is the input {source}; writing there would destroy it")


def check_distinct_outputs(outputs: dict[str, str | os.PathLike[str] | None]) -> None:
    """Raise OutputError when two of the named outputs (flag -> path) are one file: the second written would
    replace the first, exit 0."""
    seen: dict[str, str] = {}
    for flag, path in outputs.items():
        if not path:
            continue
        key = os.path.realpath(path)
        if key in seen:
            raise OutputError(f"{path}: given as both {seen[key]} and {flag}; one would overwrite the other")
        seen[key] = flag


def check_output_dir(path: str | os.PathLike[str]) -> None:
    """Raise OutputError when ``path`` cannot be an output folder (a file, below a file, unwritable)."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise OutputError(f"{p}: is a file, not a directory")
    if p.is_dir():
        if not os.access(p, os.W_OK | os.X_OK):
            raise OutputError(f"{p}: cannot write in it (permission denied)")
        return
    _check_folder_above(p)


def _check_folder_above(p: Path) -> None:
    # the folders that do not exist yet are created: what decides is the nearest one that does
    parent = p.parent if str(p.parent) else Path(".")
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if parent.exists() and not parent.is_dir():
        raise OutputError(f"{p}: {parent} is not a directory")
    if parent.exists() and not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{p}: cannot write in {parent} (permission denied)")


def output_problem(path: Path, err: OSError) -> str:
    """One line for a failed write to ``path``: what :func:`check_output_path` finds wrong with the path
    (mkdir under a regular file says only "File exists"), else the system's words."""
    try:
        check_output_path(path)
    except OutputError as found:
        return str(found)
    return f"{path}: {os_problem(err)}"


def os_problem(err: OSError) -> str:
    return err.strerror or str(err)


class FileSink:
    """OTLP/JSON lines file, one line per trace (step). ``append=True`` (live): each line is one
    ``write`` to an O_APPEND descriptor, so processes sharing the file never interleave.
    ``append=False`` (ingest): the batches are written beside the final name and ``close()`` renames
    the file into place, so a failure (``close(commit=False)``) leaves no partial file. An output that
    exists and is not a regular file (``/dev/null``, ``/dev/stdout``'s pipe, a FIFO) is written in place:
    a rename would put a regular file where the device node was. A symlink is followed: the file it
    names is replaced, not the link. Either way the
    lines are written as they are encoded: the export holds one trace's line (live) or one ~1 MiB part
    (ingest) at a time, never the file, and a regular file's pages leave the page cache two windows
    behind its end (:mod:`.page_cache`)."""

    def __init__(self, path: str | os.PathLike[str], append: bool) -> None:
        self.path = Path(path)
        self.append = append
        self.name = str(self.path)
        self.lines = 0
        self._tmp: Path | None = None  # the file being written (ingest), set with _file; None: in place
        self._file: Any = None
        # a name ending in .gz is written gzip'd: ingest as one stream, live as one gzip member per line
        # (members concatenate into one valid gzip file, and each line stays one write)
        self.gzip = self.path.name.endswith(".gz")
        self._gzip: gzip.GzipFile | None = None
        self._appended = DropBehind()  # live: the appended file leaves the page cache as it grows

    def write(self, batch: SpanBatch) -> None:
        from plasmient_trace.export.otlp_json import encode_jsonl_lines, write_jsonl

        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.append:
                fd = open_for_append(self.path)
                try:
                    # Line by line as they are encoded: one trace (step) in memory at a time, each
                    # line still one write.
                    for line in encode_jsonl_lines(batch):
                        if self.gzip:
                            write_whole(fd, gzip.compress(line if line.endswith(b"\n") else line + b"\n",
                                                          compresslevel=_GZIP_LEVEL, mtime=0))
                        else:
                            append_lines(fd, (line,))
                        self.lines += 1
                    self._appended.follow(fd)
                finally:
                    os.close(fd)
                return
            if self._file is None:
                self._open()
            self.lines += write_jsonl(batch, self._gzip or self._file)
        except OSError as err:
            self.close(commit=False)
            raise _output_failed(self.path, err) from None

    def close(self, commit: bool = True) -> None:
        """Ingest: move the written file into place (commit) or remove it. Nothing written: nothing to do,
        unless committing, which writes the empty file."""
        if self.append:
            return
        try:
            if commit and self._file is None:
                self._open()
            if self._file is None:
                return
            f, tmp, gz = self._file, self._tmp, self._gzip
            self._file = self._tmp = self._gzip = None
            if gz is not None and commit:
                gz.close()  # the end of the gzip stream into f, which stays open
            if tmp is None:  # written in place (a device or a pipe): nothing to move, nothing to remove
                try:
                    if commit:
                        f.flush()
                finally:
                    f.close()
                return
            try:
                if commit:
                    _move_into_place(f, tmp, self.path)
            finally:
                try:
                    f.close()   # on a full disk this fails again, flushing what its buffer still holds
                finally:
                    tmp.unlink(missing_ok=True)  # gone already once moved into place
        except OSError as err:
            raise _output_failed(self.path, err) from None


    def _open(self) -> None:
        if is_stdout(self.path):
            # written as any program writes its stdout: at the offset the shell gave it (`>> file` appends),
            # not renamed over a redirected file, nor opened again (which would truncate it)
            self._tmp, self._file = None, os.fdopen(os.dup(1), "wb", buffering=1 << 20)
        elif is_special_file(self.path):  # /dev/null, a FIFO
            self._tmp, self._file = None, open(self.path, "wb", buffering=1 << 20)
        else:
            fd, tmp = _temp_beside_target(self.path)
            # a large output leaves the page cache as it goes (it is fsynced at the end all the same)
            self._tmp, self._file = tmp, DropBehindFile(os.fdopen(fd, "wb", buffering=1 << 20))
        if self.gzip:
            self._gzip = gzip.GzipFile(filename="", mode="wb", fileobj=self._file, compresslevel=_GZIP_LEVEL, mtime=0)


# gzip's fastest level: the JSON lines shrink about as much as at the default level's, at several times
# the speed, and the encoder, not the disk, is what an ingest waits on
_GZIP_LEVEL = 1


def is_stdout(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names this process's stdout (/dev/stdout, /proc/self/fd/1, or the file, pipe or
    terminal it is redirected to)."""
    try:
        here, there = os.fstat(1), os.stat(path)
    except (OSError, ValueError):
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _temp_beside_target(path: Path) -> tuple[int, Path]:
    """A temporary file in the folder of the file ``path`` names (through a symlink; the folder is made
    when missing), so the rename that puts it in place stays on one file system."""
    target = Path(os.path.realpath(path))
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    return fd, Path(name)


def _move_into_place(f: BinaryIO, tmp: Path, path: Path) -> None:
    """Make the finished temporary file ``tmp`` (open as ``f``) the output ``path``: durable, with the
    mode any new file gets (mkstemp makes it private, 0600), renamed over the file ``path`` names."""
    f.flush()
    os.fsync(f.fileno())
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(f.fileno(), 0o666 & ~umask)
    f.close()
    os.replace(tmp, os.path.realpath(path))


def write_output_file(path: str | os.PathLike[str], write: Callable[[BinaryIO], Any]) -> Path:
    """Write a whole output file (an HTML report, a JSON or Parquet table) with ``write(file)``: the path is
    checked first, the bytes go to a temporary file beside it that is renamed into place, so a failure
    leaves neither a partial file nor the temporary one. A device or FIFO is written in place. Every
    failure is an :class:`OutputError` of one line."""
    path = Path(path)
    check_output_path(path)
    tmp: Path | None = None
    try:
        if is_special_file(path):
            with open(path, "wb") as f:
                write(f)
            return path
        fd, tmp = _temp_beside_target(path)
        with os.fdopen(fd, "wb") as f:
            write(f)
            _move_into_place(f, tmp, path)
        tmp = None
        return path
    except OSError as err:
        raise OutputError(output_problem(path, err)) from None
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)


class ConsoleSink:
    """OTLP/JSON lines on stderr (OTEL_TRACES_EXPORTER=console)."""

    name = "stderr"

    def write(self, batch: SpanBatch) -> None:
        from plasmient_trace.export.otlp_json import encode_jsonl_lines

        append_lines(sys.stderr.fileno(), encode_jsonl_lines(batch))


class MetricsConsoleSink:
    """The step metrics as OTLP/JSON ExportMetricsServiceRequest lines on stderr (OTEL_METRICS_EXPORTER=console)."""

    name = "stderr (metrics)"

    def write(self, batch: SpanBatch) -> None:
        from plasmient_trace.export.metrics import metric_requests, request_json

        append_lines(sys.stderr.fileno(), [request_json(r) + b"\n" for r in metric_requests(batch)])


class CallableSink:
    """Any ``fn(batch)`` as a local sink (tests, embedding applications)."""

    def __init__(self, name: str, fn: Callable[[SpanBatch], Any]) -> None:
        self.name = name
        self.write = fn


class ParquetSink:
    """Every record table and the spans as Parquet files in a directory (ingest)."""

    def __init__(self, directory: str | os.PathLike[str], records: Any) -> None:
        self.directory = directory
        self.records = records
        self.name = str(directory)
        self.files: list[Any] = []

    def write(self, batch: SpanBatch) -> None:
        from plasmient_trace.export import parquet

        try:
            self.files = parquet.write_parquet(self.records, batch, self.directory)
        except OutputError:
            raise  # names the file and the problem already
        except OSError as err:
            check_output_dir(self.directory)  # the path in the way, when that is the problem, in its words
            raise OutputError(f"{self.directory}: {os_problem(err)}") from None


class OtlpSink:
    """One OTLP signal (traces, or step metrics computed from the spans) over a persistent client."""

    def __init__(self, config: Any, signal: str = "traces") -> None:
        from plasmient_trace.export import metrics, otlp

        self.signal = signal
        self.config = config if signal == "traces" else config.for_signal(signal)
        self.name = f"{otlp.redact_url(self.config.endpoint)} ({self.config.protocol})"
        # The collector as a server: both signals' sinks of one collector share it (for HTTP their paths differ).
        endpoint = self.config.endpoint.strip()
        self.collector = urllib.parse.urlsplit(endpoint).netloc if "://" in endpoint else endpoint
        self._client: Any = None
        self._attempts_before = 0  # of clients closed since
        # One cumulative plasmient.steps series per rank/fleet across every batch this sink sends.
        self._steps = metrics.StepCounter()

    def export(self, batch: SpanBatch, stop: threading.Event, probe: bool = False) -> Any:
        from plasmient_trace.export import metrics, otlp

        if self._client is None:
            self._client = otlp.OtlpClient(self.config)
        attempts = 1 if probe else None
        if self.signal == "traces":
            return otlp.export_spans(self._client, batch, stop, max_attempts=attempts)
        return metrics.export_metrics(self._client, batch, stop, self._steps, max_attempts=attempts)

    @property
    def attempts(self) -> int:
        """Requests tried so far, retries included, over this sink's clients (0 before the first)."""
        return self._attempts_before + (self._client.attempts if self._client is not None else 0)

    def reset(self) -> None:
        self._client = None  # the parent's channel belongs to the parent: forget it, never close it

    def close(self) -> None:
        if self._client is not None:
            self._attempts_before += self._client.attempts
            self._client.close()
            self._client = None


def chosen_sinks(choice: Any, otlp_config: Any | None) -> tuple[list[OtlpSink], list[Any]]:
    """(network, console) sinks an exporter choice (``selection.select_exporters``) names, the same for ingest
    and live: an OTLP sink for each signal that chose otlp (none without an OTLP config), then the console
    ones, traces before metrics."""
    remote = [OtlpSink(otlp_config, signal) for signal, kinds in (("traces", choice.traces), ("metrics", choice.metrics))
              if "otlp" in kinds] if otlp_config is not None else []
    console: list[Any] = []
    if "console" in choice.traces:
        console.append(ConsoleSink())
    if "console" in choice.metrics:
        console.append(MetricsConsoleSink())
    return remote, console
