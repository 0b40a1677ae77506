"""Vectorised interval nesting: innermost enclosing interval of intervals and of time points.

Profiler ranges on one thread nest like a call stack. Instead of walking a stack per event (a Python
loop per op), the open-interval count at every start is computed with sorted searches, and each item's
parent is the latest preceding interval one level shallower. Cost: a few sorts and searchsorted calls,
O(n log n) in numpy whatever the nesting depth (a hostile file can nest 100k identical events).
"""

from __future__ import annotations

import numpy as np


def _group_keys(groups: np.ndarray, times: np.ndarray, t0: int, span: int) -> np.ndarray:
    return groups.astype(np.int64) * span + (times - t0)


def _lexsort_ties(key: np.ndarray, second: np.ndarray, third: np.ndarray) -> np.ndarray:
    """np.lexsort((third, second, key)): one stable sort on ``key``, then only the items whose key is tied
    are ordered by (second, third, index). Most keys are distinct, so this is one sort instead of three."""
    order = np.argsort(key, kind="stable")
    sk = key[order]
    eq = sk[1:] == sk[:-1]
    if eq.any():
        tied = np.zeros(len(sk), bool)
        tied[1:] |= eq
        tied[:-1] |= eq
        pos = np.nonzero(tied)[0]
        idx = order[pos]
        order[pos] = idx[np.lexsort((idx, third[idx], second[idx], key[idx]))]
    return order


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
    # (threads are few: a hash unique of the values and a search into them beats a sort-based inverse)
    uniq = np.unique(all_groups)
    inv = np.searchsorted(uniq, all_groups)
    g_iv, g_pt = inv[:n_iv], inv[n_iv:]
    del all_groups
    t0 = int(min(iv_start.min(), pt_time.min() if n_pt else iv_start.min()))
    t1 = int(max(iv_end.max(), pt_time.max() if n_pt else iv_end.max()))
    span = t1 - t0 + 2
    if span * (len(uniq) + 1) >= 2**62:
        raise OverflowError("time range too large to pack with group ids")

    # Millions of ops pass through here whole-rank: each temporary is let go once used, so the peak holds
    # about eight of the n-long arrays rather than every one the function makes.
    start_key = np.concatenate([_group_keys(g_iv, iv_start, t0, span), _group_keys(g_pt, pt_time, t0, span)])
    is_point = np.concatenate([np.zeros(n_iv, np.int8), np.ones(n_pt, np.int8)])
    neg_len = np.concatenate([iv_start - iv_end, np.zeros(n_pt, np.int64)])
    # Sort by (key, intervals before points, longer first): a parent precedes what it contains.
    order = _lexsort_ties(start_key, is_point, neg_len)
    del neg_len
    sorted_key = start_key[order]
    del start_key
    sorted_is_iv = is_point[order] == 0
    del is_point

    # Open intervals at each item's start = intervals before it - intervals already closed.
    depth = np.cumsum(sorted_is_iv)
    depth -= sorted_is_iv
    # timsort ("stable"): ends of nested intervals in time order are nearly sorted already, which it
    # finds in one pass (12x faster than the default introsort on 2.6M ops); the values are the same
    end_keys_sorted = np.sort(_group_keys(g_iv, iv_end, t0, span), kind="stable")
    # Intervals before it that belong to earlier groups are all closed; both counts include them.
    depth -= np.searchsorted(end_keys_sorted, sorted_key, side="right")
    del end_keys_sorted

    # Parent = the last interval before the item (in sorted order) that is exactly one level up. One
    # searchsorted over (depth, position) keys answers all depths at once: O(n log n) however deep.
    n_items = len(order)
    iv_pos = np.flatnonzero(sorted_is_iv)
    del sorted_is_iv
    cand_depth = depth[iv_pos]
    # ordered by (depth, position): positions ascend already, so a stable sort on the depth alone does it,
    # and on depths that fit in 16 bits numpy's stable sort is a radix sort (4x faster on 2.6M ops)
    narrow = len(cand_depth) and cand_depth.min() >= 0 and cand_depth.max() < 2**15
    cand_order = np.argsort(cand_depth.astype(np.int16) if narrow else cand_depth, kind="stable")
    del cand_depth
    cand_pos = iv_pos[cand_order]
    cand_keys = depth[cand_pos] * (n_items + 1) + cand_pos
    del cand_order, iv_pos
    want_keys = (depth - 1) * (n_items + 1)
    want_keys += np.arange(n_items, dtype=np.int64)
    k = np.searchsorted(cand_keys, want_keys, side="left") - 1
    del want_keys
    ok = (depth >= 1) & (k >= 0)
    np.maximum(k, 0, out=k)
    ok &= cand_keys[k] // (n_items + 1) == depth - 1  # n_iv > 0 here, so there is a candidate
    del depth, cand_keys
    parent_pos = np.where(ok, cand_pos[k], -1)
    del ok, k, cand_pos

    # Validate containment (guards against partial overlaps from float-µs rounding).
    has = parent_pos >= 0
    par_item = np.where(has, order[np.maximum(parent_pos, 0)], 0)
    del parent_pos
    valid = has & (_group_keys(g_iv[par_item], iv_start[par_item], t0, span) <= sorted_key)
    valid &= sorted_key < _group_keys(g_iv[par_item], iv_end[par_item], t0, span)
    del has, sorted_key
    out = np.empty(n_iv + n_pt, np.int64)
    out[order] = np.where(valid, par_item, -1)
    del order, valid, par_item
    iv_parent[:] = out[:n_iv]
    pt_parent[:] = out[n_iv:]
    return iv_parent, pt_parent


