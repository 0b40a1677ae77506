"""Per-step facts the live capture knows and its records do not, turned into step attributes as the rows are built.

Live capture samples: most steps run at *step depth* (no op or module hooks), one in ``PLASMIENT_EVERY``
and every step with a never-seen input signature at *full depth*. What a step-depth step measured and
what it did not is a fact of the capture, given to the stitcher in :class:`StepFacts`:

* ``plasmient.flops.source`` on every step, rank, node and fleet span: ``measured`` (full depth: FLOPs from
  its own ops), ``carried`` (step depth: the FLOPs, recompute FLOPs, ideal seconds and coverage of the latest
  full-depth step with the same input-shape signature, carried forward; MFU is those ideal seconds over the
  step's *own* device window) or ``unknown`` (step depth, nothing to carry: no FLOPs, no MFU; also the
  steps of a signature whose last two full-depth measurements disagreed, :func:`keep_measured`).
* Device activity: a step-depth step on a GPU under CUPTI still has its kernels, hence busy time and util;
  one with no kernel recorded (a CPU, whose ops are its kernels, or the Kineto fallback) has neither, so its
  busy time, util and kernel counts are absent rather than zero.
* What needs per-kernel FLOPs (bytes, bound, waste, culprits) is absent on every step-depth step.
* NVML/GPM samples (``records.samples``) are averaged over each step span; CUPTI dropped-record counts are
  given per step.

Offline ingest passes no facts: every step is ``measured``. Hooks: :func:`with_step_facts` (end of
``build_rank_tree``: carried totals on the step and rank rows), :func:`step_metrics` (end of
``derive_metrics``), :func:`step_summary_columns` (the rank summaries), :func:`step_columns` (end of
``rank_columns``) and :func:`top_columns` (fleet and node rows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..conventions import nan_to_null, numbers_on_rows, scatter_rows
from ..metrics.compute import flops_measured
from ..records import NEEDS_CONFIRMATION

FLOPS_SOURCES = ("measured", "carried", "unknown")
MEASURED, CARRIED, UNKNOWN = range(3)

# What a step-depth step cannot know without per-kernel FLOPs, whether or not FLOPs were carried.
NEEDS_KERNEL_FLOPS = (
    "plasmient.flops.self", "plasmient.bytes", "plasmient.bytes.self", "plasmient.arithmetic_intensity",
    "plasmient.bound", "plasmient.stall_fraction", "plasmient.wasted_s", "plasmient.wasted_s.self",
    "plasmient.cost.wasted_usd", "plasmient.cost.wasted_usd.self", "plasmient.kernels.folded_flops",
    "plasmient.kernels.over_peak", "plasmient.culprit.module", "plasmient.culprit.op", "plasmient.culprit.kernel",
    "plasmient.culprit.rank", "plasmient.culprit.wasted_s", "plasmient.culprit.bound", "plasmient.culprit.suggestion",
    "plasmient.culprits", "plasmient.culprits.left_out_s")
# What a step carries, or lacks when it carries nothing.
FLOPS_COLUMNS = ("plasmient.flops", "plasmient.flops.recompute", "plasmient.ideal_s", "plasmient.mfu",
                 "plasmient.hfu", "plasmient.flops.coverage")
# Device time: absent on a step-depth step with no kernel recorded (a CPU's ops are its kernels).
NEEDS_DEVICE_ACTIVITY = (
    "plasmient.busy_s", "plasmient.busy_s.self", "plasmient.util.resident", "plasmient.idle_fraction",
    "plasmient.idle_s", "plasmient.idle.host_s", "plasmient.idle.device_s", "plasmient.kernel_s", "plasmient.kernels",
    "plasmient.kernels.folded", "plasmient.kernels.folded_s", "plasmient.unjoined_kernels", "plasmient.comm.total_s",
    "plasmient.comm.exposed_s", "plasmient.comm.overlap", "plasmient.memcpy.total_s", "plasmient.memcpy.exposed_s",
    "plasmient.memcpy.overlap", "plasmient.launch_queue.mean", "plasmient.launch_queue.max")
SAMPLE_ATTRIBUTES = {"nvml.utilization.gpu": "plasmient.util.nvml", "gpm.sm_active": "plasmient.gpm.sm_active",
                     "gpm.tensor_active": "plasmient.gpm.tensor_active", "gpm.dram_bw_util": "plasmient.gpm.dram_bw_util"}


@dataclass
class CarriedWork:
    """What one full-depth step measured: the work every later step with its input signature repeats."""

    step: int
    flops: float              # model FLOPs (recompute excluded)
    ideal_s: float            # model ideal seconds at peak; NaN: peak unknown
    recompute_flops: float
    recompute_ideal_s: float
    coverage: float           # share of its busy time with known FLOPs
    disputed: bool = False    # the measurement of its signature before it found other work: carry nothing


@dataclass
class StepFacts:
    """What the capture knows about each step beyond its records (``StitchOptions.step_facts``)."""

    signatures: dict[int, str] = field(default_factory=dict)       # step -> input-shape signature
    measured: dict[str, CarriedWork] = field(default_factory=dict)  # signature -> latest full-depth step (earlier batches)
    dropped_records: dict[int, int] | None = None                   # step -> CUPTI records dropped during it
    # full-depth steps whose measurement is not carried (torch.compile traced during them: compiler ops)
    not_carried: set[int] = field(default_factory=set)
    # steps opened at their first module call, not at a step boundary (step 0, the first after an explicit
    # step): plasmient.step.opened_at
    opened_at_call: set[int] = field(default_factory=set)
    # (step, end of its device window) of the last step an earlier batch stitched: the next step's tile
    # opens there, as it would had both been stitched together (stitch.windows)
    preceding: tuple[int, int] | None = None

    def tile_floor(self, first_step: int) -> int | None:
        """Where the tile of this batch's first step opens, when the step before it was in an earlier batch."""
        if self.preceding is None or self.preceding[0] != first_step - 1:
            return None
        return self.preceding[1]

    def remember(self, summaries: list[Any]) -> None:
        """Keep what this batch's full-depth steps measured (the stitcher's rank summaries) for later batches,
        and where its last step's device window ended."""
        if summaries:
            last = max(summaries, key=lambda s: s.step)
            self.preceding = (int(last.step), int(last.window_end_ns))
        for s in sorted(summaries, key=lambda s: s.step):
            sig = self.signatures.get(int(s.step))
            if sig is None or getattr(s, "flops_source", "measured") != "measured" or int(s.step) in self.not_carried:
                continue
            work = _work_of(int(s.step), s.flops, s.ideal_s, s.recompute_flops, s.recompute_ideal_s,
                            s.known_s / s.busy_s if s.busy_s > 0 else float("nan"))
            if work is not None:
                keep_measured(self.measured, sig, work)


