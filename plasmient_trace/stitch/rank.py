"""One rank's span tree, rank -> step -> module -> op -> kernel, and its accounting over device time, for the
rank's steps or for one group of them (``stitch.chunks``; what crosses steps comes from ``stitch.timeline``).

Spans live in flat arrays laid out in blocks: [rank spans | step spans | modules | ops | kernels], one rank
span and one step span per step. Every metric is computed over a *device window* (see ``stitch.windows``):

* kernel: its own interval; op and module: the extent of the kernels under them; a span that launched
  nothing has no window and no device metrics at all;
* step: the tile of the rank's device timeline that ends with the step's last kernel (a pipelined step's
  first kernels may run in the previous step's tile: they stay whole and stay its own); rank: its step's
  tile. Their resident time is the time any of the rank's kernels ran in the tile.

Additive quantities are per-kernel facts rolled up the tree, plus the step's idle gaps (host gaps in its
window) as the step's own waste. The displayed span start/end are the CPU interval widened to cover the
children (as Perfetto nests them); the device window is exported beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..metrics import compute as mc
from ..metrics.flops.labels import Labels
from .collectives import CollectiveBandwidth, collective_bandwidth
from .inputs import KIND_CODE, LEVEL_CODE, RankInput, StitchOptions
from .joins import JoinedRank
from .nesting import (
    depth_levels,
    fold_rows_to_parents,
    reduce_to_parents,
    tree_depth,
    tree_root,
)
from .overlap import StepOverlap
from .ownership import kernel_peaks, kernel_precisions, kernel_work
from .recompute import Recompute, find_recompute
from .step_facts import step_metrics, with_step_facts
from .timeline import DeviceTimeline, device_timeline

_BIG = np.iinfo(np.int64).max
# Additive per-span quantities, in the row order of RankTree.total.
ADDITIVE = ("flops", "bytes", "ideal_s", "busy_s", "wasted_s", "known_s", "bytes_known_s", "kernel_s", "comm_s", "copy_s",
            "kernels", "charged_s", "idle_s", "recompute_flops", "recompute_ideal_s")
COL = {name: i for i, name in enumerate(ADDITIVE)}


@dataclass
class RankTree:
    """One rank's spans and their metrics. Span rows index every array of length n."""

    n_steps: int
    n_mod: int
    n_op: int
    n_k: int              # real kernels; synthetic CPU kernels follow them
    base: dict[str, int]
    level: np.ndarray
    parent: np.ndarray    # -1 for rank spans and for spans outside every step
    start: np.ndarray     # displayed interval (CPU, widened over children)
    end: np.ndarray
    step_row: np.ndarray  # step row of each span (-1 outside every step)
    alive: np.ndarray
    depth: np.ndarray
    synth_ops: np.ndarray  # op rows that stand for kernels on a CPU-only rank
    # per span: a shape-only op (FLOP model "view": t, reshape, permute, ...), or a CPU kernel standing for one
    shape_only: np.ndarray
    # per span: a kernel that moves data beside a matmul's GEMM (KernelWork.moves), memory-bound by nature
    moves_data: np.ndarray
    module_labels: list[str]  # per module row: path, + " [backward]" / " [recompute]"
    # device window and metrics
    has_device: np.ndarray
    win_start: np.ndarray
    win_end: np.ndarray
    gpus: np.ndarray
    total: np.ndarray     # (len(ADDITIVE), n) inclusive: one contiguous row per quantity
    # exclusive values (what is not under a child module/op/step/rank span) are derived per quantity on demand
    # from these: the (non-kernel child, parent) pairs whose totals are subtracted
    under_child: np.ndarray
    under_parent: np.ndarray
    union_s: np.ndarray
    price: float          # USD per device-hour (NaN unknown)
    peak_known: bool
    # per kernel (alive ones, in kernel row order): facts the culprits and the span budget need
    k_rows: np.ndarray    # kernel rows (0..n_ks) that are alive
    k_waste: np.ndarray
    k_launch_op: np.ndarray
    k_kind: np.ndarray
    k_precision: Labels    # per kernel (all of them, by kernel index): the precision its math ran at (fp32, tf32, 3xtf32, bf16, ...)
    over_peak_by_step: np.ndarray
    outside_kernels: int
    overlap: StepOverlap | None = None  # per step: communication/copy overlap, idle split, launch queue
    comm_bw: CollectiveBandwidth | None = None  # per collective kernel and step: message bytes, algbw, busbw
    facts: Any = None  # step_facts.ResolvedSteps: depth, FLOPs source, what step depth measured
    levels: list[np.ndarray] = field(default_factory=list)  # span rows by depth (nesting.depth_levels), sorted once
    _exclusive: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    def span(self, level: str, rows: np.ndarray | int) -> np.ndarray | int:
        return self.base[level] + rows

    def col(self, name: str, inclusive: bool = True) -> np.ndarray:
        if inclusive:
            return self.total[COL[name]]
        cached = self._exclusive.get(name)
        if cached is None:
            # a parent's exclusive value: its total less its non-kernel children's totals (kernels are its own work)
            # bincount adds in row order as np.add.at did (the same sums, bit for bit), and faster
            under = np.bincount(self.under_parent, weights=self.total[COL[name], self.under_child],
                                minlength=self.total.shape[1])
            cached = self._exclusive[name] = self.total[COL[name]] - under
        return cached

    def folded_under(self, name: str, export: np.ndarray) -> np.ndarray:
        """Per span, the totals of its module/op children that ``export`` folds: in the exported tree they are
        the span's own. A folded span's subtree is folded whole (the budget keeps ancestors first), so a span's
        exported children, ``col(name, False)`` and this add up to its total, budget or not."""
        child, parent = self.under_child, self.under_parent
        folded = self.alive[child] & ~export[child] & export[parent]
        return np.bincount(parent[folded], weights=self.total[COL[name], child[folded]], minlength=self.total.shape[1])


