"""A number that is unknown is absent, never 0. FLOPs, bytes and ideal seconds are sums of the known work
under a span; where that sum is 0 while some of the span's busy time ran work whose FLOPs are unknown, the 0
is not a measurement and the span leaves the number out (``metrics.compute.zero_says_nothing``). A known
zero (a copy, a view) stays 0, and a partial sum that is above 0 stays, a lower bound labelled by its
coverage. Checked on a trace recorded here by torch.profiler against the raw events: which ops ran, their
shapes and their durations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")


INCLUSIVE_SUMS = ("plasmient.flops", "plasmient.bytes", "plasmient.ideal_s")
WORK_SUMS = INCLUSIVE_SUMS + ("plasmient.flops.self", "plasmient.bytes.self")


def _recorded(tmp_path: Path) -> Path:
    """Three steps: a GEMM, a top-k (no FLOP formula) and a transpose copy; then a step of top-k alone."""
    from torch.profiler import ProfilerActivity, profile, schedule

    torch.manual_seed(0)
    x, w = torch.randn(128, 256), torch.randn(256, 128)
    values = torch.randn(1 << 20)

    def mixed() -> None:
        torch.mm(x, w)
        torch.topk(values, 1000)
        x.t().contiguous()

    mixed()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                 schedule=schedule(wait=0, warmup=0, active=5)) as prof:
        for _ in range(3):
            mixed()
            prof.step()
        torch.topk(values, 1000)
        prof.step()
    path = tmp_path / "mixed.json"
    prof.export_chrome_trace(str(path))
    return path


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], list[dict]]:
    path = _recorded(tmp_path_factory.mktemp("unknown"))
    raw = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    from plasmient_trace.pipeline import IngestOptions, ingest_paths

    # a peak, so ideal seconds exist wherever the FLOPs are known (high enough that no GEMM beats it)
    spans = ingest_paths([str(path)], IngestOptions(job_id="unknown", peak_tflops=10.0)).batch.table.to_pylist()
    return raw, spans


def _op_spans(spans: list[dict], name: str) -> list[dict]:
    return [s for s in spans if s["plasmient.level"] == "op" and s["name"] == name]


def test_an_op_without_a_flop_formula_has_no_flops_bytes_or_ideal_time_not_zeros(recorded):
    raw, spans = recorded
    raw_topk = [e for e in raw if e.get("cat") == "cpu_op" and e["name"] == "aten::topk"]
    topk = _op_spans(spans, "aten::topk")
    assert len(topk) == len(raw_topk) == 4
    for span in topk:
        assert span["plasmient.busy_s"] > 0 and span["plasmient.flops.coverage"] == 0
        assert all(span[key] is None for key in WORK_SUMS), {key: span[key] for key in WORK_SUMS}
        assert span["plasmient.mfu"] is None
        assert span["plasmient.op.flops_model"] == "none" and span["plasmient.op.model_flops"] is None


def test_a_gemm_s_flops_are_the_shapes_and_a_copy_s_known_zero_stays_zero(recorded):
    raw, spans = recorded
    dims = [e["args"]["Input Dims"] for e in raw if e.get("cat") == "cpu_op" and e["name"] == "aten::mm"]
    assert len(dims) == 3
    (m, k), (_, n) = dims[0][:2]
    mm = _op_spans(spans, "aten::mm")
    assert len(mm) == 3 and all(s["plasmient.flops"] == 2 * m * n * k for s in mm)
    assert all(s["plasmient.ideal_s"] == pytest.approx(2 * m * n * k / 10e12) for s in mm)
    copies = [s for s in _op_spans(spans, "aten::copy_") if s["plasmient.busy_s"]]
    assert copies
    for span in copies:  # a copy does no math: a known zero, all its busy time known
        assert span["plasmient.flops"] == 0 and span["plasmient.flops.coverage"] == pytest.approx(1.0)
        assert span["plasmient.op.model_flops"] == 0


def test_a_step_with_known_and_unknown_work_keeps_its_known_flops_and_a_step_of_unknown_work_has_none(recorded):
    raw, spans = recorded
    # (the profiler opens a fifth ProfilerStep as it stops: empty)
    steps = sorted((s for s in spans if s["plasmient.level"] == "step" and s["plasmient.kernels"]),
                   key=lambda s: s["plasmient.step"])
    assert len(steps) == 4
    mm_flops = sum(s["plasmient.flops"] for s in _op_spans(spans, "aten::mm")) / 3
    for step in steps[:3]:
        # a lower bound that says something: at least its GEMM, with the coverage that qualifies it
        assert step["plasmient.flops"] >= mm_flops and 0 < step["plasmient.flops.coverage"] < 1
        assert step["plasmient.mfu"] is not None
    last = steps[3]
    assert last["plasmient.busy_s"] > 0 and last["plasmient.flops.coverage"] == 0
    assert all(last[key] is None for key in INCLUSIVE_SUMS) and last["plasmient.mfu"] is None
    # its own (exclusive) share: no busy time outside its ops, so a known zero
    assert last["plasmient.busy_s.self"] == 0 and last["plasmient.flops.self"] == 0
    # the fleet span of that step says the same
    fleet = [s for s in spans if s["plasmient.level"] == "fleet" and s["plasmient.step"] == last["plasmient.step"]]
    assert len(fleet) == 1 and all(fleet[0][key] is None for key in INCLUSIVE_SUMS)


def test_a_parent_s_flops_are_its_children_s_known_flops(recorded):
    _, spans = recorded
    by_id = {(s["trace_id"], s["span_id"]): s for s in spans}
    children: dict[tuple, list[dict]] = {}
    for s in spans:
        children.setdefault((s["trace_id"], s["parent_span_id"]), []).append(s)
    checked = 0
    for key, parent in by_id.items():
        kids = children.get(key, [])
        if not kids or parent["plasmient.device.window_s"] is None or parent["plasmient.level"] in ("fleet", "node"):
            continue
        known = sum(k["plasmient.flops"] or 0 for k in kids) + (parent["plasmient.flops.self"] or 0)
        if parent["plasmient.flops"] is None:
            assert known == 0
        else:
            assert parent["plasmient.flops"] == pytest.approx(known, rel=1e-9)
        checked += 1
    assert checked > 10


def test_folded_kernels_of_unknown_flops_have_no_folded_flops_and_known_ones_keep_theirs(tmp_path):
    from plasmient_trace.pipeline import IngestOptions, ingest_paths

    path = _recorded(tmp_path)
    # a budget of the step's own spans only: every op and kernel folds into its step
    spans = ingest_paths([str(path)], IngestOptions(job_id="folded", max_spans=4)).batch.table.to_pylist()
    steps = sorted((s for s in spans if s["plasmient.level"] == "step" and s["plasmient.kernels"]),
                   key=lambda s: s["plasmient.step"])
    assert len(steps) == 4 and all(s["plasmient.kernels.folded"] == s["plasmient.kernels"] for s in steps)
    for step in steps[:3]:  # the GEMM's FLOPs are among the folded ones
        assert step["plasmient.kernels.folded_flops"] == pytest.approx(step["plasmient.flops"]) and step["plasmient.flops"] > 0
    assert steps[3]["plasmient.kernels.folded_flops"] is None and steps[3]["plasmient.flops"] is None  # top-k alone


def test_bytes_are_known_where_a_model_or_the_record_sizes_them_and_absent_where_none_does():
    """h100/qwen: 49 aten::cat (a TensorList is recorded without an element type, so a join's bytes are not
    modelled), memsets and a memcpy whose records carry their bytes, GEMMs whose bytes the shapes give."""
    from conftest import TRACES, ingest_batch, raw_trace

    name = "h100/qwen1.5_0.5b_chat_inference.json.gz"
    raw = [e for e in raw_trace(name)["traceEvents"] if e.get("ph") == "X"]
    spans = ingest_batch([TRACES / name], "bytes").table.to_pylist()
    cats = _op_spans(spans, "aten::cat")
    assert len(cats) == sum(e["name"] == "aten::cat" for e in raw) == 49
    for span in cats:  # its FLOPs are a known zero, its bytes unknown
        assert span["plasmient.flops"] == 0 and span["plasmient.bytes"] is None
    sized = {e["args"]["correlation"]: e["args"]["bytes"] for e in raw if e.get("cat") in ("gpu_memcpy", "gpu_memset")}
    copies = [s for s in spans if s["plasmient.level"] == "kernel" and s["plasmient.correlation_id"] in sized]
    assert copies and all(s["plasmient.bytes"] == sized[s["plasmient.correlation_id"]] for s in copies)
    gemms = [s for s in _op_spans(spans, "aten::mm") + _op_spans(spans, "aten::addmm") if s["plasmient.busy_s"]]
    assert gemms and all(s["plasmient.bytes"] > 0 for s in gemms)


def test_a_zero_length_window_has_no_utilisation_and_is_not_idle():
    """The V100 trace times kernels in whole microseconds: some last 0. A span whose device window is 0 long
    has no utilisation to measure (0/0: absent, as its idle fraction), and it was not idle: its kernels ran
    for all of it (latency, like any tiny kernel)."""
    from conftest import ingested, raw_trace

    name = "v100/resnet50_training.json.gz"
    rows = ingested(name).batch.table.to_pylist()
    zero = [r for r in rows if r["plasmient.device.window_s"] == 0.0]
    raw_zero = [e for e in raw_trace(name)["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "Kernel" and e["dur"] == 0]
    assert raw_zero and len([r for r in zero if r["plasmient.level"] == "kernel"]) == len(raw_zero)
    for r in zero:
        assert r["plasmient.util.resident"] is None and r["plasmient.idle_fraction"] is None, r["name"]
        assert r["plasmient.bound"] not in ("idle", None), r["name"]


def test_a_part_without_a_public_price_has_no_cost_until_one_is_given(tmp_path, capsys):
    """The MI250 has no public on-demand price; its table entry held a placeholder ($1.00 a GCD-hour) that
    every span of an MI250 trace carried as dollars. Now no span has a cost and the ingest says why; a
    price given with --gpu-price prices each step's window."""
    from conftest import trace_path

    from plasmient_trace.cli import main

    trace = str(trace_path("mi250/minitoy_train.json.gz"))
    rows = {}
    for price in (None, "1.5"):
        out = tmp_path / f"{price}.jsonl"
        assert main(["ingest", trace, "--job-id", "mi250", "--out", str(out)]
                    + (["--gpu-price", price] if price else [])) == 0
        err = capsys.readouterr().err
        said = "MI250 (per GCD) has no public list price: no cost on its spans (give one with --gpu-price)"
        assert (said in err) == (price is None)
        rows[price] = [{a["key"]: next(iter(a["value"].values())) for a in span["attributes"]}
                       for line in out.read_text().splitlines() for rs in json.loads(line)["resourceSpans"]
                       for ss in rs["scopeSpans"] for span in ss["spans"]]
    assert rows[None] and all("plasmient.cost.usd" not in r for r in rows[None])
    steps = [r for r in rows["1.5"] if r["plasmient.level"] == "step"]
    assert steps
    for r in steps:
        charged = float(r["plasmient.busy_s"]) + float(r["plasmient.idle_s"])
        assert float(r["plasmient.cost.usd"]) == pytest.approx(1.5 * charged / 3600, rel=1e-9)


