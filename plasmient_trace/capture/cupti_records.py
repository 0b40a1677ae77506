"""CUPTI activity buffers, as CUPTI fills them, -> the kernels / launches / external_correlation tables.

Pure and columnar. A completed CUPTI buffer is a run of packed, 8-byte aligned records whose first
field is their ``CUpti_ActivityKind``; every record of one kind has one size (the struct version the
loaded libcupti writes). :func:`walk` finds the records with the sizes it is given, :func:`parse`
reads the fields the record tables need at the offsets ``cupti_activity.h`` gives them, for all
records of a kind at once, and :func:`tables` builds the Arrow tables. Nothing here touches a GPU,
so recorded buffers (``tests/fixtures/gpu``) are parsed by the same code on any machine.

Reading each record through cupti-python's per-record objects cost 18-22 µs a record on an H200
(numpy record views); a training step of a small transformer delivers 3,100-5,900 records, which
made a 5 ms step take 100-150 ms. Here the training thread only hands buffers over; the parse runs in
the capture's background thread, at numpy speed.
"""

from __future__ import annotations

import bisect
import ctypes
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..records import is_collective_kernel, table_from_columns

# CUpti_ActivityKind values (cupti_activity.h).
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

# Record sizes of the struct versions CUDA 13's CUPTI writes (CUpti_ActivityKernel10, ActivityAPI,
# ActivityMemcpy6, ActivityMemset4, ActivitySynchronization2, ActivityExternalCorrelation). The live
# collector measures the sizes its libcupti really writes and uses those; these serve recorded
# buffers that say nothing else.
CUDA13_SIZES = {KIND_CONCURRENT_KERNEL: 216, KIND_KERNEL: 216, KIND_RUNTIME: 40, KIND_DRIVER: 40, KIND_MEMCPY: 96,
                KIND_MEMSET: 88, KIND_SYNCHRONIZATION: 56, KIND_EXTERNAL_CORRELATION: 24}

# The fields read, at their offsets in cupti_activity.h. These prefixes are the same in every struct
# version since CUDA 11 (Kernel5..10, Memcpy5/6, Memset4, API, Synchronization/2).
_KERNEL = (("registers_per_thread", "<u2", 6), ("start", "<u8", 16), ("end", "<u8", 24), ("device", "<u4", 40),
           ("stream", "<u4", 48), ("grid", ("<i4", 3), 52), ("block", ("<i4", 3), 64), ("static_shared", "<i4", 76),
           ("dynamic_shared", "<i4", 80), ("correlation_id", "<u4", 92), ("name", "<u8", 104), ("graph_id", "<u4", 156))
_MEMCPY = (("copy_kind", "u1", 4), ("src_kind", "u1", 5), ("dst_kind", "u1", 6), ("bytes", "<u8", 8), ("start", "<u8", 16),
           ("end", "<u8", 24), ("device", "<u4", 32), ("stream", "<u4", 40), ("correlation_id", "<u4", 44),
           ("graph_id", "<u4", 72))
_MEMSET = (("bytes", "<u8", 8), ("start", "<u8", 16), ("end", "<u8", 24), ("device", "<u4", 32), ("stream", "<u4", 40),
           ("correlation_id", "<u4", 44), ("memory_kind", "<u2", 50), ("graph_id", "<u4", 72))
_API = (("cbid", "<u4", 4), ("start", "<u8", 8), ("end", "<u8", 16), ("pid", "<u4", 24), ("tid", "<u4", 28),
        ("correlation_id", "<u4", 32))
_EXTERNAL = (("external_kind", "<i4", 4), ("external_id", "<u8", 8), ("correlation_id", "<u4", 16))
_SYNC = (("start", "<u8", 8), ("end", "<u8", 16))

_MEMCPY_KINDS = {1: "HtoD", 2: "DtoH", 3: "HtoA", 4: "AtoH", 5: "AtoA", 6: "AtoD", 7: "DtoA", 8: "DtoD",
                 9: "HtoH", 10: "PtoP"}
# CUpti_ActivityMemoryKind, spelled as Kineto spells it in "Memcpy DtoH (Device -> Pinned)".
_MEMORY_KINDS = {0: "Unknown", 1: "Pageable", 2: "Pinned", 3: "Device", 4: "Array", 5: "Managed",
                 6: "Device Static", 7: "Managed Static"}


