"""The native op observer (capture/op_observer.cpp): what it records, on the real tiny transformer,
checked against the dispatch-mode recorder and against the clocks and threads it claims to use."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import orjson
import pytest
import torch

from plasmient_trace.capture import native, torch_hooks
from plasmient_trace.capture.session import CaptureConfig, CaptureSession

from capture_helpers import Collect, tiny  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _record(recorder, fn):
    with recorder:
        fn()
    return recorder.table([recorder.take()], pid=1, epoch_offset_ns=0)


def _small():
    return tiny.build(dim=32, layers=1, heads=2, vocab=64, seq=8, batch=2)


def test_native_sees_every_aten_op_the_dispatch_hook_sees_with_the_same_shapes(native_observer):
    model, opt, data = _small()
    tiny.train_step(model, opt, data)  # lazy state (optimizer moments) exists before comparing
    native_ops = _record(torch_hooks.NativeOpRecorder(native_observer), lambda: tiny.train_step(model, opt, data))
    dispatch_ops = _record(torch_hooks.OpRecorder(), lambda: tiny.train_step(model, opt, data))

    def signatures(t, names):
        # tensor arguments only: RecordFunction boxes every schema argument (addmm's beta and alpha
        # too, as Kineto records them), a dispatch mode only those the caller passed
        out = []
        for n, d, ty in zip(t.column("name").to_pylist(), t.column("input_dims").to_pylist(),
                            t.column("input_types").to_pylist()):
            if n in names:
                out.append((n, [(x, y) for x, y in zip(orjson.loads(d), orjson.loads(ty)) if y not in ("Scalar", "")]))
        return sorted(out)

    gemms = {"aten::addmm", "aten::mm", "aten::bmm"}
    assert signatures(native_ops, gemms) == signatures(dispatch_ops, gemms) != []
    # below autograd the dispatch hook sees a subset of what RecordFunction sees: composite ops
    # (aten::linear), autograd nodes and record_function scopes are the native observer's extra;
    # the dispatch hook's own extras are the ops that implement record_function, which RecordFunction
    # shows as the scope itself
    assert set(dispatch_ops.column("name").to_pylist()) - set(native_ops.column("name").to_pylist()) <= {
        "profiler::_record_function_enter_new", "profiler::_record_function_exit"} | torch_hooks.SHAPE_ONLY_OPS
    names = set(native_ops.column("name").to_pylist())
    assert {"aten::linear", "Optimizer.step#AdamW.step"} <= names
    assert any(n.startswith("autograd::engine::evaluate_function: ") for n in names)
    cats = dict(zip(native_ops.column("name").to_pylist(), native_ops.column("category").to_pylist()))
    assert cats["Optimizer.step#AdamW.step"] == "user_annotation" and cats["aten::linear"] == "cpu_op"


def test_backward_nodes_carry_the_sequence_number_of_the_forward_op_that_made_them(native_observer):
    model, opt, data = _small()
    ops = _record(torch_hooks.NativeOpRecorder(native_observer), lambda: tiny.train_step(model, opt, data)).to_pylist()
    forward = {o["sequence_number"] for o in ops if o["fwd_thread_id"] == 0 and o["sequence_number"] is not None}
    nodes = [o for o in ops if o["fwd_thread_id"] > 0 and o["sequence_number"] is not None]
    assert any(o["name"] == "AddmmBackward0" for o in nodes)
    assert {o["sequence_number"] for o in nodes} <= forward
    # RecordFunction's own thread numbering (as Kineto's 'Fwd thread id'), not an OS thread id
    assert all(o["fwd_thread_id"] > 0 for o in nodes)


def test_timestamps_are_perf_counter_ns_and_threads_are_native_ids(native_observer):
    recorder = torch_hooks.NativeOpRecorder(native_observer)
    a = torch.randn(64, 64)
    box = {}

    def in_thread():
        box["tid"] = threading.get_native_id()
        torch.mm(a, a)

    t0 = time.perf_counter_ns()
    with recorder:
        torch.mm(a, a)
        worker = threading.Thread(target=in_thread)
        worker.start()
        worker.join()
    t1 = time.perf_counter_ns()
    ops = recorder.table([recorder.take()], pid=1, epoch_offset_ns=0).to_pylist()
    mms = [o for o in ops if o["name"] == "aten::mm"]
    assert {o["tid"] for o in mms} == {threading.get_native_id(), box["tid"]}
    assert all(t0 <= o["start_ns"] <= o["end_ns"] <= t1 for o in ops)
    assert all(o["input_dims"] == "[[64,64],[64,64]]" and o["input_types"] == '["float","float"]' for o in mms)


def test_nothing_is_recorded_outside_a_full_depth_step_and_signatures_are_spelled_once(native_observer):
    recorder = torch_hooks.NativeOpRecorder(native_observer)
    model, opt, data = _small()
    tiny.train_step(model, opt, data)
    assert len(recorder.take()["signature"]) == 0  # the callback is only installed while entered
    first = _record(recorder, lambda: tiny.train_step(model, opt, data))
    known = len(native_observer.signatures(0))
    second = _record(recorder, lambda: tiny.train_step(model, opt, data))
    # a repeated step adds no signature, though AdamW's step-dependent float scalars change
    assert len(native_observer.signatures(0)) == known
    cols = ("name", "input_dims", "input_types", "concrete_inputs")
    assert first.select(cols).to_pylist() == second.select(cols).to_pylist()
    ext = first.column("external_id").to_pylist() + second.column("external_id").to_pylist()
    assert len(set(ext)) == len(ext)


def test_a_session_switches_to_the_native_observer_when_its_background_build_lands(monkeypatch, native_observer):
    """Under PLASMIENT_OP_HOOK=auto with no cached build, full-depth steps use the dispatch hook
    until the build lands, then the native observer; external ids never repeat across the switch."""
    calls = {"n": 0}

    def loaded():
        calls["n"] += 1
        return native_observer if calls["n"] > 2 else None

    monkeypatch.setattr(native, "load", lambda build_if_missing=True: None)
    monkeypatch.setattr(native, "failure", lambda: None)
    monkeypatch.setattr(native, "build_async", lambda: None)
    monkeypatch.setattr(native, "loaded", loaded)
    sink = Collect()
    session = CaptureSession(CaptureConfig(every=1, peak_tflops=0.05, job_id="switch", environ={}),
                             exporters=[("memory", sink)]).start()
    try:
        model, opt, data = _small()
        for _ in range(4):
            tiny.train_step(model, opt, data)
    finally:
        session.close(timeout=30)
    rows = [r for r in sink.rows() if r["plasmient.level"] == "op"]
    linear_steps = {r["plasmient.step"] for r in rows if r["name"] == "aten::linear"}
    addmm_steps = {r["plasmient.step"] for r in rows if r["name"] == "aten::addmm"}
    assert addmm_steps == {0, 1, 2, 3}
    assert linear_steps == {2, 3}  # composite ops: only the native observer sees them
    ext = [r["plasmient.op.external_id"] for r in rows]
    assert len(ext) == len(set(ext))


def test_without_a_compiler_capture_says_why_once_and_keeps_the_dispatch_hook(tmp_path):
    from plasmient_trace.capture.autostart import write_shim

    out = tmp_path / "traces.jsonl"
    shim = tmp_path / "shim"
    shim.mkdir()
    write_shim(shim)  # what `plasmient run` puts on PYTHONPATH: PLASMIENT_TRACE=1 without an install step
    env = dict(os.environ, PLASMIENT_TRACE="1", PLASMIENT_OUT=str(out), PLASMIENT_EVERY="1", PYTHONPATH=str(shim),
               PLASMIENT_CACHE_DIR=str(tmp_path / "cache"), CXX=str(tmp_path / "no-such-c++"),
               PLASMIENT_PEAK_TFLOPS="0.05")
    code = ("import sys; sys.path.insert(0, 'examples'); import train_tiny_transformer as t; "
            "m, o, d = t.build(dim=32, layers=1, heads=2, vocab=64, seq=8, batch=2); "
            "[t.train_step(m, o, d) for _ in range(3)]")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("native op observer unavailable (RuntimeError: no C++ compiler") == 1, proc.stderr
    names = set()
    for line in out.read_text().splitlines():
        for rs in orjson.loads(line)["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                names |= {s["name"] for s in ss["spans"]}
    assert "aten::addmm" in names and "aten::linear" not in names  # the dispatch hook's ops


def test_the_build_command_reports_where_the_observer_lives():
    proc = subprocess.run([sys.executable, "-m", "plasmient_trace.capture.native"], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert str(native.artifact_path()) in proc.stdout


def test_an_unknown_op_hook_value_is_named_and_auto_is_used(capsys):
    config = CaptureConfig.from_env({"PLASMIENT_OP_HOOK": "fast"})
    assert config.op_hook == "fast"
    session = CaptureSession(CaptureConfig(op_hook="fast", job_id="x", environ={}), exporters=[("memory", Collect())])
    session.start()
    session.close(timeout=5)
    assert "PLASMIENT_OP_HOOK='fast' is not auto, native or dispatch" in capsys.readouterr().err
    assert isinstance(session.sources.ops, torch_hooks.NativeOpRecorder)


@pytest.mark.parametrize("value,expected", [("dispatch", "OpRecorder"), ("native", "NativeOpRecorder")])
def test_the_op_hook_variable_picks_the_recorder(value, expected):
    session = CaptureSession(CaptureConfig.from_env({"PLASMIENT_OP_HOOK": value}, job_id="x"),
                             exporters=[("memory", Collect())])
    session.start()
    session.close(timeout=5)
    assert type(session.sources.ops).__name__ == expected


def _fake_cxx(tmp_path, body: str):
    cxx = tmp_path / "fake-c++"
    cxx.write_text('#!/bin/sh\nfor out; do :; done\n' + body)  # the last argument is the output file
    cxx.chmod(0o755)
    return cxx


def test_a_job_that_exits_mid_build_leaves_a_finished_cache_not_a_temp_file(tmp_path):
    """The background build outlives a short job: the next run loads it instead of compiling again."""
    cxx = _fake_cxx(tmp_path, 'sleep 3\necho built > "$out"\n')
    env = dict(os.environ, CXX=str(cxx), PLASMIENT_CACHE_DIR=str(tmp_path / "cache"))
    # the job exits (without any cleanup) as soon as the compile has begun
    code = ("import os, pathlib, time\nfrom plasmient_trace.capture import native\nnative.build_async()\n"
            "root = pathlib.Path(os.environ['PLASMIENT_CACHE_DIR'])\nt = time.monotonic()\n"
            "while not list(root.rglob('*.building')) and time.monotonic() - t < 200:\n    time.sleep(0.05)\n"
            "os._exit(0)\n")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300)
    entry = next((tmp_path / "cache" / "native").iterdir())
    deadline = time.monotonic() + 300
    while any(p.name.endswith(".building") for p in entry.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.2)
    import importlib.machinery

    final = f"{native.MODULE_NAME}{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    names = sorted(p.name for p in entry.iterdir())
    assert names == [final, f"{final}.log"], names  # the finished artifact; no temp file, no lock
    assert (entry / final).read_text() == "built\n"


def test_a_failed_build_names_the_compilers_message_and_leaves_nothing_behind(tmp_path, monkeypatch):
    from plasmient_trace.capture import native

    monkeypatch.setenv("CXX", str(_fake_cxx(tmp_path, 'echo "error: boom in op_observer.cpp" >&2\nexit 1\n')))
    monkeypatch.setenv("PLASMIENT_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match="exit 1.*boom in op_observer.cpp"):
        native.build(timeout_s=120)
    leftovers = [p.name for p in (tmp_path / "cache").rglob("*") if p.is_file() and not p.name.endswith(".log")]
    assert leftovers == []


FORKING_JOB = r'''
import json, os, sys, threading, time
import torch
from plasmient_trace.capture import native
obs = native.load()
obs.start()
stop = False
def churn():  # new shapes: new signatures, spelled under the observer's global lock, while the main thread forks
    n = 0
    while not stop:
        n = n % 20000 + 1
        torch.ones(n, 3).add(1)
threads = [threading.Thread(target=churn, daemon=True) for _ in range(3)]
for thread in threads:
    thread.start()
time.sleep(0.1)
codes = []
for i in range(60):
    # A step ends and the next begins just before the fork (a DataLoader iterator made between steps): torch's
    # callback registry changes, and every thread catches up under torch's lock at its next op.
    obs.stop()
    obs.start()
    pid = os.fork()
    if pid == 0:  # a DataLoader worker, say: its ops never reach an exporter, so none are recorded
        obs.stop()
        for k in range(20):
            torch.ones(30000 + 100 * i + k, 2).sum()
        obs.start()
        os._exit(0 if obs.forked_child() and len(obs.take()["signature"]) == 0 else 3)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            codes.append(os.waitstatus_to_exitcode(status))
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            codes.append("hung")
            break
        time.sleep(0.01)
stop = True
for thread in threads:
    thread.join()
obs.take()
torch.ones(5, 5).mul(2)
print(json.dumps({"children": codes, "parent_records": len(obs.take()["signature"]) // 4,
                  "parent_is_child": obs.forked_child()}))
obs.stop()
'''


def test_a_forked_child_records_nothing_and_never_inherits_a_held_lock(native_observer, tmp_path):
    """fork() right after a step boundary while other threads run ops (DataLoader workers): the child starts
    with the observer's locks and torch's callback registry free, records nothing (no exporter there will take
    it), never touches the registry, and the parent keeps recording."""
    script = tmp_path / "forks.py"
    script.write_text(FORKING_JOB)
    out = subprocess.run([sys.executable, str(script)], env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
                         capture_output=True, text=True, timeout=900, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    result = orjson.loads(out.stdout.strip().splitlines()[-1])
    assert result["children"] == [0] * 60
    assert result["parent_records"] >= 1 and not result["parent_is_child"]
