"""The span table as the OTLP encoders walk it: grouped into (trace, resource) runs, cut into chunks,
attribute columns compacted to their present values.

:func:`span_layout` orders the rows so each (trace, resource) group is one contiguous run (the
stitcher's output already is, and keeps its order); :func:`iter_segments` encodes the rows chunk by
chunk with an encoder's ``encode_chunk`` and hands out each group's slice of the fragments, so an
encoder never holds more than one chunk's bytes. :func:`attribute_values` and
:func:`attribute_slots` give every attribute column's present values and their place among their
row's attributes, which both the JSON and the protobuf encoders need.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from plasmient_trace.conventions import CORE_COLUMNS, SpanBatch, rows_of

__all__ = [
    "CHUNK_ROWS",
    "AttributeValues",
    "Segment",
    "SpanLayout",
    "attribute_kind",
    "attribute_slots",
    "attribute_values",
    "column_array",
    "id_matrix",
    "iter_segments",
    "span_layout",
]

CHUNK_ROWS = 1 << 14  # spans encoded per pass unless the encoder asks for another size

_CORE_NAMES = frozenset(CORE_COLUMNS.names)
# A small chunk in several runs is gathered at once: slices would leave every column in pieces for each
# encoder to combine again, column by column.
_TAKE_BELOW_ROWS = 4096
_MAX_SLICED_RUNS = 64  # a chunk of more runs than this is gathered with one take instead of sliced



@dataclass
class SpanLayout:
    """A span table's rows in an order where every (trace, resource) group is one contiguous run.

    The table itself is not reordered (that would copy all of it): ``rows`` (the table's row for
    each position, None when the table is already grouped) is applied one chunk at a time.
    """

    table: pa.Table  # as given (core columns in their canonical types); columns may have several chunks
    rows: np.ndarray | None  # int64 table row of each position, or None for the table's own order
    group_starts: np.ndarray  # int64, first position of each group, plus num_rows at the end
    group_trace: np.ndarray  # int64 trace ordinal of each group (0, 1, ... in grouped order)
    group_resource: np.ndarray  # int64 resource index of each group
    trace_ids: list[bytes]  # trace id of each trace ordinal
    resources: list[dict[str, Any]]

    @property
    def num_rows(self) -> int:
        return self.table.num_rows

    def chunk(self, start: int, stop: int) -> pa.Table:
        """The rows at positions [start, stop), in grouped order.

        Runs of consecutive table rows are zero-copy slices; only a chunk made of many short runs
        is gathered row by row.
        """
        if self.rows is None:
            return self.table.slice(start, stop - start)
        return rows_of(self.table, self.rows[start:stop], _MAX_SLICED_RUNS, _TAKE_BELOW_ROWS)


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


def _grouped_order(hi: np.ndarray, lo: np.ndarray, res: np.ndarray) -> np.ndarray:
    """Row order that makes each trace, and each resource within it, contiguous: traces in the order of
    their first row, resources by index, rows of one group in their own order."""
    rows = np.lexsort((res, lo, hi))  # stable: rows of one group keep their order
    h, l_ = hi[rows], lo[rows]
    change = np.empty(len(rows), dtype=bool)
    change[0] = True
    change[1:] = (h[1:] != h[:-1]) | (l_[1:] != l_[:-1])
    first_row = rows[change]  # each trace's first row: stable sort, so the smallest index of its run
    if len(first_row) < 2 or (np.diff(first_row) > 0).all():
        return rows  # trace ids happen to sort as the traces appear
    appearance = np.empty(len(first_row), np.int64)
    appearance[np.argsort(first_row)] = np.arange(len(first_row))
    return rows[np.argsort(appearance[np.cumsum(change) - 1], kind="stable")]


def _trace_keys(table: pa.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per row: the trace id as a 16-byte matrix, its two halves as uint64, and the resource index."""
    tid = id_matrix(table.column("trace_id"), 16)
    hi = np.ascontiguousarray(tid[:, :8]).view(">u8").ravel().astype(np.uint64)
    lo = np.ascontiguousarray(tid[:, 8:]).view(">u8").ravel().astype(np.uint64)
    return tid, hi, lo, table.column("resource_index").to_numpy().astype(np.int64)