def innermost_enclosing_points(iv_group: np.ndarray, iv_start: np.ndarray, iv_end: np.ndarray, pt_group: np.ndarray,
                               pt_time: np.ndarray) -> np.ndarray:
    """``innermost_enclosing``'s point parents alone. A few points among millions of intervals (launches no
    External id places, module starts among ops) only need the intervals that contain one of them: the
    intervals around a point all contain it, and an interval that ends before the point but starts inside
    its parent sits deeper than that parent, so dropping the rest changes no point's answer."""
    n_iv, n_pt = len(iv_start), len(pt_time)
    if n_pt == 0 or n_iv == 0 or n_pt * 8 > n_iv:
        return innermost_enclosing(iv_group, iv_start, iv_end, pt_group, pt_time)[1]
    iv_group, pt_group = np.asarray(iv_group, np.int64), np.asarray(pt_group, np.int64)
    iv_start, pt_time = np.asarray(iv_start, np.int64), np.asarray(pt_time, np.int64)
    iv_end = np.maximum(np.asarray(iv_end, np.int64), iv_start + 1)
    groups = np.unique(pt_group)
    g = np.minimum(np.searchsorted(groups, iv_group), len(groups) - 1)
    same = np.flatnonzero(groups[g] == iv_group)
    if not len(same):
        return np.full(n_pt, -1, np.int64)
    t0 = int(min(iv_start[same].min(), pt_time.min()))
    span = int(max(iv_end[same].max(), pt_time.max())) - t0 + 2
    if span * (len(groups) + 1) >= 2**62:
        return innermost_enclosing(iv_group, iv_start, iv_end, pt_group, pt_time)[1]
    pt_keys = np.sort(_group_keys(np.searchsorted(groups, pt_group), pt_time, t0, span), kind="stable")
    first = np.searchsorted(pt_keys, _group_keys(g[same], iv_start[same], t0, span), side="left")
    past = np.searchsorted(pt_keys, _group_keys(g[same], iv_end[same], t0, span), side="left")
    keep = same[first < past]  # a point in [start, end)
    if not len(keep):
        return np.full(n_pt, -1, np.int64)
    parent = innermost_enclosing(iv_group[keep], iv_start[keep], iv_end[keep], pt_group, pt_time)[1]
    return np.where(parent >= 0, keep[np.maximum(parent, 0)], -1)


