"""Synthetic but internally consistent SpanBatches for the report tests.

Builds fleet -> node -> rank -> step -> module -> op -> kernel trees the way DESIGN.md defines the
metrics (flops summed up the tree, busy = union of kernel time, util = busy / (wall * gpus),
mfu = flops / (peak * wall * gpus), wasted_s, cost, culprits), so the report can be checked
against span attributes. Real traces go through the real pipeline in the tests; these cover the
shapes real files do not have (step-level sampling, unknown peak, 10^5 spans, several nodes).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from plasmient_trace.conventions import DEFAULT_BASELINE_MFU, SpanBatch, span_table_from_columns

H100_PEAK = 989e12
H100_BW = 3.35e12
PRICE = 2.5
B = DEFAULT_BASELINE_MFU


@dataclass
class _Span:
    level: str
    name: str
    start: int
    end: int
    parent: "_Span | None"
    resource: int
    attrs: dict[str, Any] = field(default_factory=dict)
    children: list["_Span"] = field(default_factory=list)
    kernels: list["_Span"] = field(default_factory=list)  # all kernels below (for busy union)
    span_id: int = 0


def _trace_id(job: str, step: int) -> bytes:
    return hashlib.sha256(f"plasmient/v1/{job}/{step}".encode()).digest()[:16]


# (op name, kernel name, kind, flops per kernel, bytes per kernel, duration ns, bound)
LAYER_OPS = (
    ("aten::linear", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "kernel", 4.0e9, 8.0e6, 9_000, "compute"),
    ("aten::_scaled_dot_product_flash_attention", "flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>", "kernel", 1.0e9, 6.0e7, 40_000, "memory"),
    ("aten::layer_norm", "vectorized_layer_norm_kernel<c10::BFloat16, float>", "kernel", 2.0e6, 4.0e6, 6_000, "memory"),
    ("aten::add", "elementwise_kernel<128, 4>", "kernel", 1.0e6, 6.0e6, 3_000, "latency"),
)


def step_period_ns(layers: int, kernels_per_op: int) -> int:
    """Steps follow each other with a small host gap, as in a real profiled loop."""
    per_kernel = max(d for *_, d, _b in LAYER_OPS) + 8_000 * 8
    return 200_000 + layers * len(LAYER_OPS) * kernels_per_op * per_kernel


def make_job(
    job_id: str = "job-7",
    steps: int = 2,
    nodes: int = 2,
    ranks_per_node: int = 1,
    layers: int = 3,
    kernels_per_op: int = 1,
    peak: float | None = H100_PEAK,
    bandwidth: float | None = H100_BW,
    price: float | None = PRICE,
    depth: str = "full",
    gpu_model: str = "NVIDIA H100 80GB HBM3",
    with_kernels: bool = True,
    allreduce: bool = True,
) -> SpanBatch:
    """A whole job: `steps` traces, each fleet -> nodes -> ranks -> step -> modules -> ops -> kernels."""
    resources: list[dict[str, Any]] = []
    spans: list[_Span] = []
    t_base = 1_700_000_000_000_000_000
    for node in range(nodes):
        for lr in range(ranks_per_node):
            rank = node * ranks_per_node + lr
            resources.append(
                {
                    "service.name": "plasmient-trace",
                    "host.name": f"gpu-node-{node}",
                    "plasmient.rank": rank,
                    "plasmient.job.id": job_id,
                    "plasmient.gpu.model": gpu_model if with_kernels else None,
                    "plasmient.world_size": nodes * ranks_per_node,
                }
            )
    step_wall = 0
    roots = []
    for step in range(steps):
        t0 = t_base + step * step_period_ns(layers, kernels_per_op)
        fleet = _Span("fleet", f"step {step}", t0, t0, None, 0, {"plasmient.step": step})
        spans.append(fleet)
        roots.append(fleet)
        for node in range(nodes):
            nspan = _Span("node", f"gpu-node-{node}", t0, t0, fleet, node * ranks_per_node, {"plasmient.step": step})
            fleet.children.append(nspan)
            spans.append(nspan)
            for lr in range(ranks_per_node):
                rank = node * ranks_per_node + lr
                # Ranks differ a little so cross-rank numbers are not all equal.
                skew = 1_000 * rank
                rspan = _Span("rank", f"rank {rank}", t0, t0, nspan, rank, {"plasmient.step": step, "plasmient.rank": rank})
                nspan.children.append(rspan)
                spans.append(rspan)
                sname = f"ProfilerStep#{step}"
                st = _Span("step", sname, t0 + 10_000, t0, rspan, rank, {"plasmient.step": step, "plasmient.rank": rank, "plasmient.sampled_depth": depth})
                rspan.children.append(st)
                spans.append(st)
                cursor = st.start + 5_000
                model = _Span("module", "BertModel", cursor, cursor, st, rank, {"plasmient.module.path": "model", "plasmient.module.phase": "forward"})
                st.children.append(model)
                for layer in range(layers):
                    mod = _Span("module", "BertLayer", cursor, cursor, model, rank, {"plasmient.module.path": f"model.encoder.layer.{layer}", "plasmient.module.phase": "forward"})
                    model.children.append(mod)
                    for op_name, kname, kind, fl, by, dur, bound in LAYER_OPS:
                        dur = dur + skew + 500 * layer
                        op = _Span("op", op_name, cursor, cursor, mod, rank, {})
                        mod.children.append(op)
                        for _ in range(kernels_per_op):
                            k = _Span(
                                "kernel", kname, cursor + 1_000, cursor + 1_000 + dur, op, rank,
                                {"plasmient.kernel.kind": kind, "plasmient.gpu.device": lr, "plasmient.gpu.stream": 7,
                                 "plasmient.flops": fl, "plasmient.bytes": by, "plasmient.bound": bound, "plasmient.rank": rank,
                                 "plasmient.correlation_id": len(spans)},
                            )
                            op.children.append(k)
                            cursor = k.end + 2_000
                        op.end = cursor
                        mod.end = cursor
                    model.end = cursor
                if allreduce and nodes * ranks_per_node > 1:
                    op = _Span("op", "nccl:all_reduce", cursor, cursor, st, rank, {})
                    st.children.append(op)
                    k = _Span("kernel", "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", cursor + 1_000, cursor + 61_000 - skew, op, rank,
                              {"plasmient.kernel.kind": "collective", "plasmient.gpu.device": lr, "plasmient.gpu.stream": 21,
                               "plasmient.flops": 0.0, "plasmient.bytes": 5.0e7, "plasmient.bound": "communication", "plasmient.rank": rank})
                    op.children.append(k)
                    cursor = k.end + 2_000
                    op.end = cursor
                st.end = cursor + 20_000  # host-side tail with the GPU idle
                step_wall = max(step_wall, st.end - t0)
    # Close windows bottom-up and flatten.
    flat: list[_Span] = []

    def close(s: _Span) -> None:
        flat.append(s)
        for c in s.children:
            close(c)
        if s.children:
            s.start = min(s.start, min(c.start for c in s.children))
            s.end = max(s.end, max(c.end for c in s.children))
        s.kernels = [s] if s.level == "kernel" else [k for c in s.children for k in c.kernels]

    for r in roots:
        close(r)
    if not with_kernels:
        # CPU-only: no kernel spans at all; ops keep CPU time but no device metrics.
        flat = [s for s in flat if s.level != "kernel"]
        for s in flat:
            s.children = [c for c in s.children if c.level != "kernel"]
            s.kernels = []
    _metrics(flat, peak, bandwidth, price, with_kernels)
    _culprits(flat)
    if depth == "step":
        # Step-level sampling: the metrics and culprits were computed on the whole subtree, which
        # is then not exported.
        flat = [s for s in flat if s.level in ("fleet", "node", "rank", "step")]
    for i, s in enumerate(flat, start=1):
        s.span_id = (0x5EED << 40) + i
    return _to_batch(flat, resources, job_id, peak, bandwidth)


def _gpus(s: _Span) -> int:
    if s.level in ("fleet", "node"):
        return len({k.resource for k in s.kernels}) or sum(_gpus(c) for c in s.children) or 1
    return 1


def _union(kernels: list[_Span], lo: int, hi: int) -> float:
    by_dev: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for k in kernels:
        by_dev.setdefault((k.resource, k.attrs.get("plasmient.gpu.device", 0)), []).append((max(k.start, lo), min(k.end, hi)))
    total = 0
    for iv in by_dev.values():
        iv.sort()
        cur_s, cur_e = None, None
        for a, b in iv:
            if b <= a:
                continue
            if cur_e is None or a > cur_e:
                if cur_e is not None:
                    total += cur_e - cur_s
                cur_s, cur_e = a, b
            else:
                cur_e = max(cur_e, b)
        if cur_e is not None:
            total += cur_e - cur_s
    return total / 1e9


def _metrics(flat: list[_Span], peak: float | None, bw: float | None, price: float | None, with_kernels: bool) -> None:
    for s in flat:
        a = s.attrs
        wall = (s.end - s.start) / 1e9
        gpus = _gpus(s)
        a["plasmient.level"] = s.level
        a["plasmient.wall_s"] = wall
        a["plasmient.gpus"] = gpus
        a["plasmient.device.type"] = "gpu" if with_kernels else "cpu"
        if not with_kernels:
            if s.level in ("fleet", "node", "rank", "step"):
                a["plasmient.busy_s"] = 0.0
                a["plasmient.util.resident"] = 0.0
                a["plasmient.idle_fraction"] = 1.0
                a["plasmient.bound"] = "idle"
                if price is not None:
                    a["plasmient.cost.usd"] = price * wall * gpus / 3600
            continue
        flops = sum(k.attrs["plasmient.flops"] for k in s.kernels)
        nbytes = sum(k.attrs["plasmient.bytes"] for k in s.kernels)
        busy = _union(s.kernels, s.start, s.end) if s.level != "kernel" else wall
        a["plasmient.flops"] = flops
        a["plasmient.bytes"] = nbytes
        if nbytes:
            a["plasmient.arithmetic_intensity"] = flops / nbytes
        a["plasmient.busy_s"] = busy
        a["plasmient.kernels"] = len(s.kernels)
        util = busy / (wall * gpus) if wall > 0 else 0.0
        a["plasmient.util.resident"] = util
        a["plasmient.idle_fraction"] = 1 - util
        if peak is not None:
            ideal = flops / peak
            mfu = ideal / (wall * gpus) if wall > 0 else 0.0
            a["plasmient.ideal_s"] = ideal
            a["plasmient.mfu"] = mfu
            a["plasmient.wasted_s"] = max(0.0, wall * gpus - ideal / B)
            if busy > 0:
                a["plasmient.stall_fraction"] = 1 - ideal / busy
            if s.level in ("fleet", "node", "rank", "step"):
                a["plasmient.peak_flops"] = peak
            if price is not None:
                a["plasmient.cost.wasted_usd"] = price * wall * gpus / 3600 * max(0.0, 1 - mfu / B)
        if price is not None:
            a["plasmient.cost.usd"] = price * wall * gpus / 3600
        if bw is not None and s.level == "rank":
            a["plasmient.peak_bandwidth"] = bw
        if s.level == "rank":  # as an ingest writes it: "unknown" where the device's peak is
            a["plasmient.peak.source"] = "unknown" if peak is None else "table:H100 SXM"
        if s.level != "kernel" and "plasmient.bound" not in a:
            a["plasmient.bound"] = "idle" if util < 0.2 else ("compute" if peak and nbytes and flops / nbytes > peak / (bw or 1) else "memory")


SUGGESTIONS = {
    "memory": "memory-bound attention: raise the batch or use a fused/paged attention kernel",
    "compute": "compute-bound GEMM: check the dtype and tile sizes",
    "latency": "tiny kernels: fuse them (torch.compile) or use CUDA graphs",
    "communication": "collective on the critical path: overlap it with compute or shard differently",
}


def _culprits(flat: list[_Span]) -> None:
    for s in flat:
        if s.level not in ("fleet", "node", "rank", "step"):
            continue
        ks = [k for k in s.kernels if "plasmient.wasted_s" in k.attrs]
        if not ks:
            continue
        worst = max(ks, key=lambda k: k.attrs["plasmient.wasted_s"])
        op = worst.parent
        mod = op.parent if op is not None and op.parent is not None and op.parent.level == "module" else None
        a = s.attrs
        a["plasmient.culprit.kernel"] = worst.name
        a["plasmient.culprit.op"] = op.name if op is not None else None
        a["plasmient.culprit.module"] = mod.attrs.get("plasmient.module.path") if mod is not None else None
        a["plasmient.culprit.wasted_s"] = worst.attrs["plasmient.wasted_s"]
        a["plasmient.culprit.bound"] = worst.attrs["plasmient.bound"]
        a["plasmient.culprit.suggestion"] = SUGGESTIONS[worst.attrs["plasmient.bound"]]
        if s.level in ("fleet", "node"):
            a["plasmient.culprit.rank"] = worst.resource
        rows = _culprit_rows(s, ks)
        a["plasmient.culprits"] = json.dumps(rows)
        # the span's culprit.* attributes name the first row, as the stitcher writes them
        a["plasmient.culprit.kernel"], a["plasmient.culprit.op"] = rows[0]["kernel"], rows[0]["op"]
        a["plasmient.culprit.module"], a["plasmient.culprit.wasted_s"] = rows[0]["module"], rows[0]["wasted_s"]
        a["plasmient.culprit.bound"], a["plasmient.culprit.suggestion"] = rows[0]["bound"], rows[0]["suggestion"]
        if s.level in ("fleet", "node"):
            a["plasmient.culprit.rank"] = rows[0]["rank"]


def _culprit_rows(s: _Span, ks: list[_Span]) -> list[dict[str, Any]]:
    """The stitcher's by-name table: kernels grouped by (kernel, op, module pattern), most waste first."""
    groups: dict[tuple[Any, ...], dict[str, Any]] = {}
    for k in ks:
        op = k.parent
        mod = op.parent if op is not None and op.parent is not None and op.parent.level == "module" else None
        path = mod.attrs.get("plasmient.module.path") if mod is not None else None
        pattern = re.sub(r"(?<=\.)\d+(?=\.|$)", "*", path) if path else None
        key = (k.name, op.name if op is not None else None, pattern)
        g = groups.setdefault(key, {"kernel": key[0], "op": key[1], "module": key[2], "calls": 0, "paths": set(),
                                    "wasted_s": 0.0, "bound": k.attrs["plasmient.bound"], "kind": "kernel",
                                    "suggestion": SUGGESTIONS[k.attrs["plasmient.bound"]], "_worst": -1.0})
        g["calls"] += 1
        g["paths"].add(path)
        g["wasted_s"] += k.attrs["plasmient.wasted_s"]
        if k.attrs["plasmient.wasted_s"] > g["_worst"]:
            g["_worst"] = k.attrs["plasmient.wasted_s"]
            if s.level in ("fleet", "node"):
                g["rank"] = k.resource
    rows = sorted(groups.values(), key=lambda g: -g["wasted_s"])[:10]
    for g in rows:
        g["layers"] = len(g.pop("paths") - {None})
        g.pop("_worst")
    return rows


