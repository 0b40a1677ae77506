"""MFU on every live step at step-level cost: a step sampled at step depth carries the FLOPs of the latest
full-depth step with the same input-shape signature, a new signature is captured at full depth, and a step
with nothing to carry says so. The FLOPs are checked against torch's FlopCounterMode on the same model and
inputs (it counts GEMMs and attention; plasmient also counts norms, activations and bias adds, about 1% here,
so plasmient is within [1, 1.05] of it, as in test_flops_live_models)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

from capture_helpers import Collect, live_capture

from plasmient_trace.capture.session import CaptureConfig, CaptureSession
from plasmient_trace.capture.torch_hooks import input_signature

PEAK_TFLOPS = 1.0   # far above what two CPU cores reach: MFU stays well below its cap of 1
PRICE = 3.6         # USD per device-hour: one cent per 10 device-seconds
DIM, SEQ = 128, 32


class _Block(nn.Module):
    """A GPT-2-shaped block: attention and a 4x MLP around layer norms."""

    def __init__(self, dim: int = DIM, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


def _train_step(model: nn.Module, x) -> None:
    model.zero_grad(set_to_none=True)  # no gradient accumulation: every step does the same work
    model(x).pow(2).mean().backward()


def _flop_counter(model: nn.Module, x) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        _train_step(model, x)
    return float(counter.get_total_flops())


def _flop_counter_per_input(step, inputs: dict) -> dict:
    """FlopCounterMode's count of ``step(key)`` for each key of ``inputs``, each run once before, untimed."""
    from torch.utils.flop_counter import FlopCounterMode

    out = {}
    for key in inputs:
        step(key)
        with FlopCounterMode(display=False) as counter:
            step(key)
        out[key] = counter.get_total_flops()
    return out


def _every_4th_step_full(step, order: list, job_id: str) -> dict[int, dict]:
    """Live explicit steps ``step(key)`` for each key of ``order``, full depth every 4th: the step spans by number."""
    with live_capture(every=4, peak_tflops=PEAK_TFLOPS, job_id=job_id) as (session, sink):
        for key in order:
            with session.step():
                step(key)
    steps = _by_step(sink.rows(), "step")
    assert sorted(steps) == list(range(len(order)))
    return steps


def _capture(batches: list[int], **config) -> tuple[list[dict], Collect, dict[int, float]]:
    """Explicit steps of one model, step i on a batch of batches[i]; the rows, the sink and
    FlopCounterMode's count for each batch size."""
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block())
    inputs = {b: torch.randn(b, SEQ, DIM) for b in set(batches)}
    expected = {b: _flop_counter(model, x) for b, x in inputs.items()}
    sink = Collect()
    session = CaptureSession(CaptureConfig(peak_tflops=PEAK_TFLOPS, gpu_price=PRICE, job_id="carried", environ={}, **config),
                             exporters=[("memory", sink)]).start()
    try:
        for b in batches:
            with session.step():
                _train_step(model, inputs[b])
    finally:
        session.close(timeout=60)
    assert not session.failed and session.stats["steps_dropped"] == 0
    return sink.rows(), sink, expected


def _by_step(rows: list[dict], level: str) -> dict[int, dict]:
    return {r["plasmient.step"]: r for r in rows if r["plasmient.level"] == level}


BATCHES = [4] * 12 + [2] * 3  # PLASMIENT_EVERY=10: full depth at 0 and 10; 12 has a new shape


@pytest.fixture(scope="module")
def run() -> tuple[list[dict], Collect, dict[int, float]]:
    return _capture(BATCHES, every=10)


def test_every_step_has_flops_mfu_wall_and_cost(run):
    rows, _, _ = run
    steps = _by_step(rows, "step")
    assert sorted(steps) == list(range(len(BATCHES)))
    for s, r in steps.items():
        assert r["plasmient.flops"] > 0 and 0 < r["plasmient.mfu"] < 1, s
        assert r["plasmient.wall_s"] > 0
        # one CPU charged for the step's window at PRICE per device-hour
        assert r["plasmient.cost.usd"] == pytest.approx(r["plasmient.device.window_s"] * PRICE / 3600, rel=1e-9)


