"""OTLP/JSON lines: encode a SpanBatch the way the Collector's file exporter writes.

One line is one ``ExportTraceServiceRequest`` in the protobuf JSON mapping with the OTLP/JSON
exceptions (trace/span ids as lowercase hex, enums as integers), one line per trace id.

Encoding never builds per-span Python objects. Per chunk of spans, every column is turned into
texts at once (hex ids and fixed-width heads with numpy, number texts with orjson's numpy serializer,
strings as they are, key prefixes once per key). A small C loop (:mod:`.json_native`) then copies them
into span objects in row order, one part of about ``PART_BYTES`` at a time, which goes to the file
before the next is made: the output never exists as one string. Where the C loop cannot be built, a
numpy index program and an Arrow ``take`` (:class:`.pieces.Pieces`) lay out the same bytes. Only the
per-trace/per-resource framing is Python. The grouping into (trace, resource) runs and the chunking are :mod:`.span_columns`'s, shared
with :mod:`.otlp_proto`; reading lines back is :mod:`.otlp_json_read`'s.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, BinaryIO

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from plasmient_trace.conventions import SCOPE_NAME, SpanBatch
from plasmient_trace.export import json_native
from plasmient_trace.export.background_write import BackgroundWriter
from plasmient_trace.export.otlp_json_read import (
    any_value_py,
    batch_from_otlp_dicts,
    read_jsonl,
)
from plasmient_trace.export.pieces import (
    LB,
    Pieces,
    build_rows,
    hex_matrix,
    join,
    needs_json_escape,
    number_texts,
    string_data,
    u64_be_matrix,
)
from plasmient_trace.export.span_columns import (
    AttributeValues,
    attribute_slots,
    attribute_values,
    column_array,
    id_matrix,
    iter_segments,
    span_layout,
)

__all__ = [
    "SPAN_KIND_INTERNAL",
    "any_value_json",
    "any_value_py",
    "batch_from_otlp_dicts",
    "encode_jsonl_lines",
    "package_version",
    "read_jsonl",
    "write_jsonl",
]

SPAN_KIND_INTERNAL = 1  # every span we emit is an in-process measurement, never a remote call
# Encoded bytes gathered at once: small enough that the allocator reuses the memory of one part for
# the next (larger blocks come fresh from the OS and are page-faulted in every time, which cost more
# than the encoding itself), large enough that the per-part overhead stays negligible.
PART_BYTES = 1 << 20
# A file write's parts are smaller for a small batch: the bytes in flight (the part being laid out, the
# writer's queue) sit beside the batch's own span table, so they stay a small share of the peak (on a
# 25 MB trace, 1 MiB parts held 6 MiB more at the peak); a large batch keeps 1 MiB parts, whose per-part
# overhead is then negligible (256 KiB parts throughout cost 5-7% more encoding CPU at 10^5 kernels).
MIN_PART_BYTES = 256 << 10
# Spans prepared per pass (value texts, slots, piece order): bounds the transient memory of the
# export whatever the file size; the per-pass overhead is a few numpy calls per attribute column.
JSON_CHUNK_ROWS = 8192
MIN_JSON_CHUNK_ROWS = 4096
_FIXED_PIECES = 7  # pieces of every span before its attributes: ids, parent, name, kind+start, start, end key, end


# --------------------------------------------------------------------------------------------
# Package version (scope.version)
# --------------------------------------------------------------------------------------------


def package_version() -> str:
    """Version of plasmient-trace for the instrumentation scope (package __version__, metadata, pyproject)."""
    global _VERSION
    if _VERSION is None:
        _VERSION = _find_version()
    return _VERSION


_VERSION: str | None = None


def _find_version() -> str:
    try:
        from plasmient_trace import __version__  # type: ignore[attr-defined]

        return str(__version__)
    except ImportError:
        pass  # no __version__ attribute: ask the installed metadata
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("plasmient-trace")
    except PackageNotFoundError:
        pass  # a source checkout that was never pip-installed: the pyproject next to the package says it
    import tomllib

    try:
        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
        return str(tomllib.loads(pyproject.read_text())["project"]["version"])
    except (OSError, KeyError, TypeError, tomllib.TOMLDecodeError):
        return "0+unknown"


# --------------------------------------------------------------------------------------------
# JSON span fragments
# --------------------------------------------------------------------------------------------


def json_strings(arr: pa.Array) -> pa.Array:
    """JSON string literals (quoted, escaped) of a string array; nulls stay null."""
    if not pa.types.is_large_string(arr.type):
        arr = arr.cast(pa.large_string())
    quote = pa.scalar(b'"', LB)
    if not needs_json_escape(arr):
        return join([quote, arr.cast(LB), quote])
    data = string_data(arr)
    if len(data) and data.min() < 0x20:  # in UTF-8 only the control characters themselves are bytes below 0x20
        # Control characters need \u escapes; rare enough to let orjson do it once per distinct value.
        enc = pc.dictionary_encode(arr)
        literals = pa.array([orjson.dumps(s) for s in enc.dictionary.to_pylist()], LB)
        return literals.take(enc.indices)
    escaped = pc.replace_substring(pc.replace_substring(arr, "\\", "\\\\"), '"', '\\"')
    return join([quote, escaped.cast(pa.large_string()).cast(LB), quote])


# What must follow a value piece to close its KeyValue, by how the piece ends.
_CLOSE_AFTER = {"double": b"}", "int": b"}}", "raw": b'"}}', "literal": b"}}", "bool": b"}}"}
_CLASSES = tuple(_CLOSE_AFTER)
_VALUE_OPEN = {
    "double": b'"doubleValue":',
    "int": b'"intValue":"',
    "raw": b'"stringValue":"',
    "literal": b'"stringValue":',
    "bool": b'"boolValue":',
}


def _json_value_texts(attrs: list[AttributeValues]) -> tuple[list[int], list[pa.Array]]:
    """Every attribute's value texts; returns (closing class code, texts: one per present value) per attribute.

    Numbers of one kind are printed in one orjson call for all columns: per column, the call and the
    separator search cost more than the printing at a few thousand rows."""
    classes = [0] * len(attrs)
    texts: list[pa.Array] = [pa.array([], LB)] * len(attrs)
    for kind, terminator in (("double", b"}"), ("int", b'"')):  # the closing class is the kind
        members = [i for i, a in enumerate(attrs) if a.kind == kind]
        if not members:
            continue
        printed = number_texts(np.concatenate([attrs[i].values for i in members]), terminator)
        bounds = np.cumsum([0] + [len(attrs[i].values) for i in members])
        for i, lo, hi in zip(members, bounds[:-1].tolist(), bounds[1:].tolist()):
            classes[i], texts[i] = _CLASSES.index(kind), printed.slice(lo, hi - lo)
    for i, a in enumerate(attrs):
        if a.kind == "bool":
            classes[i] = _CLASSES.index("bool")
            texts[i] = _BOOL_TEXTS.take(pa.array(np.where(a.values, 0, 1)))
        elif a.kind == "string":
            literal = needs_json_escape(a.values)
            classes[i] = _CLASSES.index("literal" if literal else "raw")
            texts[i] = json_strings(a.values) if literal else a.values.cast(LB)
    return classes, texts


_BOOL_TEXTS = pa.array([b"true", b"false"], LB)


@functools.lru_cache(maxsize=4096)
def _key_prefixes(key: str, cls: int) -> tuple[bytes, ...]:
    """What precedes a value of ``key`` of closing class ``cls``: when it is its row's first attribute, then
    after a value of each closing class."""
    key_open = b'{"key":' + orjson.dumps(key) + b',"value":{' + _VALUE_OPEN[_CLASSES[cls]]
    return (b',"attributes":[' + key_open, *(_CLOSE_AFTER[c] + b"," + key_open for c in _CLASSES))


# How a span ends: after no attribute, then after a value of each closing class.
_CLOSINGS = (b"},", *(_CLOSE_AFTER[c] + b"]}," for c in _CLASSES))


@dataclasses.dataclass
class _SpanTexts:
    """The texts a chunk's span objects are made of, before they are laid out row by row."""

    n: int
    ids: pa.Array                # per row: '{"traceId":"..","spanId":"..'
    parents: pa.Array            # per span with a parent: '","parentSpanId":"..","name":"', then the roots' one text
    parent_of: np.ndarray        # per row: its element of ``parents`` (roots: the last)
    name: pa.Array
    kind_start: bytes            # what closes the name and opens the start time
    start: pa.Array              # start time texts, each closed by its '"'
    end: pa.Array
    attrs: list[AttributeValues]
    classes: list[int]           # closing class per attribute
    values: list[pa.Array]       # value texts per attribute, one per present value


