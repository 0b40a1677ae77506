"""Where a live session's finished batches go: to the batch process (``PLASMIENT_WORKER=process``, the
default: ``capture.batch_process``) or through this process's own stitch and delivery, and the hand-over
from the one to the other when the child dies or the job turns multi-rank.

Everything here runs on the session's batching thread (``capture.worker``), except :meth:`BatchRoute.start`
(the session's start) and :meth:`BatchRoute.close` (its close), which take turns with it through a lock.
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING, Any

from . import batch_process, batches, distributed
from .config import build_delivery, notice, report_delivery, say_once, say_where

if TYPE_CHECKING:
    from .session import CaptureSession, StepCapture

_MULTI_RANK_KEEPS_THREAD = ("PLASMIENT_WORKER=process: a multi-rank job keeps the worker thread (its fleet spans "
                            "need the process group)")


class BatchRoute:
    """One session's route for its batches; ``delivery`` is set where this process delivers them itself,
    ``child`` while the batch process does."""

    def __init__(self, session: CaptureSession) -> None:
        self.session = session
        self.delivery: Any = None
        self.child: batch_process.BatchProcess | None = None
        self.first_step = threading.Event()  # set when a step first begins, or at close: the child starts then
        self._turn = threading.Lock()  # the batching thread's and close()'s turns with the child
        self._cwd: str | None = None

    def start(self) -> None:
        """At the session's start: this process's delivery now, unless the batch process will deliver."""
        s = self.session
        # A relative PLASMIENT_OUT (and the default traces.jsonl) is where the job started, as the delivery built
        # now opens it; a job that changes directory later (Hydra's run dir) does not move it.
        try:
            self._cwd = os.getcwd()
        except OSError:  # started in a directory since removed: the child starts where it can
            self._cwd = None
        if not self.wants_child():
            self.delivery = build_delivery(s.config, s.resource, s._exporters)
            say_where(self.delivery, s.job_id)

    def wants_child(self) -> bool:
        """PLASMIENT_WORKER=process, where the child can do all the batches' work: not with exporters given
        in-process, nor in a multi-rank job, whose fleet spans need its process group."""
        s = self.session
        if s.config.worker != "process" or s._exporters is not None:
            return False
        try:
            ranks = int(s.config.environ.get("WORLD_SIZE") or 1)
        except ValueError:
            ranks = 1
        if ranks > 1 or self.multi_rank():
            notice("worker-thread", _MULTI_RANK_KEEPS_THREAD)
            return False
        return True

    def multi_rank(self) -> bool:
        return distributed.active()

    def prepare(self) -> None:
        """On the batching thread, when the first step begins (while it runs, before its batch is due): the
        batch process. Not at start: a process that runs no step (a spawned DataLoader worker, whose capture
        closes at its first module call, a torchrun agent) starts no interpreter."""
        if self.delivery is not None:
            return
        self.first_step.wait()
        if self._nothing_to_stitch():
            return
        s = self.session
        try:
            child = batch_process.BatchProcess()
            child.start(s.config, s.resource, cwd=self._cwd)
            self.child = child
            if self._nothing_to_stitch():  # the job closed the capture while the child started, with no step queued
                child.close(0.0)
                self.child = None
        except Exception as err:
            say_once("batch-process", f"PLASMIENT_WORKER=process: the batch process could not start "
                                      f"({type(err).__name__}: {err}); steps are stitched in this process")
            self._back_to_thread()

    def _nothing_to_stitch(self) -> bool:
        """Closed with no step queued (a step still open at close is dropped): none will come. Counted from the
        steps offered, not the queue, which holds the stop's sentinel (a torchrun agent, which imports torch and
        runs no step, started a child at its exit)."""
        s = self.session
        return s.closed and s.stats["steps"] == s.stats["steps_dropped"]

    def _back_to_thread(self, memory: batches.BatchMemory | None = None) -> None:
        s = self.session
        self.child = None
        if memory is not None:
            s.memory.measured, s.memory.preceding, s.memory.last_full = (
                memory.measured, memory.preceding, memory.last_full)
        if self.delivery is None:
            self.delivery = build_delivery(s.config, s.resource, s._exporters)

    def handle(self, items: list[StepCapture]) -> None:
        """One batch: stitched and delivered by the child, else here."""
        s = self.session
        cpu = time.thread_time()
        if self.child is not None:
            with self._turn:
                if self._in_child(items, cpu):
                    return
        if self.delivery is None:  # a batch after the job closed with nothing queued (not expected): still written
            self._back_to_thread()
        self.delivery.submit(batches.process(s, items))  # local sinks now, the network in the delivery thread
        s.stats["exported_batches"] += 1
        s.stats["export_errors"] = self.delivery.stats.local_errors
        s._budget.measured(time.thread_time() - cpu, sum(c.full for c in items))

    def _in_child(self, items: list[StepCapture], cpu: float) -> bool:
        """The batch stitched and delivered by the batch process (True); False when this thread must do it:
        the child is gone (said once; what it remembered of earlier batches is lost with it, so steps of
        shapes it measured carry no FLOPs until measured again), or the job became multi-rank."""
        s, child = self.session, self.child
        assert child is not None
        try:
            if self.multi_rank():
                memory = child.handover(s.config.flush_timeout_s)
                notice("worker-thread", _MULTI_RANK_KEEPS_THREAD)
                self._back_to_thread(memory)
                return False
            reply = child.handle(s, items)
        except Exception as err:  # gone, or a failure of our own on the way to it: either way the thread takes over
            why = err if isinstance(err, batch_process.WorkerGone) else f"{type(err).__name__}: {err}"
            say_once("batch-process", f"PLASMIENT_WORKER=process: {why}; later steps are stitched in this process, "
                                      "and steps carry no FLOPs until their shapes are measured again")
            if not isinstance(err, batch_process.WorkerGone):
                child.close(0.0)
            self._back_to_thread()
            return False
        if reply["want_full"]:
            s.memory.want_full = True
        s.stats["exported_batches"] += 1
        s.stats["batches_in_child"] += 1
        s.stats["export_errors"] = reply["local_errors"]
        s._budget.measured(time.thread_time() - cpu + reply["cpu_s"], sum(c.full for c in items))
        if reply["error"]:
            raise RuntimeError(reply["error"])  # the worker says it once, as for a batch of its own
        return True

    def close(self, deadline: float) -> None:
        """After the batching thread stopped: what the child or the delivery holds is delivered by ``deadline``
        (time.monotonic); what the network has not taken by then goes to the spill directory."""
        if self.child is not None:
            # not while the batching thread still waits for a batch (a flush that timed out): the child then
            # sees the socket close at exit and delivers what it has by itself
            if self._turn.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
                try:
                    if self.child is not None:
                        self.child.close(max(deadline - time.monotonic(), 0.0))
                finally:
                    self._turn.release()
        if self.delivery is not None:
            self.delivery.shutdown(max(deadline - time.monotonic(), 0.0))
            report_delivery(self.delivery.stats)
