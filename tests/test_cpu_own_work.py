"""On a CPU the ops are the device's kernels, and an op whose work runs in its own body, between the small
ops it calls, is work too (``stitch.ownership.own_time_gaps``): LAPACK inside ``aten::_linalg_svd`` calls
only an error check and a few allocations and copies, and with those alone as its kernels a 20 ms SVD read as
0.2 ms of work and the rest as idle. Checked on real traces recorded here (torch.profiler, and live capture)
against each op's own interval and its children's, read from the raw records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from conftest import ingest_batch  # noqa: E402

OWN_WORK_MIN_US = 10.0


def _spans(batch) -> list[dict]:
    return batch.table.to_pylist()


def _recorded(tmp_path: Path) -> Path:
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    matrix, values = torch.randn(384, 384), torch.randn(1 << 20)
    linear, x = nn.Linear(256, 256), torch.randn(64, 256)

    def work() -> None:
        torch.linalg.svd(matrix)
        torch.sort(values)
        linear(x)

    work()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        work()
    path = tmp_path / "cpu_own_work.json"
    prof.export_chrome_trace(str(path))
    return path


def _own_and_children_us(raw: dict, name: str) -> tuple[float, float]:
    """The first ``name`` op's duration and its direct children's summed durations, from the raw events:
    a child is an op of the same thread inside it that no other op inside it contains."""
    ops = [e for e in raw["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    op = next(e for e in ops if e["name"] == name)
    t0, t1 = op["ts"], op["ts"] + op["dur"]
    inside = [e for e in ops if e is not op and e["tid"] == op["tid"] and t0 <= e["ts"] and e["ts"] + e["dur"] <= t1]
    direct = [e for e in inside if not any(o is not e and o["ts"] <= e["ts"] and e["ts"] + e["dur"] <= o["ts"] + o["dur"]
                                          and (o["ts"], -o["dur"]) < (e["ts"], -e["dur"]) for o in inside)]
    return op["dur"], sum(e["dur"] for e in direct)


def test_an_op_doing_its_work_in_its_own_body_is_busy_for_its_whole_interval(tmp_path):
    path = _recorded(tmp_path)
    raw = json.loads(path.read_text())
    spans = _spans(ingest_batch([path], "own-work"))
    ops = {s["name"]: s for s in spans if s["plasmient.level"] == "op"}

    svd_us, svd_children_us = _own_and_children_us(raw, "aten::_linalg_svd")
    assert svd_children_us > 0 and svd_us - svd_children_us >= max(svd_children_us, OWN_WORK_MIN_US)
    svd = ops["aten::_linalg_svd"]
    wall_s = (svd["end_ns"] - svd["start_ns"]) / 1e9
    # its own time is busy, beside what its children's kernels hold (not their dispatch, nor an allocation)
    own_s = (svd_us - svd_children_us) / 1e6
    assert own_s - 2e-6 <= svd["plasmient.busy_s"] <= wall_s
    # its own time has no FLOP formula: unknown work, which the coverage says
    assert svd["plasmient.flops.coverage"] <= svd_children_us / svd_us + 1e-3

    # A composite op's few microseconds of dispatch around its GEMM are not work: aten::linear is busy for its
    # children's intervals at most (aten::addmm, and the view under aten::t).
    linear, addmm = ops["aten::linear"], ops["aten::addmm"]
    linear_us, linear_children_us = _own_and_children_us(raw, "aten::linear")
    assert linear_us > linear_children_us
    assert (addmm["end_ns"] - addmm["start_ns"]) / 1e9 <= linear["plasmient.busy_s"] <= linear_children_us / 1e6 + 1e-8
    assert linear["plasmient.flops.coverage"] == 1.0

    step = next(s for s in spans if s["plasmient.level"] == "step")
    assert step["plasmient.busy_s"] >= own_s + (addmm["end_ns"] - addmm["start_ns"]) / 1e9


def test_live_capture_counts_an_svd_s_own_time_as_work():
    from capture_helpers import live_capture

    matrix = torch.randn(384, 384)
    torch.linalg.svd(matrix)
    with live_capture(every=1, peak_tflops=0.05, job_id="svd") as (session, sink):
        with session.step():
            torch.linalg.svd(matrix)
    rows = sink.rows()
    svd = next(r for r in rows if r["plasmient.level"] == "op" and r["name"] == "aten::_linalg_svd")
    children = [r for r in rows if r["parent_span_id"] == svd["span_id"] and r["plasmient.level"] == "op"]
    wall_s = (svd["end_ns"] - svd["start_ns"]) / 1e9
    in_children_s = sum(r["end_ns"] - r["start_ns"] for r in children) / 1e9
    assert in_children_s < wall_s / 2
    assert wall_s - in_children_s <= svd["plasmient.busy_s"] <= wall_s
    step = next(r for r in rows if r["plasmient.level"] == "step")
    assert step["plasmient.busy_s"] >= wall_s - in_children_s


def test_the_python_around_compiled_kernels_and_dynamo_s_guard_check_are_not_work():
    # Only ATen ops (C++ bodies) take their own time as work. torch.compile's CompiledFunction spends most of
    # its time outside the GEMMs it calls in AOTAutograd's and Inductor's Python wrappers, and dynamo's guard
    # check runs before each call: neither is the model's work, whatever share of the op's interval it is.
    from capture_helpers import live_capture

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128), nn.LayerNorm(128))
    compiled = torch.compile(model)
    x = torch.randn(64, 128)
    for _ in range(2):
        compiled(x).pow(2).mean().backward()
    with live_capture(every=1, peak_tflops=0.05, job_id="compiled") as (session, sink):
        with session.step():
            compiled(x).pow(2).mean().backward()
    rows = sink.rows()
    ops = [r for r in rows if r["plasmient.level"] == "op"]
    wrappers = [r for r in ops if r["name"] in ("CompiledFunction", "CompiledFunctionBackward")]
    assert len(wrappers) == 2
    for wrapper in wrappers:
        children = [r for r in ops if r["parent_span_id"] == wrapper["span_id"]]
        assert children, wrapper["name"]
        assert wrapper["plasmient.busy_s"] == pytest.approx(sum(r["plasmient.busy_s"] or 0.0 for r in children), abs=1e-9)
    lookups = [r for r in ops if r["name"] == "TorchDynamo Cache Lookup"]
    assert lookups and all(not r["plasmient.busy_s"] for r in lookups)


def test_own_work_is_the_same_stitched_whole_or_a_step_at_a_time(tmp_path):
    from torch.profiler import ProfilerActivity, profile, schedule

    from plasmient_trace.cli import main

    matrix, values = torch.randn(200, 200), torch.randn(200_000)
    torch.linalg.svd(matrix)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                 schedule=schedule(wait=0, warmup=0, active=5)) as prof:
        for _ in range(4):
            torch.linalg.svd(matrix)
            torch.sort(values)
            prof.step()
    trace = tmp_path / "steps.json"
    prof.export_chrome_trace(str(trace))
    outputs = []
    for extra in ([], ["--chunk-rows", "1"]):
        out = tmp_path / f"spans{len(extra)}.jsonl"
        assert main(["ingest", str(trace), "--job-id", "own", "--out", str(out), "--quiet", *extra]) == 0
        outputs.append(sorted(out.read_bytes().splitlines()))
    assert len(outputs[0]) >= 4 and outputs[0] == outputs[1]
    steps = [s for s in _spans_of(outputs[0]) if s["plasmient.level"] == "step" and s["plasmient.busy_s"]]
    assert len(steps) >= 4 and all(s["plasmient.util.resident"] > 0.5 for s in steps)
    # The culprits name the SVD and the sort, each one call a step however many stretches its own work took
    # (the raw trace has one of each per ProfilerStep: aten::sort calls its out= form, also aten::sort, which
    # does the work).
    raw = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "cpu_op"]

    def innermost(name: str) -> int:
        calls = [e for e in raw if e["name"] == name]
        return sum(not any(o is not e and e["ts"] <= o["ts"] and o["ts"] + o["dur"] <= e["ts"] + e["dur"] for o in calls)
                   for e in calls)

    per_step = {name: innermost(name) / len(steps) for name in ("aten::_linalg_svd", "aten::sort")}
    assert per_step == {"aten::_linalg_svd": 1, "aten::sort": 1}

    def inside(e: dict, events: list[dict]) -> list[dict]:
        return [o for o in events if o is not e and o["tid"] == e["tid"] and e["ts"] <= o["ts"]
                and o["ts"] + o["dur"] <= e["ts"] + e["dur"]]

    def own_body_is_most_of_it(e: dict) -> bool:
        # ownership.own_time_gaps counts an op's own body as work when it spends at least half its interval
        # outside its child ops. On a loaded machine a preempted child (the sort's aten::copy_, 40 ms) can take
        # that half: then the child is what the step names, as its interval says.
        nested = inside(e, raw)
        children = [o for o in nested if not any(any(o is q for q in inside(p, nested)) for p in nested)]
        in_children = sum(o["dur"] for o in children)
        return e["dur"] - in_children >= in_children

    bounds = {int(e["name"].split("#")[1]): (e["ts"], e["ts"] + e["dur"]) for e in json.loads(trace.read_text())["traceEvents"]
              if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")}
    checked = 0
    for step in steps:
        rows = {r["op"]: r for r in json.loads(step["plasmient.culprits"])}
        lo, hi = bounds[int(step["plasmient.step"])]
        for name in per_step:
            (work,) = [e for e in raw if e["name"] == name and lo <= e["ts"] <= hi and not inside(e, [o for o in raw if o["name"] == name])]
            if own_body_is_most_of_it(work):
                assert rows[name]["calls"] == 1 and rows[name]["bound"] == "unknown", (name, rows.get(name))
                checked += 1
    assert checked >= len(per_step) * len(steps) // 2  # a loaded machine preempts some, never most


def _spans_of(lines: list[bytes]) -> list[dict]:
    import orjson

    out = []
    for line in lines:
        for rs in orjson.loads(line)["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                for sp in ss["spans"]:
                    out.append({a["key"]: next(iter(a["value"].values())) for a in sp["attributes"]})
    return out
