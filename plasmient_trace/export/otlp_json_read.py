"""Reading OTLP/JSON back into a SpanBatch: our lines files, a Collector file exporter's, or request dicts.

Walks the parsed JSON per span (this is not on the capture hot path) and converts each attribute
column in bulk at the end. Attributes outside SPAN_TABLE_SCHEMA are ignored; bad input raises a
one-line ValueError naming the file and line (or the request).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np
import orjson
import pyarrow as pa

from plasmient_trace.conventions import (
    CORE_COLUMNS,
    SPAN_TABLE_SCHEMA,
    SpanBatch,
    scatter_rows,
    span_table_from_columns,
)
from plasmient_trace.export.span_columns import attribute_kind
from plasmient_trace.export.gzip_members import Counted, GzipMembers
from plasmient_trace.memory import cyclic_gc_paused
from plasmient_trace.sources.rawinput import check_inflated, is_gzip, limits

__all__ = ["any_value_py", "batch_from_otlp_dicts", "open_span_file", "read_jsonl"]

_CORE_NAMES = frozenset(CORE_COLUMNS.names)
# Spans read into Python lists before they become an Arrow table part: a few lines of ours, whose values as
# Python objects take some 4x their table's memory.
PART_SPANS = 20_000


def _decode_id(value: Any, nbytes: int) -> bytes:
    """OTLP/JSON ids are hex; protobuf's canonical JSON (json_format, MessageToDict) uses base64."""
    if not value:
        return b""
    if not isinstance(value, str):
        raise TypeError(f"id {value!r} is not a string")
    if len(value) == 2 * nbytes:
        try:
            return bytes.fromhex(value)
        except ValueError:
            pass
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) == nbytes:
        return raw
    raise ValueError(f"id {value!r} is neither {2 * nbytes} hex digits nor base64 of {nbytes} bytes")


def any_value_py(value: dict[str, Any]) -> Any:
    """Python value of an OTLP/JSON AnyValue (None when empty)."""
    if "stringValue" in value:
        return value["stringValue"]
    if "intValue" in value:
        return int(value["intValue"])
    if "doubleValue" in value:
        return float(value["doubleValue"])  # also takes protojson's "NaN"/"Infinity" strings
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "arrayValue" in value:
        return [any_value_py(v) for v in (value["arrayValue"] or {}).get("values", ())]
    if "kvlistValue" in value:
        return {kv["key"]: any_value_py(kv.get("value") or {}) for kv in (value["kvlistValue"] or {}).get("values", ())}
    if "bytesValue" in value:
        return base64.b64decode(value["bytesValue"])
    return None


_VALUE_FIELD = {"string": "stringValue", "int": "intValue", "double": "doubleValue", "bool": "boolValue"}


class _Column:
    """Raw values of one attribute as read (converted in bulk at the end), with their rows."""

    __slots__ = ("field", "kind", "name", "rows", "type", "values")

    def __init__(self, name: str, type_: pa.DataType) -> None:
        self.name = name
        self.kind = attribute_kind(type_)
        self.field = _VALUE_FIELD[self.kind]
        self.type = type_
        self.rows: list[int] = []
        self.values: list[Any] = []

    def coerce(self, value: dict[str, Any]) -> Any:
        """A value given as another AnyValue kind: convert when lossless, else raise; None skips it."""
        v = any_value_py(value)
        if v is None:
            return None
        if self.kind == "double" and isinstance(v, int) and not isinstance(v, bool):
            return float(v)
        if self.kind == "int" and isinstance(v, float) and v.is_integer():
            return int(v)
        raise ValueError(f"attribute {self.name!r}: expected a {self.kind} value, got {value!r}")

    def one(self, v: Any) -> Any:
        """Slow-path conversion of a single raw value (to find and name a bad one)."""
        if self.kind == "string":
            if not isinstance(v, str):
                raise ValueError(f"expected a string, got {v!r}")
            return v
        if self.kind == "bool":
            if not isinstance(v, bool):
                raise ValueError(f"expected a bool, got {v!r}")
            return v
        if isinstance(v, bool):
            raise TypeError(f"expected a number, got {v!r}")
        if self.kind == "int":
            try:
                return int(v)  # OTLP/JSON int64s are decimal strings; numbers are accepted too
            except (TypeError, ValueError):
                raise ValueError(f"expected an integer, got {v!r}") from None
        try:
            return float(v)  # also protojson's "NaN"/"Infinity" strings
        except (TypeError, ValueError):
            raise ValueError(f"expected a number, got {v!r}") from None

    def array(self, locate: Callable[[int], str]) -> pa.Array:
        """The values as an Arrow array of the column type; non-finite doubles become null."""
        try:
            if self.kind == "int":
                arr = pa.array(self.values)
                if not pa.types.is_integer(arr.type):
                    arr = arr.cast(pa.int64())  # decimal strings parse in bulk
            elif self.kind == "double":
                arr = pa.array(self.values, pa.float64())
            else:
                arr = pa.array(self.values, self.type)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError):
            converted = []
            for row, v in zip(self.rows, self.values):
                try:
                    converted.append(self.one(v))
                except (TypeError, ValueError) as exc:
                    raise ValueError(f"{locate(row)}: attribute {self.name!r}: {exc}") from None
            arr = pa.array(converted, pa.float64() if self.kind == "double" else self.type)
        if arr.type != self.type:
            arr = arr.cast(self.type)
        if self.kind == "double" and len(arr):
            values = arr.to_numpy(zero_copy_only=False)
            finite = np.isfinite(values)
            if not finite.all():  # same rule as the encoder: non-finite means absent
                arr = pa.array(values, self.type, mask=~finite)
        return arr


