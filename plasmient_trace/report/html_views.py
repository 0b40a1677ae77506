"""The data of the report page's three drawn views, trimmed to their caps: (a) the icicle of the span tree,
(b) the kernel timeline, (c) the roofline. Vectorised over a :class:`~.frame.SpanFrame`; the page draws them
(``assets/report.js``), and :mod:`.html` puts them in the page with the bill and the diff.

Caps, and what happens past them (each is stated in the page under its view):
- icicle: at most ``ICICLE_MAX_NODES`` cells: the largest spans by width plus all their ancestors;
  the dropped children of a kept span are folded into one "… N more" cell that carries their
  summed time and device-time weighted util/MFU, so widths and averages stay honest.
- timeline: up to ``TIMELINE_MAX_KERNELS`` kernels are drawn one by one; past that, the longest
  kernels at least one bin long (up to that cap) still are, and all the others are merged into
  ``TIMELINE_BINS`` bins per lane, each kernel's time split exactly over the bins it overlaps,
  coloured by the bound holding most time in the bin, with the bin's occupancy as opacity.
- roofline: up to ``ROOFLINE_MAX_POINTS`` kernels are plotted one by one; past that one point per
  (kernel name, device roof): summed flops / summed bytes against summed flops / summed time.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from plasmient_trace.conventions import BOUNDS, LEVELS
from plasmient_trace.report.frame import BOUND_CODE, LEVEL_CODE, SpanFrame, weighted_mean
from plasmient_trace.report.summary import _top_spans

__all__ = ["ICICLE_MAX_NODES", "TIMELINE_MAX_KERNELS", "TIMELINE_BINS", "ROOFLINE_MAX_POINTS", "NAME_MAX", "PAGE_LEVELS",
           "icicle_data", "icicle_value", "device_items", "timeline_data", "roofline_data"]

ICICLE_MAX_NODES = 20_000
TIMELINE_MAX_KERNELS = 50_000
TIMELINE_BINS = 2_000
ROOFLINE_MAX_POINTS = 5_000
NAME_MAX = 300  # CUDA template symbols run to kilobytes; the page shows them middle-ellipsized
# Levels in the page: the span levels, then a synthetic job root above several traces, then the
# "… N more" cells that fold the spans dropped by the node cap.
PAGE_LEVELS = LEVELS + ("job", "other")
JOB_LEVEL, OTHER_LEVEL = len(LEVELS), len(LEVELS) + 1


def _short(arr: pa.Array) -> pa.Array:
    """Truncate long names (middle ellipsis) so one templated kernel symbol cannot bloat the page."""
    arr = pc.fill_null(arr.cast(pa.string()), "")
    long = pc.greater(pc.utf8_length(arr), NAME_MAX)
    if not pc.any(long).as_py():
        return arr
    half = NAME_MAX // 2 - 1
    head = pc.utf8_slice_codeunits(arr, 0, half)
    tail = pc.utf8_slice_codeunits(arr, -half)
    return pc.if_else(long, pc.binary_join_element_wise(head, tail, "…"), arr)


def _names(arr: pa.Array) -> tuple[list[str], np.ndarray]:
    """Dictionary-encode names: the page gets each distinct name once plus an index per item."""
    enc = pc.dictionary_encode(_short(arr))
    return enc.dictionary.to_pylist(), enc.indices.to_numpy(zero_copy_only=False).astype(np.int32)


def _f(x: np.ndarray) -> np.ndarray:
    """float64 for JSON; NaN becomes null (orjson writes non-finite floats as null)."""
    return np.ascontiguousarray(x, dtype=np.float64)


# ---- (a) icicle ---------------------------------------------------------------------------------


def icicle_data(frame: SpanFrame, title: str, max_nodes: int) -> dict[str, Any]:
    n = frame.n
    value = icicle_value(frame)
    util, mfu = frame.num("plasmient.util.resident"), frame.num("plasmient.mfu")
    kept = _select_nodes(frame, value, max_nodes)
    kept_idx = np.nonzero(kept)[0]
    kept_idx = kept_idx[np.argsort(frame.start_ns[kept_idx], kind="stable")]
    pos = np.full(n, -1, dtype=np.int64)

    # Dropped spans whose parent is kept: fold them, per parent, into one "… N more" cell.
    folded_root = (~kept) & (frame.parent >= 0)
    folded_root &= kept[np.where(frame.parent >= 0, frame.parent, 0)]
    fr = np.nonzero(folded_root)[0]
    fparents, finv = np.unique(frame.parent[fr], return_inverse=True)
    fval = value[fr]
    nf = fparents.size

    def wsum(x: np.ndarray) -> np.ndarray:
        """Time-weighted mean per folded cell of a per-span column."""
        x = x[fr]
        ok = ~np.isnan(x)
        num = np.bincount(finv[ok], weights=x[ok] * fval[ok], minlength=nf)
        den = np.bincount(finv[ok], weights=fval[ok], minlength=nf)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where((den > 0) & (np.bincount(finv[ok], minlength=nf) > 0), num / np.where(den > 0, den, 1), np.nan)

    def ssum(x: np.ndarray) -> np.ndarray:
        """Sum per folded cell of a per-span column (NaN where no folded span knows it)."""
        x = x[fr]
        ok = ~np.isnan(x)
        s = np.bincount(finv[ok], weights=x[ok], minlength=nf)
        return np.where(np.bincount(finv[ok], minlength=nf) > 0, s, np.nan)

    roots = kept_idx[frame.parent[kept_idx] < 0]
    synthetic_root = roots.size != 1
    offset = 1 if synthetic_root else 0
    pos[kept_idx] = np.arange(kept_idx.size) + offset
    total = offset + kept_idx.size + nf

    def col(x: np.ndarray, other: np.ndarray, root: float, dtype: type = np.float32) -> np.ndarray:
        # float32 (7 digits) for what the page only displays; util/MFU stay float64 so the page
        # shows exactly the span attribute.
        out = np.empty(total, dtype=dtype)
        if synthetic_root:
            out[0] = root
        out[offset : offset + kept_idx.size] = x[kept_idx]
        out[offset + kept_idx.size :] = other
        return out

    root_w = value[roots]

    def root_mean(x: np.ndarray) -> float:
        m = weighted_mean(x[roots], root_w)
        return np.nan if m is None else m

    def root_sum(x: np.ndarray) -> float:
        v = x[roots]
        return np.nan if np.isnan(v).all() else float(np.nansum(v))

    parent = np.empty(total, dtype=np.int64)
    kp = frame.parent[kept_idx]
    parent_kept = np.where(kp >= 0, pos[np.where(kp >= 0, kp, 0)], 0 if synthetic_root else -1)
    if synthetic_root:
        parent[0] = -1
    parent[offset : offset + kept_idx.size] = parent_kept
    parent[offset + kept_idx.size :] = pos[fparents]

    names, name_idx = _names(frame.batch.table.column("name").combine_chunks().take(pa.array(kept_idx)))
    counts = np.bincount(finv, minlength=nf)
    ucounts, cinv = np.unique(counts, return_inverse=True)
    other_name_idx = (len(names) + cinv.reshape(-1)).astype(np.int32)
    names = names + [f"… {c} more" for c in ucounts.tolist()]
    root_name = _job_label(frame, title)
    if synthetic_root:
        names.append(root_name)
    name_all = np.concatenate(
        ([np.array([len(names) - 1])] if synthetic_root else []) + [name_idx, other_name_idx]
    ).astype(np.int32)

    level = np.concatenate(
        ([np.array([JOB_LEVEL])] if synthetic_root else []) + [frame.level[kept_idx].astype(np.int64), np.full(nf, OTHER_LEVEL)]
    )
    bound = frame.codes("plasmient.bound", BOUND_CODE)
    bound_all = np.concatenate(([np.array([-1])] if synthetic_root else []) + [bound[kept_idx].astype(np.int64), np.full(nf, -1)])
    span_ids = frame.batch.table.column("span_id").combine_chunks().take(pa.array(kept_idx)).to_numpy()
    span_hex = [f"{int(s):016x}" for s in span_ids.tolist()]
    span_all = ([None] if synthetic_root else []) + span_hex + [None] * nf
    rank = frame.rank.astype(np.float64)
    rank[rank < 0] = np.nan
    flops, nbytes = frame.num("plasmient.flops"), frame.num("plasmient.bytes")
    ai = frame.num("plasmient.arithmetic_intensity")
    cost, wusd, ws = frame.num("plasmient.cost.usd"), frame.num("plasmient.cost.wasted_usd"), frame.num("plasmient.wasted_s")
    step = frame.num("plasmient.step")
    with np.errstate(invalid="ignore", divide="ignore"):
        other_ai = np.where(ssum(nbytes) > 0, ssum(flops) / ssum(nbytes), np.nan)
        root_ai = root_sum(flops) / root_sum(nbytes) if root_sum(nbytes) > 0 else np.nan
    return {
        "root": 0 if (synthetic_root or total == 0) else int(pos[roots[0]]),
        "names": names,
        "name": name_all,
        "level": level.astype(np.int32),
        "parent": parent,
        "value": col(value, ssum(value), float(root_w.sum())),
        "wall": col(frame.wall_s, np.full(nf, np.nan), _span_of(frame, roots)),
        # Several roots are several steps of the same GPUs, not more GPUs.
        "gpus": col(frame.gpus, ssum(frame.gpus), float(frame.gpus[roots].max()) if roots.size else np.nan),
        "util": col(util, wsum(util), root_mean(util), np.float64),
        "mfu": col(mfu, wsum(mfu), root_mean(mfu), np.float64),
        "flops": col(flops, ssum(flops), root_sum(flops)),
        "bytes": col(nbytes, ssum(nbytes), root_sum(nbytes)),
        "ai": col(ai, other_ai, root_ai),
        "bound": bound_all.astype(np.int32),
        "cost": col(cost, ssum(cost), root_sum(cost)),
        "wasted_usd": col(wusd, ssum(wusd), root_sum(wusd)),
        "wasted_s": col(ws, ssum(ws), root_sum(ws)),
        "rank": col(rank, np.full(nf, np.nan), np.nan),
        "step": col(step, np.full(nf, np.nan), np.nan),
        "span_id": span_all,
        "spans_total": n,
        "spans_shown": int(kept_idx.size),
        "folded_cells": int(nf),
        "max_nodes": max_nodes,
    }


def icicle_value(frame: SpanFrame) -> np.ndarray:
    """Cell widths: device time (wall x GPUs) from fleet down to step; below the step, the GPU-resident
    time (busy_s) of the span, so the empty part under a step is time its GPU sat idle.

    Below a step, wall times do not add up: ops of the backward thread overlap the forward ones and
    op windows are widened to their asynchronous kernels, so siblings' walls can sum to 20x the
    step's. GPU-resident time is the union of the span's own kernels, which siblings partition.
    CPU-only spans (no GPU time) keep their wall time.
    """
    below_step = frame.level > LEVEL_CODE["step"]
    busy = frame.num("plasmient.busy_s")
    on_cpu = np.asarray(pc.equal(frame.strings("plasmient.device.type"), "cpu").fill_null(False))
    use_busy = below_step & ~on_cpu & ~np.isnan(busy)
    return np.nan_to_num(np.where(use_busy, busy, frame.device_s), nan=0.0)


def _closed_over_ancestors(frame: SpanFrame, kept: np.ndarray) -> np.ndarray:
    frontier = np.nonzero(kept)[0]
    while frontier.size:
        p = frame.parent[frontier]
        p = np.unique(p[p >= 0])
        frontier = p[~kept[p]]
        kept[frontier] = True
    return kept


def _select_nodes(frame: SpanFrame, value: np.ndarray, max_nodes: int) -> np.ndarray:
    """The spans the icicle keeps: the largest by device time, closed over ancestors, such that the
    kept spans plus one folded cell per kept parent of dropped children fit in max_nodes."""
    n = frame.n
    if n <= max_nodes:
        return np.ones(n, dtype=bool)
    # Rank by device time; ties (e.g. zero-length spans) go to the higher level, then table order.
    order = np.lexsort((np.arange(n), frame.level, -value))
    k = max_nodes
    for _ in range(8):
        kept = np.zeros(n, dtype=bool)
        kept[order[:k]] = True
        kept = _closed_over_ancestors(frame, kept)
        dropped_child = (~kept) & (frame.parent >= 0)
        folded = np.unique(frame.parent[dropped_child])
        folded = folded[kept[folded]].size
        total = int(kept.sum()) + folded
        if total <= max_nodes or k <= 1:
            return kept
        k = max(1, int(k * max_nodes / total * 0.97))
    return kept


def _span_of(frame: SpanFrame, rows: np.ndarray) -> float:
    if rows.size == 0:
        return np.nan
    return float((frame.end_ns[rows].max() - frame.start_ns[rows].min()) / 1e9)


def _job_label(frame: SpanFrame, title: str) -> str:
    jobs = sorted({str(r["plasmient.job.id"]) for r in frame.batch.resources if r.get("plasmient.job.id") is not None})
    if not jobs:
        vals = pc.unique(frame.strings("plasmient.job.id").drop_null()).to_pylist()
        jobs = sorted(str(v) for v in vals)
    if len(jobs) == 1:
        return f"job {jobs[0]}"
    if jobs:
        return f"{len(jobs)} jobs"
    return title


# ---- (b) timeline ------------------------------------------------------------------------------


def device_items(frame: SpanFrame) -> np.ndarray:
    """The spans that are the device's work items: kernel spans; on a CPU-only run (no kernel spans), the
    op spans that are the CPU's kernels (those with busy time of their own)."""
    k = np.nonzero(frame.is_level("kernel"))[0]
    if k.size:
        return k
    own = frame.num("plasmient.busy_s.self")
    return np.nonzero(frame.is_level("op") & (np.nan_to_num(own) > 0))[0]