def _span_texts(chunk: pa.Table) -> _SpanTexts:
    n = chunk.num_rows
    tid = hex_matrix(id_matrix(column_array(chunk, "trace_id"), 16))
    sid = hex_matrix(u64_be_matrix(column_array(chunk, "span_id").to_numpy()))
    parent_ids = column_array(chunk, "parent_span_id").to_numpy()
    name = column_array(chunk, "name")
    literal_names = needs_json_escape(name)
    name_open = b'","name":' if literal_names else b'","name":"'
    # Roots omit parentSpanId, as the Collector does.
    kids = parent_ids != 0
    n_kids = int(np.count_nonzero(kids))
    parents = pa.concat_arrays([build_rows(n_kids, [b'","parentSpanId":"', hex_matrix(u64_be_matrix(parent_ids[kids])), name_open]),
                                pa.array([name_open], LB)])
    parent_of = np.full(n, n_kids, np.int64)
    parent_of[kids] = np.arange(n_kids)
    attrs = attribute_values(chunk)
    classes, values = _json_value_texts(attrs)
    close_name = b"," if literal_names else b'",'
    return _SpanTexts(
        n=n,
        ids=build_rows(n, [b'{"traceId":"', tid, b'","spanId":"', sid]),
        parents=parents,
        parent_of=parent_of,
        name=json_strings(name) if literal_names else name.cast(LB),
        kind_start=close_name + b'"kind":%d,"startTimeUnixNano":"' % SPAN_KIND_INTERNAL,
        start=number_texts(column_array(chunk, "start_ns").to_numpy(), b'"'),  # each closed by its '"'
        end=number_texts(column_array(chunk, "end_ns").to_numpy(), b'"'),
        attrs=attrs, classes=classes, values=values)


