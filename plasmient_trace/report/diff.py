"""`plasmient diff A B`: what changed between two runs, per module pattern, op name and kernel name.

Each side is a span file (OTLP JSON lines as ``plasmient ingest --out`` writes, or the ``spans.parquet`` of
``--parquet``) or a profiler trace, ingested first. Both are cut into the same exclusive *units* of device
time, so every device-second of a side lands in exactly one row of each table:

- every kernel span, with its own busy/wasted seconds, FLOPs, ideal seconds and wasted $;
- the part of a non-kernel span's exclusive (``.self``) quantities that no kernel child carries: on an op or
  module, the kernels and spans the span budget folded (``[kernels not exported]``); on a step, its host gaps
  (``[device idle]``, its ``plasmient.idle_s``) and what the budget folded under it; on rank, node and
  fleet, the time spent waiting for a straggler.

A unit is named by its kernel name, by its nearest op (itself or an ancestor) and by the module pattern of its
nearest module (layer numbers as ``*``, as the culprit rows name them, so twelve layers are one row; its
backward and recompute passes, `` [backward]`` and `` [recompute]``, are rows apart from its forward). The
three tables sum the units per name: *device time* is the sum of ``plasmient.busy_s.self`` over the row's
units (concurrent kernels share a device-second, so nothing is counted twice), *wasted* the sum of
``plasmient.wasted_s.self``; a row's MFU is its ideal seconds over its busy seconds (MFU of the time its
kernels held the device, at each kernel's own peak), a lower bound where its coverage (busy share of kernels
with known FLOPs) is below 1 and unknown where it is 0. Rows are ranked by the absolute change in wasted
seconds. The CI gate compares step-weighted MFU: the step spans' MFU weighted by their device-seconds, as the
terminal summary's "all" row computes it. The command around this comparison is ``report.diff_cli``.

A live run samples: most of its steps run at step depth (``plasmient.sampled_depth`` = ``step``) and export
their step span alone, with no kernel, op or module below it and no exclusive device time. The units, the
tables and the totals of time, FLOPs and waste are therefore those of the *detailed* steps only (full depth
live, every step of an ingested trace), and ``per_step`` divides each side by its number of detailed steps,
the steps the units come from; step-weighted MFU is over every step that has one, carried ones included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from plasmient_trace.conventions import SpanBatch
from plasmient_trace.metrics.compute import flops_measured, zero_says_nothing
from plasmient_trace.report.frame import LEVEL_CODE, SpanFrame, weighted_mean
from plasmient_trace.stitch.culprits import IDLE_LABEL, module_pattern

DIMENSIONS = ("module", "op", "kernel")
NOT_EXPORTED = "[kernels not exported]"
STRAGGLER_WAIT = "[waiting for other ranks]"
NO_OP, NO_MODULE = "(no op)", "(no module)"
# Summed per row; None in a row = unknown on that side (every unit of the row lacked it).
QUANTITIES = ("busy_s", "wasted_s", "flops", "ideal_s", "covered_s", "wasted_usd")
_SELF_COLUMNS = {"busy_s": "plasmient.busy_s.self", "wasted_s": "plasmient.wasted_s.self",
                 "flops": "plasmient.flops.self", "wasted_usd": "plasmient.cost.wasted_usd.self"}
# Sums of known work: a row's (or a side's) 0 beside busy time of unknown work is unknown, as on the spans.
_WORK_SUMS = ("flops", "ideal_s")
# A residual below this share of the span's own value is floating-point noise, not folded work.
_RESIDUAL_RTOL = 1e-9
# Two sums of the same work in another order (one run at two span budgets; a row both sides hold whole) differ
# by float round-off, 6.7e-16 s of v100's 0.60 s of busy time (1e-15 relative), which printed as "+0.0 µs". A
# change below this share of the larger side is that noise: far above it, and below anything a trace measures
# (1 ns of 1000 s is 1e-12, and is kept).
ROUNDOFF_RTOL = 1e-12
EXIT_OK, EXIT_MFU_DROPPED, EXIT_BAD_INPUT = 0, 1, 2


def change(a: Any, b: Any) -> Any:
    """b - a, exactly 0 where it is the round-off of two sums of the same numbers (ROUNDOFF_RTOL); NaN (None
    for scalars) where either side is unknown."""
    if np.ndim(a) == 0 and np.ndim(b) == 0:
        if a is None or b is None:
            return None
        return 0.0 if abs(b - a) < ROUNDOFF_RTOL * max(abs(a), abs(b)) else b - a
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    d = b - a
    with np.errstate(invalid="ignore"):
        return np.where(np.abs(d) < ROUNDOFF_RTOL * np.maximum(np.abs(a), np.abs(b)), 0.0, d)


# ---- units and per-name sums ------------------------------------------------------------------


def _children_sum(frame: SpanFrame, values: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Per span, the sum of `values` over its direct children among `rows` (NaN children count as 0)."""
    child = rows[frame.parent[rows] >= 0]
    return np.bincount(frame.parent[child], weights=np.nan_to_num(values[child]), minlength=frame.n)


