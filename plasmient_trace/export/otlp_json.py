"""OTLP/JSON lines: encode a SpanBatch the way the Collector's file exporter writes, and read such files back.

One line is one ``ExportTraceServiceRequest`` in the protobuf JSON mapping with the OTLP/JSON
exceptions (trace/span ids as lowercase hex, enums as integers), one line per trace id.

Encoding never builds per-span Python objects. Per chunk of spans, every column is turned into
byte *pieces* at once (hex ids and fixed-width heads with numpy, number texts with orjson's numpy
serializer, strings as they are), constants (keys, punctuation) are pooled once, and a numpy index
program says which pieces make up each span in which order; one Arrow ``take`` then lays every
span's bytes out contiguously (:class:`Pieces`). Only the per-trace/per-resource framing is Python.
The same machinery (grouping into (trace, resource) runs, chunking, pieces) serves
:mod:`.otlp_proto`.

Reading (:func:`read_jsonl`) walks the parsed JSON per span; it is not on the capture hot path.
"""

from __future__ import annotations

import base64
import gzip
import math
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, BinaryIO

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from plasmient_trace.conventions import CORE_COLUMNS, SCOPE_NAME, SPAN_TABLE_SCHEMA, SpanBatch, span_table_from_columns

__all__ = [
    "SPAN_KIND_INTERNAL",
    "encode_jsonl_lines",
    "write_jsonl",
    "read_jsonl",
    "batch_from_otlp_dicts",
    "any_value_json",
    "package_version",
]

SPAN_KIND_INTERNAL = 1  # every span we emit is an in-process measurement, never a remote call
CHUNK_ROWS = 1 << 14  # spans encoded per pass: ~40 MB of pieces, reused by the allocator instead of freshly faulted in

LB = pa.large_binary()  # int64 offsets: a chunk's fragments never hit the 2 GiB binary limit
_EMPTY = pa.scalar(b"", LB)
_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
_CORE_NAMES = frozenset(CORE_COLUMNS.names)


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
    except Exception:
        pass
    try:
        from importlib.metadata import version

        return version("plasmient-trace")
    except Exception:
        pass
    # A source checkout that was never pip-installed: the pyproject next to the package says it.
    try:
        import tomllib

        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
        return str(tomllib.loads(pyproject.read_text())["project"]["version"])
    except Exception:
        return "0+unknown"


# --------------------------------------------------------------------------------------------
# Shared columnar layout: sort into (trace, resource) groups, chunk, hand out fragments
# --------------------------------------------------------------------------------------------


@dataclass
class SpanLayout:
    """A span table sorted so every (trace, resource) group is one contiguous run of rows."""

    table: pa.Table  # sorted, single-chunk columns
    group_starts: np.ndarray  # int64, first row of each group, plus num_rows at the end
    group_trace: np.ndarray  # int64 trace ordinal of each group (0, 1, ... in sorted order)
    group_resource: np.ndarray  # int64 resource index of each group
    trace_ids: list[bytes]  # trace id of each trace ordinal
    resources: list[dict[str, Any]]

    @property
    def num_rows(self) -> int:
        return self.table.num_rows


