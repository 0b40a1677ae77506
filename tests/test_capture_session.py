"""The live capture session in-process: steps, module/op spans, backward mapping, sampling, and
that nothing tracing does can break or block the job."""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
import time
from collections import Counter

import pytest
import torch

from plasmient_trace.capture import torch_hooks
from plasmient_trace.metrics.compute import FULL_COVERAGE
from plasmient_trace.capture.session import CaptureConfig, CaptureSession
from plasmient_trace.records import table_from_columns
from plasmient_trace.stitch import ids

from capture_helpers import Collect, live_capture, tiny  # noqa: E402


def run(steps: int = 3, every: int = 1, exporters=None, **cfg) -> tuple[CaptureSession, Collect]:
    sink = Collect()
    config = CaptureConfig(every=every, peak_tflops=0.05, job_id="test-job", environ={}, **cfg)
    session = CaptureSession(config, exporters=exporters if exporters is not None else [("memory", sink)]).start()
    try:
        model, opt, data = tiny.build(dim=32, layers=2, heads=2, vocab=64, seq=8, batch=2)
        for _ in range(steps):
            tiny.train_step(model, opt, data)
    finally:
        session.close(timeout=30)
    return session, sink


@pytest.fixture(scope="module")
def traced() -> tuple[CaptureSession, list[dict]]:
    # full depth: step 0 (every 3rd, opened at its first module call), step 1 (the first step opened at a
    # boundary: its signature is not step 0's, never measured) and step 3 (every 3rd); step 2 carries step 1's
    session, sink = run(steps=4, every=3)
    return session, sink.rows()


def test_one_trace_per_optimizer_step_with_deterministic_ids(traced):
    session, rows = traced
    steps = [r for r in rows if r["plasmient.level"] == "step"]
    assert sorted(r["plasmient.step"] for r in steps) == [0, 1, 2, 3]
    assert [r["name"] for r in sorted(steps, key=lambda r: r["plasmient.step"])] == [f"optimizer.step#{i}" for i in range(4)]
    for r in rows:
        assert r["trace_id"] == ids.trace_id("test-job", r["plasmient.step"])
    assert session.stats["steps"] == 4 and session.stats["steps_dropped"] == 0 and not session.failed


def test_every_nth_step_is_full_depth_the_others_step_level(traced):
    _, rows = traced
    depth = {r["plasmient.step"]: r["plasmient.sampled_depth"] for r in rows if r["plasmient.level"] == "step"}
    # every 3rd step, and step 1 for its new signature (step 0 opened at its first module call: its own)
    assert depth == {0: "full", 1: "full", 2: "step", 3: "full"}
    assert {r["plasmient.step"]: r["plasmient.step.opened_at"] for r in rows if r["plasmient.level"] == "step"} == \
        {0: "first_module_call", 1: "boundary", 2: "boundary", 3: "boundary"}
    levels = {s: {r["plasmient.level"] for r in rows if r["plasmient.step"] == s} for s in depth}
    assert levels[2] == {"fleet", "node", "rank", "step"}
    assert {"module", "op", "kernel"} - levels[0] == {"kernel"}  # CPU: the leaf ops are the device's kernels


def _parents(rows: list[dict], step: int) -> tuple[dict, dict]:
    rows = [r for r in rows if r["plasmient.step"] == step]
    return {r["span_id"]: r for r in rows}, rows


def _module_of(span: dict, by_id: dict) -> str | None:
    cur = span
    while cur is not None and cur["plasmient.level"] not in ("module", "step"):
        cur = by_id.get(cur["parent_span_id"])
    return cur["name"] if cur is not None and cur["plasmient.level"] == "module" else None


def test_module_spans_are_named_by_path_and_hold_their_ops(traced):
    _, rows = traced
    by_id, rows0 = _parents(rows, 0)
    modules = {r["name"] for r in rows0 if r["plasmient.level"] == "module" and r["plasmient.module.phase"] == "forward"}
    expected = {"TinyLM", "TinyLM.embed", "TinyLM.norm", "TinyLM.head"} | {
        f"TinyLM.layers.{i}.{p}" for i in range(2) for p in ("norm1", "attn", "norm2", "mlp", "mlp.0", "mlp.1", "mlp.2")}
    assert expected <= modules
    for r in rows0:
        if r["plasmient.level"] == "module":
            assert r["plasmient.module.path"] == r["name"].removesuffix(" [backward]")
    # nesting follows the model: mlp.0 sits in mlp, which sits in layers.1, in TinyLM
    mlp0 = next(r for r in rows0 if r["name"] == "TinyLM.layers.1.mlp.0")
    chain = []
    cur = by_id[mlp0["parent_span_id"]]
    while cur["plasmient.level"] == "module":
        chain.append(cur["name"])
        cur = by_id[cur["parent_span_id"]]
    assert chain == ["TinyLM.layers.1.mlp", "TinyLM.layers.1", "TinyLM"]
    ops_in_linear = {r["name"] for r in rows0 if r["plasmient.level"] == "op" and by_id[r["parent_span_id"]]["name"] == "TinyLM.layers.1.mlp.0"}
    assert ops_in_linear & {"aten::addmm", "aten::mm", "aten::linear"}
    gelu = [r for r in rows0 if r["plasmient.level"] == "op" and r["name"] == "aten::gelu"]
    assert gelu and all(_module_of(r, by_id) == "TinyLM.layers.0.mlp.1" or _module_of(r, by_id) == "TinyLM.layers.1.mlp.1" for r in gelu)


def test_op_spans_carry_shapes_dtypes_thread_and_sequence_numbers(traced):
    _, rows = traced
    addmm = [r for r in rows if r["plasmient.level"] == "op" and r["name"] == "aten::addmm"]
    assert addmm
    r = addmm[0]
    assert r["plasmient.op.input_types"].startswith('["float"')
    assert r["plasmient.op.input_dims"].count("[") >= 4
    assert r["thread.id"] == threading.get_native_id()
    assert r["plasmient.op.sequence_number"] is not None
    assert r["plasmient.op.flops_model"] == "gemm" and r["plasmient.op.model_flops"] > 0


def test_backward_ops_land_under_the_backward_span_of_their_forward_module(traced):
    _, rows = traced
    by_id, rows0 = _parents(rows, 0)
    gelu_bwd = [r for r in rows0 if r["plasmient.level"] == "op" and r["name"] == "aten::gelu_backward"]
    assert gelu_bwd
    assert {_module_of(r, by_id) for r in gelu_bwd} == {"TinyLM.layers.0.mlp.1 [backward]", "TinyLM.layers.1.mlp.1 [backward]"}
    emb_bwd = [r for r in rows0 if r["plasmient.level"] == "op" and r["name"].startswith("aten::embedding_dense_backward")]
    assert emb_bwd and {_module_of(r, by_id) for r in emb_bwd} == {"TinyLM.embed [backward]"}


def test_metrics_on_every_span_and_mfu_on_every_full_depth_span(traced):
    _, rows = traced
    for r in rows:
        assert r["plasmient.wall_s"] is not None and r["plasmient.device.type"] == "cpu"
        assert r["plasmient.cost.usd"] is None or r["plasmient.cost.usd"] >= 0
        if r["plasmient.step"] != 2 and r["plasmient.level"] != "kernel":
            if r["plasmient.device.window_s"] is None:
                # ran no device work of its own (an alias inside addmm, a view): no device metrics at all
                assert r["plasmient.level"] in ("op", "module") and r["plasmient.mfu"] is None and r["plasmient.flops"] is None
            elif r["plasmient.flops.coverage"]:
                assert r["plasmient.util.resident"] is not None, r["name"]
                # known FLOPs of zero beside unknown work (an op's own time, ownership.own_time_gaps) bound MFU
                # by nothing: absent, not 0, and so are the FLOPs
                measured = (r["plasmient.flops"] or 0) > 0 or r["plasmient.flops.coverage"] >= FULL_COVERAGE
                assert (r["plasmient.mfu"] is not None) == measured, r["name"]
                assert (r["plasmient.flops"] is not None) == measured, r["name"]
    shallow = next(r for r in rows if r["plasmient.step"] == 2 and r["plasmient.level"] == "step")
    # a step-level step ran without op hooks: its busy time is unknown, not zero; its FLOPs are carried from
    # step 1 (same input shapes, opened at a boundary), and its MFU is those FLOPs over its own window
    assert shallow["plasmient.busy_s"] is None and shallow["plasmient.flops.source"] == "carried"
    assert shallow["plasmient.flops"] > 0 and shallow["plasmient.mfu"] > 0
    full = next(r for r in rows if r["plasmient.step"] == 0 and r["plasmient.level"] == "step")
    assert 0 < full["plasmient.mfu"] and full["plasmient.flops"] > 0


