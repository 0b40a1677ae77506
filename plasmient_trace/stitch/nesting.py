"""Vectorised interval nesting: innermost enclosing interval of intervals and of time points.

Profiler ranges on one thread nest like a call stack. Instead of walking a stack per event (a Python
loop per op), the open-interval count at every start is computed with sorted searches, and each item's
parent is the latest preceding interval one level shallower. Cost: one sort plus one searchsorted per
nesting depth, all in numpy.
"""

from __future__ import annotations

import numpy as np


def _group_keys(groups: np.ndarray, times: np.ndarray, t0: int, span: int) -> np.ndarray:
    return groups.astype(np.int64) * span + (times - t0)


def innermost_enclosing(
    iv_group: np.ndarray,
    iv_start: np.ndarray,
    iv_end: np.ndarray,
    pt_group: np.ndarray | None = None,
    pt_time: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Return (interval_parent, point_parent): indices into the intervals, -1 where none encloses.

    An interval's parent is the innermost other interval of the same group that contains its start
    (ties on the start: the longer one is the parent). A point's parent is the innermost interval of
    its group with start <= t < end. Intervals are half-open [start, end); zero-length intervals are
    treated as 1 ns long so they can still be parents of what starts at their instant.
    """
    n_iv = len(iv_start)
    pt_group = np.zeros(0, np.int64) if pt_group is None else np.asarray(pt_group, np.int64)
    pt_time = np.zeros(0, np.int64) if pt_time is None else np.asarray(pt_time, np.int64)
    n_pt = len(pt_time)
    iv_parent = np.full(n_iv, -1, np.int64)
    pt_parent = np.full(n_pt, -1, np.int64)
    if n_iv == 0:
        return iv_parent, pt_parent
    iv_group = np.asarray(iv_group, np.int64)
    iv_start = np.asarray(iv_start, np.int64)
    iv_end = np.maximum(np.asarray(iv_end, np.int64), iv_start + 1)

    # Dense group ranks so (group, time) packs into one int64 key.
    all_groups = np.concatenate([iv_group, pt_group])
    uniq, inv = np.unique(all_groups, return_inverse=True)
    g_iv, g_pt = inv[:n_iv], inv[n_iv:]
    t0 = int(min(iv_start.min(), pt_time.min() if n_pt else iv_start.min()))
    t1 = int(max(iv_end.max(), pt_time.max() if n_pt else iv_end.max()))
    span = t1 - t0 + 2
    if span * (len(uniq) + 1) >= 2**62:
        raise OverflowError("time range too large to pack with group ids")

    start_key = np.concatenate([_group_keys(g_iv, iv_start, t0, span), _group_keys(g_pt, pt_time, t0, span)])
    is_point = np.concatenate([np.zeros(n_iv, np.int8), np.ones(n_pt, np.int8)])
    neg_len = np.concatenate([-(iv_end - iv_start), np.zeros(n_pt, np.int64)])
    # Sort by (key, intervals before points, longer first): a parent precedes what it contains.
    order = np.lexsort((neg_len, is_point, start_key))
    sorted_key = start_key[order]
    sorted_is_iv = is_point[order] == 0

    # Open intervals at each item's start = intervals before it - intervals already closed.
    iv_before = np.cumsum(sorted_is_iv) - sorted_is_iv
    end_keys_sorted = np.sort(_group_keys(g_iv, iv_end, t0, span))
    closed = np.searchsorted(end_keys_sorted, sorted_key, side="right")
    # Intervals before it that belong to earlier groups are all closed; both counts include them.
    depth = iv_before - closed

    parent_pos = np.full(len(order), -1, np.int64)
    max_depth = int(depth.max()) if len(depth) else 0
    # all items grouped by depth once (stable: positions stay ascending inside a depth)
    by_depth = np.argsort(depth, kind="stable")
    depth_bounds = np.searchsorted(depth[by_depth], np.arange(0, max_depth + 2), side="left")
    for d in range(1, max_depth + 1):
        want = by_depth[depth_bounds[d]:depth_bounds[d + 1]]
        if len(want) == 0:
            continue
        above = by_depth[depth_bounds[d - 1]:depth_bounds[d]]
        candidates = above[sorted_is_iv[above]]  # intervals one level up, in position order
        if len(candidates) == 0:
            continue
        k = np.searchsorted(candidates, want, side="left") - 1
        ok = k >= 0
        parent_pos[want[ok]] = candidates[k[ok]]

    # Validate containment (guards against partial overlaps from float-µs rounding).
    orig = order  # position -> original item index
    has = parent_pos >= 0
    par_item = np.where(has, orig[np.maximum(parent_pos, 0)], 0)
    item_key = sorted_key
    par_end_key = _group_keys(g_iv[par_item], iv_end[par_item], t0, span)
    par_start_key = _group_keys(g_iv[par_item], iv_start[par_item], t0, span)
    valid = has & (par_start_key <= item_key) & (item_key < par_end_key)
    result = np.where(valid, par_item, -1)

    out = np.empty(n_iv + n_pt, np.int64)
    out[orig] = result
    iv_parent[:] = out[:n_iv]
    pt_parent[:] = out[n_iv:]
    return iv_parent, pt_parent


def tree_depth(parent: np.ndarray) -> np.ndarray:
    """Number of ancestors of every node of a parent-index forest (-1 = root), one pass per level."""
    depth = np.zeros(len(parent), np.int64)
    cur = parent.copy()
    live = np.nonzero(cur >= 0)[0]
    while len(live):
        depth[live] += 1
        cur[live] = parent[cur[live]]
        live = live[cur[live] >= 0]
    return depth


def tree_root(parent: np.ndarray) -> np.ndarray:
    """Index of every node's root in a parent-index forest (-1 = root), one pass per level."""
    root = np.arange(len(parent))
    cur = parent.copy()
    live = np.nonzero(cur >= 0)[0]
    while len(live):
        root[live] = cur[live]
        cur[live] = parent[cur[live]]
        live = live[cur[live] >= 0]
    return root
