"""Device-time windows: where on the device's timeline each step lives, and how concurrent kernels share it.

* Steps tile each rank's device timeline. A step's window runs from where the previous step's device
  work ended (the first step: from its own CPU start) to the end of its last kernel, so the host gap before
  a step's first kernel is that step's idle time and no device nanosecond belongs to two steps. Kernels are
  clipped to their step's window for every metric (a kernel that began under the previous step's tail on
  another stream gives that overlap up rather than counting it twice).
* Concurrent kernels on one device share each nanosecond equally (a compute kernel overlapped by an NCCL
  kernel gets half of the overlap), so summed kernel device-seconds never exceed the device's elapsed time:
  that share is the additive ``busy`` of the accounting.
"""

from __future__ import annotations

import numpy as np


def step_windows(step_cpu_start: np.ndarray, step_cpu_end: np.ndarray, last_kernel_end: np.ndarray,
                 has_kernels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(window start, window end) per step; steps must be given in time order.

    A step with no kernels ends at its CPU end (the device sat idle through it). Windows are
    non-decreasing, so they tile: start[i] == end[i-1].
    """
    n = len(step_cpu_start)
    own_end = np.where(has_kernels, last_kernel_end, step_cpu_end).astype(np.int64)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    end = np.maximum.accumulate(np.maximum(own_end, step_cpu_start[0]))
    start = np.empty(n, np.int64)
    start[0] = step_cpu_start[0]
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
    keys, dev = np.unique(device_key, return_inverse=True)
    lo = np.full(len(keys), np.iinfo(np.int64).max)
    hi = np.full(len(keys), np.iinfo(np.int64).min)
    np.minimum.at(lo, dev, start)
    np.maximum.at(hi, dev, end)
    width = hi - lo + 1
    offset = np.cumsum(width) - width - lo
    s, e = start + offset[dev], end + offset[dev]
    times = np.concatenate([s, e])
    delta = np.concatenate([np.ones(n, np.int64), -np.ones(n, np.int64)])
    order = np.argsort(times, kind="stable")
    t, d = times[order], delta[order]
    active = np.cumsum(d)                      # kernels resident right after each event
    dt = np.diff(t).astype(np.float64)         # length of the segment after each event but the last
    rate = np.where(active[:-1] > 0, 1.0 / np.maximum(active[:-1], 1), 0.0)
    f = np.concatenate([[0.0], np.cumsum(dt * rate)])
    # F at a time value: take it at the first event with that time (the segments between equal times are empty).
    first = np.searchsorted(t, s, side="left")
    last = np.searchsorted(t, e, side="left")
    return np.maximum(f[last] - f[first], 0.0)