def _codes(arr: pa.Array) -> tuple[np.ndarray, pa.Array]:
    """Per row, an index into the returned dictionary of distinct values (-1 where null)."""
    enc = pc.dictionary_encode(arr)
    return enc.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64), enc.dictionary


def _module_labels(frame: SpanFrame) -> pa.Array:
    """Each module span's label as the culprit rows (and the span's name) give it: its path, and the pass that
    ran it, " [backward]" or " [recompute]" (a checkpointed forward run again in the backward), so a layer's
    forward, backward and recompute are three rows, never one. Where a span has no path, its name."""
    name = frame.strings("name")
    recompute = pc.fill_null(pc.ends_with(name, " [recompute]"), False)
    backward = pc.or_(pc.fill_null(pc.equal(frame.strings("plasmient.module.phase"), "backward"), False),
                      pc.fill_null(pc.ends_with(name, " [backward]"), False))
    suffix = pc.if_else(recompute, " [recompute]", pc.if_else(backward, " [backward]", ""))
    path = frame.strings("plasmient.module.path")
    return pc.if_else(pc.is_valid(path), pc.binary_join_element_wise(path, suffix, ""), name)


def unit_table(batch: SpanBatch) -> pa.Table:
    """The exclusive units of device time of a batch (module docstring), one row each, with their three names."""
    frame = SpanFrame(batch)
    level = frame.level
    kernel = np.nonzero(level == LEVEL_CODE["kernel"])[0]
    other = np.nonzero((level >= 0) & (level != LEVEL_CODE["kernel"]))[0]
    values: dict[str, np.ndarray] = {}
    for q, col in _SELF_COLUMNS.items():
        exclusive = frame.num(col)
        res = exclusive - _children_sum(frame, exclusive, kernel)
        res[np.abs(res) <= _RESIDUAL_RTOL * np.abs(exclusive)] = 0.0
        values[q] = np.where(level == LEVEL_CODE["kernel"], exclusive, res)
    # ideal_s and covered_s (busy seconds of kernels whose FLOPs are known: coverage * busy) have no .self:
    # a span's own share is its total minus its children's, as both are additive.
    children = np.nonzero(frame.parent >= 0)[0]
    covered = frame.num("plasmient.flops.coverage") * frame.num("plasmient.busy_s")
    for q, total in (("ideal_s", frame.num("plasmient.ideal_s")), ("covered_s", covered)):
        res = total - _children_sum(frame, total, children)
        res[np.abs(res) <= _RESIDUAL_RTOL * np.abs(total)] = 0.0
        values[q] = np.where(level == LEVEL_CODE["kernel"], total, res)

    # A step's residual is two units: its idle gaps (waste, no work) and the module/op spans the budget
    # folded under it (their work is the step's own in the exported tree).
    step = other[level[other] == LEVEL_CODE["step"]]
    idle_s = np.minimum(np.nan_to_num(frame.num("plasmient.idle_s")[step]), np.nan_to_num(values["wasted_s"][step]))
    with np.errstate(divide="ignore", invalid="ignore"):
        usd_per_s = np.where(values["wasted_s"][step] > 0, values["wasted_usd"][step] / values["wasted_s"][step], 0.0)
    idle = {q: np.where(np.isnan(values[q][step]), np.nan, 0.0) for q in QUANTITIES}  # no work; unknown stays unknown
    # dollars unknown on the step (no price) stay unknown on both of its units
    idle["wasted_s"] = idle_s
    idle["wasted_usd"] = np.where(np.isnan(values["wasted_usd"][step]), np.nan, idle_s * usd_per_s)
    folded = {q: values[q][step] - idle[q] for q in QUANTITIES}
    for q in QUANTITIES:
        folded[q][np.abs(folded[q]) <= _RESIDUAL_RTOL * np.abs(np.nan_to_num(values[q][step]))] = 0.0

    def nonzero(vals: dict[str, np.ndarray], n: int) -> np.ndarray:
        """Units with exclusive time, waste or FLOPs of their own (ideal and covered seconds ride along)."""
        return np.logical_or.reduce([np.nan_to_num(vals[q]) != 0 for q in _SELF_COLUMNS]) if n else np.zeros(0, bool)

    rest = other[level[other] != LEVEL_CODE["step"]]
    rest = rest[nonzero({q: values[q][rest] for q in QUANTITIES}, len(rest))]
    folded_keep = nonzero(folded, len(step))
    for q in QUANTITIES:  # a folded part with no time of its own stays with the step's idle unit
        idle[q] = np.where(folded_keep, idle[q], values[q][step])
    idle_keep = nonzero(idle, len(step))
    units = np.concatenate([kernel, rest, step[idle_keep], step[folded_keep]])
    unit_values = {q: np.concatenate([values[q][kernel], values[q][rest], idle[q][idle_keep], folded[q][folded_keep]])
                   for q in QUANTITIES}
    # the label a unit takes in all three dimensions where it is not a span's own (-1: by its span)
    special_code = np.concatenate([np.full(len(kernel) + len(rest), -1), np.zeros(int(idle_keep.sum()), np.int64),
                                   np.full(int(folded_keep.sum()), 2)])

    # Every label is a code into one vocabulary: the bracketed labels of time outside any kernel, op or
    # module first, then the span names and module patterns, so no Python runs per span.
    special = [IDLE_LABEL, STRAGGLER_WAIT, NOT_EXPORTED, NO_OP, NO_MODULE]
    name_code, names = _codes(frame.strings("name"))
    path = _module_labels(frame)
    path_code, paths = _codes(pc.if_else(pa.array(level == LEVEL_CODE["module"]), path, pa.scalar(None, pa.string())))
    patterns = pa.array([module_pattern(p) for p in paths.to_pylist()], pa.string())
    vocab = pa.concat_arrays([pa.array(special, pa.string()), names.cast(pa.string()), patterns])
    name_base, pattern_base = len(special), len(special) + len(names)

    lvl = level[units]
    own = np.where(special_code >= 0, special_code, np.where(lvl < LEVEL_CODE["step"], 1, 2))
    is_kernel = lvl == LEVEL_CODE["kernel"]
    k_code = np.where(is_kernel, name_base + name_code[units], own)
    o_of = frame.ancestor_at("op", include_self=True)[units]
    o_code = np.where(o_of >= 0, name_base + name_code[np.maximum(o_of, 0)], np.where(is_kernel, 3, own))
    m_of = frame.ancestor_at("module", include_self=True)[units]
    m_code = np.where(m_of >= 0, pattern_base + path_code[np.maximum(m_of, 0)],
                      np.where(lvl > LEVEL_CODE["step"], 4, own))
    columns: dict[str, Any] = {dim: vocab.take(pa.array(code)) for dim, code in
                               (("module", m_code), ("op", o_code), ("kernel", k_code))}
    columns["kernels"] = pa.array(is_kernel.astype(np.int64))
    for q in QUANTITIES:
        v = unit_values[q]
        columns[q] = pa.array(v, pa.float64(), mask=np.isnan(v))
    return pa.table(columns)