def _explicit_steps(job: str, loop) -> list[dict]:
    """The span rows of ``loop(session, model)`` run under no_grad in a fresh every-step session."""
    sink = Collect()
    session = CaptureSession(CaptureConfig(every=1, peak_tflops=0.05, job_id=job, environ={}),
                             exporters=[("memory", sink)]).start()
    try:
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU())
        with torch.no_grad():
            loop(session, model)
    finally:
        session.close(timeout=30)
    return sink.rows()


def _step_names(rows: list[dict]) -> list[tuple[int, str]]:
    return sorted((r["plasmient.step"], r["name"]) for r in rows if r["plasmient.level"] == "step")


def test_explicit_step_context_for_inference_loops():
    def loop(session, model):
        model(torch.randn(2, 16))           # outside any explicit step: not traced
        for _ in range(2):
            with session.step():
                model(torch.randn(2, 16))

    rows = _explicit_steps("infer", loop)
    assert _step_names(rows) == [(0, "step#0"), (1, "step#1")]
    assert {r["name"] for r in rows if r["plasmient.level"] == "module"} == {"Sequential", "Sequential.0", "Sequential.1"}


def test_a_step_context_inside_another_is_part_of_it():
    # a library that marks its own steps, called inside the user's: one step per outer iteration, holding
    # the ops of both (it used to cut an empty step#N with FLOPs 0 before each inner one)
    def loop(session, model):
        for _ in range(3):
            with session.step():
                model(torch.randn(2, 16))
                with session.step():
                    with session.step():
                        model(torch.randn(2, 16))

    rows = _explicit_steps("nested", loop)
    assert _step_names(rows) == [(0, "step#0"), (1, "step#1"), (2, "step#2")]
    calls = Counter(r["plasmient.step"] for r in rows if r["plasmient.level"] == "module" and r["name"] == "Sequential")
    assert calls == {0: 2, 1: 2, 2: 2}


def test_the_captures_own_setup_and_step_end_work_are_not_charged_to_the_jobs_steps():
    """Starting CUPTI and NVML at the first step (on an H200 the first captured step took 0.21-0.29 s, where
    torch.profiler's took 6-21 ms) and each step end's flush are the capture's time: step spans hold the
    job's time only."""
    sink = Collect()
    session = CaptureSession(CaptureConfig(every=1, peak_tflops=0.05, job_id="setup", environ={}),
                             exporters=[("memory", sink)]).start()
    detect, end = session._detect_devices, session._end

    def slow_detect():
        time.sleep(0.5)
        detect()

    def slow_end(now):
        end(now)
        time.sleep(0.5)

    session._detect_devices, session._end = slow_detect, slow_end
    try:
        model = torch.nn.Linear(16, 16)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            model(torch.randn(2, 16)).sum().backward()
            opt.step()
    finally:
        session.close(timeout=30)
    walls = [r["plasmient.wall_s"] for r in sorted(sink.rows(), key=lambda r: r["plasmient.step"])
             if r["plasmient.level"] == "step"]
    assert len(walls) == 3 and max(walls) < 0.4


def test_profiler_step_calls_are_step_boundaries_and_coexist_with_torch_profiler():
    sink = Collect()
    session = CaptureSession(CaptureConfig(every=1, peak_tflops=0.05, job_id="prof", environ={}),
                             exporters=[("memory", sink)]).start()
    try:
        model = torch.nn.Linear(8, 8)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                model(torch.randn(4, 8)).sum().backward()
                prof.step()
        user_events = prof.key_averages()
    finally:
        session.close(timeout=30)
    names = sorted(r["name"] for r in sink.rows() if r["plasmient.level"] == "step")
    assert names == ["ProfilerStep#0", "ProfilerStep#1", "ProfilerStep#2"]
    assert any(e.key == "aten::addmm" for e in user_events)  # the user's profiler still saw everything


def test_a_failing_exporter_is_reported_once_and_the_job_continues(capsys):
    calls = []

    def broken(batch):
        calls.append(len(batch))
        raise ConnectionRefusedError("collector down")

    session, _ = run(steps=3, every=1, exporters=[("collector", broken)])
    err = capsys.readouterr().err
    assert calls and session.stats["export_errors"] == len(calls)
    assert err.count("export to collector failed") == 1


@contextlib.contextmanager
def held_exporter(job_id: str, **cfg):
    """A full-depth session whose exporter waits until released, and one small training step to run
    under it; yields (session, one_step, release, sink)."""
    release = threading.Event()
    sink = Collect()

    def held(batch):
        release.wait(60)
        sink(batch)

    config = CaptureConfig(every=1, peak_tflops=0.05, job_id=job_id, environ={}, **cfg)
    session = CaptureSession(config, exporters=[("held", held)]).start()
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def one_step():
        model(torch.randn(4, 8)).sum().backward()
        opt.step()

    try:
        yield session, one_step, release, sink
    finally:
        release.set()
        session.close(timeout=30)


def test_a_blocked_exporter_never_blocks_a_step():
    with held_exporter("stuck", queue_steps=2, queue_step_depth_steps=2) as (session, one_step, _, sink):
        one_step()
        assert not session.flush(0.5)  # the worker is now stuck inside the exporter
        for _ in range(8):
            one_step()
        # All 9 steps returned although the exporter never did: the full queue dropped steps instead. Step 1
        # waits at full depth; the backlog puts later ones off to step depth, of which two may wait.
        assert session.stats["steps"] == 9 and session.stats["steps_dropped"] == 8 - 3
    assert sorted(r["plasmient.step"] for r in sink.rows() if r["plasmient.level"] == "step") == [0, 1, 2, 3]


@pytest.mark.parametrize("every", [1, 10**9])
def test_a_batch_holds_many_step_depth_steps_but_few_full_ones(every):
    """Steps that waited while the exporter was busy go out together: step-depth steps (a step span and
    its kernels) up to max_batch_steps at once, which spreads the batch's fixed cost over more of them;
    full-depth ones (every op) at most max_batch_full_steps at once, which bounds the worker's memory."""
    release = threading.Event()
    sink = Collect()

    def held(batch):
        release.wait(60)
        sink(batch)

    config = CaptureConfig(every=every, peak_tflops=0.05, job_id="batches", environ={}, max_batch_full_steps=3)
    session = CaptureSession(config, exporters=[("held", held)]).start()
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for _ in range(13):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            if session.stats["steps"] == 1:
                assert not session.flush(0.5)  # step 0 is inside the exporter; the rest wait in the queue
        release.set()
        assert session.flush(30)
    finally:
        release.set()
        session.close(timeout=30)
    per_batch = [sum(1 for r in b.table.to_pylist() if r["plasmient.level"] == "step") for b in sink.batches]
    assert sum(per_batch) == 13 and session.stats["steps_deferred"] == 0
    assert per_batch == ([1, 3, 3, 3, 3] if every == 1 else [1, 12])