class _SpanAccumulator:
    """Column lists filled span by span while reading OTLP/JSON requests."""

    def __init__(self) -> None:
        self.resources: list[dict[str, Any]] = []
        self._resource_keys: dict[str, int] = {}
        self._parts: list[pa.Table] = []
        self._start_part()

    def _start_part(self) -> None:
        self.core: dict[str, list[Any]] = {name: [] for name in CORE_COLUMNS.names}
        self.columns = {f.name: _Column(f.name, f.type) for f in SPAN_TABLE_SCHEMA if f.name not in _CORE_NAMES}
        self.origin: list[int] = []  # where each span came from (line or request number)

    @property
    def pending(self) -> int:
        """Spans read since the last part was built."""
        return len(self.origin)

    def end_part(self, locate: Callable[[int], str]) -> None:
        """Turn the spans read so far into an Arrow table: as Python values they take some 4x the memory."""
        n = len(self.core["name"])
        if n == 0:
            return
        columns: dict[str, Any] = dict(self.core)
        for name, col in self.columns.items():
            if not col.rows:
                continue
            values = col.array(lambda row: locate(self.origin[row]))
            columns[name] = scatter_rows(values, np.asarray(col.rows, dtype=np.int64), n)  # rows in read order
        self._parts.append(span_table_from_columns(columns, n))
        self._start_part()

    def resource_index(self, attributes: dict[str, Any]) -> int:
        key = repr(sorted(attributes.items()))
        idx = self._resource_keys.get(key)
        if idx is None:
            idx = self._resource_keys[key] = len(self.resources)
            self.resources.append(attributes)
        return idx

    def add_request(self, request: dict[str, Any], origin: int) -> None:
        core = self.core
        columns = self.columns
        names, trace_ids, span_ids, parents = core["name"], core["trace_id"], core["span_id"], core["parent_span_id"]
        res_col, starts, ends = core["resource_index"], core["start_ns"], core["end_ns"]
        for rs in request.get("resourceSpans") or ():
            resource = rs.get("resource") or {}
            res_attrs = {kv["key"]: any_value_py(kv.get("value") or {}) for kv in resource.get("attributes") or ()}
            res_idx = self.resource_index(res_attrs)
            for ss in rs.get("scopeSpans") or rs.get("instrumentationLibrarySpans") or ():
                for span in ss.get("spans") or ():
                    row = len(names)
                    trace_id = _decode_id(span.get("traceId"), 16)
                    if len(trace_id) != 16:
                        raise ValueError("span has no traceId")
                    span_id = _decode_id(span.get("spanId"), 8)
                    if len(span_id) != 8:
                        raise ValueError("span has no spanId")
                    parent = _decode_id(span.get("parentSpanId"), 8)
                    for kv in span.get("attributes") or ():
                        col = columns.get(kv.get("key"))
                        if col is None:
                            continue  # not one of our attributes
                        value = kv.get("value")
                        if not value:
                            continue
                        raw = value.get(col.field)
                        if raw is None:
                            raw = col.coerce(value)
                            if raw is None:
                                continue
                        col.rows.append(row)
                        col.values.append(raw)
                    trace_ids.append(trace_id)
                    span_ids.append(int.from_bytes(span_id, "big"))
                    parents.append(int.from_bytes(parent, "big") if parent else 0)
                    res_col.append(res_idx)
                    names.append(span.get("name", ""))
                    starts.append(int(span.get("startTimeUnixNano") or 0))
                    ends.append(int(span.get("endTimeUnixNano") or 0))
                    self.origin.append(origin)

    def batch(self, locate: Callable[[int], str]) -> SpanBatch:
        self.end_part(locate)
        if not self._parts:
            return SpanBatch(span_table_from_columns({name: [] for name in CORE_COLUMNS.names}, 0), self.resources)
        table = self._parts[0] if len(self._parts) == 1 else pa.concat_tables(self._parts)
        self._parts = []
        return SpanBatch(table, self.resources)


