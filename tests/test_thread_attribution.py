"""Which threads' ops belong to a step: the thread that ran it, threads that ran its nn.Module calls, the autograd
engine's and collectives'. A user's background thread working during the step (a metrics or EMA thread, a
prefetcher doing tensor math) is not the model's work: its ops stay out of the step and its FLOPs, as torch's
FlopCounterMode leaves them out, and each step counts them (``plasmient.ops.other_threads``).

The oracle is FlopCounterMode on the same step run alone, and for the Kineto path the raw trace's own events."""

from __future__ import annotations

import json
import threading

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

BACKGROUND_MATMULS = 6


class _Background:
    """A thread that, when told, runs BACKGROUND_MATMULS 256x256 matmuls and says it is done: the training
    thread waits for it, so the work falls inside the step for certain."""

    def __init__(self) -> None:
        self.go, self.done, self.stop = threading.Event(), threading.Event(), False
        self.a = torch.randn(256, 256)
        self.thread = threading.Thread(target=self._run, name="user-background", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            self.go.wait()
            self.go.clear()
            if self.stop:
                return
            for _ in range(BACKGROUND_MATMULS):
                torch.mm(self.a, self.a)
            self.done.set()

    def work_now(self) -> None:
        self.done.clear()
        self.go.set()
        assert self.done.wait(60)

    def close(self) -> None:
        self.stop = True
        self.go.set()
        self.thread.join(60)


def _model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 128)), torch.randn(32, 128)


def _train_step(model: nn.Module, x: torch.Tensor, background: _Background | None) -> None:
    loss = model(x).pow(2).mean()
    if background is not None:
        background.work_now()
    loss.backward()


def _flop_counter_step(model: nn.Module, x: torch.Tensor) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        _train_step(model, x, None)
    return counter.get_total_flops()


def test_a_background_threads_ops_stay_out_of_the_live_steps_flops():
    from capture_helpers import live_capture

    model, x = _model()
    _train_step(model, x, None)
    expected = _flop_counter_step(model, x)
    background = _Background()
    try:
        with live_capture(every=1, peak_tflops=0.05, job_id="threads") as (session, sink):
            for _ in range(3):
                with session.step():
                    _train_step(model, x, background)
    finally:
        background.close()
    steps = [r for r in sink.rows() if r["plasmient.level"] == "step"]
    assert len(steps) == 3
    background_flops = BACKGROUND_MATMULS * 2 * 256 ** 3
    assert background_flops > expected  # counted, they would more than double the step
    for step in steps:
        # FlopCounterMode counts the GEMMs; plasmient also the bias adds, ReLU and loss, a few percent here
        assert expected <= step["plasmient.flops"] <= 1.05 * expected, (step["plasmient.flops"], expected)
        assert step["plasmient.ops.other_threads"] >= BACKGROUND_MATMULS
    ops = [r for r in sink.rows() if r["plasmient.level"] == "op"]
    assert not [r for r in ops if r["name"] == "aten::mm" and r.get("plasmient.flops") == 2 * 256 ** 3]


def test_a_modules_worker_thread_is_the_steps_work():
    """The forward run on another thread (as nn.DataParallel's replicas are): its modules tie the thread to
    the step, and its FLOPs count."""
    from concurrent.futures import ThreadPoolExecutor

    from capture_helpers import live_capture

    model, x = _model()
    _train_step(model, x, None)
    expected = _flop_counter_step(model, x)
    with ThreadPoolExecutor(1) as pool, live_capture(every=1, peak_tflops=0.05, job_id="threads") as (session, sink):
        for _ in range(2):
            with session.step():
                loss = pool.submit(lambda: model(x).pow(2).mean()).result()
                loss.backward()
    steps = [r for r in sink.rows() if r["plasmient.level"] == "step"]
    assert len(steps) == 2
    for step in steps:
        assert expected <= step["plasmient.flops"] <= 1.05 * expected, (step["plasmient.flops"], expected)
        assert step["plasmient.ops.other_threads"] == 0


