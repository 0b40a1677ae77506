"""One rank's exported spans as span-table columns: ids, names, metrics and per-record attributes.

Spans are laid out in blocks (rank/step, modules, ops, kernels) and the exported rows are sorted, so each
block's exported rows are one contiguous run of the output: record attributes are concatenated block by
block, and a block exported whole is a zero-copy slice of its record table.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .. import conventions as cv
from ..metrics import compute as mc
from . import ids
from .collectives import collective_columns
from .culprits import StepCulprits, culprit_columns
from .inputs import CULPRIT_ROWS, LEVEL_CODE, RankInput, StitchOptions
from .joins import JoinedRank
from .nesting import depth_levels, fold_rows_to_parents
from .ownership import kernel_peaks
from .rank import RankTree, SpanMetrics
from .step_facts import step_columns, step_depth_rows

_NAME_LIMIT = 1024
# An op's recorded input shapes and types as span attributes: 1,000 inputs' worth of text. Past it the text
# ends in "…" (not JSON): a 180 MB 'Input Dims' became 121 MB of one span, sent in one OTLP request.
_ARGS_LIMIT = 16384


def _capped(text: pa.Array | pa.ChunkedArray, limit: int, mark: str = "") -> pa.Array | pa.ChunkedArray:
    """Strings longer than ``limit`` code units cut to it (with ``mark`` after); the column as it is when none is."""
    if not len(text) or text.null_count == len(text) or _longest_bytes(text) <= limit:
        return text  # a text of at most `limit` bytes has at most `limit` characters: nothing to measure
    length = pc.utf8_length(text)
    longest = pc.max(length).as_py()
    if longest is None or longest <= limit:
        return text
    cut = pc.utf8_slice_codeunits(text, 0, limit)
    return pc.if_else(pc.greater(length, limit), pc.binary_join_element_wise(cut, mark, ""), text) if mark else cut


def _longest_bytes(text: pa.Array | pa.ChunkedArray) -> int:
    """The longest value's UTF-8 byte count, read off the offsets (no pass over the characters)."""
    longest = 0
    for chunk in (text.chunks if isinstance(text, pa.ChunkedArray) else [text]):
        if not len(chunk):
            continue
        if not (pa.types.is_string(chunk.type) or pa.types.is_large_string(chunk.type)):
            return np.iinfo(np.int64).max  # another type: measured the long way
        width = np.int64 if pa.types.is_large_string(chunk.type) else np.int32
        offsets = np.frombuffer(chunk.buffers()[1], width)[chunk.offset:chunk.offset + len(chunk) + 1]
        longest = max(longest, int(np.diff(offsets).max()))
    return longest


# numeric span-table columns with nulls (one np.packbits for the validity, conventions.with_nulls)
masked, nan_to_null = cv.with_nulls, cv.nan_to_null
on_rows = cv.numbers_on_rows  # the columns that only step and rank spans carry


def repeated(value: str | None, n: int, where: np.ndarray | None = None) -> pa.Array:
    """A string column holding ``value`` on every row (or only where ``where``, null elsewhere), built by
    one take from a one-element array instead of a Python list per row."""
    if where is None:
        return pa.array([value], pa.string()).take(pa.array(np.zeros(n, np.int32)))
    return pa.array([value], pa.string()).take(pa.array(np.zeros(n, np.int32), mask=~np.asarray(where, bool)))