def _cpu_price_set(cpu_price: str | None, monkeypatch) -> float:
    """PLASMIENT_CPU_PRICE as given (None: unset), and the USD an hour the run's spans should be priced at."""
    from plasmient_trace.metrics import cpu_peak

    if cpu_price is None:
        monkeypatch.delenv("PLASMIENT_CPU_PRICE", raising=False)
        return cpu_peak.CPU_PRICE_PER_THREAD_HOUR * torch.get_num_threads()
    monkeypatch.setenv("PLASMIENT_CPU_PRICE", cpu_price)
    return float(cpu_price)


def _three_cpu_steps(**config) -> dict[int, dict]:
    """The step spans of three explicit steps of the block, captured live with ``config``."""
    torch.manual_seed(0)
    model, x = _Block(), torch.randn(2, SEQ, DIM)
    with live_capture(close_timeout=60, every=2, **config) as (session, sink):
        for _ in range(3):
            with session.step():
                _train_step(model, x)
    return _by_step(sink.rows(), "step")


@pytest.mark.parametrize("cpu_price", [None, "36"])
def test_a_peak_given_for_the_cpu_keeps_the_cpus_price(cpu_price, monkeypatch):
    # PLASMIENT_PEAK_TFLOPS skips the CPU calibration, and the CPU's price went with it: no cost on any span
    price = _cpu_price_set(cpu_price, monkeypatch)
    steps = _three_cpu_steps(peak_tflops=PEAK_TFLOPS, job_id="cpu-price")
    assert sorted(steps) == [0, 1, 2]
    for r in steps.values():
        assert r["plasmient.cost.usd"] == pytest.approx(r["plasmient.device.window_s"] * price / 3600, rel=1e-9)
        assert 0 < r["plasmient.mfu"] < 1  # the peak is the one given


def test_full_depth_on_the_sampling_rhythm_and_on_a_new_shape_the_rest_carried(run):
    rows, _, _ = run
    steps = _by_step(rows, "step")
    depth = {s: r["plasmient.sampled_depth"] for s, r in steps.items()}
    source = {s: r["plasmient.flops.source"] for s, r in steps.items()}
    full = {0, 10, 12}  # 0 and 10: every 10th step; 12: batch 2 was never seen
    assert {s for s, d in depth.items() if d == "full"} == full
    assert source == {s: "measured" if s in full else "carried" for s in steps}


def test_measured_flops_agree_with_flop_counter_mode_and_carried_flops_are_the_measured_ones(run):
    rows, _, expected = run
    steps = _by_step(rows, "step")
    for s, r in steps.items():
        oracle = expected[BATCHES[s]]
        assert oracle <= r["plasmient.flops"] <= 1.05 * oracle, (s, r["plasmient.flops"], oracle)
        if r["plasmient.flops.source"] == "carried":
            source_step = max(m for m in (0, 10, 12) if m < s)
            assert r["plasmient.flops"] == steps[source_step]["plasmient.flops"], s
            assert r["plasmient.flops.coverage"] == pytest.approx(steps[source_step]["plasmient.flops.coverage"])
    assert expected[2] < 0.6 * expected[4]  # the new shape is other work, measured afresh


def test_carried_mfu_is_the_carried_flops_over_the_steps_own_window(run):
    rows, _, _ = run
    for r in _by_step(rows, "step").values():
        if r["plasmient.flops.source"] != "carried":
            continue
        # fp32 on a CPU whose peak is overridden: ideal time = flops / peak
        assert r["plasmient.ideal_s"] == pytest.approx(r["plasmient.flops"] / (PEAK_TFLOPS * 1e12), rel=1e-9)
        assert r["plasmient.mfu"] == pytest.approx(r["plasmient.ideal_s"] / r["plasmient.device.window_s"], rel=1e-9)
        # a CPU's ops are its kernels: without op hooks its busy time and util were not measured
        assert r["plasmient.util.resident"] is None and r["plasmient.busy_s"] is None
        assert r["plasmient.culprits"] is None and r["plasmient.wasted_s"] is None