def batch_from_otlp_dicts(requests: Iterable[dict[str, Any]]) -> SpanBatch:
    """SpanBatch from ExportTraceServiceRequest dicts in OTLP/JSON (hex ids) or protobuf JSON (base64 ids).

    Attributes outside SPAN_TABLE_SCHEMA are ignored; a value of the wrong type raises ValueError
    naming the request (its position in ``requests``).
    """
    acc = _SpanAccumulator()
    for i, request in enumerate(requests):
        try:
            acc.add_request(request, i)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f"request {i}: not a valid ExportTraceServiceRequest: {exc}") from None
    return acc.batch(lambda i: f"request {i}")


@contextlib.contextmanager
def open_span_file(path: str | os.PathLike[str]) -> Iterator[tuple[str, IO[bytes]]]:
    """(name, binary lines) of a span file, gzip'd or not by its bytes (not its name: a .gz may hold plain
    lines), read in one pass: a pipe (``<(zcat spans.jsonl.gz)``) or stdin works as a file does. The
    stream's ``peek`` shows its first (decompressed) bytes without consuming them. A gzip'd file is read
    member by member (``gzip_members.GzipMembers``): a member cut short is left out, not the rest of the file."""
    p = Path(path)
    with open(p, "rb", buffering=1 << 16) as raw:
        if not is_gzip(raw.peek(2)[:2]):
            yield str(p), raw
            return
        with io.BufferedReader(GzipMembers(Counted(raw), str(p)), 1 << 16) as f:
            yield str(p), f


@contextlib.contextmanager
def _open_lines(path: str | os.PathLike[str] | IO[bytes]) -> Iterator[tuple[str, IO[bytes]]]:
    """(name, binary lines) of a path (closed afterwards) or an open file (left open)."""
    if not isinstance(path, (str, os.PathLike)):
        yield getattr(path, "name", "<stream>"), path
        return
    with open_span_file(path) as opened:
        yield opened


_PROGRESS_EVERY_S = 0.2
_READ_BLOCK = 1 << 20
_BLANKS = re.compile(rb"[ \t\r\n]*")
# A line still without its newline past this, whose first byte cannot start a JSON object, is refused
# there: /dev/zero or an image has no newline to wait for.
_SNIFF_BYTES = 1 << 16