# Two successive full-depth steps of one signature whose FLOPs differ by more than this show that the signature
# does not decide the step's work (state it cannot see: a KV cache whose position the model keeps, data-dependent
# control flow): its steps carry nothing until two successive measurements agree again (a first step that
# differs from the rest: gradients assigned, not yet accumulated), rather than a count wrong for some of them.
CARRY_AGREEMENT = 0.01


def keep_measured(measured: dict[str, CarriedWork], sig: str, work: CarriedWork) -> None:
    """Remember ``work`` as what ``sig``'s steps do, disputed when the measurement before it disagrees (or
    there is none, for a signature that needs confirmation)."""
    before = measured.get(sig)
    total = work.flops + work.recompute_flops
    if before is None:
        disputed = sig.endswith(NEEDS_CONFIRMATION)
    else:
        disputed = abs(total - (before.flops + before.recompute_flops)) > CARRY_AGREEMENT * max(abs(total), 1.0)
    measured[sig] = replace(work, disputed=disputed)


def _work_of(step: int, flops: float, ideal: float, rc_flops: float, rc_ideal: float, coverage: float) -> CarriedWork | None:
    """A measurement worth carrying: FLOPs known on some of its busy time, and a measurement
    (``metrics.compute.flops_measured``: not zero known FLOPs beside unknown ones)."""
    if not (np.isfinite(flops) and np.isfinite(coverage) and bool(flops_measured(flops + np.nan_to_num(rc_flops), coverage))):
        return None
    return CarriedWork(step, float(flops), float(ideal), float(rc_flops), float(rc_ideal), float(coverage))


