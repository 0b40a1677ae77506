"""What a step's device timeline hid and what it exposed: communication and copies against compute, idle time
split by who made the device wait, and how deep the launch queue ran.

Per (step, device), over the step's device window (kernels clipped to it):

* communication overlap, as HTA's ``get_comm_comp_overlap`` and TraceLens's exposed communication define it:
  ``total`` = time some collective ran (the union of their intervals), ``hidden`` = the part of it during which
  a compute kernel also ran, ``exposed = total - hidden``. Unions only, so concurrent collectives count once:
  ``hidden = |U(comm)| + |U(compute)| - |U(comm + compute)|``. Copies (memcpy/memset) the same way.
* idle split: the window's idle time is ``device`` idle where a kernel was already launched but not yet started
  (queued behind a dependency, an event, another stream: the device waited on itself) and ``host`` idle where
  nothing was queued (the host did not feed it). ``device = |U(queued + kernels)| - |U(kernels)|``.
* launch queue: kernels launched and not yet finished, over the window: time-weighted mean and maximum.

All of it is grouped interval arithmetic in numpy (one sort per quantity), no loop per kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..metrics.compute import grouped_union_ns


def _union_per_group(group: np.ndarray, start: np.ndarray, end: np.ndarray, n_groups: int) -> np.ndarray:
    out = np.zeros(n_groups)
    ok = end > start
    if not ok.any():
        return out
    order = np.argsort(start[ok], kind="stable")
    keys, union_ns, _, _ = grouped_union_ns(group[ok][order], start[ok][order], end[ok][order])
    out[keys] = union_ns
    return out


@dataclass
class StepOverlap:
    """Per step row, summed over the rank's devices (seconds), and the launch-queue statistics."""

    comm_total_s: np.ndarray
    comm_exposed_s: np.ndarray
    copy_total_s: np.ndarray
    copy_exposed_s: np.ndarray
    idle_device_s: np.ndarray
    queue_mean: np.ndarray      # NaN where no kernel had a launch record
    queue_max: np.ndarray


def step_overlap(n_steps: int, step: np.ndarray, device: np.ndarray, start: np.ndarray, end: np.ndarray,
                 is_comm: np.ndarray, is_copy: np.ndarray, launch_start: np.ndarray,
                 window_start: np.ndarray, window_end: np.ndarray) -> StepOverlap:
    """Kernels (alive ones) with their step row, device, clipped interval, kind flags and launch start
    (-1: no launch record); windows per step row."""
    _, dev = np.unique(device, return_inverse=True) if len(device) else (None, np.zeros(0, np.int64))
    dev = dev.reshape(-1)
    n_dev = int(dev.max()) + 1 if len(dev) else 1
    group = step * n_dev + dev
    n_groups = n_steps * n_dev
    compute = ~is_comm & ~is_copy

    def per_step(values: np.ndarray) -> np.ndarray:
        return values.reshape(n_steps, n_dev).sum(axis=1) / 1e9 if n_steps else np.zeros(0)

    def hidden_and_total(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        total = _union_per_group(group[mask], start[mask], end[mask], n_groups)
        comp = _union_per_group(group[compute], start[compute], end[compute], n_groups)
        both = mask | compute
        together = _union_per_group(group[both], start[both], end[both], n_groups)
        return np.maximum(total + comp - together, 0.0), total

    comm_hidden, comm_total = hidden_and_total(is_comm)
    copy_hidden, copy_total = hidden_and_total(is_copy)

    # queued: launched, not yet started; clipped to the step's window
    has_launch = launch_start >= 0
    ws, we = window_start[step], window_end[step]
    q_start = np.clip(np.where(has_launch, launch_start, start), ws, we)
    q_end = np.clip(start, q_start, we)
    kernels = _union_per_group(group, start, end, n_groups)
    with_queue = _union_per_group(np.concatenate([group, group]), np.concatenate([start, q_start]),
                                  np.concatenate([end, q_end]), n_groups)
    idle_device = np.maximum(with_queue - kernels, 0.0)

    # launch queue depth: +1 at launch (clipped into the window), -1 at the kernel's end
    queue_mean = np.full(n_steps, np.nan)
    queue_max = np.full(n_steps, np.nan)
    if has_launch.any():
        g = step[has_launch]
        a = np.clip(launch_start[has_launch], ws[has_launch], we[has_launch])
        b = np.clip(end[has_launch], a, we[has_launch])
        win = np.maximum(window_end - window_start, 1).astype(np.float64)
        queue_mean = np.bincount(g, weights=(b - a).astype(np.float64), minlength=n_steps) / win
        t = np.concatenate([a, b])
        d = np.concatenate([np.ones(len(a), np.int64), -np.ones(len(b), np.int64)])
        gg = np.concatenate([g, g])
        order = np.lexsort((d, t, gg))  # ends before starts at the same instant
        depth = np.cumsum(d[order])     # every group nets to zero, so groups do not leak into each other
        gs = gg[order]
        first = np.r_[0, np.nonzero(gs[1:] != gs[:-1])[0] + 1]
        queue_max[gs[first]] = np.maximum.reduceat(depth, first)
        seen = np.bincount(g, minlength=n_steps) > 0
        queue_mean[~seen] = np.nan
    return StepOverlap(
        comm_total_s=per_step(comm_total), comm_exposed_s=per_step(comm_total - comm_hidden),
        copy_total_s=per_step(copy_total), copy_exposed_s=per_step(copy_total - copy_hidden),
        idle_device_s=per_step(idle_device), queue_mean=queue_mean, queue_max=queue_max,
    )
