"""Message size and achieved bandwidth of each NCCL/RCCL collective kernel, as nccl-tests reports them.

Per collective kernel whose record carries PyTorch's c10d metadata (``records.KERNELS`` ``comm_*`` columns):

* ``bytes`` = elements x dtype size, counting the message nccl-tests calls the size *S*: the whole array
  (for all_gather the output, for reduce_scatter the input; the two ends agree for the others);
* ``algbw = bytes / kernel duration`` (the kernel's own interval on the device);
* ``busbw = algbw x factor(n)`` with n the process group's size, the factors of nccl-tests
  (doc/PERFORMANCE.md, src/alltoall.cu, src/sendrecv.cu): all_reduce 2(n-1)/n; all_gather, reduce_scatter,
  all_to_all (n-1)/n; broadcast, reduce, send, recv 1. With n < 2 nothing crosses a link: no busbw.
* ``busbw_fraction = busbw / link peak``, the GPU's one-direction NVLink/xGMI bandwidth
  (``metrics.hardware``), where the table knows it.

The kernel's duration includes any wait for late peers, so busbw is a lower bound on what the link did
while it moved data. It can also come out above the link peak: a rank that arrives last may find part of
its peers' data already in its receive buffers and finish in less time than the transfer took, and an
intra-node collective may run over several paths at once. Such kernels keep their measured values and are
counted per step (``over_link_peak``), never capped.

Per step (and its rank span): total bytes of the sized collectives, their bytes-weighted mean busbw
(sum bytes_i x busbw_i / sum bytes_i), the slowest collective -- the longest-running one with a known busbw
(the lowest busbw is always the smallest, latency-bound message, which says nothing) -- and how many
collective kernels had no size. Everything is numpy over the kernels; the name and dtype tables are applied per distinct value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..conventions import numbers_on_rows, scatter_rows
from ..metrics.hardware import SPECS

GBS = 1e9

# c10 ScalarType names (as record_param_comms writes 'dtype') -> bytes per element.
DTYPE_BYTES: dict[str, int] = {
    "Byte": 1, "Char": 1, "Bool": 1, "QInt8": 1, "QUInt8": 1, "Short": 2, "UInt16": 2, "Half": 2, "BFloat16": 2,
    "Int": 4, "UInt32": 4, "QInt32": 4, "Float": 4, "ComplexHalf": 4, "Long": 8, "UInt64": 8, "Double": 8,
    "ComplexFloat": 8, "ComplexDouble": 16, "Float8_e5m2": 1, "Float8_e4m3fn": 1, "Float8_e5m2fnuz": 1,
    "Float8_e4m3fnuz": 1, "Float8_e8m0fnu": 1,
}

# family -> (which element count is nccl-tests' S, bus factor as a function of the group size n)
FAMILIES: dict[str, tuple[str, Any]] = {
    "all_reduce": ("in", lambda n: 2.0 * (n - 1) / n),
    "all_gather": ("out", lambda n: (n - 1) / n),
    "reduce_scatter": ("in", lambda n: (n - 1) / n),
    "all_to_all": ("in", lambda n: (n - 1) / n),
    "broadcast": ("in", lambda n: np.ones_like(n)),
    "reduce": ("in", lambda n: np.ones_like(n)),
    "send": ("in", lambda n: np.ones_like(n)),
    "recv": ("out", lambda n: np.ones_like(n)),
}


def collective_family(name: str) -> str | None:
    """c10d's collective name ('allreduce', '_allgather_base', 'reduce_scatter_tensor_coalesced', 'all_to_allv',
    'recvAnysource', ...) -> its nccl-tests family; None for what nccl-tests has no bus factor for here
    (barrier, gather, scatter, coalesced groups of unknown make-up)."""
    key = name.lower().lstrip("_").replace("_", "")
    for prefix, family in (("allreduce", "all_reduce"), ("allgather", "all_gather"), ("reducescatter", "reduce_scatter"),
                           ("alltoall", "all_to_all"), ("recv", "recv")):
        if key.startswith(prefix):
            return family
    return {"broadcast": "broadcast", "broadcastoop": "broadcast", "reduce": "reduce", "reduceoop": "reduce",
            "send": "send"}.get(key)


@dataclass
class CollectiveBandwidth:
    """Per real kernel row (NaN = unknown) and per step row."""

    bytes: np.ndarray
    algbw: np.ndarray          # bytes/s
    busbw: np.ndarray          # bytes/s
    link_peak: float           # bytes/s per direction, NaN unknown
    has_collective: np.ndarray  # per step: any collective kernel
    unsized: np.ndarray        # per step: collective kernels without a message size
    step_bytes: np.ndarray     # per step: NaN when no collective was sized
    step_busbw: np.ndarray     # per step: bytes-weighted mean busbw, NaN when none is known
    step_rated_bytes: np.ndarray  # per step: the bytes that weight step_busbw (collectives with a known busbw)
    over_link_peak: np.ndarray  # per step: kernels whose busbw exceeded the link peak
    slowest: np.ndarray        # per step: kernel row of the longest collective with a known busbw, -1 none
    duration_s: np.ndarray     # per real kernel row


def _per_value(column: pa.ChunkedArray, table: Any, missing: Any) -> np.ndarray:
    """Apply ``table`` (a function of one string) to each distinct value of a string column, not to each row;
    null rows get ``missing``."""
    enc = pc.dictionary_encode(column.combine_chunks())
    mapped = np.array([table(v) for v in enc.dictionary.to_pylist()] + [missing])  # [-1]: null
    return mapped[pc.fill_null(enc.indices, -1).to_numpy(zero_copy_only=False).astype(np.int64)]


def _floats(column: pa.ChunkedArray) -> np.ndarray:
    return pc.cast(column, pa.float64()).to_numpy(zero_copy_only=False).astype(np.float64)


def collective_bandwidth(kernels: pa.Table, is_collective: np.ndarray, duration_ns: np.ndarray, kernel_step: np.ndarray,
                         n_steps: int, device_model: str | None) -> CollectiveBandwidth:
    """``is_collective``, ``duration_ns`` (the kernel's own, unclipped) and ``kernel_step`` (-1: in no step) per
    real kernel row of ``kernels``; ``device_model`` names the hardware table entry the link peak comes from."""
    n_k = kernels.num_rows
    names = list(FAMILIES)
    family = _per_value(kernels.column("comm_collective"), lambda v: names.index(f) if (f := collective_family(v)) else -1, -1)
    elem = _per_value(kernels.column("comm_dtype"), lambda v: DTYPE_BYTES.get(v, np.nan), np.nan).astype(np.float64)
    n_in = _floats(kernels.column("comm_in_nelems"))
    n_out = _floats(kernels.column("comm_out_nelems"))
    group = _floats(kernels.column("comm_group_size"))
    count = np.full(n_k, np.nan)
    factor = np.full(n_k, np.nan)
    with np.errstate(divide="ignore", invalid="ignore"):
        for code, (side, bus_factor) in enumerate(FAMILIES.values()):
            rows = is_collective & (family == code)
            count[rows] = (n_in if side == "in" else n_out)[rows]
            factor[rows] = np.where(group[rows] >= 2, bus_factor(group[rows]), np.nan)
        size = count * elem
        seconds = duration_ns / 1e9
        algbw = np.where(seconds > 0, size / seconds, np.nan)
        busbw = algbw * factor
    spec = SPECS.get(device_model) if device_model else None
    peak = float(spec.link_bandwidth) if spec is not None and spec.link_bandwidth else np.nan

    live = kernel_step >= 0
    step = np.where(live, kernel_step, 0)
    sized = live & np.isfinite(size)
    rated = live & np.isfinite(busbw) & (size > 0)
    coll = live & is_collective
    has_collective = np.bincount(step[coll], minlength=n_steps)[:n_steps] > 0
    unsized = np.bincount(step[coll & ~np.isfinite(size)], minlength=n_steps)[:n_steps]
    total = np.bincount(step[sized], weights=size[sized], minlength=n_steps)[:n_steps]
    any_sized = np.bincount(step[sized], minlength=n_steps)[:n_steps] > 0
    weight = np.bincount(step[rated], weights=size[rated], minlength=n_steps)[:n_steps]
    weighted = np.bincount(step[rated], weights=size[rated] * busbw[rated], minlength=n_steps)[:n_steps]
    over = np.bincount(step[rated & (busbw > peak)], minlength=n_steps)[:n_steps] if np.isfinite(peak) else np.zeros(n_steps, np.int64)
    slowest = np.full(n_steps, -1, np.int64)
    rows = np.nonzero(rated)[0]
    if len(rows):
        order = rows[np.lexsort((-duration_ns[rows], step[rows]))]
        first = np.r_[0, np.nonzero(np.diff(step[order]))[0] + 1]
        slowest[step[order[first]]] = order[first]
    with np.errstate(divide="ignore", invalid="ignore"):
        step_busbw = np.where(weight > 0, weighted / weight, np.nan)
    return CollectiveBandwidth(bytes=size, algbw=algbw, busbw=busbw, link_peak=peak, has_collective=has_collective,
                               unsized=unsized, step_bytes=np.where(any_sized, total, np.nan), step_busbw=step_busbw,
                               step_rated_bytes=weight,
                               over_link_peak=over, slowest=slowest, duration_s=duration_ns / 1e9)


def collective_columns(cb: CollectiveBandwidth | None, kernels: pa.Table, k_span: np.ndarray, k_row: np.ndarray,
                       carriers: np.ndarray, carrier_step: np.ndarray, n: int) -> dict[str, Any]:
    """Span-table columns for n exported spans: the spans ``k_span`` are the real kernels ``k_row``, the
    spans ``carriers`` the step and rank spans of steps ``carrier_step``. Every other row is null, so
    each column is scattered onto its few rows."""
    if cb is None:
        return {}
    if not len(cb.bytes):
        k_span, k_row = k_span[:0], k_row[:0]
    if not len(cb.step_bytes):
        carriers, carrier_step = carriers[:0], carrier_step[:0]
    both = np.concatenate([k_span, carriers])

    def on_both(per_kernel: np.ndarray, per_step: np.ndarray) -> pa.Array:
        return numbers_on_rows(np.concatenate([per_kernel[k_row], per_step[carrier_step]]), both, n)

    cols: dict[str, Any] = {
        "plasmient.comm.bytes": on_both(cb.bytes, cb.step_bytes),
        "plasmient.comm.algbw_gbs": numbers_on_rows(cb.algbw[k_row] / GBS, k_span, n),
        "plasmient.comm.busbw_gbs": on_both(cb.busbw / GBS, cb.step_busbw / GBS),
        "plasmient.comm.busbw_fraction": on_both(cb.busbw / cb.link_peak, cb.step_busbw / cb.link_peak),
    }
    if len(cb.step_bytes):
        with_comm = cb.has_collective[carrier_step]
        cols["plasmient.comm.link_peak_gbs"] = numbers_on_rows(np.full(int(with_comm.sum()), cb.link_peak / GBS),
                                                               carriers[with_comm], n)
        cols["plasmient.comm.unsized"] = numbers_on_rows(np.asarray(cb.unsized, np.int64)[carrier_step][with_comm],
                                                         carriers[with_comm], n)
        rated = np.isfinite(cb.step_bytes[carrier_step]) & np.isfinite(cb.link_peak)
        cols["plasmient.comm.over_link_peak"] = numbers_on_rows(np.asarray(cb.over_link_peak, np.int64)[carrier_step][rated],
                                                                carriers[rated], n)
        slow = cb.slowest[carrier_step]
        has_slow = slow >= 0
        if not has_slow.any():
            return cols
        rows, slow = carriers[has_slow], slow[has_slow]
        cols["plasmient.comm.slowest.collective"] = scatter_rows(kernels.column("comm_collective").combine_chunks().take(pa.array(slow)), rows, n)
        cols["plasmient.comm.slowest.bytes"] = numbers_on_rows(cb.bytes[slow], rows, n)
        cols["plasmient.comm.slowest.busbw_gbs"] = numbers_on_rows(cb.busbw[slow] / GBS, rows, n)
        cols["plasmient.comm.slowest.duration_s"] = numbers_on_rows(cb.duration_s[slow], rows, n)
    return cols
