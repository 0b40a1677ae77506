"""The Kineto fallback of live capture: with cupti-python unusable (or PLASMIENT_CUPTI=kineto), each
full-depth step is profiled by torch.profiler and its ops come from the profiler, nested under the
session's module spans; the job's own torch.profiler makes ours stand aside without breaking it.

On this CPU machine the profiler runs with the CPU activity only: ops, no kernels, device type cpu."""

from __future__ import annotations

import tempfile

import orjson
import pytest
import torch

from plasmient_trace.capture import config as config_mod
from plasmient_trace.capture.session import CaptureConfig, CaptureSession

from capture_helpers import Collect, tiny  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_messages(monkeypatch):
    # say_once remembers keys for the process: each test sees its own one-time messages.
    monkeypatch.setattr(config_mod, "_said", set())


def _module_of(span: dict, by_id: dict) -> str | None:
    cur = span
    while cur["parent_span_id"] in by_id:
        cur = by_id[cur["parent_span_id"]]
        if cur["plasmient.level"] == "module":
            return cur["name"]
    return None


def _train(config: CaptureConfig, steps: int = 3, user_profiler: bool = False):
    sink = Collect()
    session = CaptureSession(config, exporters=[("memory", sink)]).start()
    user = None
    try:
        model, opt, data = tiny.build(dim=32, layers=2, heads=2, vocab=64, seq=8, batch=2)
        if user_profiler:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
                for _ in range(steps):
                    tiny.train_step(model, opt, data)
            user = prof.key_averages()
        else:
            for _ in range(steps):
                tiny.train_step(model, opt, data)
    finally:
        session.close(timeout=30)
    return session, sink.rows(), user


def test_env_variable_selects_the_kineto_fallback():
    assert CaptureConfig.from_env({"PLASMIENT_CUPTI": "kineto"}).kineto is True
    assert CaptureConfig.from_env({"PLASMIENT_CUPTI": "kineto"}).cupti is True
    assert CaptureConfig.from_env({}).kineto is False
    assert CaptureConfig.from_env({"PLASMIENT_CUPTI": "0"}).cupti is False