def per_name(units: pa.Table, dimension: str) -> pa.Table:
    """Units summed per name of one dimension; a quantity no unit of the row knows stays null."""
    aggs = [(q, "sum") for q in QUANTITIES] + [("kernels", "sum")]
    out = units.group_by(dimension).aggregate(aggs)
    return out.rename_columns([c.removesuffix("_sum") for c in out.column_names])


# ---- the comparison -----------------------------------------------------------------------------


@dataclass
class Side:
    """One input: its units, totals and step-weighted MFU."""

    label: str
    units: pa.Table
    mfu: float | None  # step spans' MFU weighted by their device-seconds; None when no step has one
    steps: int
    mfu_steps: int = 0  # the step spans that have an MFU: ``mfu`` is theirs alone
    detailed_steps: int = 0  # the step spans whose subtree was exported (not sampled at step depth): the units'

    def per_step(self) -> "Side":
        """The same side with every additive quantity divided by its number of detailed steps, the steps its
        units come from (kernel counts stay totals), for runs that profiled or sampled a different number of
        steps; unchanged when it has at most one."""
        if self.detailed_steps <= 1:
            return self
        units = self.units
        for q in QUANTITIES:
            i = units.schema.get_field_index(q)
            units = units.set_column(i, q, pc.divide(units.column(q), float(self.detailed_steps)))
        return Side(self.label, units, self.mfu, self.steps, self.mfu_steps, self.detailed_steps)

    def total(self, q: str) -> float | None:
        col = self.units.column(q)
        value = None if col.null_count == len(col) else float(pc.sum(col).as_py())
        if q in _WORK_SUMS and value is not None:
            # known FLOPs summing to 0 beside busy time of unknown work are unknown, as on the spans
            busy, covered = (pc.sum(self.units.column(c)).as_py() or 0.0 for c in ("busy_s", "covered_s"))
            if zero_says_nothing(value, busy, covered):
                return None
        return value