def test_a_profiled_background_thread_is_counted_apart_on_ingest(tmp_path):
    """The same job under torch.profiler, ingested: the step holds the training thread's work, and its count of
    other threads' ops is the raw trace's number of the background thread's ops inside the ProfilerStep."""
    from torch.profiler import ProfilerActivity, profile, schedule

    from plasmient_trace.cli import main
    from test_cpu_own_work import _spans_of

    model, x = _model()
    _train_step(model, x, None)
    expected = _flop_counter_step(model, x)
    # torch.profiler records other threads' ops only when asked to (profile_all_threads)
    every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    background = _Background()
    try:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True, experimental_config=every_thread,
                     schedule=schedule(wait=0, warmup=1, active=2, repeat=1)) as prof:
            for _ in range(3):
                _train_step(model, x, background)
                prof.step()
    finally:
        background.close()
    trace = tmp_path / "background.json"
    prof.export_chrome_trace(str(trace))
    out = tmp_path / "spans.jsonl"
    assert main(["ingest", str(trace), "--job-id", "threads", "--out", str(out), "--quiet", "--peak-tflops", "0.05"]) == 0

    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    steps_raw = [e for e in events if e["name"].startswith("ProfilerStep#")]
    step_tid = {e["tid"] for e in steps_raw}
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    mm_tids = {e["tid"] for e in ops if e["name"] == "aten::mm" and e["tid"] not in step_tid}
    assert len(mm_tids) == 1, "the background thread's matmuls are in the trace, on a thread of their own"
    expected_other = {}
    for s in steps_raw:
        inside = [e for e in ops if e["tid"] in mm_tids and s["ts"] <= e["ts"] < s["ts"] + s["dur"]]
        expected_other[int(s["name"].split("#")[1])] = len(inside)
    assert all(n >= BACKGROUND_MATMULS for n in expected_other.values())

    steps = [s for s in _spans_of(out.read_bytes().splitlines()) if s["plasmient.level"] == "step"]
    assert sorted(int(s["plasmient.step"]) for s in steps) == sorted(expected_other)
    for s in steps:
        assert int(s["plasmient.ops.other_threads"]) == expected_other[int(s["plasmient.step"])]
        assert expected <= s["plasmient.flops"] <= 1.05 * expected, (s["plasmient.flops"], expected)


def test_a_profiled_forward_on_a_pool_thread_is_the_steps_work_without_module_events(tmp_path):
    """torch.profiler without with_stack records no module events: a forward run on another thread (as
    nn.DataParallel's replicas run) is tied to the step by its autograd nodes, which the step's backward ran."""
    from concurrent.futures import ThreadPoolExecutor

    from torch.profiler import ProfilerActivity, profile, schedule

    from plasmient_trace.cli import main
    from test_cpu_own_work import _spans_of

    model, x = _model()
    _train_step(model, x, None)
    expected = _flop_counter_step(model, x)
    every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with ThreadPoolExecutor(1) as pool:
        pool.submit(lambda: None).result()  # the thread exists before the profiler starts, as a replica's would
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True, experimental_config=every_thread,
                     schedule=schedule(wait=0, warmup=1, active=2, repeat=1)) as prof:
            for _ in range(3):
                loss = pool.submit(lambda: model(x).pow(2).mean()).result()
                loss.backward()
                prof.step()
    trace = tmp_path / "pool.json"
    prof.export_chrome_trace(str(trace))
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    step_tid = {e["tid"] for e in events if e["name"].startswith("ProfilerStep#")}
    assert any(e["name"] == "aten::addmm" and e["tid"] not in step_tid for e in events), "the forward ran elsewhere"
    assert not any(e.get("cat") == "python_function" for e in events)
    out = tmp_path / "spans.jsonl"
    assert main(["ingest", str(trace), "--job-id", "pool", "--out", str(out), "--quiet", "--peak-tflops", "0.05"]) == 0
    steps = [s for s in _spans_of(out.read_bytes().splitlines()) if s["plasmient.level"] == "step"]
    assert len(steps) == 2
    for s in steps:
        assert int(s["plasmient.ops.other_threads"]) == 0
        assert expected <= s["plasmient.flops"] <= 1.05 * expected, (s["plasmient.flops"], expected)