def _runs(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(starts, lengths) of the consecutive runs of sorted rows, or None when there are too many runs for
    slicing to beat a take (a budget that keeps every span but a few is a handful of runs)."""
    breaks = np.nonzero(np.diff(rows) != 1)[0] + 1
    if len(breaks) > max(16, len(rows) // 4096):
        return None
    bounds = np.concatenate([[0], breaks, [len(rows)]])
    return rows[bounds[:-1]], np.diff(bounds)


def take_rows(values: pa.Array, rows: np.ndarray) -> pa.Array:
    """values.take(rows) for sorted rows; mostly-consecutive rows are copied as whole slices."""
    runs = _runs(rows) if len(rows) else None
    if runs is None:
        return values.take(pa.array(rows))
    return pa.concat_arrays([values.slice(int(a), int(n)) for a, n in zip(*runs)])


def resource_for_rank(inp: RankInput, rank: int, node: str, options: StitchOptions) -> dict[str, Any]:
    res: dict[str, Any] = {"service.name": options.service_name or os.environ.get("OTEL_SERVICE_NAME") or "plasmient-trace"}
    res.update(options.extra_resource)
    res.update({k: v for k, v in inp.records.resource.items() if v is not None})
    res.setdefault("host.name", node)
    res["plasmient.job.id"] = options.job_id
    res["plasmient.rank"] = rank
    res["service.instance.id"] = f"{options.job_id}/{rank}"
    # the model the peaks come from; a peak the user gave for a device no table names has no model
    if inp.spec.model and inp.spec.source != "user":
        res.setdefault("plasmient.cpu.model" if inp.spec.device_type == "cpu" else "plasmient.gpu.model", inp.spec.model)
    devices = inp.records.devices
    if devices:
        res.setdefault("plasmient.gpu.model.reported", devices[0].name)
    if inp.records.source:
        res.setdefault("plasmient.source", inp.records.source)
    return res


def rank_columns(inp: RankInput, j: JoinedRank, tree: RankTree, met: SpanMetrics, export: np.ndarray, rank: int,
                 node: str, options: StitchOptions, culprits: StepCulprits) -> cv.SpanBatch:
    t = tree
    job = options.job_id
    n = len(t.level)
    n_steps = t.n_steps
    b = t.base
    steps = j.steps.astype(np.int64)
    step_of = steps[np.maximum(t.step_row, 0)]

    # ---- ids
    span_id = np.zeros(n, np.uint64)
    rank_ids = np.array([ids.rank_span_id(job, int(s), rank) for s in steps], np.uint64)
    step_ids = np.array([ids.step_span_id(job, int(s), rank) for s in steps], np.uint64)
    span_id[b["rank"]:b["rank"] + n_steps] = rank_ids
    span_id[b["step"]:b["step"] + n_steps] = step_ids
    for level, kind in (("module", ids.KIND_MODULE), ("op", ids.KIND_OP), ("kernel", ids.KIND_KERNEL)):
        hi = b[{"module": "op", "op": "kernel", "kernel": None}[level]] if level != "kernel" else n
        lo = b[level]
        rows = j.origin.of(level, np.arange(hi - lo))  # the whole rank's rows: a chunk's ids are the rank's
        span_id[lo:hi] = ids.child_span_ids(step_ids[np.maximum(t.step_row[lo:hi], 0)] if n_steps else np.zeros(0, np.uint64), kind, rows)
    node_ids = np.array([ids.node_span_id(job, int(s), node) for s in steps], np.uint64)
    parent_id = np.where(t.parent >= 0, span_id[np.maximum(t.parent, 0)], np.uint64(0)).astype(np.uint64)
    parent_id[b["rank"]:b["rank"] + n_steps] = node_ids

    # ---- names
    rs = inp.records
    step_names = rs.steps.column("name").to_pylist() if rs.steps.num_rows else ["capture"]
    if rs.steps.num_rows:
        order = np.argsort(rs.steps.column("start_ns").to_numpy(), kind="stable")
        step_names = [step_names[i] for i in order]
    kn = rs.kernels.column("name").combine_chunks().cast(pa.string()) if rs.kernels.num_rows else pa.array([], pa.string())
    n_ks = n - b["kernel"]
    if n_ks > len(kn):
        kn = pa.concat_arrays([kn, pa.array(["cpu"] * (n_ks - len(kn)), pa.string())])
    kn = _capped(kn, _NAME_LIMIT)
    names = pa.concat_arrays([
        pa.array([f"rank {rank}"] * n_steps + step_names, pa.string()),
        pa.array(t.module_labels, pa.string()),
        _capped(rs.ops.column("name").combine_chunks().cast(pa.string()), _NAME_LIMIT) if t.n_op
        else pa.array([], pa.string()),
        kn,
    ])

    sel = np.nonzero(export)[0]
    lv = t.level[sel]
    is_step = lv == LEVEL_CODE["step"]
    is_rank = lv == LEVEL_CODE["rank"]
    upper = is_step | is_rank
    m = len(sel)
    srow = np.maximum(t.step_row[sel], 0)
    # rows (of the exported ones) that carry the step-level columns: few, so those columns are scattered
    carriers, step_rows, rank_rows = np.flatnonzero(upper), np.flatnonzero(is_step), np.flatnonzero(is_rank)
    cols: dict[str, Any] = {}
    trace_of_step = pa.array([ids.trace_id(job, int(s)) for s in steps], pa.binary(16))
    cols["trace_id"] = trace_of_step.take(pa.array(srow))
    cols["span_id"] = span_id[sel]
    cols["parent_span_id"] = parent_id[sel]
    cols["resource_index"] = np.zeros(len(sel), np.int32)
    cols["name"] = take_rows(names, sel)
    cols["start_ns"] = t.start[sel]
    cols["end_ns"] = t.end[sel]
    cols["plasmient.level"] = pa.array(list(cv.LEVELS), pa.string()).take(pa.array(lv.astype(np.int64)))
    cols["plasmient.job.id"] = repeated(job, len(sel))
    cols["plasmient.step"] = step_of[sel]
    cols["plasmient.rank"] = np.full(len(sel), rank, np.int64)
    cols["plasmient.device.type"] = repeated(inp.spec.device_type, len(sel))
    dev = t.has_device[sel]
    cols["plasmient.gpus"] = masked(t.gpus[sel], ~dev)
    cols["plasmient.wall_s"] = (t.end[sel] - t.start[sel]) / 1e9
    cols["plasmient.device.window_s"] = nan_to_null(met.window_s[sel])
    cols["plasmient.device.start_ns"] = masked(t.win_start[sel], ~dev)

    def value(key: str, inclusive: bool) -> np.ndarray:
        """A column's total, or its exclusive value in the exported tree: what the budget folded under a span
        is its own, so nothing is lost between a span and its exported children."""
        return t.col(key) if inclusive else t.col(key, False) + t.folded_under(key, export)

    for name, key in (("plasmient.busy_s", "busy_s"), ("plasmient.wasted_s", "wasted_s")):
        cols[name] = masked(t.col(key)[sel], ~dev)
        cols[f"{name}.self"] = masked(value(key, False)[sel], ~dev)

    # A sum of known work that is 0 beside busy time of unknown work is unknown, not 0 (metrics.compute.
    # zero_says_nothing); in a step sampled at step depth, step_facts decides (measured or carried).
    sampled = step_depth_rows(t, sel)

    def unknown(values: np.ndarray, known: str, inclusive: bool) -> np.ndarray:
        busy_s, known_s = value("busy_s", inclusive)[sel], value(known, inclusive)[sel]
        return ~dev | (~sampled & mc.zero_says_nothing(values, busy_s, known_s))

    flops_absent = {}
    for inclusive, suffix in ((True, ""), (False, ".self")):
        nbytes = value("bytes", inclusive)[sel]
        cols[f"plasmient.bytes{suffix}"] = masked(nbytes, unknown(nbytes, "bytes_known_s", inclusive))
        # model FLOPs: recomputed forward work (activation checkpointing) is hardware work, reported apart
        flops = (value("flops", inclusive) - value("recompute_flops", inclusive))[sel]
        flops_absent[inclusive] = unknown(flops, "known_s", inclusive)
        cols[f"plasmient.flops{suffix}"] = masked(flops, flops_absent[inclusive])
    recomputed = t.col("recompute_flops")[sel]
    cols["plasmient.flops.recompute"] = masked(recomputed, ~dev | (recomputed <= 0))
    cols["plasmient.ideal_s"] = nan_to_null(np.where(t.peak_known & ~flops_absent[True],
                                                     (t.col("ideal_s") - t.col("recompute_ideal_s"))[sel], np.nan))
    cols["plasmient.idle_s"] = on_rows(t.col("idle_s")[sel[carriers]], carriers, m)
    cols["plasmient.kernel_s"] = on_rows(t.col("kernel_s")[sel[carriers]], carriers, m)
    _overlap_columns(cols, t, carriers, srow[carriers], m)
    k_span = np.flatnonzero((lv == LEVEL_CODE["kernel"]) & (sel < b["kernel"] + t.n_k))
    cols.update(collective_columns(t.comm_bw, rs.kernels, k_span, sel[k_span] - b["kernel"], carriers, srow[carriers], m))
    cols["plasmient.util.resident"] = nan_to_null(met.util[sel])
    cols["plasmient.mfu"] = nan_to_null(met.mfu[sel])
    cols["plasmient.hfu"] = nan_to_null(met.hfu[sel])
    cols["plasmient.flops.coverage"] = nan_to_null(met.coverage[sel])
    cols["plasmient.stall_fraction"] = nan_to_null(met.stall[sel])
    cols["plasmient.idle_fraction"] = nan_to_null(1.0 - met.util[sel])
    cols["plasmient.arithmetic_intensity"] = nan_to_null(met.intensity[sel])
    bound = met.bound[sel].astype(np.int64)
    cols["plasmient.bound"] = pa.array(list(cv.BOUNDS), pa.string()).take(pa.array(np.maximum(bound, 0), mask=bound < 0))
    cols["plasmient.cost.usd"] = nan_to_null(np.where(dev, met.cost[sel], np.nan))
    # met's exclusive dollars are the spans' own: the folded children's are added as for the seconds above
    per_s = t.price / 3600.0
    folded_charged = t.folded_under("charged_s", export)[sel]
    folded_wasted = t.folded_under("wasted_s", export)[sel]
    cols["plasmient.cost.usd.self"] = nan_to_null(np.where(dev, met.cost_self[sel] + per_s * folded_charged, np.nan))
    cols["plasmient.cost.wasted_usd"] = nan_to_null(np.where(dev, met.wasted_usd[sel], np.nan))
    cols["plasmient.cost.wasted_usd.self"] = nan_to_null(np.where(dev, met.wasted_usd_self[sel] + per_s * folded_wasted, np.nan))
    cols["plasmient.kernels"] = masked(t.col("kernels")[sel].astype(np.int64), ~dev & ~upper)

    # ---- what the budget folded, inclusive (the step: everything under it that is not a span)
    real_kernel = np.zeros(n, bool)
    real_kernel[b["kernel"]:b["kernel"] + t.n_k] = True
    not_exported = t.alive & ~export
    folded_k = real_kernel & not_exported
    # A CPU op's work (a synthetic kernel row, never a span of its own) is folded with its op span.
    cpu_work = np.arange(b["kernel"] + t.n_k, n)
    if len(cpu_work):
        op_of = t.parent[cpu_work]
        folded_k[cpu_work] = t.alive[cpu_work] & (op_of >= 0) & ~export[np.maximum(op_of, 0)]
    folded_spans = not_exported & ((t.level == LEVEL_CODE["module"]) | (t.level == LEVEL_CODE["op"]))
    if folded_k.any() or folded_spans.any():
        kernel_flops = t.col("flops") - t.col("recompute_flops")
        unknown_k = folded_k & mc.zero_says_nothing(kernel_flops, t.col("busy_s"), t.col("known_s"))
        fold = np.stack([folded_k.astype(float), np.where(folded_k, t.col("kernel_s"), 0.0),
                         np.where(folded_k, kernel_flops, 0.0), folded_spans.astype(float), unknown_k.astype(float)])
        fold_rows_to_parents(fold, t.parent, t.levels or depth_levels(t.depth), np.add)
        fold = fold[:, sel]
    else:  # the budget kept every span: nothing to add up
        fold = np.zeros((5, m))
    no_fold = (lv == LEVEL_CODE["kernel"])
    cols["plasmient.kernels.folded"] = masked(fold[0].astype(np.int64), no_fold)
    cols["plasmient.kernels.folded_s"] = masked(fold[1], no_fold)
    # 0 FLOPs of folded kernels some of whose FLOPs are unknown: unknown, as plasmient.flops is
    cols["plasmient.kernels.folded_flops"] = masked(fold[2], no_fold | ((fold[2] == 0) & (fold[4] > 0)))
    cols["plasmient.spans.folded"] = masked(fold[3].astype(np.int64), no_fold)

    # ---- step and rank counters
    cols["plasmient.kernels.over_peak"] = on_rows(np.asarray(t.over_peak_by_step, np.int64)[srow[step_rows]], step_rows, m)
    if j.step_ops_other_threads is not None:
        cols["plasmient.ops.other_threads"] = on_rows(j.step_ops_other_threads[srow[step_rows]], step_rows, m)
    k_parent_is_step = np.zeros(n, bool)
    kr = np.arange(b["kernel"], b["kernel"] + t.n_k)
    k_parent_is_step[kr] = t.alive[kr] & (t.level[np.maximum(t.parent[kr], 0)] == LEVEL_CODE["step"])
    unjoined = np.bincount(t.parent[k_parent_is_step], minlength=n)
    cols["plasmient.unjoined_kernels"] = on_rows(unjoined[sel[step_rows]], step_rows, m)
    first_step = step_rows[srow[step_rows] + j.origin.first_step == 0]
    cols["plasmient.kernels.outside_steps"] = on_rows(np.full(len(first_step), t.outside_kernels, np.int64), first_step, m)
    cols["plasmient.ops.outside_steps"] = on_rows(np.full(len(first_step), j.stats.ops_outside_steps, np.int64), first_step, m)
    for key in ("input.dropped_events", "input.clamped_events", "input.invalid_values"):
        count = inp.records.counters.get(key)
        if key == "input.clamped_events" and j.stats.kernels_clamped_to_launch:
            count = (count or 0) + j.stats.kernels_clamped_to_launch
        if count is not None:
            cols[f"plasmient.{key}"] = on_rows(np.full(len(first_step), int(count), np.int64), first_step, m)
    spec = inp.spec
    headline = spec.headline_peak()
    # a kernel that did known math carries the peak of its precision (fp32, tf32, 3xtf32, bf16...): its roof
    kernel_rows = np.flatnonzero(lv == LEVEL_CODE["kernel"])
    kernel_peak = kernel_peaks(inp, t.k_precision)[sel[kernel_rows] - b["kernel"]]
    own_peak = np.isfinite(kernel_peak) & (t.col("flops")[sel[kernel_rows]] > 0)
    cols["plasmient.peak_flops"] = on_rows(
        np.concatenate([np.full(len(carriers), np.nan if headline is None else headline, np.float64), kernel_peak[own_peak]]),
        np.concatenate([carriers, kernel_rows[own_peak]]), m)
    cols["plasmient.peak_bandwidth"] = on_rows(np.full(len(carriers), spec.bandwidth or np.nan, np.float64), carriers, m)
    cols["plasmient.peak.source"] = cv.scatter_rows(pa.array([spec.source] * len(rank_rows), pa.string()), rank_rows, m)
    offset = max(j.stats.clock_offset_ns.values(), default=0)
    cols["plasmient.clock.offset_ns"] = on_rows(np.full(len(rank_rows), offset, np.int64), rank_rows, m)
    cols["plasmient.sampled_depth"] = _step_depth(step_of[sel[step_rows]], step_rows, m, options.full_depth_steps)
    dropped = inp.records.counters.get("cupti.dropped_records")
    if dropped is not None:
        cols["plasmient.cupti.dropped_records"] = on_rows(np.full(len(step_rows), dropped, np.int64), step_rows, m)

    # a step's (and its rank span's) rows shown cut to CULPRIT_ROWS; its summary hands on all it has
    cols.update(culprit_columns(len(sel), {int(i): culprits.rows[int(srow[i])] for i in carriers},
                                {int(i): culprits.left_out_s[int(srow[i])] for i in carriers}, CULPRIT_ROWS))
    _per_record_columns(cols, sel, t, inp, j)
    step_columns(cols, t, sel)
    return cv.SpanBatch(table=cv.span_table_from_columns(cols, len(sel)), resources=[resource_for_rank(inp, rank, node, options)])


def _overlap_columns(cols: dict[str, Any], t: RankTree, carriers: np.ndarray, carrier_step: np.ndarray, n: int) -> None:
    """Communication/copy overlap, the idle split and the launch queue of each step, on its step and rank spans
    (the rows ``carriers`` of the n exported ones, of steps ``carrier_step``)."""
    o = t.overlap
    if o is None or t.n_steps == 0:
        return
    with np.errstate(divide="ignore", invalid="ignore"):
        comm_overlap = np.where(o.comm_total_s > 0, 1.0 - o.comm_exposed_s / o.comm_total_s, np.nan)
        copy_overlap = np.where(o.copy_total_s > 0, 1.0 - o.copy_exposed_s / o.copy_total_s, np.nan)
    idle = t.col("idle_s")[t.base["step"]:t.base["step"] + t.n_steps]
    idle_device = np.minimum(o.idle_device_s, idle)
    for name, values in (("plasmient.comm.total_s", o.comm_total_s), ("plasmient.comm.exposed_s", o.comm_exposed_s),
                         ("plasmient.comm.overlap", comm_overlap), ("plasmient.memcpy.total_s", o.copy_total_s),
                         ("plasmient.memcpy.exposed_s", o.copy_exposed_s), ("plasmient.memcpy.overlap", copy_overlap),
                         ("plasmient.idle.host_s", idle - idle_device), ("plasmient.idle.device_s", idle_device),
                         ("plasmient.launch_queue.mean", o.queue_mean)):
        cols[name] = on_rows(np.asarray(values, np.float64)[carrier_step], carriers, n)
    qmax = o.queue_max[carrier_step]
    known = ~np.isnan(qmax)
    cols["plasmient.launch_queue.max"] = on_rows(qmax[known].astype(np.int64), carriers[known], n)


def _step_depth(steps: np.ndarray, rows: np.ndarray, n: int, full: set[int] | None) -> pa.Array:
    """"full" or "step" on the step spans (rows ``rows`` of n, of steps ``steps``), null elsewhere."""
    values = pa.array(["full", "step"], pa.string())
    if full is None:
        codes = np.zeros(len(steps), np.int64)
    else:
        codes = np.where(np.isin(steps, np.fromiter(full, np.int64, len(full))), 0, 1)
    return cv.scatter_rows(values.take(pa.array(codes)), rows, n)


RECORD_ATTRIBUTES = (
    "plasmient.op.external_id", "plasmient.op.sequence_number", "plasmient.op.input_dims", "plasmient.op.input_types",
    "plasmient.op.dtype", "plasmient.op.flops_model", "plasmient.op.model_flops", "plasmient.op.kineto_flops",
    "plasmient.op.cpu_s", "thread.id", "plasmient.module.path", "plasmient.module.phase", "plasmient.correlation_id",
    "plasmient.kernel.kind", "plasmient.kernel.launch", "plasmient.gpu.device", "plasmient.gpu.stream",
    "plasmient.kernel.grid", "plasmient.kernel.block", "plasmient.kernel.registers_per_thread",
    "plasmient.kernel.shared_memory", "plasmient.kernel.graph_id", "plasmient.kernel.capture_op",
    "plasmient.kernel.capture_module",
)


def _rows_of(table: pa.Table, columns: list[str], rows: np.ndarray, full: bool) -> pa.Table:
    table = table.select(columns)
    if full:
        return table
    runs = _runs(rows) if len(rows) else None
    if runs is None:
        return table.take(pa.array(rows))
    # zero-copy slices: the span table combines each column's chunks once
    return pa.concat_tables([table.slice(int(a), int(n)) for a, n in zip(*runs)])


def _record_values(kind: str, inp: RankInput, j: JoinedRank, rows: np.ndarray, full: bool) -> dict[str, Any]:
    rs = inp.records
    vals: dict[str, Any] = {}
    if kind == "op":
        t = _rows_of(rs.ops, ["external_id", "sequence_number", "input_dims", "input_types", "kineto_flops", "start_ns", "end_ns", "tid"], rows, full)
        vals["plasmient.op.external_id"] = t.column("external_id")
        vals["plasmient.op.sequence_number"] = t.column("sequence_number")
        vals["plasmient.op.input_dims"] = _capped(t.column("input_dims"), _ARGS_LIMIT, "…")
        vals["plasmient.op.input_types"] = _capped(t.column("input_types"), _ARGS_LIMIT, "…")
        vals["plasmient.op.dtype"] = inp.op_dtype[rows].to_arrow()
        vals["plasmient.op.flops_model"] = inp.op_model[rows].to_arrow()
        vals["plasmient.op.model_flops"] = pa.array(inp.op_flops[rows], pa.float64(), mask=inp.op_model[rows].equals("none"))
        vals["plasmient.op.kineto_flops"] = t.column("kineto_flops")
        vals["plasmient.op.cpu_s"] = pc.divide(pc.subtract(t.column("end_ns"), t.column("start_ns")).cast(pa.float64()), pa.scalar(1e9, pa.float64()))
        vals["thread.id"] = t.column("tid")
    elif kind == "module":
        n_fwd = rs.modules.num_rows
        vals["plasmient.module.path"] = pa.array([j.module_path[r] for r in rows.tolist()], pa.string())
        vals["plasmient.module.phase"] = pa.array([j.module_phase[r] for r in rows.tolist()], pa.string())
        fwd = rows < n_fwd
        vals["plasmient.op.cpu_s"] = pa.array((j.module_end[rows] - j.module_start[rows]) / 1e9, mask=~fwd)
        tids = rs.modules.column("tid").to_numpy()[np.minimum(rows, max(n_fwd - 1, 0))] if n_fwd else np.zeros(len(rows), np.int64)
        vals["thread.id"] = pa.array(tids, mask=~fwd)
    else:
        t = _rows_of(rs.kernels, ["correlation_id", "kind", "device", "stream", "grid", "block", "registers_per_thread",
                                  "shared_memory", "graph_id", "capture_op", "capture_module"], rows, full)
        lrow = j.kernel_launch[rows]
        if rs.launches.num_rows:
            launch_names = rs.launches.column("name").take(pa.array(lrow, mask=lrow < 0))
        else:
            launch_names = pa.nulls(len(rows), pa.string())
        vals["plasmient.correlation_id"] = t.column("correlation_id")
        vals["plasmient.kernel.kind"] = t.column("kind")
        vals["plasmient.kernel.launch"] = launch_names
        vals["plasmient.gpu.device"] = t.column("device")
        vals["plasmient.gpu.stream"] = t.column("stream")
        vals["plasmient.kernel.grid"] = _dims_string(t.column("grid"))
        vals["plasmient.kernel.block"] = _dims_string(t.column("block"))
        vals["plasmient.kernel.registers_per_thread"] = t.column("registers_per_thread")
        vals["plasmient.kernel.shared_memory"] = t.column("shared_memory")
        vals["plasmient.kernel.graph_id"] = t.column("graph_id")
        vals["plasmient.kernel.capture_op"] = t.column("capture_op")
        vals["plasmient.kernel.capture_module"] = t.column("capture_module")
    return vals


def _per_record_columns(cols: dict[str, Any], sel: np.ndarray, t: RankTree, inp: RankInput, j: JoinedRank) -> None:
    parts: dict[str, list[Any]] = {name: [] for name in RECORD_ATTRIBUTES}
    b, n = t.base, len(t.level)
    blocks = [(b["rank"], b["module"], None), (b["module"], b["op"], "module"), (b["op"], b["kernel"], "op"),
              (b["kernel"], b["kernel"] + t.n_k, "kernel"), (b["kernel"] + t.n_k, n, None)]
    for lo, hi, kind in blocks:
        a, z = np.searchsorted(sel, [lo, hi])
        count = int(z - a)
        if count == 0:
            continue
        vals = _record_values(kind, inp, j, sel[a:z] - lo, count == hi - lo) if kind else {}
        for name in RECORD_ATTRIBUTES:
            value = vals.get(name)
            typ = cv.ATTRIBUTE_BY_NAME[name].type
            if value is None:
                parts[name].append(pa.nulls(count, typ))
            else:
                value = value.combine_chunks() if isinstance(value, pa.ChunkedArray) else value
                parts[name].append(value if value.type == typ else value.cast(typ))
    # One array per attribute now, its block pieces freed as it goes (a chunked column left for the span table
    # to combine would hold every piece and its combined copy at once).
    for name in RECORD_ATTRIBUTES:
        arrays = parts.pop(name)
        cols[name] = (arrays[0] if len(arrays) == 1 else pa.concat_arrays(arrays)) if arrays else pa.nulls(0, cv.ATTRIBUTE_BY_NAME[name].type)
        del arrays


def _dims_string(col: pa.ChunkedArray) -> pa.Array:
    arr = col.combine_chunks()
    if len(arr) == 0:
        return pa.array([], pa.string())
    valid = arr.is_valid().to_numpy(zero_copy_only=False)
    flat = arr.flatten()
    if len(flat) and flat.null_count == 0 and pa.types.is_fixed_size_list(arr.type) and arr.type.list_size == 3 and pa.types.is_integer(flat.type):
        # Launch dimensions repeat: format each distinct (x, y, z) once and take.
        xyz = np.ascontiguousarray(flat.to_numpy().astype(np.int64).reshape(-1, 3))
        packed = pa.FixedSizeBinaryArray.from_buffers(pa.binary(24), len(xyz), [None, pa.py_buffer(xyz)])
        enc = pc.dictionary_encode(packed)
        distinct = np.frombuffer(enc.dictionary.buffers()[1], np.int64, 3 * len(enc.dictionary)).reshape(-1, 3)
        text = pa.array([f"{x},{y},{z}" for x, y, z in distinct.tolist()], pa.string())
        code = enc.indices.to_numpy(zero_copy_only=False)[np.maximum(np.cumsum(valid) - 1, 0)]
        return text.take(pa.array(code, mask=~valid))
    flat = flat.cast(pa.string())
    x = flat.take(pa.array(np.arange(0, len(flat), 3)))
    y = flat.take(pa.array(np.arange(1, len(flat), 3)))
    z = flat.take(pa.array(np.arange(2, len(flat), 3)))
    joined = pc.binary_join_element_wise(x, y, z, ",")
    # flatten() drops null lists: scatter back
    idx = np.cumsum(valid) - 1
    return joined.take(pa.array(np.where(valid, idx, 0), mask=~valid))
