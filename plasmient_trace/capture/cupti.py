"""Live CUPTI activity collection: buffers in, record tables out (the parsing is :mod:`.cupti_records`).

:class:`CuptiCollector` enables the activity kinds, lends CUPTI buffers and takes them back through
C callbacks registered with libcupti itself (ctypes), pushes/pops external correlation ids for the
torch hooks, hands the worker every record so far once per batch, and fails soft (one clear message,
``available = False``) when there is no driver, no GPU, or another CUPTI subscriber (torch.profiler)
already holds it.

The training thread's share per step is reading the dropped-record count. The worker flushes and
copies each completed buffer's valid bytes. cupti-python's own buffer callback, which builds a Python
object per record, cost 18-22 µs a record on an H200 and is not used; cupti-python still loads
libcupti and provides the enums, ``activity_enable`` and the timestamps.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np
import pyarrow as pa

from .cupti_records import (CUDA13_SIZES, EXTERNAL_KIND_CUSTOM0, KIND_CONCURRENT_KERNEL, KIND_DRIVER,  # noqa: F401
                            KIND_EXTERNAL_CORRELATION, KIND_KERNEL, KIND_MEMCPY, KIND_MEMSET, KIND_RUNTIME,
                            KIND_SYNCHRONIZATION, RawActivity, demangle, parse)
from .cupti_records import tables as _tables

# Device work: recorded on every step (util, idle, the step's device window).
_DEVICE_KINDS = (KIND_CONCURRENT_KERNEL, KIND_MEMCPY, KIND_MEMSET)
# Host API calls and the op ids pushed around them: what joins a kernel to its launch and op. A
# training step makes thousands of runtime/driver calls, nearly all of which launch nothing
# (cudaGetDevice, ...), and CUPTI records each on the launching thread: recorded on full-depth steps only.
_API_KINDS = (KIND_RUNTIME, KIND_DRIVER, KIND_SYNCHRONIZATION, KIND_EXTERNAL_CORRELATION)
_ENABLED_KINDS = _DEVICE_KINDS + _API_KINDS

# CUpti_BuffersCallbackRequestFunc / CUpti_BuffersCallbackCompleteFunc (cupti_activity.h).
_REQUEST = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t),
                            ctypes.POINTER(ctypes.c_size_t))
_COMPLETE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t)
# CUPTI may call back as long as the process lives: the callbacks, and the collector they reach, stay.
_callbacks: list[Any] = []


def default_api_name(domain_kind: int, cbid: int) -> str:
    """cudaLaunchKernel, cuLaunchKernel, ...: CUPTI's own name for the callback id, where available."""
    try:
        from cupti import cupti

        domain = cupti.CallbackDomain.RUNTIME_API if domain_kind == KIND_RUNTIME else cupti.CallbackDomain.DRIVER_API
        name = cupti.get_callback_name(domain, cbid)
        if name:
            # CUPTI names carry a version suffix: cudaLaunchKernel_v7000 -> cudaLaunchKernel.
            base, sep, tail = name.rpartition("_v")
            return base if sep and tail.isdigit() else name
    except Exception:  # no libcupti: the id is all we have
        pass
    return f"{'runtime' if domain_kind == KIND_RUNTIME else 'driver'}:{cbid}"


def tables(raw: RawActivity, epoch_offset_ns: int, api_name: Any = default_api_name) -> dict[str, pa.Table]:
    """One or more steps' CUPTI buffers -> kernels, launches and external_correlation record tables."""
    return _tables(parse(raw), epoch_offset_ns, api_name)


def _libcupti_path() -> str | None:
    """The libcupti cupti-python loaded (the one whose entry points and buffers we must use)."""
    try:
        with open("/proc/self/maps") as maps:
            return next((line.split()[-1] for line in maps
                         if "libcupti.so" in line and line.split()[-1].startswith("/")), None)
    except OSError:
        return None


class CuptiUnavailable(RuntimeError):
    pass