def timeline_data(frame: SpanFrame, max_kernels: int, bins: int) -> dict[str, Any]:
    k = device_items(frame)
    out: dict[str, Any] = {"kernels_total": int(k.size), "lanes": [], "mode": "kernels", "bins_per_lane": bins,
                           "item": "kernels" if frame.is_level("kernel").any() or not k.size else "ops"}
    if k.size == 0:
        out.update(t0_ns=0, t_end_us=0.0, lane=[], start=[], dur=[], bound=[], name=[], names=[], steps=[])
        return out
    start, end = frame.start_ns[k], np.maximum(frame.end_ns[k], frame.start_ns[k])
    device = np.nan_to_num(frame.num("plasmient.gpu.device")[k], nan=-1).astype(np.int64)
    stream = np.nan_to_num(frame.num("plasmient.gpu.stream")[k], nan=-1).astype(np.int64)
    keys = np.stack([frame.rank[k], frame.resource_index[k], device, stream], axis=1)
    lanes, lane = np.unique(keys, axis=0, return_inverse=True)
    lane = lane.reshape(-1).astype(np.int64)
    hosts = [str(r.get("host.name", "")) for r in frame.batch.resources]
    out["lanes"] = [
        {
            "rank": int(r) if r >= 0 else None,
            "host": hosts[ri] if 0 <= ri < len(hosts) else "",
            "device": int(d) if d >= 0 else None,
            "stream": int(s) if s >= 0 else None,
        }
        for r, ri, d, s in lanes.tolist()
    ]
    # The time axis starts where the first step's device window does, so the host gap before a step's
    # first kernel is drawn (as idle) instead of being cut off.
    top = _top_spans(frame)
    top = top[np.argsort(frame.start_ns[top], kind="stable")]
    w_start = frame.num("plasmient.device.start_ns")[top]
    w_len = frame.num("plasmient.device.window_s")[top]
    has_w = np.isfinite(w_start) & np.isfinite(w_len)
    step_a = np.where(has_w, w_start, frame.start_ns[top]).astype(np.int64)
    step_b = np.where(has_w, w_start + np.nan_to_num(w_len) * 1e9, frame.end_ns[top]).astype(np.int64)
    t0 = int(min(start.min(), step_a.min())) if top.size else int(start.min())
    s_us = (start - t0) / 1e3
    d_us = (end - start) / 1e3
    t_end = float((max(end.max(), step_b.max() if top.size else 0) - t0) / 1e3)
    bound = frame.codes("plasmient.bound", BOUND_CODE)[k].astype(np.int64)
    names_arr = frame.batch.table.column("name").combine_chunks().take(pa.array(k))
    kind = frame.strings("plasmient.kernel.kind").take(pa.array(k))
    out.update(t0_ns=t0, t_end_us=t_end)
    step_no = frame.num("plasmient.step")[top]
    idle = frame.num("plasmient.idle_s")[top]
    out["steps"] = [
        {"step": None if np.isnan(sn) else int(sn), "start": (int(a) - t0) / 1e3, "end": (int(b) - t0) / 1e3,
         "idle_s": None if np.isnan(i) else float(i)}
        for sn, a, b, i in zip(step_no.tolist(), step_a.tolist(), step_b.tolist(), idle.tolist())
    ][:2000]

    if k.size <= max_kernels:
        individual = np.arange(k.size)
    else:
        binw = max(t_end / bins, 1e-3)
        long_ = np.nonzero(d_us >= binw)[0]
        individual = np.sort(long_[np.argsort(-d_us[long_], kind="stable")[:max_kernels]])
        rest = np.ones(k.size, dtype=bool)
        rest[individual] = False
        out.update(mode="binned", bin_us=binw, **_bins(lane[rest], bound[rest], s_us[rest], s_us[rest] + d_us[rest], binw, bins))
    names, name_idx = _names(names_arr.take(pa.array(individual)))
    out.update(
        lane=lane[individual],
        start=_f(s_us[individual]),
        dur=_f(d_us[individual]),
        bound=bound[individual].astype(np.int32),
        name=name_idx,
        names=names,
        kind=kind.take(pa.array(individual)).to_pylist() if individual.size <= 5000 else None,
        drawn=int(individual.size),
    )
    return out