def test_a_worker_that_falls_behind_defers_full_depth_instead_of_dropping_steps(capsys, monkeypatch):
    """PLASMIENT_EVERY=1 on a job faster than its stitch: once half the queue waits, steps due at full
    depth run at step depth (carrying FLOPs) and the first step after the backlog clears is full again."""
    from plasmient_trace.capture import config as config_mod

    monkeypatch.setattr(config_mod, "_said", set())  # said once per process: earlier tests may have said it
    with held_exporter("behind", queue_steps=8, max_batch_steps=1) as (session, one_step, release, sink):
        one_step()
        assert not session.flush(0.5)  # step 0 is inside the exporter; later steps wait in the queue
        for _ in range(7):
            one_step()
        # Steps 1-4 began with 0-3 steps waiting; steps 5-7 found 4 (half the queue) and were put off.
        assert session.stats["steps_deferred"] >= 3 and session.stats["steps_dropped"] == 0
        release.set()
        assert session.flush(30)
        one_step()  # step 8 began while the backlog still stood; step 9 is owed full depth
        one_step()
    depth = {r["plasmient.step"]: (r["plasmient.sampled_depth"], r["plasmient.flops.source"])
             for r in sink.rows() if r["plasmient.level"] == "step"}
    assert sorted(depth) == list(range(10))  # every step exported
    assert all(depth[s] == ("full", "measured") for s in range(5))
    assert all(depth[s] == ("step", "carried") for s in (5, 6, 7))  # same shapes: the full steps' FLOPs
    assert depth[9] == ("full", "measured")
    assert "ran at step depth: the background stitch fell behind" in capsys.readouterr().err


def test_a_broken_hook_never_changes_what_the_op_returns(monkeypatch, capsys):
    def losses(session: CaptureSession | None) -> list[float]:
        model, opt, data = tiny.build(dim=32, layers=2, heads=2, vocab=64, seq=8, batch=2)
        try:
            return [tiny.train_step(model, opt, data) for _ in range(2)]
        finally:
            if session is not None:
                session.close(timeout=30)

    untraced = losses(None)

    def boom(values):
        raise RuntimeError("bookkeeping bug")

    monkeypatch.setattr(torch_hooks, "_meta", boom)
    session = CaptureSession(CaptureConfig(every=1, peak_tflops=0.05, job_id="boom", op_hook="dispatch", environ={}),
                             exporters=[("memory", Collect())]).start()
    assert losses(session) == untraced
    assert capsys.readouterr().err.count("torch hook failed") == 1
    assert session.stats["steps"] == 2


def test_low_mfu_step_triggers_full_depth_on_a_later_step():
    # MFU can never reach 2.0, so every step-level step looks slow: the next one is captured fully.
    sink = Collect()
    config = CaptureConfig(every=1000, peak_tflops=0.05, job_id="thr", environ={}, mfu_threshold=2.0)
    session = CaptureSession(config, exporters=[("memory", sink)]).start()
    try:
        model, opt, data = tiny.build(dim=32, layers=1, heads=2, vocab=64, seq=8, batch=2)
        for _ in range(5):
            tiny.train_step(model, opt, data)
            session.flush(30)  # let the worker judge each step before the next begins
    finally:
        session.close(timeout=30)
    depth = {r["plasmient.step"]: r["plasmient.sampled_depth"] for r in sink.rows() if r["plasmient.level"] == "step"}
    # step 1 is full for its signature (step 0, opened at its first module call, has its own): step 2 is the
    # first step-level step, and the one or two after it (opened before the worker judged it) go full
    assert depth[0] == "full" and depth[1] == "full" and depth[2] == "step"
    assert "full" in (depth[3], depth[4])


def test_hooks_are_removed_on_close():
    from torch.nn.modules import module as m
    from torch.optim import optimizer as o

    before = (len(m._global_forward_pre_hooks), len(m._global_forward_hooks), len(o._global_optimizer_post_hooks))
    prof_step = torch.profiler.profile.step
    run(steps=1)
    assert (len(m._global_forward_pre_hooks), len(m._global_forward_hooks), len(o._global_optimizer_post_hooks)) == before
    assert torch.profiler.profile.step is prof_step
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    assert _get_current_dispatch_mode() is None


def test_a_step_depth_cpu_step_carries_flops_but_not_busy_time(traced):
    """Step 2 ran without op hooks: on a CPU its ops are its kernels, so busy time and util are absent
    (not zero); its FLOPs are step 1's (same input shapes, both opened at a boundary), carried, not measured.
    Step 0, opened at its first module call, carries to no boundary step."""
    _, rows = traced
    steps = {r["plasmient.step"]: r for r in rows if r["plasmient.level"] == "step"}
    assert steps[2]["plasmient.flops.source"] == "carried" and steps[1]["plasmient.flops.source"] == "measured"
    assert steps[2]["plasmient.flops"] == steps[1]["plasmient.flops"] > 0
    assert steps[2]["plasmient.busy_s"] is None and steps[2]["plasmient.util.resident"] is None
    assert steps[1]["plasmient.busy_s"] > 0 and steps[1]["plasmient.util.resident"] > 0