def id_matrix(column: pa.ChunkedArray | pa.Array, width: int) -> np.ndarray:
    """(n, width) uint8 view of a fixed_size_binary(width) column."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if arr.type != pa.binary(width):
        arr = arr.cast(pa.binary(width))
    n = len(arr)
    if n == 0:
        return np.empty((0, width), dtype=np.uint8)
    raw = np.frombuffer(arr.buffers()[1], dtype=np.uint8)
    return raw[arr.offset * width : (arr.offset + n) * width].reshape(n, width)


def _is_grouped(hi: np.ndarray, lo: np.ndarray, res: np.ndarray) -> bool:
    """Whether every trace's rows, and every (trace, resource) group's rows, form one run."""
    n = len(hi)
    if n < 2:
        return True
    trace_change = (hi[1:] != hi[:-1]) | (lo[1:] != lo[:-1])
    group_change = trace_change | (res[1:] != res[:-1])
    trace_runs = np.flatnonzero(np.concatenate(([True], trace_change)))
    group_runs = np.flatnonzero(np.concatenate(([True], group_change)))
    traces = np.stack([hi[trace_runs], lo[trace_runs]], axis=1)
    groups = np.stack([hi[group_runs], lo[group_runs], res[group_runs].astype(np.uint64)], axis=1)
    return len(np.unique(traces, axis=0)) == len(traces) and len(np.unique(groups, axis=0)) == len(groups)


def span_layout(batch: SpanBatch) -> SpanLayout:
    """Group the batch into (trace, resource) runs, keeping the stitcher's order inside a group.

    Raises ValueError when a required column is missing or a resource index has no resource.
    """
    table = batch.table
    missing = [name for name in CORE_COLUMNS.names if name not in table.column_names]
    if missing:
        raise ValueError(f"span table lacks required column(s) {missing}")
    # Normalise core column types so every encoder can rely on them.
    for f in CORE_COLUMNS:
        col = table.column(f.name)
        if col.type != f.type:
            table = table.set_column(table.schema.get_field_index(f.name), f.name, col.cast(f.type))
    n = table.num_rows
    resources = list(batch.resources)
    if n == 0:
        return SpanLayout(table, np.zeros(1, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64), [], resources)

    tid = id_matrix(table.column("trace_id"), 16)
    hi = np.ascontiguousarray(tid[:, :8]).view(">u8").ravel().astype(np.uint64)
    lo = np.ascontiguousarray(tid[:, 8:]).view(">u8").ravel().astype(np.uint64)
    res = table.column("resource_index").to_numpy().astype(np.int64)

    # A table whose traces, and (trace, resource) groups within them, are already contiguous (the
    # stitcher's output) is used in its own order; anything else is sorted by (trace id, resource).
    if not _is_grouped(hi, lo, res):
        order = np.lexsort((res, lo, hi))  # stable: rows of one group keep their order
        table = table.take(pa.array(order))
        hi, lo, res = hi[order], lo[order], res[order]
    table = table.combine_chunks()

    trace_change = np.empty(n, dtype=bool)
    trace_change[0] = True
    trace_change[1:] = (hi[1:] != hi[:-1]) | (lo[1:] != lo[:-1])
    group_change = trace_change.copy()
    group_change[1:] |= res[1:] != res[:-1]
    starts = np.flatnonzero(group_change).astype(np.int64)
    trace_starts = np.flatnonzero(trace_change)
    group_trace = np.searchsorted(trace_starts, starts, side="right").astype(np.int64) - 1
    group_resource = res[starts]

    if group_resource.min() < 0 or group_resource.max() >= max(len(resources), 1):
        raise ValueError(
            f"span table refers to resource index {int(group_resource.max())} "
            f"but the batch has {len(resources)} resource(s)"
        )
    if not resources:
        resources = [{}]  # every span has resource_index 0 and no resource attributes

    trace_ids = [tid_row.tobytes() for tid_row in id_matrix(table.column("trace_id"), 16)[trace_starts]]
    return SpanLayout(
        table=table,
        group_starts=np.append(starts, n),
        group_trace=group_trace,
        group_resource=group_resource,
        trace_ids=trace_ids,
        resources=resources,
    )


@dataclass
class Segment:
    """Consecutive span fragments of one group inside one encoded chunk."""

    group: int
    data: memoryview  # the chunk's fragment bytes
    offsets: np.ndarray  # int64, len = spans + 1, absolute positions in ``data``
    ends_group: bool


def iter_segments(layout: SpanLayout, encode_chunk: Callable[[pa.Table], pa.Array], chunk_rows: int = CHUNK_ROWS) -> Iterator[Segment]:
    """Encode the layout's rows chunk by chunk and hand out per-group slices of the fragments."""
    n = layout.num_rows
    starts = layout.group_starts
    for c0 in range(0, n, chunk_rows):
        c1 = min(n, c0 + chunk_rows)
        frags = encode_chunk(layout.table.slice(c0, c1 - c0))
        if frags.null_count:
            raise AssertionError("span fragment encoder produced nulls")  # an encoder bug, never input
        m = len(frags)
        offs = np.frombuffer(frags.buffers()[1], dtype=np.int64)[frags.offset : frags.offset + m + 1]
        data = memoryview(frags.buffers()[2])
        g = int(np.searchsorted(starts, c0, side="right")) - 1
        while g < len(starts) - 1 and starts[g] < c1:
            a = max(int(starts[g]), c0) - c0
            b = min(int(starts[g + 1]), c1) - c0
            yield Segment(g, data, offs[a : b + 1], int(starts[g + 1]) <= c1)
            g += 1


