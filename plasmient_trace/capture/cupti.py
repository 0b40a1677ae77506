"""cupti-python adapter: CUPTI activity records -> the kernels / launches / external_correlation tables.

The conversion (:func:`tables_from_activities`) is a pure function of activity-record objects that
carry the attribute names of cupti-python's activity classes (ActivityKernel9.., ActivityAPI,
ActivityMemcpy6, ActivityMemset4, ActivitySynchronization, ActivityExternalCorrelation), so it is
tested on recorded fixtures without a GPU. :class:`CuptiCollector` is the live part: it enables the
activity kinds, pushes/pops external correlation ids for the torch hooks, flushes at each step end,
and fails soft (one clear message, ``available = False``) when there is no driver, no GPU, or
another CUPTI subscriber (torch.profiler) already holds it.

cupti-python hands records over as one Python object each, so reading them is one attribute read
per record, done inside the buffer-completed callback (the objects view CUPTI's buffer, which is
released when the callback returns); the rest is columnar. CUPTI names kernels by their mangled
symbols; :func:`demangle` gives them the names Kineto writes (``abi::__cxa_demangle``), so live and
ingested traces name a kernel alike and the kernel classifiers see the same text.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Callable, Iterable

import numpy as np
import pyarrow as pa

from ..records import table_from_columns

# CUpti_ActivityKind values (cupti_activity.h; the same numbers as cupti.ActivityKind).
KIND_MEMCPY = 1
KIND_MEMSET = 2
KIND_KERNEL = 3
KIND_DRIVER = 4
KIND_RUNTIME = 5
KIND_CONCURRENT_KERNEL = 10
KIND_SYNCHRONIZATION = 38
KIND_EXTERNAL_CORRELATION = 39
# CUpti_ExternalCorrelationKind: the torch hooks use CUSTOM0 (Kineto uses CUSTOM0/1 likewise).
EXTERNAL_KIND_CUSTOM0 = 3

_MEMCPY_KINDS = {1: "HtoD", 2: "DtoH", 3: "HtoA", 4: "AtoH", 5: "AtoA", 6: "AtoD", 7: "DtoA", 8: "DtoD",
                 9: "HtoH", 10: "PtoP"}
# CUpti_ActivityMemoryKind, spelled as Kineto spells it in "Memcpy DtoH (Device -> Pinned)".
_MEMORY_KINDS = {0: "Unknown", 1: "Pageable", 2: "Pinned", 3: "Device", 4: "Array", 5: "Managed",
                 6: "Device Static", 7: "Managed Static"}


def _memory(record: Any, attribute: str) -> str:
    return _MEMORY_KINDS.get(int(getattr(record, attribute, 0) or 0), "Unknown")
_COLLECTIVE_MARKERS = ("nccl", "rccl")

# One row of raw columns per record kind; filled in the callback, turned into tables by `tables`.
_GPU_COLS = ("device", "stream", "start", "end", "name", "kind", "correlation_id", "grid", "block",
             "registers_per_thread", "shared_memory", "graph_id", "bytes")
_API_COLS = ("pid", "tid", "start", "end", "domain", "cbid", "correlation_id")


class ActivityBuffer:
    """Raw columns of the activity records seen so far (thread-safe: CUPTI may complete buffers
    on its own thread while the training thread flushes)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self.gpu: dict[str, list[Any]] = {c: [] for c in _GPU_COLS}
        self.api: dict[str, list[Any]] = {c: [] for c in _API_COLS}
        self.ext: dict[str, list[Any]] = {"correlation_id": [], "external_id": []}
        self.sync_count = 0
        self.sync_ns = 0

    def add(self, activities: Iterable[Any]) -> None:
        with self._lock:
            gpu, api, ext = self.gpu, self.api, self.ext
            for a in activities:
                k = int(a.kind)
                if k in (KIND_CONCURRENT_KERNEL, KIND_KERNEL):
                    name = a.name or "<unnamed kernel>"
                    low = name.lower()
                    kind = "collective" if any(m in low for m in _COLLECTIVE_MARKERS) else "kernel"
                    shared = int(getattr(a, "static_shared_memory", 0) or 0) + int(getattr(a, "dynamic_shared_memory", 0) or 0)
                    row = (a.device_id, a.stream_id, a.start, a.end, name, kind, a.correlation_id,
                           (a.grid_x, a.grid_y, a.grid_z), (a.block_x, a.block_y, a.block_z),
                           a.registers_per_thread, shared, getattr(a, "graph_id", None) or None, None)
                elif k == KIND_MEMCPY:
                    label = _MEMCPY_KINDS.get(int(a.copy_kind), "Unknown")
                    name = f"Memcpy {label} ({_memory(a, 'src_kind')} -> {_memory(a, 'dst_kind')})"
                    row = (a.device_id, a.stream_id, a.start, a.end, name, "memcpy",
                           a.correlation_id, None, None, None, None, getattr(a, "graph_id", None) or None, a.bytes)
                elif k == KIND_MEMSET:
                    row = (a.device_id, a.stream_id, a.start, a.end, f"Memset ({_memory(a, 'memory_kind')})", "memset",
                           a.correlation_id, None, None, None, None, getattr(a, "graph_id", None) or None, a.bytes)
                elif k in (KIND_RUNTIME, KIND_DRIVER):
                    for col, v in zip(_API_COLS, (a.process_id, a.thread_id, a.start, a.end, k, a.cbid, a.correlation_id)):
                        api[col].append(v)
                    continue
                elif k == KIND_EXTERNAL_CORRELATION:
                    if int(a.external_kind) == EXTERNAL_KIND_CUSTOM0:
                        ext["correlation_id"].append(a.correlation_id)
                        ext["external_id"].append(a.external_id)
                    continue
                elif k == KIND_SYNCHRONIZATION:
                    self.sync_count += 1
                    self.sync_ns += max(int(a.end) - int(a.start), 0)
                    continue
                else:
                    continue
                for col, v in zip(_GPU_COLS, row):
                    gpu[col].append(v)

    def take(self) -> "ActivityBuffer":
        with self._lock:
            out = ActivityBuffer.__new__(ActivityBuffer)
            out._lock = threading.Lock()
            out.gpu, out.api, out.ext = self.gpu, self.api, self.ext
            out.sync_count, out.sync_ns = self.sync_count, self.sync_ns
            self._reset()
            return out


