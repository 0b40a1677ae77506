"""Sampled full-depth steps under PLASMIENT_OVERHEAD: their background work stays under a share of wall time,
whatever the model's step time, and the steps they skip still carry FLOPs."""

from __future__ import annotations

import pytest
import torch

from plasmient_trace.capture import config as config_mod
from plasmient_trace.capture.budget import DEFAULT_FRACTION, FullDepthBudget
from plasmient_trace.capture.session import CaptureConfig, CaptureSession

from capture_helpers import Collect


def _simulate(budget: FullDepthBudget, step_s: float, cost_s: float, steps: int, every: int) -> list[int]:
    """Steps of `step_s` wall time, each sample costing `cost_s` of background CPU (measured after it runs);
    a sample held back is owed to the next step, as the session does. Returns the steps that ran full."""
    full, owed = [], False
    for i in range(1, steps):
        if i % every == 0 or owed:
            owed = not budget.allow(int(i * step_s * 1e9))
            if not owed:
                full.append(i)
                budget.measured(cost_s, 1)
    return full


def test_background_share_stays_under_the_budget_on_fast_and_slow_steps():
    for step_s, cost_s in ((0.034, 0.030), (0.005, 0.030), (1.6, 0.100)):
        steps = int(600 / step_s)  # ten minutes of the job
        full = _simulate(FullDepthBudget(0.02), step_s, cost_s, steps, every=10)
        share = len(full) * cost_s / (steps * step_s)
        # one in ten when that is cheap enough; otherwise 2% of the time, plus the first sample, run before its cost is known
        assert share <= 0.02 + 3 * cost_s / (steps * step_s)
        assert len(full) >= min(steps // 10, 0.02 * steps * step_s / cost_s) - 4
    slow = _simulate(FullDepthBudget(0.02), 1.6, 0.1, 1000, every=10)
    assert slow == list(range(10, 1000, 10))  # slow steps: the budget never holds a sample back


def test_samples_run_until_a_cost_is_measured_and_then_only_within_the_budget():
    ms = 1_000_000
    # no cost measured yet (the background thread has not finished its first batch): samples run
    unmeasured = FullDepthBudget(0.02)
    assert unmeasured.allow(0) and unmeasured.allow(25 * ms)
    # step 0 (always full depth) measured at 30 ms of background CPU before the first periodic sample:
    # from then on the bucket alone decides, from the first sample on
    budget = FullDepthBudget(0.02)
    budget.measured(0.030, 1)
    assert not budget.allow(0)
    assert not budget.allow(250 * ms)  # 2% of 0.25 s is 5 ms, short of a sample
    assert budget.allow(1500 * ms)  # 2% of 1.5 s is 30 ms: one sample, not the six of 0.25 s periods
    assert not budget.allow(1750 * ms)


def test_no_budget_means_exactly_every_nth_step():
    assert _simulate(FullDepthBudget(None), 0.005, 0.5, 101, every=10) == list(range(10, 101, 10))


def test_environment_defaults():
    assert CaptureConfig.from_env({}).overhead == DEFAULT_FRACTION
    assert CaptureConfig.from_env({"PLASMIENT_EVERY": "1"}).overhead is None  # a rate asked for is kept
    assert CaptureConfig.from_env({"PLASMIENT_EVERY": "1", "PLASMIENT_OVERHEAD": "0.1"}).overhead == 0.1
    assert CaptureConfig.from_env({"PLASMIENT_OVERHEAD": "0"}).overhead is None


def test_a_bad_value_is_said_once_and_the_default_kept(capsys, monkeypatch):
    monkeypatch.setattr(config_mod, "_said", set())
    assert CaptureConfig.from_env({"PLASMIENT_OVERHEAD": "5%"}).overhead == DEFAULT_FRACTION
    assert CaptureConfig.from_env({"PLASMIENT_OVERHEAD": "1.5"}).overhead == DEFAULT_FRACTION
    err = capsys.readouterr().err
    assert err.count("ignoring PLASMIENT_OVERHEAD") == 1 and "'5%'" in err


def test_a_cpu_price_that_is_not_a_price_is_said_once(capsys, monkeypatch):
    # the calibration fell back to its default price without a word: the only variable whose mistake went unsaid
    monkeypatch.setattr(config_mod, "_said", set())
    for _ in range(2):
        CaptureConfig.from_env({"PLASMIENT_CPU_PRICE": "-2"})
    CaptureConfig.from_env({"PLASMIENT_CPU_PRICE": "0.42"})
    assert capsys.readouterr().err.count("ignoring PLASMIENT_CPU_PRICE='-2': not a number in (0, ") == 1


def test_samples_held_back_by_the_budget_carry_flops_and_are_counted():
    sink = Collect()
    config = CaptureConfig(every=2, overhead=1e-6, peak_tflops=0.05, job_id="budget", environ={}, export_interval_s=0.05)
    session = CaptureSession(config, exporters=[("memory", sink)]).start()
    try:
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(12):
            model(torch.randn(8, 16)).sum().backward()
            opt.step()
            session.flush(30)  # each step measured before the next begins
    finally:
        session.close(timeout=30)
    rows = {r["plasmient.step"]: r for r in sink.rows() if r["plasmient.level"] == "step"}
    assert sorted(rows) == list(range(12))
    full = sorted(s for s, r in rows.items() if r["plasmient.sampled_depth"] == "full")
    # step 0, and step 1 for its new signature (step 0 opened at its first module call, so its signature is
    # its own; a new signature is not held back): their cost is measured before step 2 begins, and from then
    # on a sample waits for 1e-6 of wall time per measured cost, which twelve small steps never accrue
    assert full == [0, 1]
    assert session.stats["samples_held"] == 6  # steps 2, 4, 6, 8, 10 and 12 (opened by the last optimizer step)
    for s in set(rows) - set(full):
        latest = max(f for f in full if f < s)  # the same input shapes every step: carried from step 1
        assert rows[s]["plasmient.flops.source"] == "carried"
        assert rows[s]["plasmient.flops"] == rows[latest]["plasmient.flops"] > 0


@pytest.mark.parametrize("name, value", [("PLASMIENT_PEAK_TFLOPS", "-3"), ("PLASMIENT_GPU_PRICE", "-1"),
                                         ("PLASMIENT_EXPORT_INTERVAL_S", "-1"), ("PLASMIENT_PEAK_TFLOPS", "nan"),
                                         ("PLASMIENT_FLUSH_TIMEOUT_S", "soon")])
def test_a_negative_or_unreadable_setting_is_said_once_and_ignored(capsys, monkeypatch, name, value):
    # A negative peak or price would make every MFU or cost negative; it was dropped without a word, so the
    # user believed their value was in use. 0 stays "as if unset", silently.
    monkeypatch.setattr(config_mod, "_said", set())
    defaults = CaptureConfig.from_env({})
    for _ in range(2):
        config = CaptureConfig.from_env({name: value})
        assert (config.peak_tflops, config.gpu_price, config.export_interval_s, config.flush_timeout_s) == \
               (defaults.peak_tflops, defaults.gpu_price, defaults.export_interval_s, defaults.flush_timeout_s)
    assert capsys.readouterr().err.count(f"ignoring {name}={value!r}") == 1
    CaptureConfig.from_env({name: "0"})
    assert capsys.readouterr().err == ""


def test_a_negative_fleet_wait_is_said_once_and_the_default_kept(capsys, monkeypatch):
    from plasmient_trace.capture import distributed

    monkeypatch.setattr(config_mod, "_said", set())
    assert distributed.wait_s({"PLASMIENT_FLEET_WAIT_S": "-1"}) == distributed.DEFAULT_WAIT_S
    assert distributed.wait_s({"PLASMIENT_FLEET_WAIT_S": "-1"}) == distributed.DEFAULT_WAIT_S
    assert distributed.wait_s({"PLASMIENT_FLEET_WAIT_S": "0"}) == 0.0
    assert distributed.wait_s({}) == distributed.DEFAULT_WAIT_S
    assert capsys.readouterr().err.count("ignoring PLASMIENT_FLEET_WAIT_S='-1'") == 1