@dataclass
class ResolvedSteps:
    """Per step row of one rank (time order): depth, where its FLOPs come from, what it carries."""

    full: np.ndarray             # bool: sampled at full depth
    source: np.ndarray           # int8 code into FLOPS_SOURCES
    device_measured: np.ndarray  # bool: its device activity was recorded
    coverage: np.ndarray         # carried coverage (NaN where not carried)
    dropped: np.ndarray | None   # int64 per step row, -1 unknown
    samples: dict[str, np.ndarray]  # span attribute -> mean per step row (NaN none)
    opened_at_call: np.ndarray | None = None  # bool per step row: opened at its first module call (None: ingest)


def with_step_facts(tree: Any, options: Any, steps: np.ndarray, samples: pa.Table) -> Any:
    """Resolve each step's facts onto ``tree.facts``; carried steps get the carried work in the step and
    rank rows of ``tree.total`` (unknown ones NaN FLOPs), so every consumer of the totals agrees."""
    from .rank import COL

    t = tree
    n = t.n_steps
    steps = np.asarray(steps, np.int64)
    full_set = options.full_depth_steps
    full = np.ones(n, bool) if full_set is None else np.isin(steps, np.fromiter(full_set, np.int64, len(full_set)))
    live = getattr(options, "step_facts", None) is not None
    facts: StepFacts = getattr(options, "step_facts", None) or StepFacts()
    real = t.k_rows[t.k_rows < t.n_k]
    has_kernels = np.bincount(t.step_row[t.base["kernel"] + real], minlength=n)[:n] > 0 if n else np.zeros(0, bool)
    source = np.where(full, MEASURED, UNKNOWN).astype(np.int8)
    coverage = np.full(n, np.nan)
    total = t.total  # quantity-major: total[COL[q], row]
    known = dict(facts.measured)
    # no signatures (ingest, or steps without module calls): step-depth steps have nothing to carry
    order = np.argsort(steps, kind="stable") if facts.signatures else np.nonzero(~full)[0]
    for s in order:  # a step carries from the latest full step before it
        sig = facts.signatures.get(int(steps[s]))
        r = t.base["step"] + s
        if full[s]:
            busy = total[COL["busy_s"], r]
            cov = total[COL["known_s"], r] / busy if busy > 0 else np.nan
            model = total[COL["flops"], r] - total[COL["recompute_flops"], r]
            ideal = total[COL["ideal_s"], r] - total[COL["recompute_ideal_s"], r] if t.peak_known else np.nan
            work = _work_of(int(steps[s]), model, ideal, total[COL["recompute_flops"], r], total[COL["recompute_ideal_s"], r], cov)
            if sig is not None and work is not None and int(steps[s]) not in facts.not_carried:
                keep_measured(known, sig, work)
            continue
        work = known.get(sig) if sig is not None else None
        work = None if work is not None and work.disputed else work
        for row in (t.base["rank"] + s, r):
            if work is None:
                total[[COL["flops"], COL["ideal_s"]], row] = np.nan
                continue
            total[COL["flops"], row] = work.flops + work.recompute_flops
            total[COL["recompute_flops"], row] = work.recompute_flops
            total[COL["ideal_s"], row] = work.ideal_s + work.recompute_ideal_s
            total[COL["recompute_ideal_s"], row] = work.recompute_ideal_s
        if work is not None:
            source[s] = CARRIED
            coverage[s] = work.coverage
    dropped = None
    if facts.dropped_records is not None:
        dropped = np.array([facts.dropped_records.get(int(x), -1) for x in steps], np.int64)
    t.facts = ResolvedSteps(full=full, source=source, device_measured=full | has_kernels, coverage=coverage,
                            dropped=dropped, samples=_sample_means(samples, t.start[t.base["step"]:t.base["step"] + n],
                                                                   t.end[t.base["step"]:t.base["step"] + n]),
                            opened_at_call=np.isin(steps, np.fromiter(facts.opened_at_call, np.int64,
                                                                      len(facts.opened_at_call))) if live else None)
    return t