_demangled: dict[str, str] = {}
_cxa_demangle: Any = None


def _demangler() -> Any:
    """libstdc++'s ``__cxa_demangle`` (what Kineto calls), or False where it cannot be loaded."""
    global _cxa_demangle
    if _cxa_demangle is None:
        try:
            fn = ctypes.CDLL("libstdc++.so.6").__cxa_demangle
            fn.restype = ctypes.c_void_p  # a malloc'd buffer this module frees
            fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
            free = ctypes.CDLL(None).free
            free.argtypes = [ctypes.c_void_p]
            _cxa_demangle = (fn, free)
        except (OSError, AttributeError):
            _cxa_demangle = False
    return _cxa_demangle


def demangle(name: str) -> str:
    """A kernel's name as Kineto writes it: the demangled C++ signature, or the name unchanged when it
    is not a mangled symbol (cuBLAS's ``sm90_xmma_gemm_...``) or no demangler is available."""
    if not name.startswith("_Z"):
        return name
    out = _demangled.get(name)
    if out is None:
        out = name
        lib = _demangler()
        if lib:
            fn, free = lib
            status = ctypes.c_int(0)
            ptr = fn(name.encode(), None, None, ctypes.byref(status))
            if ptr:
                try:
                    if status.value == 0:
                        out = ctypes.string_at(ptr).decode("utf-8", "replace")
                finally:
                    free(ptr)
        if len(_demangled) < 100_000:  # a job has a few thousand distinct kernels; bound it anyway
            _demangled[name] = out
    return out