def _bins(lane: np.ndarray, bound: np.ndarray, start: np.ndarray, end: np.ndarray, binw: float, bins: int) -> dict[str, Any]:
    """Merge kernels into `bins` fixed bins per lane: time per (lane, bin), its dominant bound.

    A kernel's time is split exactly over the bins it overlaps, through the running integral
    F(x) = sum_k clip(x - start_k, 0, dur_k) evaluated at the bin edges (sorted starts/ends and
    prefix sums), so the bins conserve time. One pass per (lane, bound) group, not per kernel.
    """
    nb = len(BOUNDS) + 1  # the last code: kernels with no bound
    group = lane * nb + np.where(bound < 0, len(BOUNDS), bound)
    order = np.argsort(group, kind="stable")
    ugroup, first = np.unique(group[order], return_index=True)
    last = np.r_[first[1:], order.size]
    edges = np.arange(bins + 1) * binw
    time = np.zeros((ugroup.size, bins))
    for gi in range(ugroup.size):
        members = order[first[gi] : last[gi]]
        ss, ee = np.sort(start[members]), np.sort(end[members])
        cs, ce = np.r_[0.0, np.cumsum(ss)], np.r_[0.0, np.cumsum(ee)]
        ns, ne = np.searchsorted(ss, edges), np.searchsorted(ee, edges)
        integral = (edges * ns - cs[ns]) - (edges * ne - ce[ne])
        integral[-1] = ce[-1] - cs[-1]  # everything ends by the last edge, rounding aside
        time[gi] = np.diff(integral)
    glane = ugroup // nb
    lanes, lfirst = np.unique(glane, return_index=True)
    per_lane = np.add.reduceat(time, lfirst, axis=0)
    # Dominant bound per (lane, bin): the group row with most time in that bin, within the lane.
    dom = np.full(per_lane.shape, -1, dtype=np.int64)
    best = np.full(per_lane.shape, -1.0)
    for gi in range(ugroup.size):
        li = np.searchsorted(lanes, glane[gi])
        better = time[gi] > best[li]
        best[li][better] = time[gi][better]
        dom[li][better] = ugroup[gi] % nb
    counts = np.bincount(
        np.searchsorted(lanes, lane) * bins + np.minimum((start / binw).astype(np.int64), bins - 1), minlength=lanes.size * bins
    ).reshape(lanes.size, bins)
    li, bi = np.nonzero((per_lane > 0) | (counts > 0))
    d = dom[li, bi]
    return {
        "bin_lane": lanes[li].astype(np.int64),
        "bin_start": _f(bi * binw),
        "bin_bound": np.where(d == len(BOUNDS), -1, d).astype(np.int64),
        "bin_occupancy": _f(np.minimum(per_lane[li, bi] / binw, 1.0)),
        "bin_kernels": counts[li, bi].astype(np.int64),
        "bin_time": _f(per_lane[li, bi]),
    }


