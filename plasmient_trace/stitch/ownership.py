"""FLOP ownership: which op's modelled work each kernel carries, and what that work is per kernel.

A kernel carries the FLOPs and bytes of the innermost modelled op on its launching op's ancestor chain,
split over that op's kernels by duration, except that a matmul's or convolution's FLOPs and bytes go only to
its GEMM/convolution kernels, not to the transposes, fills and casts beside them, which are memory-bound by
nature (metrics.flops.ownership.split_op_work). An op yields to a same-class op below it (aten::linear over
aten::addmm) so nothing is counted twice. On a CPU-only rank the ops are the device's kernels. A kernel
whose record carries its own FLOPs (Inductor's kernel_flop, a CUDA-graph capture pairing) uses those.
Every kernel also says whether its FLOPs are *known*: memcpy/memset and collectives are known zero, a
kernel with no modelled owner is unknown (its time counts against ``plasmient.flops.coverage``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..metrics.flops import flop_owners
from ..metrics.flops.kernel_roles import ROLE_MOVES
from ..metrics.flops.ownership import split_op_work
from ..metrics.flops.labels import Labels, as_labels
from ..metrics.hardware import FP32_PRECISIONS
from .inputs import KIND_CODE, RankInput
from .joins import JoinedRank
from .nesting import any_ancestor


def cpu_kernel_ops(op_parent: np.ndarray, owns: np.ndarray, in_owner: np.ndarray | None = None) -> np.ndarray:
    """The ops that stand for kernels when the CPU is the device: each outermost op that owns
    FLOPs (its whole interval, children included, is its work: the BLAS call inside aten::addmm
    is addmm's own time), and every leaf op not inside one (``timeline`` then leaves out the scopes that ran
    no op). ``in_owner``: ``any_ancestor(op_parent, owns)`` when the caller already has it."""
    is_parent = np.zeros(len(op_parent), bool)
    is_parent[op_parent[op_parent >= 0]] = True
    if in_owner is None:
        in_owner = any_ancestor(op_parent, owns)
    return np.nonzero((owns | ~is_parent) & ~in_owner)[0]


# An op's own time below this is dispatch, not work: the mean kernel length under which a span is latency-bound
# (metrics.compute.LATENCY_BOUND_MEAN_KERNEL_S).
OWN_WORK_MIN_NS = 10_000


def own_time_gaps(op_parent: np.ndarray, start: np.ndarray, end: np.ndarray, candidates: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The CPU work an op does in its own body, between its child ops, as (op, start, end) intervals: for
    each op of ``candidates`` (ops with no FLOP formula that no kernel op holds) that spends at least half
    of its interval and at least ``OWN_WORK_MIN_NS`` outside its children. LAPACK inside
    ``aten::_linalg_svd``, oneDNN inside an RNN layer or the sort inside ``aten::sort`` run between the small
    ops they call (an allocation, a copy, an error check); with only those children as the CPU's kernels,
    0.2 ms of a 20 ms SVD counted as work and the rest as idle. The microseconds a composite op
    (``aten::linear``, an autograd node, ``aten::item``) spends dispatching to its children stay outside, as
    a GPU's launch overhead does. The intervals are kernels of unknown FLOPs."""
    n = len(op_parent)
    child = np.nonzero(op_parent >= 0)[0]
    if not len(child) or not candidates.any():
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    length = np.maximum(end - start, 0).astype(np.float64)
    in_children = np.bincount(op_parent[child], weights=length[child], minlength=n)
    has_children = np.bincount(op_parent[child], minlength=n) > 0
    own = length - in_children
    working = candidates & has_children & (own >= in_children) & (own >= OWN_WORK_MIN_NS)
    kids = child[working[op_parent[child]]]
    if not len(kids):
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    kids = kids[np.lexsort((start[kids], op_parent[kids]))]
    owner = op_parent[kids]
    first = np.r_[True, owner[1:] != owner[:-1]]
    last = np.r_[owner[1:] != owner[:-1], True]
    # before each child: from the op's start (first child) or the previous child's end; after the last: to the op's end
    gap_start = np.where(first, start[owner], np.r_[0, end[kids][:-1]])
    ops = np.concatenate([owner, owner[last]])
    lo = np.concatenate([gap_start, end[kids][last]])
    hi = np.concatenate([start[kids], end[owner[last]]])
    keep = hi > lo
    order = np.lexsort((lo[keep], ops[keep]))
    return ops[keep][order], lo[keep][order], hi[keep][order]


@dataclass
class KernelWork:
    """Per kernel of one rank (real kernels, then the synthetic CPU ones)."""

    owner: np.ndarray    # op whose model the kernel carries (-1 none)
    flops: np.ndarray
    bytes: np.ndarray
    dtype_src: np.ndarray  # op row whose dtype sets the peak (-1: none)
    known: np.ndarray    # bool: the kernel's FLOPs are known (possibly a known zero)
    bytes_known: np.ndarray  # bool: its bytes are known (a join's are not: a TensorList has no element type)
    moves: np.ndarray    # bool: a transpose/fill/cast beside a matmul's GEMM: 0 FLOPs, bytes unknown, memory-bound


def _float_col(table: pa.Table, name: str, n_total: int) -> np.ndarray:
    out = np.full(n_total, np.nan)
    if name in table.column_names and table.num_rows:
        out[:table.num_rows] = table.column(name).cast(pa.float64()).fill_null(np.nan).to_numpy()
    return out