def side_from_batch(batch: SpanBatch, label: str) -> Side:
    frame = SpanFrame(batch)
    steps = np.nonzero(frame.is_level("step"))[0]
    step_mfu = frame.num("plasmient.mfu")[steps]
    mfu = weighted_mean(step_mfu, frame.device_s[steps]) if steps.size else None
    known = int((~np.isnan(step_mfu) & (frame.device_s[steps] > 0)).sum())
    # absent on every step of an ingested trace: all of them are detailed
    depth = frame.strings("plasmient.sampled_depth").take(pa.array(steps, pa.int64()))
    detailed = int(steps.size) - int(pc.sum(pc.equal(depth, "step").fill_null(False).cast(pa.int64())).as_py() or 0)
    return Side(label, unit_table(batch), mfu, int(steps.size), known, detailed)


def _side_values(table: pa.Table, q: str, present: np.ndarray) -> np.ndarray:
    """A summed column after the outer join: 0 where the name did not run on that side, NaN where unknown."""
    v = np.array(table.column(q).to_numpy(zero_copy_only=False), dtype=np.float64)
    v[~present] = 0.0
    return v


def compare(a: Side, b: Side, dimension: str) -> list[dict[str, Any]]:
    """Rows for one dimension, ranked by |change in wasted seconds| (unknown changes last)."""
    ta, tb = per_name(a.units, dimension), per_name(b.units, dimension)
    ta = ta.append_column("_a", pa.array(np.ones(ta.num_rows, dtype=bool)))
    tb = tb.append_column("_b", pa.array(np.ones(tb.num_rows, dtype=bool)))
    joined = ta.join(tb, keys=dimension, join_type="full outer", left_suffix=".a", right_suffix=".b",
                     coalesce_keys=True)
    if joined.num_rows == 0:
        return []
    in_a = joined.column("_a").fill_null(False).to_numpy(zero_copy_only=False).astype(bool)
    in_b = joined.column("_b").fill_null(False).to_numpy(zero_copy_only=False).astype(bool)
    col: dict[str, np.ndarray] = {}
    for q in QUANTITIES + ("kernels",):
        col[q + "_a"] = _side_values(joined, q + ".a", in_a)
        col[q + "_b"] = _side_values(joined, q + ".b", in_b)
    for s in ("a", "b"):
        unknown = zero_says_nothing(col[f"flops_{s}"], col[f"busy_s_{s}"], col[f"covered_s_{s}"])
        for q in _WORK_SUMS:
            col[f"{q}_{s}"] = np.where(unknown, np.nan, col[f"{q}_{s}"])
    for q in QUANTITIES + ("kernels",):
        col[q + "_delta"] = change(col[q + "_a"], col[q + "_b"])
    for s in ("a", "b"):
        busy, ideal, covered = col[f"busy_s_{s}"], col[f"ideal_s_{s}"], col[f"covered_s_{s}"]
        with np.errstate(divide="ignore", invalid="ignore"):
            coverage = np.where(busy > 0, covered / busy, np.nan)
            # No kernel of the row with known FLOPs, or known FLOPs of zero beside unknown ones: its MFU is
            # unknown, not 0 (the span rule, metrics.compute.flops_measured).
            col[f"mfu_{s}"] = np.where((busy > 0) & flops_measured(col[f"flops_{s}"], coverage), ideal / busy, np.nan)
            col[f"coverage_{s}"] = coverage
    col["mfu_delta"] = change(col["mfu_a"], col["mfu_b"])
    col["coverage_delta"] = change(col["coverage_a"], col["coverage_b"])
    key = np.abs(col["wasted_s_delta"])
    order = np.lexsort((-np.abs(np.nan_to_num(col["busy_s_delta"])), -np.nan_to_num(key, nan=-1.0)))
    names = joined.column(dimension).to_pylist()
    rows = []
    for i in order.tolist():
        row: dict[str, Any] = {"name": names[i], "in_a": bool(in_a[i]), "in_b": bool(in_b[i])}
        for k, v in col.items():
            x = float(v[i])
            row[k] = None if np.isnan(x) else x
        row["kernels_a"] = int(row["kernels_a"] or 0)
        row["kernels_b"] = int(row["kernels_b"] or 0)
        rows.append(row)
    return rows


