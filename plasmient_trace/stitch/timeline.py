"""One rank's device timeline: every kernel's interval, kind, step and share of its device, and each step's
tile and overlap, measured once over *all* the rank's kernels.

These are the only numbers of the accounting that depend on kernels of other steps (a pipelined step's
first kernels run in the previous step's tile; concurrent kernels of two steps share the device; the
launch queue counts every launched kernel), so they are computed here, before the rank is cut into
chunks of steps (``stitch.chunks``), and each chunk's tree reads its rows of them. A rank stitched whole
and a rank stitched chunk by chunk therefore get the same numbers.

What a kernel's name says (its role in its op's work, the precision an fp32 op's math ran at on it), and which
ops yield their FLOPs to a same-class op below them (``metrics.flops.yields_flops``), are found here too, once
per rank: a chunk's tree would otherwise classify the same names and climb the same op trees again.

Kernel rows are the rank's real kernels, then the synthetic ones: on a CPU-only rank the ops that stand
for kernels (``ownership.cpu_kernel_ops``), then the work ops do in their own bodies between their child ops
(``ownership.own_time_gaps``), one interval per gap.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..metrics.flops import yields_flops
from ..metrics.flops.kernel_roles import ROLE_OTHER, kernel_roles
from ..metrics.flops.labels import as_labels
from ..metrics.grouping import dictionary_of, match_distinct
from ..metrics.hardware import fp32_precision_codes
from ..records import collective_kernel_names, collective_op_names
from .inputs import KIND_CODE, RankInput, StitchOptions
from .joins import JoinedRank
from .nesting import any_ancestor
from .overlap import StepOverlap, step_overlap
from .ownership import cpu_kernel_ops, own_time_gaps
from .windows import kernel_shares_ns, step_tiles

_BIG = np.iinfo(np.int64).max

@dataclass
class DeviceTimeline:
    """Per kernel row (real, then synthetic), per step row and (``op_yields``) per op row of one rank."""

    synth_ops: np.ndarray     # per synthetic kernel row (a CPU-only rank's), the op it stands for or is a gap of
    start: np.ndarray         # the kernel's own interval
    end: np.ndarray
    kind: np.ndarray          # int8 KIND_CODE
    step: np.ndarray          # step row (-1: outside every step)
    device: np.ndarray        # device ordinal (-1: the CPU)
    clip_start: np.ndarray    # the interval inside the rank's device range (what time accounting uses)
    clip_end: np.ndarray
    share_s: np.ndarray       # device seconds the kernel holds when concurrent kernels split time equally
    tile_start: np.ndarray    # per step: its device window (stitch.windows.step_tiles)
    tile_end: np.ndarray
    overlap: StepOverlap      # per step
    rank_devices: int         # devices the rank's kernels ran on (at least 1)
    outside_kernels: int      # real kernels outside every step
    role: np.ndarray          # int8 kernel_roles of the kernel's name (synthetic kernels: ROLE_OTHER)
    fp32_code: np.ndarray     # int8 index into hardware.FP32_PRECISIONS of an fp32 op's math on the kernel (0: fp32)
    op_yields: np.ndarray     # per op: its FLOPs yield to a same-class op below it (metrics.flops.yields_flops)

    @property
    def n_real(self) -> int:
        return len(self.start) - len(self.synth_ops)


# Scopes torch records around its own machinery, not the model's ops: dynamo's guard check before each compiled
# frame (24-130 us a call on a small MLP here). Their time is framework overhead, as Python is.
_FRAMEWORK_SCOPES = pa.array(["TorchDynamo Cache Lookup"])


def _python_only_scopes(ops: pa.Table, rows: np.ndarray, owns: np.ndarray) -> np.ndarray:
    """Of the leaf ops ``rows``, the record_function scopes (user annotations: Optimizer.zero_grad with
    set_to_none, a user's ``with record_function("data")``) that ran no op: their time is the Python inside
    them, as is dynamo's guard check (``_FRAMEWORK_SCOPES``). The same Python outside a scope is idle CPU time
    between ops, so it is here too, and the step's idle row, not an unknown-FLOPs op, says where it went.
    Scopes that are collectives (gloo:all_reduce) or that a registered formula models stay work."""
    if not len(rows):
        return np.zeros(0, bool)
    names = ops.column("name").take(rows)
    scope = pc.equal(ops.column("category").take(rows), "user_annotation").fill_null(False).to_numpy(zero_copy_only=False)
    scope |= pc.is_in(names, value_set=_FRAMEWORK_SCOPES).fill_null(False).to_numpy(zero_copy_only=False)
    if not scope.any():
        return scope
    collective = match_distinct(names, collective_op_names)
    return scope & ~collective & ~owns[rows]


# Ops that allocate a tensor and hand its filling to a child op (aten::zeros -> aten::zero_, aten::clone ->
# aten::copy_, aten::randint -> aten::random_, aten::arange -> its out= form): their own time is the
# allocator's, which is no more the device's work on a CPU than on a GPU.
_ALLOCATING_OPS = pa.array([f"aten::{name}" for name in (
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "zeros", "zeros_like", "new_zeros",
    "ones", "ones_like", "new_ones", "full", "full_like", "new_full", "clone", "contiguous", "to", "_to_copy",
    "rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm", "arange", "linspace",
    "logspace", "eye")])


def _aten_working_names(names: pa.Array) -> pa.Array:
    return pc.and_(pc.starts_with(names, "aten::"), pc.invert(pc.is_in(names, value_set=_ALLOCATING_OPS)))


def _own_work_candidates(ops: pa.Table) -> np.ndarray:
    """Per op: may its own time between child ops be CPU work (``ownership.own_time_gaps``)? An ATen op, whose
    body is C++, not an allocating one. Not a scope whose body is Python: a ``record_function``, an autograd
    Function written in Python (checkpointing's), torch.compile's ``CompiledFunction`` (the AOTAutograd and
    Inductor wrappers around the compiled kernels: 340 of the 375 us outside the GEMMs of a small MLP's
    compiled step, against 38 us for the kernels themselves when Inductor names them)."""
    return match_distinct(ops.column("name"), _aten_working_names)


def kernel_kinds(inp: RankInput, synth_ops: np.ndarray, kernel_names: pa.Array | None) -> np.ndarray:
    """KIND_CODE per kernel row; collective kernels (records.COLLECTIVE_KERNEL) and collective ops standing
    for kernels on a CPU are collectives whatever category the source gave them. ``kernel_names``: the
    kernels' names as ``grouping.dictionary_of`` gives them (None without kernels)."""
    rs = inp.records
    n_k = rs.kernels.num_rows
    codes = np.zeros(n_k + len(synth_ops), np.int8)  # synthetic CPU kernels are 'kernel'
    kind = rs.kernels.column("kind")
    for name, code in KIND_CODE.items():
        if code:
            codes[:n_k][pc.equal(kind, pa.scalar(name, pa.string())).fill_null(False).to_numpy(zero_copy_only=False)] = code
    if n_k:
        comm = match_distinct(kernel_names, collective_kernel_names)
        codes[:n_k][comm & (codes[:n_k] == KIND_CODE["kernel"])] = KIND_CODE["collective"]
    if len(synth_ops):
        hit = match_distinct(rs.ops.column("name").combine_chunks().take(synth_ops), collective_op_names)
        codes[n_k:] = np.where(hit, KIND_CODE["collective"], KIND_CODE["kernel"])
    return codes


def device_timeline(inp: RankInput, j: JoinedRank, options: StitchOptions) -> DeviceTimeline:
    rs = inp.records
    n_steps, n_op, n_k = len(j.steps), len(j.op_parent), len(j.kernel_start)
    synth_ops = np.zeros(0, np.int64)
    o_start = rs.ops.column("start_ns").to_numpy() if n_op else np.zeros(0, np.int64)
    o_end = rs.ops.column("end_ns").to_numpy() if n_op else np.zeros(0, np.int64)
    synth_start, synth_end = np.zeros(0, np.int64), np.zeros(0, np.int64)
    yields = yields_flops(j.op_parent, inp.op_model, inp.op_flops) if n_op else np.zeros(0, bool)
    if n_k == 0 and n_op:
        # No device activity: the CPU is the device and its ops are the kernels.
        unmodelled = inp.op_model.equals("none")
        owns = ~unmodelled & ~yields
        in_owner = any_ancestor(j.op_parent, owns)
        whole = cpu_kernel_ops(j.op_parent, owns, in_owner)
        whole = whole[(j.op_step[whole] >= 0) & ~_python_only_scopes(rs.ops, whole, owns)]
        gap_ops, gap_start, gap_end = own_time_gaps(j.op_parent, o_start, o_end,
                                                    unmodelled & ~in_owner & (j.op_step >= 0) & _own_work_candidates(rs.ops))
        synth_ops = np.concatenate([whole, gap_ops])
        synth_start = np.concatenate([o_start[whole], gap_start])
        synth_end = np.concatenate([o_end[whole], gap_end])
    ks = np.concatenate([j.kernel_start, synth_start]).astype(np.int64)
    ke = np.concatenate([j.kernel_end, synth_end]).astype(np.int64)
    kstep = np.concatenate([j.kernel_step, j.op_step[synth_ops]]).astype(np.int64)
    # classified by name three ways (kind, role, fp32 precision): hashed once
    kernel_names = dictionary_of(rs.kernels.column("name")) if n_k else None
    kinds = kernel_kinds(inp, synth_ops, kernel_names)
    devs = np.concatenate([rs.kernels.column("device").to_numpy().astype(np.int64) if n_k else np.zeros(0, np.int64),
                           np.full(len(synth_ops), -1, np.int64)])

    # ---- steps tile the rank's device timeline and keep their kernels whole (stitch.windows)
    live = np.nonzero(kstep >= 0)[0]
    last_end = np.full(n_steps, -_BIG, np.int64)
    np.maximum.at(last_end, kstep[live], ke[live])
    has_k = np.bincount(kstep[live], minlength=n_steps) > 0 if n_steps else np.zeros(0, bool)
    facts = options.step_facts
    opens_at = facts.tile_floor(int(j.steps[0])) if facts is not None and n_steps else None
    t_start, t_end = step_tiles(j.step_start, j.step_end, last_end, has_k, opens_at)
    # Only the rank's device range bounds a kernel (a launch-less kernel cannot reach before the first step).
    # Opened by an earlier batch, the range starts where that batch's last step ended: the device time before
    # it is already billed there (as idle, where this batch's early kernels ran unseen).
    lo, hi = (t_start[0], t_end[-1]) if n_steps else (0, 0)
    cs = np.zeros(len(ks), np.int64)
    ce = np.zeros(len(ks), np.int64)
    cs[live] = np.clip(ks[live], lo, hi)
    ce[live] = np.clip(ke[live], cs[live], hi)
    share_s = np.zeros(len(ks))
    share_s[live] = kernel_shares_ns(devs[live], cs[live], ce[live]) / 1e9

    launch_rows = np.concatenate([j.kernel_launch, np.full(len(synth_ops), -1, np.int64)])[live]
    l_start = rs.launches.column("start_ns").to_numpy() if rs.launches.num_rows else np.zeros(0, np.int64)
    launch_start = np.where(launch_rows >= 0, l_start[np.maximum(launch_rows, 0)] if len(l_start) else -1, -1)
    kind_live = kinds[live]
    copy = (kind_live == KIND_CODE["memcpy"]) | (kind_live == KIND_CODE["memset"])
    overlap = step_overlap(n_steps, kstep[live], devs[live], cs[live], ce[live], kind_live == KIND_CODE["collective"],
                           copy, launch_start, t_start, t_end)
    role, fp32_code = _name_facts(inp, len(ks), kernel_names)
    return DeviceTimeline(
        synth_ops=synth_ops, start=ks, end=ke, kind=kinds, step=kstep, device=devs, clip_start=cs, clip_end=ce,
        share_s=share_s, tile_start=t_start, tile_end=t_end, overlap=overlap,
        rank_devices=max(len(np.unique(devs[live])), 1), outside_kernels=int((j.kernel_step < 0).sum()) if n_k else 0,
        role=role, fp32_code=fp32_code, op_yields=yields,
    )


def _name_facts(inp: RankInput, n_ks: int, names: pa.Array | None) -> tuple[np.ndarray, np.ndarray]:
    """Per kernel row: its role (metrics.flops.kernel_roles) and its fp32 precision code
    (hardware.fp32_precision_codes; read only where an op's dtype is fp32, so left 0 without one)."""
    n_k = inp.records.kernels.num_rows
    role = np.full(n_ks, ROLE_OTHER, np.int8)
    fp32_code = np.zeros(n_ks, np.int8)
    if n_k:
        role[:n_k] = kernel_roles(names)
        if "fp32" in as_labels(inp.op_dtype).names.tolist():
            fp32_code[:n_k] = fp32_precision_codes(names)
    return role, fp32_code