def test_an_offline_cpu_trace_is_priced_by_plasmient_cpu_price_and_has_no_cost_without_it(tmp_path, capsys,
                                                                                          monkeypatch):
    """PLASMIENT_CPU_PRICE is the USD an hour of a CPU-only job's cores; a live run prices its CPU spans with it,
    and an offline ingest of a CPU trace ignored it (no cost on any span, not a word said). Now the ingest
    prices the trace's step window with it, with or without a --peak-tflops, and without it (or with a value
    that is no price) no span has a cost and the ingest says why: the default per thread is not applied, as
    the trace does not say how many threads the job had. The oracle, from the raw JSON: the step's charged
    window, from its ProfilerStep# start to the end of the last op in it (on a CPU the ops are the kernels)."""
    from conftest import raw_trace, trace_path

    from plasmient_trace.cli import main

    name = "cpu_only/rank-34.json.gz"
    events = [e for e in raw_trace(name)["traceEvents"] if e.get("ph") == "X"]
    ((start, end),) = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith("ProfilerStep#")]
    window_us = max(e["ts"] + e["dur"] for e in events if e.get("cat") in ("cpu_op", "user_annotation")
                    and not e["name"].startswith("ProfilerStep#") and start <= e["ts"] and e["ts"] + e["dur"] <= end) - start
    said = "no cost on its spans (set PLASMIENT_CPU_PRICE"
    for env, flags, price in ((None, [], None), ("3", [], 3.0), ("3", ["--peak-tflops", "1"], 3.0),
                              ("-1", [], None), ("3", ["--gpu-price", "2"], 2.0)):
        if env is None:
            monkeypatch.delenv("PLASMIENT_CPU_PRICE", raising=False)
        else:
            monkeypatch.setenv("PLASMIENT_CPU_PRICE", env)
        out = tmp_path / f"{env}-{len(flags)}.jsonl"
        assert main(["ingest", str(trace_path(name)), "--job-id", "cpu", "--out", str(out), *flags]) == 0
        err = capsys.readouterr().err
        assert (said in err) == (price is None), (env, flags, err)
        assert ("PLASMIENT_CPU_PRICE='-1' ignored" in err) == (env == "-1"), err
        rows = [{a["key"]: next(iter(a["value"].values())) for a in span["attributes"]}
                for line in out.read_text().splitlines() for rs in json.loads(line)["resourceSpans"]
                for ss in rs["scopeSpans"] for span in ss["spans"]]
        if price is None:
            assert rows and all("plasmient.cost.usd" not in r for r in rows), (env, flags)
            continue
        (step,) = [r for r in rows if r["plasmient.level"] == "step"]
        assert float(step["plasmient.cost.usd"]) == pytest.approx(price * window_us / 1e6 / 3600, rel=1e-6)
