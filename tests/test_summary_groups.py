"""Group totals of rank summaries, as arrays, are the numbers a Python loop over each group gives: the
same floats bit for bit (members added in rank order), so the fleet and node spans did not change when
the loop went away."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np

from plasmient_trace.stitch.summary_groups import SummaryGroups


def _groups(seed: int) -> list:
    rng = random.Random(seed)
    groups = []
    for step in range(40):
        members = [SimpleNamespace(rank=r, busy_s=rng.choice([rng.random() * 1e-3, 0.1, 1e-17, float("nan")]),
                                   window_start_ns=1_700_000_000_000_000_000 + rng.randint(0, 10**9), gpus=rng.randint(1, 8),
                                   flops_coverage=rng.choice([None, 0.5]), host=f"h{r % 3}")
                   for r in range(rng.randint(1, 12))]
        groups.append(("fleet", step, None, members))
        for host in sorted({m.host for m in members}):
            groups.append(("node", step, host, [m for m in members if m.host == host]))
    return groups


def test_totals_are_python_sums_in_rank_order_bit_for_bit():
    for seed in range(5):
        groups = _groups(seed)
        g = SummaryGroups(groups)
        expected = [sum(m.busy_s for m in members) for *_, members in groups]
        got = g.total("busy_s").tolist()
        assert [np.float64(e).tobytes() for e in expected] == [np.float64(x).tobytes() for x in got]
        finite = np.isfinite(g.values("busy_s"))
        assert g.total("busy_s", finite).tolist() == [sum(m.busy_s for m in ms if m.busy_s == m.busy_s) for *_, ms in groups]
        assert g.count(finite).tolist() == [sum(m.busy_s == m.busy_s for m in ms) for *_, ms in groups]


def test_extremes_of_nanosecond_fields_are_exact_integers():
    groups = _groups(1)
    g = SummaryGroups(groups)
    assert g.min("window_start_ns").tolist() == [min(m.window_start_ns for m in ms) for *_, ms in groups]
    assert g.max("window_start_ns").tolist() == [max(m.window_start_ns for m in ms) for *_, ms in groups]
    assert g.total(g.values("gpus", np.int64)).astype(np.int64).tolist() == [sum(m.gpus for m in ms) for *_, ms in groups]


def test_none_reads_as_nan_and_any_all_are_per_group():
    groups = _groups(2)
    g = SummaryGroups(groups)
    cov = g.values("flops_coverage")
    assert np.isnan(cov).tolist() == [m.flops_coverage is None for m in g.members]
    unknown = np.isnan(cov)
    assert g.any(unknown).tolist() == [any(m.flops_coverage is None for m in ms) for *_, ms in groups]
    assert g.all(unknown).tolist() == [all(m.flops_coverage is None for m in ms) for *_, ms in groups]
    assert g.per_pair(np.arange(g.n)).tolist() == [i for i, (*_, ms) in enumerate(groups) for _ in ms]