class CuptiCollector:
    """Live CUPTI activity collection for one process."""

    BUFFER_BYTES = 8 << 20
    SPARE_BUFFERS = 4  # lent buffers kept for reuse rather than freed and allocated again

    def __init__(self) -> None:
        self.epoch_offset_ns = 0
        self.available = False
        self.reason = ""
        self.sizes: dict[int, int] = dict(CUDA13_SIZES)
        self._cupti: Any = None
        self._lib: Any = None
        self._lock = threading.Lock()
        self._lent: dict[int, np.ndarray] = {}
        self._spare: list[np.ndarray] = []
        self._completed: list[np.ndarray] = []
        self.api_recorded = True  # _API_KINDS are enabled

    def start(self) -> None:
        """Enable activity collection; raises CuptiUnavailable with a one-line reason."""
        try:
            from cupti import cupti
        except Exception as err:
            raise CuptiUnavailable(f"cupti-python is not importable ({err})") from None
        self._cupti = cupti
        try:
            if self._lib is None:
                path = _libcupti_path()
                if path is None:
                    raise CuptiUnavailable("libcupti is not loaded after importing cupti-python")
                self._lib = ctypes.CDLL(path)  # the already-loaded library: dlopen hands back the same handle
            # System thread ids (gettid), the ids threading.get_native_id() gives the torch hooks, so
            # launches and ops meet on the same thread in the joins.
            cupti.set_thread_id_type(cupti.ActivityThreadIdType.SYSTEM)
            self._register()
            for kind in _ENABLED_KINDS:
                cupti.activity_enable(kind)
            self._measure_sizes()
            import time

            a = time.time_ns()
            ts = cupti.get_timestamp()
            b = time.time_ns()
            self.epoch_offset_ns = (a + b) // 2 - int(ts)
        except CuptiUnavailable:
            raise
        except Exception as err:
            text = str(err)
            if "MULTIPLE_SUBSCRIBERS" in text.upper() or "NOT_INITIALIZED" in text.upper():
                text += " (is torch.profiler or another CUPTI client already running?)"
            raise CuptiUnavailable(f"CUPTI could not be enabled: {text}") from None
        self.available = True

    def _register(self) -> None:
        """Our buffer callbacks, registered with libcupti directly (another client, e.g. Kineto after a
        user's torch.profiler, may have registered its own meanwhile)."""
        request, complete = _REQUEST(self._buffer_requested), _COMPLETE(self._buffer_completed)
        _callbacks.append((self, request, complete))
        register = self._lib.cuptiActivityRegisterCallbacks
        register.argtypes = [_REQUEST, _COMPLETE]
        status = register(request, complete)
        if status != 0:
            raise CuptiUnavailable(f"cuptiActivityRegisterCallbacks returned CUPTI error {status}")

    def _measure_sizes(self) -> None:
        """The record size of each enabled kind in this libcupti, asked of cuptiActivityGetNextRecord on a
        buffer of bare record headers (its struct version may differ from the CUDA 13 defaults)."""
        try:
            step = ctypes.POINTER(ctypes.c_void_p)
            get_next = self._lib.cuptiActivityGetNextRecord
            get_next.argtypes = [ctypes.c_void_p, ctypes.c_size_t, step]
            for kind in _ENABLED_KINDS:
                # a record of `kind` at 0, and a valid record header at every 8-byte slot after it, so the
                # second call lands on one wherever the first record ends
                probe = np.full(512, KIND_EXTERNAL_CORRELATION, np.int32)
                probe[1::2] = 0
                probe[0] = kind
                record = ctypes.c_void_p(None)
                base = probe.ctypes.data
                if get_next(base, 2048, ctypes.byref(record)) != 0 or record.value != base:
                    return
                if get_next(base, 2048, ctypes.byref(record)) != 0 or record.value is None:
                    return
                size = record.value - base
                if 0 < size <= 1024 and size % 8 == 0:
                    self.sizes[kind] = size
        except Exception:  # keep the defaults; a buffer that does not fit them is skipped and counted
            return

    def _buffer_requested(self, buffer: Any, size: Any, max_records: Any) -> None:
        try:
            with self._lock:
                data = self._spare.pop() if self._spare else np.empty(self.BUFFER_BYTES, np.uint8)
                address = data.ctypes.data
                self._lent[address] = data
            buffer[0] = address
            size[0] = len(data)
            max_records[0] = 0
        except Exception:  # never raise into CUPTI's thread: no buffer means CUPTI drops and counts
            buffer[0] = None
            size[0] = 0

    def _buffer_completed(self, context: Any, stream_id: int, buffer: int, size: int, valid: int) -> None:
        try:
            with self._lock:
                data = self._lent.pop(buffer, None)
                if data is None:
                    return
                if valid:
                    self._completed.append(data[:valid].copy())
                if len(self._spare) < self.SPARE_BUFFERS:
                    self._spare.append(data)
        except Exception:
            pass

    def record_api(self, on: bool) -> bool:
        """Record host API calls and external correlations (``_API_KINDS``) from now on, or stop; False
        when CUPTI refused (the caller says so once). Called at step boundaries, on changes only."""
        if not self.available or on == self.api_recorded:
            return True
        toggle = self._cupti.activity_enable if on else self._cupti.activity_disable
        try:
            for kind in _API_KINDS:
                toggle(kind)
        except Exception:
            return False
        self.api_recorded = on
        return True

    # push/pop run around every op on the training thread: they must never raise into it.
    def push(self, external_id: int) -> None:
        if self.available:
            try:
                self._cupti.activity_push_external_correlation_id(EXTERNAL_KIND_CUSTOM0, external_id)
            except Exception:
                self.available = False

    def pop(self) -> None:
        if self.available:
            try:
                self._cupti.activity_pop_external_correlation_id(EXTERNAL_KIND_CUSTOM0)
            except Exception:
                self.available = False

    def native_correlation(self) -> tuple[int, int] | None:
        """Addresses of ``cuptiActivityPush/PopExternalCorrelationId`` in the libcupti cupti-python
        loaded, for the native op observer to call without Python; None where they cannot be found
        (the session then brackets ops through :meth:`push`/:meth:`pop` instead)."""
        if not self.available or self._lib is None:
            return None
        try:
            push = ctypes.cast(self._lib.cuptiActivityPushExternalCorrelationId, ctypes.c_void_p).value
            pop = ctypes.cast(self._lib.cuptiActivityPopExternalCorrelationId, ctypes.c_void_p).value
            return (int(push), int(pop)) if push and pop else None
        except (OSError, AttributeError, ValueError):
            return None

    def flush(self) -> RawActivity:
        """Every completed and pending buffer, unparsed: all CUPTI recorded up to now. The worker calls it
        once per batch; on the H200 a flush at every step end cost a launch-bound step 3-4 ms (most of it
        in the next step's launches, not in the call)."""
        # Through ctypes, which lets go of the GIL for the call: CUPTI may hand buffers back on its own
        # thread meanwhile, and our callbacks there need the GIL.
        self._lib.cuptiActivityFlushAll(1)  # CUPTI_ACTIVITY_FLAG_FLUSH_FORCED: include the open buffer
        with self._lock:
            buffers, self._completed = self._completed, []
        return RawActivity(buffers=buffers, sizes=dict(self.sizes))

    def dropped(self) -> int | None:
        """Records CUPTI dropped (no buffer space) since the last call; None when it would not say."""
        try:
            value = ctypes.c_size_t(0)
            if self._lib.cuptiActivityGetNumDroppedRecords(None, 0, ctypes.byref(value)) == 0:
                return int(value.value)
        except Exception:
            pass
        return None

    def stop(self) -> None:
        if not self.available:
            return
        cupti = self._cupti
        try:
            self._lib.cuptiActivityFlushAll(1)
            for kind in _ENABLED_KINDS:
                cupti.activity_disable(kind)
        except Exception:
            pass
        self.available = False