def diff(a: Side, b: Side, per_step: bool = False) -> dict[str, Any]:
    """The whole comparison: totals per side and the ranked rows of each dimension (per step of each
    side with `per_step`)."""
    if per_step:
        a, b = a.per_step(), b.per_step()
    totals = {}
    for q in QUANTITIES:
        ta, tb = a.total(q), b.total(q)
        totals[q] = {"a": ta, "b": tb, "delta": change(ta, tb)}
    totals["mfu"] = {"a": a.mfu, "b": b.mfu, "delta": change(a.mfu, b.mfu)}
    totals["steps"] = {"a": a.steps, "b": b.steps, "delta": b.steps - a.steps}
    totals["mfu_steps"] = {"a": a.mfu_steps, "b": b.mfu_steps, "delta": b.mfu_steps - a.mfu_steps}
    totals["detailed_steps"] = {"a": a.detailed_steps, "b": b.detailed_steps, "delta": b.detailed_steps - a.detailed_steps}
    return {"a": a.label, "b": b.label, "per_step": per_step, "totals": totals,
            **{d: compare(a, b, d) for d in DIMENSIONS}}


def mfu_drop(result: dict[str, Any]) -> float | None:
    """Relative drop of B's step-weighted MFU below A's (0.05 = 5% lower); None when either is unknown."""
    a, b = result["totals"]["mfu"]["a"], result["totals"]["mfu"]["b"]
    if a is None or b is None or a <= 0:
        return None
    return -change(a, b) / a


# ---- the rows as a table (--parquet) and their documented schema ------------------------------------