class LayoutError(ValueError):
    """A buffer whose records do not follow the sizes given (another struct version, or a torn buffer)."""


@dataclass
class RawActivity:
    """The completed CUPTI buffers of one or more steps, unparsed (exactly their valid bytes each), the
    record size per kind of the libcupti that wrote them, and where kernel names come from: CUPTI
    records hold a pointer to a name it owns; live that is read from memory, recorded buffers carry
    a map of the pointers they use."""

    buffers: list[np.ndarray] = field(default_factory=list)
    sizes: Mapping[int, int] = field(default_factory=lambda: dict(CUDA13_SIZES))
    names: Mapping[int, str] | None = None

    @classmethod
    def concat(cls, raws: list["RawActivity"]) -> "RawActivity":
        """Several flushes as one batch (one libcupti wrote them all: the last one's sizes stand)."""
        names = None
        if any(r.names is not None for r in raws):
            names = {}
            for r in raws:
                names.update(r.names or {})
        return cls(buffers=[b for r in raws for b in r.buffers], sizes=raws[-1].sizes, names=names)

    def name_of(self, pointer: int, readable: list[tuple[int, int]] | None = None) -> str:
        """The kernel name at ``pointer``; live, read only inside a readable mapping of this process
        (``readable``, from :func:`readable_ranges`) and at most to its end, so a wrong pointer gives
        an unnamed kernel, never a crash of the job."""
        if self.names is not None:
            return self.names.get(pointer, "<unnamed kernel>")
        if not pointer:
            return "<unnamed kernel>"
        ranges = readable if readable is not None else readable_ranges()
        i = bisect.bisect_right(ranges, (pointer, float("inf"))) - 1
        if i < 0 or not ranges[i][0] <= pointer < ranges[i][1]:
            return "<unnamed kernel>"
        room, want = ranges[i][1] - pointer, 1024
        while True:  # templated kernel names run to a few KiB; read more only while no NUL is seen
            text = ctypes.string_at(pointer, min(want, room))
            end = text.find(b"\0")
            if end >= 0 or want >= min(room, 64 << 10):
                break
            want *= 4
        return (text[:end] if end >= 0 else text).decode("utf-8", "replace") or "<unnamed kernel>"


def name_table(raw: RawActivity) -> dict[int, str]:
    """pointer -> name of every kernel record in ``raw``'s buffers: what a recording stores as
    ``RawActivity.names``, read while CUPTI still holds the names."""
    readable = readable_ranges() if raw.names is None else None
    names: dict[int, str] = {}
    for data in raw.buffers:
        offsets, kinds = walk(np.asarray(data, np.uint8), raw.sizes)
        sel = np.isin(kinds, (KIND_CONCURRENT_KERNEL, KIND_KERNEL))
        for pointer in np.unique(_read(data, offsets[sel], _KERNEL)["name"]).tolist() if sel.any() else []:
            names[int(pointer)] = raw.name_of(int(pointer), readable)
    return names


def readable_ranges() -> list[tuple[int, int]]:
    """[start, end) of this process's readable memory mappings, in address order (empty where /proc is
    not there)."""
    out = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                span, perms = line.split(None, 2)[:2]
                if perms.startswith("r"):
                    lo, hi = span.split("-")
                    out.append((int(lo, 16), int(hi, 16)))
    except (OSError, ValueError):
        return []
    return sorted(out)


def _per_kind(table: np.ndarray, kinds: np.ndarray, missing: int) -> np.ndarray:
    """``table[kind]`` for each kind, ``missing`` where a kind (read from untrusted bytes) is off the table."""
    inside = (kinds >= 0) & (kinds < len(table))
    return np.where(inside, table[np.where(inside, kinds, 0)], missing)


