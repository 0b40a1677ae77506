"""Steps opened at their first module call carry nothing to the steps opened at a boundary.

Step 0, and the first training step after an eval loop run inside ``with plasmient_trace.step()``, open at
their first nn.Module call: what ran before it (here a 512x512 projection outside the model) is in no step.
Such a step is measured from that call, so its count is short of the whole step's; it used to be the carry
source of every later step with its input shapes (0.84x FlopCounterMode's count here, 0.51x in the audit's
model) until the next periodic sample. Its signature is now its own: step 1, the first step opened at a
boundary, is measured whole, and the steps after it carry that. Each step is checked against torch's
FlopCounterMode over the whole step (plasmient also counts the ReLU, the loss and the optimizer's update,
which FlopCounterMode leaves out: within [1, 1.05] of it, as in test_capture_carried)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from capture_helpers import flop_counter_per_step as _oracle, live_capture

BATCH, DIM = 64, 512
PROJECTION_FLOPS = 2 * BATCH * DIM * DIM  # the GEMM before the model, outside every module


def _make():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, DIM, bias=False), nn.ReLU(), nn.Linear(DIM, DIM, bias=False))
    return model, torch.optim.SGD(model.parameters(), lr=1e-3), torch.randn(DIM, DIM), torch.randn(BATCH, DIM)


def _train(state, i: int) -> None:
    """A training step whose optimizer.step() ends it, with a projection done before the model is called."""
    model, opt, project, raw = state
    x = raw @ project
    opt.zero_grad(set_to_none=True)
    model(x).pow(2).mean().backward()
    opt.step()


def _eval(state) -> None:
    model, _, project, raw = state
    model.eval()
    with torch.no_grad():
        model(raw @ project)
    model.train()


def _steps(sink) -> list[dict]:
    rows = sorted((r for r in sink.rows() if r["plasmient.level"] == "step"), key=lambda r: r["plasmient.step"])
    assert [r["plasmient.step"] for r in rows] == list(range(len(rows)))
    return rows


def _whole(r: dict, want: float) -> None:
    assert 1.0 <= r["plasmient.flops"] / want <= 1.05, (r["plasmient.step"], r["plasmient.flops.source"],
                                                      r["plasmient.flops"], want, r["plasmient.flops"] / want)


def test_steps_carry_the_whole_step_not_step_0s_count_from_its_first_module_call():
    n = 12
    expected = _oracle(_make, _train, n)
    with live_capture(every=10, peak_tflops=1.0, job_id="opened-at-call") as (session, sink):
        state = _make()
        for i in range(n):
            _train(state, i)
    assert not session.failed
    rows = _steps(sink)
    assert len(rows) == n
    for r, want in zip(rows[1:], expected[1:]):  # step 1 measured whole, the rest carried from it or step 10
        _whole(r, want)
    # step 1 is the first step opened at a boundary: its signature was never measured, so it is measured
    # (one full-depth step more than before), and steps 2-9 carry it
    assert [r["plasmient.flops.source"] for r in rows] == ["measured", "measured"] + ["carried"] * 8 + ["measured", "carried"]
    assert [r["plasmient.sampled_depth"] for r in rows] == ["full", "full"] + ["step"] * 8 + ["full", "step"]
    # step 0 says what it is: measured from its first module call, without the projection before it
    assert [r["plasmient.step.opened_at"] for r in rows] == ["first_module_call"] + ["boundary"] * (n - 1)
    _whole(rows[0], expected[0] - PROJECTION_FLOPS)
    assert rows[0]["plasmient.flops"] < 0.9 * expected[0]


def test_the_first_step_after_an_eval_loop_carries_only_what_a_step_opened_the_same_way_measured():
    # steps 0-3 train, 4-5 evaluate inside `with session.step()`, 6-9 train: step 6 opens at its first
    # module call, the projection before it in no step, as step 0's was
    with live_capture(every=100, peak_tflops=1.0, job_id="after-eval") as (session, sink):
        state = _make()
        for i in range(4):
            _train(state, i)
        for _ in range(2):
            with session.step():
                _eval(state)
        for i in range(4, 8):
            _train(state, i)
    assert not session.failed
    rows = _steps(sink)
    assert len(rows) == 10
    whole = _oracle(_make, _train, 1)[0]
    for s in (1, 2, 3, 7, 8, 9):  # opened at a boundary: the whole step, measured at 1 and carried from it
        _whole(rows[s], whole)
    assert [r["plasmient.flops.source"] for r in rows] == \
        ["measured", "measured", "carried", "carried", "measured", "carried", "carried", "carried", "carried", "carried"]
    assert [r["plasmient.step.opened_at"] for r in rows] == \
        ["first_module_call"] + ["boundary"] * 5 + ["first_module_call"] + ["boundary"] * 3
    # step 6 carries step 0's count: like for like, both from their first module call
    assert rows[6]["plasmient.flops"] == rows[0]["plasmient.flops"]
    _whole(rows[6], whole - PROJECTION_FLOPS)


def test_a_compiled_models_step_1_is_measured_on_the_code_step_0_compiled():
    # A compiled model's new signature waits a call (its first one recompiles); step 1's signature is not step
    # 0's, but its shapes are, and step 0 compiled them: step 1 is measured, not left unknown
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    model, opt, x = torch.compile(eager), torch.optim.SGD(eager.parameters(), lr=1e-3), torch.randn(16, 64)

    def train(_, i: int) -> None:
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        opt.step()

    with live_capture(every=100, peak_tflops=1.0, job_id="compiled-step-1", close_timeout=120) as (session, sink):
        for i in range(4):
            train(None, i)
    assert not session.failed
    rows = _steps(sink)
    assert [r["plasmient.flops.source"] for r in rows] == ["measured", "measured", "carried", "carried"]
    whole = _oracle(lambda: None, lambda _, i: eager(x).pow(2).mean().backward(), 1)[0]
    for r in rows[1:]:
        _whole(r, whole)


def test_ingested_steps_say_nothing_of_where_they_opened():
    from plasmient_trace.pipeline import IngestOptions, stitch_records
    from plasmient_trace.records import RecordSet, table_from_columns

    rs = RecordSet(source="live:cupti", steps=table_from_columns("steps", {
        "step": [0, 1], "start_ns": [0, 10**6], "end_ns": [10**6, 2 * 10**6], "name": ["s0", "s1"]}))
    rows = stitch_records([rs], IngestOptions(job_id="ingest")).batch.table.to_pylist()
    assert [r["plasmient.level"] for r in rows if r["plasmient.level"] == "step"] == ["step", "step"]
    assert all(r.get("plasmient.step.opened_at") is None for r in rows)