def test_rank_and_fleet_spans_carry_the_step_mfu(run):
    rows, _, _ = run
    steps, ranks, fleet = (_by_step(rows, lv) for lv in ("step", "rank", "fleet"))
    for s, r in steps.items():
        for top in (ranks[s], fleet[s]):
            assert top["plasmient.flops.source"] == r["plasmient.flops.source"]
            assert top["plasmient.flops"] == r["plasmient.flops"]
            assert top["plasmient.mfu"] == pytest.approx(r["plasmient.mfu"], rel=1e-9)
        # one rank alone: the node and the fleet are its window, their time and cost its own, none outside it
        # (a live rank's tiled stretch is open; read as int64's extremes it billed $103,149 a step)
        for level in ("node", "fleet"):
            top = _by_step(rows, level)[s]
            assert top["plasmient.device.window_s"] == pytest.approx(ranks[s]["plasmient.device.window_s"], rel=1e-9)
            for key in ("plasmient.cost.usd", "plasmient.cost.wasted_usd", "plasmient.wasted_s"):
                assert (top[key] is None) == (ranks[s][key] is None), (level, key)
                if top[key] is not None:
                    assert top[key] == pytest.approx(ranks[s][key], rel=1e-9, abs=1e-15), (level, key)


def _mfu_points(sink: Collect) -> list[tuple[dict, object]]:
    from test_metrics_export import _points

    from plasmient_trace.export.metrics import metric_requests

    return [(attrs, dp) for b in sink.batches for name, attrs, dp, _ in _points(list(metric_requests(b)))
            if name == "plasmient.step.mfu"]


def test_live_metrics_have_one_mfu_point_per_step_with_its_span_as_exemplar(run):
    rows, sink, _ = run
    spans = {(r["trace_id"], r["span_id"]): r for r in rows}
    points = _mfu_points(sink)
    for attrs, dp in points:
        (ex,) = dp.exemplars
        span = spans[(ex.trace_id, int.from_bytes(ex.span_id, "big"))]
        assert span["plasmient.level"] == attrs["plasmient.level"] and dp.as_double == pytest.approx(span["plasmient.mfu"])
    for level in ("rank", "fleet"):
        assert sorted(_exemplar_steps(rows, points, level)) == list(range(len(BATCHES))), level


def test_a_new_shape_that_could_not_be_measured_is_unknown_without_mfu():
    # one signature may be captured: the second shape is never measured, so its steps have nothing to carry
    batches = [4, 4, 4, 2, 2]
    rows, sink, _ = _capture(batches, every=100, max_signatures=1)
    steps = _by_step(rows, "step")
    assert {s: r["plasmient.flops.source"] for s, r in steps.items()} == {
        0: "measured", 1: "carried", 2: "carried", 3: "unknown", 4: "unknown"}
    for s in (3, 4):
        for r in (steps[s], _by_step(rows, "rank")[s], _by_step(rows, "fleet")[s]):
            assert r["plasmient.sampled_depth"] in ("step", None)
            assert r["plasmient.flops"] is None and r["plasmient.mfu"] is None and r["plasmient.hfu"] is None
            assert r["plasmient.flops.coverage"] is None and r["plasmient.wall_s"] > 0
    # no MFU point for an unknown step, rather than a fake one
    assert sorted(_exemplar_steps(rows, _mfu_points(sink), "rank")) == [0, 1, 2]


def test_the_report_shows_the_coverage_a_carried_step_carries(run):
    from plasmient_trace.report.cli import merge_batches
    from plasmient_trace.report.summary import summary_rows

    rows, sink, _ = run
    fleets = _by_step(rows, "fleet")
    by_step = {r["step"]: r for r in summary_rows(merge_batches(sink.batches))}
    carried = [s for s, f in fleets.items() if f["plasmient.flops.source"] == "carried"]
    assert carried and all(fleets[s]["plasmient.busy_s"] is None for s in carried)  # CPU step depth: no busy time
    for s, fleet in fleets.items():
        assert by_step[s]["coverage"] == pytest.approx(fleet["plasmient.flops.coverage"]), s