def grouped_rows(table: pa.Table) -> np.ndarray | None:
    """The row order in which a span table is exported (traces in order of first appearance, each
    resource's spans together), or None when the table is in it already: what keeps a Parquet copy
    of the spans in the order of the JSON lines, whatever engine stitched them."""
    if table.num_rows == 0:
        return None
    _, hi, lo, res = _trace_keys(table)
    return None if _is_grouped(hi, lo, res) else _grouped_order(hi, lo, res)


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
    # A column with no value on any span (a CPU job's GPU attributes) would be gathered chunk by chunk only
    # to be skipped: left out once here.
    present = [name for name in table.column_names if name in _CORE_NAMES or table.column(name).null_count < n]
    if n and len(present) < table.num_columns:
        table = table.select(present)
    resources = list(batch.resources)
    if n == 0:
        return SpanLayout(table, None, np.zeros(1, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64), [], resources)

    tid, hi, lo, res = _trace_keys(table)

    # A table whose traces, and (trace, resource) groups within them, are already contiguous (the
    # stitcher's output) is used in its own order; anything else is grouped by (trace, resource), the
    # traces in the order they first appear. The stitcher puts every step's fleet and node spans first, so
    # its tables are usually not grouped, and its traces first appear in step order: the lines of a file
    # follow the steps, whatever engine stitched them. Either way the table is not copied: the columns
    # keep their chunks and each encoded chunk gathers (or combines) only its own rows.
    rows = None
    if not _is_grouped(hi, lo, res):
        rows = _grouped_order(hi, lo, res)
        hi, lo, res = hi[rows], lo[rows], res[rows]

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

    first_rows = trace_starts if rows is None else rows[trace_starts]
    trace_ids = [tid_row.tobytes() for tid_row in tid[first_rows]]
    return SpanLayout(
        table=table,
        rows=rows,
        group_starts=np.append(starts, n),
        group_trace=group_trace,
        group_resource=group_resource,
        trace_ids=trace_ids,
        resources=resources,
    )


@dataclass
class Segment:
    """Consecutive span fragments of one group inside one encoded part of a chunk."""

    group: int
    data: memoryview  # the part's fragment bytes
    offsets: np.ndarray  # int64, len = spans + 1, absolute positions in ``data``
    ends_group: bool


def iter_segments(layout: SpanLayout, encode_chunk: Callable[[pa.Table], pa.Array | Iterable[pa.Array]],
                  chunk_rows: int = CHUNK_ROWS) -> Iterator[Segment]:
    """Encode the layout's rows chunk by chunk and hand out per-group slices of the fragments.

    ``encode_chunk`` returns one fragment per row of its chunk, as one array or as consecutive parts
    (made one at a time, so only one part's bytes need exist while its segments are consumed).
    """
    n = layout.num_rows
    starts = layout.group_starts
    for c0 in range(0, n, chunk_rows):
        c1 = min(n, c0 + chunk_rows)
        out = encode_chunk(layout.chunk(c0, c1))
        p0 = c0
        for frags in [out] if isinstance(out, pa.Array) else out:
            if frags.null_count:
                raise AssertionError("span fragment encoder produced nulls")  # an encoder bug, never input
            p1 = p0 + len(frags)
            offs = np.frombuffer(frags.buffers()[1], dtype=np.int64)[frags.offset : frags.offset + len(frags) + 1]
            data = memoryview(frags.buffers()[2] or b"")
            g = int(np.searchsorted(starts, p0, side="right")) - 1
            while g < len(starts) - 1 and starts[g] < p1:
                a = max(int(starts[g]), p0) - p0
                b = min(int(starts[g + 1]), p1) - p0
                yield Segment(g, data, offs[a : b + 1], int(starts[g + 1]) <= p1)
                g += 1
            p0 = p1
        if p0 != c1:
            raise AssertionError(f"span fragment encoder returned {p0 - c0} rows for {c1 - c0}")  # an encoder bug


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
    valid: np.ndarray | None  # bool per chunk row: carries the attribute (None: every row does)
    values: Any  # numpy int64 / float64 / bool for numbers and bools, pa.LargeStringArray for strings
    ranks: np.ndarray | None = None  # position among its row's attributes (set by attribute_slots)
    _rows: np.ndarray | None = field(default=None, repr=False)

    @property
    def rows(self) -> np.ndarray:
        """int64 ascending row numbers that carry the attribute (made when first asked for)."""
        if self._rows is None:
            self._rows = (np.arange(len(self.values), dtype=np.int64) if self.valid is None
                          else np.flatnonzero(self.valid).astype(np.int64))
        return self._rows

    @property
    def dense(self) -> bool:
        """rows is 0..m-1 (typically: present on every row of the chunk), so row gathers become slices."""
        return self.valid is None or len(self.rows) == 0 or int(self.rows[-1]) == len(self.rows) - 1

    def take(self, per_row: np.ndarray) -> np.ndarray:
        """``per_row[rows]``, without the gather when dense."""
        return per_row[: len(self.values)] if self.dense else per_row[self.rows]


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
        if len(values):
            out.append(AttributeValues(name, kind, None if len(values) == n else valid, values))
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
