"""What a step's device timeline hid and what it exposed: communication and copies against compute, idle time
split by who made the device wait, and how deep the launch queue ran.

Kernels keep their whole intervals (``stitch.windows``: a pipelined step's kernels may start in the previous
step's tile).

* communication overlap, as HTA's ``get_comm_comp_overlap`` and TraceLens's exposed communication define it:
  per (step, device), ``total`` = time some collective of the step ran (the union of their intervals) and
  ``hidden`` = the part of it during which a compute kernel ran on that device, whichever step launched it;
  ``exposed = total - hidden``. Unions only, so concurrent collectives count once. Copies (memcpy/memset) the
  same way.
* idle split, over the step's tile (its device window): ``device`` idle where a kernel was already
  launched but not yet started (queued behind a dependency, an event, another stream: the device waited on
  itself) and ``host`` idle where nothing was queued (the host did not feed it).
  ``device = |U(queued + kernels) in tile| - |U(kernels) in tile|``, over all the rank's kernels; unknown (NaN)
  for a step none of whose kernels has a launch record.
* launch queue: the rank's kernels launched and not yet finished, over the step's tile: time-weighted mean
  and maximum (NaN where none of the step's kernels has a launch record).

Interval arithmetic in numpy (merged unions and running totals, ``windows.Coverage``), no loop per kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..metrics.grouping import unique_inverse
from .windows import Coverage, merge_intervals


@dataclass
class StepOverlap:
    """Per step row, summed over the rank's devices (seconds), and the launch-queue statistics."""

    comm_total_s: np.ndarray
    comm_exposed_s: np.ndarray
    copy_total_s: np.ndarray
    copy_exposed_s: np.ndarray
    idle_device_s: np.ndarray   # NaN where none of the step's kernels had a launch record
    resident_s: np.ndarray      # time any kernel of the rank ran in the step's tile (idle is the rest)
    queue_mean: np.ndarray      # NaN where no kernel had a launch record
    queue_max: np.ndarray


def step_overlap(n_steps: int, step: np.ndarray, device: np.ndarray, start: np.ndarray, end: np.ndarray,
                 is_comm: np.ndarray, is_copy: np.ndarray, launch_start: np.ndarray,
                 tile_start: np.ndarray, tile_end: np.ndarray) -> StepOverlap:
    """Kernels (alive ones) with their step row, device, interval, kind flags and launch start (-1: no launch
    record); the steps' tiles (their device windows)."""
    dev = unique_inverse(device)[1]
    n_dev = int(dev.max()) + 1 if len(dev) else 1
    group = step * n_dev + dev
    n_groups = n_steps * n_dev
    compute = ~is_comm & ~is_copy
    compute_cover = Coverage.of(dev[compute], start[compute], end[compute])

    def per_step(values: np.ndarray) -> np.ndarray:
        return values.reshape(n_steps, n_dev).sum(axis=1) / 1e9 if n_steps else np.zeros(0)

    def hidden_and_total(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        g, ms, me = merge_intervals(group[mask], start[mask], end[mask])
        total = np.bincount(g, weights=(me - ms).astype(np.float64), minlength=n_groups)
        hidden = np.bincount(g, weights=compute_cover.covered(g % n_dev, ms, me).astype(np.float64), minlength=n_groups)
        return hidden, total

    comm_hidden, comm_total = hidden_and_total(is_comm)
    copy_hidden, copy_total = hidden_and_total(is_copy)

    # queued: launched, not yet started
    has_launch = (launch_start >= 0) & (launch_start < start)
    kernels = Coverage.of(dev, start, end)
    with_queue = Coverage.of(np.concatenate([dev, dev[has_launch]]), np.concatenate([start, launch_start[has_launch]]),
                             np.concatenate([end, start[has_launch]]))
    step_dev = np.repeat(np.arange(n_steps), n_dev)
    dev_ids = np.tile(np.arange(n_dev), n_steps)
    a, b = tile_start[step_dev], tile_end[step_dev]
    resident = kernels.covered(dev_ids, a, b).astype(np.float64)
    idle_device = np.maximum(with_queue.covered(dev_ids, a, b) - resident, 0.0)

    queue_mean, queue_max = _launch_queue(n_steps, step, launch_start, end, tile_start, tile_end)
    # Without a launch record nothing is known to have been queued: the split is unknown, not "all host"
    # (live step-depth steps record kernels only; some traces have no runtime events).
    unlaunched = (np.bincount(step, minlength=n_steps) > 0) & (np.bincount(step[launch_start >= 0], minlength=n_steps) == 0)
    return StepOverlap(
        comm_total_s=per_step(comm_total), comm_exposed_s=per_step(comm_total - comm_hidden),
        copy_total_s=per_step(copy_total), copy_exposed_s=per_step(copy_total - copy_hidden),
        idle_device_s=np.where(unlaunched[:n_steps], np.nan, per_step(idle_device)), resident_s=per_step(resident), queue_mean=queue_mean,
        queue_max=queue_max,
    )


def _launch_queue(n_steps: int, step: np.ndarray, launch_start: np.ndarray, end: np.ndarray,
                  window_start: np.ndarray, window_end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Kernels launched and not yet finished (+1 at launch, -1 at the end), over each step's window: the
    time-weighted mean and the maximum. One sweep over the rank's events; a loop per step, not per kernel."""
    queue_mean = np.full(n_steps, np.nan)
    queue_max = np.full(n_steps, np.nan)
    has_launch = launch_start >= 0
    if not has_launch.any():
        return queue_mean, queue_max
    a = launch_start[has_launch]
    b = np.maximum(end[has_launch], a)
    t = np.concatenate([a, b])
    d = np.concatenate([np.ones(len(a), np.int64), -np.ones(len(b), np.int64)])
    order = np.lexsort((d, t))  # ends before starts at the same instant
    t, depth = t[order], np.cumsum(d[order])  # depth right after each event
    integral = np.concatenate([[0.0], np.cumsum(depth[:-1] * np.diff(t).astype(np.float64))])

    def area_upto(x: np.ndarray) -> np.ndarray:
        k = np.searchsorted(t, x, side="right") - 1
        safe = np.maximum(k, 0)
        return np.where(k >= 0, integral[safe] + depth[safe] * (x - t[safe]).astype(np.float64), 0.0)

    width = np.maximum(window_end - window_start, 1).astype(np.float64)
    mean = (area_upto(window_end) - area_upto(window_start)) / width
    first = np.searchsorted(t, window_start, side="right")  # events after the window opens
    last = np.searchsorted(t, window_end, side="left")      # events before it closes
    at_open = np.where(first > 0, depth[np.maximum(first - 1, 0)], 0)
    seen = np.bincount(step[has_launch], minlength=n_steps) > 0
    for s in np.nonzero(seen)[0]:
        inner = depth[first[s]:last[s]]
        queue_max[s] = max(int(at_open[s]), int(inner.max()) if len(inner) else 0)
        queue_mean[s] = mean[s]
    return queue_mean, queue_max
