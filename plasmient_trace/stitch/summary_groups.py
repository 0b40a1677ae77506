"""The fleet and node groups of rank summaries as arrays, so a group's totals are one array reduction.

A live job reduces its summaries every batch (one per step and rank) and an offline ingest of a thousand
ranks reduces ten thousand of them: a Python sum per group and per field was most of a step-level
batch's processing. Each (group, member) pair is one row here, groups contiguous and members in rank
order, so ``total`` adds the members in the order a Python ``sum`` over the group would: the totals are
the same floats, bit for bit.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

import numpy as np

__all__ = ["SummaryGroups"]


class SummaryGroups:
    """Groups of summaries: ``groups`` is a list of (level, step, host, members); every group has a member."""

    def __init__(self, groups: list[tuple[str, int, str | None, list[Any]]]) -> None:
        self.groups = groups
        self.n = len(groups)
        sizes = np.array([len(g[3]) for g in groups], np.int64)
        self.members: list[Any] = [s for g in groups for s in g[3]]
        self.group = np.repeat(np.arange(self.n, dtype=np.int64), sizes)  # group of each pair
        self.first = np.zeros(self.n, np.int64)  # first pair of each group
        np.cumsum(sizes[:-1], out=self.first[1:])
        self._cache: dict[tuple[str, Any], np.ndarray] = {}

    def values(self, name: str, dtype: Any = np.float64) -> np.ndarray:
        """The field of every pair's member (``getattr`` with None read as NaN for floats)."""
        key = (name, dtype)
        got = self._cache.get(key)
        if got is None:
            raw = list(map(attrgetter(name), self.members))
            if dtype is np.float64:
                raw = [np.nan if v is None else v for v in raw] if None in raw else raw
            got = self._cache[key] = np.array(raw, dtype=dtype) if raw else np.zeros(0, dtype)
        return got

    def total(self, values: str | np.ndarray, where: np.ndarray | None = None) -> np.ndarray:
        """Per group: the sum of a field (or of per-pair values) over its members (those ``where`` holds)."""
        v = self.values(values) if isinstance(values, str) else np.asarray(values, np.float64)
        if where is None:
            return np.bincount(self.group, weights=v, minlength=self.n)
        return np.bincount(self.group[where], weights=v[where], minlength=self.n)

    def count(self, where: np.ndarray) -> np.ndarray:
        return np.bincount(self.group[where], minlength=self.n)

    def min(self, values: str | np.ndarray) -> np.ndarray:
        return np.minimum.reduceat(self._array(values), self.first) if self.n else np.zeros(0)

    def max(self, values: str | np.ndarray) -> np.ndarray:
        return np.maximum.reduceat(self._array(values), self.first) if self.n else np.zeros(0)

    def any(self, mask: np.ndarray) -> np.ndarray:
        return self.count(mask) > 0

    def all(self, mask: np.ndarray) -> np.ndarray:
        return self.count(~mask) == 0

    def per_pair(self, per_group: np.ndarray) -> np.ndarray:
        """A per-group array spread to the pairs."""
        return per_group[self.group]

    def _array(self, values: str | np.ndarray) -> np.ndarray:
        return self.values(values, np.int64 if values.endswith("_ns") else np.float64) if isinstance(values, str) else values
