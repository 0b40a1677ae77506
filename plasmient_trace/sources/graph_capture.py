"""CUDA/HIP graph replays, explained by the trace of their capture.

A replayed graph's kernels hang under one cudaGraphLaunch/hipGraphLaunch with no op shapes, so
nothing about their work is known from the replay trace alone. Serving stacks (vLLM, SGLang) can
also write a trace of the graph being *captured*: there every kernel launch is made by an op with
recorded shapes, but no kernel runs. This module pairs each replayed kernel with the capture-time
launch of the same graph node and fills the kernel columns ``model_flops``, ``model_bytes``,
``model_dtype``, ``capture_op`` and ``capture_module`` (records.KERNELS; null = unknown).

Pairing: by graph node id where both traces carry one (a ``graph_node_id`` column on the replay
kernels and the capture launches); otherwise by kernel order within the graph (replayed kernels by
start time against captured launches by launch time), and only where the kernel names agree: a
name mismatch is counted and left unpaired, never guessed. A capture op's FLOPs and bytes are split
over its paired kernels as the stitcher splits an op over the kernels it launched
(metrics.flops.ownership.split_op_work: by duration, a matmul's work on its GEMM kernels only; a helper
beside them gets 0 FLOPs and null bytes).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from ..memory import cyclic_gc_paused
from ..metrics import flops as flops_model
from ..metrics.flops.context import step_annotations
from ..metrics.flops.kernel_roles import kernel_roles
from ..metrics.flops.vendor import VLLM_ATTENTION_OPS, vllm_attention_cost
from ..records import GRAPH_LAUNCH_NAMES, RecordSet
from ..stitch.joins import join_rank
from ..stitch.nesting import innermost_enclosing_points
from .kineto import TraceFormatError
from .rawinput import InputError, inflate_whole, read_file_bytes

__all__ = ["capture_trace_for", "launch_kernel_names", "pair_graph_capture"]

_BEGIN_CAPTURE = ("cudaStreamBeginCapture", "hipStreamBeginCapture", "cuStreamBeginCapture")
_END_CAPTURE = ("cudaStreamEndCapture", "hipStreamEndCapture", "cuStreamEndCapture")
_NODE_COLUMN = "graph_node_id"
_NAME_COLUMN = "kernel_name"


def capture_trace_for(replay_path: str | Path) -> Path | None:
    """The capture trace that vLLM/SGLang wrote for a replay trace, from ``execution_details.json``
    (beside the replay or in its ``capture_traces/`` folder); None when there is none. With several
    entries the first whose file exists is taken."""
    replay = Path(replay_path)
    for folder in (replay.parent, replay.parent / "capture_traces"):
        details = folder / "execution_details.json"
        if not details.is_file():
            continue
        try:
            entries = json.loads(details.read_text())
        except (OSError, ValueError):
            return None
        if isinstance(entries, dict):
            entries = [entries]
        for entry in entries if isinstance(entries, list) else []:
            name = entry.get("file") if isinstance(entry, dict) else None
            if isinstance(name, str) and (folder / name).is_file():
                return folder / name
    return None


def launch_kernel_names(path: str | Path) -> dict[int, str]:
    """Correlation id -> kernel name of every launch in a Kineto trace (the launch's ``kernel`` arg).
    Needed while records.LAUNCHES has no kernel-name column: a captured launch runs no kernel, so its
    name exists only on the launch."""
    path = Path(path)
    try:  # under the same size and expansion caps as the trace's own read
        raw = inflate_whole(path, read_file_bytes(path))
    except InputError as err:
        raise TraceFormatError(str(err)) from None
    with cyclic_gc_paused():  # a whole trace of dicts: the GC would rescan them for cycles they never have
        doc = orjson.loads(raw)
    events = doc.get("traceEvents", []) if isinstance(doc, dict) else doc
    out: dict[int, str] = {}
    for e in events:
        args = e.get("args") if isinstance(e, dict) else None
        if isinstance(args, dict) and "kernel" in args and "correlation" in args:
            out[int(args["correlation"])] = str(args["kernel"])
    return out


def _col(table: pa.Table, name: str, fill: int = -1) -> np.ndarray:
    return table.column(name).fill_null(fill).to_numpy().astype(np.int64)


def _captured_launches(capture: RecordSet) -> np.ndarray:
    """Launch rows made while a stream was capturing, in launch order: between Begin/EndCapture on
    the capturing thread where those calls were traced, else every kernel launch that ran no kernel."""
    lt = capture.launches
    names = np.array(lt.column("name").to_pylist(), dtype=object)
    start, tid = _col(lt, "start_ns"), _col(lt, "tid")
    is_launch = (pc.match_substring(lt.column("name"), "Launch").to_numpy(zero_copy_only=False)
                 & ~pc.match_substring(lt.column("name"), "Graph").to_numpy(zero_copy_only=False))
    begins = np.nonzero(np.isin(names, _BEGIN_CAPTURE))[0]
    ends = np.nonzero(np.isin(names, _END_CAPTURE))[0]
    if len(begins) and len(ends):
        inside = np.zeros(len(names), bool)
        for b in begins:
            later = ends[(tid[ends] == tid[b]) & (start[ends] >= start[b])]
            if len(later):
                e = later[np.argmin(start[later])]
                inside |= (tid == tid[b]) & (start >= start[b]) & (start <= start[e])
        rows = np.nonzero(is_launch & inside)[0]
    else:
        ran = np.isin(_col(lt, "correlation_id"), _col(capture.kernels, "correlation_id"))
        rows = np.nonzero(is_launch & ~ran)[0]
    return rows[np.argsort(start[rows], kind="stable")]


def _launch_ops(capture: RecordSet, rows: np.ndarray) -> np.ndarray:
    """The op that made each launch: same external id, else the innermost op on its thread."""
    ops, lt = capture.ops, capture.launches
    o_ext = _col(ops, "external_id")
    l_ext = _col(lt, "external_id")[rows]
    order = np.argsort(o_ext, kind="stable")
    pos = np.clip(np.searchsorted(o_ext[order], l_ext), 0, max(len(order) - 1, 0))
    found = (l_ext >= 0) & (len(order) > 0)
    op = np.where(found & (o_ext[order][pos] == l_ext) if len(order) else found, order[pos] if len(order) else -1, -1)
    missing = op < 0
    if missing.any() and ops.num_rows:
        o_thread = _col(ops, "pid") * (1 << 32) + (_col(ops, "tid") & 0xFFFFFFFF)
        l_thread = _col(lt, "pid")[rows] * (1 << 32) + (_col(lt, "tid")[rows] & 0xFFFFFFFF)
        inner = innermost_enclosing_points(o_thread, _col(ops, "start_ns"), _col(ops, "end_ns"),
                                           l_thread[missing], _col(lt, "start_ns")[rows][missing])
        op[missing] = inner
    return op


def _with_replay_batch(capture: RecordSet, base: flops_model.OpCosts, replay: RecordSet,
                       launch_ns: int | None) -> flops_model.OpCosts:
    """Capture-op costs for one replay: vLLM attention depends on the batch's sequence lengths, which
    the capture (dummy lengths) lacks and the replay's engine-step annotation states."""
    attn = np.isin(np.array(capture.ops.column("name").to_pylist(), dtype=object), VLLM_ATTENTION_OPS)
    if launch_ns is None or not attn.any() or not replay.ops.num_rows:
        return base
    r_start, r_end = _col(replay.ops, "start_ns"), _col(replay.ops, "end_ns")
    steps = [st for row, st in step_annotations(replay.ops) if r_start[row] <= launch_ns < r_end[row]]
    if len(steps) != 1:
        return base
    flops, nbytes, model = base.flops.copy(), base.bytes.copy(), base.model.copy()
    for r in np.nonzero(attn)[0].tolist():
        dims, types = (orjson.loads(capture.ops.column(c)[r].as_py() or "null") for c in ("input_dims", "input_types"))
        if isinstance(dims, list) and isinstance(types, list):
            res = vllm_attention_cost(flops_model.OpArgs(dims, types, None), steps[0])
            if res is not None:
                flops[r], nbytes[r], model[r] = res
    return flops_model.OpCosts(flops, nbytes, base.dtype, model)


def _op_modules(capture: RecordSet, op: np.ndarray) -> np.ndarray:
    """Innermost nn.Module (row of capture.modules) around each op's start on its thread; -1 if none."""
    out = np.full(len(op), -1, np.int64)
    mt, ot = capture.modules, capture.ops
    sel = op >= 0
    if not mt.num_rows or not sel.any():
        return out
    m_thread = _col(mt, "pid") * (1 << 32) + (_col(mt, "tid") & 0xFFFFFFFF)
    o_thread = (_col(ot, "pid") * (1 << 32) + (_col(ot, "tid") & 0xFFFFFFFF))[op[sel]]
    inner = innermost_enclosing_points(m_thread, _col(mt, "start_ns"), _col(mt, "end_ns"),
                                       o_thread, _col(ot, "start_ns")[op[sel]])
    out[sel] = inner
    return out


def _names_of(capture: RecordSet, rows: np.ndarray, kernel_names: Mapping[int, str] | None) -> np.ndarray:
    if _NAME_COLUMN in capture.launches.column_names:
        return np.array(capture.launches.column(_NAME_COLUMN).to_pylist(), dtype=object)[rows]
    out = np.full(len(rows), None, dtype=object)
    if kernel_names:
        keys = np.fromiter(kernel_names.keys(), np.int64, len(kernel_names))
        vals = np.array(list(kernel_names.values()), dtype=object)
        order = np.argsort(keys)
        corr = _col(capture.launches, "correlation_id")[rows]
        pos = np.clip(np.searchsorted(keys[order], corr), 0, len(order) - 1)
        hit = keys[order][pos] == corr
        out[hit] = vals[order][pos[hit]]
    return out


def _pair(replay: RecordSet, capture: RecordSet, kernel_names: Mapping[int, str] | None,
          stats: dict) -> tuple[np.ndarray, np.ndarray]:
    """(captured launch row per replay kernel or -1, the captured launch rows in order)."""
    kt, lt = replay.kernels, replay.launches
    n = kt.num_rows
    graph = pc.is_in(lt.column("name"), value_set=pa.array(GRAPH_LAUNCH_NAMES)).to_numpy(zero_copy_only=False)
    k_corr = _col(kt, "correlation_id")
    in_graph = np.isin(k_corr, _col(lt, "correlation_id")[graph]) & (k_corr >= 0)
    stats["graph_kernels"] = int(in_graph.sum())
    rows = _captured_launches(capture)
    stats["capture_launches"] = len(rows)
    paired = np.full(n, -1, np.int64)
    if not in_graph.any() or not len(rows):
        stats["unpaired"] = stats["graph_kernels"]
        return paired, rows
    k_start = _col(kt, "start_ns")
    by_node = np.zeros(n, bool)
    if _NODE_COLUMN in kt.column_names and _NODE_COLUMN in capture.launches.column_names:
        node_k = _col(kt, _NODE_COLUMN)
        node_c = _col(capture.launches, _NODE_COLUMN)[rows]
        order = np.argsort(node_c, kind="stable")
        pos = np.clip(np.searchsorted(node_c[order], node_k), 0, len(order) - 1)
        by_node = in_graph & (node_k >= 0) & (node_c[order][pos] == node_k)
        paired[by_node] = order[pos[by_node]]
    for corr in np.unique(k_corr[in_graph & ~by_node]):
        # One graph launch replays the captured nodes once each, in capture order.
        ks = np.nonzero((k_corr == corr) & ~by_node)[0]
        ks = ks[np.argsort(k_start[ks], kind="stable")]
        m = min(len(ks), len(rows))
        paired[ks[:m]] = np.arange(m)
    have = paired >= 0
    cap_name = _names_of(capture, rows, kernel_names)
    k_name = np.array(kt.column("name").to_pylist(), dtype=object)
    agree = have & (k_name == cap_name[np.maximum(paired, 0)])
    stats["name_mismatches"] = int((have & ~agree).sum())
    paired[~agree] = -1
    have = paired >= 0
    stats["paired"] = int(have.sum())
    stats["by_node_id"] = int((have & by_node).sum())
    stats["by_order"] = stats["paired"] - stats["by_node_id"]
    stats["unpaired"] = stats["graph_kernels"] - stats["paired"]
    return paired, rows


def pair_graph_capture(replay: RecordSet, capture: RecordSet,
                       kernel_names: Mapping[int, str] | None = None,
                       moe: flops_model.MoEConfig | None = None) -> tuple[RecordSet, dict]:
    """Fill the capture columns of every replayed kernel of ``replay`` from ``capture``.

    ``moe`` (from the model's config) costs the capture's MoE expert ops, which are unknown without it.

    ``kernel_names`` maps the capture's launch correlation ids to kernel names
    (:func:`launch_kernel_names`) where capture.launches has no ``kernel_name`` column. Returns the
    replay with a new kernels table and stats: graph_kernels, paired, by_node_id, by_order,
    name_mismatches, unpaired, capture_launches. Kernels outside graph launches are untouched.
    """
    stats = {"graph_kernels": 0, "paired": 0, "by_node_id": 0, "by_order": 0, "name_mismatches": 0,
             "unpaired": 0, "capture_launches": 0}
    paired_launch, rows = _pair(replay, capture, kernel_names, stats)
    have = paired_launch >= 0
    if not have.any():
        return replay, stats
    kt, lt = replay.kernels, replay.launches
    n = kt.num_rows
    k_corr, k_start = _col(kt, "correlation_id"), _col(kt, "start_ns")

    j = join_rank(capture)
    base = flops_model.model_ops(capture.ops, moe)
    launch_op = _launch_ops(capture, rows)
    op_of_k = np.where(have, launch_op[np.maximum(paired_launch, 0)], -1)
    dur_ns = _col(kt, "end_ns") - k_start
    role = kernel_roles(kt.column("name"))
    mflops = np.zeros(n)
    mbytes = np.zeros(n)
    dtype = np.full(n, None, dtype=object)
    known = np.zeros(n, bool)
    counted_any = np.zeros(n, bool)
    passed_any = np.zeros(n, bool)  # helpers beside a matmul's GEMM: 0 FLOPs, bytes the op's model leaves out
    launch_start = dict(zip(_col(lt, "correlation_id").tolist(), _col(lt, "start_ns").tolist()))
    for corr in np.unique(k_corr[have]).tolist():
        # One replay at a time: its batch (vLLM step statistics) and its own split of each op.
        ks = have & (k_corr == corr)
        costs = _with_replay_batch(capture, base, replay, launch_start.get(corr))
        owner, counted = flops_model.flop_owners(op_of_k, j.op_parent, costs.model,
                                                 flops_model.yields_flops(j.op_parent, costs.model, costs.flops))
        kn = ks & (owner >= 0)
        own = kn & counted
        share, passed = flops_model.split_op_work(owner, own, dur_ns, role, costs.model, capture.ops.num_rows)
        o = np.maximum(owner, 0)
        mflops[kn] = np.where(own, costs.flops[o] * share, 0.0)[kn]
        mbytes[kn] = np.where(own, costs.bytes[o] * share, 0.0)[kn]
        passed_any |= passed & ks
        dtype[own] = costs.dtype[o][own]
        known |= kn
        counted_any |= own
    own_rows = counted_any
    op_names = np.array(capture.ops.column("name").to_pylist() + [None], dtype=object)
    mod_names = np.array(list(j.module_path) + [None], dtype=object)
    mod_idx = _op_modules(capture, op_of_k)

    def nullable(values: np.ndarray, valid: np.ndarray, typ: pa.DataType) -> pa.Array:
        return pa.array(values, typ, mask=~valid, from_pandas=True)

    new = kt
    for name, arr in (
        ("model_flops", nullable(mflops, known, pa.float64())),
        ("model_bytes", nullable(mbytes, known & ~passed_any, pa.float64())),
        ("model_dtype", nullable(dtype, own_rows, pa.string())),
        ("capture_op", nullable(op_names[np.where(op_of_k >= 0, op_of_k, -1)], op_of_k >= 0, pa.string())),
        ("capture_module", nullable(mod_names[np.where(mod_idx >= 0, mod_idx, -1)], mod_idx >= 0, pa.string())),
    ):
        new = new.set_column(new.schema.get_field_index(name), new.schema.field(name), arr)
    return replace(replay, kernels=new), stats