# --------------------------------------------------------------------------------------------
# Vectorised byte-building helpers (shared with otlp_proto)
# --------------------------------------------------------------------------------------------


def join(parts: list[pa.Array | pa.Scalar], null_handling: str = "emit_null") -> pa.Array:
    """Row-wise concatenation of large_binary arrays/scalars (Arrow's binary_join_element_wise).

    Never use 'skip' where every part of a row can be null: pyarrow 26 then *drops the row*,
    returning a shorter array.
    """
    return pc.binary_join_element_wise(*parts, _EMPTY, null_handling=null_handling)


def hex_matrix(raw: np.ndarray) -> np.ndarray:
    """(n, k) bytes -> (n, 2k) lowercase hex ASCII."""
    out = np.empty((raw.shape[0], raw.shape[1] * 2), dtype=np.uint8)
    out[:, 0::2] = _HEX[raw >> 4]
    out[:, 1::2] = _HEX[raw & 0x0F]
    return out


def u64_be_matrix(values: np.ndarray) -> np.ndarray:
    """uint64 -> (n, 8) big-endian bytes: the 8-byte OTLP span id whose hex equals f'{v:016x}'."""
    return np.ascontiguousarray(values.astype(">u8")).view(np.uint8).reshape(-1, 8)


def u64_le_matrix(values: np.ndarray) -> np.ndarray:
    """int64/uint64/float64 -> (n, 8) little-endian bytes (protobuf fixed64 / double)."""
    dtype = "<f8" if values.dtype.kind == "f" else "<u8"
    return np.ascontiguousarray(values.astype(dtype)).view(np.uint8).reshape(-1, 8)


def varint_lengths(values: np.ndarray) -> np.ndarray:
    """Bytes of the protobuf varint of each uint64."""
    v = values.astype(np.uint64, copy=False)
    n = np.ones(v.shape, dtype=np.int64)
    for k in range(1, 10):
        longer = v >= np.uint64(1 << (7 * k))
        if not longer.any():
            break
        n += longer
    return n


class Varint:
    """A build_rows part: the protobuf varint of one uint64 per row."""

    __slots__ = ("values", "lengths")

    def __init__(self, values: np.ndarray) -> None:
        self.values = values.astype(np.uint64, copy=False)
        self.lengths = varint_lengths(self.values)


def _varint_bytes(v: Varint, k: int, sel: np.ndarray | None = None) -> np.ndarray:
    """Byte k of the varints (of the selected ones only, when ``sel`` is given)."""
    values, lengths = (v.values, v.lengths) if sel is None else (v.values[sel], v.lengths[sel])
    byte = ((values >> np.uint64(7 * k)) & np.uint64(0x7F)).astype(np.uint8)
    byte[lengths > k + 1] |= 0x80
    return byte


def varint_array(values: np.ndarray | Varint) -> pa.Array:
    """Protobuf varints of uint64 values as a large_binary array (no nulls)."""
    v = values if isinstance(values, Varint) else Varint(values)
    m = len(v.values)
    if m and int(v.lengths.max()) == 1:  # all below 128: the varint is the byte itself
        return pa.Array.from_buffers(LB, m, [None, pa.py_buffer(np.arange(m + 1, dtype=np.int64)), pa.py_buffer(v.values.astype(np.uint8))])
    offsets = np.zeros(m + 1, dtype=np.int64)
    np.cumsum(v.lengths, out=offsets[1:])
    # All bytes of all varints as an (m, longest) matrix, then the real ones picked in row order.
    width = int(v.lengths.max(initial=1))
    k = np.arange(width)
    matrix = ((v.values[:, None] >> (np.uint64(7) * k.astype(np.uint64))) & np.uint64(0x7F)).astype(np.uint8)
    matrix[k[None, :] < v.lengths[:, None] - 1] |= 0x80
    out = np.ascontiguousarray(matrix[k[None, :] < v.lengths[:, None]])
    return pa.Array.from_buffers(LB, m, [None, pa.py_buffer(offsets), pa.py_buffer(out)])