def _to_batch(flat: list[_Span], resources: list[dict[str, Any]], job_id: str, peak: float | None, bw: float | None) -> SpanBatch:
    from plasmient_trace.conventions import SPAN_TABLE_SCHEMA

    n = len(flat)
    root_of: dict[int, _Span] = {}
    for s in flat:
        r = s
        while r.parent is not None:
            r = r.parent
        root_of[id(s)] = r
    cols: dict[str, Any] = {
        "trace_id": [_trace_id(job_id, root_of[id(s)].attrs["plasmient.step"]) for s in flat],
        "span_id": [s.span_id for s in flat],
        "parent_span_id": [s.parent.span_id if s.parent is not None else 0 for s in flat],
        "resource_index": [s.resource for s in flat],
        "name": [s.name for s in flat],
        "start_ns": [s.start for s in flat],
        "end_ns": [s.end for s in flat],
    }
    keys = sorted({k for s in flat for k in s.attrs})
    schema_names = set(SPAN_TABLE_SCHEMA.names)
    for k in keys:
        if k in schema_names:
            cols[k] = [s.attrs.get(k) for s in flat]
    for s in flat:
        s.attrs.setdefault("plasmient.job.id", job_id)
    cols["plasmient.job.id"] = [job_id] * n
    cols["plasmient.step"] = [root_of[id(s)].attrs["plasmient.step"] for s in flat]
    table = span_table_from_columns(cols, n)
    if "plasmient.peak_bandwidth" not in schema_names and any("plasmient.peak_bandwidth" in s.attrs for s in flat):
        import pyarrow as pa

        table = table.append_column("plasmient.peak_bandwidth", pa.array([s.attrs.get("plasmient.peak_bandwidth") for s in flat], pa.float64()))
    return SpanBatch(table, resources)