def walk(data: np.ndarray, sizes: Mapping[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, kinds) of the records packed in one buffer's valid bytes, in order.

    Vectorised: every 8-byte slot is read as if a record started there, which gives each slot its
    successor; the records are the chain of successors from slot 0, collected by pointer doubling
    (O(n log n) numpy work, no Python loop per record). Raises LayoutError when the chain meets a
    kind without a size or does not end exactly at the end of the data.
    """
    n = len(data)
    if n == 0:
        return np.empty(0, np.int64), np.empty(0, np.int32)
    if n % 8 or any(s <= 0 or s % 8 for s in sizes.values()):
        raise LayoutError(f"{n} valid bytes or record sizes {dict(sizes)} are not multiples of 8")
    slots = n // 8
    kind_at = np.ascontiguousarray(data[: slots * 8]).view("<i4")[::2].astype(np.int64)
    table = np.zeros(max(max(sizes), 0) + 2, np.int64)
    for kind, size in sizes.items():
        table[kind] = size // 8
    step = _per_kind(table, kind_at, 0)
    end, sink = slots, slots + 1
    nxt = np.arange(slots, dtype=np.int64) + step
    nxt = np.where(step == 0, sink, np.where(nxt > slots, sink, nxt))
    jump = np.concatenate([nxt, [end, sink]])
    on_chain = np.zeros(slots + 2, bool)
    on_chain[0] = True
    chain = np.zeros(1, np.int64)
    while True:  # after round r the chain holds every record within 2^r hops of the first
        on_chain[jump[chain]] = True
        chain = np.flatnonzero(on_chain)
        if chain[-1] >= end:
            break
        jump = jump[jump]
    if on_chain[sink]:
        bad = chain[chain < end]
        last = bad[np.argmax(nxt[bad] >= sink)] if len(bad) else 0
        raise LayoutError(f"record at byte {int(last) * 8} has kind {int(kind_at[last])} and does not fit the "
                          f"record sizes {dict(sizes)}")
    offsets = chain[chain < end]
    return offsets * 8, kind_at[offsets].astype(np.int32)


def _read(data: np.ndarray, offsets: np.ndarray, layout: tuple) -> np.ndarray:
    """The layout's fields of every record at ``offsets``, as one structured array."""
    dtype = np.dtype({"names": [f[0] for f in layout], "formats": [f[1] for f in layout],
                      "offsets": [f[2] for f in layout],
                      "itemsize": max(f[2] + np.dtype(f[1]).itemsize for f in layout)})
    rows = data[offsets[:, None] + np.arange(dtype.itemsize)]
    return np.ascontiguousarray(rows).view(dtype).ravel()


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


@dataclass
class Columns:
    """Parsed records: device activity (kernels, memcpy, memset), API calls, external correlations."""

    gpu: dict[str, Any]
    api: dict[str, np.ndarray]
    ext: dict[str, np.ndarray]
    sync_count: int = 0
    sync_ns: int = 0
    skipped_buffers: int = 0


_GROUPS = {KIND_CONCURRENT_KERNEL: 0, KIND_KERNEL: 0, KIND_MEMCPY: 1, KIND_MEMSET: 2, KIND_RUNTIME: 3, KIND_DRIVER: 3,
           KIND_EXTERNAL_CORRELATION: 4, KIND_SYNCHRONIZATION: 5}
_GROUP_OF = np.full(64, -1, np.int8)  # CUpti_ActivityKind -> index into the groups above (-1: not read)
_GROUP_OF[list(_GROUPS)] = list(_GROUPS.values())
_CORRELATION = {3: (("start", "<u8", 8), ("correlation_id", "<u4", 32)), 4: (("correlation_id", "<u4", 16),)}


def parse(raw: RawActivity, keep_from: int | None = None) -> Columns:
    """Every buffer of ``raw`` -> columns, records of one kind read together. A buffer whose layout
    does not match the sizes is skipped and counted (``skipped_buffers``), never misread.

    Only the API calls that put work on the device matter to the joins (cudaLaunchKernel,
    cuLaunchKernel, cudaMemcpyAsync, ...): ~95% of a training step's runtime/driver records
    (cudaGetDevice, cudaStreamIsCapturing, ...) and their external correlations are left out, read no
    further than their correlation id and start. Calls from ``keep_from`` on (CUPTI's clock) are all
    kept: they belong to a step still open at the flush, whose device work may not have arrived yet
    (the live worker carries them to its next batch, :func:`split_at`).
    """
    walked = []
    skipped = 0
    for index, data in enumerate(raw.buffers):
        data = np.asarray(data, np.uint8)
        try:
            offsets, kinds = walk(data, raw.sizes)
        except LayoutError:
            try:  # sizes measured wrongly, or none given: the struct versions of CUDA 13
                offsets, kinds = walk(data, CUDA13_SIZES)
            except LayoutError:
                skipped += 1
                continue
        group = _per_kind(_GROUP_OF, kinds, -1)
        walked.append((index, data, offsets, kinds, group))

    def read(g: int, layout: tuple, keep: np.ndarray | None = None,
             since: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(delivery order, fields, kinds) of every record of group ``g``; with ``keep``, those whose
        correlation id is in it or (API calls) that started at ``since`` or later."""
        got = []
        for index, data, offsets, kinds, group in walked:
            sel = group == g
            if not sel.any():
                continue
            offs, ks = offsets[sel], kinds[sel]
            if keep is not None:
                head = _read(data, offs, _CORRELATION[g])
                wanted = np.isin(head["correlation_id"].astype(np.int64), keep)
                if since is not None:
                    wanted |= head["start"] >= since
                offs, ks = offs[wanted], ks[wanted]
            if len(offs):
                got.append((offs + (index << 40), _read(data, offs, layout), ks))  # buffer order, then record order
        if not got:
            return None
        return (np.concatenate([x[0] for x in got]), np.concatenate([x[1] for x in got]), np.concatenate([x[2] for x in got]))

    gpu = _device_columns(raw, read(0, _KERNEL), read(1, _MEMCPY), read(2, _MEMSET))
    device_work = np.unique(gpu["correlation_id"].astype(np.int64)) if gpu else np.empty(0, np.int64)
    api = {c: np.empty(0, np.int64) for c in ("pid", "tid", "start", "end", "domain", "cbid", "correlation_id")}
    api_parts = read(3, _API, device_work, keep_from)
    if api_parts is not None:
        order, rec, kinds = api_parts
        o = np.argsort(order, kind="stable")
        rec, kinds = rec[o], kinds[o]
        api = {"pid": rec["pid"].astype(np.int64), "tid": rec["tid"].astype(np.int64), "start": rec["start"].astype(np.int64),
               "end": rec["end"].astype(np.int64), "domain": kinds.astype(np.int64), "cbid": rec["cbid"].astype(np.int64),
               "correlation_id": rec["correlation_id"].astype(np.int64)}
    ext = {"correlation_id": np.empty(0, np.int64), "external_id": np.empty(0, np.int64)}
    ext_parts = read(4, _EXTERNAL, np.union1d(device_work, api["correlation_id"]))
    if ext_parts is not None:
        order, rec, _ = ext_parts
        rec = rec[np.argsort(order, kind="stable")]
        ours = rec["external_kind"] == EXTERNAL_KIND_CUSTOM0  # another tool's ids (Kineto's CUSTOM1) are not ours
        ext = {"correlation_id": rec["correlation_id"][ours].astype(np.int64),
               "external_id": rec["external_id"][ours].astype(np.int64)}
    sync = read(5, _SYNC)
    sync_count = sync_ns = 0
    if sync is not None:
        sync_count = len(sync[1])
        sync_ns = int(np.maximum(sync[1]["end"].astype(np.int64) - sync[1]["start"].astype(np.int64), 0).sum())
    return Columns(gpu=gpu, api=api, ext=ext, sync_count=sync_count, sync_ns=sync_ns, skipped_buffers=skipped)


def _device_columns(raw: RawActivity, kernels: Any, memcpy: Any, memset: Any) -> dict[str, Any]:
    """Kernels, copies and sets as one set of columns, in delivery order."""
    pieces = []
    if kernels is not None:
        order, rec, _ = kernels
        unique, inverse = np.unique(rec["name"], return_inverse=True)
        readable = readable_ranges() if raw.names is None else None
        distinct = [demangle(raw.name_of(int(p), readable)) for p in unique.tolist()]
        collective = np.array([is_collective_kernel(n) for n in distinct], bool)
        names = np.array(distinct, dtype=object)[inverse]
        kind = np.where(collective[inverse], "collective", "kernel")
        graph = rec["graph_id"].astype(np.int64)
        pieces.append({"order": order, "device": rec["device"], "stream": rec["stream"], "start": rec["start"],
                       "end": rec["end"], "name": names, "kind": kind.astype(object), "correlation_id": rec["correlation_id"],
                       "grid": rec["grid"], "block": rec["block"], "has_dims": np.ones(len(rec), bool),
                       "registers_per_thread": rec["registers_per_thread"].astype(np.int64),
                       "shared_memory": rec["static_shared"].astype(np.int64) + rec["dynamic_shared"].astype(np.int64),
                       "graph_id": graph, "bytes": np.full(len(rec), -1, np.int64)})
    for parts, label in ((memcpy, "memcpy"), (memset, "memset")):
        if parts is None:
            continue
        order, rec, _ = parts
        # a name per distinct (copy kind, source, destination) or memory kind, not per record
        if label == "memcpy":
            key = rec["copy_kind"].astype(np.int64) * 65536 + rec["src_kind"].astype(np.int64) * 256 + rec["dst_kind"]
            unique, inverse = np.unique(key, return_inverse=True)
            distinct = [f"Memcpy {_MEMCPY_KINDS.get(k >> 16, 'Unknown')} ({_MEMORY_KINDS.get((k >> 8) & 255, 'Unknown')} -> "
                        f"{_MEMORY_KINDS.get(k & 255, 'Unknown')})" for k in unique.tolist()]
        else:
            unique, inverse = np.unique(rec["memory_kind"].astype(np.int64), return_inverse=True)
            distinct = [f"Memset ({_MEMORY_KINDS.get(k, 'Unknown')})" for k in unique.tolist()]
        names = np.array(distinct, dtype=object)[inverse]
        n = len(rec)
        pieces.append({"order": order, "device": rec["device"], "stream": rec["stream"], "start": rec["start"],
                       "end": rec["end"], "name": names, "kind": np.full(n, label, dtype=object),
                       "correlation_id": rec["correlation_id"], "grid": np.zeros((n, 3), np.int32),
                       "block": np.zeros((n, 3), np.int32), "has_dims": np.zeros(n, bool),
                       "registers_per_thread": np.full(n, -1, np.int64), "shared_memory": np.full(n, -1, np.int64),
                       "graph_id": rec["graph_id"].astype(np.int64), "bytes": rec["bytes"].astype(np.int64)})
    if not pieces:
        return {}
    cols = {k: np.concatenate([np.asarray(p[k]) for p in pieces]) for k in pieces[0]}
    o = np.argsort(cols.pop("order"), kind="stable")
    return {k: v[o] for k, v in cols.items()}


def tables(cols: Columns, epoch_offset_ns: int, api_name: Callable[[int, int], str]) -> dict[str, pa.Table]:
    """Parsed columns -> kernels, launches and external_correlation record tables.

    ``epoch_offset_ns`` maps CUPTI timestamps onto the process's epoch clock; kernels and launches
    get the same shift (CUPTI stamps both with one clock), so the stitcher's launch-before-kernel
    check sees their true order. ``api_name(domain kind, callback id)`` names a launch.
    """
    e = cols.ext
    order = np.argsort(e["correlation_id"], kind="stable")
    corr_sorted, ext_sorted = e["correlation_id"][order], e["external_id"][order]

    def external_ids(correlation: np.ndarray) -> pa.Array:
        """The op's external id for each correlation id (the joins read it from the launch row)."""
        q = np.asarray(correlation, np.int64)
        if not len(corr_sorted) or not len(q):
            return pa.nulls(len(q), pa.int64())
        k = np.minimum(np.searchsorted(corr_sorted, q), len(corr_sorted) - 1)
        return pa.array(ext_sorted[k], pa.int64(), mask=corr_sorted[k] != q)

    g = cols.gpu
    if g and len(g["start"]):
        no_dims = ~g["has_dims"]

        def dims(values: np.ndarray) -> pa.Array:
            flat = pa.array(np.asarray(values, np.int32).reshape(-1), pa.int32())
            return pa.FixedSizeListArray.from_arrays(flat, 3, mask=pa.array(no_dims))

        def masked(values: np.ndarray, missing: np.ndarray) -> pa.Array:
            return pa.array(values, pa.int64(), mask=missing)

        kernels = table_from_columns("kernels", {
            "device": pa.array(g["device"].astype(np.int32)), "stream": pa.array(g["stream"].astype(np.int64)),
            "start_ns": pa.array(g["start"].astype(np.int64) + epoch_offset_ns),
            "end_ns": pa.array(g["end"].astype(np.int64) + epoch_offset_ns),
            "name": pa.array(g["name"].tolist(), pa.string()), "kind": pa.array(g["kind"].tolist(), pa.string()),
            "correlation_id": pa.array(g["correlation_id"].astype(np.int64)),
            "grid": dims(g["grid"]), "block": dims(g["block"]),
            "registers_per_thread": masked(g["registers_per_thread"], no_dims),
            "shared_memory": masked(g["shared_memory"], no_dims),
            "graph_id": masked(g["graph_id"], g["graph_id"] == 0),  # 0 = not launched from a graph
            "bytes": masked(g["bytes"], g["bytes"] < 0),
            "external_id": external_ids(g["correlation_id"]),
        })
    else:
        kernels = table_from_columns("kernels", {})
    a = cols.api
    if len(a["start"]):
        keys = a["domain"] * (1 << 32) + a["cbid"]
        unique, inverse = np.unique(keys, return_inverse=True)
        names = pa.array([api_name(int(k >> 32), int(k & 0xFFFFFFFF)) for k in unique.tolist()], pa.string())
        launches = table_from_columns("launches", {
            "pid": pa.array(a["pid"]), "tid": pa.array(a["tid"]),
            "start_ns": pa.array(a["start"] + epoch_offset_ns), "end_ns": pa.array(a["end"] + epoch_offset_ns),
            "name": names.take(pa.array(inverse)), "correlation_id": pa.array(a["correlation_id"]),
            "external_id": external_ids(a["correlation_id"]),
        })
    else:
        launches = table_from_columns("launches", {})
    ext = table_from_columns("external_correlation", {"correlation_id": pa.array(e["correlation_id"]),
                                                      "external_id": pa.array(e["external_id"])}) \
        if len(e["correlation_id"]) else table_from_columns("external_correlation", {})
    return {"kernels": kernels, "launches": launches, "external_correlation": ext}


def concat_records(earlier: dict[str, pa.Table], parsed: dict[str, pa.Table]) -> dict[str, pa.Table]:
    """The records carried from the last batch, then those parsed now, table by table."""
    return {name: pa.concat_tables([earlier[name], table]) if name in earlier and earlier[name].num_rows else table
            for name, table in parsed.items()}


def split_at(tables: dict[str, pa.Table], cutoff_ns: int) -> tuple[dict[str, pa.Table], dict[str, pa.Table]]:
    """CUPTI records of this batch's steps, and those of the step still open when the worker flushed
    (launched at or after ``cutoff_ns``, the batch's last step end), kept for the next batch. A kernel
    goes with its launch when that is among the records (a step's kernels may run after it ends),
    else by its own start; external correlations go with their launches.

    The open step's API calls are all kept (``parse(keep_from=)``): a launch whose kernel was still
    running at the flush finds it in the next batch. Of the earlier calls, only those whose device
    work is here go on, as ``parse`` keeps them (the carried ones that launched nothing stop here)."""
    kernels, launches, ext = tables["kernels"], tables["launches"], tables["external_correlation"]
    kernel_ids = kernels.column("correlation_id").combine_chunks()
    launch_ids = launches.column("correlation_id").combine_chunks()
    launched_later = pc.greater_equal(launches.column("start_ns"), cutoff_ns)
    launch_now = pc.and_(pc.invert(launched_later), pc.is_in(launch_ids, value_set=kernel_ids))
    later_ids = launch_ids.filter(launched_later)
    kernel_later = pc.if_else(pc.is_in(kernel_ids, value_set=launch_ids),
                              pc.is_in(kernel_ids, value_set=later_ids),
                              pc.greater_equal(kernels.column("start_ns"), cutoff_ns))
    ext_ids = ext.column("correlation_id")
    ext_later = pc.is_in(ext_ids, value_set=later_ids)
    ext_now = pc.and_(pc.invert(ext_later), pc.is_in(ext_ids, value_set=kernel_ids))
    parts = {"kernels": (kernels, pc.invert(kernel_later), kernel_later),
             "launches": (launches, launch_now, launched_later),
             "external_correlation": (ext, ext_now, ext_later)}
    now = {name: table.filter(keep) for name, (table, keep, _) in parts.items()}
    later = {name: table.filter(carry) for name, (table, _, carry) in parts.items()}
    return now, later