def build_rows(m: int, parts: list[bytes | np.ndarray | Varint]) -> pa.Array:
    """large_binary array whose row i concatenates the parts' row i.

    Parts are constants (bytes), per-row fixed-width bytes ((m, w) uint8) or per-row varints.
    Rows of equal width (the common case: all varints one byte) are filled column-block-wise.
    """
    uniform = all(not isinstance(p, Varint) or m == 0 or p.lengths.min() == p.lengths.max() for p in parts)
    if uniform:
        widths = [len(p) if isinstance(p, bytes) else (int(p.lengths[0]) if m else 1) if isinstance(p, Varint) else p.shape[1] for p in parts]
        width = sum(widths)
        out = np.empty((m, width), dtype=np.uint8)
        pos = 0
        for p, w in zip(parts, widths):
            if isinstance(p, bytes):
                out[:, pos : pos + w] = np.frombuffer(p, dtype=np.uint8)
            elif isinstance(p, Varint):
                for k in range(w):
                    out[:, pos + k] = _varint_bytes(p, k)
            else:
                out[:, pos : pos + w] = p
            pos += w
        offsets = np.arange(m + 1, dtype=np.int64) * width
        return pa.Array.from_buffers(LB, m, [None, pa.py_buffer(offsets), pa.py_buffer(out)])
    lengths = np.zeros(m, dtype=np.int64)
    for p in parts:
        lengths += len(p) if isinstance(p, bytes) else p.lengths if isinstance(p, Varint) else p.shape[1]
    offsets = np.zeros(m + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    out = np.empty(int(offsets[-1]), dtype=np.uint8)
    pos = offsets[:-1].copy()
    for p in parts:
        if isinstance(p, Varint):
            for k in range(int(p.lengths.max())):
                sel = p.lengths > k
                out[pos[sel] + k] = _varint_bytes(p, k, sel)
            pos += p.lengths
        else:
            block = np.frombuffer(p, dtype=np.uint8)[None, :] if isinstance(p, bytes) else p
            w = block.shape[1]
            if w:
                out[pos[:, None] + np.arange(w)] = block
            pos += w
    return pa.Array.from_buffers(LB, m, [None, pa.py_buffer(offsets), pa.py_buffer(out)])


def number_texts(values: np.ndarray, terminator: bytes) -> pa.Array:
    """Decimal text of each int64/float64, followed by ``terminator`` (one byte), as large_binary.

    orjson prints a numpy array (shortest round-trip doubles) about 5x faster than an Arrow cast;
    each separator it writes becomes the terminator, so the values are sliced out without copying.
    """
    m = len(values)
    if m == 0:
        return pa.array([], LB)
    buf = np.frombuffer(bytearray(orjson.dumps(np.ascontiguousarray(values), option=orjson.OPT_SERIALIZE_NUMPY)), dtype=np.uint8)
    seps = np.flatnonzero(buf == ord(","))
    if len(seps) != m - 1:
        raise AssertionError("number text has unexpected separators")  # numbers never contain ','
    term = terminator[0]
    buf[seps] = term
    buf[-1] = term
    offsets = np.empty(m + 1, dtype=np.int64)
    offsets[0] = 1
    offsets[1:m] = seps + 1
    offsets[m] = len(buf)
    return pa.Array.from_buffers(LB, m, [None, pa.py_buffer(offsets), pa.py_buffer(buf)])


_CONST = np.int64(1 << 48)  # piece ids at or above this name a constant, not a pooled array element


class Pieces:
    """Per-row sequences of byte pieces, concatenated for all rows by one ``take``.

    Pieces are constants or elements of pooled arrays. Each ``per_row``/``per_row_major`` call
    appends one more run of pieces to every row; ``build`` lays all runs out row by row, gathers the
    pieces in that order and returns one large_binary value per row that shares the gathered buffer.
    The work per span is a handful of numpy index operations and one memcpy per piece.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self._arrays: list[pa.Array] = []
        self._size = 0
        self._consts: dict[bytes, int] = {}
        self._const_list: list[bytes] = []
        self._runs: list[tuple[np.ndarray | None, np.ndarray]] = []  # (pieces per row or None for one, ids)

    def array(self, arr: pa.Array) -> np.ndarray:
        """Pool ``arr``; returns the piece id of each of its elements."""
        base = self._size
        self._arrays.append(arr if arr.type == LB else arr.cast(LB))
        self._size += len(arr)
        return np.arange(base, base + len(arr), dtype=np.int64)

    def const(self, value: bytes) -> np.int64:
        """Piece id of a constant (registered once per distinct value)."""
        i = self._consts.get(value)
        if i is None:
            i = self._consts[value] = len(self._const_list)
            self._const_list.append(value)
        return _CONST + np.int64(i)

    def const_value(self, piece_id: int) -> bytes:
        return self._const_list[piece_id - int(_CONST)]

    def per_row(self, ids: np.ndarray | np.int64) -> None:
        """One piece for every row (an id per row, or one constant id for all)."""
        self._runs.append((None, np.broadcast_to(np.asarray(ids, dtype=np.int64), (self.n,))))

    def per_row_major(self, counts: np.ndarray, ids: np.ndarray) -> None:
        """``counts[r]`` pieces for row r, given row after row in ``ids`` (no per-piece row/rank needed)."""
        self._runs.append((counts, ids))

    def build(self) -> pa.Array:
        n = self.n
        per_row = np.zeros(n, dtype=np.int64)
        for counts, _ in self._runs:
            per_row += 1 if counts is None else counts
        row_first = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(per_row, out=row_first[1:])
        total = int(row_first[-1])
        order = np.empty(total, dtype=np.int64)
        at = row_first[:-1].copy()  # next free position of each row
        for counts, ids in self._runs:
            if counts is None:
                order[at] = ids
                at += 1
            else:
                # Row r's pieces go to at[r], at[r] + 1, ...: increasing positions, streaming writes.
                run_first = np.zeros(n, dtype=np.int64)
                np.cumsum(counts[:-1], out=run_first[1:])
                order[np.repeat(at - run_first, counts) + np.arange(len(ids), dtype=np.int64)] = ids
                at += counts
        pool = pa.concat_arrays(self._arrays + [pa.array(self._const_list, LB)])
        is_const = order >= _CONST
        order[is_const] -= _CONST - self._size
        taken = pool.take(pa.array(order))
        piece_offsets = np.frombuffer(taken.buffers()[1], dtype=np.int64)[taken.offset : taken.offset + total + 1]
        row_offsets = np.ascontiguousarray(piece_offsets[row_first])
        return pa.Array.from_buffers(LB, n, [None, pa.py_buffer(row_offsets), taken.buffers()[2]])


def column_array(table: pa.Table, name: str) -> pa.Array:
    col = table.column(name)
    arr = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
    if pa.types.is_dictionary(arr.type):
        arr = arr.cast(arr.type.value_type)
    return arr


def attribute_kind(type_: pa.DataType) -> str:
    if pa.types.is_dictionary(type_):
        type_ = type_.value_type
    if pa.types.is_string(type_) or pa.types.is_large_string(type_):
        return "string"
    if pa.types.is_boolean(type_):
        return "bool"
    if pa.types.is_integer(type_):
        return "int"
    if pa.types.is_floating(type_):
        return "double"
    raise TypeError(f"span attribute column of type {type_} is not exportable (string, int, float, bool)")


@dataclass
class AttributeValues:
    """The present values of one attribute column within a chunk, compacted (no nulls)."""

    key: str
    kind: str  # string | int | double | bool
    rows: np.ndarray  # int64 ascending row numbers that carry the attribute
    values: Any  # numpy int64 / float64 / bool for numbers and bools, pa.LargeStringArray for strings
    ranks: np.ndarray | None = None  # position among its row's attributes (set by attribute_slots)

    @property
    def dense(self) -> bool:
        """rows is 0..m-1 (typically: present on every row of the chunk), so row gathers become slices."""
        return len(self.rows) == 0 or int(self.rows[-1]) == len(self.rows) - 1

    def take(self, per_row: np.ndarray) -> np.ndarray:
        """``per_row[rows]``, without the gather when dense."""
        return per_row[: len(self.rows)] if self.dense else per_row[self.rows]


def _validity(arr: pa.Array) -> np.ndarray | None:
    """Boolean validity of an array (None when it has no nulls), straight from its bitmap."""
    if arr.null_count == 0:
        return None
    bits = np.unpackbits(np.frombuffer(arr.buffers()[0], dtype=np.uint8), bitorder="little")
    return bits[arr.offset : arr.offset + len(arr)].view(bool)


def _fixed_values(arr: pa.Array, dtype: type) -> np.ndarray:
    """The value buffer of a fixed-width array as numpy (null slots hold whatever is there)."""
    return np.frombuffer(arr.buffers()[1], dtype=dtype)[arr.offset : arr.offset + len(arr)]


def attribute_values(chunk: pa.Table) -> list[AttributeValues]:
    """Every non-core column with at least one value, compacted, in table order.

    Non-finite doubles count as absent: OTLP/JSON cannot carry them as numbers, so both encoders
    drop them and the two outputs mean the same.
    """
    n = chunk.num_rows
    out = []
    for name in chunk.column_names:
        if name in _CORE_NAMES:
            continue
        arr = column_array(chunk, name)
        if arr.null_count == n:
            continue
        kind = attribute_kind(arr.type)
        valid = _validity(arr)
        if kind == "string":
            if not pa.types.is_large_string(arr.type):
                arr = arr.cast(pa.large_string())
            values: Any = arr if valid is None else arr.filter(pa.array(valid))
        elif kind == "bool":
            values = arr.to_numpy(zero_copy_only=False) if valid is None else arr.filter(pa.array(valid)).to_numpy(zero_copy_only=False)
        elif kind == "int":
            # uint64 above 2^63 wraps like the protobuf int64 varint does, so both encoders agree.
            ints = _fixed_values(arr if arr.type.bit_width == 64 else arr.cast(pa.int64()), np.int64)
            values = ints if valid is None else ints[valid]
        else:
            floats = _fixed_values(arr if arr.type == pa.float64() else arr.cast(pa.float64()), np.float64)
            finite = np.isfinite(floats)
            valid = finite if valid is None else valid & finite
            values = floats[valid]
        rows = np.arange(n, dtype=np.int64) if valid is None else np.flatnonzero(valid).astype(np.int64)
        if len(rows):
            out.append(AttributeValues(name, kind, rows, values))
    return out


def attribute_slots(n: int, attrs: list[AttributeValues]) -> tuple[np.ndarray, np.ndarray]:
    """Set each column's ``ranks`` (position among its row's attributes, table order).

    Returns (attributes per row, first slot of each row in row-major slot order, length n + 1).
    """
    counts = np.zeros(n, dtype=np.int64)
    for a in attrs:
        if a.dense:
            m = len(a.rows)
            a.ranks = counts[:m].copy()
            counts[:m] += 1
        else:
            a.ranks = counts[a.rows]
            counts[a.rows] += 1  # rows are unique within a column, so fancy-index += is exact
    first = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=first[1:])
    return counts, first


def string_data(arr: pa.Array) -> np.ndarray:
    """The UTF-8 bytes of a (large_)string array's values, as one uint8 array."""
    n = len(arr)
    if n == 0 or arr.buffers()[2] is None:
        return np.empty(0, dtype=np.uint8)
    width = np.int64 if pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type) else np.int32
    offs = np.frombuffer(arr.buffers()[1], dtype=width)[arr.offset : arr.offset + n + 1]
    return np.frombuffer(arr.buffers()[2], dtype=np.uint8)[int(offs[0]) : int(offs[-1])]


