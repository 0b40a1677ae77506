"""Per-span metrics of DESIGN.md, computed for every span at once from the kernels under it.

Each kernel carries flops, bytes, ideal seconds (flops / peak for its dtype) and its device. One pass
per tree depth maps every kernel to its ancestor at that depth; sums go through np.bincount and the
resident time (union of kernel intervals per device) through one grouped sweep per pass, so the cost is
O(kernels * depth) numpy work, no Python loop per kernel or per span.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..conventions import BOUNDS, DEFAULT_BASELINE_MFU

# Below this mean kernel duration a span's kernels are launch/latency-bound, whatever their intensity.
LATENCY_BOUND_MEAN_KERNEL_S = 10e-6
# Below this resident utilisation the device mostly waited: the span is idle-bound.
IDLE_BOUND_UTIL = 0.5
COMM_BOUND_SHARE = 0.5


@dataclass
class KernelFacts:
    """Per-kernel inputs, all arrays of the same length (kernels of every rank, concatenated)."""

    span: np.ndarray       # span index of the kernel's own span
    start: np.ndarray
    end: np.ndarray
    device_key: np.ndarray  # unique per (rank, device)
    flops: np.ndarray
    bytes: np.ndarray
    ideal_s: np.ndarray    # NaN where the peak is unknown
    is_comm: np.ndarray    # bool


@dataclass
class SpanSums:
    flops: np.ndarray
    bytes: np.ndarray
    ideal_s: np.ndarray
    busy_s: np.ndarray
    kernels: np.ndarray
    kernel_s: np.ndarray   # summed kernel durations (not a union)
    comm_s: np.ndarray
    devices: np.ndarray    # distinct devices under the span
    device_price: np.ndarray  # USD/hour summed over those devices (NaN: a price is unknown)


def _grouped_union_ns(group: np.ndarray, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Union length of intervals per group. Returns (unique group keys, union ns).

    The intervals must come sorted by start: a stable sort by group then keeps them in start order
    within each group, and on kernels (whose groups are runs of neighbours in time) timsort is
    close to linear.
    """
    order = np.argsort(group, kind="stable")
    g, s, e = group[order], start[order], end[order]
    new = np.empty(len(g), bool)
    new[:1] = True
    new[1:] = g[1:] != g[:-1]
    first = np.nonzero(new)[0]
    gmin = s[first]
    gmax = np.maximum.reduceat(e, first)
    width = gmax - gmin + 1
    # Lay the groups end to end so one running maximum serves all of them.
    offset = np.cumsum(width) - width - gmin
    gi = np.cumsum(new) - 1
    shift = offset[gi]
    s2, e2 = s + shift, e + shift
    running = np.maximum.accumulate(e2)
    prev = np.empty_like(running)
    prev[:1] = np.iinfo(np.int64).min
    prev[1:] = running[:-1]
    contrib = np.clip(e2 - np.maximum(s2, prev), 0, None)
    return g[first], np.add.reduceat(contrib, first)


def aggregate(parent: np.ndarray, depth: np.ndarray, kernels: KernelFacts, device_price: np.ndarray) -> SpanSums:
    """Sum kernel facts into every ancestor span (the kernel's own span included).

    Passes go by absolute tree depth, deepest first, so every span receives all kernels of its subtree
    in one pass: that is what makes the per-device union (and the distinct-device count) exact.
    device_price[k] is the USD/hour of device key k.
    """
    n = len(parent)
    out = SpanSums(*(np.zeros(n) for _ in range(3)), np.zeros(n), np.zeros(n, np.int64), np.zeros(n), np.zeros(n),
                   np.zeros(n, np.int64), np.zeros(n))
    if len(kernels.span) == 0:
        return out
    by_start = np.argsort(kernels.start, kind="stable")
    kernels = KernelFacts(*(getattr(kernels, f)[by_start] for f in KernelFacts.__dataclass_fields__))
    dur_s = np.maximum(kernels.end - kernels.start, 0) / 1e9
    comm_s = np.where(kernels.is_comm, dur_s, 0.0)
    n_dev = int(kernels.device_key.max()) + 1
    cur = kernels.span.astype(np.int64).copy()
    k_depth = depth[cur]
    for d in range(int(k_depth.max()), -1, -1):
        deeper = depth[cur] > d
        cur[deeper] = parent[cur[deeper]]
        live = np.nonzero(k_depth >= d)[0]
        c = cur[live]
        out.flops += np.bincount(c, weights=kernels.flops[live], minlength=n)
        out.bytes += np.bincount(c, weights=kernels.bytes[live], minlength=n)
        out.ideal_s += np.bincount(c, weights=kernels.ideal_s[live], minlength=n)
        out.kernels += np.bincount(c, minlength=n)
        out.kernel_s += np.bincount(c, weights=dur_s[live], minlength=n)
        out.comm_s += np.bincount(c, weights=comm_s[live], minlength=n)
        keys, union_ns = _grouped_union_ns(c * n_dev + kernels.device_key[live], kernels.start[live], kernels.end[live])
        owner = keys // n_dev
        out.busy_s += np.bincount(owner, weights=union_ns / 1e9, minlength=n)
        out.devices += np.bincount(owner, minlength=n)
        out.device_price += np.bincount(owner, weights=device_price[keys % n_dev], minlength=n)
    return out