# ---- (c) roofline ------------------------------------------------------------------------------


def roofline_data(frame: SpanFrame, max_points: int) -> dict[str, Any]:
    k = device_items(frame)
    flops, nbytes = frame.num("plasmient.flops")[k], frame.num("plasmient.bytes")[k]
    wall = frame.wall_s[k]
    coverage = frame.num("plasmient.flops.coverage")[k]
    ok = (flops > 0) & (nbytes > 0) & (wall > 0)
    # Why a kernel has no point, first reason that applies: no FLOP model, no FLOPs (copies,
    # collectives), no byte count, no duration.
    unmodelled = ~ok & (np.nan_to_num(coverage, nan=0.0) <= 0) & ~(np.nan_to_num(flops) > 0)
    no_flops = ~ok & ~unmodelled & ~(np.nan_to_num(flops) > 0)
    no_bytes = ~ok & ~unmodelled & ~no_flops & ~(np.nan_to_num(nbytes) > 0)
    no_time = ~ok & ~unmodelled & ~no_flops & ~no_bytes
    out: dict[str, Any] = {"kernels_total": int(k.size), "excluded": int((~ok).sum()), "mode": "kernels", "roofs": [],
                           "excluded_why": {"no FLOP model": int(unmodelled.sum()), "zero FLOPs (copies, collectives)": int(no_flops.sum()),
                                            "no byte count": int(no_bytes.sum()), "zero duration": int(no_time.sum())}}
    # A kernel's roof is the peak of the precision it ran at (its own plasmient.peak_flops), else its rank's.
    anc = frame.ancestor_at("rank")
    step_anc = frame.ancestor_at("step")
    peak_all, bw_all = frame.num("plasmient.peak_flops"), frame.num("plasmient.peak_bandwidth")

    def from_ancestors(col: np.ndarray) -> np.ndarray:
        v = np.full(k.size, np.nan)
        for a in (anc[k], step_anc[k]):
            fill = np.isnan(v) & (a >= 0)
            v[fill] = col[a[fill]]
        return v

    own_peak = peak_all[k]
    peak = np.where(np.isfinite(own_peak), own_peak, from_ancestors(peak_all))
    bw = from_ancestors(bw_all)
    models = [str(r.get("plasmient.gpu.model") or "") for r in frame.batch.resources]
    ri = frame.resource_index[k]
    model_idx = np.where((ri >= 0) & (ri < len(models)), ri, -1)
    model_names = sorted(set(models)) or [""]
    model_code = np.array([model_names.index(m) for m in models] + [0], dtype=np.int64)[model_idx]
    roof_keys = np.stack([model_code.astype(np.float64), np.nan_to_num(peak, nan=-1), np.nan_to_num(bw, nan=-1)], axis=1)
    # the roofs of the plotted kernels (a copy's rank roof is no kernel's); with none plotted, the device's
    keyed = ok if ok.any() else np.ones(k.size, bool)
    roofs, roof_of_keyed = (np.unique(roof_keys[keyed], axis=0, return_inverse=True) if k.size
                            else (np.zeros((0, 3)), np.zeros(0, np.int64)))
    roof = np.full(k.size, -1, np.int64)
    roof[keyed] = roof_of_keyed.reshape(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        # modelled FLOPs beyond what the roof allows in the kernel's time (a Winograd convolution's transforms)
        out["above_roof"] = int((ok & (flops / wall > peak * (1 + 1e-9))).sum())
    out["roofs"] = [
        {"model": model_names[int(m)], "peak_flops": None if p < 0 else p, "peak_bandwidth": None if b < 0 else b}
        for m, p, b in roofs.tolist()
    ]
    sel = np.nonzero(ok)[0]
    names_arr = frame.batch.table.column("name").combine_chunks().take(pa.array(k[sel]))
    bound = frame.codes("plasmient.bound", BOUND_CODE)[k[sel]].astype(np.int64)
    if sel.size <= max_points:
        ai_attr = frame.num("plasmient.arithmetic_intensity")[k[sel]]
        x = np.where(np.isnan(ai_attr), flops[sel] / nbytes[sel], ai_attr)
        y = flops[sel] / wall[sel]
        t = wall[sel]
        names, name_idx = _names(names_arr)
        r = roof[sel]
        count = np.ones(sel.size, dtype=np.int64)
    else:
        tab = pa.table(
            {
                "name": _short(names_arr),
                "roof": pa.array(roof[sel]),
                "flops": pa.array(flops[sel]),
                "bytes": pa.array(nbytes[sel]),
                "t": pa.array(wall[sel]),
                "bound": pa.array(bound),
            }
        ).sort_by([("t", "descending")])
        g = tab.group_by(["name", "roof"], use_threads=False).aggregate(
            [("flops", "sum"), ("bytes", "sum"), ("t", "sum"), ("t", "count"), ("bound", "first")]
        )
        g = g.sort_by([("t_sum", "descending")]).slice(0, max_points)
        fs, bs, t = (g.column(c).to_numpy() for c in ("flops_sum", "bytes_sum", "t_sum"))
        x, y = fs / bs, fs / t
        names, name_idx = _names(g.column("name").combine_chunks())
        r = g.column("roof").to_numpy()
        bound = g.column("bound_first").to_numpy()
        count = g.column("t_count").to_numpy()
        out["mode"] = "by_name"
    out.update(x=_f(x), y=_f(y), t=_f(t), bound=bound.astype(np.int32), name=name_idx, names=names, roof=r.astype(np.int32), count=count)
    return out