def needs_json_escape(arr: pa.Array) -> bool:
    """Whether any value has a quote, backslash or control character (usually none do)."""
    data = string_data(arr)
    if not len(data):
        return False
    if data.min() < 0x20:
        return True
    raw = data.tobytes()  # a memcpy; 'in' on bytes is memchr
    return b'"' in raw or b"\\" in raw


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
    if pc.any(pc.match_substring_regex(arr, r"[\x00-\x1f]")).as_py():
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


def _json_values(pieces: Pieces, a: AttributeValues) -> tuple[str, np.ndarray]:
    """Pool one attribute's value texts; returns (closing class, piece id per value)."""
    if a.kind == "double":
        return "double", pieces.array(number_texts(a.values, b"}"))
    if a.kind == "int":
        return "int", pieces.array(number_texts(a.values, b'"'))
    if a.kind == "bool":
        ids = np.where(a.values, pieces.const(b"true"), pieces.const(b"false"))
        return "bool", ids.astype(np.int64)
    if needs_json_escape(a.values):
        return "literal", pieces.array(json_strings(a.values))
    return "raw", pieces.array(a.values.cast(LB))


def json_span_fragments(chunk: pa.Table) -> pa.Array:
    """One OTLP/JSON span object per row, each followed by ',' (the consumer drops the group's last)."""
    n = chunk.num_rows
    pieces = Pieces(n)
    tid = hex_matrix(id_matrix(column_array(chunk, "trace_id"), 16))
    sid = hex_matrix(u64_be_matrix(column_array(chunk, "span_id").to_numpy()))
    parent_ids = column_array(chunk, "parent_span_id").to_numpy()
    name = column_array(chunk, "name")
    literal_names = needs_json_escape(name)
    name_open = b'","name":' if literal_names else b'","name":"'

    # Head: ids (+ parentSpanId, which roots omit as the Collector does) up to the name's opening.
    head = np.empty(n, dtype=np.int64)
    kids = parent_ids != 0
    for sel, parent_part in ((~kids, []), (kids, [b'","parentSpanId":"', hex_matrix(u64_be_matrix(parent_ids[kids]))])):
        rows = np.flatnonzero(sel)
        if len(rows):
            part = build_rows(len(rows), [b'{"traceId":"', tid[rows], b'","spanId":"', sid[rows], *parent_part, name_open])
            head[rows] = pieces.array(part)
    pieces.per_row(head)
    pieces.per_row(pieces.array(json_strings(name) if literal_names else name.cast(LB)))

    # Times: one orjson pass over interleaved (start, end), each text closed by its '"'.
    times = np.empty(2 * n, dtype=np.int64)
    times[0::2] = column_array(chunk, "start_ns").to_numpy()
    times[1::2] = column_array(chunk, "end_ns").to_numpy()
    time_ids = pieces.array(number_texts(times, b'"'))
    close_name = b"," if literal_names else b'",'
    pieces.per_row(pieces.const(close_name + b'"kind":%d,"startTimeUnixNano":"' % SPAN_KIND_INTERNAL))
    pieces.per_row(time_ids[0::2])
    pieces.per_row(pieces.const(b',"endTimeUnixNano":"'))
    pieces.per_row(time_ids[1::2])

    # Attributes: per value a prefix (what closes the previous KeyValue, ',', this key) and the value.
    attrs = attribute_values(chunk)
    counts, slot_first = attribute_slots(n, attrs)
    total = int(slot_first[-1])
    slot_class = np.empty(total, dtype=np.int64)  # closing class of each slot, row-major
    per_attr = []
    for a in attrs:
        cls, value_ids = _json_values(pieces, a)
        slot = a.take(slot_first) + a.ranks
        slot_class[slot] = _CLASSES.index(cls)
        per_attr.append((a, cls, value_ids, slot))
    if attrs:
        row_major = np.empty(2 * total, dtype=np.int64)  # prefix, value, prefix, value, ... row by row
        for a, cls, value_ids, slot in per_attr:
            key_open = b'{"key":' + orjson.dumps(a.key) + b',"value":{' + _VALUE_OPEN[cls]
            variants = np.array(
                [pieces.const(b',"attributes":[' + key_open)] + [pieces.const(_CLOSE_AFTER[c] + b"," + key_open) for c in _CLASSES],
                dtype=np.int64,
            )
            first = a.ranks == 0
            prev_class = slot_class[np.where(first, slot, slot - 1)]
            row_major[2 * slot] = np.where(first, variants[0], variants[1 + prev_class])
            row_major[2 * slot + 1] = value_ids
        pieces.per_row_major(2 * counts, row_major)
    closings = np.array([pieces.const(b"},")] + [pieces.const(_CLOSE_AFTER[c] + b']},') for c in _CLASSES], dtype=np.int64)
    has_attrs = counts > 0
    last_class = slot_class[np.maximum(slot_first[1:] - 1, 0)] if total else np.zeros(n, dtype=np.int64)
    pieces.per_row(np.where(has_attrs, closings[1 + last_class], closings[0]))
    return pieces.build()


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


