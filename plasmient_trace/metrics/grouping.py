"""Grouping equal integer keys in one hashing pass: the FLOP models group a million ops by signature, and a
trace repeats a few thousand signatures, where a hash table beats numpy's sort-based ``unique`` ~8x."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def first_seen_groups(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(group of each row, first row of each group) for an int64 key; groups are numbered in the order
    their first row appears."""
    n = len(key)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    group = pc.dictionary_encode(pa.array(np.asarray(key, np.int64))).indices.to_numpy().astype(np.int64)
    # Numbered by first appearance, a row opens a new group exactly when its number exceeds every one before it.
    opens = np.empty(n, bool)
    opens[0] = True
    opens[1:] = group[1:] > np.maximum.accumulate(group)[:-1]
    return group, np.flatnonzero(opens)


def group_rows(columns: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(group of each row, first row of each group) for rows of small non-negative-or--1 integer columns:
    one radix key hashed when the columns fit in it, else the columns folded into one key a column at a
    time, so the key stays small (1-D unique, no row sort)."""
    key = radix_key(columns)
    if key is not None:
        return first_seen_groups(key)
    key = np.zeros(len(columns[0]), np.int64)
    for c in columns:
        _, key = np.unique(key * (int(c.max(initial=0)) + 2) + (c + 1), return_inverse=True)
        key = key.reshape(-1).astype(np.int64)
    groups, first = np.unique(key, return_index=True)
    return np.searchsorted(groups, key), first


def radix_key(columns: list[np.ndarray]) -> np.ndarray | None:
    """One int64 key per row from small non-negative-or--1 integer columns (equal rows, equal keys), or None
    when the columns' ranges do not fit in 62 bits together."""
    key = np.zeros(len(columns[0]) if columns else 0, np.int64)
    radix = 1
    for c in columns:
        size = int(c.max(initial=0)) + 2
        if radix * size >= 2**62:
            return None
        key += (c.astype(np.int64) + 1) * radix
        radix *= size
    return key


def unique_inverse(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(values, return_inverse=True)`` (inverse flat, int64) without its sort or hash where one
    pass does: integer keys that already ascend (rows ordered by group), or keys in a range no wider than a
    few times their count (device ids, step rows)."""
    v = np.asarray(values)
    n = len(v)
    if n == 0 or v.dtype.kind not in "iu":
        keys, inverse = np.unique(v, return_inverse=True)
        return keys, inverse.reshape(-1).astype(np.int64)
    if (v[1:] >= v[:-1]).all():
        opens = np.empty(n, bool)
        opens[0] = True
        np.not_equal(v[1:], v[:-1], out=opens[1:])
        return v[opens], np.cumsum(opens) - 1
    lo, hi = int(v.min()), int(v.max())
    if hi - lo < 4 * n + 1024:
        present = np.zeros(hi - lo + 1, bool)
        # unsigned: v - lo is exact in its own type; signed: widen first (int8 from -100 to 100 spans 200)
        offset = (v - v.dtype.type(lo)).astype(np.int64) if v.dtype.kind == "u" else v.astype(np.int64) - lo
        present[offset] = True
        code = np.cumsum(present) - 1
        return np.flatnonzero(present).astype(v.dtype) + v.dtype.type(lo), code[offset]
    keys, inverse = np.unique(v, return_inverse=True)
    return keys, inverse.reshape(-1).astype(np.int64)


def dictionary_of(strings: pa.Array | pa.ChunkedArray) -> pa.DictionaryArray:
    """``strings`` as one dictionary array; one already encoded is returned as it is, so a column several
    classifiers read (a rank's kernel names: kinds, roles, precisions) is hashed once, not once each."""
    arr = strings.combine_chunks() if isinstance(strings, pa.ChunkedArray) else strings
    return arr if pa.types.is_dictionary(arr.type) else pc.dictionary_encode(arr)


def match_distinct(strings: pa.Array | pa.ChunkedArray, match: Callable[[pa.Array], pa.Array]) -> np.ndarray:
    """Per row, ``match`` (Arrow strings -> Arrow booleans) evaluated once per distinct value: a trace repeats
    a few hundred kernel names over a million rows. Null rows and null answers are False. ``strings`` may be
    :func:`dictionary_of` already."""
    enc = dictionary_of(strings)
    answer = np.append(np.asarray(pc.fill_null(match(enc.dictionary), False).to_numpy(zero_copy_only=False), bool), False)
    return answer[enc.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)]