def _demangled_names(names: list[str]) -> pa.Array:
    """Each distinct name demangled once."""
    coded = pa.array(names, pa.string()).dictionary_encode()
    return pa.array([demangle(n) for n in coded.dictionary.to_pylist()], pa.string()).take(coded.indices)


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


def tables(buf: ActivityBuffer, epoch_offset_ns: int,
           api_name: Callable[[int, int], str] = default_api_name) -> dict[str, pa.Table]:
    """Raw activity columns -> kernels, launches and external_correlation record tables.

    ``epoch_offset_ns`` maps CUPTI timestamps onto the process's epoch clock; kernels and launches
    get the same shift (CUPTI stamps both with one clock), so the stitcher's launch-before-kernel
    check sees their true order.
    """
    e = buf.ext
    corr_of_ext = np.asarray(e["correlation_id"], np.int64)
    ext_ids = np.asarray(e["external_id"], np.int64)
    order = np.argsort(corr_of_ext, kind="stable")
    corr_sorted, ext_sorted = corr_of_ext[order], ext_ids[order]

    def external_ids(correlation: list[int]) -> pa.Array:
        """The op's external id for each correlation id (the joins read it from the launch row)."""
        q = np.asarray(correlation, np.int64)
        if not len(corr_sorted) or not len(q):
            return pa.nulls(len(q), pa.int64())
        k = np.minimum(np.searchsorted(corr_sorted, q), len(corr_sorted) - 1)
        hit = corr_sorted[k] == q
        return pa.array(ext_sorted[k], pa.int64(), mask=~hit)

    g = buf.gpu
    kernels = table_from_columns("kernels", {
        "device": g["device"], "stream": g["stream"],
        "start_ns": (np.asarray(g["start"], np.int64) + epoch_offset_ns) if g["start"] else [],
        "end_ns": (np.asarray(g["end"], np.int64) + epoch_offset_ns) if g["end"] else [],
        "name": _demangled_names(g["name"]), "kind": g["kind"], "correlation_id": g["correlation_id"],
        "grid": [list(x) if x is not None else None for x in g["grid"]],
        "block": [list(x) if x is not None else None for x in g["block"]],
        "registers_per_thread": g["registers_per_thread"], "shared_memory": g["shared_memory"],
        "graph_id": g["graph_id"], "bytes": g["bytes"], "external_id": external_ids(g["correlation_id"]),
    }) if g["start"] else table_from_columns("kernels", {})
    a = buf.api
    if a["start"]:
        cache: dict[tuple[int, int], str] = {}
        names = []
        for dom, cbid in zip(a["domain"], a["cbid"]):
            key = (dom, cbid)
            if key not in cache:
                cache[key] = api_name(dom, cbid)
            names.append(cache[key])
        launches = table_from_columns("launches", {
            "pid": a["pid"], "tid": a["tid"],
            "start_ns": np.asarray(a["start"], np.int64) + epoch_offset_ns,
            "end_ns": np.asarray(a["end"], np.int64) + epoch_offset_ns,
            "name": names, "correlation_id": a["correlation_id"], "external_id": external_ids(a["correlation_id"]),
        })
    else:
        launches = table_from_columns("launches", {})
    ext = table_from_columns("external_correlation", {"correlation_id": e["correlation_id"], "external_id": e["external_id"]}) \
        if e["correlation_id"] else table_from_columns("external_correlation", {})
    return {"kernels": kernels, "launches": launches, "external_correlation": ext}


def tables_from_activities(activities: Iterable[Any], epoch_offset_ns: int = 0,
                           api_name: Callable[[int, int], str] = default_api_name) -> dict[str, pa.Table]:
    """Pure: activity-record objects (as cupti-python delivers them) -> record tables."""
    buf = ActivityBuffer()
    buf.add(activities)
    return tables(buf, epoch_offset_ns, api_name)


class CuptiUnavailable(RuntimeError):
    pass