_ROW_UNITS = {"busy_s": ("s", "exclusive busy device-seconds (sum of plasmient.busy_s.self of the row's units)"),
              "wasted_s": ("s", "exclusive wasted device-seconds (sum of plasmient.wasted_s.self)"),
              "flops": ("{flop}", "useful FLOPs (sum of plasmient.flops.self)"),
              "ideal_s": ("s", "seconds the FLOPs take at each kernel's peak (plasmient.ideal_s)"),
              "covered_s": ("s", "busy_s of kernels whose FLOPs are known (plasmient.flops.coverage * busy_s)"),
              "wasted_usd": ("USD", "exclusive wasted dollars (sum of plasmient.cost.wasted_usd.self)"),
              "kernels": ("{kernel}", "kernel spans in the row (a count, never divided per step)"),
              "mfu": ("1", "ideal_s / busy_s of the row, a lower bound where coverage < 1; null without busy time, "
                      "without a known peak, without any kernel whose FLOPs are known, or where the known FLOPs are "
                      "zero and coverage < 1; above 1 for kernels whose model FLOPs beat the peak in their time "
                      "(Winograd, FFT: plasmient.kernels.over_peak)"),
              "coverage": ("1", "covered_s / busy_s: the share of the row's busy time whose FLOPs are known")}


def _row_fields() -> list[pa.Field]:
    def f(name: str, typ: pa.DataType, unit: str, doc: str, nullable: bool = True) -> pa.Field:
        return pa.field(name, typ, nullable=nullable, metadata={"unit": unit, "description": doc})

    fields = [f("dimension", pa.string(), "", "module | op | kernel", False),
              f("position", pa.int64(), "", "1-based place in its dimension, largest |wasted_s_delta| first", False),
              f("name", pa.string(), "", "module pattern (layer numbers as *), op name or kernel name; "
                "[device idle], [waiting for other ranks], [kernels not exported], (no op), (no module) for time "
                "outside those", False),
              f("in_a", pa.bool_(), "", "the name ran in A", False), f("in_b", pa.bool_(), "", "the name ran in B", False)]
    for q, (unit, doc) in _ROW_UNITS.items():
        fields += [f(f"{q}_a", pa.float64(), unit, f"A: {doc}; 0 where the name did not run, null where unknown"),
                   f(f"{q}_b", pa.float64(), unit, f"B: {doc}"),
                   f(f"{q}_delta", pa.float64(), unit, "B - A; null where either side is unknown")]
    return fields


DIFF_ROW_SCHEMA = pa.schema(_row_fields())


def rows_table(result: dict[str, Any]) -> pa.Table:
    """Every row of every dimension as one Arrow table in DIFF_ROW_SCHEMA."""
    cols: dict[str, list[Any]] = {f.name: [] for f in DIFF_ROW_SCHEMA}
    for dim in DIMENSIONS:
        for pos, row in enumerate(result[dim], 1):
            for name in cols:
                cols[name].append(dim if name == "dimension" else pos if name == "position" else row[name])
    return pa.Table.from_pydict(cols, schema=DIFF_ROW_SCHEMA)


def diff_document() -> dict[str, Any]:
    """The row schema as schemas/ documents tables (name, type, nullable, unit, description)."""
    return {
        "description": "Rows of `plasmient diff A B` (--json per dimension, --parquet as one table): per module "
                       "pattern, op name and kernel name, the exclusive device time, waste, FLOPs and MFU of each side. "
                       "Totals in --json: the same quantities summed over all units, plus mfu = the step spans' MFU "
                       "weighted by their device-seconds, steps, mfu_steps = the step spans "
                       "that have an MFU (the others, e.g. live steps with nothing to carry, are not in mfu), and "
                       "detailed_steps = the step spans whose kernels, ops and modules were exported (a live run's "
                       "full-depth steps; every step of an ingested trace): the rows and the other totals are theirs "
                       "alone, and --per-step divides by this count.",
        "rows": [{"name": f.name, "type": str(f.type), "nullable": f.nullable,
                  **{k.decode(): v.decode() for k, v in (f.metadata or {}).items()}} for f in DIFF_ROW_SCHEMA],
    }