def _json_pieces(batch: SpanBatch, max_bytes: int | None, chunk_rows: int = CHUNK_ROWS) -> Iterator[bytes | memoryview | None]:
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

    for seg in iter_segments(layout, json_span_fragments, chunk_rows):
        g = seg.group
        t = int(layout.group_trace[g])
        if t != cur_trace:
            if cur_trace >= 0:
                if group_open:
                    yield _GROUP_TAIL
                yield _LINE_TAIL
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
        yield None


def encode_jsonl_lines(batch: SpanBatch, max_bytes: int | None = None) -> Iterator[bytes]:
    """Yield one OTLP/JSON ExportTraceServiceRequest line (newline included) per trace.

    With ``max_bytes`` a trace whose line would be longer is split over several lines (each a valid
    request for the same trace id), e.g. to stay under an HTTP body limit.
    """
    pieces: list[bytes | memoryview] = []
    for piece in _json_pieces(batch, max_bytes):
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


def _write_pieces(batch: SpanBatch, f: IO[bytes]) -> int:
    lines = 0
    write = f.write
    # Pieces go straight to the file: a huge trace never exists as one bytes object.
    for piece in _json_pieces(batch, None):
        if piece is None:
            lines += 1
        else:
            write(piece)
    return lines


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def _decode_id(value: Any, nbytes: int) -> bytes:
    """OTLP/JSON ids are hex; protobuf's canonical JSON (json_format, MessageToDict) uses base64."""
    if not value:
        return b""
    if not isinstance(value, str):
        raise ValueError(f"id {value!r} is not a string")
    if len(value) == 2 * nbytes:
        try:
            return bytes.fromhex(value)
        except ValueError:
            pass
    try:
        raw = base64.b64decode(value, validate=True)
    except Exception:
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

    __slots__ = ("name", "kind", "field", "type", "rows", "values")

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
            raise ValueError(f"expected a number, got {v!r}")
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
                except ValueError as exc:
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
        self.core: dict[str, list[Any]] = {name: [] for name in CORE_COLUMNS.names}
        self.columns = {f.name: _Column(f.name, f.type) for f in SPAN_TABLE_SCHEMA if f.name not in _CORE_NAMES}
        self.origin: list[int] = []  # where each span came from (line or request number)
        self.resources: list[dict[str, Any]] = []
        self._resource_keys: dict[str, int] = {}

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
        n = len(self.core["name"])
        columns: dict[str, Any] = dict(self.core)
        for name, col in self.columns.items():
            if not col.rows:
                continue
            values = col.array(lambda row: locate(self.origin[row]))
            index = np.full(n, -1, dtype=np.int64)
            index[np.asarray(col.rows, dtype=np.int64)] = np.arange(len(col.rows), dtype=np.int64)
            columns[name] = values.take(pa.array(index, mask=index < 0))
        return SpanBatch(span_table_from_columns(columns, n), self.resources)


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


