"""The span tree: joined records of every rank -> one trace per step, fleet -> node -> rank -> step ->
module -> op -> kernel, with the metrics of DESIGN.md on every span, as a columnar SpanBatch.

All spans of all ranks live in flat numpy arrays (a parent index per span). Windows are widened
bottom-up so a parent covers its children (an op's kernels run after the op returned on the CPU),
then metrics are aggregated from the kernels, culprits picked, the span budget applied, and the table
assembled column by column.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .. import conventions as cv
from ..metrics import compute as mc
from ..metrics.culprit import suggestion
from ..records import RecordSet
from . import ids
from .joins import JoinedRank, join_rank
from .nesting import tree_depth, tree_root

LEVEL_CODE = {name: i for i, name in enumerate(cv.LEVELS)}
KINDS = ("kernel", "memcpy", "memset", "collective")
KIND_CODE = {name: i for i, name in enumerate(KINDS)}
DEFAULT_MAX_SPANS = 10_000
_BIG = np.iinfo(np.int64).max
_NAME_LIMIT = 1024


@dataclass
class DeviceSpec:
    """What the metrics need of a device; built from metrics.hardware lookups or overrides."""

    model: str | None
    device_type: str              # gpu | cpu
    peak_for: Callable[[str], float] | None   # dtype -> FLOP/s; None = unknown
    bandwidth: float | None       # bytes/s
    price_per_hour: float | None  # USD per device-hour
    source: str                   # table:<model> | override | calibrated | unknown

    def peak(self, dtype: str) -> float:
        if self.peak_for is None:
            return float("nan")
        value = self.peak_for(dtype)
        return float(value) if value else float("nan")


@dataclass
class StitchOptions:
    job_id: str = "default"
    max_spans: int = DEFAULT_MAX_SPANS
    baseline_mfu: float = cv.DEFAULT_BASELINE_MFU
    ranks_per_node: int = 8
    host: str | None = None
    service_name: str | None = None
    full_depth_steps: set[int] | None = None  # None: every step carries its whole subtree
    extra_resource: dict[str, Any] = field(default_factory=dict)


@dataclass
class RankInput:
    records: RecordSet
    spec: DeviceSpec
    op_flops: np.ndarray
    op_bytes: np.ndarray
    op_dtype: np.ndarray   # unicode array of dtype names
    op_model: np.ndarray   # unicode array of model names ("none" = no model)


@dataclass
class StitchResult:
    batch: cv.SpanBatch
    joined: list[JoinedRank]
    stats: dict[str, Any]


def _rank_of(records: RecordSet, position: int) -> int:
    value = records.resource.get("plasmient.rank")
    return int(value) if isinstance(value, int) else position


def _node_of(records: RecordSet, rank: int, options: StitchOptions) -> str:
    host = records.resource.get("host.name") or options.host
    return str(host) if host else f"node-{rank // max(options.ranks_per_node, 1)}"


_GEMM_LIKE = ("gemm", "conv", "attention")


def _yields_flops(op_parent: np.ndarray, op_model: np.ndarray) -> np.ndarray:
    """Per op: is its work already modelled by an op below it of the same class? aten::linear
    (gemm) over aten::addmm (gemm), aten::layer_norm over aten::native_layer_norm (norm): the outer
    op yields, so its FLOPs are not counted twice. GEMM, convolution and attention form one class
    (scaled_dot_product_attention over bmm); an op over a different class keeps its FLOPs (addmm
    over the copy_ of its bias). One numpy step per tree level."""
    n = len(op_parent)
    yields = np.zeros(n, bool)
    if n == 0:
        return yields
    model = op_model.astype(str)
    classes, cls = np.unique(np.where(np.isin(model, _GEMM_LIKE), "gemm-like", model), return_inverse=True)
    k = len(classes)
    modelled = model != "none"
    seen = np.zeros(n * k, bool)
    node, c = op_parent[modelled], cls[modelled]
    for _ in range(256):
        keep = node >= 0
        key = np.unique(node[keep] * k + c[keep])
        key = key[~seen[key]]
        if not len(key):
            break
        seen[key] = True
        node, c = key // k, key % k
        yields[node[cls[node] == c]] = True
        node = op_parent[node]
    return yields


def _cpu_kernel_ops(op_parent: np.ndarray, owns: np.ndarray) -> np.ndarray:
    """The ops that stand for kernels when the CPU is the device: each outermost op that owns
    FLOPs (its whole interval, children included, is its work: the BLAS call inside aten::addmm
    is addmm's own time), and every leaf op not inside one. Flat op lists (the dispatch hook) are
    all leaves; nested ones (Kineto, the native observer) get one kernel per unit of work, not one
    per aten::as_strided."""
    n = len(op_parent)
    is_parent = np.zeros(n, bool)
    is_parent[op_parent[op_parent >= 0]] = True
    inside_owner = np.zeros(n, bool)
    cur = op_parent.copy()
    for _ in range(256):
        up = cur >= 0
        if not up.any():
            break
        inside_owner[up] |= owns[cur[up]]
        cur[up] = op_parent[cur[up]]
    return np.nonzero((owns | ~is_parent) & ~inside_owner)[0]


def stitch(inputs: list[RankInput], options: StitchOptions) -> StitchResult:
    joined = [join_rank(r.records) for r in inputs]
    ranks = [_rank_of(r.records, i) for i, r in enumerate(inputs)]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"two inputs claim the same rank ({sorted(ranks)}); pass one file per rank")
    nodes = [_node_of(r.records, rk, options) for r, rk in zip(inputs, ranks)]

    # ---- fleet / node spans for every step any rank has
    step_values = sorted({int(s) for j in joined for s in j.steps})
    fleet_index = {s: i for i, s in enumerate(step_values)}
    node_keys = sorted({(int(s), n) for j, n in zip(joined, nodes) for s in j.steps})
    node_index = {k: len(step_values) + i for i, k in enumerate(node_keys)}
    n_top = len(step_values) + len(node_keys)

    # ---- per-rank segments
    seg_level: list[np.ndarray] = [np.full(len(step_values), LEVEL_CODE["fleet"], np.int8),
                                   np.full(len(node_keys), LEVEL_CODE["node"], np.int8)]
    seg_parent = [np.full(len(step_values), -1, np.int64),
                  np.array([fleet_index[s] for s, _ in node_keys], np.int64)]
    seg_start = [np.full(n_top, _BIG, np.int64)]
    seg_end = [np.full(n_top, -_BIG, np.int64)]
    seg_step = [np.array(step_values, np.int64), np.array([s for s, _ in node_keys], np.int64)]
    seg_rank = [np.full(n_top, -1, np.int64)]
    seg_rankpos = [np.full(n_top, -1, np.int64)]   # which input the span belongs to
    seg_row = [np.full(n_top, -1, np.int64)]       # row in that input's record table
    seg_alive = [np.ones(n_top, bool)]

    k_span, k_start, k_end, k_devkey, k_flops, k_bytes, k_ideal, k_comm = [], [], [], [], [], [], [], []
    k_synthetic, k_alive_parts = [], []
    k_name_parts: list[np.ndarray] = []
    k_op_name_parts: list[np.ndarray] = []
    k_module_parts: list[np.ndarray] = []
    kernel_labels, op_labels, module_labels = _Labels(), _Labels(), _Labels()
    k_kind_parts: list[np.ndarray] = []
    layout: list[dict[str, int]] = []
    device_price: list[float] = []
    device_keys: dict[tuple[int, int], int] = {}
    cursor = n_top
    over_peak_by_step: dict[tuple[int, int], int] = {}

    for pos, (inp, j, rank, node) in enumerate(zip(inputs, joined, ranks, nodes)):
        rs = inp.records
        n_steps, n_mod, n_op = len(j.steps), len(j.module_parent), len(j.op_parent)
        synth_ops = np.zeros(0, np.int64)
        n_k = len(j.kernel_start)
        has_model = (inp.op_model != "none") if n_op else np.zeros(0, bool)
        yields = _yields_flops(j.op_parent, inp.op_model) if n_op else np.zeros(0, bool)
        if n_k == 0 and n_op:
            # No device activity: the CPU is the device and its ops are the kernels.
            synth_ops = _cpu_kernel_ops(j.op_parent, has_model & ~yields)
            synth_ops = synth_ops[j.op_step[synth_ops] >= 0]
        n_ks = n_k + len(synth_ops)
        base = {"rank": cursor, "step": cursor + n_steps, "module": cursor + 2 * n_steps,
                "op": cursor + 2 * n_steps + n_mod, "kernel": cursor + 2 * n_steps + n_mod + n_op}
        layout.append(base)
        cursor = base["kernel"] + n_ks
        step_rows = np.arange(n_steps)

        # rank and step spans
        seg_level += [np.full(n_steps, LEVEL_CODE["rank"], np.int8), np.full(n_steps, LEVEL_CODE["step"], np.int8)]
        seg_parent += [np.array([node_index[(int(s), node)] for s in j.steps], np.int64), base["rank"] + step_rows]
        seg_start += [np.full(n_steps, _BIG, np.int64), j.step_start]
        seg_end += [np.full(n_steps, -_BIG, np.int64), j.step_end]
        seg_step += [j.steps, j.steps]
        seg_row += [step_rows, step_rows]

        def step_span(step_row: np.ndarray) -> np.ndarray:
            return base["step"] + step_row

        # modules
        m_alive = j.module_step >= 0
        mp = j.module_parent
        mp_ok = (mp >= 0) & m_alive[np.maximum(mp, 0)] & (j.module_step[np.maximum(mp, 0)] == j.module_step)
        m_par = np.where(mp_ok, base["module"] + mp, step_span(np.maximum(j.module_step, 0)))
        # ops
        o_alive = j.op_step >= 0
        op_p = j.op_parent
        op_ok = (op_p >= 0) & (j.op_step[np.maximum(op_p, 0)] == j.op_step)
        om = j.op_module
        om_ok = (om >= 0) & m_alive[np.maximum(om, 0)] if n_mod else np.zeros(n_op, bool)
        if n_mod:
            om_ok &= j.module_step[np.maximum(om, 0)] == j.op_step
        o_par = np.where(op_ok, base["op"] + op_p, np.where(om_ok, base["module"] + om, step_span(np.maximum(j.op_step, 0))))
        # kernels (real, then synthetic)
        ko = np.concatenate([j.kernel_op, synth_ops])
        kstep = np.concatenate([j.kernel_step, j.op_step[synth_ops]])
        ko_ok = (ko >= 0) & (j.op_step[np.maximum(ko, 0)] == kstep) if n_op else np.zeros(n_ks, bool)
        k_par = np.where(ko_ok, base["op"] + ko, step_span(np.maximum(kstep, 0)))
        k_alive = kstep >= 0

        ops_t = rs.ops
        o_start = ops_t.column("start_ns").to_numpy() if n_op else np.zeros(0, np.int64)
        o_end = ops_t.column("end_ns").to_numpy() if n_op else np.zeros(0, np.int64)
        ks = np.concatenate([j.kernel_start, o_start[synth_ops]])
        ke = np.concatenate([j.kernel_end, o_end[synth_ops]])

        seg_level += [np.full(n_mod, LEVEL_CODE["module"], np.int8), np.full(n_op, LEVEL_CODE["op"], np.int8),
                      np.full(n_ks, LEVEL_CODE["kernel"], np.int8)]
        seg_parent += [m_par, o_par, k_par]
        seg_start += [j.module_start, o_start, ks]
        seg_end += [j.module_end, o_end, ke]
        seg_step += [j.steps[np.maximum(j.module_step, 0)] if n_mod else np.zeros(0, np.int64),
                     j.steps[np.maximum(j.op_step, 0)] if n_op else np.zeros(0, np.int64),
                     j.steps[np.maximum(kstep, 0)] if n_ks else np.zeros(0, np.int64)]
        seg_row += [np.arange(n_mod), np.arange(n_op), np.arange(n_ks)]
        seg_alive += [np.ones(2 * n_steps, bool), m_alive, o_alive, k_alive]
        total = 2 * n_steps + n_mod + n_op + n_ks
        seg_rank.append(np.full(total, rank, np.int64))
        seg_rankpos.append(np.full(total, pos, np.int64))

        # ---- kernel facts: flops owner = innermost modelled op on the launching op's ancestor chain
        kinds = _kind_codes(rs.kernels.column("kind"), len(synth_ops))
        owner = ko.copy()
        for _ in range(256):
            climb = (owner >= 0) & ~has_model[np.maximum(owner, 0)] if n_op else np.zeros(n_ks, bool)
            if not climb.any():
                break
            owner[climb] = j.op_parent[owner[climb]]
        is_compute_kind = kinds == KIND_CODE["kernel"]
        owned = (owner >= 0) & is_compute_kind & k_alive
        if n_op:
            # aten::linear's FLOPs are counted on its aten::addmm's kernels, not again on a kernel
            # that climbs to linear from one of its other children.
            owned &= ~yields[np.maximum(owner, 0)]
        dur = np.maximum(ke - ks, 0).astype(np.float64) + 1.0
        share = np.zeros(n_ks)
        if owned.any():
            tot = np.bincount(owner[owned], weights=dur[owned], minlength=n_op)
            share[owned] = dur[owned] / tot[owner[owned]]
        o_fl = inp.op_flops if n_op else np.zeros(0)
        o_by = inp.op_bytes if n_op else np.zeros(0)
        flops = np.where(owned, o_fl[np.maximum(owner, 0)] * share, 0.0) if n_op else np.zeros(n_ks)
        kbytes = np.where(owned, o_by[np.maximum(owner, 0)] * share, 0.0) if n_op else np.zeros(n_ks)
        rec_bytes = rs.kernels.column("bytes").fill_null(0).to_numpy().astype(np.float64) if n_k else np.zeros(0)
        rec_bytes = np.concatenate([rec_bytes, np.zeros(len(synth_ops))])
        kbytes = np.where(is_compute_kind, kbytes, rec_bytes)
        # peak per kernel from the owner's (else launching op's) dtype
        dtype_src = np.where(owner >= 0, owner, ko)
        peaks = np.full(n_ks, inp.spec.peak("fp32"))
        if n_op and n_ks:
            # peak per distinct dtype (a handful), mapped to kernels through integer codes
            op_dtypes, op_dtype_code = np.unique(inp.op_dtype.astype(str), return_inverse=True)
            peak_of_code = np.array([inp.spec.peak(str(d)) for d in op_dtypes])
            has_src = dtype_src >= 0
            peaks[has_src] = peak_of_code[op_dtype_code[dtype_src[has_src]]]
        ideal = np.where(flops > 0, flops / peaks, np.where(np.isnan(peaks), np.nan, 0.0))
        cap = (ke - ks) / 1e9
        over = ideal > cap
        if over.any():
            for srow, cnt in zip(*np.unique(kstep[over & k_alive], return_counts=True)):
                over_peak_by_step[(pos, int(srow))] = int(cnt)
        ideal = np.where(over, cap, ideal)

        devs = np.concatenate([rs.kernels.column("device").to_numpy().astype(np.int64) if n_k else np.zeros(0, np.int64),
                               np.full(len(synth_ops), -1, np.int64)])
        dkeys = np.empty(n_ks, np.int64)
        for d in np.unique(devs):
            key = device_keys.setdefault((pos, int(d)), len(device_keys))
            if key == len(device_price):
                device_price.append(inp.spec.price_per_hour if inp.spec.price_per_hour is not None else np.nan)
            dkeys[devs == d] = key

        k_span.append(base["kernel"] + np.arange(n_ks)); k_start.append(ks); k_end.append(ke)
        k_devkey.append(dkeys); k_flops.append(flops); k_bytes.append(kbytes); k_ideal.append(ideal)
        k_comm.append(kinds == KIND_CODE["collective"]); k_synthetic.append(np.arange(n_ks) >= n_k)
        k_kind_parts.append(kinds)
        k_alive_parts.append(k_alive)
        # Culprit labels travel as integer codes into one job-wide dictionary per kind of label.
        op_local, op_dict = _codes(ops_t.column("name").combine_chunks()) if n_op else (np.zeros(0, np.int64), [])
        op_of_kernel = np.where(ko >= 0, op_local[np.maximum(ko, 0)], -1) if n_op else np.full(n_ks, -1, np.int64)
        k_local, k_dict = _codes(rs.kernels.column("name").combine_chunks()) if n_k else (np.zeros(0, np.int64), [])
        k_local = np.concatenate([k_local, op_local[synth_ops] + len(k_dict)]) if len(synth_ops) else k_local
        k_name_parts.append(kernel_labels.add(k_dict + (op_dict if len(synth_ops) else []), k_local))
        k_op_name_parts.append(op_labels.add(op_dict, op_of_kernel))
        # innermost module of each kernel: the module of the root of its launching op
        if n_op and n_mod and n_ks:
            root = tree_root(j.op_parent)[np.maximum(ko, 0)]
            mod = np.where(ko >= 0, j.op_module[root], -1)
            k_module_parts.append(module_labels.add([_module_label(j, m) for m in range(n_mod)], mod))
        else:
            k_module_parts.append(np.full(n_ks, -1, np.int64))

    level = np.concatenate(seg_level)
    parent = np.concatenate(seg_parent)
    start = np.concatenate(seg_start).astype(np.int64)
    end = np.concatenate(seg_end).astype(np.int64)
    step = np.concatenate(seg_step).astype(np.int64)
    rank_arr = np.concatenate(seg_rank)
    rankpos = np.concatenate(seg_rankpos)
    row = np.concatenate(seg_row)
    alive = np.concatenate(seg_alive)
    n = len(level)
    kernels = mc.KernelFacts(
        span=_cat(k_span, np.int64), start=_cat(k_start, np.int64), end=_cat(k_end, np.int64),
        device_key=_cat(k_devkey, np.int64), flops=_cat(k_flops, np.float64), bytes=_cat(k_bytes, np.float64),
        ideal_s=_cat(k_ideal, np.float64), is_comm=_cat(k_comm, bool),
    )
    k_alive_all = _cat(k_alive_parts, bool)
    k_synth = _cat(k_synthetic, bool)

    # Dead spans (outside every step) take no part: detach their kernels.
    live_k = k_alive_all
    kernels = mc.KernelFacts(*(getattr(kernels, f)[live_k] for f in ("span", "start", "end", "device_key", "flops", "bytes", "ideal_s", "is_comm")))
    parent = np.where(alive, parent, -1)

    depth = tree_depth(parent)
    start, end = _widen(parent, depth, start, end, alive)
    sums = mc.aggregate(parent, depth, kernels, np.asarray(device_price, np.float64) if device_price else np.zeros(0))

    # ---- per-span device facts
    specs = [inp.spec for inp in inputs]
    ridge_rank = np.array([_ridge(s) for s in specs] + [np.nan])
    prices = [s.price_per_hour if s.price_per_hour is not None else np.nan for s in specs]
    # Fleet/node spans of a step with no kernels at all: charge one device at the ranks' price.
    fallback_price = prices[0] if prices and all(p == prices[0] for p in prices) else np.nan
    price_rank = np.array(prices + [fallback_price])
    ridge = ridge_rank[np.where(rankpos >= 0, rankpos, len(specs))]
    top = rankpos < 0
    if top.any() and len(specs):
        ridge[top] = np.nanmean(ridge_rank[:-1]) if np.isfinite(ridge_rank[:-1]).any() else np.nan
    gpus = np.maximum(sums.devices, 1)
    price_sum = np.where(sums.devices > 0, sums.device_price, price_rank[np.where(rankpos >= 0, rankpos, len(specs))])
    is_kernel = level == LEVEL_CODE["kernel"]
    # Where a rank's peak is unknown its spans (and the node/fleet above) get no MFU, not MFU 0.
    peak_known = np.array([s.peak_for is not None for s in specs] + [all(s.peak_for is not None for s in specs)])
    unknown = ~peak_known[np.where(rankpos >= 0, rankpos, len(specs))]
    sums.ideal_s[unknown] = np.nan
    met = mc.derive(sums, start, end, gpus, ridge, price_sum, is_kernel, options.baseline_mfu)

    # ---- culprits on step / rank / node / fleet spans
    k_ancestors = _ancestors_at(parent, kernels.span, level, ("step", "rank", "node", "fleet"))
    waste_k = mc.kernel_waste_s(kernels.start, kernels.end, kernels.ideal_s, options.baseline_mfu)
    labels = [(_cat(parts, np.int64)[live_k], table.names) for parts, table in
              ((k_name_parts, kernel_labels), (k_op_name_parts, op_labels), (k_module_parts, module_labels))]
    kinds_k = _cat(k_kind_parts, np.int8)[live_k] if k_kind_parts else np.zeros(0, np.int8)
    culprit = _culprits(n, k_ancestors, waste_k, labels, kinds_k, kernels.span, met, rank_arr, sums, level)

    # ---- span budget: keep the most wasteful kernels of each trace, fold the rest into the parent
    export = alive.copy()
    if options.full_depth_steps is not None:
        shallow = ~np.isin(step, np.fromiter(options.full_depth_steps, np.int64, len(options.full_depth_steps)))
        export &= ~(shallow & (level >= LEVEL_CODE["module"]))
    k_idx = kernels.span
    exportable_k = export[k_idx] & ~k_synth[live_k]
    folded = np.zeros(len(k_idx), bool)
    trace_of = np.searchsorted(np.array(step_values), step)
    non_kernel = np.bincount(trace_of[export & ~is_kernel], minlength=len(step_values))
    allowance = np.maximum(options.max_spans - non_kernel, 0)
    if exportable_k.any():
        cand = np.nonzero(exportable_k)[0]
        tr = trace_of[k_idx[cand]]
        order = np.lexsort((-waste_k[cand], tr))
        cand, tr = cand[order], tr[order]
        first = np.searchsorted(tr, tr, side="left")
        rank_in_trace = np.arange(len(cand)) - first
        drop = rank_in_trace >= allowance[tr]
        folded[cand[drop]] = True
    export[k_idx[folded]] = False
    export[k_idx[k_synth[live_k]]] = False
    fold_parent = parent[k_idx[folded]]
    folded_n = np.bincount(fold_parent, minlength=n)
    folded_s = np.bincount(fold_parent, weights=(kernels.end - kernels.start)[folded] / 1e9, minlength=n)
    folded_fl = np.bincount(fold_parent, weights=kernels.flops[folded], minlength=n)

    stats = {
        "ranks": len(inputs), "traces": len(step_values), "spans": int(export.sum()),
        "kernels": int(len(k_idx) - k_synth[live_k].sum()), "kernels_folded": int(folded.sum()),
        "ops_outside_steps": sum(j.stats.ops_outside_steps for j in joined),
        "kernels_outside_steps": sum(j.stats.kernels_outside_steps for j in joined),
    }
    batch = _assemble(options, inputs, joined, ranks, nodes, step_values, node_keys, layout,
                      level, parent, start, end, step, rank_arr, rankpos, row, export, sums, met, gpus,
                      culprit, folded_n, folded_s, folded_fl, over_peak_by_step)
    return StitchResult(batch=batch, joined=joined, stats=stats)


def _kind_codes(kind: pa.ChunkedArray, n_synthetic: int) -> np.ndarray:
    codes = np.zeros(len(kind) + n_synthetic, np.int8)  # synthetic CPU kernels are 'kernel'
    for name, code in KIND_CODE.items():
        if code:
            codes[:len(kind)][pc.equal(kind, name).fill_null(False).to_numpy(zero_copy_only=False)] = code
    return codes


def _cat(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)


def _module_label(j: JoinedRank, m: int) -> str:
    return j.module_path[m] + (" [backward]" if j.module_phase[m] == "backward" else "")


def _headline_peak(spec: DeviceSpec) -> float:
    """The peak quoted for a device as a whole: bf16 tensor math on a GPU, fp32 on a CPU."""
    return spec.peak("bf16" if spec.device_type == "gpu" else "fp32")


def _ridge(spec: DeviceSpec) -> float:
    if spec.peak_for is None or not spec.bandwidth:
        return np.nan
    return _headline_peak(spec) / spec.bandwidth


def _widen(parent: np.ndarray, depth: np.ndarray, start: np.ndarray, end: np.ndarray, alive: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Make every parent cover its children; spans with no interval of their own take their children's."""
    start, end = start.copy(), end.copy()
    for d in range(int(depth.max()) if len(depth) else 0, 0, -1):
        kids = np.nonzero((depth == d) & alive)[0]
        np.minimum.at(start, parent[kids], start[kids])
        np.maximum.at(end, parent[kids], end[kids])
    empty = start > end
    start[empty] = 0
    end[empty] = 0
    return start, end


def _ancestors_at(parent: np.ndarray, spans: np.ndarray, level: np.ndarray, names: tuple[str, ...]) -> dict[str, np.ndarray]:
    out = {name: np.full(len(spans), -1, np.int64) for name in names}
    codes = {LEVEL_CODE[name]: name for name in names}
    cur = spans.copy()
    live = np.arange(len(cur))
    while len(live):
        lv = level[cur[live]]
        for code, name in codes.items():
            hit = lv == code
            out[name][live[hit]] = cur[live[hit]]
        nxt = parent[cur[live]]
        keep = nxt >= 0
        cur[live[keep]] = nxt[keep]
        live = live[keep]
    return out


class _Labels:
    """A job-wide dictionary of labels fed with per-rank dictionaries (a few thousand names, not per kernel)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self._index: dict[str, int] = {}

    def add(self, local_names: list[str], local_codes: np.ndarray) -> np.ndarray:
        """Global codes for local codes into local_names (-1 stays -1)."""
        mapping = np.empty(len(local_names) + 1, np.int64)
        for i, name in enumerate(local_names):
            code = self._index.get(name)
            if code is None:
                code = self._index[name] = len(self.names)
                self.names.append(name)
            mapping[i] = code
        mapping[-1] = -1
        return mapping[np.where(local_codes >= 0, local_codes, len(local_names))]


def _codes(values: list[str | None] | pa.Array) -> tuple[np.ndarray, list[str]]:
    arr = values if isinstance(values, pa.Array) else pa.array(values, pa.string())
    enc = arr.dictionary_encode()
    codes = enc.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
    return codes, enc.dictionary.to_pylist()


def _culprits(n, anc, waste, labels, kinds, k_span, met, rank_arr, sums, level):
    (k_codes, k_dict), (o_codes, o_dict), (m_codes, m_dict) = labels
    r_codes = rank_arr[k_span] if len(k_span) else np.zeros(0, np.int64)
    out: dict[str, np.ndarray] = {key: np.full(n, None, dtype=object) for key in ("kernel", "op", "module", "rank", "wasted_s", "bound", "suggestion")}
    mean_kernel = np.where(sums.kernels > 0, sums.kernel_s / np.maximum(sums.kernels, 1), 0.0)
    for lvl, group in anc.items():
        targets = np.nonzero(level == LEVEL_CODE[lvl])[0]
        if len(targets) == 0:
            continue
        kb, kw = mc.top_label_per_group(group, k_codes, waste, n)
        ob, _ = mc.top_label_per_group(group, o_codes, waste, n)
        mb, _ = mc.top_label_per_group(group, m_codes, waste, n)
        rb, _ = mc.top_label_per_group(group, r_codes, waste, n) if lvl in ("node", "fleet") else (None, None)
        # the culprit kernel's bound/kind: those of its single most wasteful instance
        rep = np.full(n, -1, np.int64)
        match = (group >= 0) & (k_codes == kb[np.maximum(group, 0)])
        if match.any():
            idx = np.nonzero(match)[0]
            order = np.lexsort((-waste[idx], group[idx]))
            idx = idx[order]
            g = group[idx]
            first = np.concatenate([[True], g[1:] != g[:-1]])
            rep[g[first]] = idx[first]
        for t in targets.tolist():
            if kb[t] < 0:
                continue
            r = rep[t]
            kspan = k_span[r] if r >= 0 else -1
            bound = cv.BOUNDS[met.bound[kspan]] if kspan >= 0 else None
            kind = KINDS[kinds[r]] if r >= 0 else None
            out["kernel"][t] = k_dict[kb[t]][:_NAME_LIMIT]
            out["op"][t] = o_dict[ob[t]] if ob[t] >= 0 else None
            out["module"][t] = m_dict[mb[t]] if mb[t] >= 0 else None
            out["rank"][t] = int(rb[t]) if rb is not None and rb[t] >= 0 else None
            out["wasted_s"][t] = float(kw[t])
            out["bound"][t] = bound
            out["suggestion"][t] = suggestion(out["kernel"][t], out["op"][t], out["module"][t], bound, kind,
                                              float(met.idle[t]), float(mean_kernel[kspan]) if kspan >= 0 else None)
    return out


def _resource_for_rank(inp: RankInput, rank: int, node: str, options: StitchOptions) -> dict[str, Any]:
    res: dict[str, Any] = {"service.name": options.service_name or os.environ.get("OTEL_SERVICE_NAME") or "plasmient-trace"}
    res.update(options.extra_resource)
    res.update({k: v for k, v in inp.records.resource.items() if v is not None})
    res.setdefault("host.name", node)
    res["plasmient.job.id"] = options.job_id
    res["plasmient.rank"] = rank
    res["service.instance.id"] = f"{options.job_id}/{rank}"
    if inp.spec.model:
        res.setdefault("plasmient.gpu.model", inp.spec.model)
    devices = inp.records.devices
    if devices:
        res.setdefault("plasmient.gpu.model.reported", devices[0].name)
    if inp.records.source:
        res.setdefault("plasmient.source", inp.records.source)
    return res


def _assemble(options, inputs, joined, ranks, nodes, step_values, node_keys, layout, level, parent, start, end,
              step, rank_arr, rankpos, row, export, sums, met, gpus, culprit, folded_n, folded_s, folded_fl,
              over_peak_by_step) -> cv.SpanBatch:
    n = len(level)
    job = options.job_id
    # ---- resources: fleet, one per node, one per rank
    service = options.service_name or os.environ.get("OTEL_SERVICE_NAME") or "plasmient-trace"
    resources: list[dict[str, Any]] = [{"service.name": service, "plasmient.job.id": job, **options.extra_resource}]
    node_names = sorted({name for _, name in node_keys})
    node_res = {name: len(resources) + i for i, name in enumerate(node_names)}
    resources += [{"service.name": service, "plasmient.job.id": job, "host.name": name, **options.extra_resource} for name in node_names]
    rank_res = []
    for inp, rk, nd in zip(inputs, ranks, nodes):
        rank_res.append(len(resources))
        resources.append(_resource_for_rank(inp, rk, nd, options))

    # ---- ids
    span_id = np.zeros(n, np.uint64)
    n_fleet = len(step_values)
    for i, s in enumerate(step_values):
        span_id[i] = ids.fleet_span_id(job, s)
    for i, (s, nd) in enumerate(node_keys):
        span_id[n_fleet + i] = ids.node_span_id(job, s, nd)
    resource_index = np.zeros(n, np.int32)
    resource_index[n_fleet:n_fleet + len(node_keys)] = [node_res[nd] for _, nd in node_keys]
    names: list[Any] = [f"fleet step {s}" for s in step_values] + [f"node {nd}" for _, nd in node_keys]
    name_parts: list[pa.Array] = [pa.array(names, pa.string())]
    for pos, (inp, j, rk, base) in enumerate(zip(inputs, joined, ranks, layout)):
        n_steps = len(j.steps)
        rank_ids = np.array([ids.rank_span_id(job, int(s), rk) for s in j.steps], np.uint64)
        step_ids = np.array([ids.step_span_id(job, int(s), rk) for s in j.steps], np.uint64)
        span_id[base["rank"]:base["rank"] + n_steps] = rank_ids
        span_id[base["step"]:base["step"] + n_steps] = step_ids
        hi = layout[pos + 1]["rank"] if pos + 1 < len(layout) else n
        resource_index[base["rank"]:hi] = rank_res[pos]
        rs = inp.records
        n_mod, n_op = len(j.module_parent), len(j.op_parent)
        n_ks = hi - base["kernel"]
        mstep = np.maximum(j.module_step, 0)
        span_id[base["module"]:base["op"]] = ids.child_span_ids(step_ids[mstep] if n_mod else np.zeros(0, np.uint64),
                                                                 ids.KIND_MODULE, np.arange(n_mod))
        ostep = np.maximum(j.op_step, 0)
        span_id[base["op"]:base["kernel"]] = ids.child_span_ids(step_ids[ostep] if n_op else np.zeros(0, np.uint64),
                                                                 ids.KIND_OP, np.arange(n_op))
        kstep_rows = np.searchsorted(j.steps, step[base["kernel"]:hi]) if n_steps else np.zeros(n_ks, np.int64)
        kstep_rows = np.minimum(kstep_rows, max(n_steps - 1, 0))
        span_id[base["kernel"]:hi] = ids.child_span_ids(step_ids[kstep_rows] if n_ks and n_steps else np.zeros(0, np.uint64),
                                                         ids.KIND_KERNEL, np.arange(n_ks))
        rank_name = f"rank {rk}"
        step_names = rs.steps.column("name").to_pylist() if rs.steps.num_rows else ["capture"]
        if rs.steps.num_rows:
            order = np.argsort(rs.steps.column("start_ns").to_numpy(), kind="stable")
            step_names = [step_names[i] for i in order]
        name_parts.append(pa.array([rank_name] * n_steps + step_names, pa.string()))
        name_parts.append(pa.array([_module_label(j, m) for m in range(n_mod)], pa.string()))
        name_parts.append(rs.ops.column("name").combine_chunks().cast(pa.string()) if n_op else pa.array([], pa.string()))
        kn = rs.kernels.column("name").combine_chunks().cast(pa.string()) if rs.kernels.num_rows else pa.array([], pa.string())
        if n_ks > len(kn):
            kn = pa.concat_arrays([kn, pa.array(["cpu"] * (n_ks - len(kn)), pa.string())])
        too_long = len(kn) and pc.max(pc.binary_length(kn)).as_py() > _NAME_LIMIT
        name_parts.append(pc.utf8_slice_codeunits(kn, 0, _NAME_LIMIT) if too_long else kn)
    all_names = pa.concat_arrays(name_parts)
    trace_ids_by_step = {s: ids.trace_id(job, s) for s in step_values}

    sel = np.nonzero(export)[0]
    sel_pa = pa.array(sel)
    cols: dict[str, Any] = {}
    step_list = np.array(step_values, np.int64)
    cols["trace_id"] = pa.array([trace_ids_by_step[s] for s in step_values], pa.binary(16)).take(pa.array(np.searchsorted(step_list, step[sel])))
    cols["span_id"] = span_id[sel]
    cols["parent_span_id"] = np.where(parent[sel] >= 0, span_id[np.maximum(parent[sel], 0)], np.uint64(0)).astype(np.uint64)
    cols["resource_index"] = resource_index[sel]
    cols["name"] = all_names.take(sel_pa)
    cols["start_ns"] = start[sel]
    cols["end_ns"] = end[sel]
    lv = level[sel]
    cols["plasmient.level"] = pa.array(list(cv.LEVELS), pa.string()).take(pa.array(lv.astype(np.int64)))
    cols["plasmient.job.id"] = pa.array([job], pa.string()).take(pa.array(np.zeros(len(sel), np.int64)))
    cols["plasmient.step"] = step[sel]
    cols["plasmient.rank"] = _masked(rank_arr[sel], lv <= LEVEL_CODE["node"])
    dev_type = np.array([inp.spec.device_type for inp in inputs] + ["gpu"], dtype=object)
    top_type = "cpu" if inputs and all(inp.spec.device_type == "cpu" for inp in inputs) else "gpu"
    dev_type[-1] = top_type
    cols["plasmient.device.type"] = pa.array(dev_type.tolist(), pa.string()).take(pa.array(np.where(rankpos[sel] >= 0, rankpos[sel], len(inputs))))
    cols["plasmient.gpus"] = gpus[sel]
    cols["plasmient.wall_s"] = met.wall_s[sel]
    cols["plasmient.flops"] = sums.flops[sel]
    cols["plasmient.ideal_s"] = _nan_to_null(met.ideal_s[sel])
    cols["plasmient.busy_s"] = sums.busy_s[sel]
    cols["plasmient.util.resident"] = met.util[sel]
    cols["plasmient.mfu"] = _nan_to_null(met.mfu[sel])
    cols["plasmient.stall_fraction"] = _nan_to_null(met.stall[sel])
    cols["plasmient.idle_fraction"] = met.idle[sel]
    cols["plasmient.bytes"] = sums.bytes[sel]
    cols["plasmient.arithmetic_intensity"] = _nan_to_null(met.intensity[sel])
    cols["plasmient.bound"] = pa.array(list(cv.BOUNDS), pa.string()).take(pa.array(met.bound[sel].astype(np.int64)))
    cols["plasmient.cost.usd"] = _nan_to_null(met.cost[sel])
    cols["plasmient.cost.wasted_usd"] = _nan_to_null(met.wasted_usd[sel])
    cols["plasmient.wasted_s"] = _nan_to_null(met.wasted_s[sel])
    cols["plasmient.kernels"] = sums.kernels[sel]
    has_fold = (lv == LEVEL_CODE["op"]) | (lv == LEVEL_CODE["step"])
    cols["plasmient.kernels.folded"] = _masked(folded_n[sel], ~has_fold)
    cols["plasmient.kernels.folded_s"] = _masked(folded_s[sel], ~has_fold)
    cols["plasmient.kernels.folded_flops"] = _masked(folded_fl[sel], ~has_fold)

    # step-level counters
    is_step = lv == LEVEL_CODE["step"]
    unjoined = np.zeros(len(sel), np.int64)
    over_peak = np.zeros(len(sel), np.int64)
    offsets = np.zeros(len(sel), np.int64)
    peak_src = np.full(len(sel), None, dtype=object)
    peak_flops = np.full(len(sel), np.nan)
    peak_bw = np.full(len(sel), np.nan)
    upper = np.nonzero(lv <= LEVEL_CODE["step"])[0]
    for out_i, span_i in zip(upper.tolist(), sel[upper].tolist()):
        code = level[span_i]
        pos = rankpos[span_i]
        if pos < 0 or code > LEVEL_CODE["step"]:
            continue
        spec = inputs[pos].spec
        peak_flops[out_i] = _headline_peak(spec)
        peak_bw[out_i] = spec.bandwidth if spec.bandwidth else np.nan
        if code == LEVEL_CODE["rank"]:
            peak_src[out_i] = spec.source
            offsets[out_i] = max(joined[pos].stats.clock_offset_ns.values(), default=0)
        else:
            over_peak[out_i] = over_peak_by_step.get((pos, int(row[span_i])), 0)
    if is_step.any():
        # unjoined kernels: kernel spans whose parent is the step itself, plus folded ones there
        k_parent_is_step = (level == LEVEL_CODE["kernel"]) & (parent >= 0)
        k_parent_is_step &= level[np.maximum(parent, 0)] == LEVEL_CODE["step"]
        kernel_rows = np.nonzero(k_parent_is_step)[0]
        real = np.zeros(len(kernel_rows), bool)
        for pos, base in enumerate(layout):
            n_real = inputs[pos].records.kernels.num_rows
            lo = base["kernel"]
            real |= (kernel_rows >= lo) & (kernel_rows < lo + n_real)
        per_parent = np.bincount(parent[kernel_rows[real]], minlength=n)
        unjoined = per_parent[sel]
    cols["plasmient.unjoined_kernels"] = _masked(unjoined, ~is_step)
    cols["plasmient.kernels.over_peak"] = _masked(over_peak, ~is_step)
    cols["plasmient.peak_flops"] = _nan_to_null(np.where(lv <= LEVEL_CODE["step"], peak_flops, np.nan))
    cols["plasmient.peak_bandwidth"] = _nan_to_null(peak_bw)
    cols["plasmient.peak.source"] = pa.array(peak_src, pa.string())
    cols["plasmient.clock.offset_ns"] = _masked(offsets, lv != LEVEL_CODE["rank"])
    cols["plasmient.sampled_depth"] = _step_depth(step[sel], is_step, options.full_depth_steps)
    cpu_counter = [inp.records.counters.get("cupti.dropped_records") for inp in inputs]
    if any(c is not None for c in cpu_counter):
        dropped = np.array([c if c is not None else -1 for c in cpu_counter] + [-1], np.int64)[np.where(rankpos[sel] >= 0, rankpos[sel], len(inputs))]
        cols["plasmient.cupti.dropped_records"] = _masked(dropped, ~is_step | (dropped < 0))
    for key in ("kernel", "op", "module", "rank", "wasted_s", "bound", "suggestion"):
        cols[f"plasmient.culprit.{key}"] = pa.array(culprit[key][sel], cv.ATTRIBUTE_BY_NAME[f"plasmient.culprit.{key}"].type)

    _per_record_columns(cols, sel, layout, inputs, joined, n)
    return cv.SpanBatch(table=cv.span_table_from_columns(cols, len(sel)), resources=resources)


def _step_depth(steps: np.ndarray, is_step: np.ndarray, full: set[int] | None) -> pa.Array:
    values = pa.array(["full", "step"], pa.string())
    if full is None:
        codes = np.zeros(len(steps), np.int64)
    else:
        codes = np.where(np.isin(steps, np.fromiter(full, np.int64, len(full))), 0, 1)
    return values.take(pa.array(codes, mask=~is_step))


def _masked(values: np.ndarray, mask_null: np.ndarray) -> pa.Array:
    return pa.array(values, mask=np.asarray(mask_null, bool))


def _nan_to_null(values: np.ndarray) -> pa.Array:
    values = np.asarray(values, np.float64)
    return pa.array(values, mask=~np.isfinite(values))


RECORD_ATTRIBUTES = (
    "plasmient.op.external_id", "plasmient.op.sequence_number", "plasmient.op.input_dims", "plasmient.op.input_types",
    "plasmient.op.dtype", "plasmient.op.flops_model", "plasmient.op.model_flops", "plasmient.op.kineto_flops",
    "plasmient.op.cpu_s", "thread.id", "plasmient.module.path", "plasmient.module.phase", "plasmient.correlation_id",
    "plasmient.kernel.kind", "plasmient.kernel.launch", "plasmient.gpu.device", "plasmient.gpu.stream",
    "plasmient.kernel.grid", "plasmient.kernel.block", "plasmient.kernel.registers_per_thread",
    "plasmient.kernel.shared_memory", "plasmient.kernel.graph_id",
)


def _rows_of(table: pa.Table, columns: list[str], rows: np.ndarray, full: bool) -> pa.Table:
    table = table.select(columns)
    return table if full else table.take(pa.array(rows))


def _record_values(kind: str, inp: RankInput, j: JoinedRank, rows: np.ndarray, full: bool) -> dict[str, Any]:
    rs = inp.records
    vals: dict[str, Any] = {}
    if kind == "op":
        t = _rows_of(rs.ops, ["external_id", "sequence_number", "input_dims", "input_types", "kineto_flops", "start_ns", "end_ns", "tid"], rows, full)
        vals["plasmient.op.external_id"] = t.column("external_id")
        vals["plasmient.op.sequence_number"] = t.column("sequence_number")
        vals["plasmient.op.input_dims"] = t.column("input_dims")
        vals["plasmient.op.input_types"] = t.column("input_types")
        vals["plasmient.op.dtype"] = pa.array(inp.op_dtype[rows].astype(str), pa.string())
        vals["plasmient.op.flops_model"] = pa.array(inp.op_model[rows].astype(str), pa.string())
        vals["plasmient.op.model_flops"] = pa.array(inp.op_flops[rows], pa.float64())
        vals["plasmient.op.kineto_flops"] = t.column("kineto_flops")
        vals["plasmient.op.cpu_s"] = pc.divide(pc.subtract(t.column("end_ns"), t.column("start_ns")).cast(pa.float64()), 1e9)
        vals["thread.id"] = t.column("tid")
    elif kind == "module":
        n_fwd = rs.modules.num_rows
        vals["plasmient.module.path"] = pa.array([j.module_path[r] for r in rows.tolist()], pa.string())
        vals["plasmient.module.phase"] = pa.array([j.module_phase[r] for r in rows.tolist()], pa.string())
        fwd = rows < n_fwd
        vals["plasmient.op.cpu_s"] = pa.array((j.module_end[rows] - j.module_start[rows]) / 1e9, mask=~fwd)
        tids = rs.modules.column("tid").to_numpy()[np.minimum(rows, max(n_fwd - 1, 0))] if n_fwd else np.zeros(len(rows), np.int64)
        vals["thread.id"] = pa.array(tids, mask=~fwd)
    else:
        t = _rows_of(rs.kernels, ["correlation_id", "kind", "device", "stream", "grid", "block", "registers_per_thread",
                                  "shared_memory", "graph_id"], rows, full)
        lrow = j.kernel_launch[rows]
        if rs.launches.num_rows:
            launch_names = rs.launches.column("name").take(pa.array(lrow, mask=lrow < 0))
        else:
            launch_names = pa.nulls(len(rows), pa.string())
        vals["plasmient.correlation_id"] = t.column("correlation_id")
        vals["plasmient.kernel.kind"] = t.column("kind")
        vals["plasmient.kernel.launch"] = launch_names
        vals["plasmient.gpu.device"] = t.column("device")
        vals["plasmient.gpu.stream"] = t.column("stream")
        vals["plasmient.kernel.grid"] = _dims_string(t.column("grid"))
        vals["plasmient.kernel.block"] = _dims_string(t.column("block"))
        vals["plasmient.kernel.registers_per_thread"] = t.column("registers_per_thread")
        vals["plasmient.kernel.shared_memory"] = t.column("shared_memory")
        vals["plasmient.kernel.graph_id"] = t.column("graph_id")
    return vals


def _per_record_columns(cols, sel, layout, inputs, joined, n_total) -> None:
    """Attributes that come straight from a record row (op shapes, kernel launch config, ...).

    Spans are laid out in blocks (per rank: rank/step, modules, ops, kernels) and `sel` is sorted, so
    each block's exported rows are one contiguous run of the output: columns are concatenated block
    by block, and a block exported whole is a zero-copy slice of its record table.
    """
    parts: dict[str, list[Any]] = {name: [] for name in RECORD_ATTRIBUTES}
    blocks: list[tuple[int, int, str | None, int]] = [(0, layout[0]["rank"] if layout else n_total, None, -1)]
    for pos, base in enumerate(layout):
        hi = layout[pos + 1]["rank"] if pos + 1 < len(layout) else n_total
        n_real = inputs[pos].records.kernels.num_rows
        blocks += [(base["rank"], base["module"], None, pos), (base["module"], base["op"], "module", pos),
                   (base["op"], base["kernel"], "op", pos), (base["kernel"], base["kernel"] + n_real, "kernel", pos),
                   (base["kernel"] + n_real, hi, None, pos)]
    for lo, hi, kind, pos in blocks:
        a, b = np.searchsorted(sel, [lo, hi])
        count = int(b - a)
        if count == 0:
            continue
        vals = _record_values(kind, inputs[pos], joined[pos], sel[a:b] - lo, count == hi - lo) if kind else {}
        for name in RECORD_ATTRIBUTES:
            value = vals.get(name)
            typ = cv.ATTRIBUTE_BY_NAME[name].type
            if value is None:
                parts[name].append(pa.nulls(count, typ))
            else:
                value = value.combine_chunks() if isinstance(value, pa.ChunkedArray) else value
                parts[name].append(value if value.type == typ else value.cast(typ))
    for name, arrays in parts.items():
        cols[name] = pa.chunked_array(arrays, cv.ATTRIBUTE_BY_NAME[name].type) if arrays else pa.nulls(0, cv.ATTRIBUTE_BY_NAME[name].type)


def _dims_string(col: pa.ChunkedArray) -> pa.Array:
    arr = col.combine_chunks()
    if len(arr) == 0:
        return pa.array([], pa.string())
    flat = arr.flatten().cast(pa.string())
    x = flat.take(pa.array(np.arange(0, len(flat), 3)))
    y = flat.take(pa.array(np.arange(1, len(flat), 3)))
    z = flat.take(pa.array(np.arange(2, len(flat), 3)))
    joined = pc.binary_join_element_wise(x, y, z, ",")
    # flatten() drops null lists: scatter back
    valid = arr.is_valid().to_numpy(zero_copy_only=False)
    idx = np.cumsum(valid) - 1
    return joined.take(pa.array(np.where(valid, idx, 0), mask=~valid))