class CuptiCollector:
    """Live CUPTI activity collection for one process."""

    BUFFER_BYTES = 8 << 20

    def __init__(self) -> None:
        self.buffer = ActivityBuffer()
        self.epoch_offset_ns = 0
        self.available = False
        self.reason = ""
        self._cupti: Any = None
        self._dropped_seen = 0

    def start(self) -> None:
        """Enable activity collection; raises CuptiUnavailable with a one-line reason."""
        try:
            from cupti import cupti
        except Exception as err:
            raise CuptiUnavailable(f"cupti-python is not importable ({err})") from None
        self._cupti = cupti
        try:
            # System thread ids (gettid), the ids threading.get_native_id() gives the torch hooks, so
            # launches and ops meet on the same thread in the joins.
            cupti.set_thread_id_type(cupti.ActivityThreadIdType.SYSTEM)
            cupti.activity_register_callbacks(self._buffer_requested, self._buffer_completed)
            for kind in (cupti.ActivityKind.CONCURRENT_KERNEL, cupti.ActivityKind.RUNTIME, cupti.ActivityKind.DRIVER,
                         cupti.ActivityKind.MEMCPY, cupti.ActivityKind.MEMSET, cupti.ActivityKind.SYNCHRONIZATION,
                         cupti.ActivityKind.EXTERNAL_CORRELATION):
                cupti.activity_enable(kind)
            import time

            a = time.time_ns()
            ts = cupti.get_timestamp()
            b = time.time_ns()
            self.epoch_offset_ns = (a + b) // 2 - int(ts)
        except Exception as err:
            text = str(err)
            if "MULTIPLE_SUBSCRIBERS" in text.upper() or "NOT_INITIALIZED" in text.upper():
                text += " (is torch.profiler or another CUPTI client already running?)"
            raise CuptiUnavailable(f"CUPTI could not be enabled: {text}") from None
        self.available = True

    def _buffer_requested(self) -> tuple[int, int]:
        return self.BUFFER_BYTES, 0

    def _buffer_completed(self, activities: list) -> None:
        try:
            self.buffer.add(activities)
        except Exception:  # never raise into CUPTI's thread
            pass

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
        if not self.available:
            return None
        try:
            path = next((line.split()[-1] for line in open("/proc/self/maps")
                         if "libcupti.so" in line and line.split()[-1].startswith("/")), None)
            if path is None:
                return None
            lib = ctypes.CDLL(path)  # the already-loaded library: dlopen hands back the same handle
            push = ctypes.cast(lib.cuptiActivityPushExternalCorrelationId, ctypes.c_void_p).value
            pop = ctypes.cast(lib.cuptiActivityPopExternalCorrelationId, ctypes.c_void_p).value
            return (int(push), int(pop)) if push and pop else None
        except (OSError, AttributeError, ValueError):
            return None

    def flush(self) -> tuple[ActivityBuffer, int]:
        """Deliver every completed and pending record; returns them and the records dropped since."""
        cupti = self._cupti
        cupti.activity_flush_all(1)  # CUPTI_ACTIVITY_FLAG_FLUSH_FORCED: include the open buffer
        dropped = 0
        try:
            value = ctypes.c_size_t(0)
            cupti.activity_get_num_dropped_records(0, 0, ctypes.addressof(value))
            dropped = int(value.value)
        except Exception:
            dropped = 0
        return self.buffer.take(), dropped

    def stop(self) -> None:
        if not self.available:
            return
        cupti = self._cupti
        try:
            cupti.activity_flush_all(1)
            for kind in (cupti.ActivityKind.CONCURRENT_KERNEL, cupti.ActivityKind.RUNTIME, cupti.ActivityKind.DRIVER,
                         cupti.ActivityKind.MEMCPY, cupti.ActivityKind.MEMSET, cupti.ActivityKind.SYNCHRONIZATION,
                         cupti.ActivityKind.EXTERNAL_CORRELATION):
                cupti.activity_disable(kind)
        except Exception:
            pass
        self.available = False