def test_full_depth_steps_carry_the_profilers_ops_under_the_module_spans(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("PLASMIENT_VERBOSE", "1")  # which source runs is news, not a failure: said when asked
    # PLASMIENT_EVERY as a user sets it: a rate of its own, without the default budget, which held step 3 back
    # once the first batch's cost was measured on a loaded machine
    config = CaptureConfig.from_env({"PLASMIENT_CUPTI": "kineto", "PLASMIENT_EVERY": "3"}, peak_tflops=0.05, job_id="kineto-job")
    session, rows, _ = _train(config, steps=4)
    assert capsys.readouterr().err.count("PLASMIENT_CUPTI=kineto") == 1
    assert not list(tmp_path.glob("plasmient-kineto-*"))  # each step's exported trace is removed once read
    assert session.sources.kineto is not None and not session.failed and session.stats["steps"] == 4
    by_id = {r["span_id"]: r for r in rows}
    depth = {r["plasmient.step"]: r["plasmient.sampled_depth"] for r in rows if r["plasmient.level"] == "step"}
    # every 3rd step, and step 1, whose signature (opened at a boundary) is new: profiled from its first module call
    assert depth == {0: "full", 1: "full", 2: "step", 3: "full"}
    for step in (0, 1, 3):
        ops = [r for r in rows if r["plasmient.step"] == step and r["plasmient.level"] == "op"]
        addmm = [r for r in ops if r["name"] == "aten::addmm"]
        assert addmm, step
        # Kineto's spelling of shapes (record_shapes=True) and its External ids are on every op
        for r in addmm:
            dims = orjson.loads(r["plasmient.op.input_dims"])
            assert len(dims) >= 3 and dims[1] == [16, dims[2][0]]  # 2 x 8 tokens (k) @ (k, n)
            assert r["plasmient.op.input_types"].startswith('["float","float","float"')
            assert r["plasmient.op.external_id"] is not None
        assert {_module_of(r, by_id) for r in addmm} >= {"TinyLM.layers.0.mlp.0", "TinyLM.layers.1.mlp.0"}
        assert all(r["plasmient.device.type"] == "cpu" for r in ops)
        # user annotations (Optimizer.zero_grad...) come through only from a profiler, not from the dispatch hooks
        assert any(r["name"].startswith("aten::") for r in ops)
    assert not [r for r in rows if r["plasmient.level"] == "op" and r["plasmient.step"] == 2]
    assert all(r["plasmient.device.type"] == "cpu" for r in rows)
    full = next(r for r in rows if r["plasmient.step"] == 0 and r["plasmient.level"] == "step")
    assert full["plasmient.flops"] > 0 and full["plasmient.mfu"] is not None


def test_starting_torch_profiler_is_not_charged_to_the_step_it_profiles(monkeypatch):
    """The fallback starts torch.profiler at each full step's beginning (10-100 ms on a GPU machine): the
    step's span starts once it runs, so its wall time and MFU are the job's, not ours. (Its recording
    during the step is the job's step being slower, and stays in.)"""
    import time

    from plasmient_trace.capture import kineto_fallback

    start_step = kineto_fallback.KinetoCollector.start_step
    started: list[int] = []

    def slow_start(self):
        time.sleep(0.5)
        start_step(self)
        started.append(time.time_ns())

    monkeypatch.setattr(kineto_fallback.KinetoCollector, "start_step", slow_start)
    config = CaptureConfig.from_env({"PLASMIENT_CUPTI": "kineto", "PLASMIENT_EVERY": "1"}, peak_tflops=0.05, job_id="k4")
    session, rows, _ = _train(config, steps=3)
    steps = sorted((r for r in rows if r["plasmient.level"] == "step"), key=lambda r: r["start_ns"])
    assert len(steps) == 3 and all(r["plasmient.sampled_depth"] == "full" for r in steps)
    # the epoch clocks of the span and of this test agree to well under the 0.5 s start
    lag = [(r["start_ns"] - t) / 1e9 for r, t in zip(steps, started)]
    assert all(-0.05 < x < 0.05 for x in lag), lag


def test_ops_come_from_the_profiler_not_the_dispatch_hooks(monkeypatch):
    # Were the dispatch hooks still recording, their ops would be in the step too (twice the addmms).
    config = CaptureConfig.from_env({"PLASMIENT_CUPTI": "kineto", "PLASMIENT_EVERY": "1"}, peak_tflops=0.05, job_id="k2")
    _, kineto_rows, _ = _train(config, steps=2)
    plain = CaptureConfig(every=1, peak_tflops=0.05, job_id="k3", environ={})
    _, plain_rows, _ = _train(plain, steps=2)

    def count(rows, name):
        return sum(1 for r in rows if r["plasmient.level"] == "op" and r["name"] == name and r["plasmient.step"] == 1)

    assert count(kineto_rows, "aten::addmm") == count(plain_rows, "aten::addmm") > 0
    # only a profiler sees record_function annotations such as the optimizer's zero_grad
    names = {r["name"] for r in kineto_rows if r["plasmient.level"] == "op"}
    assert any(n.startswith("Optimizer.") for n in names), sorted(names)[:20]


def test_cupti_unavailable_on_a_gpu_falls_back_to_kineto_once(monkeypatch, capsys):
    """The GPU branch without a GPU: CUDA 'initialised', cupti-python refusing; the session says so
    once and profiles full-depth steps with torch.profiler (CUDA activity requested)."""
    from plasmient_trace.capture import cupti as cupti_mod

    class Refusing:
        def start(self):
            raise cupti_mod.CuptiUnavailable("CUPTI is in use by another subscriber")

    class Props:
        name, total_memory, major, minor, multi_processor_count = "NVIDIA H100 80GB HBM3", 85_000_000_000, 9, 0, 132

    monkeypatch.setattr(cupti_mod, "CuptiCollector", Refusing)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props())
    config = CaptureConfig(every=1, peak_tflops=0.05, job_id="fallback", environ={}, nvml=False)
    session = CaptureSession(config, exporters=[("memory", Collect())])
    session.sources.init_gpu(torch)
    assert session.sources.on_gpu and session.sources.kineto is not None and session.sources.kineto.cuda
    assert session.sources.label() == "live:kineto"
    assert [str(a) for a in session.sources.kineto.activities] == [str(torch.profiler.ProfilerActivity.CPU),
                                                          str(torch.profiler.ProfilerActivity.CUDA)]
    session.sources.init_gpu(torch)
    err = capsys.readouterr().err
    assert err.count("falling back to torch.profiler") == 1 and "in use by another subscriber" in err