def test_the_reports_all_row_says_its_mfu_covers_only_the_measured_steps():
    import io

    from rich.console import Console

    from plasmient_trace.report.cli import merge_batches
    from plasmient_trace.report.summary import fmt_pct, render_summary

    rows, sink, _ = _capture([4, 4, 4, 2, 2], every=100, max_signatures=1)  # steps 3 and 4: unknown FLOPs
    fleets = _by_step(rows, "fleet")
    # the report's weight: the device window the MFU divides by, times the devices
    device_s = {s: r["plasmient.device.window_s"] * r["plasmient.gpus"] for s, r in fleets.items()}
    with_mfu = [s for s, r in fleets.items() if r["plasmient.mfu"] is not None]
    assert with_mfu == [0, 1, 2]
    share = sum(device_s[s] for s in with_mfu) / sum(device_s.values())
    console = Console(file=io.StringIO(), width=400, record=True, color_system=None)
    render_summary(merge_batches(sink.batches), console=console)
    text = console.export_text()
    assert f"all: MFU is over the 3 of 5 steps that have one ({fmt_pct(share)} of the device time)" in text
    # the all row's MFU is theirs, weighted by device time
    mfu = sum(fleets[s]["plasmient.mfu"] * device_s[s] for s in with_mfu) / sum(device_s[s] for s in with_mfu)
    all_row = next(line for line in text.splitlines() if line.startswith("│") and line.split("│")[1].strip() == "all")
    assert f" {fmt_pct(mfu)} " in all_row


def _exemplar_steps(rows: list[dict], points: list, level: str) -> list[int]:
    spans = {(r["trace_id"], r["span_id"]): r for r in rows}
    out = []
    for attrs, dp in points:
        if attrs["plasmient.level"] == level:
            (ex,) = dp.exemplars
            out.append(spans[(ex.trace_id, int.from_bytes(ex.span_id, "big"))]["plasmient.step"])
    return out


def test_input_signature_is_shapes_and_dtypes_of_nested_tensors_and_the_numbers_beside_them():
    a, b = torch.zeros(2, 3), torch.zeros(4, dtype=torch.int64)
    assert input_signature((a, {"mask": b, "n": 7}, [None, "x"])) == \
        (((2, 3), "float32"), ((4,), "int64"), ("int", 7), ("str", "x"))
    assert input_signature((a,)) != input_signature((torch.zeros(3, 3),))
    assert input_signature((1, "text", None)) is None
    deep = (((((((a,),),),),),),)
    assert input_signature(deep) is None  # deeper than it looks: bounded, not walked
    assert len(input_signature(tuple(torch.zeros(1) for _ in range(100)))) == 32


def test_a_gpu_step_at_step_depth_keeps_its_own_kernel_time_and_carries_the_flops():
    """Under CUPTI the kernels of a step-depth step still arrive (only the op hooks are off): its util is
    its own kernels' resident time over its own window, and its MFU the carried ideal time over that window."""
    from cupti_buffers import tables_of
    from test_capture_cupti import OFFSET, T0, _ops, api_name, kernel, records, runtime

    from plasmient_trace.pipeline import IngestOptions, stitch_records
    from plasmient_trace.records import DeviceInfo, RecordSet, table_from_columns
    from plasmient_trace.stitch.step_facts import StepFacts

    # step 0: the fixture's mm + copy + fill, joined to their ops; step 1: two GEMMs, no ops, no external ids
    step1 = [runtime(21, 601_000, 602_000), kernel(21, 610_000, 710_000),
             runtime(22, 603_000, 604_000), kernel(22, 800_000, 850_000)]
    t = tables_of(records() + step1, OFFSET, api_name)
    e = OFFSET + T0
    rs = RecordSet(kernels=t["kernels"], launches=t["launches"], external_correlation=t["external_correlation"],
                   ops=_ops(), source="live:cupti",
                   devices=[DeviceInfo(ordinal=0, name="NVIDIA H100 80GB HBM3", properties={"name": "NVIDIA H100 80GB HBM3"})],
                   steps=table_from_columns("steps", {"step": [0, 1], "start_ns": [e - 1_000, e + 600_000],
                                                      "end_ns": [e + 600_000, e + 900_000], "name": ["s0", "s1"]}))
    facts = StepFacts(signatures={0: "Model|train|grad|((4096, 4096), 'float32')", 1: "Model|train|grad|((4096, 4096), 'float32')"})
    result = stitch_records([rs], IngestOptions(job_id="gpu-carried", full_depth_steps={0}, step_facts=facts,
                                                gpu_price=2.0))
    rows = result.batch.table.to_pylist()
    steps = _by_step(rows, "step")
    # culprits are ranked for the full-depth step only: what the fleet reduce (and other ranks) receive
    assert [bool(s.culprits) for s in sorted(result.summaries, key=lambda s: s.step)] == [True, False]
    assert steps[0]["plasmient.flops.source"] == "measured" and steps[0]["plasmient.flops"] == 2 * 4096 ** 3
    s1 = steps[1]
    assert s1["plasmient.flops.source"] == "carried" and s1["plasmient.flops"] == 2 * 4096 ** 3
    assert s1["plasmient.ideal_s"] == steps[0]["plasmient.ideal_s"]
    # its window runs from step 0's last kernel end (the memset, 410 us) to its own last kernel end (850 us)
    window = (850_000 - 410_000) / 1e9
    busy = (100_000 + 50_000) / 1e9
    assert s1["plasmient.device.window_s"] == pytest.approx(window)
    assert s1["plasmient.busy_s"] == pytest.approx(busy) and s1["plasmient.util.resident"] == pytest.approx(busy / window)
    assert s1["plasmient.mfu"] == pytest.approx(min(s1["plasmient.ideal_s"] / window, busy / window))
    assert s1["plasmient.cost.usd"] == pytest.approx(window * 2.0 / 3600)
    assert s1["plasmient.culprits"] is None and s1["plasmient.bound"] is None
    assert _by_step(rows, "fleet")[1]["plasmient.mfu"] == pytest.approx(s1["plasmient.mfu"])


