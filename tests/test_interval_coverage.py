"""The interval arithmetic behind step idle time, exposed communication and copies (stitch.windows): merged
unions, the covered length inside any window and each kernel's share of its device, per device, checked against
counting nanoseconds one by one."""

from __future__ import annotations

import random
from itertools import pairwise

import numpy as np

from plasmient_trace.stitch.windows import Coverage, kernel_shares_ns, merge_intervals


def _covered_ns(intervals, group, a, b) -> int:
    return len({t for g, s, e in intervals if g == group for t in range(s, e) if a <= t < b})


def _random_cases(seed: int, cases: int = 200):
    """(intervals as tuples, and as group/start/end arrays): up to 25 intervals in 4 groups, some empty or reversed."""
    rng = random.Random(seed)
    for _ in range(cases):
        n = rng.randint(0, 25)
        intervals = [(rng.randint(0, 3), s, s + rng.randint(-3, 30)) for s in (rng.randint(0, 100) for _ in range(n))]
        yield rng, intervals, tuple(np.array([iv[k] for iv in intervals], np.int64) for k in range(3))


def test_covered_length_equals_counting_nanoseconds():
    for rng, intervals, (g, s, e) in _random_cases(7):
        coverage = Coverage.of(g, s, e)
        queries = [(rng.randint(0, 4), rng.randint(-10, 140), rng.randint(-10, 140)) for _ in range(15)]
        got = coverage.covered(*(np.array([q[k] for q in queries], np.int64) for k in range(3)))
        assert list(got) == [_covered_ns(intervals, *q) for q in queries]


def test_merged_intervals_are_disjoint_and_cover_the_same_nanoseconds():
    for _, intervals, (g, s, e) in _random_cases(11):
        mg, ms, me = merge_intervals(g, s, e)
        assert (me > ms).all()
        for group in range(4):
            mine = sorted((a, b) for k, a, b in zip(mg, ms, me) if k == group)
            assert all(b1 < a2 for (_, b1), (a2, _) in pairwise(mine))  # disjoint, not even touching
            want = {t for k, a, b in intervals if k == group for t in range(a, b)}
            assert {t for a, b in mine for t in range(a, b)} == want


def test_each_kernel_s_share_is_its_nanoseconds_split_equally_with_the_kernels_resident_beside_it():
    for _, intervals, (g, s, e) in _random_cases(13):
        resident: dict[tuple[int, int], int] = {}
        for k, a, b in intervals:
            for t in range(a, b):
                resident[k, t] = resident.get((k, t), 0) + 1
        want = [sum(1.0 / resident[k, t] for t in range(a, b)) for k, a, b in intervals]
        got = kernel_shares_ns(g, s, e)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-9)
        # the shares of a device add up to the time any kernel ran on it: nothing counted twice
        for group in range(4):
            mine = [i for i, iv in enumerate(intervals) if iv[0] == group]
            assert abs(sum(got[i] for i in mine) - _covered_ns(intervals, group, -10, 200)) < 1e-6