@pytest.mark.parametrize("op_hook", ["dispatch", "native"])
def test_the_jobs_own_profiler_makes_ours_stand_aside_without_breaking_it(capsys, op_hook, native_observer):
    config = CaptureConfig.from_env({"PLASMIENT_CUPTI": "kineto", "PLASMIENT_OP_HOOK": op_hook, "PLASMIENT_EVERY": "1"},
                                    peak_tflops=0.05, job_id="user-prof")
    session, rows, user = _train(config, user_profiler=True)
    err = capsys.readouterr().err
    assert err.count("stands aside") == 1
    assert not session.failed and session.stats["steps"] == 3
    # the user's profile is whole
    keys = {e.key for e in user}
    assert {"aten::addmm", "aten::mm"} <= keys
    # our steps still carry ops, from our own op hook beside the job's profiler
    by_id = {r["span_id"]: r for r in rows}
    addmm = [r for r in rows if r["plasmient.level"] == "op" and r["name"] == "aten::addmm"]
    assert {r["plasmient.step"] for r in addmm} == {0, 1, 2}
    assert all(_module_of(r, by_id) for r in addmm)
    annotated = any(r["name"].startswith("Optimizer.") for r in rows if r["plasmient.level"] == "op")
    # record_function scopes: the native observer sees them as Kineto does, a dispatch mode cannot
    assert annotated == (op_hook == "native")


def test_the_fallback_resumes_after_the_jobs_profiler_stops(capsys):
    sink = Collect()
    # the dispatch hook, which cannot see record_function scopes: they mark the steps ours profiled
    config = CaptureConfig.from_env({"PLASMIENT_CUPTI": "kineto", "PLASMIENT_OP_HOOK": "dispatch", "PLASMIENT_EVERY": "1"},
                                    peak_tflops=0.05, job_id="resume")
    session = CaptureSession(config, exporters=[("memory", sink)]).start()
    try:
        model, opt, data = tiny.build(dim=32, layers=1, heads=2, vocab=64, seq=8, batch=2)
        tiny.train_step(model, opt, data)          # step 0 (opened at the first forward): ours runs
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            tiny.train_step(model, opt, data)      # ours yields mid-step 1; the user's profile runs
        tiny.train_step(model, opt, data)
        tiny.train_step(model, opt, data)
    finally:
        session.close(timeout=30)
    assert any(e.key == "aten::addmm" for e in prof.key_averages())
    rows = sink.rows()
    assert not session.failed
    annotated = {r["plasmient.step"] for r in rows if r["plasmient.level"] == "op" and r["name"].startswith("Optimizer.")}
    ops = {r["plasmient.step"] for r in rows if r["plasmient.level"] == "op" and r["name"] == "aten::addmm"}
    # Steps run from one opt.step() to the next: step 1 was open when the user's profiler started
    # (ours stopped, the dispatch hooks took over), step 2 began under it, step 3 after it stopped.
    assert ops == {0, 1, 2, 3}
    assert annotated == {0, 3}  # profiled by ours before, and again once the user's stopped
    # profiler runs and the dispatch hooks both number ops from 1: in one batch they must not collide,
    # since launches and kernels are joined to ops by these ids
    ext = [r["plasmient.op.external_id"] for r in rows if r["plasmient.level"] == "op"]
    assert None not in ext and len(ext) == len(set(ext))