def test_under_torch_compile_the_carried_flops_are_not_the_compilers():
    """A full-depth step during which torch.compile traced records the compiler's own ops too: it is not
    carried; the signature is measured again on a compiled call, and that is what later steps carry."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
    x = torch.randn(16, DIM)
    oracle = _flop_counter(eager, x)
    model = torch.compile(eager)
    sink = Collect()
    session = CaptureSession(CaptureConfig(every=10, peak_tflops=PEAK_TFLOPS, job_id="compiled", environ={}),
                             exporters=[("memory", sink)]).start()
    try:
        for _ in range(8):
            with session.step():
                _train_step(model, x)
    finally:
        session.close(timeout=120)
    steps = _by_step(sink.rows(), "step")
    carried = {s: r["plasmient.flops"] for s, r in steps.items() if r["plasmient.flops.source"] == "carried"}
    assert len(carried) >= 5, {s: r["plasmient.flops.source"] for s, r in steps.items()}
    for s, flops in carried.items():
        assert oracle <= flops <= 1.05 * oracle, (s, flops, oracle)


def test_a_step_that_calls_the_model_another_number_of_times_carries_nothing():
    # Gradient accumulation: four micro-batches a step, but two at an epoch's end and eight once. The step's
    # first call has the same shapes every time, so all steps carried the four-micro-batch FLOPs: 2x, 4x too
    # many or 2x too few, labelled "carried". A step's signature now holds every call of the model.
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block())
    x = torch.randn(2, SEQ, DIM)
    micro = [4, 4, 2, 4, 1, 8, 4, 2]

    def step(n: int) -> None:
        model.zero_grad(set_to_none=True)
        for _ in range(n):
            model(x).pow(2).mean().backward()

    def counted(n: int) -> float:
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:
            step(n)
        return float(counter.get_total_flops())

    expected = {n: counted(n) for n in set(micro)}
    with live_capture(close_timeout=60, every=10, peak_tflops=PEAK_TFLOPS, job_id="accumulate") as (session, sink):
        for n in micro:
            with session.step():
                step(n)
    steps = _by_step(sink.rows(), "step")
    assert [steps[i]["plasmient.flops.source"] for i in range(len(micro))] == \
        ["measured", "carried", "unknown", "carried", "unknown", "unknown", "carried", "unknown"]
    for i, n in enumerate(micro):
        if steps[i]["plasmient.flops.source"] == "unknown":
            assert steps[i]["plasmient.flops"] is None and steps[i]["plasmient.mfu"] is None
        else:
            assert n == 4 and expected[4] <= steps[i]["plasmient.flops"] <= 1.05 * expected[4]
    assert expected[8] == 2 * expected[4] == 4 * expected[2]


def test_a_step_measured_on_its_new_shape_counts_the_work_before_its_first_module_call():
    """A new shape sends a step-depth step to full depth at its first module call. What the step did before
    that call (here a preprocessing GEMM outside any module) is its work too: the measured FLOPs, and the
    FLOPs later steps of that shape carry, are the whole step's, as FlopCounterMode counts it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256, bias=False), nn.ReLU(), nn.Linear(256, 64, bias=False))
    project = torch.randn(64, 512)
    inputs = {b: torch.randn(b, 512) for b in (16, 32)}

    def step(b: int) -> None:
        x = inputs[b] @ project.t()  # preprocessing before the model: 2 * b * 512 * 64 FLOPs
        model.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()

    expected = _flop_counter_per_input(step, inputs)
    batches = [16, 32, 16, 32, 16, 32]
    steps = _every_4th_step_full(step, batches, "pre-module")
    sources = {}
    for i, b in enumerate(batches):
        s = steps[i]
        sources[i] = s["plasmient.flops.source"]
        # FlopCounterMode counts the GEMMs; plasmient also the ReLU, the loss and its backward: a few percent
        assert expected[b] <= s["plasmient.flops"] <= 1.05 * expected[b], (i, b, s["plasmient.flops"], expected[b])
    assert sources[1] == "measured" and sources[3] == "carried" and sources[5] == "carried"


