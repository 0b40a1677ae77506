"""The arithmetic of DESIGN.md's metrics over a span tree, for every span at once.

Inputs are flat arrays: a parent index per span and per-kernel facts. Additive quantities (FLOPs, bytes,
ideal seconds, busy device-seconds, wasted device-seconds, cost) are rolled up the tree with one bincount
per depth level, so every parent's total is the sum of its children's (nothing counted twice). Resident
time (the union of kernel intervals per device) and the device extent of a subtree go through one grouped
sweep per depth level. No Python loop per kernel or per span.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..conventions import BOUNDS, DEFAULT_BASELINE_MFU
from ..stitch.nesting import reduce_to_parents
from .grouping import unique_inverse

# Below this mean kernel duration a span's kernels are launch/latency-bound, whatever their intensity.
LATENCY_BOUND_MEAN_KERNEL_S = 10e-6
# Below this resident utilisation the device mostly waited: the span is idle-bound.
IDLE_BOUND_UTIL = 0.5
COMM_BOUND_SHARE = 0.5
# compute/memory are only claimed when this share of the busy time has known FLOPs.
BOUND_EVIDENCE_COVERAGE = 0.5
BOUND_CODE = {name: i for i, name in enumerate(BOUNDS)}
# Coverage at or above this is "every busy second's FLOPs are known" (sums of the same seconds, rounded).
FULL_COVERAGE = 1.0 - 1e-9


def flops_measured(flops: np.ndarray, coverage: np.ndarray) -> np.ndarray:
    """Where the ratios built on known FLOPs (MFU, HFU, stall, arithmetic intensity) are measurements: some
    busy time has known FLOPs, and either some of them are non-zero or every busy second's are known. Known
    FLOPs of zero beside unknown ones (a step whose only modelled kernels are its collectives and copies)
    bound MFU below by 0, which says nothing about it: the ratio is absent, not 0."""
    flops, coverage = np.asarray(flops, np.float64), np.asarray(coverage, np.float64)
    with np.errstate(invalid="ignore"):
        return (coverage > 0) & ((flops > 0) | (coverage >= FULL_COVERAGE))


def zero_says_nothing(total: np.ndarray, busy_s: np.ndarray, known_s: np.ndarray) -> np.ndarray:
    """Where a span's sum of known FLOPs (or bytes, or ideal seconds) is 0 while some of its busy time ran
    work whose FLOPs are unknown: a 0 there is "unknown", not a measured zero, so the number is absent (an
    Inductor-fused CPU kernel or an unmodelled sort read "plasmient.flops 0"). Spans whose busy time is all
    known keep a 0 (views, copies, collectives: a known zero), and spans without busy time keep theirs."""
    total, busy_s, known_s = (np.asarray(a, np.float64) for a in (total, busy_s, known_s))
    with np.errstate(invalid="ignore"):
        return (total == 0) & (busy_s > 0) & (known_s < busy_s * FULL_COVERAGE)


def rollup(parent: np.ndarray, depth: np.ndarray, values: np.ndarray, levels: list[np.ndarray] | None = None) -> np.ndarray:
    """Inclusive subtree sums of per-span values (rows = spans, any trailing columns); ``levels`` as
    ``nesting.depth_levels(depth)`` when the caller has it."""
    return reduce_to_parents(parent, depth, np.asarray(values, np.float64), np.add, levels=levels)


def grouped_union_ns(group: np.ndarray, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per group: (keys, union length, min start, max end). Intervals must come sorted by start."""
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
    return g[first], np.add.reduceat(contrib, first), gmin, gmax


@dataclass
class DeviceStats:
    union_s: np.ndarray    # resident seconds (union of kernel intervals per device, summed over devices)
    devices: np.ndarray    # distinct devices under the span
    ext_start: np.ndarray  # first kernel start under the span (int64 max where none)
    ext_end: np.ndarray    # last kernel end under the span (int64 min where none)