# How far back a sample reaches. NVML's utilization.gpu is the share of its own sample period (1/6 s to
# 1 s, by product) with a kernel running, so a reading speaks for a step only if the step holds the whole
# period: shorter steps get none rather than a stale value (an H200 read 0% on 5-165 ms steps whose
# kernels ran 0.4-29% of the time). GPM metrics are exact over the 20 ms between two samples.
SAMPLE_LOOKBACK_NS = {"nvml.utilization.gpu": 1_000_000_000}


def _sample_means(samples: pa.Table, start: np.ndarray, end: np.ndarray) -> dict[str, np.ndarray]:
    """Mean of each NVML/GPM metric over the samples that cover only time inside each step's [start, end]
    (vectorised: cumulative sums)."""
    out: dict[str, np.ndarray] = {}
    if samples is None or not samples.num_rows or not len(start):
        return out
    ts = samples.column("timestamp_ns").to_numpy()
    metric = samples.column("metric").to_numpy(zero_copy_only=False)
    value = samples.column("value").to_numpy()
    for name, attr in SAMPLE_ATTRIBUTES.items():
        sel = metric == name
        if not sel.any():
            continue
        order = np.argsort(ts[sel], kind="stable")
        t, v = ts[sel][order], value[sel][order]
        csum = np.concatenate([[0.0], np.cumsum(v)])
        lo = np.searchsorted(t, start + SAMPLE_LOOKBACK_NS.get(name, 0), side="left")
        hi = np.searchsorted(t, end, side="right")
        cnt = np.maximum(hi - lo, 0)
        out[attr] = np.where(cnt > 0, (csum[hi] - csum[np.minimum(lo, hi)]) / np.maximum(cnt, 1), np.nan)
    return out


def step_metrics(tree: Any, met: Any) -> Any:
    """Ratios of the step and rank rows of step-depth steps: util only where device activity was
    recorded; MFU/HFU from carried ideal seconds over the step's own window, at most its util (or 1)."""
    from .rank import COL

    f = getattr(tree, "facts", None)
    if f is None or f.full.all():
        return met
    t = tree
    for lo in (t.base["rank"], t.base["step"]):
        rows = lo + np.nonzero(~f.full)[0]
        s = rows - lo
        util = np.where(f.device_measured[s], met.util[rows], np.nan)
        cap = np.where(np.isfinite(util), util, 1.0)
        device_s = met.window_s[rows] * t.gpus[rows]
        carried = (f.source[s] == CARRIED) & t.peak_known & (device_s > 0) & (f.coverage[s] > 0)
        ideal_hw = t.total[COL["ideal_s"], rows]
        ideal = ideal_hw - t.total[COL["recompute_ideal_s"], rows]
        with np.errstate(divide="ignore", invalid="ignore"):
            met.mfu[rows] = np.where(carried, np.minimum(ideal / device_s, cap), np.nan)
            met.hfu[rows] = np.where(carried, np.minimum(ideal_hw / device_s, cap), np.nan)
        met.util[rows] = util
        met.coverage[rows] = np.where(f.source[s] == CARRIED, f.coverage[s], np.nan)
        met.stall[rows] = np.nan
        met.intensity[rows] = np.nan
        met.bound[rows] = -1
        met.wasted_usd[rows] = np.nan
        met.wasted_usd_self[rows] = np.nan
    return met