@dataclass
class SpanMetrics:
    wall_s: np.ndarray
    util: np.ndarray
    mfu: np.ndarray            # NaN = absent
    stall: np.ndarray          # NaN = absent
    idle: np.ndarray
    intensity: np.ndarray      # NaN = absent
    bound: np.ndarray          # int8 index into conventions.BOUNDS
    cost: np.ndarray           # NaN = absent
    wasted_usd: np.ndarray
    wasted_s: np.ndarray
    ideal_s: np.ndarray        # capped at busy
    over_peak: np.ndarray      # bool: the model claimed more than peak * busy


def derive(
    sums: SpanSums,
    start: np.ndarray,
    end: np.ndarray,
    gpus: np.ndarray,
    ridge: np.ndarray,
    price_sum: np.ndarray,
    is_kernel: np.ndarray,
    baseline_mfu: float = DEFAULT_BASELINE_MFU,
) -> SpanMetrics:
    """Ratios, bound and cost from the sums. ridge: flop/byte of the span's device (NaN unknown);
    price_sum: USD per hour summed over the span's devices (NaN unknown)."""
    wall = np.maximum(end - start, 0) / 1e9
    device_s = wall * gpus
    with np.errstate(divide="ignore", invalid="ignore"):
        util = np.where(device_s > 0, np.minimum(sums.busy_s / device_s, 1.0), 0.0)
        ideal = sums.ideal_s.copy()
        over = ideal > sums.busy_s * (1 + 1e-9)
        ideal = np.where(over, sums.busy_s, ideal)
        mfu = np.where(device_s > 0, ideal / device_s, np.where(np.isnan(ideal), np.nan, 0.0))
        mfu = np.minimum(mfu, util)
        stall = np.where(sums.busy_s > 0, np.clip(1.0 - ideal / sums.busy_s, 0.0, 1.0), np.nan)
        intensity = np.where(sums.bytes > 0, sums.flops / sums.bytes, np.nan)
        cost = price_sum * wall / 3600.0
        waste_share = np.maximum(0.0, 1.0 - mfu / baseline_mfu)
        wasted_usd = cost * waste_share
        wasted_s = np.maximum(0.0, device_s - ideal / baseline_mfu)
        mean_kernel = np.where(sums.kernels > 0, sums.kernel_s / np.maximum(sums.kernels, 1), 0.0)
        comm_share = np.where(sums.kernel_s > 0, sums.comm_s / sums.kernel_s, 0.0)
    codes = {name: i for i, name in enumerate(BOUNDS)}
    ridge_or_inf = np.nan_to_num(ridge, nan=np.inf)
    bound = np.select(
        [sums.kernels == 0,
         comm_share > COMM_BOUND_SHARE,
         ~is_kernel & (util < IDLE_BOUND_UTIL),
         mean_kernel < LATENCY_BOUND_MEAN_KERNEL_S,
         (sums.flops > 0) & ((sums.bytes == 0) | (intensity >= ridge_or_inf))],
        [codes["idle"], codes["communication"], codes["idle"], codes["latency"], codes["compute"]],
        default=codes["memory"],
    ).astype(np.int8)
    return SpanMetrics(wall, util, mfu, stall, 1.0 - util, intensity, bound, cost, wasted_usd, wasted_s, ideal, over)


def kernel_waste_s(start: np.ndarray, end: np.ndarray, ideal_s: np.ndarray, baseline_mfu: float = DEFAULT_BASELINE_MFU) -> np.ndarray:
    """Device-seconds a kernel spent below the baseline MFU; its full duration where the peak is unknown."""
    dur = np.maximum(end - start, 0) / 1e9
    ideal = np.where(np.isnan(ideal_s), 0.0, np.minimum(ideal_s, dur))
    return np.maximum(0.0, dur - ideal / baseline_mfu)


def top_label_per_group(group: np.ndarray, label: np.ndarray, weight: np.ndarray, n_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """For each group, the label with the largest summed weight: (label or -1, its weight)."""
    best_label = np.full(n_groups, -1, np.int64)
    best_weight = np.zeros(n_groups)
    ok = (group >= 0) & (label >= 0)
    if not ok.any():
        return best_label, best_weight
    g, lab, w = group[ok], label[ok], weight[ok]
    # Groups are few (steps, ranks, nodes): densify them so (group, label) fits a bincount.
    targets, g_dense = np.unique(g, return_inverse=True)
    n_lab = int(lab.max()) + 1
    if len(targets) * n_lab <= 1 << 26:
        sums = np.bincount(g_dense * n_lab + lab, weights=w, minlength=len(targets) * n_lab).reshape(len(targets), n_lab)
        present = np.bincount(g_dense * n_lab + lab, minlength=len(targets) * n_lab).reshape(len(targets), n_lab) > 0
        sums = np.where(present, sums, -np.inf)
        top = np.argmax(sums, axis=1)
        best_label[targets] = top
        best_weight[targets] = sums[np.arange(len(targets)), top]
        return best_label, best_weight
    key = g_dense.astype(np.int64) * n_lab + lab
    uniq, inv = np.unique(key, return_inverse=True)
    sums = np.bincount(inv, weights=w)
    ug, ul = uniq // n_lab, uniq % n_lab
    order = np.lexsort((-sums, ug))
    ug, ul, sums = ug[order], ul[order], sums[order]
    first = np.concatenate([[True], ug[1:] != ug[:-1]])
    best_label[targets[ug[first]]] = ul[first]
    best_weight[targets[ug[first]]] = sums[first]
    return best_label, best_weight
