"""The batch process (PLASMIENT_WORKER=process, the default): the stitch and delivery of live steps in an
interpreter of their own. It writes what the worker thread writes, step for step, and never imports torch; a
child that dies hands the steps back to the job's thread, and a job that becomes multi-rank takes back what
the child remembered. That the job runs as it does untraced, signals and outages included, is
test_capture_never_breaks.py's and its neighbours', whose jobs run with the default worker."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
from capture_helpers import sampled_live_session
from test_capture_never_breaks import _steps, _warm_cache

from plasmient_trace.export.otlp_json import read_jsonl

__all__ = ["_warm_cache"]  # the autouse fixture that fills the native build cache the jobs share

torch = pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def _say_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """say_once's memory is the test process's: each test here reads the lines its own session says."""
    from plasmient_trace.capture import config as config_mod

    monkeypatch.setattr(config_mod, "_said", set())


def _run(out: Path, worker: str, during: Any = None) -> Any:
    """Ten steps of the small model through ``worker``, full depth every third; ``during(session, step)`` runs
    after each step. Returns the closed session."""
    return sampled_live_session(out, every=3, steps=10, during=during, job_id="batch-process", worker=worker,
                                op_hook="native")


def _per_step(path: Path) -> dict[int, dict[str, Any]]:
    """Per step: its span names by level, and the step span's FLOPs and their source."""
    rows = read_jsonl(path).table.to_pylist()
    out: dict[int, dict[str, Any]] = {}
    for r in rows:
        step = out.setdefault(r["plasmient.step"], {"names": []})
        step["names"].append((r["plasmient.level"], r["name"]))
        if r["plasmient.level"] == "step":
            step.update(flops=r["plasmient.flops"], source=r["plasmient.flops.source"])
    for step in out.values():
        step["names"].sort()
    return out


def test_the_batch_process_writes_what_the_worker_thread_writes_and_never_imports_torch(tmp_path: Path) -> None:
    from plasmient_trace.capture import native

    if native.load() is None:
        pytest.skip(f"native op observer unavailable: {native.failure()}")
    libraries: list[str] = []

    def look_at_the_child(session: Any, step: int) -> None:
        if step == 4 and session.route.child is not None:  # the child has stitched batches by now
            session.flush(60)
            maps = Path(f"/proc/{session.route.child.pid}/maps")
            if maps.exists():
                libraries.append(maps.read_text())

    thread = _run(tmp_path / "thread.jsonl", "thread")
    child = _run(tmp_path / "process.jsonl", "process", during=look_at_the_child)
    assert child.stats["steps_dropped"] == 0 and not child.failed
    assert child.route.child is not None  # no fallback to the thread happened
    # every batch went to the child, and none on the thread's run
    assert child.stats["batches_in_child"] == child.stats["exported_batches"] > 0
    assert thread.stats["batches_in_child"] == 0 < thread.stats["exported_batches"]
    expected = _per_step(tmp_path / "thread.jsonl")
    got = _per_step(tmp_path / "process.jsonl")
    assert sorted(got) == list(range(10))
    assert got == expected
    # steps 0, 3, 6, 9 measured, the rest carried from what the child remembered between batches
    assert {s: v["source"] for s, v in got.items()} == {
        s: "measured" if s % 3 == 0 else "carried" for s in range(10)}
    assert all(v["flops"] > 0 for v in got.values())
    if libraries:  # Linux: the child's mapped libraries; it never loaded torch (1-2 s and hundreds of MB)
        assert "libtorch" not in libraries[0] and "numpy" in libraries[0]


def test_a_batch_process_that_dies_hands_the_later_steps_to_the_job_s_thread(tmp_path: Path,
                                                                              capfd: pytest.CaptureFixture) -> None:
    def kill_the_child(session: Any, step: int) -> None:
        if step == 3:
            session.flush(60)
            os.kill(session.route.child.pid, signal.SIGKILL)
            session.route.child._proc.wait(30)

    session = _run(tmp_path / "t.jsonl", "process", during=kill_the_child)
    assert session.route.child is None and session.route.delivery is not None
    assert 0 < session.stats["batches_in_child"] < session.stats["exported_batches"]
    steps = _per_step(tmp_path / "t.jsonl")
    assert _steps(tmp_path / "t.jsonl") == list(range(10))  # nothing lost, nothing written twice
    # what the child measured died with it: step 4 and 5 carry nothing, step 6 is measured again, 7 and 8 carry
    sources = {s: v["source"] for s, v in steps.items()}
    assert sources == {0: "measured", 1: "carried", 2: "carried", 3: "measured", 4: "unknown", 5: "unknown",
                       6: "measured", 7: "carried", 8: "carried", 9: "measured"}
    err = capfd.readouterr().err
    assert err.count("PLASMIENT_WORKER=process: the batch process ended (exit status -9); later steps are "
                     "stitched in this process") == 1, err


