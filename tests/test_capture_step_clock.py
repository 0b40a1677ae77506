"""Which calls end a live step: the step clock. The first optimizer that steps is the clock, so a GAN's two
optimizers make one step per iteration; an optimizer that replaces it takes over even while the old one is
alive; an eval loop in ``with plasmient_trace.step()`` between epochs is its own steps and the training steps
around it still end at their optimizer steps. Each step is checked against the loop's own count and clock."""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

from capture_helpers import live_capture


def _steps(rows: list[dict]) -> list[dict]:
    return sorted((r for r in rows if r["plasmient.level"] == "step"), key=lambda r: r["plasmient.step"])


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))


def _train(model, opt) -> tuple[int, int]:
    """One training iteration; (its start, its optimizer step's end) on the job's clock (perf_counter_ns, as
    the capture's)."""
    t0 = time.perf_counter_ns()
    model(torch.randn(8, 32)).pow(2).mean().backward()
    opt.step()
    t1 = time.perf_counter_ns()
    opt.zero_grad()
    return t0, t1


def test_an_optimizer_that_replaces_a_live_one_takes_over_the_steps():
    # Linear probe, then fine-tune: the head's optimizer stays alive (the old code kept it as the clock, and
    # every step of the second phase was missing, with nothing said).
    model = _model()
    head = torch.optim.SGD(model[2].parameters(), lr=0.01)
    whole = torch.optim.Adam(model.parameters(), lr=1e-3)
    with live_capture(every=1, peak_tflops=0.05, job_id="two-phase") as (session, sink):
        for _ in range(3):
            _train(model, head)
        for _ in range(12):
            _train(model, whole)
    steps = _steps(sink.rows())
    # The second optimizer takes over at its 8th step in a row (a WGAN critic's 5 steps a generator step never
    # do): its first 8 iterations are one step, each after that one.
    forwards = _forwards_per_step(sink.rows())
    assert [r["plasmient.step"] for r in steps] == list(range(8))
    assert all(r["name"] == f"optimizer.step#{r['plasmient.step']}" for r in steps)
    assert [forwards[r["plasmient.step"]] for r in steps] == [1, 1, 1, 8, 1, 1, 1, 1]


def _forwards_per_step(rows: list[dict]) -> dict[int, int]:
    from collections import Counter

    return Counter(r["plasmient.step"] for r in rows if r["plasmient.level"] == "module" and r["name"] == "Sequential")


def test_an_eval_loop_in_explicit_steps_loses_no_training_step():
    # 3 training iterations, 2 eval steps, 3 training iterations, 2 eval steps: 10 steps. The old code let
    # the first explicit step take over for good: the 3 later training iterations were in no step, and their
    # 15 ms went into the next eval step's window (MFU and cost off by 10x).
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    spans: list[tuple[str, int, int]] = []
    with live_capture(every=1, peak_tflops=0.05, job_id="train-eval") as (session, sink):
        for _ in range(2):
            for _ in range(3):
                spans.append(("train", *_train(model, opt)))
            for _ in range(2):
                with session.step():
                    t0 = time.perf_counter_ns()
                    with torch.no_grad():
                        model(torch.randn(64, 32))
                    spans.append(("eval", t0, time.perf_counter_ns()))
    steps = _steps(sink.rows())
    assert [r["plasmient.step"] for r in steps] == list(range(10))
    kinds = ["train" if r["name"].startswith("optimizer.step#") else "eval" for r in steps]
    assert kinds == [k for k, _, _ in spans]
    epoch = session._epoch
    for r, (kind, t0, t1) in zip(steps, spans):
        start, end = r["start_ns"] - epoch, r["end_ns"] - epoch
        if kind == "eval":
            # the explicit step is the block: it holds the loop's own clock readings
            assert start <= t0 and t1 <= end
        else:
            # a training step ends at its optimizer step (its post hook, just before the loop's own reading)
            assert start <= t1 and end <= t1
    flops = {r["plasmient.step"]: r["plasmient.flops"] for r in steps}
    assert all(flops[s] > 0 for s in flops)


def test_an_optimizer_step_after_an_explicit_step_opens_no_step_of_its_own():
    # forward and backward in `with step()`, the optimizer after it: one step per iteration, as before
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with live_capture(every=1, peak_tflops=0.05, job_id="partial") as (session, sink):
        for _ in range(4):
            with session.step():
                model(torch.randn(8, 32)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    steps = _steps(sink.rows())
    assert [(r["plasmient.step"], r["name"]) for r in steps] == [(i, f"step#{i}") for i in range(4)]


@pytest.mark.parametrize("generator_first", [True, False])
def test_a_wgan_critic_stepping_5_times_a_generator_step_never_takes_over(generator_first):
    # The first optimizer that steps is the clock; the other stepping 5 times while it steps once is not a
    # replacement (a rule that let any optimizer stepping twice in a row take over made 30 steps of 6 iterations).
    torch.manual_seed(0)
    gen, critic = torch.nn.Linear(16, 32), torch.nn.Linear(32, 1)
    opt_g, opt_c = torch.optim.SGD(gen.parameters(), lr=1e-3), torch.optim.SGD(critic.parameters(), lr=1e-3)

    def generator_step():
        critic(gen(torch.randn(8, 16))).mean().backward()
        opt_g.step()
        opt_g.zero_grad()
        opt_c.zero_grad()

    def critic_steps():
        for _ in range(5):
            critic(gen(torch.randn(8, 16)).detach()).mean().backward()
            opt_c.step()
            opt_c.zero_grad()

    with live_capture(every=100, peak_tflops=0.05, job_id="wgan") as (session, sink):
        for _ in range(6):
            if generator_first:
                generator_step()
                critic_steps()
            else:
                critic_steps()
                generator_step()
    # the clock is the generator when it steps first (6 steps), the critic when it does (30)
    assert session.stats["steps"] == (6 if generator_first else 30)