def replicate(batch: SpanBatch, copies: int) -> SpanBatch:
    """`copies` back-to-back repetitions of a job's steps as further steps (new trace and span ids),
    built column-wise so a 10^5-span batch takes well under a second."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    t = batch.table
    start = t.column("start_ns").to_numpy()
    end = t.column("end_ns").to_numpy()
    period = int(end.max() - start.min()) + 100_000
    steps = t.column("plasmient.step").to_numpy(zero_copy_only=False)
    n_steps = int(steps.max()) + 1
    enc = pc.dictionary_encode(t.column("trace_id").combine_chunks())
    sid = t.column("span_id").to_numpy()
    pid = t.column("parent_span_id").to_numpy()
    parts = []
    for c in range(copies):
        new_ids = pa.array([hashlib.sha256(b"replica/%d/" % c + old).digest()[:16] for old in enc.dictionary.to_pylist()], pa.binary(16))
        off = np.uint64(c) << np.uint64(32)
        cols = {
            "trace_id": new_ids.take(enc.indices),
            "span_id": pa.array(sid + off),
            "parent_span_id": pa.array(np.where(pid == 0, np.uint64(0), pid + off)),
            "start_ns": pa.array(start + c * period),
            "end_ns": pa.array(end + c * period),
            "plasmient.step": pa.array(steps + c * n_steps),
        }
        part = t
        for name, arr in cols.items():
            part = part.set_column(part.schema.get_field_index(name), name, arr)
        parts.append(part)
    return SpanBatch(pa.concat_tables(parts), batch.resources)