def test_a_job_that_becomes_multi_rank_takes_back_what_the_batch_process_remembered(tmp_path: Path,
                                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The fleet spans of a multi-rank job need its process group, which only the job's process holds: at the
    first batch that finds one, the child delivers what it holds, hands back the carried FLOPs and ends."""
    from plasmient_trace.capture.batch_route import BatchRoute

    handed: list[bool] = []

    def become_multi_rank(session: Any, step: int) -> None:
        if step == 4:
            session.flush(60)
            monkeypatch.setattr(BatchRoute, "multi_rank", lambda self: True)
            handed.append(True)

    session = _run(tmp_path / "t.jsonl", "process", during=become_multi_rank)
    assert handed and session.route.child is None
    steps = _per_step(tmp_path / "t.jsonl")
    assert _steps(tmp_path / "t.jsonl") == list(range(10))
    # steps 5, 7 and 8 carry what the child measured at steps 3 and 6: nothing was forgotten at the hand-over
    assert all(steps[s]["source"] == "carried" and steps[s]["flops"] == steps[3]["flops"] for s in (5, 7, 8))


def test_a_multi_rank_job_keeps_the_worker_thread() -> None:
    from plasmient_trace.capture.session import CaptureConfig, CaptureSession

    session = CaptureSession(CaptureConfig(worker="process", environ={"WORLD_SIZE": "2"}))
    assert not session.route.wants_child()
    assert CaptureSession(CaptureConfig(worker="process", environ={"WORLD_SIZE": "1"})).route.wants_child()


def test_a_relative_out_file_is_where_the_job_started_though_it_changed_directory(tmp_path: Path,
                                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Hydra moves a job into its run directory after `import torch` started the capture: the thread's file was
    opened where the job started, and the batch process, started at the first step, must write there too."""
    from plasmient_trace.capture.session import CaptureConfig, CaptureSession

    (tmp_path / "started").mkdir()
    (tmp_path / "moved").mkdir()
    monkeypatch.chdir(tmp_path / "started")
    session = CaptureSession(CaptureConfig(out="t.jsonl", peak_tflops=1.0, job_id="cwd", environ={})).start()
    try:
        os.chdir(tmp_path / "moved")
        model = torch.nn.Linear(8, 8)
        for _ in range(3):
            with session.step():
                model(torch.randn(4, 8)).sum().backward()
    finally:
        session.close(timeout=60)
    assert session.route.child is not None
    assert _steps(tmp_path / "started" / "t.jsonl") == [0, 1, 2]
    assert not (tmp_path / "moved" / "t.jsonl").exists()


def test_a_wedged_batch_process_is_killed_and_the_thread_takes_its_steps(tmp_path: Path, capfd: pytest.CaptureFixture,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A child that stops answering (here stopped by SIGSTOP) must not hold the batching thread for good: past
    the reply bound it is killed, said once, and the batch it held is stitched on the thread."""
    from plasmient_trace.capture import batch_process

    monkeypatch.setattr(batch_process, "_REPLY_WAIT_S", 1.0)
    stopped: list[Any] = []

    def stop_the_child(session: Any, step: int) -> None:
        if step == 3:
            session.flush(60)
            stopped.append(session.route.child._proc)
            os.kill(session.route.child.pid, signal.SIGSTOP)

    session = _run(tmp_path / "t.jsonl", "process", during=stop_the_child)
    assert session.route.child is None
    assert stopped[0].wait(30) == -signal.SIGKILL
    assert _steps(tmp_path / "t.jsonl") == list(range(10))
    err = capfd.readouterr().err
    assert err.count("PLASMIENT_WORKER=process: the batch process did not answer within 1s") == 1, err


def test_a_process_that_runs_no_step_starts_no_batch_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torchrun agent imports torch (so `plasmient run` traces it) and runs no step: it started a child at its
    exit, whose "ready" it never read, and the child printed a ConnectionResetError traceback. (The exit's stop
    sentinel in the step queue read as a step to stitch.) A step opened at a module call and never ended starts
    the child, which the close then ends."""
    from plasmient_trace.capture import batch_process
    from plasmient_trace.capture.session import CaptureConfig, CaptureSession

    started: list[int] = []
    real_start = batch_process.BatchProcess.start
    monkeypatch.setattr(batch_process.BatchProcess, "start",
                        lambda self, *a, **k: (started.append(1), real_start(self, *a, **k))[1])
    session = CaptureSession(CaptureConfig(job_id="no-step", environ={})).start()
    session.close(timeout=30)
    session.worker._thread.join(30)
    assert started == [] and session.route.child is None

    session = CaptureSession(CaptureConfig(job_id="no-step", environ={})).start()
    torch.nn.Linear(2, 2)(torch.ones(1, 2))  # a module call opens a step, which never ends
    session.close(timeout=30)
    session.worker._thread.join(30)
    child = session.route.child
    assert child is None or child._proc.wait(30) == 0  # not started, or started and ended by the close
