"""A columnar view of a SpanBatch that the report views share: parent indices and ancestors by level.

The terminal summary and the HTML report both need "which op / module / step / rank is above this
kernel" for every kernel at once. Resolving parent links span by span is a Python loop per span, so
this module resolves them once with an Arrow hash join and walks ancestors level by level with numpy
pointer jumping (one vectorised pass per tree depth, not per span).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from plasmient_trace.conventions import BOUNDS, LEVELS, SpanBatch

LEVEL_CODE = {name: i for i, name in enumerate(LEVELS)}
BOUND_CODE = {name: i for i, name in enumerate(BOUNDS)}
# Trees deeper than this are treated as cyclic or corrupt; real traces are ~20 levels deep.
MAX_DEPTH = 256


def _codes(arr: pa.ChunkedArray | pa.Array, vocabulary: dict[str, int]) -> np.ndarray:
    """Map a string column onto small integer codes (-1 = null or unknown), without a per-row loop."""
    arr = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
    enc = pc.dictionary_encode(arr)
    dict_codes = np.array([vocabulary.get(v, -1) for v in enc.dictionary.to_pylist()] + [-1], dtype=np.int16)
    idx = enc.indices.fill_null(len(enc.dictionary)).to_numpy(zero_copy_only=False)
    return dict_codes[idx]


@dataclass
class SpanFrame:
    """Numpy views of one SpanBatch; every array has one entry per span, in table order."""

    batch: SpanBatch
    level: np.ndarray = field(init=False)  # int16 code into LEVELS, -1 unknown
    parent: np.ndarray = field(init=False)  # int64 row index of the parent span, -1 for roots/orphans
    trace: np.ndarray = field(init=False)  # int32 code into trace_ids
    trace_ids: list[bytes] = field(init=False)

    def __post_init__(self) -> None:
        table = self.batch.table
        self.n = table.num_rows
        self.level = _codes(table.column("plasmient.level"), LEVEL_CODE)
        enc = pc.dictionary_encode(table.column("trace_id").combine_chunks())
        self.trace_ids = enc.dictionary.to_pylist()
        self.trace = enc.indices.to_numpy(zero_copy_only=False).astype(np.int32)
        self.parent = self._resolve_parents(table)
        self._ancestors: dict[tuple[str, bool], np.ndarray] = {}

    def _resolve_parents(self, table: pa.Table) -> np.ndarray:
        # Span ids are only promised unique within a trace, so the join key is (trace, span id).
        rows = pa.array(np.arange(self.n, dtype=np.int64))
        trace = pa.array(self.trace)
        children = pa.table({"t": trace, "p": table.column("parent_span_id").combine_chunks(), "child": rows})
        spans = pa.table({"t": trace, "s": table.column("span_id").combine_chunks(), "pidx": rows})
        joined = children.join(spans, keys=["t", "p"], right_keys=["t", "s"], join_type="inner")
        parent = np.full(self.n, -1, dtype=np.int64)
        parent[joined.column("child").to_numpy()] = joined.column("pidx").to_numpy()
        parent[parent == np.arange(self.n)] = -1  # a span that names itself as parent is a root
        return parent

    # ---- columns -------------------------------------------------------------------------

    def num(self, name: str) -> np.ndarray:
        """A numeric attribute as float64 with NaN for null; all-NaN when the column is absent."""
        if name not in self.batch.table.column_names:
            return np.full(self.n, np.nan)
        col = self.batch.table.column(name)
        return np.array(col.cast(pa.float64(), safe=False).to_numpy(zero_copy_only=False), dtype=np.float64)  # writable copy (ns lose sub-µs digits)

    def strings(self, name: str) -> pa.Array:
        """A string column as one Arrow array (nulls where absent)."""
        if name not in self.batch.table.column_names:
            return pa.nulls(self.n, pa.string())
        return self.batch.table.column(name).combine_chunks()

    def codes(self, name: str, vocabulary: dict[str, int]) -> np.ndarray:
        return _codes(self.strings(name), vocabulary)

    @cached_property
    def start_ns(self) -> np.ndarray:
        return self.batch.table.column("start_ns").to_numpy().astype(np.int64)

    @cached_property
    def end_ns(self) -> np.ndarray:
        return self.batch.table.column("end_ns").to_numpy().astype(np.int64)

    @cached_property
    def wall_s(self) -> np.ndarray:
        """The span's device window (plasmient.device.window_s: what its ratios divide by), else
        plasmient.wall_s, else end - start (files from before device windows)."""
        wall = self.num("plasmient.device.window_s")
        missing = np.isnan(wall)
        wall[missing] = self.num("plasmient.wall_s")[missing]
        missing = np.isnan(wall)
        wall[missing] = (self.end_ns[missing] - self.start_ns[missing]) / 1e9
        return wall

    def window_extent_s(self, idx: np.ndarray) -> float:
        """The extent of the spans ``idx``'s device windows (device.start_ns to start + window_s), as a node's
        or the fleet's window is their ranks'; the drawn extent (end - start) where one of them has none
        (files from before device windows)."""
        table = self.batch.table
        if "plasmient.device.start_ns" in table.column_names:
            start = table.column("plasmient.device.start_ns").take(pa.array(idx))
            window = self.num("plasmient.device.window_s")[idx]
            if start.null_count == 0 and not np.isnan(window).any():
                start_ns = start.to_numpy().astype(np.int64)
                ends = start_ns + np.round(window * 1e9).astype(np.int64)
                return int(ends.max() - start_ns.min()) / 1e9
        return float((self.end_ns[idx].max() - self.start_ns[idx].min()) / 1e9)

    @cached_property
    def gpus(self) -> np.ndarray:
        """Devices a span is charged for; 1 where the attribute is absent (a single device)."""
        gpus = self.num("plasmient.gpus")
        gpus[np.isnan(gpus) | (gpus <= 0)] = 1.0
        return gpus

    @cached_property
    def device_s(self) -> np.ndarray:
        """wall * gpus: the device-seconds a span is charged for; the weight of every average here."""
        return self.wall_s * self.gpus

    @cached_property
    def rank(self) -> np.ndarray:
        """Global rank per span: the span attribute, else the resource's plasmient.rank, else -1."""
        rank = self.num("plasmient.rank")
        res_rank = np.array(
            [_as_float(r.get("plasmient.rank")) for r in self.batch.resources] or [np.nan], dtype=np.float64
        )
        ri = self.resource_index
        ok = (ri >= 0) & (ri < len(self.batch.resources))
        fill = np.isnan(rank) & ok
        rank[fill] = res_rank[ri[fill]]
        return np.where(np.isnan(rank), -1, rank).astype(np.int64)

    @cached_property
    def resource_index(self) -> np.ndarray:
        return self.batch.table.column("resource_index").to_numpy().astype(np.int64)

    # ---- tree ---------------------------------------------------------------------------

    def ancestor_at(self, level: str, include_self: bool = False) -> np.ndarray:
        """Row index of the nearest ancestor at `level` for every span (-1 where none)."""
        key = (level, include_self)
        if key not in self._ancestors:
            self._ancestors[key] = self._ancestor_at(LEVEL_CODE[level], include_self)
        return self._ancestors[key]

    def _ancestor_at(self, code: int, include_self: bool) -> np.ndarray:
        out = np.full(self.n, -1, dtype=np.int64)
        if include_self:
            mine = self.level == code
            out[mine] = np.nonzero(mine)[0]
        todo = np.nonzero(out < 0)[0]
        cur = self.parent[todo]
        keep = cur >= 0
        todo, cur = todo[keep], cur[keep]
        for _ in range(MAX_DEPTH):
            if todo.size == 0:
                break
            hit = self.level[cur] == code
            out[todo[hit]] = cur[hit]
            todo, cur = todo[~hit], self.parent[cur[~hit]]
            keep = cur >= 0
            todo, cur = todo[keep], cur[keep]
        return out

    def roots(self) -> np.ndarray:
        """Row indices of the spans with no parent in the batch, i.e. the top of each trace."""
        return np.nonzero(self.parent < 0)[0]

    def is_level(self, level: str) -> np.ndarray:
        return self.level == LEVEL_CODE[level]

    def traces_with(self, mask: np.ndarray) -> np.ndarray:
        """Per trace (index into trace_ids): whether any span of ``mask`` is in it."""
        return np.bincount(self.trace[mask], minlength=len(self.trace_ids)) > 0


def _as_float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return np.nan


def weighted_mean(values: np.ndarray, weights: np.ndarray) -> float | None:
    """Weight-averaged value over the entries where it is known; None when none is."""
    ok = ~np.isnan(values) & (weights > 0)
    total = float(weights[ok].sum())
    if not ok.any() or total <= 0:
        return None
    return float((values[ok] * weights[ok]).sum() / total)