def test_a_step_whose_second_model_sees_other_shapes_carries_nothing_measured_without_them():
    """An encoder of fixed shape, then a decoder whose length changes (two models of one class): the step's
    signature is the encoder's first call, and a step carried what a step with another decoder length
    measured (7x under FlopCounterMode). The other models' shapes join the signature: a step is carried
    only from one whose every model saw the same shapes, and is unknown otherwise, never wrong."""
    torch.manual_seed(0)

    def mlp() -> nn.Module:
        return nn.Sequential(nn.Linear(64, 256, bias=False), nn.ReLU(), nn.Linear(256, 64, bias=False))

    enc, dec = mlp(), mlp()
    image = torch.randn(32, 64)
    tokens = {n: torch.randn(n, 64) for n in (8, 256)}

    def step(n: int) -> None:
        loss = dec(tokens[n]).pow(2).mean() + enc(image).pow(2).mean()
        loss.backward()

    step_order = [8, 256, 8, 256, 8, 256, 8, 256]
    expected = _flop_counter_per_input(step, tokens)

    def enc_first(n: int) -> None:  # the encoder's call gives the signature
        h = enc(image).pow(2).mean()
        (h + dec(tokens[n]).pow(2).mean()).backward()

    steps = _every_4th_step_full(enc_first, step_order, "enc-dec")
    for i, n in enumerate(step_order):
        s = steps[i]
        if s["plasmient.flops.source"] == "unknown":
            assert s["plasmient.flops"] is None
            continue
        assert expected[n] <= s["plasmient.flops"] <= 1.05 * expected[n], (i, n, s["plasmient.flops.source"], s["plasmient.flops"])
    # the shape measured at full depth (steps 0 and 4: n=8) is carried to the steps of the same shape
    assert [steps[i]["plasmient.flops.source"] for i in (2, 6)] == ["carried", "carried"]


@pytest.mark.parametrize("cpu_price", [None, "1.5"])
def test_steps_exported_before_the_cpu_peak_is_calibrated_keep_their_price(cpu_price, monkeypatch):
    """The price of a CPU job's cores needs no calibration, but steps stitched while the peak's calibration
    was still running (a job's first run on a machine, or one that keeps every core busy) had no cost on any
    span. They have no MFU (the peak is unknown) and their cost is the price times the window."""
    from concurrent.futures import Future

    from plasmient_trace.metrics import hardware

    price = _cpu_price_set(cpu_price, monkeypatch)
    never: Future = Future()  # a calibration that has not finished by the end of the run
    monkeypatch.setattr(hardware, "start_cpu_calibration", lambda threads: never)
    steps = _three_cpu_steps(job_id="cpu-pending", environ={"PLASMIENT_CALIBRATION_WAIT_S": "0"})
    assert sorted(steps) == [0, 1, 2]
    for r in steps.values():
        assert r["plasmient.mfu"] is None
        assert r["plasmient.cost.usd"] == pytest.approx(r["plasmient.device.window_s"] * price / 3600, rel=1e-9)
