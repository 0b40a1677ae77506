"""The live capture's background thread: finished steps in a bounded queue, handled in batches.

The training thread only offers a step (:meth:`StepWorker.offer`: never waits; a full queue drops the
step and says so to the caller). The thread collects steps for up to ``export_interval_s``, as
OpenTelemetry's batch span processor collects spans: one stitch and one export for many steps costs the
job far less than one per step. A flush or the arrival of enough steps ends the collection early. What a
batch is turned into, and where it goes, is the ``handle`` callable's business (the session's:
``batches.process`` then the delivery).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

from .config import CaptureConfig, say_once


def _import_processing_or_raise() -> None:
    """Import what processing a batch needs. Nothing on this path may register a threading exit hook at
    import (``concurrent.futures.process`` does): a short job's exit flush imports it while Python shuts
    down, when threading refuses them."""
    from .. import pipeline  # noqa: F401
    from ..export import otlp_json  # noqa: F401
    from ..sources import kineto  # noqa: F401
    from ..stitch import step_facts  # noqa: F401
    from . import cupti, kineto_fallback, torch_hooks  # noqa: F401


def _import_processing() -> None:
    """Import what processing a batch needs now, while the job warms up, not at the first step end, and
    never during interpreter exit if it can be helped: defining a dataclass there (an exec of its source)
    resets CPython's note of an unhandled KeyboardInterrupt, and a job stopped by Ctrl-C before its first
    export would exit with status 1 instead of dying of SIGINT."""
    try:
        _import_processing_or_raise()
    except Exception:
        pass


class StepWorker:
    """A bounded step queue and the daemon thread that empties it in batches."""

    def __init__(self, config: CaptureConfig, handle: Callable[[list[Any]], None],
                 prepare: Callable[[], None] | None = None) -> None:
        self.config = config
        self._handle = handle
        self._prepare = prepare  # run first on the thread (it may start a process: not the training thread's time)
        # unbounded as a queue: offer() holds the bounds (full-depth steps apart from the rest)
        self._queue: queue.Queue = queue.Queue()
        self._count_lock = threading.Lock()
        self._full_waiting = 0
        self._step_depth_waiting = 0
        self._flush_now = threading.Event()
        self._arrived = threading.Event()  # steps to take now, or a flush asked for the batch now
        self._wake_at = max(1, min(config.max_batch_steps, config.queue_steps // 4))
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="plasmient-export", daemon=True)
        self._thread.start()

    def offer(self, step: Any) -> bool:
        """Queue a finished step; False (the step is dropped) when its kind's bound is reached: ``queue_steps``
        full-depth steps, ``queue_step_depth_steps`` others."""
        with self._count_lock:
            if step.full:
                if self._full_waiting >= self.config.queue_steps:
                    return False
                self._full_waiting += 1
            else:
                if self._step_depth_waiting >= self.config.queue_step_depth_steps:
                    return False
                self._step_depth_waiting += 1
        self._queue.put_nowait(step)
        # Waking the thread for every step costs the training thread a GIL hand-off a step. It is woken by
        # a full-depth step (counted against batch_full_steps()) and by a quarter of the queue waiting,
        # which it moves into its batch (the queue stays far from full and from the backlog at which
        # full-depth steps are put off); otherwise it takes what waits at its interval's end.
        if step.full or self._queue.qsize() >= self._wake_at:
            self._arrived.set()
        return True

    def backlog(self) -> int:
        """How far behind the worker is, in full-depth steps: those queued and not yet taken into a batch, plus
        one for every ``max_batch_steps`` step-depth steps (the steps one batch takes)."""
        with self._count_lock:
            return self._full_waiting + self._step_depth_waiting // max(1, self.config.max_batch_steps)

    def queued(self) -> int:
        """Steps queued and not yet taken into a batch."""
        return self._queue.qsize()

    def _taken(self, step: Any) -> None:
        with self._count_lock:
            if step.full:
                self._full_waiting -= 1
            else:
                self._step_depth_waiting -= 1

    def unfinished(self) -> int:
        """Steps queued or in the batch being handled."""
        return self._queue.unfinished_tasks

    def flush(self, timeout: float) -> bool:
        """Wait until every queued step is handled (True) or ``timeout`` passes (False)."""
        self._flush_now.set()
        self._arrived.set()  # a batch being collected is handled now, not at its interval's end
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self._queue.unfinished_tasks == 0:
                    return True
                time.sleep(0.005)
            return self._queue.unfinished_tasks == 0
        finally:
            self._flush_now.clear()

    def stop(self) -> None:
        """Ask the thread to end once the queue is empty (a wedged handler dies with the process: the thread
        is a daemon)."""
        self._queue.put_nowait(None)
        self._arrived.set()

    def _run(self) -> None:
        if self._prepare is not None:
            try:
                self._prepare()
            except Exception as err:
                say_once("process", f"the capture's worker could not prepare ({type(err).__name__}: {err})")
        _import_processing()
        stop = False
        while not stop:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            self._taken(item)
            items = [item]
            deadline = time.monotonic() + self.config.export_interval_s
            # Step-depth steps are small (a step span and its kernels): up to max_batch_steps of them spread
            # the batch's fixed cost; full-depth ones (every op) are bounded apart, for memory.
            full = int(item.full)
            full_steps = self.config.batch_full_steps()
            while len(items) < self.config.max_batch_steps and full < full_steps:
                try:
                    nxt = self._queue.get_nowait()  # what is queued goes in, the interval's end included
                except queue.Empty:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or self._flush_now.is_set():
                        break  # a flush takes what is queued now, in one batch
                    self._arrived.clear()
                    if self._queue.empty():  # looked again after clearing: a wake since the look still counts
                        self._arrived.wait(remaining)
                    continue
                if nxt is None:
                    self._queue.task_done()
                    stop = True
                    break
                self._taken(nxt)
                items.append(nxt)
                full += int(nxt.full)
            try:
                self._handle(items)
            except Exception as err:
                say_once("process", f"a step could not be traced ({type(err).__name__}: {err}); later steps continue")
            finally:
                for _ in items:
                    self._queue.task_done()
