"""The live capture session: step boundaries, per-step RecordSets, and the hand-off to the one pipeline.

On the training thread the session only flips hooks on and off at step boundaries (which torch calls
mark them: ``capture.step_hooks``) and swaps record lists; which recorders it uses (op hook, CUPTI or the
Kineto fallback, NVML, the CPU's peak) is ``capture.live_sources``. A background thread
(``capture.worker``) batches finished steps, turns them into a RecordSet and runs
``pipeline.stitch_records`` on it (the same joins, metrics and span tree as offline ingest:
``capture.batches``), and hands the spans to the same :class:`..export.delivery.Delivery` as ingest: the
file at once, the network from its own bounded queue, the spill directory when the collector is down.
The step queue is bounded: if stitching falls behind, new steps are dropped and counted, never waited
for, so tracing cannot slow or block a step. Every tracing error is caught, reported once on stderr,
and never raised into the job.

Sampling: every step gets a cheap step span (no op or module hooks); every ``every``-th step, the
step after one whose estimated MFU fell below ``mfu_threshold``, and every step whose input-shape
signature was never captured (``capture.signature``: the shapes of the step's first module call with a
tensor, and of that module's later calls; at most ``max_signatures`` of them) is captured at full depth
(modules, ops, kernels). A step-depth step has no op shapes of its own: it carries the FLOPs of the
latest full-depth step with its signature (``plasmient.flops.source = carried``), else its FLOPs and
MFU are absent (``unknown``). These per-step facts go to the stitcher as ``stitch.step_facts.StepFacts``,
which writes the attributes as it builds the rows; nothing edits the stitched table afterwards.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass, field
from time import perf_counter_ns
from typing import Any, Iterator

import pyarrow as pa

from . import autostart, batches, distributed, signature, step_hooks
from .batch_route import BatchRoute
from .budget import FullDepthBudget
from .inductor_kernels import InductorKernelNames, frames_compiled as _frames_compiled
from .live_sources import LiveSources
from .worker import StepWorker
from .config import (
    CaptureConfig,
    Exporter,
    build_delivery,
    default_out_path,
    say_once,
)

__all__ = ["CaptureConfig", "CaptureSession", "StepCapture", "build_delivery", "default_out_path", "say_once"]

# ---------------------------------------------------------------------------------------------
# Steps


@dataclass
class StepCapture:
    """Everything one finished step left behind, handed to the worker thread."""

    step: int
    name: str
    start_ns: int
    end_ns: int
    full: bool
    ops: Any = None            # the op recorder's chunk for this step (see torch_hooks)
    op_recorder: Any = None    # the recorder that made it, whose .table() reads it
    modules: list[tuple] = field(default_factory=list)
    kineto: str | None = None  # this step's exported torch.profiler trace (Kineto fallback)
    dropped: int | None = 0    # CUPTI records dropped during the step (None: CUPTI would not say)
    samples: pa.Table | None = None
    signature: str | None = None  # input-shape signature of the step's first module call with tensors and the
    #                               shapes of that module's later calls in the step
    compiled: bool = False        # torch.compile traced a frame during the step: its ops include the compiler's
    tid: int | None = None        # the thread that opened the step (ops of threads unrelated to it stay out)
    opened_at_call: bool = False  # opened at its first module call, not at a boundary (plasmient.step.opened_at)


# Ops a step-depth step may record on average before its first module call keeps it at step depth (they are
# dropped) before the session stops recording there (``CaptureSession._drop_pre_recorded``).
PRE_RECORD_MAX_OPS = 256

# How long a full-depth step's end waits for the async ops it began (a collective's work on a process group's
# thread, ended there just after the training thread was woken) before the op observer stops: past it, such an
# op is not in the step. Gloo ends them within microseconds on an idle machine; the bound allows for a loaded
# one, where that thread may wait a scheduler slice or two before it runs (10 ms was the audit's first bound).
# It is spent whole only where an async op stays open past a full step's end (a collective the job waits for
# in a later step), at most once per full-depth step.
ASYNC_OP_WAIT_S = 0.05

_STEP_NAMES = {"optimizer": "optimizer.step#{n}", "profiler": "ProfilerStep#{n}", "explicit": "step#{n}"}


def _backlog_limit(queue_steps: int) -> int:
    """Queued steps from which a full-depth step is put off: half the queue, so step-depth steps
    (cheap to stitch) still have room while the worker catches up."""
    return max(1, queue_steps // 2)


def _in_data_loader_worker() -> bool:
    try:
        from torch.utils.data import get_worker_info

        return get_worker_info() is not None
    except Exception:
        return False


class CaptureSession:
    """One process's live capture. ``start()`` installs the hooks; ``close()`` flushes and removes them."""

    def __init__(self, config: CaptureConfig | None = None, exporters: list[tuple[str, Exporter]] | None = None) -> None:
        self.config = config or CaptureConfig.from_env()
        self._exporters = exporters
        self.started = False
        self.closed = False
        self.failed = False
        self.step_index = 0
        self.stats = {"steps": 0, "steps_full": 0, "steps_deferred": 0, "samples_held": 0, "steps_dropped": 0,
                      "steps_too_many_ops": 0, "exported_batches": 0, "export_errors": 0,
                      "batches_in_child": 0}
        self._budget = FullDepthBudget(self.config.overhead)
        self._kind: str | None = None  # the step clock between explicit steps: optimizer | profiler, first seen
        self._explicit_depth = 0  # explicit step contexts entered and not left (nested ones join the outer)
        self._explicit_seen = False
        self._step_explicit = False  # the open step is an explicit one
        self._forked_child = False  # this is a fork()ed child's copy of its parent's session (detach_in_child)
        self._open = False
        self._full = False
        self._full_owed = False  # a sampled full-depth step was put off while the worker was behind
        self._pre_recording = False  # a step-depth step records ops until its first module call decides
        self._pre_recorded = [0, 0]  # steps and ops recorded before a first module call that kept them at step depth
        self._pre_record_off = False
        self._step_start = 0
        self._step_thread: int | None = None
        self._mode_entered = False
        self.route = BatchRoute(self)  # the batch process, or this process's own stitch and delivery
        self.worker = StepWorker(self.config, self.route.handle, prepare=self.route.prepare)
        self.memory = batches.BatchMemory()  # what each batch leaves the next (worker thread)
        self._lock = threading.RLock()
        self.signatures = signature.StepSignatures(self.config.max_signatures)  # training thread only
        self._patched: list[tuple[Any, str, Any]] = []
        self.inductor_kernels = InductorKernelNames(self.config.environ)
        self._opt_hook: Any = None
        self._opt_clock: Any = None
        self._opt_rival: Any = None  # weakref: an optimizer that stepped since the clock last did
        self._opt_rival_steps = 0    # its steps since then
        self._opt_longest_run = 0    # the most steps another optimizer made between two clock steps
        self._opt_wrapped_depth = 0
        self.sources = LiveSources(self.config)
        self._user_profilers = 0   # the job's own torch.profiler runs now active
        self.resource: dict[str, Any] = {}
        self.job_id = ""
        self.job_id_shared = False

    # ---- lifecycle
    def start(self) -> "CaptureSession":
        if self.started:
            return self
        try:
            self._start()
        except Exception as err:
            self._fail("start", err)
        return self

    def _start(self) -> None:
        import torch

        from ..sources.resource import resource_from_env
        from . import op_tables, torch_hooks

        cfg = self.config
        self.resource = resource_from_env(cfg.environ)
        named = cfg.job_id or self.resource.get("plasmient.job.id")
        # Named by the environment: every rank has it. Else this process's own, which the ranks of a
        # multi-rank run replace with rank 0's at their first batch (batches.agree_job_id).
        self.job_id_shared = bool(named)
        self.job_id = named or f"{self.resource['host.name']}-{os.getpid()}-{time.strftime('%Y%m%dT%H%M%S')}"
        self.resource["plasmient.job.id"] = self.job_id
        # service.name travels as IngestOptions.service_name (OTEL_SERVICE_NAME, else the one
        # OTEL_RESOURCE_ATTRIBUTES named); the stitcher puts it on every resource.
        service = self.resource.pop("service.name", None)
        if cfg.service_name is None and service and service != "plasmient-trace":
            cfg.service_name = str(service)
        self._epoch = op_tables.epoch_offset_ns()
        self._pid = os.getpid()

        self.resource["plasmient.source"] = self.sources.label()
        self.sources.choose_op_recorder()
        self.modules = torch_hooks.ModuleRecorder(on_forward=self._on_forward, on_signature=self._on_signature,
                                                  on_repeat=self.signatures.repeat, on_root=self.signatures.other_model,
                                                  on_backward=self.signatures.backward_pass,
                                                  on_kwargs=self.signatures.model_kwargs)
        self.modules.limit = cfg.max_step_ops
        self.modules.install()
        self.inductor_kernels.install()
        step_hooks.install(self, torch)
        self.route.start()
        self.worker.start()
        self.started = True

    def close(self, timeout: float | None = None) -> None:
        """Stop capturing, export what is queued (waiting at most ``timeout`` s), remove the hooks."""
        if self.closed or not self.started:
            self.closed = True
            return
        self.closed = True
        self.route.first_step.set()  # a batching thread still waiting to start the batch process: it need not now
        # The job ran its model but never ended a step: the open one is dropped, and the user is told why.
        never_ended = self._open and self.stats["steps"] == 0 and not self.failed
        try:
            with self._lock:
                self._exit_mode()
                # The native observer is process-wide and outlives us: it must not keep calling
                # into this session's CUPTI after close.
                self.sources.ops.set_correlation(None, None)
                if self.sources.kineto is not None:
                    self.sources.kineto.abort()
                self._open = False
                self.modules.enabled = False
                self.modules.uninstall()
                self.inductor_kernels.uninstall()
                if self._opt_hook is not None:
                    self._opt_hook.remove()
                for owner, name, original in self._patched:
                    setattr(owner, name, original)
                self._patched = []
            if timeout is None:
                timeout = self.config.flush_timeout_s
                if distributed.active():
                    # rank 0 may still be waiting for the slowest rank's last summary
                    timeout = max(timeout, distributed.wait_s(self.config.environ) + 2.0)
            deadline = time.monotonic() + timeout
            if not self.flush(timeout):
                say_once("flush-timeout", f"{self.worker.unfinished()} step(s) still being traced after "
                                          f"{timeout:g}s at exit were not written (PLASMIENT_FLUSH_TIMEOUT_S)")
            self.worker.stop()
            self.route.close(deadline)
            self.sources.stop()
        except Exception as err:
            self._fail("close", err)
        if never_ended and not autostart.note_started("no-step"):  # else `plasmient run` says it for the command
            say_once("no-step", autostart.NO_STEP)
        if self.stats["steps_deferred"]:
            say_once("deferred", f"{self.stats['steps_deferred']} step(s) due at full depth ran at step depth: "
                                 "the background stitch fell behind (raise PLASMIENT_EVERY)")
        if self.stats["steps_dropped"]:
            say_once("dropped", f"{self.stats['steps_dropped']} step(s) were not exported: the exporter fell behind")

    def detach_in_child(self) -> None:
        """After fork(), in the child: stop tracing without flushing (the worker thread stayed in the parent)
        and without taking a lock another thread may have held at the fork."""
        self.closed = True
        self._open = False
        self._forked_child = True
        try:
            self.modules.enabled = False
            if self._mode_entered:  # a full-depth step was open: the child's ops must not pile up unread
                self._mode_entered = False
                self.sources.ops.__exit__(None, None, None)
        except Exception:
            pass

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued step is exported (True) or ``timeout`` passes (False)."""
        return self.worker.flush(timeout)

    def _fail(self, where: str, err: BaseException) -> None:
        """A tracing error: say it once, stop tracing, keep the job running."""
        self.failed = True
        say_once(f"fail-{where}", f"tracing disabled after an error in {where}: {type(err).__name__}: {err}")
        try:
            self._exit_mode()
            if self.sources.kineto is not None:
                self.sources.kineto.abort()
            if hasattr(self, "modules"):
                self.modules.enabled = False
        except Exception:
            pass

    # ---- step boundaries (training thread)
    def _on_forward(self) -> None:
        # The first module forward opens step 0 (before it there is only setup: imports, model build), and
        # after an explicit step the next training step (an eval loop in `with plasmient_trace.step()`
        # between epochs); a job whose only boundaries are explicit steps has nothing between them.
        if (not self._open and not self._explicit_depth and (self._kind is not None or not self._explicit_seen)
                and not self.failed and not self.closed):
            if _in_data_loader_worker():
                # A DataLoader worker started with the spawn method starts its own session, as every
                # process of the job does, and runs modules: torchvision's transforms are nn.Modules. It
                # trains nothing, and its "no step ended" at exit went into the job's stderr, per worker
                # and epoch. Closed before its first step opens, it has nothing to say at exit. (A forked
                # worker has its parent's session, detached: detach_in_child.)
                self.close(0.0)
                return
            try:
                self._begin(perf_counter_ns(), at_call=True)
            except Exception as err:
                self._fail("step", err)

    def mark_step(self, kind: str) -> None:
        """A step boundary of ``kind`` (optimizer | profiler): ends the open step, opens the next.

        The first kind seen is the step clock; boundaries of another kind are ignored, so a loop that
        calls both optimizer.step() and prof.step() still gets one trace per iteration. Inside an explicit
        step (``with plasmient_trace.step()``) the explicit step is the boundary; once explicit steps are
        seen, a boundary with no step open opens none (the next module forward does)."""
        if self.failed or self.closed:
            if self._forked_child:
                # a forked child trains: it is not traced, and says so once (one that only runs modules, a
                # DataLoader worker applying torchvision's transforms, is not news)
                self._forked_child = False
                say_once("forked-child", "this process was forked from a traced one and is not traced "
                                         "(start such processes with the spawn method to trace them)")
            return
        try:
            with self._lock:
                if self._kind is None:
                    self._kind = kind
                if kind != self._kind or self._explicit_depth:
                    return
                now = perf_counter_ns()
                if self._open:
                    self._end(now)
                    now = perf_counter_ns()  # the step end's own work is ours, not the next step's
                elif self._explicit_seen:
                    return  # an optimizer.step() after an explicit step that held the forward and backward
                self._begin(now)
        except Exception as err:
            self._fail("step", err)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """``with plasmient_trace.step():`` - an explicit step (an inference loop, an eval loop between
        training epochs). Optimizer/profiler boundaries still end the steps between explicit ones, so an
        eval loop loses no training step; a training step still open when an explicit one begins (what
        ran after the last optimizer.step()) is dropped, as it ended at no boundary. A step entered inside
        another (a library's step inside the user's loop) is part of it: the outermost one is the step."""
        active = False
        if not (self.failed or self.closed):
            try:
                with self._lock:
                    self._explicit_depth += 1
                    if self._explicit_depth == 1:
                        self._explicit_seen = True
                        if self._open and not self._step_explicit:
                            self._abort_open()
                        if self._open:
                            self._end(perf_counter_ns())
                        self._begin(perf_counter_ns(), explicit=True)
                    active = True
            except Exception as err:
                self._fail("step", err)
        try:
            yield
        finally:
            if active:
                try:
                    with self._lock:
                        self._explicit_depth -= 1
                        if self._explicit_depth == 0 and self._open and not (self.failed or self.closed):
                            self._end(perf_counter_ns())
                except Exception as err:
                    self._fail("step", err)

    def _abort_open(self) -> None:
        if self._open:
            self._pre_recording = False
            self._exit_mode()
            if self.sources.kineto is not None:
                self.sources.kineto.abort()
            self.modules.enabled = False
            self.sources.ops.take()
            self.modules.take()
            self.modules.watch_kwargs = False
            self.signatures.abort()
            self._open = False

    def _begin(self, now: int, explicit: bool = False, at_call: bool = False) -> None:
        """Open a step at ``now``: at a boundary, or (``at_call``) at its first module call, whose signature is
        then its own (``signature.OPENED_AT_CALL``): what ran before that call is in no step."""
        if self.sources.devices_pending:
            self.route.first_step.set()  # the batch process starts beside the first step (its setup is not the job's)
            self._detect_devices()  # CUPTI and NVML start here, the first time: up to seconds
            now = perf_counter_ns()  # the step starts when our setup is done: that time is not the job's
        if self.sources.native_pending:
            self.sources.poll_native()
        every = max(self.config.every, 1)
        self._full = False
        periodic = self.step_index % every == 0
        full = periodic or self.memory.want_full or self._full_owed
        self.memory.want_full = False
        self._full_owed = False
        if full and self.step_index > 0:
            if self.worker.backlog() >= _backlog_limit(self.config.queue_steps):
                # The worker is behind: another full step would only deepen the backlog until whole steps
                # are dropped. This one runs at step depth (it still carries FLOPs); the next step owes it.
                full = False
                self._full_owed = True
                self.stats["steps_deferred"] += 1
            elif not self._budget.allow(now):
                full = False  # over PLASMIENT_OVERHEAD: the sample runs once the budget holds its cost
                self._full_owed = True
                self.stats["samples_held"] += int(periodic)
        self._step_start = now
        self._step_thread = threading.get_native_id()
        self._step_explicit = explicit
        self._open = True
        self.signatures.begin(opened_at_call=at_call)
        self.modules.repeat_module = None
        self.modules.watch_roots = False
        self.modules.watch_kwargs = True
        self._compiled_at_begin = _frames_compiled()
        self.modules.want_signature = True
        if full:
            self._go_full()
            if self.sources.kineto is not None and self.sources.kineto.running:
                self._step_start = perf_counter_ns()  # starting torch.profiler (the fallback) is ours too
        elif self._may_pre_record():
            # The first module call may find a new shape and send the step to full depth: record from the
            # start, so the work before that call (data preparation, a preprocessing op) is measured too.
            self._pre_recording = True
            self._record_api(True)
            self._enter_mode()
        else:
            self._record_api(self.config.cupti_api_always)

    def _may_pre_record(self) -> bool:
        """Through the native observer only: a dispatch mode entered here could not leave mid-step under a
        user's own mode, and torch.profiler (the fallback) starts where the step goes full."""
        from . import torch_hooks

        return (not self._pre_record_off and self.signatures.may_measure() and self.sources.kineto is None
                and isinstance(self.sources.ops, torch_hooks.NativeOpRecorder))

    def _drop_pre_recorded(self) -> None:
        """The step stays at step depth: what it recorded since its start goes. A job that does much before its
        first module call (a DataLoader's transforms on the training thread) would pay for that on every step:
        past PRE_RECORD_MAX_OPS a step on average, the session stops (a new shape is then measured from its
        first module call)."""
        self._pre_recording = False
        self._exit_mode()
        chunk = self.sources.ops.take()
        self._pre_recorded[0] += 1
        self._pre_recorded[1] += len(chunk.get("start_ns", b"")) // 8 + self.sources.ops.taken_over
        steps, ops = self._pre_recorded
        if steps >= 16 and ops > PRE_RECORD_MAX_OPS * steps:
            self._pre_record_off = True
        self._record_api(self.config.cupti_api_always)

    def _go_full(self) -> None:
        """Capture the open step at full depth from now on (its start, or its first module call)."""
        self._full = True
        self._record_api(True)
        self.modules.reset_stack()
        self.modules.enabled = True
        if not self._start_kineto():
            self._enter_mode()

    def _record_api(self, on: bool) -> None:
        """CUPTI's host API records on (full depth: launches join kernels to ops) or off (step depth)."""
        if self.sources.cupti is not None and not self.sources.cupti.record_api(on):
            say_once("cupti-api", f"CUPTI would not {'enable' if on else 'disable'} its API activity kinds: "
                                  + ("full-depth steps may miss kernel -> op joins" if on else
                                     "step-depth steps keep recording launches (more overhead)"))

    def _on_signature(self, module: Any, args: Any) -> None:
        """A module call while the step has no signature (``capture.signature``); a signature never
        measured makes the rest of the step full depth, so later steps can carry its FLOPs."""
        if self.failed or self.closed or not self._open:
            self.modules.want_signature = False
            return
        with self._lock:
            outcome = self.signatures.first_call(module, args, self._full, root=self.modules.root_of(module))
            if outcome == signature.WAIT:
                return
            self.modules.want_signature = False
            if self.signatures.key is not None:
                self.modules.repeat_module = module  # its later calls in the step join the signature
                self.modules.watch_roots = True  # and so do other models' calls
            if outcome == signature.MEASURE:
                self._pre_recording = False
                self._go_full()
            elif self._pre_recording:
                self._drop_pre_recorded()

    def _start_kineto(self) -> bool:
        """Profile this full-depth step with torch.profiler (its ops replace the dispatch hooks');
        False when there is no Kineto fallback, the job's own profiler holds Kineto, or it failed."""
        if self.sources.kineto is None:
            return False
        if self._user_profilers:
            step_hooks.say_kineto_stands_aside()
            return False
        try:
            self.sources.kineto.start_step()
            return True
        except Exception as err:
            say_once("kineto-start", f"torch.profiler could not start ({type(err).__name__}: {err}); "
                                     "full-depth steps carry ops without kernels")
            self.sources.kineto.abort()
            return False

    def _end(self, now: int) -> None:
        trace = None
        if self.sources.kineto is not None and self.sources.kineto.running:
            try:
                trace = self.sources.kineto.end_step()
            except Exception as err:
                say_once("kineto-export", f"torch.profiler trace of a step not exported ({type(err).__name__}: "
                                          f"{err}); such steps carry modules only")
        if self._pre_recording:
            self._drop_pre_recorded()  # no module call decided: the step stays at step depth
        elif self._full and self._mode_entered and hasattr(self.sources.ops, "settle"):
            self.sources.ops.settle(ASYNC_OP_WAIT_S)  # a collective's work ending on its own thread
        self._exit_mode()
        if self.sources.cpu_pending:
            self.sources.start_cpu_calibration()
        self.modules.enabled = False
        self.modules.want_signature = False
        self.modules.repeat_module = None
        self.modules.watch_roots = False
        self.modules.watch_kwargs = False
        self._open = False
        compiled = self._full and _frames_compiled() != self._compiled_at_begin
        if compiled:
            self.signatures.compiled_during()
        full, ops, modules = self._full, None, []
        if full:
            ops, modules = self.sources.ops.take(), self.modules.take()
            over = self.sources.ops.taken_over + self.modules.taken_over
            if over:
                # A step of millions of tiny ops (a Python loop of them) would take a gigabyte and seconds
                # to stitch: it goes out at step depth, and its signature is not measured again. Its
                # recording cost the training thread at most the step's wall: the budget holds that against
                # the periodic samples, which would only be cut short the same way.
                full, ops, modules, trace = False, None, [], None
                self._budget.measured((now - self._step_start) / 1e9, 1)
                self.stats["steps_too_many_ops"] += 1
                say_once("step-ops", f"step {self.step_index} made more than {self.config.max_step_ops:,} op or "
                                     "module calls: it and steps like it go out at step depth, their FLOPs "
                                     "unknown (raise PLASMIENT_MAX_STEP_OPS to trace them whole)")
        kind = "explicit" if self._step_explicit or self._kind is None else self._kind
        cap = StepCapture(step=self.step_index, name=_STEP_NAMES[kind].format(n=self.step_index),
                          start_ns=self._step_start + self._epoch, end_ns=now + self._epoch, full=full,
                          ops=ops, op_recorder=self.sources.ops, modules=modules, kineto=trace,
                          signature=self.signatures.finish(), compiled=compiled, tid=self._step_thread,
                          opened_at_call=self.signatures.opened_at_call)
        for rec in (self.sources.ops, self.modules):
            if rec.failed is not None:
                err, rec.failed = rec.failed, None
                say_once("hook-error", f"a torch hook failed and its record was skipped: {type(err).__name__}: {err}")
        if self.sources.ops.notice:
            say_once("op-notice", self.sources.ops.notice)
        if self.sources.cupti is not None and self.sources.cupti.available:
            cap.dropped = self.sources.cupti.dropped()  # the records themselves: flushed by the worker, per batch
        if self.sources.nvml is not None:
            cap.samples = self.sources.nvml.take(cap.start_ns, cap.end_ns)
        distributed.remember()  # the store handle, while the process group surely exists
        self.step_index += 1
        self.stats["steps"] += 1
        if self.stats["steps"] == 1:
            autostart.note_started("stepped")
        self.stats["steps_full"] += int(full)
        if not self.worker.offer(cap):
            self.stats["steps_dropped"] += 1

    def _detect_devices(self) -> None:
        self.sources.detect_devices()
        self.resource["plasmient.source"] = self.sources.label()

    def _enter_mode(self) -> None:
        if not self._mode_entered:
            self.sources.ops.limit = self.config.max_step_ops  # the recorder may have changed since the last step
            self.sources.ops.__enter__()
            self._mode_entered = True

    def _exit_mode(self) -> None:
        if self._mode_entered:
            self._mode_entered = False
            self.sources.ops.__exit__(None, None, None)