def test_nvml_samples_are_averaged_over_each_step_window():
    from plasmient_trace.pipeline import IngestOptions, stitch_records
    from plasmient_trace.records import RecordSet

    # NVML's utilization is a share of the past sample period (up to 1 s): a reading counts for a step only
    # once that period lies inside it. GPM samples cover the 20 ms since the previous one.
    s = 10**9
    rs = RecordSet(source="live:cupti",
                   steps=table_from_columns("steps", {"step": [0, 1, 2], "start_ns": [0, 3 * s, 3 * s + s // 10],
                                                      "end_ns": [3 * s, 3 * s + s // 10, 4 * s], "name": ["s0", "s1", "s2"]}),
                   samples=table_from_columns("samples", {
                       "timestamp_ns": [s // 2, 3 * s // 2, 5 * s // 2, 3 * s + s // 20, 3 * s + s // 20],
                       "device": [0] * 5,
                       "metric": ["nvml.utilization.gpu"] * 4 + ["gpm.sm_active"],
                       "value": [0.9, 1.0, 0.5, 0.2, 0.3]}))
    rows = stitch_records([rs], IngestOptions(job_id="nvml", full_depth_steps=set())).batch.table.to_pylist()
    steps = {r["plasmient.step"]: r for r in rows if r["plasmient.level"] == "step"}
    # step 0: the readings at 1.5 s and 2.5 s (the one at 0.5 s reaches back before the step began);
    # step 1 (100 ms) holds no whole NVML period; step 2 has no sample
    assert [steps[n]["plasmient.util.nvml"] for n in (0, 1, 2)] == [pytest.approx(0.75), None, None]
    assert [steps[n]["plasmient.gpm.sm_active"] for n in (0, 1, 2)] == [None, pytest.approx(0.3), None]
    assert all(r["plasmient.util.nvml"] is None for r in rows if r["plasmient.level"] != "step")


def test_resource_comes_from_the_environment():
    env = {"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attrs,team=ml", "RANK": "0", "WORLD_SIZE": "1",
           "SLURM_JOB_ID": "77"}
    sink = Collect()
    session = CaptureSession(CaptureConfig.from_env(env, peak_tflops=0.05), exporters=[("memory", sink)]).start()
    try:
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    finally:
        session.close(timeout=30)
    rank_res = sink.batches[0].resources[-1]
    assert rank_res["service.name"] == "from-attrs" and rank_res["team"] == "ml"
    assert rank_res["plasmient.job.id"] == "77" and rank_res["plasmient.slurm.job_id"] == "77"
    assert rank_res["plasmient.rank"] == 0 and rank_res["plasmient.source"] == "live:cpu"
    assert {r["plasmient.job.id"] for r in sink.rows()} == {"77"}


def test_sink_choice_follows_the_otel_variables(tmp_path):
    from plasmient_trace.capture.session import build_delivery

    def kinds(env, **cfg):
        d = build_delivery(CaptureConfig.from_env(env, **cfg), {})
        return [type(s).__name__ for s in d.local] + [f"{type(s).__name__}:{s.signal}" for s in d.remote]

    assert kinds({}) == ["FileSink"]  # the embedded default: no server needed
    assert build_delivery(CaptureConfig.from_env({}), {"plasmient.world_size": 4, "plasmient.rank": 3}).local[0].name.endswith("traces.rank3.jsonl")
    otlp = ["OtlpSink:traces", "OtlpSink:metrics"]  # live runs send the step metrics too, as ingest does
    assert kinds({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}) == otlp
    assert kinds({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_METRICS_EXPORTER": "none"}) == otlp[:1]
    assert kinds({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "PLASMIENT_OUT": str(tmp_path / "t.jsonl")}) == ["FileSink"] + otlp
    assert kinds({"OTEL_TRACES_EXPORTER": "otlp"}) == otlp  # the spec's default endpoint
    assert kinds({"OTEL_TRACES_EXPORTER": "console"}) == ["ConsoleSink"]
    assert kinds({"OTEL_TRACES_EXPORTER": "none"}) == []
    spill = build_delivery(CaptureConfig.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317",
                                                   "PLASMIENT_OUT": str(tmp_path / "t.jsonl")}), {}).spill
    assert spill.path == tmp_path / "plasmient-spill"  # documented: beside the output file


def test_rank_in_the_out_path_gives_each_rank_its_own_file_and_spill(tmp_path):
    # NFS does not keep O_APPEND writes from several machines apart: PLASMIENT_OUT=.../traces.rank{rank}.jsonl
    from plasmient_trace.capture.session import build_delivery

    env = {"PLASMIENT_OUT": str(tmp_path / "r{rank}" / "traces.rank{rank}.jsonl"),
           "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}
    d = build_delivery(CaptureConfig.from_env(env), {"plasmient.world_size": 4, "plasmient.rank": 3})
    assert d.local[0].name == str(tmp_path / "r3" / "traces.rank3.jsonl")
    assert d.spill.path == tmp_path / "r3" / "plasmient-spill"
    # a process with no rank is rank 0, as torch.distributed numbers a lone process
    assert build_delivery(CaptureConfig.from_env(env), {}).local[0].name == str(tmp_path / "r0" / "traces.rank0.jsonl")


def test_config_reads_the_documented_variables_and_ignores_garbage(capsys):
    cfg = CaptureConfig.from_env({"PLASMIENT_EVERY": "5", "PLASMIENT_MFU_THRESHOLD": "0.2", "PLASMIENT_PEAK_TFLOPS": "312",
                                  "PLASMIENT_GPU_PRICE": "2.5", "PLASMIENT_JOB_ID": "j", "OTEL_SERVICE_NAME": "svc",
                                  "PLASMIENT_OUT": "o.jsonl", "PLASMIENT_CUPTI": "0"})
    assert (cfg.every, cfg.mfu_threshold, cfg.peak_tflops, cfg.gpu_price, cfg.job_id, cfg.service_name, cfg.out, cfg.cupti) == \
        (5, 0.2, 312.0, 2.5, "j", "svc", "o.jsonl", False)
    bad = CaptureConfig.from_env({"PLASMIENT_EVERY": "often", "PLASMIENT_PEAK_TFLOPS": "fast"})
    assert bad.every == 10 and bad.peak_tflops is None
    err = capsys.readouterr().err
    assert "PLASMIENT_EVERY" in err and "PLASMIENT_PEAK_TFLOPS" in err


def test_non_finite_or_absurd_numbers_in_the_environment_are_said_and_ignored(capsys, monkeypatch):
    """inf would make a flush wait forever and a peak of 1e308 TFLOP/s read every MFU as 0; an MFU threshold
    of 5 would force every step to full depth. Each is said once and taken as unset."""
    from plasmient_trace.capture import config as config_mod
    from plasmient_trace.capture.distributed import DEFAULT_WAIT_S, wait_s

    monkeypatch.setattr(config_mod, "_said", set())
    cfg = CaptureConfig.from_env({"PLASMIENT_PEAK_TFLOPS": "1e308", "PLASMIENT_GPU_PRICE": "inf",
                                  "PLASMIENT_FLUSH_TIMEOUT_S": "nan", "PLASMIENT_MFU_THRESHOLD": "5",
                                  "PLASMIENT_EXPORT_INTERVAL_S": "-1"})
    assert (cfg.peak_tflops, cfg.gpu_price, cfg.flush_timeout_s, cfg.mfu_threshold, cfg.export_interval_s) == \
        (None, None, 5.0, None, 2.0)
    err = capsys.readouterr().err.splitlines()
    said = {name for name in ("PEAK_TFLOPS", "GPU_PRICE", "FLUSH_TIMEOUT_S", "MFU_THRESHOLD", "EXPORT_INTERVAL_S")
            if any(f"PLASMIENT_{name}=" in line for line in err)}
    assert said == {"PEAK_TFLOPS", "GPU_PRICE", "FLUSH_TIMEOUT_S", "MFU_THRESHOLD", "EXPORT_INTERVAL_S"}
    assert len(err) == 5
    assert [wait_s({"PLASMIENT_FLEET_WAIT_S": v}) for v in ("inf", "nan", "-3", "2.5")] == \
        [DEFAULT_WAIT_S, DEFAULT_WAIT_S, DEFAULT_WAIT_S, 2.5]


def test_two_optimizers_stepping_each_iteration_make_one_step_per_iteration():
    sink = Collect()
    session = CaptureSession(CaptureConfig(every=1, peak_tflops=0.05, job_id="gan", environ={}),
                             exporters=[("memory", sink)]).start()
    try:
        g, d = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
        opt_g, opt_d = torch.optim.SGD(g.parameters(), lr=0.1), torch.optim.SGD(d.parameters(), lr=0.1)
        for _ in range(3):
            d(g(torch.randn(2, 4))).sum().backward()
            opt_d.step()
            opt_g.step()
    finally:
        session.close(timeout=30)
    assert sorted(r["plasmient.step"] for r in sink.rows() if r["plasmient.level"] == "step") == [0, 1, 2]


def test_nvml_sampler_fails_soft_without_a_driver_and_cuts_samples_per_window():
    from plasmient_trace.capture.nvml import UTIL_METRIC, NvmlSampler

    sampler = NvmlSampler([0])
    if not torch.cuda.is_available():
        assert sampler.start() is False and "NVML unavailable" in sampler.reason
    sampler.stop()
    for ts in (10, 20, 30, 40):
        sampler.samples.append((ts, 0, UTIL_METRIC, ts / 100))
    window = sampler.take(15, 30)
    assert window.column("timestamp_ns").to_pylist() == [20, 30]
    assert window.column("value").to_pylist() == [0.2, 0.3]
    assert [s[0] for s in sampler.samples] == [20, 30, 40]  # older than the window: discarded


class FakeCupti:
    """Stands in for CuptiCollector on a machine without a GPU: every op the hooks bracket with
    push/pop 'launches' one kernel, recorded the way CUPTI would (launch on the op's thread inside
    the op, kernel after it, an EXTERNAL_CORRELATION record tying the two to the op's id)."""

    def __init__(self, epoch: int) -> None:
        from plasmient_trace.capture import cupti as cu

        self.cu = cu
        self.available = True
        self.epoch_offset_ns = epoch
        self.records: list = []
        self.stack: list[tuple[int, int]] = []
        self.corr = 0
        self.flushes = 0
        self.drop_reads = 0
        self.api_recorded = True
        self.api_changes: list[bool] = []
        self.running: list = []   # kernels launched since the last flush that will still run at the next
        self.finishing: list = []  # kernels that were running at the last flush: delivered by the next one

    def record_api(self, on: bool) -> bool:
        """As CUPTI with its runtime/driver/external-correlation kinds disabled: kernels only."""
        if on != self.api_recorded:
            self.api_changes.append(on)
        self.api_recorded = on
        return True

    def push(self, eid: int) -> None:
        self.stack.append((eid, torch_hooks.perf_counter_ns()))

    def pop(self) -> None:
        eid, t_push = self.stack.pop()
        t_pop = torch_hooks.perf_counter_ns()
        mid = (t_push + t_pop) // 2
        k_start, k_end = self.kernel_interval(t_pop)
        self.launch(mid, k_start, k_end, f"kernel_{eid}", eid)

    def launch(self, t_launch: int, k_start: int, k_end: int, name: str, eid: int | None = None,
               running: bool = False) -> None:
        """A launch and its kernel; with ``running``, the kernel is still running at the next flush (its
        launch is delivered then, the kernel by the flush after, timed at that flush)."""
        from types import SimpleNamespace as Rec

        cu = self.cu
        self.corr += 1
        kernel = Rec(kind=cu.KIND_CONCURRENT_KERNEL, name=name, device_id=0, stream_id=7, start=k_start,
                     end=k_end, correlation_id=self.corr, grid_x=1, grid_y=1, grid_z=1, block_x=128, block_y=1,
                     block_z=1, registers_per_thread=32, static_shared_memory=0, dynamic_shared_memory=0, graph_id=0)
        (self.running if running else self.records).append(kernel)
        if not self.api_recorded:
            return
        self.records.append(Rec(kind=cu.KIND_RUNTIME, cbid=211, process_id=1, thread_id=threading.get_native_id(),
                                start=t_launch, end=t_launch + 1, correlation_id=self.corr))
        if eid is not None:
            self.records.append(Rec(kind=cu.KIND_EXTERNAL_CORRELATION, external_kind=cu.EXTERNAL_KIND_CUSTOM0,
                                    external_id=eid, correlation_id=self.corr))

    def kernel_interval(self, t_pop: int) -> tuple[int, int]:
        """When the op's kernel runs: right after the op, for 2 µs (a device that keeps up)."""
        return t_pop + 1_000, t_pop + 3_000

    def native_correlation(self) -> tuple[int, int]:
        """C entry points shaped like cuptiActivityPush/PopExternalCorrelationId, for the native
        observer to call (ctypes takes the GIL around them): the same bookkeeping as push/pop."""
        push_t = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_uint64)
        pop_t = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_uint64))

        def push(kind, eid):
            assert kind == self.cu.EXTERNAL_KIND_CUSTOM0
            self.push(int(eid))
            return 0

        def pop(kind, out):
            out[0] = self.stack[-1][0]
            self.pop()
            return 0

        self._c_callbacks = (push_t(push), pop_t(pop))  # kept alive as long as the observer may call them
        return tuple(ctypes.cast(f, ctypes.c_void_p).value for f in self._c_callbacks)

    def flush(self):
        from cupti_buffers import pack

        self.flushes += 1
        now = torch_hooks.perf_counter_ns()
        for kernel in self.finishing:
            kernel.start, kernel.end = now, now + 1_000
        records, self.records = self.records + self.finishing, []
        self.finishing, self.running = self.running, []
        return pack(records)

    def dropped(self) -> int:
        self.drop_reads += 1
        return 10 * self.drop_reads  # dropped records: 10, 20, ... per step

    def stop(self) -> None:
        self.available = False


def _on_a_stand_in_gpu(monkeypatch, session: CaptureSession, cupti_class: type) -> None:
    """The session finds an H100 whose CUPTI is ``cupti_class`` and whose NVML reads 97% every ms."""
    from plasmient_trace.capture import nvml as nvml_mod
    from plasmient_trace.records import DeviceInfo

    def detect(sources=session.sources):
        sources.devices_pending = False
        sources.on_gpu = True
        sources.devices = [DeviceInfo(ordinal=0, name="NVIDIA H100 80GB HBM3",
                                      properties={"name": "NVIDIA H100 80GB HBM3", "totalGlobalMem": 85_000_000_000})]
        sources.cupti = cupti_class(session._epoch)
        sources.correlate()
        sampler = nvml_mod.NvmlSampler([0])
        # a sample every ms from 1 s before now: every step window holds some, however the load stretches it
        now = session._epoch + torch_hooks.perf_counter_ns()
        sampler.samples.extend((t, 0, nvml_mod.UTIL_METRIC, 0.97) for t in range(now - 10**9, now + 60 * 10**9, 10**6))
        sources.nvml = sampler

    monkeypatch.setattr(session.sources, "detect_devices", detect)


def _train_a_small_mlp(session: CaptureSession, steps: int, after_step=lambda: None, before_step=lambda: None) -> None:
    """Start the session, train a 3-layer MLP with SGD for ``steps`` steps, close the session."""
    session.start()
    try:
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(steps):
            model(torch.randn(8, 16)).sum().backward()
            before_step()
            opt.step()
            after_step()
    finally:
        session.close(timeout=30)


def _stand_in_gpu_session(monkeypatch, every: int, api: str) -> tuple[CaptureSession, Collect]:
    """A session on a stand-in GPU (FakeCupti) with PLASMIENT_EVERY and PLASMIENT_CUPTI_API, and its sink."""
    sink = Collect()
    env = {"PLASMIENT_EVERY": str(every), **({"PLASMIENT_CUPTI_API": "always"} if api == "always" else {})}
    session = CaptureSession(CaptureConfig.from_env(env, job_id="gpu", op_hook="dispatch"), exporters=[("memory", sink)])
    _on_a_stand_in_gpu(monkeypatch, session, FakeCupti)
    return session, sink


def _launch_now(session: CaptureSession, name: str, duration_ns: int, running: bool = False) -> None:
    """A kernel no op bracketed, launched now, running from 1 µs later for ``duration_ns`` (``running``:
    FakeCupti.launch's)."""
    now = torch_hooks.perf_counter_ns()
    session.sources.cupti.launch(now, now + 1_000, now + 1_000 + duration_ns, name, running=running)


@pytest.mark.parametrize("api", ["full", "always"])
def test_host_api_calls_are_recorded_on_full_depth_steps_only(monkeypatch, api):
    """CUPTI's runtime/driver/external-correlation records (thousands per step, nearly all launching
    nothing) serve the kernel -> op join of full-depth steps. Step-depth steps record kernels only: their
    busy and idle time stay measured, their idle split and launch queue are unknown (absent), and full
    steps after them still join every kernel. PLASMIENT_CUPTI_API=always records launches on every step."""
    session, sink = _stand_in_gpu_session(monkeypatch, every=3, api=api)
    _train_a_small_mlp(session, 7, before_step=lambda: _launch_now(session, "step_kernel", 49_000))
    steps = {r["plasmient.step"]: r for r in sink.rows() if r["plasmient.level"] == "step"}
    assert sorted(steps) == list(range(7))
    full = {n for n, r in steps.items() if r["plasmient.sampled_depth"] == "full"}
    assert full == {0, 1, 3, 6}  # every 3rd, and step 1: the first opened at a boundary, a new signature
    for n, step in steps.items():
        assert step["plasmient.kernels"] >= 1 and step["plasmient.busy_s"] > 0 and step["plasmient.idle_s"] >= 0
        split_known = n in full or api == "always"
        assert (step["plasmient.idle.device_s"] is not None) == split_known, n
        assert (step["plasmient.launch_queue.max"] is not None) == split_known, n
        if n in full:
            assert step["plasmient.unjoined_kernels"] == 1  # the step_kernel, no op around it
    # off at step 1's start, on at its first module call (a new signature), off at 2, on at 3, off at 4, on
    # at 6, off at 7 (opened, never ended)
    assert session.sources.cupti.api_changes == ([] if api == "always" else [False, True, False, True, False, True, False])


@pytest.mark.parametrize("api", ["full", "always"])
def test_records_of_the_step_open_at_a_flush_reach_that_step_in_the_next_batch(monkeypatch, api):
    """The worker flushes CUPTI once per batch, while the job has already begun the next step: what that
    step recorded so far (kernels, and their launches where recorded) waits for the next batch instead of
    falling outside every step of this one."""
    session, sink = _stand_in_gpu_session(monkeypatch, every=1000, api=api)

    def after_step():  # opt.step() ended a step and opened the next: that one's first work, then a batch
        _launch_now(session, "early_kernel", 199_000)
        session.flush(30)  # one batch per step, each flushed with the next step's kernel in CUPTI

    _train_a_small_mlp(session, 5, after_step=after_step)
    steps = sorted((r for r in sink.rows() if r["plasmient.level"] == "step"), key=lambda r: r["plasmient.step"])
    # step 0 opened at the first forward (no early kernel); the step open at close is not a finished step
    assert [s["plasmient.step"] for s in steps] == list(range(5))
    assert [s["plasmient.kernels"] for s in steps[2:]] == [1] * 3
    assert all(s["plasmient.busy_s"] == pytest.approx(199e-6, abs=1e-9) for s in steps[2:])
    # step 1 went full at its first module call (the first step opened at a boundary: a new signature), so
    # its ops' kernels are beside its early one, which it holds as a span
    early = [r for r in sink.rows() if r["plasmient.level"] == "kernel" and r["name"] == "early_kernel"]
    assert [r["plasmient.step"] for r in early] == [1] and steps[1]["plasmient.kernels"] > 1


def test_a_kernel_still_running_at_the_flush_stays_with_the_step_that_launched_it(monkeypatch):
    """The worker may flush while a full-depth step's kernel, launched already, still runs: the launch
    arrives in this batch, the kernel in a later one, after that step has ended. The open step's API
    calls wait with it, so the kernel joins its launch and lands in the step that launched it, not in
    the one during which it ran."""
    session, sink = _stand_in_gpu_session(monkeypatch, every=1, api="full")

    def after_step():  # opt.step() opened a step: it launches a long kernel, then the worker flushes
        _launch_now(session, f"late_{session.step_index}", 0, running=True)
        session.flush(30)

    _train_a_small_mlp(session, 5, after_step=after_step)
    late = {r["name"]: r["plasmient.step"] for r in sink.rows()
            if r["plasmient.level"] == "kernel" and r["name"].startswith("late_")}
    # late_5 was launched in the step still open at close
    assert late == {f"late_{n}": n for n in (1, 2, 3, 4)}


class LaggingCupti(FakeCupti):
    """A device that falls behind the host: every kernel takes 300 µs and they run one after another, so
    a step's kernels are still running when the host has started the next step."""

    def __init__(self, epoch: int) -> None:
        super().__init__(epoch)
        self.free_at = 0

    def kernel_interval(self, t_pop: int) -> tuple[int, int]:
        start = max(t_pop + 1_000, self.free_at)
        self.free_at = start + 300_000
        return start, self.free_at


def test_live_batches_tile_the_device_timeline_as_one_stitch_would(monkeypatch):
    """Each step stitched in its own batch (a slow step outlasts the export interval): the first step of a
    batch opens its window where the previous batch's last step closed, not at its own CPU start, so the
    windows still tile and busy + idle add up to the device's elapsed time, though the device runs behind."""
    sink = Collect()
    session = CaptureSession(CaptureConfig(every=1, job_id="lag", op_hook="dispatch", environ={}, max_batch_steps=1),
                             exporters=[("memory", sink)])
    _on_a_stand_in_gpu(monkeypatch, session, LaggingCupti)
    _train_a_small_mlp(session, steps=4, after_step=lambda: session.flush(30))  # one batch per step
    steps = sorted((r for r in sink.rows() if r["plasmient.level"] == "step"), key=lambda r: r["plasmient.step"])
    assert [s["plasmient.step"] for s in steps] == [0, 1, 2, 3]
    windows = [(s["plasmient.device.start_ns"], s["plasmient.device.start_ns"] + round(s["plasmient.device.window_s"] * 1e9))
               for s in steps]
    kernels = [r for r in sink.rows() if r["plasmient.level"] == "kernel"]
    ends = {s["plasmient.step"]: max(k["end_ns"] for k in kernels if k["plasmient.step"] == s["plasmient.step"])
            for s in steps}
    for (step, (_, end)), (nxt, (start, _)) in zip(zip(steps, windows), zip(steps[1:], windows[1:])):
        assert end == ends[step["plasmient.step"]]  # a window closes with its step's last kernel
        assert start == end, (nxt["name"], start - end)  # and the next one opens there
    lagging = [nxt for step, nxt in zip(steps, steps[1:]) if ends[step["plasmient.step"]] > nxt["start_ns"]]
    assert lagging  # the device was still busy with a step when the host began the next one
    busy_idle = sum(s["plasmient.busy_s"] + s["plasmient.idle_s"] for s in steps)
    assert busy_idle == pytest.approx((windows[-1][1] - windows[0][0]) / 1e9, rel=1e-9)


@pytest.mark.parametrize("op_hook", ["native", "dispatch"])
def test_gpu_path_wiring_with_a_stand_in_cupti(monkeypatch, op_hook):
    """The session's GPU path end to end without a GPU: push/pop around every op (through C entry
    points for the native observer, through Python for the dispatch hook), buffers flushed at each
    step end, kernels joined to their ops through external correlation, dropped counts and NVML
    samples on the step spans (those long enough to hold an NVML sample period)."""
    import time

    sink = Collect()
    session = CaptureSession(CaptureConfig(every=1, job_id="gpu", op_hook=op_hook, environ={}),
                             exporters=[("memory", sink)])
    _on_a_stand_in_gpu(monkeypatch, session, FakeCupti)
    _train_a_small_mlp(session, steps=2, before_step=lambda: time.sleep(1.1) if session.step_index == 1 else None)
    rows = sink.rows()
    by_id = {r["span_id"]: r for r in rows}
    steps = {r["plasmient.step"]: r for r in rows if r["plasmient.level"] == "step"}
    assert sorted(steps) == [0, 1]
    assert [steps[s]["plasmient.cupti.dropped_records"] for s in (0, 1)] == [10, 20]
    assert all(s["plasmient.device.type"] == "gpu" and s["plasmient.unjoined_kernels"] == 0 for s in steps.values()), [(s["plasmient.device.type"], s["plasmient.unjoined_kernels"], s["plasmient.kernels"]) for s in steps.values()]
    # NVML read 97% all along; step 0 (a few ms) holds no whole NVML sample period (up to 1 s), step 1 does
    assert steps[0]["plasmient.util.nvml"] is None and steps[1]["plasmient.util.nvml"] == pytest.approx(0.97)
    kernels = [r for r in rows if r["plasmient.level"] == "kernel"]
    ops = [r for r in rows if r["plasmient.level"] == "op"]
    # one kernel per op that can launch one (shape-only ops get no correlation id), under exactly its op
    bracketed = [r for r in ops if r["name"] not in torch_hooks.SHAPE_ONLY_OPS] if op_hook == "native" else ops
    assert kernels and len(kernels) == len(bracketed)
    for k in kernels:
        op = by_id[k["parent_span_id"]]
        assert op["plasmient.level"] == "op" and k["name"] == f"kernel_{op['plasmient.op.external_id']}"
    addmm = next(r for r in ops if r["name"] == "aten::addmm")
    module = by_id[addmm["parent_span_id"]]
    while module["plasmient.level"] == "op":  # the native observer also sees aten::linear around it
        module = by_id[module["parent_span_id"]]
    assert module["name"] == "Sequential.0"
    assert isinstance(session.sources.ops, torch_hooks.NativeOpRecorder) == (op_hook == "native")
    assert addmm["plasmient.flops"] > 0 and addmm["plasmient.mfu"] is not None


def test_a_second_start_with_other_settings_says_they_are_ignored(tmp_path, capsys, monkeypatch):
    from plasmient_trace import capture
    from plasmient_trace.capture import config as capture_config

    monkeypatch.setattr(capture_config, "_said", set())  # say_once's memory: this process may have said it
    first = capture.start(CaptureConfig(out=str(tmp_path / "first.jsonl"), peak_tflops=0.05, environ={}))
    try:
        assert capture.start() is first and capsys.readouterr().err == ""  # no settings asked for: nothing to say
        again = capture.start(out=str(tmp_path / "second.jsonl"))
        assert again is first
        assert capsys.readouterr().err.splitlines() == [
            "plasmient-trace: start() while already tracing (started earlier, e.g. by PLASMIENT_TRACE=1 or plasmient "
            "run): its settings stay and these are ignored; stop() first"]
        model = torch.nn.Linear(4, 4)
        with capture.step():
            model(torch.randn(2, 4)).sum().backward()
    finally:
        capture.stop(timeout=30)
    assert (tmp_path / "first.jsonl").exists() and not (tmp_path / "second.jsonl").exists()


def test_uninstrument_undoes_instrument_and_patches_keep_wrapped():
    from plasmient_trace import capture
    from plasmient_trace.capture import autostart
    from plasmient_trace.capture_instrumentor import PlasmientInstrumentor

    original_step = torch.profiler.profile.step
    inst = PlasmientInstrumentor()
    inst.instrument(skip_dep_check=True)
    try:
        session = capture.current()
        assert session is not None  # torch is imported already: the capture started at once
        assert torch.profiler.profile.step.__wrapped__ is original_step
    finally:
        inst.uninstrument()
    assert capture.current() is None and torch.profiler.profile.step is original_step
    assert not any(type(f).__name__ == "_TorchWatcher" for f in sys.meta_path) and not autostart._installed


def test_after_uninstrument_torch_compile_does_not_warn_of_global_hooks_that_are_gone():
    """torch.compile(module) warns when global module hooks exist. Ours are gone after uninstrument, and so
    is the filter that hid that warning: a user's own global hook makes torch warn as it would untraced."""
    import warnings

    from plasmient_trace.capture_instrumentor import PlasmientInstrumentor

    filters_before = list(warnings.filters)
    inst = PlasmientInstrumentor()
    inst.instrument(skip_dep_check=True)
    inst.uninstrument()
    assert warnings.filters == filters_before
    compiled = torch.compile(torch.nn.Linear(4, 4), backend="eager")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        compiled(torch.randn(2, 4))
    assert [str(w.message) for w in seen if "global hooks" in str(w.message)] == []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *args: None)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            compiled(torch.randn(2, 4))
    finally:
        handle.remove()
    assert len([w for w in seen if "global hooks" in str(w.message)]) == 1


@pytest.mark.parametrize("batch_steps", [64, 1])
def test_every_full_step_groups_the_optimizer_under_its_optimizer_step_span(batch_steps):
    """torch's post hook runs inside its Optimizer.step#<cls>.step scope; the step ends after that scope
    closes, so every step (the first and the last included) has the span and AdamW's ops under it, also
    when each step is stitched on its own (batch_steps=1: a step's records never lean on the next's)."""
    from plasmient_trace.capture import native

    if native.load(build_if_missing=True) is None:
        pytest.skip(f"native observer unavailable: {native.failure()}")
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # torch hooks the class at its first instance
    original = torch.optim.AdamW.__dict__.get("step")
    session, sink = run(steps=4, every=1, op_hook="native", max_batch_steps=batch_steps)
    rows = sink.rows()
    by_id = {r["span_id"]: r for r in rows}
    for step in range(4):
        in_step = [r for r in rows if r["plasmient.step"] == step]
        scopes = [r for r in in_step if r["name"] == "Optimizer.step#AdamW.step"]
        assert len(scopes) == 1, step
        adam_ops = [r for r in in_step if r["name"] in ("aten::lerp_", "aten::_foreach_lerp_", "aten::addcdiv_",
                                                        "aten::_foreach_addcdiv_")]
        assert adam_ops
        for r in adam_ops:  # under the scope (directly or through an enclosing op), never flat under the step
            parent = by_id[r["parent_span_id"]]
            while parent["span_id"] != scopes[0]["span_id"]:
                assert parent["plasmient.level"] == "op", (step, r["name"], parent["name"])
                parent = by_id[parent["parent_span_id"]]
    assert torch.optim.AdamW.__dict__.get("step") is original  # close restored torch's own wrapper


@pytest.mark.parametrize("op_hook", ["native"])
def test_every_gradient_lands_under_the_backward_span_of_the_module_that_owns_its_parameter(op_hook):
    """The autograd engine accumulates a parameter's gradient (evaluate_function: AccumulateGrad, no sequence
    number) right after the node that produced it, so each one belongs to the backward span of the module that
    owns the parameter: per step, one per parameter, under the innermost module with a span whose path
    prefixes the parameter's name (an attention's out_proj weights under the attention, which calls no
    out_proj forward); none flat under the step."""
    from plasmient_trace.capture import native

    if native.load(build_if_missing=True) is None:
        pytest.skip(f"native observer unavailable: {native.failure()}")
    _, sink = run(steps=2, every=1, op_hook=op_hook)
    rows = sink.rows()
    model, _, _ = tiny.build(dim=32, layers=2, heads=2, vocab=64, seq=8, batch=2)
    for step in range(2):
        by_id, in_step = _parents(rows, step)
        modules = {r["name"] for r in in_step if r["plasmient.level"] == "module" and r["plasmient.module.phase"] == "forward"}
        expected = Counter()
        for name, _ in model.named_parameters():
            parts = f"{type(model).__name__}.{name}".split(".")[:-1]
            owner = next(".".join(parts[:k]) for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in modules)
            expected[owner + " [backward]"] += 1
        grads = [r for r in in_step if r["plasmient.level"] == "op" and r["name"].startswith("autograd::engine::evaluate_function")
                 and r["name"].endswith("AccumulateGrad")]
        assert Counter(by_id[r["parent_span_id"]]["name"] for r in grads) == expected, step


def test_python_inside_a_scope_that_runs_no_op_is_idle_cpu_time_like_python_outside_one():
    # A record_function scope that runs no op (zero_grad with set_to_none; a user's scope around Python data
    # preparation) holds the Python inside it. Outside a scope that Python is the step's idle CPU time; inside
    # one it was a CPU "kernel" with unknown FLOPs: util.resident counted it as work, coverage fell, and the
    # culprit table said "no FLOP formula for Optimizer.zero_grad#AdamW.zero_grad: register one".
    with live_capture(every=1, peak_tflops=0.05, job_id="scopes") as (session, sink):
        model, opt, data = tiny.build(dim=32, layers=2, heads=2, vocab=64, seq=8, batch=2)
        for _ in range(3):
            with session.step():
                with torch.autograd.profiler.record_function("prepare_batch"):
                    deadline = time.perf_counter() + 0.004
                    while time.perf_counter() < deadline:  # Python work, no torch op
                        pass
                tiny.train_step(model, opt, data)
    rows = sink.rows()
    scopes = [r for r in rows if r["plasmient.level"] == "op"
              and (r["name"] == "prepare_batch" or r["name"].startswith("Optimizer.zero_grad#"))]
    assert {r["name"] for r in scopes} == {"prepare_batch", "Optimizer.zero_grad#AdamW.zero_grad"}
    steps = {r["trace_id"]: r for r in rows if r["plasmient.level"] == "step"}
    assert len(steps) == 3
    for trace, step in steps.items():
        mine = [r for r in scopes if r["trace_id"] == trace]
        assert len(mine) == 2
        for scope in mine:
            assert not scope["plasmient.busy_s"] and scope["plasmient.mfu"] is None, scope["name"]  # no CPU work
            # no op that stands for CPU work (its own busy time) runs inside the scope
            assert not [r for r in rows if r["trace_id"] == trace and r["plasmient.level"] == "op"
                        and (r["plasmient.busy_s.self"] or 0) > 0
                        and r["start_ns"] < scope["end_ns"] and r["end_ns"] > scope["start_ns"]], scope["name"]
        # the scopes' time is idle CPU time, and the step's busy + idle still tile its wall
        assert step["plasmient.idle_s"] >= sum(r["end_ns"] - r["start_ns"] for r in mine) / 1e9 > 0.004
        assert step["plasmient.busy_s"] + step["plasmient.idle_s"] == pytest.approx(step["plasmient.device.window_s"], rel=1e-9)
    culprits = [r.get("plasmient.culprit.op") for r in rows if r["plasmient.level"] == "step"]
    assert not any((c or "").startswith(("Optimizer.zero_grad", "prepare_batch")) for c in culprits)


@pytest.mark.parametrize("op_hook", ["native", "dispatch"])
def test_a_full_depth_step_of_too_many_ops_goes_out_at_step_depth_with_unknown_flops(op_hook, capsys, monkeypatch):
    """A step of a Python loop of tiny ops recorded every one: 1.2 million op records for 300,000 additions,
    1 GB more RSS while the worker stitched them and over 5 s of it, so a job with full depth every step
    lost them all at exit. Past PLASMIENT_MAX_STEP_OPS the recorders keep nothing more and the step goes
    out at step depth, FLOPs unknown; steps under it are measured as before."""
    from plasmient_trace.capture import config as config_mod
    from plasmient_trace.capture import native

    if op_hook == "native" and native.load(build_if_missing=True) is None:
        pytest.skip(f"native observer unavailable: {native.failure()}")
    monkeypatch.setattr(config_mod, "_said", set())
    lin = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(lin.parameters(), lr=0.01)
    limit, loops = 2_000, [10, 5_000, 10, 5_000]
    with live_capture(every=1, peak_tflops=0.05, job_id="many-ops", op_hook=op_hook, max_step_ops=limit) as (session, sink):
        recorder_sizes = []
        for n in loops:
            x = torch.zeros(4)
            y = lin(x if n < limit else x.expand(2, 4))  # the long steps have a signature of their own
            for _ in range(n):
                x = x + 1e-6
            y.sum().backward()
            opt.step()
            opt.zero_grad()
        recorder_sizes.append(session.sources.ops.limit)
    rows = sink.rows()
    steps = {r["plasmient.step"]: r for r in rows if r["plasmient.level"] == "step"}
    assert sorted(steps) == [0, 1, 2, 3]
    assert {s: r["plasmient.flops.source"] for s, r in steps.items()} == {
        0: "measured", 1: "unknown", 2: "measured", 3: "unknown"}
    for s in (1, 3):
        assert steps[s]["plasmient.flops"] is None and steps[s]["plasmient.mfu"] is None
        assert not [r for r in rows if r["plasmient.step"] == s and r["plasmient.level"] in ("op", "module")]
    small = [r for r in rows if r["plasmient.step"] == 0 and r["plasmient.level"] == "op"]
    assert any(r["name"] == "aten::add" for r in small)
    assert session.stats["steps_full"] == 2 and recorder_sizes == [limit]
    err = capsys.readouterr().err
    assert err.count("made more than 2,000 op or module calls") == 1


@pytest.mark.parametrize("overhead", [0.02, None])
def test_steps_cut_short_for_too_many_ops_count_against_the_sampling_budget(overhead):
    """Such a step records until the limit and then goes out at step depth, its recording paid for nothing.
    With the default budget (PLASMIENT_OVERHEAD) that cost is held against the periodic samples: the first
    attempt is the only one; with an explicit rhythm and no budget, every periodic sample still tries."""
    lin = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(lin.parameters(), lr=0.01)
    with live_capture(every=2, overhead=overhead, peak_tflops=0.05, job_id="budget-ops", op_hook="dispatch",
                      max_step_ops=2_000) as (session, sink):
        for _ in range(6):
            x = torch.zeros(4)
            y = lin(x)
            for _ in range(5_000):
                x = x + 1e-6
            y.sum().backward()
            opt.step()
            opt.zero_grad()
    steps = [r for r in sink.rows() if r["plasmient.level"] == "step"]
    assert len(steps) == 6 and all(r["plasmient.flops.source"] == "unknown" for r in steps)
    assert session.stats["steps_full"] == 0
    # step 1 tries too: the first step opened at a boundary has a signature never measured (step 0, opened at
    # its first module call, has its own), and a new signature is not held back by the budget
    if overhead:
        # held: the periodic samples of steps 2 and 4, and of step 6, opened by the last optimizer.step()
        assert session.stats["steps_too_many_ops"] == 2 and session.stats["samples_held"] == 3
    else:
        assert session.stats["steps_too_many_ops"] == 4  # steps 0, 1, 2 and 4


@pytest.mark.parametrize("op_hook", ["native", "dispatch"])
def test_an_op_recorder_keeps_at_most_its_limit_between_two_takes(op_hook):
    from plasmient_trace.capture import native

    if op_hook == "native":
        observer = native.load(build_if_missing=True)
        if observer is None:
            pytest.skip(f"native observer unavailable: {native.failure()}")
        recorder = torch_hooks.NativeOpRecorder(observer)
    else:
        recorder = torch_hooks.OpRecorder()
    def record(adds: int) -> tuple[int, int]:
        x = torch.zeros(4)
        with recorder:
            for _ in range(adds):
                x = x + 1
        chunk = recorder.take()
        return (len(chunk) if op_hook == "dispatch" else len(chunk["signature"]) // 4), recorder.taken_over

    everything, _ = record(250)  # the native observer sees an add's inner calls too
    recorder.limit = 100
    try:
        kept, over = record(250)
        # the observer is process-wide: a call of another thread of the test process may come and go
        assert kept == 100 and abs(kept + over - everything) <= 2
        assert record(10) == (everything // 25, 0)  # each take starts the count again
    finally:
        recorder.limit = 0


def test_the_ending_signal_handler_is_invisible_to_the_job_and_removal_restores_everything() -> None:
    """While ours serves SIGTERM, the job sees the default; a handler the job sets is called after a flush
    and is what getsignal returns; remove() leaves the job's own handler and the original functions."""
    import os
    import signal as sig

    from plasmient_trace.capture import ending_signals

    real_signal, real_getsignal = sig.signal, sig.getsignal
    saved = real_getsignal(sig.SIGTERM)
    real_signal(sig.SIGTERM, sig.SIG_DFL)
    flushed: list[int] = []
    try:
        ending_signals.install(flush=lambda: flushed.append(1), stop=lambda: None)
        assert sig.getsignal(sig.SIGTERM) is sig.SIG_DFL  # what the job would see without us
        got: list[int] = []
        assert sig.signal(sig.SIGTERM, lambda s, f: got.append(s)) is sig.SIG_DFL
        job_handler = sig.getsignal(sig.SIGTERM)
        assert callable(job_handler) and not getattr(job_handler, "_plasmient_flushes_first", False)
        os.kill(os.getpid(), sig.SIGTERM)
        assert got == [sig.SIGTERM] and flushed == [1]  # written first, then the job's own handler
        ending_signals.remove()
        assert sig.signal is real_signal and sig.getsignal is real_getsignal
        assert real_getsignal(sig.SIGTERM) is job_handler
    finally:
        ending_signals.remove()
        real_signal(sig.SIGTERM, saved)


def test_two_models_of_one_class_have_their_own_names_and_a_rebuilt_one_takes_its_name_back():
    """An encoder and a decoder of one class, both called at the top of the step: their spans and their layers'
    are told apart (MLP, MLP#2), so a layer's time and waste land on the right model."""
    import gc

    from capture_helpers import live_capture

    nn = torch.nn

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

        def forward(self, x):
            return self.down(self.up(x).relu())

    enc, dec = MLP(), MLP()
    with live_capture(every=1, job_id="names") as (session, sink):
        with session.step():
            (dec(enc(torch.randn(4, 16))).sum()).backward()
        del dec
        gc.collect()
        rebuilt = MLP()
        with session.step():
            (rebuilt(enc(torch.randn(4, 16))).sum()).backward()
    by_step: dict[int, set] = {}
    for r in sink.rows():
        if r["plasmient.level"] == "module" and not r["name"].endswith("[backward]"):
            by_step.setdefault(r["plasmient.step"], set()).add(r["name"])
    assert by_step[0] == {"MLP", "MLP.up", "MLP.down", "MLP#2", "MLP#2.up", "MLP#2.down"}
    assert by_step[1] == by_step[0]  # the rebuilt decoder is MLP#2 again, the encoder still MLP