def subtree_device_stats(parent: np.ndarray, depth: np.ndarray, k_span: np.ndarray, k_start: np.ndarray,
                         k_end: np.ndarray, k_device: np.ndarray) -> DeviceStats:
    """Resident time, device count and device extent of every span's subtree.

    Passes go by absolute tree depth, deepest first, so every span receives all kernels of its subtree
    in one pass: that is what makes the per-device union (and the distinct-device count) exact.
    """
    n = len(parent)
    out = DeviceStats(np.zeros(n), np.zeros(n, np.int64), np.full(n, np.iinfo(np.int64).max, np.int64),
                      np.full(n, np.iinfo(np.int64).min, np.int64))
    if len(k_span) == 0:
        return out
    by_start = np.argsort(k_start, kind="stable")
    k_span, k_start, k_end = k_span[by_start], k_start[by_start], k_end[by_start]
    dev_codes, dev = unique_inverse(k_device)
    n_dev = len(dev_codes)
    cur = k_span.astype(np.int64).copy()
    k_depth = depth[cur]
    joins_at = np.bincount(k_depth, minlength=int(k_depth.max()) + 1)
    prev: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
    for d in range(int(k_depth.max()), -1, -1):
        deeper = depth[cur] > d
        cur[deeper] = parent[cur[deeper]]
        if prev is not None and joins_at[d] == 0:
            # No kernel joins at this depth: if no two groups merge going up one level (a chain, as in
            # deeply nested ops), every group's union and extent carry over unchanged.
            keys, union_ns, gmin, gmax = prev
            up = parent[keys // n_dev] * n_dev + keys % n_dev
            if len(np.unique(up)) == len(up):
                prev = (up, union_ns, gmin, gmax)
                _credit(out, up // n_dev, union_ns, gmin, gmax, n)
                continue
        live = np.nonzero(k_depth >= d)[0]
        prev = grouped_union_ns(cur[live] * n_dev + dev[live], k_start[live], k_end[live])
        _credit(out, prev[0] // n_dev, prev[1], prev[2], prev[3], n)
    return out


def _credit(out: DeviceStats, owner: np.ndarray, union_ns: np.ndarray, gmin: np.ndarray, gmax: np.ndarray, n: int) -> None:
    # owners are unique per (owner, device) group, not per owner: accumulate only where they are
    np.add.at(out.union_s, owner, union_ns / 1e9)
    np.add.at(out.devices, owner, 1)
    np.minimum.at(out.ext_start, owner, gmin)
    np.maximum.at(out.ext_end, owner, gmax)


def kernel_waste_s(share_s: np.ndarray, ideal_s: np.ndarray, baseline_mfu: float = DEFAULT_BASELINE_MFU) -> np.ndarray:
    """Device-seconds a kernel held without doing baseline-MFU work: its share of the device minus
    ideal/baseline. A kernel whose FLOPs or peak are unknown has no proven useful work: all of it."""
    ideal = np.where(np.isnan(ideal_s), 0.0, ideal_s)
    with np.errstate(over="ignore"):  # a baseline near 0 makes any work infinitely enough: no waste, no warning
        return np.maximum(0.0, share_s - ideal / baseline_mfu)


def bound_codes(*, has_device: np.ndarray, is_kernel: np.ndarray, util: np.ndarray, kernels: np.ndarray,
                kernel_s: np.ndarray, comm_s: np.ndarray, copy_s: np.ndarray, ideal_s: np.ndarray,
                memory_s: np.ndarray, coverage: np.ndarray, work_free: np.ndarray | None = None,
                moves_data: np.ndarray | None = None) -> np.ndarray:
    """What limits each span, from evidence only (-1 = absent: the span has no device time).

    communication: collectives are most of its kernel time; idle: the device mostly waited in its window;
    latency: tiny kernels, and ``work_free`` spans (a CPU's shape-only ops, t or reshape, that moved and computed
    nothing: their whole time is per-op overhead, however long); copies are memory-bound by nature, and so are
    ``moves_data`` kernels (the transposes, fills and casts beside a matmul's GEMM, which carry none of its work);
    compute/memory: only with known FLOPs
    (coverage), bytes, peaks and bandwidth, by the roofline of each kernel's own precision: would the
    span's math at peak (``ideal_s``: every kernel's FLOPs over the peak of the precision it ran at) take
    longer than moving its bytes at full bandwidth (``memory_s``)? For one precision that is arithmetic
    intensity against that precision's ridge point. One ridge for every kernel (the bf16 tensor-core peak's)
    called V100's fp32 convolutions, compute-bound at fp32, memory-bound. Anything else is ``unknown``.
    """
    with np.errstate(divide="ignore", invalid="ignore"):
        mean_kernel = np.where(kernels > 0, kernel_s / np.maximum(kernels, 1), 0.0)
        comm_share = np.where(kernel_s > 0, comm_s / kernel_s, 0.0)
        copy_share = np.where(kernel_s > 0, copy_s / kernel_s, 0.0)
    evidence = (coverage >= BOUND_EVIDENCE_COVERAGE) & (memory_s > 0) & np.isfinite(memory_s) & np.isfinite(ideal_s)
    code = np.select(
        [~has_device,
         kernels == 0,
         comm_share > COMM_BOUND_SHARE,
         ~is_kernel & (util < IDLE_BOUND_UTIL),
         mean_kernel < LATENCY_BOUND_MEAN_KERNEL_S,
         (copy_share > 0.5) if moves_data is None else (copy_share > 0.5) | moves_data,
         np.zeros(len(kernels), bool) if work_free is None else work_free,
         evidence & (ideal_s >= memory_s),
         evidence & (ideal_s < memory_s)],
        [-1, BOUND_CODE["idle"], BOUND_CODE["communication"], BOUND_CODE["idle"], BOUND_CODE["latency"],
         BOUND_CODE["memory"], BOUND_CODE["latency"], BOUND_CODE["compute"], BOUND_CODE["memory"]],
        default=BOUND_CODE["unknown"],
    )
    return code.astype(np.int8)
