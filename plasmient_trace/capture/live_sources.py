"""What a live session records with, and the device records it hands each batch.

A session reads ops from one op recorder (the native RecordFunction observer, or the Python dispatch
hook until it is built or where it cannot be), kernels and host API calls from CUPTI (or, where CUPTI
is refused, from a torch.profiler run per full-depth step: the Kineto fallback), utilisation from NVML,
and on a CPU the calibrated peak. :class:`LiveSources` chooses them (devices are looked at when the
first step begins, never at ``import torch``), keeps them, and says which it uses
(``plasmient.source``). Each batch takes the CUPTI records of its steps with
:meth:`LiveSources.take_cupti`, which keeps the records of a step still open for the next batch: the
carry-over is the sources' state, not the batch's.
"""

from __future__ import annotations

import time
from concurrent import futures
from typing import Any, Callable

import pyarrow as pa

from ..records import DeviceInfo
from .config import CaptureConfig, notice, say_once


class LiveSources:
    """The recorders of one live session: chosen at start and at the first step, switched when the native
    observer's background build lands or CUPTI is refused, stopped at close."""

    def __init__(self, config: CaptureConfig) -> None:
        from . import torch_hooks

        self.config = config
        self.ops: Any = torch_hooks.OpRecorder()
        self.cupti: Any = None
        self.kineto: Any = None    # kineto_fallback.KinetoCollector, when cupti-python is not used
        self.nvml: Any = None
        self.devices: list[DeviceInfo] = []
        self.on_gpu = False
        self.cpu_spec: Any = None
        # Devices are looked at when the first step begins, not at `import torch`: touching CUDA then
        # would initialise it before the script sets CUDA_VISIBLE_DEVICES or forks.
        self.devices_pending = True
        self.cpu_pending = False
        self.native_pending = False
        self._cpu_future: futures.Future | None = None
        self._cpu_wait_until = 0.0
        self._cupti_later: dict[str, pa.Table] = {}  # records of a step still open at the last flush

    def label(self) -> str:
        """``plasmient.source`` of the spans these sources feed."""
        if not self.on_gpu:
            return "live:cpu"
        return "live:kineto" if self.kineto is not None else "live:cupti"

    # ---- the op recorder
    def choose_op_recorder(self) -> None:
        """The native observer when it is built (or, with PLASMIENT_OP_HOOK=native, once built now);
        under auto a first build runs in the background and :meth:`poll_native` switches when it lands."""
        from . import native

        hook = self.config.op_hook
        if hook not in ("auto", "native", "dispatch"):
            say_once("op-hook", f"PLASMIENT_OP_HOOK={hook!r} is not auto, native or dispatch: using auto")
            hook = "auto"
        if hook == "dispatch":
            return
        observer = native.load(build_if_missing=(hook == "native"))
        if observer is not None:
            self._use_native(observer)
        elif hook == "native" or native.failure() is not None:
            self._native_unavailable()
        else:
            notice("native-build", f"building the native op observer once, in the background (cached in "
                                     f"{native.cache_dir()}); full-depth steps use the slower dispatch hook until then")
            native.build_async()
            self.native_pending = True

    def poll_native(self) -> None:
        """At a step start: use the native observer if its background build has landed."""
        from . import native

        observer = native.loaded()
        if observer is not None:
            self.native_pending = False
            self._use_native(observer)
        elif native.failure() is not None:
            self.native_pending = False
            self._native_unavailable()

    def _use_native(self, observer: Any) -> None:
        from . import torch_hooks

        recorder = torch_hooks.NativeOpRecorder(observer)
        recorder.next_id = max(recorder.next_id, self.ops.next_id)  # external ids stay unique per rank
        self.ops = recorder
        if self.cupti is not None:
            self.correlate()

    def _native_unavailable(self) -> None:
        from . import native

        say_once("native-failed", f"native op observer unavailable ({native.failure()}); full-depth steps use "
                                  "the Python dispatch hook, which costs far more per op")

    def correlate(self) -> None:
        """Bracket every op with a CUPTI external correlation id (exact kernel -> op join). The
        native observer needs libcupti's C entry points; without them the dispatch hook, which
        calls cupti-python, takes over so the join stays exact."""
        from . import torch_hooks

        if isinstance(self.ops, torch_hooks.NativeOpRecorder):
            addresses = self.cupti.native_correlation()
            if addresses is not None:
                self.ops.set_correlation(*addresses)
                return
            say_once("native-cupti", "libcupti's external-correlation entry points were not found for the native "
                                     "op observer; ops are recorded by the dispatch hook so kernels still join exactly")
            fallback = torch_hooks.OpRecorder()
            fallback.next_id = self.ops.next_id
            self.ops = fallback
            self.native_pending = False
        self.ops.set_correlation(self.cupti.push, self.cupti.pop)

    # ---- devices
    def detect_devices(self) -> None:
        """GPU path when the job has initialised CUDA (a CPU job on a GPU machine stays on the CPU
        path); called at each step start until CUDA appears, so a late `.cuda()` is picked up."""
        import torch

        if not torch.cuda.is_available():
            self.devices_pending = False
            if self.config.kineto and self.config.cupti:
                notice("kineto-forced", "PLASMIENT_CUPTI=kineto: full-depth steps are profiled with torch.profiler "
                                        "(no CUDA here: ops only)")
                self._use_kineto(cuda=False)
        elif torch.cuda.is_initialized():
            self.devices_pending = False
            self.init_gpu(torch)
            if self.cupti is not None:
                self.correlate()
        if not self.on_gpu and self.cpu_spec is None:
            if self.config.peak_tflops is None:
                self.cpu_pending = True
            else:
                # no calibration for a peak the user gave; the CPU's price still applies
                from ..metrics.cpu_peak import user_cpu_spec

                self.cpu_spec = user_cpu_spec(self.config.peak_tflops)

    def _use_kineto(self, cuda: bool) -> None:
        from .kineto_fallback import KinetoCollector

        self.kineto = KinetoCollector(cuda=cuda)
        self.on_gpu = self.on_gpu or cuda

    def init_gpu(self, torch: Any) -> None:
        from .cupti import CuptiCollector, CuptiUnavailable

        count = torch.cuda.device_count()
        for i in range(count):
            p = torch.cuda.get_device_properties(i)
            props = {"name": p.name, "totalGlobalMem": int(p.total_memory), "computeMajor": p.major,
                     "computeMinor": p.minor, "numSms": p.multi_processor_count}
            self.devices.append(DeviceInfo(ordinal=i, name=p.name, uuid=str(getattr(p, "uuid", "")) or None,
                                           sm_count=p.multi_processor_count, memory_bytes=int(p.total_memory),
                                           properties=props))
        if self.config.cupti and self.config.kineto:
            notice("kineto-forced", "PLASMIENT_CUPTI=kineto: GPU kernels come from torch.profiler on full-depth steps")
            self._use_kineto(cuda=True)
        elif self.config.cupti:
            collector = CuptiCollector()
            try:
                collector.start()
                self.cupti = collector
                self.on_gpu = True
            except CuptiUnavailable as err:
                say_once("cupti", f"{err}; falling back to torch.profiler (Kineto) for GPU kernels "
                                  "on full-depth steps")
                self._use_kineto(cuda=True)
        if self.config.nvml and self.on_gpu:
            from .nvml import NvmlSampler

            sampler = NvmlSampler(list(range(count)))
            if sampler.start():
                self.nvml = sampler
            else:
                say_once("nvml", sampler.reason)

    # ---- the CPU's peak
    def start_cpu_calibration(self) -> None:
        # Called at the first step end: torch's thread count is the job's by then (the capture starts at
        # `import torch`, before the script sets it). The calibration itself runs in a child process (its
        # own torch, threads and RNG), never on the training thread; a cached CPU resolves at once. The
        # background worker waits for it before stitching (cpu_spec_for_stitch), not the training loop.
        self.cpu_pending = False
        try:
            import torch

            from ..metrics import hardware

            self._cpu_wait_until = time.monotonic() + float(self.config.environ.get("PLASMIENT_CALIBRATION_WAIT_S", "10"))
            self._cpu_future = hardware.start_cpu_calibration(torch.get_num_threads())
        except Exception as err:
            say_once("cpu-spec", f"CPU peak calibration failed ({err}): no MFU on CPU spans")

    def cpu_spec_for_stitch(self, closing: Callable[[], bool]) -> Any:
        """The calibrated CPU spec, waiting (on the worker) until PLASMIENT_CALIBRATION_WAIT_S after the
        calibration started for the child process, and not at all once ``closing()``: steps are never held
        back from the exit flush for it. None (no MFU, said once) while it is not known; the steps of a
        later batch get it once the child is done."""
        future = self._cpu_future
        if self.cpu_spec is not None or future is None:
            return self.cpu_spec
        while not future.done() and not closing() and time.monotonic() < self._cpu_wait_until:
            futures.wait([future], timeout=0.25)
        if future.done():
            self._cpu_future = None
            try:
                self.cpu_spec = future.result()
            except Exception as err:
                say_once("cpu-spec", f"CPU peak calibration failed ({type(err).__name__}: {err}): no MFU on CPU "
                                     "spans; `python -m plasmient_trace.metrics.cpu_peak --threads N` on an idle "
                                     "machine calibrates it, or PLASMIENT_PEAK_TFLOPS gives it")
        else:
            say_once("cpu-spec-pending", "CPU peak calibration still running (it times the CPU only while the "
                                         "machine is otherwise idle): steps exported meanwhile carry no MFU")
        return self.cpu_spec

    def cpu_threads(self) -> int:
        """The job's torch threads, which its CPU peak was calibrated with."""
        from ..metrics.cpu_peak_cache import torch_threads

        return torch_threads()

    def cpu_price_per_hour(self) -> float | None:
        """USD an hour of a CPU-only job's threads (None on a GPU, whose price is the device's)."""
        from ..metrics.cpu_peak import cpu_price_per_hour

        return None if self.on_gpu else cpu_price_per_hour()

    # ---- per batch (worker thread)
    def take_cupti(self, cutoff_ns: int) -> dict[str, pa.Table] | None:
        """Every record CUPTI holds now, parsed at once (one pass of numpy work per batch), less those of
        the step still open at ``cutoff_ns`` (the batch's last step end), which the next call returns.
        None when there is no CUPTI to read."""
        from . import cupti as cupti_mod
        from . import cupti_records

        collector = self.cupti
        if not self.on_gpu or collector is None or not (collector.available or self._cupti_later):
            return None
        raw = collector.flush() if collector.available else cupti_records.RawActivity()
        cols = cupti_records.parse(raw, keep_from=max(cutoff_ns - collector.epoch_offset_ns, 0))
        if cols.skipped_buffers:
            say_once("cupti-layout", f"{cols.skipped_buffers} CUPTI buffer(s) did not match the record sizes "
                                     f"{dict(raw.sizes)} and were skipped: their steps miss kernels")
        parsed = cupti_records.tables(cols, collector.epoch_offset_ns, cupti_mod.default_api_name)
        now, self._cupti_later = cupti_records.split_at(cupti_records.concat_records(self._cupti_later, parsed),
                                                        cutoff_ns)
        return now

    def stop(self) -> None:
        if self.cupti is not None:
            self.cupti.stop()
        if self.nvml is not None:
            self.nvml.stop()