def json_span_fragments(chunk: pa.Table, part_bytes: int = PART_BYTES) -> Iterator[pa.Array]:
    """One OTLP/JSON span object per row, each followed by ',' (the consumer drops the group's last).

    The rows come in consecutive parts of about ``part_bytes`` each: a part is made only when the
    consumer asks for it, so the encoded bytes held at once stay near ``part_bytes`` (and small enough
    for the allocator to reuse one part's memory for the next, instead of faulting in fresh pages for
    every chunk). The native assembler lays the parts out where it could be built; the numpy layout
    otherwise, with the same bytes.
    """
    texts = _span_texts(chunk)
    assemble = json_native.assembler()
    if assemble is not None:
        return _native_layout(texts, assemble, part_bytes)
    return _numpy_layout(texts, part_bytes)


def _native_layout(t: _SpanTexts, assemble: Any, part_bytes: int) -> Iterator[pa.Array]:
    src = json_native.Texts()
    per_row, constant, indexed = json_native.PER_ROW, json_native.CONSTANT, json_native.INDEXED
    fixed = [(per_row, src.of_array(t.ids), None), (indexed, src.of_array(t.parents), t.parent_of),
             (per_row, src.of_array(t.name), None), (constant, src.of_bytes([t.kind_start]), None),
             (per_row, src.of_array(t.start), None), (constant, src.of_bytes([b',"endTimeUnixNano":"']), None),
             (per_row, src.of_array(t.end), None)]
    attrs = [(a.valid, len(a.values), src.of_array(values), cls, src.of_bytes(_key_prefixes(a.key, cls)))
             for a, cls, values in zip(t.attrs, t.classes, t.values)]
    return json_native.assemble_parts(assemble, t.n, fixed, attrs, src.of_bytes(_CLOSINGS), src, part_bytes)


def _numpy_layout(t: _SpanTexts, part_bytes: int) -> Iterator[pa.Array]:
    # Every row: ids, parent (or the name's opening), name, ',"kind":..,"startTimeUnixNano":"', start,
    # ',"endTimeUnixNano":"', end,
    # then a (prefix, value) pair per attribute, then what closes the span.
    n = t.n
    pieces = Pieces(n)
    counts, slot_first = attribute_slots(n, t.attrs)
    row_first = pieces.layout(_FIXED_PIECES + 1 + 2 * counts)
    first = row_first[:-1]
    pieces.put(first, pieces.array(t.ids))
    pieces.put(first + 1, pieces.array(t.parents)[t.parent_of])
    pieces.put(first + 2, pieces.array(t.name))
    pieces.put(first + 3, pieces.const(t.kind_start))
    pieces.put(first + 4, pieces.array(t.start))
    pieces.put(first + 5, pieces.const(b',"endTimeUnixNano":"'))
    pieces.put(first + 6, pieces.array(t.end))

    # Attributes: per value a prefix (what closes the previous KeyValue, ',', this key) and the value.
    total = int(slot_first[-1])
    slot_class = np.empty(total, dtype=np.int64)  # closing class of each slot, row-major
    slots = []
    for a, cls in zip(t.attrs, t.classes):
        slot = a.take(slot_first) + a.ranks
        slot_class[slot] = cls
        slots.append(slot)
    prefix_bytes = 0
    for a, cls, values, slot in zip(t.attrs, t.classes, t.values, slots):
        variants = _key_prefixes(a.key, int(cls))
        variant_ids = np.array([pieces.const(v) for v in variants], dtype=np.int64)
        is_first = a.ranks == 0
        prev_class = slot_class[np.where(is_first, slot, slot - 1)]
        at = a.take(first) + _FIXED_PIECES + 2 * a.ranks
        pieces.put(at, np.where(is_first, variant_ids[0], variant_ids[1 + prev_class]))
        pieces.put(at + 1, pieces.array(values))
        prefix_bytes += len(a.rows) * (len(variants[1]) + 1)
    closings = np.array([pieces.const(c) for c in _CLOSINGS], dtype=np.int64)
    last_class = slot_class[np.maximum(slot_first[1:] - 1, 0)] if total else np.zeros(n, dtype=np.int64)
    pieces.put(row_first[1:] - 1, np.where(counts > 0, closings[1 + last_class], closings[0]))
    row_bytes = (pieces.pooled_bytes + prefix_bytes) / max(n, 1) + 64  # + the per-span constants
    return pieces.build_parts(max(1, int(part_bytes / row_bytes)))