def _numbered_lines(stream: IO[bytes], name: str) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of every line that is not blank, read a block at a time under the size cap ingest
    reads a trace under (PLASMIENT_MAX_TRACE_BYTES; a gzip'd file's bytes are capped as they inflate, with
    PLASMIENT_MAX_GZIP_RATIO too, by ``gzip_members.GzipMembers``): a gzip bomb, a gigabyte of blank lines or
    /dev/zero stop early in one line, where reading line by line held one unbounded line in memory, or went
    through blank lines one Python iteration each.
    An EOFError (a gzip member cut off) is raised after every whole line before it."""
    if not hasattr(stream, "read"):  # an iterable of lines handed in (a caller's own reader)
        yield from ((n, line) for n, line in enumerate(stream, start=1) if line.strip())
        return
    max_bytes, max_ratio = limits()
    read = getattr(stream, "read1", stream.read)  # what a pipe has now, not a whole block
    buf, pos, lineno, total = b"", 0, 0, 0
    parts: list[bytes] = []  # a line begun in earlier blocks, still without its newline
    held, sniffed = 0, False
    while True:
        if not parts:
            start = _BLANKS.match(buf, pos).end()
            lineno += buf.count(b"\n", pos, start)
            pos = start
        end = buf.find(b"\n", pos)
        if end >= 0:
            lineno += 1
            line = buf[pos:end + 1]
            if parts:
                line = _joined(parts + [line], name, lineno)
                parts, held, sniffed = [], 0, False
            yield lineno, line
            pos = end + 1
            continue
        if pos < len(buf):
            parts.append(buf[pos:])
            held += len(buf) - pos
        if held > _SNIFF_BYTES and not sniffed:
            sniffed = True
            head = b"".join(parts[:4])[:4]
            if not (head.startswith(b"{") or head == b"\xef\xbb\xbf{"):
                raise ValueError(f"{name}:{lineno + 1}: not valid JSON (a line of OTLP JSON starts with '{{')")
        buf, pos = read(_READ_BLOCK), 0
        if not buf:
            if parts:  # the pieces go before the line is parsed: a long one would be held twice
                line, parts = _joined(parts, name, lineno + 1), []
                yield lineno + 1, line
            return
        total += len(buf)
        check_inflated(name, total, None, max_bytes, max_ratio)


def _joined(parts: list[bytes], name: str, lineno: int) -> bytes:
    try:
        return b"".join(parts)
    except MemoryError:
        raise ValueError(f"{name}:{lineno}: not enough memory for a line of {sum(map(len, parts)) / 1e6:,.0f} MB") from None


def _position_of(stream: IO[bytes]) -> Callable[[], int] | None:
    """How far into its file a stream (plain, or gzip'd over one) has read; None for a pipe."""
    try:
        fd = stream.fileno()
        os.lseek(fd, 0, os.SEEK_CUR)
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return None
    return lambda: os.lseek(fd, 0, os.SEEK_CUR)


def read_jsonl(path: str | os.PathLike[str] | IO[bytes], progress: Callable[[int], None] | None = None,
               notes: list[str] | None = None) -> SpanBatch:
    """Read an OTLP/JSON lines file (ours or a Collector file exporter's) into a SpanBatch.

    Lines holding other signals (resourceMetrics/resourceLogs) are skipped; a line that is not JSON
    or not an ExportTraceServiceRequest raises ValueError naming the file and line number.
    ``progress`` is called, at most a few times a second, with the bytes of the file (as stored: gzip'd
    bytes for a .gz) read so far; never for a pipe, whose position is not known.
    With ``notes``, an incomplete last line (a live run still writing the file, or a file cut short: a
    line with no newline that does not parse, or a gzip member cut off) is left out and a note says so, as is
    a trace's line whose JSON ends before the line does (a live write a full disk cut short) and a gzip
    member such a write cut short before others (``gzip_members``); without, it raises as any bad line does.
    """
    acc = _SpanAccumulator()
    # a line holds a whole trace: some 5,000 spans, a few hundred thousand dicts and lists
    with _open_lines(path) as (name, f), cyclic_gc_paused():

        def locate(line: int) -> str:
            return f"{name}:{line}"

        def incomplete(after: int) -> None:
            assert notes is not None
            which = f"the line after line {after}" if after else "its first line"
            notes.append(f"{name}: {which} is incomplete (a run still writing the file, or the file cut short): "
                         f"left out{f'; the {after} line(s) before it are read' if after else ''}")

        position = _position_of(f) if progress is not None else None
        shown = time.monotonic()
        lines = _numbered_lines(f, name)
        lineno = 0
        while True:
            try:
                lineno, line = next(lines)
            except StopIteration:
                break
            except EOFError:  # a gzip member cut off
                if notes is None:
                    raise
                incomplete(lineno)
                break
            if position is not None and time.monotonic() - shown > _PROGRESS_EVERY_S:
                shown = time.monotonic()
                progress(position())  # type: ignore[misc]
            if lineno == 1 and line.startswith(b"\xef\xbb\xbf"):
                line = line[3:]  # a UTF-8 byte order mark, as Windows editors save files; JSON allows ignoring it
            try:
                request = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                if notes is not None and not line.endswith(b"\n"):  # only the last line can lack its newline
                    incomplete(lineno - 1)
                    break
                if notes is not None and line.startswith(b'{"resourceSpans"') and exc.pos >= len(line.rstrip()):
                    # a trace's line whose JSON ends before it does: a live write a full disk cut short, ended
                    # by the writer with a newline so the lines after it are whole
                    notes.append(f"{name}:{lineno}: cut short (a write that failed, e.g. on a full disk): left out")
                    continue
                raise ValueError(f"{name}:{lineno}: not valid JSON ({exc})") from None
            if not isinstance(request, dict) or "resourceSpans" not in request:
                if isinstance(request, dict) and ({"resourceMetrics", "resourceLogs", "resourceProfiles"} & request.keys()):
                    continue
                raise ValueError(f"{name}:{lineno}: not an OTLP ExportTraceServiceRequest (no 'resourceSpans' key)")
            try:
                acc.add_request(request, lineno)
            except (ValueError, TypeError, KeyError, AttributeError) as exc:
                raise ValueError(f"{name}:{lineno}: invalid ExportTraceServiceRequest: {exc}") from None
            del request
            if acc.pending >= PART_SPANS:
                acc.end_part(locate)
        for first, after in getattr(getattr(f, "raw", None), "cuts", ()):  # what GzipMembers left out
            cut = (f"{name}: bytes {first:,} to {after - 1:,} hold a gzip member cut short (a write that failed, "
                   "e.g. on a full disk)")
            if notes is None:
                raise ValueError(cut)
            notes.append(f"{cut}: left out")
        return acc.batch(locate)