def step_summary_columns(tree: Any) -> dict[str, list[Any]]:
    """What the rank summaries of the tree's steps say beyond their sums (see fleet.RankSummary), one list
    per field with a value per step row."""
    f = getattr(tree, "facts", None)
    if f is None:
        return {}
    n = tree.n_steps
    coverage = np.asarray(f.coverage[:n], np.float64)
    return {"flops_source": [FLOPS_SOURCES[c] for c in f.source[:n].tolist()], "full_depth": f.full[:n].astype(bool).tolist(),
            "device_measured": f.device_measured[:n].astype(bool).tolist(),
            "flops_coverage": [c if math.isfinite(c) else None for c in coverage.tolist()]}


def _null_where(value: Any, mask: np.ndarray, typ: pa.DataType) -> pa.Array:
    if isinstance(value, pa.ChunkedArray):
        value = value.combine_chunks()
    arr = value if isinstance(value, pa.Array) else pa.array(value, type=typ)
    if arr.type != typ:
        arr = arr.cast(typ)
    if arr.offset == 0 and (pa.types.is_integer(typ) or pa.types.is_floating(typ)):
        # numbers keep their values buffer; only the validity bitmap is new (if_else copies both)
        keep = ~np.asarray(mask, bool)
        if arr.null_count:
            keep &= arr.is_valid().to_numpy(zero_copy_only=False)
        bitmap = pa.py_buffer(np.packbits(keep, bitorder="little"))
        return pa.Array.from_buffers(typ, len(arr), [bitmap, arr.buffers()[1]], null_count=len(arr) - int(np.count_nonzero(keep)))
    return pc.if_else(pa.array(mask), pa.nulls(len(arr), typ), arr)


def _null_columns(cols: dict[str, Any], names: tuple[str, ...], mask: np.ndarray, length: int) -> None:
    from .. import conventions as cv

    if not mask.any():
        return
    for name in names:
        if cols.get(name) is not None:
            cols[name] = _null_where(cols[name], mask, cv.ATTRIBUTE_BY_NAME[name].type)


def step_depth_rows(tree: Any, sel: np.ndarray) -> np.ndarray:
    """Per exported row ``sel``: is it inside a step sampled at step depth (whose FLOPs are carried or
    absent, not measured by this capture)?"""
    f = getattr(tree, "facts", None)
    srow = tree.step_row[sel]
    if f is None or tree.n_steps == 0:
        return np.zeros(len(sel), bool)
    return (srow >= 0) & ~f.full[np.maximum(srow, 0)]


def step_columns(cols: dict[str, Any], tree: Any, sel: np.ndarray) -> None:
    """The per-step attributes of the exported rows ``sel`` of one rank: flops.source on step and rank
    spans, what step depth could not measure left absent, NVML/GPM means and dropped records per step."""
    from .inputs import LEVEL_CODE

    f = getattr(tree, "facts", None)
    t = tree
    if f is None or t.n_steps == 0:
        return
    lv = t.level[sel]
    s = np.maximum(t.step_row[sel], 0)
    upper = (lv == LEVEL_CODE["step"]) | (lv == LEVEL_CODE["rank"])
    is_step = lv == LEVEL_CODE["step"]
    n = len(sel)
    carriers, step_rows = np.flatnonzero(upper), np.flatnonzero(is_step)
    codes = f.source[s].astype(np.int64)
    cols["plasmient.flops.source"] = scatter_rows(pa.array(list(FLOPS_SOURCES), pa.string()).take(pa.array(codes[carriers])), carriers, n)
    shallow = step_depth_rows(t, sel)
    _null_columns(cols, NEEDS_KERNEL_FLOPS, shallow, n)
    _null_columns(cols, FLOPS_COLUMNS, shallow & ~(upper & (codes == CARRIED)), n)
    _null_columns(cols, NEEDS_DEVICE_ACTIVITY, shallow & ~f.device_measured[s], n)
    for attr, means in f.samples.items():
        cols[attr] = numbers_on_rows(np.asarray(means, np.float64)[s[step_rows]], step_rows, n)
    if f.opened_at_call is not None:
        at_call = pa.array(f.opened_at_call[s[step_rows]].astype(np.int64))
        opened = pa.array(["boundary", "first_module_call"], pa.string()).take(at_call)
        cols["plasmient.step.opened_at"] = scatter_rows(opened, step_rows, n)
    if f.dropped is not None:
        d = np.asarray(f.dropped, np.int64)[s[step_rows]]
        cols["plasmient.cupti.dropped_records"] = numbers_on_rows(d[d >= 0], step_rows[d >= 0], n)