# --------------------------------------------------------------------------------------------
# Resource / scope framing
# --------------------------------------------------------------------------------------------


def any_value_json(value: Any) -> dict[str, Any] | None:
    """OTLP/JSON AnyValue for a Python value; None for values OTLP cannot carry (None, NaN, inf)."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)):
        return {"boolValue": bool(value)}
    if isinstance(value, (int, np.integer)):
        return {"intValue": str(int(value))}
    if isinstance(value, (float, np.floating)):
        return {"doubleValue": float(value)} if math.isfinite(value) else None
    if isinstance(value, str):
        return {"stringValue": value}
    if isinstance(value, (bytes, bytearray)):
        return {"bytesValue": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, (list, tuple)):
        values = [v for v in (any_value_json(x) for x in value) if v is not None]
        return {"arrayValue": {"values": values}}
    if isinstance(value, dict):
        return {"kvlistValue": {"values": key_values_json(value)}}
    return {"stringValue": str(value)}


def key_values_json(attributes: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for key, value in attributes.items():
        v = any_value_json(value)
        if v is not None:
            out.append({"key": str(key), "value": v})
    return out


def _scope_json() -> dict[str, str]:
    return {"name": SCOPE_NAME, "version": package_version()}


_LINE_HEAD = b'{"resourceSpans":['
_LINE_TAIL = b"]}\n"
_GROUP_TAIL = b"]}]}"


def _json_pieces(batch: SpanBatch, max_bytes: int | None, chunk_rows: int | None = None,
                 part_bytes: int = PART_BYTES, line_traces: list[bytes] | None = None) -> Iterator[bytes | memoryview | None]:
    """Byte pieces of the JSONL output; None marks the end of a line (after its newline piece)."""
    layout = span_layout(batch)
    if layout.num_rows == 0:
        return
    scope = orjson.dumps(_scope_json())
    heads = [
        b'{"resource":' + orjson.dumps({"attributes": key_values_json(r)}) + b',"scopeSpans":[{"scope":' + scope + b',"spans":['
        for r in layout.resources
    ]
    fixed_tail = len(_GROUP_TAIL) + len(_LINE_TAIL) - 1  # what closing a line adds (newline not counted)

    cur_trace = -1
    cur_group = -1
    line_size = 0  # bytes of the current line so far
    line_spans = 0
    group_open = False  # groups open lazily, with their first span, so the size check covers the head
    first_group = True
    pending_comma = False  # a span was emitted in the open group: the next one needs a ','

    encode_chunk = functools.partial(json_span_fragments, part_bytes=part_bytes)
    for seg in iter_segments(layout, encode_chunk, chunk_rows or JSON_CHUNK_ROWS):
        g = seg.group
        t = int(layout.group_trace[g])
        if t != cur_trace:
            if cur_trace >= 0:
                if group_open:
                    yield _GROUP_TAIL
                yield _LINE_TAIL
                if line_traces is not None:
                    line_traces.append(layout.trace_ids[cur_trace])
                yield None
            yield _LINE_HEAD
            line_size, line_spans, first_group, group_open = len(_LINE_HEAD), 0, True, False
            cur_trace, cur_group = t, -1
        if g != cur_group:
            if group_open:
                yield _GROUP_TAIL
                line_size += len(_GROUP_TAIL)
                group_open = False
            cur_group = g
        head = heads[int(layout.group_resource[g])]
        offs = seg.offsets
        i, m = 0, len(offs) - 1
        while i < m:
            if group_open:
                extra = 1 if pending_comma else 0
            else:
                extra = len(head) + (0 if first_group else 1)
            if max_bytes is None:
                k = m
            else:
                # Each fragment carries its trailing ',' which stands for the separator; the last
                # one's is dropped, so spans i..k-1 cost offs[k]-offs[i]-1 bytes plus ``extra``.
                budget = max_bytes - line_size - extra - fixed_tail + 1
                k = int(np.searchsorted(offs, offs[i] + budget, side="right")) - 1
                if k <= i:
                    if line_spans:
                        # Line is full: continue this trace on a fresh line (a valid request of its own).
                        if group_open:
                            yield _GROUP_TAIL
                        yield _LINE_TAIL
                        if line_traces is not None:
                            line_traces.append(layout.trace_ids[cur_trace])
                        yield None
                        yield _LINE_HEAD
                        line_size, line_spans, first_group, group_open = len(_LINE_HEAD), 0, True, False
                        continue
                    k = i + 1  # a single span above the limit still goes out, alone
            if not group_open:
                if not first_group:
                    yield b","
                yield head
                group_open, first_group, pending_comma = True, False, False
            elif pending_comma:
                yield b","
            line_size += extra
            piece = seg.data[int(offs[i]) : int(offs[k]) - 1]
            yield piece
            line_size += len(piece)
            line_spans += k - i
            pending_comma = True
            i = k
    if cur_trace >= 0:
        if group_open:
            yield _GROUP_TAIL
        yield _LINE_TAIL
        if line_traces is not None:
            line_traces.append(layout.trace_ids[cur_trace])
        yield None


def encode_jsonl_lines(batch: SpanBatch, max_bytes: int | None = None, traces: list[bytes] | None = None) -> Iterator[bytes]:
    """Yield one OTLP/JSON ExportTraceServiceRequest line (newline included) per trace.

    With ``max_bytes`` a trace whose line would be longer is split over several lines (each a valid
    request for the same trace id), e.g. to stay under an HTTP body limit. ``traces`` gets the trace id of
    each line, appended before it is yielded.
    """
    pieces: list[bytes | memoryview] = []
    for piece in _json_pieces(batch, max_bytes, line_traces=traces):
        if piece is None:
            yield b"".join(pieces)
            pieces = []
        else:
            pieces.append(piece)


def write_jsonl(batch: SpanBatch, path_or_file: str | os.PathLike[str] | BinaryIO, append: bool = False) -> int:
    """Write the batch as OTLP/JSON lines; returns the number of lines (= traces) written.

    ``path_or_file`` is a path (created, or appended to with ``append=True``) or a binary file
    object, which is written to at its current position and left open.
    """
    if isinstance(path_or_file, (str, os.PathLike)):
        path = Path(path_or_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab" if append else "wb", buffering=1 << 20) as f:
            return _write_pieces(batch, f)
    return _write_pieces(batch, path_or_file)


# Below this many spans the output is a part or two: written inline, no thread to start.
_BACKGROUND_WRITE_ROWS = 4096


def file_part_bytes(table: pa.Table) -> int:
    """Part (and write batch) size for writing ``table`` to a file: 1/32 of the table's own bytes, between
    MIN_PART_BYTES and PART_BYTES."""
    return int(min(PART_BYTES, max(MIN_PART_BYTES, table.nbytes // 32)))


def file_chunk_rows(table: pa.Table) -> int:
    """Spans per pass for writing ``table`` to a file. A pass's value texts take about as many bytes as its
    rows of the table: a batch that one pass would hold whole (up to JSON_CHUNK_ROWS spans) is prepared in
    passes of MIN_JSON_CHUNK_ROWS, so its texts are never as large as the batch itself."""
    return JSON_CHUNK_ROWS if table.num_rows > JSON_CHUNK_ROWS else MIN_JSON_CHUNK_ROWS


def _write_pieces(batch: SpanBatch, f: IO[bytes]) -> int:
    lines = 0
    part_bytes = file_part_bytes(batch.table)
    writer = BackgroundWriter(f.write, batch_bytes=part_bytes) if batch.table.num_rows >= _BACKGROUND_WRITE_ROWS else None
    write = f.write if writer is None else writer.add
    # Pieces go straight to the file: a huge trace never exists as one bytes object.
    try:
        for piece in _json_pieces(batch, None, chunk_rows=file_chunk_rows(batch.table), part_bytes=part_bytes):
            if piece is None:
                lines += 1
            else:
                write(piece)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    if writer is not None:
        writer.close()
    return lines