def _jump_to_roots(parent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(root, depth) of every node by pointer jumping: each round doubles how far a node sees, so a
    chain of n nodes takes log2(n) vectorised rounds instead of n (100k nested events: 17 rounds)."""
    n = len(parent)
    parent = np.asarray(parent, np.int64)
    up = np.where(parent >= 0, parent, np.arange(n, dtype=np.int64))
    dist = (parent >= 0).astype(np.int64)
    # A forest needs at most log2(n) + 1 rounds; the bound also ends the loop on a (corrupt) cycle.
    for _ in range(max(1, int(n).bit_length() + 1)):
        nxt = up[up]
        if np.array_equal(nxt, up):
            break
        dist = dist + dist[up]  # the root points at itself with distance 0, so this saturates there
        up = nxt
    return up, dist


def tree_depth(parent: np.ndarray) -> np.ndarray:
    """Number of ancestors of every node of a parent-index forest (-1 = root)."""
    return _jump_to_roots(parent)[1]


def tree_root(parent: np.ndarray) -> np.ndarray:
    """Index of every node's root in a parent-index forest (-1 = root)."""
    return _jump_to_roots(parent)[0]


def depth_levels(depth: np.ndarray) -> list[np.ndarray]:
    """Node indices grouped by depth (index d = the nodes at depth d), from one stable sort, so a
    bottom-up or top-down pass touches each node once however deep the tree is."""
    if len(depth) == 0:
        return []
    # a small integer dtype lets numpy's stable sort be a radix sort (trees are shallow next to their size)
    narrow = depth.astype(np.int16) if 0 <= depth.min() and depth.max() < 2**15 else depth
    order = np.argsort(narrow, kind="stable")
    bounds = np.searchsorted(depth[order], np.arange(int(depth.max()) + 2), side="left")
    return [order[bounds[d]:bounds[d + 1]] for d in range(len(bounds) - 1)]


def reduce_to_parents(parent: np.ndarray, depth: np.ndarray, values: np.ndarray, ufunc: np.ufunc,
                      alive: np.ndarray | None = None, levels: list[np.ndarray] | None = None) -> np.ndarray:
    """Fold every node's value into its ancestors with ``ufunc`` (np.add: subtree sums, np.maximum /
    np.minimum: subtree extremes), deepest level first, so each node is touched once however deep the
    tree. ``values`` may carry trailing columns; ``alive`` masks the nodes that take part; ``levels`` is
    ``depth_levels(depth)`` when the caller already has it (one sort per tree instead of one per call).

    Columns are folded one at a time as contiguous 1-D arrays: ``ufunc.at`` on a 1-D array is an order of
    magnitude faster than on rows of a 2-D one, and applies the same updates in the same order (bitwise
    the same sums)."""
    values = np.asarray(values)
    out = np.array(values[None, :] if values.ndim == 1 else values.T, copy=True, order="C")
    fold_rows_to_parents(out, parent, depth_levels(depth) if levels is None else levels, ufunc, alive)
    return out[0] if values.ndim == 1 else out.T


def fold_rows_to_parents(quantities: np.ndarray, parent: np.ndarray, levels: list[np.ndarray], ufunc: np.ufunc,
                         alive: np.ndarray | None = None) -> None:
    """``reduce_to_parents`` in place on a quantity-major (q, n) C-contiguous array, row by row.

    A level of few rows (a group of steps has many such levels) is folded for every quantity in one
    ``ufunc.at`` over the flat array, the quantities' targets laid end to end: each element gets the same
    updates in the same order as row by row, with one call instead of q."""
    q, n = quantities.shape
    flat = quantities.reshape(-1) if quantities.flags.c_contiguous and q > 1 else None
    for rows in reversed(levels[1:]):
        rows = rows[parent[rows] >= 0]
        if alive is not None:
            rows = rows[alive[rows]]
        if len(rows):
            to = parent[rows]
            if flat is not None and q * len(rows) <= _FLAT_FOLD_MAX:
                ufunc.at(flat, (to + (np.arange(q) * n)[:, None]).reshape(-1), quantities[:, rows].reshape(-1))
                continue
            for col in quantities:
                ufunc.at(col, to, col[rows])


# Most (quantity, row) pairs a level folds in one flat ufunc.at (1 MiB of int64 indices).
_FLAT_FOLD_MAX = 1 << 17


def any_ancestor_of(rows: np.ndarray, parent: np.ndarray, mark: np.ndarray) -> np.ndarray:
    """:func:`any_ancestor` for a few nodes: per node of ``rows``, does any strict ancestor carry ``mark``?
    Walks up from those nodes alone, so it costs their depth, not a pass over the whole forest."""
    out = np.zeros(len(rows), bool)
    up = parent[rows]
    while (up >= 0).any():
        known = up >= 0
        out[known] |= mark[up[known]]
        up[known] = parent[up[known]]
    return out


def any_ancestor(parent: np.ndarray, mark: np.ndarray, levels: list[np.ndarray] | None = None) -> np.ndarray:
    """Per node: does any strict ancestor carry ``mark``? Top-down, one level at a time, each node once.
    ``levels``: ``depth_levels(tree_depth(parent))`` when the caller already has it."""
    out = np.zeros(len(parent), bool)
    for rows in (depth_levels(tree_depth(parent)) if levels is None else levels)[1:]:
        p = parent[rows]
        out[rows] = mark[p] | out[p]
    return out
