"""The live capture's step queue and batching thread (capture.worker), on its own: what the training
thread may rely on (never waits, a full queue drops and says so) and what the handler sees (batches
in order, a flush hands over what is queued now, a failing batch does not stop the next)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest

from plasmient_trace.capture import config as capture_config
from plasmient_trace.capture.config import CaptureConfig
from plasmient_trace.capture.worker import StepWorker


@dataclass
class Step:
    step: int
    full: bool = False


@pytest.mark.parametrize("full", [False, True])
def test_a_full_queue_drops_the_step_at_once_and_says_so(full):
    release = threading.Event()
    config = CaptureConfig(queue_steps=3, queue_step_depth_steps=3, export_interval_s=0.0, environ={})
    worker = StepWorker(config, lambda items: release.wait(30))
    worker.start()
    try:
        assert worker.offer(Step(0, full))  # taken by the thread, whose handler now blocks
        while worker.queued():  # until the thread has taken step 0 off the queue
            threading.Event().wait(0.01)
        assert [worker.offer(Step(i, full)) for i in range(1, 5)] == [True, True, True, False]
        assert worker.unfinished() == 4  # the one being handled and three queued; the fifth was never queued
    finally:
        release.set()
    assert worker.flush(30) and worker.unfinished() == 0


def test_step_depth_steps_wait_apart_from_full_depth_ones():
    # one bound of 64 for both: a loop of 0.4 ms steps lost 474 of 1,000 while the worker stitched a batch
    release = threading.Event()
    config = CaptureConfig(queue_steps=2, export_interval_s=0.0, max_batch_steps=100, environ={})
    worker = StepWorker(config, lambda items: release.wait(30))
    worker.start()
    try:
        assert worker.offer(Step(0))
        while worker.queued():
            threading.Event().wait(0.01)
        assert all(worker.offer(Step(i)) for i in range(1, 1001))  # a thousand small steps wait
        assert [worker.offer(Step(i, True)) for i in range(3)] == [True, True, False]  # two full-depth ones
        assert worker.backlog() == 2 + 1000 // 100  # full-depth steps, and a batch's worth of the others each
    finally:
        release.set()
    assert worker.flush(30) and worker.unfinished() == 0


def test_steps_collected_within_the_interval_are_one_batch_and_a_flush_hands_them_over_now():
    batches: list[list[int]] = []
    worker = StepWorker(CaptureConfig(export_interval_s=600.0, environ={}),
                        lambda items: batches.append([s.step for s in items]))
    worker.start()
    for i in range(5):
        assert worker.offer(Step(i))
    assert worker.flush(30)  # well before the 600 s interval ends
    assert batches == [[0, 1, 2, 3, 4]]


def test_full_depth_steps_per_batch_are_bounded_apart_from_step_depth_ones():
    batches: list[list[int]] = []
    gate = threading.Event()
    seen = []

    def handle(items):
        gate.wait(30)
        batches.append([s.step for s in items])
        seen.append(sum(s.full for s in items))

    cfg = CaptureConfig(export_interval_s=600.0, max_batch_steps=256, max_batch_full_steps=2, environ={})
    worker = StepWorker(cfg, handle)
    for i in range(6):
        assert worker.offer(Step(i, full=i % 2 == 0))  # full, step, full, step, full, step
    worker.start()
    gate.set()
    assert worker.flush(30)
    assert sum(batches, []) == list(range(6))  # in order, each once
    assert max(seen) == 2 and batches[0] == [0, 1, 2]  # the batch ends at its second full-depth step


def test_a_failing_batch_is_reported_once_and_later_batches_still_go(capsys, monkeypatch):
    monkeypatch.setattr(capture_config, "_said", set())  # said once per process: earlier tests may have said it
    handled: list[int] = []

    def handle(items):
        if items[0].step == 0:
            raise ValueError("bad records")
        handled.extend(s.step for s in items)

    worker = StepWorker(CaptureConfig(export_interval_s=0.0, environ={}), handle)
    worker.start()
    for failing in (0, 0):
        worker.offer(Step(failing))
        assert worker.flush(30)
    worker.offer(Step(1))
    assert worker.flush(30)
    worker.stop()
    assert handled == [1]
    err = capsys.readouterr().err
    assert err.count("a step could not be traced (ValueError: bad records); later steps continue") == 1


class _CountingEvent(threading.Event):
    def __init__(self) -> None:
        super().__init__()
        self.sets = 0

    def set(self) -> None:
        self.sets += 1
        super().set()


def test_step_depth_steps_wake_the_thread_once_a_quarter_of_the_queue_waits():
    """Each wake is a GIL hand-off the training thread pays for. Step-depth steps wake the batching thread
    only once a quarter of the queue waits (it moves them into its batch, so 40 steps pass a queue of 16
    within one interval, none dropped); a full-depth step wakes it at once (it counts against
    max_batch_full_steps). Every step before the flush is in its one batch, in order."""
    batches: list[list[int]] = []
    worker = StepWorker(CaptureConfig(queue_steps=16, export_interval_s=600.0, environ={}),
                        lambda items: batches.append([s.step for s in items]))
    worker._arrived = wakes = _CountingEvent()
    worker.start()
    for i in range(40):
        assert worker.offer(Step(i))
        time.sleep(0.02)  # a training step's worth: the thread takes what woke it before the next step
    assert 5 <= wakes.sets <= 40 // 4 + 4  # was one a step
    before = wakes.sets
    assert worker.offer(Step(40, full=True))
    assert wakes.sets == before + 1
    assert worker.flush(30)
    assert batches == [list(range(41))]


def test_a_batch_processed_while_the_interpreter_exits_imports_what_it_needs(tmp_path):
    """A job shorter than the worker's background import of the processing modules ends with its steps still
    queued: the exit flush then imports them while Python is shutting down, when threading no longer takes
    exit hooks. An import that registers one there (concurrent.futures.process does) raised "can't register
    atexit after shutdown", and every step of the job was lost with a line in its stderr."""
    import subprocess
    import sys

    script = tmp_path / "late_import.py"
    script.write_text(
        "import sys, threading\n"
        "import torch  # the job's\n"
        "def late():\n"
        "    from plasmient_trace.capture import worker\n"
        "    worker._import_processing_or_raise()\n"
        "    from plasmient_trace.capture import batches  # what StepWorker's handle calls\n"
        "    from plasmient_trace.export import delivery, otlp, sinks, spill  # and what delivers\n"
        "    import grpc  # the OTLP/gRPC client, imported at the first export\n"
        "    print('imported', 'concurrent.futures.process' in sys.modules)\n"
        "threading._register_atexit(late)  # runs where the exit flush runs: after threading's shutdown began\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == "imported False\n", proc.stderr