def kernel_work(inp: RankInput, j: JoinedRank, launching_op: np.ndarray, kinds: np.ndarray,
                alive: np.ndarray, duration_ns: np.ndarray, yields: np.ndarray, role: np.ndarray) -> KernelWork:
    """Modelled FLOPs and bytes per kernel, and whether they are known. ``yields``: per op, as
    :func:`~plasmient_trace.metrics.flops.yields_flops` gives it; ``role``: per kernel row, as
    :func:`~plasmient_trace.metrics.flops.kernel_roles.kernel_roles` gives it (``DeviceTimeline.role``)."""
    n_op = len(j.op_parent)
    n_ks = len(launching_op)
    rs = inp.records
    owner, counted = flop_owners(launching_op, j.op_parent, inp.op_model, yields)
    is_compute = kinds == KIND_CODE["kernel"]
    owned = counted & is_compute & alive
    share, passed = split_op_work(owner, owned, duration_ns, role, inp.op_model, n_op)
    o_fl = inp.op_flops if n_op else np.zeros(1)
    o_by = inp.op_bytes if n_op else np.zeros(1)
    flops = np.where(owned, o_fl[np.maximum(owner, 0)] * share, 0.0) if n_op else np.zeros(n_ks)
    kbytes = np.where(owned, o_by[np.maximum(owner, 0)] * share, 0.0) if n_op else np.zeros(n_ks)
    rec_bytes = np.zeros(n_ks)
    rec_sized = np.zeros(n_ks, bool)
    if rs.kernels.num_rows:
        recorded = rs.kernels.column("bytes")
        rec_bytes[:rs.kernels.num_rows] = recorded.fill_null(0).to_numpy().astype(np.float64)
        rec_sized[:rs.kernels.num_rows] = recorded.is_valid().to_numpy(zero_copy_only=False)
    kbytes = np.where(is_compute, kbytes, rec_bytes)
    # A compute kernel's bytes are known where its op's model gave some, or the op is shape-only (moves
    # nothing); a model's 0 is otherwise "not modelled" (joins, dtypes it cannot read). A copy's or a
    # collective's are known where the record sized it. A helper a matmul's work passed by moves bytes the
    # op's model leaves out: unknown.
    model_sized = (o_by > 0) | inp.op_model.equals("view") if n_op else np.zeros(1, bool)
    bytes_known = np.where(is_compute, owned & ~passed & model_sized[np.maximum(owner, 0)], rec_sized)
    # Per-kernel FLOPs from the record (Inductor, graph-capture pairing) win over the op model.
    rec_flops = _float_col(rs.kernels, "model_flops", n_ks)
    rec_model_bytes = _float_col(rs.kernels, "model_bytes", n_ks)
    per_kernel = np.isfinite(rec_flops)
    flops = np.where(per_kernel, rec_flops, flops)
    kbytes = np.where(np.isfinite(rec_model_bytes), rec_model_bytes, kbytes)
    bytes_known |= np.isfinite(rec_model_bytes)
    known = owned | ~is_compute | per_kernel
    # data movement by nature: a helper the op's work passed by, here or in the capture of a replayed graph
    # (sources.graph_capture leaves its bytes null and its FLOPs 0)
    moves = is_compute & ((passed & ~per_kernel)
                          | (per_kernel & (rec_flops == 0) & ~np.isfinite(rec_model_bytes) & (role == ROLE_MOVES)))
    return KernelWork(owner=np.where(owned, owner, -1), flops=flops, bytes=kbytes,
                      dtype_src=np.where(owner >= 0, owner, launching_op), known=known, bytes_known=bytes_known,
                      moves=moves)


def kernel_precisions(inp: RankInput, work: KernelWork, fp32_code: np.ndarray) -> Labels:
    """Per kernel, the precision its math ran at: its op's dtype, ``tf32`` where an fp32 GEMM ran a
    tensor-core kernel, ``3xtf32`` where an fp32 op ran one that splits each product in three
    (hardware.kernel_precision), the kernel's own ``model_dtype`` where the records carry one (CUDA-graph
    replays), ``fp32`` where nothing says. ``fp32_code``: per kernel row, hardware.fp32_precision_codes of
    its name where an op's dtype is fp32 (``DeviceTimeline.fp32_code``)."""
    n_ks = len(work.flops)
    op_dtype = as_labels(inp.op_dtype)
    vocab = [*FP32_PRECISIONS, *(str(d) for d in op_dtype.names)]
    code = np.zeros(n_ks, np.int64)  # FP32_PRECISIONS[0], fp32
    if len(op_dtype.codes) and n_ks:
        has_src = work.dtype_src >= 0
        code[has_src] = len(FP32_PRECISIONS) + op_dtype.codes[work.dtype_src[has_src]]
        n_real = inp.records.kernels.num_rows
        if n_real:
            # only kernels whose op says fp32: with no op, nothing says what a tensor-core kernel multiplied
            fp32_op = np.array([d == "fp32" for d in vocab])[code[:n_real]] & has_src[:n_real]
            real = code[:n_real]
            real[fp32_op] = fp32_code[:n_real][fp32_op]
    rs = inp.records
    if "model_dtype" in rs.kernels.column_names and rs.kernels.num_rows and rs.kernels.column("model_dtype").null_count < rs.kernels.num_rows:
        enc = pc.dictionary_encode(rs.kernels.column("model_dtype").combine_chunks())
        idx = enc.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
        own = idx >= 0
        code[:rs.kernels.num_rows][own] = len(vocab) + idx[own]
        vocab += [str(d) for d in enc.dictionary.to_pylist()]
    return Labels(codes=code.astype(np.int32), names=np.asarray(vocab))


def kernel_peaks(inp: RankInput, precision: Labels) -> np.ndarray:
    """Peak FLOP/s per kernel for the precision of its math (NaN where the device's peak is unknown)."""
    return np.array([inp.spec.peak(str(d)) for d in precision.names], np.float64)[precision.codes]