def _widen(parent: np.ndarray, depth: np.ndarray, start: np.ndarray, end: np.ndarray, alive: np.ndarray,
           levels: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Make every parent cover its children; spans with no interval of their own take their children's."""
    start = reduce_to_parents(parent, depth, start, np.minimum, alive, levels)
    end = reduce_to_parents(parent, depth, end, np.maximum, alive, levels)
    empty = start > end
    start[empty] = 0
    end[empty] = 0
    return start, end


def build_rank_tree(inp: RankInput, j: JoinedRank, options: StitchOptions, tl: DeviceTimeline | None = None) -> RankTree:
    """The rank's tree, or a chunk's (``stitch.chunks``: then ``tl`` is the chunk's rows of the rank's timeline)."""
    rs = inp.records
    if tl is None:
        tl = device_timeline(inp, j, options)
    n_steps, n_mod, n_op = len(j.steps), len(j.module_parent), len(j.op_parent)
    n_k = len(j.kernel_start)
    synth_ops = tl.synth_ops
    yields = tl.op_yields
    n_ks = n_k + len(synth_ops)
    base = {"rank": 0, "step": n_steps, "module": 2 * n_steps, "op": 2 * n_steps + n_mod,
            "kernel": 2 * n_steps + n_mod + n_op}
    n = base["kernel"] + n_ks
    steps_rows = np.arange(n_steps)

    # ---- parents
    m_alive = j.module_step >= 0
    mp = j.module_parent
    mp_ok = (mp >= 0) & m_alive[np.maximum(mp, 0)] & (j.module_step[np.maximum(mp, 0)] == j.module_step)
    m_par = np.where(mp_ok, base["module"] + mp, base["step"] + np.maximum(j.module_step, 0))
    o_alive = j.op_step >= 0
    op_p = j.op_parent
    op_ok = (op_p >= 0) & (j.op_step[np.maximum(op_p, 0)] == j.op_step)
    om = j.op_module
    om_ok = (om >= 0) & m_alive[np.maximum(om, 0)] if n_mod else np.zeros(n_op, bool)
    if n_mod:
        om_ok &= j.module_step[np.maximum(om, 0)] == j.op_step
    o_par = np.where(op_ok, base["op"] + op_p, np.where(om_ok, base["module"] + om, base["step"] + np.maximum(j.op_step, 0)))
    rc = find_recompute(rs, j)
    m_par, o_par = _hang_recompute(rc, j, base, m_par, o_par, m_alive)
    module_labels = [j.module_path[m] + (" [recompute]" if rc.modules[m] else " [backward]" if j.module_phase[m] == "backward" else "")
                     for m in range(n_mod)]
    ko = np.concatenate([j.kernel_op, synth_ops])
    kstep = tl.step
    ko_ok = (ko >= 0) & (j.op_step[np.maximum(ko, 0)] == kstep) if n_op else np.zeros(n_ks, bool)
    k_par = np.where(ko_ok, base["op"] + ko, base["step"] + np.maximum(kstep, 0))
    k_alive = kstep >= 0

    o_start = rs.ops.column("start_ns").to_numpy() if n_op else np.zeros(0, np.int64)
    o_end = rs.ops.column("end_ns").to_numpy() if n_op else np.zeros(0, np.int64)
    ks, ke = tl.start, tl.end

    level = np.concatenate([np.full(n_steps, LEVEL_CODE["rank"]), np.full(n_steps, LEVEL_CODE["step"]),
                            np.full(n_mod, LEVEL_CODE["module"]), np.full(n_op, LEVEL_CODE["op"]),
                            np.full(n_ks, LEVEL_CODE["kernel"])]).astype(np.int8)
    parent = np.concatenate([np.full(n_steps, -1), base["rank"] + steps_rows, m_par, o_par, k_par]).astype(np.int64)
    start = np.concatenate([np.full(n_steps, _BIG), j.step_start, j.module_start, o_start, ks]).astype(np.int64)
    end = np.concatenate([np.full(n_steps, -_BIG), j.step_end, j.module_end, o_end, ke]).astype(np.int64)
    step_row = np.concatenate([steps_rows, steps_rows, j.module_step, j.op_step, kstep]).astype(np.int64)
    alive = np.concatenate([np.ones(2 * n_steps, bool), m_alive, o_alive, k_alive])
    parent = np.where(alive, parent, -1)
    depth = tree_depth(parent)
    levels = depth_levels(depth)
    start, end = _widen(parent, depth, start, end, alive, levels)

    # ---- per-kernel work: FLOPs, bytes, ideal seconds at the peak of the kernel's dtype
    kinds = tl.kind
    work = kernel_work(inp, j, ko, kinds, k_alive, ke - ks, yields, tl.role)
    precision = kernel_precisions(inp, work, tl.fp32_code)
    peaks = kernel_peaks(inp, precision)
    # recomputed forward work (activation checkpointing): hardware FLOPs, not model FLOPs
    k_rc = rc.ops[np.maximum(np.where(work.owner >= 0, work.owner, ko), 0)] & (ko >= 0) if n_op else np.zeros(n_ks, bool)

    # ---- device windows (stitch.windows, measured over the whole rank by stitch.timeline)
    live_k = np.nonzero(k_alive)[0]
    t_start, t_end = tl.tile_start, tl.tile_end
    cs, ce, devs, share_s = tl.clip_start[live_k], tl.clip_end[live_k], tl.device[live_k], tl.share_s[live_k]
    dur_s = (ce - cs) / 1e9
    ideal = np.where(work.flops[live_k] > 0, work.flops[live_k] / peaks[live_k], np.where(np.isnan(peaks[live_k]), np.nan, 0.0))
    # Model FLOPs faster than the peak allows: the kernel ran fewer multiplies than the op it computes
    # (Winograd or FFT convolutions). Counted, and kept: ideal_s stays flops/peak, so a step's MFU is its
    # flops/(peak*window) as FlopCounterMode's would be; each span's MFU is still at most its util.
    over = ideal > dur_s
    over_peak_by_step = np.bincount(kstep[live_k][over], minlength=n_steps) if n_steps else np.zeros(0, np.int64)
    rc_live = k_rc[live_k]
    waste = mc.kernel_waste_s(share_s, np.where(rc_live, 0.0, ideal), options.baseline_mfu)
    kind_live = kinds[live_k]
    k_span = base["kernel"] + live_k

    stats = mc.subtree_device_stats(parent, depth, k_span, cs, ce, devs)
    rank_devices = tl.rank_devices
    gpus = np.where(level == LEVEL_CODE["kernel"], 1, stats.devices).astype(np.int64)
    gpus[:2 * n_steps] = rank_devices
    has_device = stats.devices > 0
    has_device[:2 * n_steps] = True
    win_start = np.where(has_device, stats.ext_start, 0)
    win_end = np.where(has_device, stats.ext_end, 0)
    # a step's (and its rank span's) window is its tile: the period between step boundaries on the device
    for lo_row in (base["rank"], base["step"]):
        win_start[lo_row:lo_row + n_steps] = t_start
        win_end[lo_row:lo_row + n_steps] = t_end

    # ---- additive facts: kernels carry theirs; a step carries its idle gaps
    # quantity-major (one contiguous row per quantity): every fold and gather below is 1-D
    self_vals = np.zeros((len(ADDITIVE), n))
    ideal_known = np.nan_to_num(ideal)
    # summed durations describe the kernels (their own, unclipped lengths); time accounting uses the shares
    raw_s = np.maximum(ke[live_k] - ks[live_k], 0) / 1e9
    for name, values in (
        ("flops", work.flops[live_k]), ("bytes", work.bytes[live_k]), ("ideal_s", ideal_known), ("busy_s", share_s),
        ("wasted_s", waste), ("known_s", np.where(work.known[live_k], share_s, 0.0)),
        ("bytes_known_s", np.where(work.bytes_known[live_k], share_s, 0.0)), ("kernel_s", raw_s),
        ("comm_s", np.where(kind_live == KIND_CODE["collective"], raw_s, 0.0)),
        ("copy_s", np.where((kind_live == KIND_CODE["memcpy"]) | (kind_live == KIND_CODE["memset"]), raw_s, 0.0)),
        ("kernels", 1.0), ("charged_s", share_s),
        ("recompute_flops", np.where(rc_live, work.flops[live_k], 0.0)),
        ("recompute_ideal_s", np.where(rc_live, ideal_known, 0.0)),
    ):
        self_vals[COL[name], k_span] = values
    step_spans = base["step"] + steps_rows
    # Step and rank spans: resident time is the time any of the rank's kernels ran in the tile, whichever step
    # launched it (stitch.overlap measures it with the idle split), and idle is the rest of the tile.
    overlap = tl.overlap
    resident_s = overlap.resident_s
    union_s = stats.union_s.copy()
    union_s[:n_steps] = union_s[step_spans] = resident_s
    idle = np.maximum((t_end - t_start) * rank_devices / 1e9 - resident_s, 0.0)
    self_vals[COL["idle_s"], step_spans] = idle
    self_vals[COL["wasted_s"], step_spans] = idle
    self_vals[COL["charged_s"], step_spans] = idle
    total = self_vals  # folded in place: inclusive sums from here on
    fold_rows_to_parents(total, parent, levels, np.add)
    # Exclusive = total minus what sits under child module/op/step spans (RankTree.col computes it when asked:
    # a few quantities are, and 14 more (q, n) rows are 400 MB at 10^6 kernels).
    non_kernel_child = np.nonzero((parent >= 0) & (level != LEVEL_CODE["kernel"]))[0]

    moves_data = np.zeros(n, bool)
    moves_data[base["kernel"]:base["kernel"] + n_ks] = work.moves
    comm_bw = collective_bandwidth(rs.kernels, kinds[:n_k] == KIND_CODE["collective"], ke[:n_k] - ks[:n_k], kstep[:n_k],
                                   n_steps, inp.spec.model) if n_k else None
    tree = RankTree(
        n_steps=n_steps, n_mod=n_mod, n_op=n_op, n_k=n_k, base=base, level=level, parent=parent, start=start,
        end=end, step_row=step_row, alive=alive, depth=depth, synth_ops=synth_ops,
        shape_only=_shape_only(inp, n, base, n_op, n_k, synth_ops), moves_data=moves_data, module_labels=module_labels,
        has_device=has_device & alive, win_start=win_start, win_end=win_end, gpus=gpus, total=total,
        under_child=non_kernel_child, under_parent=parent[non_kernel_child],
        union_s=union_s, price=inp.spec.price_per_hour if inp.spec.price_per_hour is not None else np.nan,
        peak_known=inp.spec.peak_for is not None, k_rows=live_k, k_waste=waste, k_launch_op=ko[live_k],
        k_kind=kind_live, k_precision=precision, over_peak_by_step=over_peak_by_step, outside_kernels=tl.outside_kernels, overlap=overlap,
        comm_bw=comm_bw, levels=levels,
    )
    if options.full_depth_steps is not None:
        # Exclusive values are of the measured totals: derive the ones step facts may overwrite (carried work on
        # step and rank rows) before they do, as when the whole exclusive matrix was built here.
        for name in ("flops", "recompute_flops", "ideal_s", "recompute_ideal_s"):
            tree.col(name, inclusive=False)
    return with_step_facts(tree, options, j.steps, rs.samples)


@dataclass
class SpanMetrics:
    """Ratios and derived values per span (NaN = absent)."""

    window_s: np.ndarray
    util: np.ndarray
    mfu: np.ndarray        # model FLOPs only (recompute excluded)
    hfu: np.ndarray        # hardware FLOPs: model + recomputed
    coverage: np.ndarray
    stall: np.ndarray
    intensity: np.ndarray
    bound: np.ndarray      # int8 code into BOUNDS, -1 absent
    cost: np.ndarray
    cost_self: np.ndarray
    wasted_usd: np.ndarray
    wasted_usd_self: np.ndarray


def _shape_only(inp: RankInput, n: int, base: dict[str, int], n_op: int, n_k: int, synth_ops: np.ndarray) -> np.ndarray:
    out = np.zeros(n, bool)
    if n_op:
        view = inp.op_model.equals("view")
        out[base["op"]:base["op"] + n_op] = view
        out[base["kernel"] + n_k:] = view[synth_ops]
    return out


def derive_metrics(tree: RankTree, bandwidth: float) -> SpanMetrics:
    """Every span's metrics from its sums; ``bandwidth``: the device's memory bandwidth (bytes/s; NaN
    unknown), which with each kernel's peak (in ideal_s) places the span on its roofline."""
    t = tree
    window_s = np.where(t.has_device, np.maximum(t.win_end - t.win_start, 0) / 1e9, np.nan)
    device_s = window_s * t.gpus
    busy = t.col("busy_s")
    known = t.col("known_s")
    ideal_hw = t.col("ideal_s")
    ideal = ideal_hw - t.col("recompute_ideal_s")
    with np.errstate(divide="ignore", invalid="ignore"):
        # a window of zero length (a kernel under the trace's microsecond resolution, the op around only it) has
        # no utilisation to measure: 0/0 is unknown, not an idle device
        util = np.where(device_s > 0, np.minimum(t.union_s / device_s, 1.0), np.nan)
        coverage = np.where(busy > 0, np.clip(known / busy, 0.0, 1.0), np.nan)
        measured = mc.flops_measured(t.col("flops"), coverage)
        measurable = t.peak_known & measured
        mfu = np.where(measurable & (device_s > 0), np.minimum(ideal / device_s, util), np.nan)
        hfu = np.where(measurable & (device_s > 0), np.minimum(ideal_hw / device_s, util), np.nan)
        stall = np.where(measurable & (busy > 0), np.clip(1.0 - ideal / busy, 0.0, 1.0), np.nan)
        intensity = np.where((t.col("bytes") > 0) & measured, t.col("flops") / t.col("bytes"), np.nan)
    kernels = t.col("kernels")
    bound = mc.bound_codes(
        # a zero-length window is not idle: its kernels ran for all of it
        has_device=t.has_device, is_kernel=t.level == LEVEL_CODE["kernel"], util=np.where(np.isnan(util), 1.0, util),
        kernels=kernels,
        kernel_s=t.col("kernel_s"), comm_s=t.col("comm_s"), copy_s=t.col("copy_s"),
        ideal_s=ideal_hw if t.peak_known else np.full(len(kernels), np.nan),
        memory_s=t.col("bytes") / bandwidth, coverage=np.nan_to_num(coverage),
        # a shape-only op that moved and computed nothing (no copy under it): its time is all per-op overhead
        work_free=t.shape_only & (np.nan_to_num(coverage) >= 1.0) & (t.col("flops") == 0) & (t.col("bytes") == 0),
        moves_data=t.moves_data)
    price = t.price / 3600.0
    return step_metrics(t, SpanMetrics(
        window_s=window_s, util=util, mfu=mfu, hfu=hfu, coverage=coverage, stall=stall, intensity=intensity, bound=bound,
        cost=price * t.col("charged_s"), cost_self=price * t.col("charged_s", False),
        wasted_usd=price * t.col("wasted_s"), wasted_usd_self=price * t.col("wasted_s", False),
    ))


def _hang_recompute(rc: Recompute, j: JoinedRank, base: dict[str, int], m_par: np.ndarray, o_par: np.ndarray,
                    m_alive: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Recompute modules under the backward op that ran them, recompute roots under those modules;
    left as they were if that would not be a tree (a module and its op starting at the same instant)."""
    if not rc.modules.any():
        return m_par, o_par
    new_m, new_o = m_par.copy(), o_par.copy()
    mods = np.nonzero(rc.modules & (rc.module_parent_op >= 0) & m_alive)[0]
    mp = j.module_parent[mods]
    top = (mp < 0) | ~rc.modules[np.maximum(mp, 0)]
    mods = mods[top & (j.module_step[mods] == j.op_step[rc.module_parent_op[mods]])]
    new_m[mods] = base["op"] + rc.module_parent_op[mods]
    roots = np.nonzero(rc.op_module >= 0)[0]
    roots = roots[m_alive[rc.op_module[roots]] & (j.module_step[rc.op_module[roots]] == j.op_step[roots])]
    new_o[roots] = base["module"] + rc.op_module[roots]
    # pointer-chase with a bound: a cycle never reaches a root
    parent = np.concatenate([np.full(base["module"], -1), new_m, new_o])
    cur = parent.copy()
    for _ in range(4096):
        live = cur >= 0
        if not live.any():
            return new_m, new_o
        cur[live] = parent[cur[live]]
    return m_par, o_par


def module_of_ops(j: JoinedRank, root: np.ndarray | None = None) -> np.ndarray:
    """Innermost module row of each op: the module of the root of its op tree (-1 none); ``root``: the
    roots (``nesting.tree_root(j.op_parent)``) where the caller has them."""
    if not len(j.op_parent):
        return np.zeros(0, np.int64)
    root = tree_root(j.op_parent) if root is None else root
    return j.op_module[root] if len(j.op_module) else np.full(len(root), -1, np.int64)