def _open_lines(path: str | os.PathLike[str] | IO[bytes]) -> tuple[str, IO[bytes], bool]:
    if isinstance(path, (str, os.PathLike)):
        p = Path(path)
        f: IO[bytes] = gzip.open(p, "rb") if p.suffix == ".gz" else open(p, "rb")
        return str(p), f, True
    return getattr(path, "name", "<stream>"), path, False


def read_jsonl(path: str | os.PathLike[str] | IO[bytes]) -> SpanBatch:
    """Read an OTLP/JSON lines file (ours or a Collector file exporter's) into a SpanBatch.

    Lines holding other signals (resourceMetrics/resourceLogs) are skipped; a line that is not JSON
    or not an ExportTraceServiceRequest raises ValueError naming the file and line number.
    """
    name, f, owned = _open_lines(path)
    acc = _SpanAccumulator()
    try:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                request = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise ValueError(f"{name}:{lineno}: not valid JSON ({exc})") from None
            if not isinstance(request, dict) or "resourceSpans" not in request:
                if isinstance(request, dict) and ({"resourceMetrics", "resourceLogs", "resourceProfiles"} & request.keys()):
                    continue
                raise ValueError(f"{name}:{lineno}: not an OTLP ExportTraceServiceRequest (no 'resourceSpans' key)")
            try:
                acc.add_request(request, lineno)
            except (ValueError, TypeError, KeyError, AttributeError) as exc:
                raise ValueError(f"{name}:{lineno}: invalid ExportTraceServiceRequest: {exc}") from None
    finally:
        if owned:
            f.close()
    return acc.batch(lambda line: f"{name}:{line}")

