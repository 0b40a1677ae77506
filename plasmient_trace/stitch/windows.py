"""Device-time windows: where on the device's timeline each step lives, and how concurrent kernels share it.

* Steps tile each rank's device timeline. A step's tile, its device window, runs from where the previous
  step's device work ended (the first step: from its own CPU start) to the end of its last kernel: the
  period between step boundaries on the device, so the host gap before a step's first kernel is that
  step's idle time, no device nanosecond lies in two windows, and a step's MFU is its work over its period.
* Kernels are never clipped to their step's tile. A pipelined job (the next batch's input copies running
  under the previous step's compute) starts a step's first kernels in the previous step's tile: they keep
  their whole interval and their time and work stay with their own step.
* Concurrent kernels on one device share each nanosecond equally (a compute kernel overlapped by an NCCL
  kernel gets half of the overlap, whichever steps they belong to), so summed kernel device-seconds never
  exceed the device's elapsed time: that share is the additive ``busy`` of the accounting. A step's resident
  time is the time any kernel of the rank ran in its tile and its idle time is the rest, so over a rank
  busy + idle is exactly the sum of the tiles, however the steps' work overlaps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..metrics.grouping import unique_inverse


def _end_to_end(group: np.ndarray, n_groups: int, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per group (0..n_groups-1): its first start, last end, and the shift that lays the groups end to end
    on one time axis (a gap of 1 ns between them), so one sort or running maximum serves all of them."""
    lo = np.full(n_groups, np.iinfo(np.int64).max)
    hi = np.full(n_groups, np.iinfo(np.int64).min)
    np.minimum.at(lo, group, start)
    np.maximum.at(hi, group, end)
    width = hi - lo + 1
    return lo, hi, np.cumsum(width) - width - lo


def step_tiles(step_cpu_start: np.ndarray, step_cpu_end: np.ndarray, last_kernel_end: np.ndarray,
               has_kernels: np.ndarray, opens_at: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(tile start, tile end) per step; steps must be given in time order.

    A step with no kernels ends at its CPU end (the device sat idle through it). Tiles are
    non-decreasing, so they tile: start[i] == end[i-1]. The first tile opens at the first step's CPU
    start, or at ``opens_at``: where the previous step's tile ended when that step was stitched earlier
    (a live capture's previous batch).
    """
    n = len(step_cpu_start)
    own_end = np.where(has_kernels, last_kernel_end, step_cpu_end).astype(np.int64)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    first = int(step_cpu_start[0]) if opens_at is None else int(opens_at)
    end = np.maximum.accumulate(np.maximum(own_end, first))
    start = np.empty(n, np.int64)
    start[0] = first
    start[1:] = end[:-1]
    end = np.maximum(end, start)
    return start, end


def kernel_shares_ns(device_key: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Device nanoseconds each kernel holds when concurrent kernels on a device split time equally.

    With c(t) kernels resident at t, kernel k gets the integral of 1/c(t) over its interval. F(t), the
    running integral of 1/c over the device's events, is built once; a kernel's share is F(end) - F(start).
    Devices are laid end to end on one time axis so one sort serves all of them.
    """
    n = len(start)
    if n == 0:
        return np.zeros(0)
    start = start.astype(np.int64)
    end = np.maximum(end.astype(np.int64), start)
    keys, dev = unique_inverse(device_key)
    _, _, offset = _end_to_end(dev, len(keys), start, end)
    s, e = start + offset[dev], end + offset[dev]
    times = np.concatenate([s, e])
    delta = np.concatenate([np.ones(n, np.int64), -np.ones(n, np.int64)])
    order = np.argsort(times, kind="stable")
    t, d = times[order], delta[order]
    active = np.cumsum(d)                      # kernels resident right after each event
    dt = np.diff(t).astype(np.float64)         # length of the segment after each event but the last
    rate = np.where(active[:-1] > 0, 1.0 / np.maximum(active[:-1], 1), 0.0)
    f = np.concatenate([[0.0], np.cumsum(dt * rate)])
    # F at each kernel's own start and end event: where the sort put them. Events at equal times have equal F
    # (the segments between them are empty and add exactly 0.0), so this is F at the first event of that time.
    place = np.empty(2 * n, np.int64)
    place[order] = np.arange(2 * n)
    return np.maximum(f[place[n:]] - f[place[:n]], 0.0)


def merge_intervals(group: np.ndarray, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The union of the intervals of each group as disjoint intervals: (group, start, end), sorted by group
    then start. Empty intervals are dropped."""
    ok = end > start
    group, start, end = group[ok].astype(np.int64), start[ok].astype(np.int64), end[ok].astype(np.int64)
    if not len(group):
        return group, start, end
    # lay the groups end to end on one time axis: one stable sort of one key orders the intervals by group
    # then start (as a lexsort of the two would, at half its cost), and one running maximum serves them all
    keys, gi = unique_inverse(group)
    shift = _end_to_end(gi, len(keys), start, end)[2][gi]
    order = np.argsort(start + shift, kind="stable")
    g, s, e, shift = group[order], start[order], end[order], shift[order]
    reach = np.maximum.accumulate(e + shift)
    new = np.ones(len(s), bool)
    new[1:] = s[1:] + shift[1:] > reach[:-1]
    first = np.nonzero(new)[0]
    return g[first], s[first], np.maximum.reduceat(e, first)


@dataclass
class Coverage:
    """The union of a set of intervals per group (device), as a running total: how many nanoseconds of the
    union lie before any instant. Groups are laid end to end on one time axis so one binary search serves
    every query; ``covered(group, a, b)`` is the union's length inside [a, b]."""

    keys: np.ndarray      # sorted group keys present
    lo: np.ndarray        # per key: its first start and last end
    hi: np.ndarray
    offset: np.ndarray    # per key: shift onto the shared axis
    starts: np.ndarray    # merged intervals on the shared axis, sorted
    ends: np.ndarray
    before: np.ndarray    # union length before each merged interval

    @classmethod
    def of(cls, group: np.ndarray, start: np.ndarray, end: np.ndarray) -> Coverage:
        g, ms, me = merge_intervals(group, start, end)
        keys, gi = unique_inverse(g)
        lo, hi, offset = _end_to_end(gi, len(keys), ms, me)
        length = me - ms
        return cls(keys, lo, hi, offset, ms + offset[gi], me + offset[gi], np.cumsum(length) - length)

    def _upto(self, idx: np.ndarray, t: np.ndarray) -> np.ndarray:
        x = np.clip(t, self.lo[idx], self.hi[idx]) + self.offset[idx]
        i = np.searchsorted(self.starts, x, side="right") - 1
        safe = np.maximum(i, 0)
        inside = np.clip(x - self.starts[safe], 0, self.ends[safe] - self.starts[safe])
        return np.where(i >= 0, self.before[safe] + inside, 0)

    def covered(self, group: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Nanoseconds of the union inside [a, b] (0 for a group with no intervals or b <= a)."""
        group = np.asarray(group, np.int64)
        out = np.zeros(len(group), np.int64)
        if not len(self.keys) or not len(group):
            return out
        idx = np.minimum(np.searchsorted(self.keys, group), len(self.keys) - 1)
        hit = (self.keys[idx] == group) & (b > a)
        if hit.any():
            out[hit] = self._upto(idx[hit], b[hit]) - self._upto(idx[hit], a[hit])
        return out