def top_columns(cols: dict[str, Any], g: Any) -> None:
    """Fleet and node rows of steps some rank sampled at step depth: flops.source, device time absent
    where a rank recorded none, MFU/HFU from the ranks' carried ideal seconds over the group's window.
    ``g`` is the rows' ``summary_groups.SummaryGroups``."""
    n = g.n
    codes = {name: code for code, name in enumerate(FLOPS_SOURCES)}
    member_source = np.array([codes[m] for m in g.values("flops_source", object).tolist()], np.int64)
    source = np.maximum.reduceat(member_source, g.first) if n else np.zeros(0, np.int64)
    cols["plasmient.flops.source"] = pa.array(list(FLOPS_SOURCES), pa.string()).take(pa.array(source))
    shallow = g.any(~g.values("full_depth", bool))
    if not shallow.any():
        return
    no_device = g.any(~g.values("device_measured", bool))
    _null_columns(cols, NEEDS_KERNEL_FLOPS, shallow, n)
    _null_columns(cols, NEEDS_DEVICE_ACTIVITY, no_device, n)
    carried = shallow & (source == CARRIED)

    # a carried member's coverage is the one it carried; a measured one's is known over busy time
    busy, known = g.values("busy_s"), g.values("known_s")
    with np.errstate(divide="ignore", invalid="ignore"):
        measured_coverage = np.where(busy > 0, known / busy, np.nan)
    member_coverage = np.where(member_source == CARRIED, g.values("flops_coverage"), measured_coverage)
    # min() over the members as Python's does it: a NaN first stays, a NaN after a number is passed over
    coverage = np.array([min(member_coverage[a:b].tolist()) for a, b in zip(g.first.tolist(), [*g.first[1:].tolist(), len(g.members)])])
    coverage[source == UNKNOWN] = np.nan
    device_s = (g.max("window_end_ns") - g.min("window_start_ns")) / 1e9 * g.total(g.values("gpus", np.int64)).astype(np.int64)
    ideal = g.total("ideal_s")
    recompute = g.total("recompute_ideal_s")
    util = np.where(no_device, np.nan, np.array([np.nan if c is None else c for c in
                                                  _as_floats(cols.get("plasmient.util.resident"), n)]))
    cap = np.where(np.isfinite(util), util, 1.0)
    ok = carried & (coverage > 0) & (device_s > 0) & np.isfinite(ideal)
    with np.errstate(divide="ignore", invalid="ignore"):
        mfu = np.where(ok, np.minimum(ideal / device_s, cap), np.nan)
        hfu = np.where(ok, np.minimum((ideal + recompute) / device_s, cap), np.nan)
    for name, values in (("plasmient.mfu", mfu), ("plasmient.hfu", hfu), ("plasmient.flops.coverage", coverage)):
        old = _as_floats(cols.get(name), n)
        cols[name] = nan_to_null(np.where(shallow, values, old))


def _as_floats(value: Any, n: int) -> np.ndarray:
    if value is None:
        return np.full(n, np.nan)
    if isinstance(value, (pa.Array, pa.ChunkedArray)):
        return pc.fill_null(value.cast(pa.float64()), np.nan).to_numpy(zero_copy_only=False)
    return np.asarray(value, np.float64)

