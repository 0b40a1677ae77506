"""The span budget: which spans below the step a trace exports, at most ``--max-spans`` in all.

Every module, op and kernel span gets a priority that is the maximum over its subtree of (kernel waste,
kernel device time, CPU time), compared in that order. A parent's priority is therefore never below its
child's, and with ties broken by depth (ancestors first) any prefix of the ranking is closed under
ancestors: keeping the top N keeps the most wasteful kernels *with* their op and module chain, and drops
first what has no device time and next to no CPU time (allocations, views). What is not exported is
counted, inclusively, on every span above it: ``plasmient.kernels.folded`` on the step is every kernel
of the step that is not a span. Parquet keeps every record either way.
"""

from __future__ import annotations

import numpy as np

from .inputs import LEVEL_CODE
from .nesting import depth_levels, fold_rows_to_parents
from .rank import RankTree


def choose_exported(tree: RankTree, allowance: int, full_depth_steps: set[int] | None, steps: np.ndarray) -> np.ndarray:
    """Boolean mask of the spans to export. `allowance` = spans this rank may use in each trace."""
    t = tree
    n = len(t.level)
    export = t.alive.copy()
    is_kernel = t.level == LEVEL_CODE["kernel"]
    synthetic = np.zeros(n, bool)
    synthetic[t.base["kernel"] + t.n_k:] = True   # CPU ops standing for kernels: the op span is exported instead
    export &= ~synthetic
    below_step = t.level >= LEVEL_CODE["module"]
    if full_depth_steps is not None:
        full = np.isin(steps[np.maximum(t.step_row, 0)], np.fromiter(full_depth_steps, np.int64, len(full_depth_steps)))
        export &= ~(below_step & ~full)
    cand = np.nonzero(export & below_step)[0]
    if not len(cand) or np.bincount(t.step_row[cand]).max() <= allowance:
        return export  # every step's spans fit: nothing to rank
    waste = np.zeros(n)
    waste[t.base["kernel"] + t.k_rows] = t.k_waste
    device = np.where(is_kernel, t.col("kernel_s"), 0.0)
    cpu = np.where(is_kernel | (t.level < LEVEL_CODE["module"]), 0.0, (t.end - t.start) / 1e9)
    a, b, c = priority = np.stack([waste, device, cpu])
    fold_rows_to_parents(priority, t.parent, t.levels or depth_levels(t.depth), np.maximum, t.alive)
    step = t.step_row[cand]
    order = np.lexsort((t.depth[cand], -c[cand], -b[cand], -a[cand], step))
    cand, step = cand[order], step[order]
    first = np.searchsorted(step, step, side="left")
    rank_in_step = np.arange(len(cand)) - first
    export[cand[rank_in_step >= max(allowance, 0)]] = False
    return export
