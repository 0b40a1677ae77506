"""Culprits: where a step's wasted device-seconds live, as a profiler's "by name" table.

Waste is exclusive: each kernel's below-baseline device time, plus the step's idle gaps (host gaps in its
window). Kernels are grouped by (kernel name, launching op name, module pattern), where the pattern drops
layer and instance numbers (``ViTLayer_3`` -> ``ViTLayer_*``, ``layers.3`` -> ``layers.*``), so the same
softmax in twelve layers is one row: "12 calls in 12 layers". Rows are kernel groups or the idle row,
never a span and its ancestor, so they add up: their waste sums to at most the step's device-seconds.
The step span, the terminal summary and the HTML report all read the same list (``plasmient.culprits``).
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .. import conventions as cv
from ..metrics.compute import BOUND_CODE, BOUND_EVIDENCE_COVERAGE
from ..metrics.culprit import suggestion
from ..records import GRAPH_LAUNCH_NAMES
from .inputs import CULPRIT_ROWS, KINDS, DeviceSpec
from .joins import JoinedRank
from .nesting import tree_root
from .rank import RankTree, SpanMetrics, module_of_ops

IDLE_LABEL = "[device idle]"
_INSTANCE = re.compile(r"(?<=_)\d+(?=\.|$|\s)|(?<=\.)\d+(?=\.|$|\s)")


def module_pattern(path: str) -> str:
    """A module path with its layer/instance numbers replaced by '*'."""
    return _INSTANCE.sub("*", path)


def _dense(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    uniq, inv = np.unique(values, return_inverse=True)
    return uniq, inv.astype(np.int64)


def _dense_text(values: list[Any]) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_dense` of texts, the distinct ones sorted, as an object array: a fixed-width array is as wide as
    the longest text on every row (one 1 MB module name among 300,000 modules asked numpy for 1.14 GiB)."""
    texts = [str(v) for v in values]
    uniq = sorted(set(texts))
    index = {v: i for i, v in enumerate(uniq)}
    return np.array(uniq, dtype=object), np.fromiter((index[v] for v in texts), np.int64, len(texts))


def _group_rows(columns: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(distinct rows in lexicographic order, group of each row): ``np.unique(np.stack(columns, 1), axis=0,
    return_inverse=True)`` from one lexsort of the columns (unique over rows sorts a structured view, far slower)."""
    order = np.lexsort(columns[::-1])
    keys = np.stack([c[order] for c in columns], axis=1)
    new = np.ones(len(order), bool)
    new[1:] = (keys[1:] != keys[:-1]).any(axis=1)
    g = np.empty(len(order), np.int64)
    g[order] = np.cumsum(new) - 1
    return keys[new], g


def _names(arr: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, list[str]]:
    arr = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
    enc = arr.dictionary_encode()
    return enc.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64), [str(x) for x in enc.dictionary.to_pylist()]


def step_culprits(tree: RankTree, j: JoinedRank, met: SpanMetrics, spec: DeviceSpec,
                  rows: int = CULPRIT_ROWS, wanted: np.ndarray | None = None) -> list[list[dict[str, Any]]]:
    """Per step row, the top culprit rows (most exclusive waste first). ``wanted`` (per step row) limits
    them to those steps, the others getting none: a step sampled at step depth has no kernel FLOPs, and
    its culprits would be left out of its spans (``step_facts.NEEDS_KERNEL_FLOPS``) once ranked. ``spec``:
    the device: its type, and the precisions and peaks a compute-bound row's suggestion names."""
    device_type = spec.device_type
    out: list[list[dict[str, Any]]] = [[] for _ in range(tree.n_steps)]
    wanted = np.ones(tree.n_steps, bool) if wanted is None else np.asarray(wanted, bool)[:tree.n_steps]
    if not wanted.any():
        return out
    rs = j.records
    n_k = tree.n_k
    kr = tree.k_rows
    # labels: kernel name, launching op name, module pattern (+ the raw module for the layer count)
    k_names_code, k_names = _names(rs.kernels.column("name")) if n_k else (np.zeros(0, np.int64), [])
    op_code, op_names = _names(rs.ops.column("name")) if tree.n_op else (np.zeros(0, np.int64), [])
    real = kr < n_k
    kname = np.where(real, k_names_code[np.minimum(kr, max(n_k - 1, 0))] if n_k else -1, -1)
    synth = ~real
    # a call is a kernel, but an op whose own work is several stretches between its child ops
    # (ownership.own_time_gaps) is one call however many stretches it has
    calls = np.ones(len(kr))
    if synth.any():
        synth_op = tree.synth_ops[kr[synth] - n_k]
        kname[synth] = op_code[synth_op] + len(k_names)
        first = np.zeros(len(synth_op))
        first[np.unique(synth_op, return_index=True)[1]] = 1.0
        calls[synth] = first
    all_k_names = k_names + op_names
    lop = tree.k_launch_op
    oname = np.where(lop >= 0, op_code[np.maximum(lop, 0)] if tree.n_op else -1, -1)
    root = tree_root(j.op_parent) if tree.n_op else np.zeros(0, np.int64)  # each op's outermost ancestor
    mod_of_op = module_of_ops(j, root)
    mod = np.where(lop >= 0, mod_of_op[np.maximum(lop, 0)] if tree.n_op else -1, -1)
    labels = tree.module_labels
    patterns = [module_pattern(x) for x in labels]
    pat_uniq, pat_code_of_mod = _dense_text(patterns) if labels else (np.array([]), np.zeros(0, np.int64))
    mpat = np.where(mod >= 0, pat_code_of_mod[np.maximum(mod, 0)] if len(labels) else -1, -1)
    pat_uniq, mpat = _context_scopes(root, lop, mod, op_code, op_names, pat_uniq, mpat)
    # layers are distinct module paths (a module called three times in the step is one layer)
    _, path_code_of_mod = _dense_text(labels) if labels else (None, np.zeros(0, np.int64))
    mpath = np.where(mod >= 0, path_code_of_mod[np.maximum(mod, 0)] if len(labels) else -1, -1)

    # A replayed CUDA-graph kernel is named by the op that launched it at capture time, not the replay call.
    if n_k and "capture_op" in rs.kernels.column_names and rs.kernels.column("capture_op").null_count < n_k:
        cap_code, cap_names = _names(rs.kernels.column("capture_op"))
        cmod_code, cmod_names = _names(rs.kernels.column("capture_module"))
        kr_real = np.minimum(kr, n_k - 1)
        has_cap = real & (cap_code[kr_real] >= 0)
        oname = np.where(has_cap, cap_code[kr_real] + len(op_names), oname)
        op_names = op_names + cap_names
        cpat = [module_pattern(x) for x in cmod_names]
        pat_list = [str(x) for x in pat_uniq] + cpat
        pat_uniq, remap = _dense_text(pat_list) if pat_list else (np.array([]), np.zeros(0, np.int64))
        mpat = np.where(mpat >= 0, remap[np.maximum(mpat, 0)] if len(remap) else -1, -1)
        has_cmod = has_cap & (cmod_code[kr_real] >= 0)
        mpat = np.where(has_cmod, remap[len(pat_list) - len(cpat) + np.maximum(cmod_code[kr_real], 0)] if len(remap) else -1, mpat)
        mpath = np.where(has_cmod, 1_000_000_000 + cmod_code[kr_real], mpath)
    step = tree.step_row[tree.base["kernel"] + kr]
    waste = tree.k_waste
    kernel_bound = met.bound[tree.base["kernel"] + kr]
    kind = tree.k_kind
    precision = tree.k_precision
    alive = np.arange(len(kr))  # each row's position among the alive kernels (tree.k_rows)
    if not wanted.all():
        keep = (step < 0) | wanted[np.maximum(step, 0)]
        kname, oname, mpat, mpath, step, waste, kernel_bound, kind, alive, calls = (
            a[keep] for a in (kname, oname, mpat, mpath, step, waste, kernel_bound, kind, alive, calls))
    if len(step):
        groups, g = _group_rows((step, kname, oname, mpat))
        g_waste = np.bincount(g, weights=waste, minlength=len(groups))
        g_calls = np.rint(np.bincount(g, weights=calls, minlength=len(groups))).astype(np.int64)
        pair, _ = _group_rows((g, mpath))
        g_layers = np.bincount(pair[:, 0], weights=(pair[:, 1] >= 0).astype(float), minlength=len(groups)).astype(int)
        # representative instance: the group's most wasteful kernel (its bound and kind)
        order = np.lexsort((-waste, g))
        first = order[np.r_[True, g[order][1:] != g[order][:-1]]]
        rep = np.empty(len(groups), np.int64)
        rep[g[first]] = first
        by = np.lexsort((-g_waste, groups[:, 0]))
        # each step's `rows` most wasteful groups: rank within the step, in one pass
        group_step = groups[by, 0]
        starts = np.r_[0, np.nonzero(group_step[1:] != group_step[:-1])[0] + 1] if len(by) else np.zeros(0, np.int64)
        rank = np.arange(len(by)) - np.repeat(starts, np.diff(np.r_[starts, len(by)]))
        candidates: list[tuple[int, float, dict[str, Any]]] = []
        # a group that wasted nothing (every kernel at or above the baseline MFU) is no culprit
        for gi in by[(rank < rows) & (g_waste[by] > 0)].tolist():
            s = int(groups[gi, 0])
            r = rep[gi]
            bound_code = int(kernel_bound[r])
            row = {
                "kernel": all_k_names[groups[gi, 1]][:1024] if groups[gi, 1] >= 0 else None,
                "op": op_names[groups[gi, 2]] if groups[gi, 2] >= 0 else None,
                "module": str(pat_uniq[groups[gi, 3]]) if groups[gi, 3] >= 0 else None,
                "calls": int(g_calls[gi]), "layers": int(g_layers[gi]),
                "wasted_s": float(g_waste[gi]),
                "bound": cv.BOUNDS[bound_code] if bound_code >= 0 else None,
                "kind": KINDS[int(kind[r])],
                "missing": None,
                "precision": str(precision.names[precision.codes[kr[alive[r]]]]),
            }
            if bound_code == UNKNOWN_BOUND:
                row["missing"] = MISSING[int(_missing_evidence(tree, j, met, alive[[r]], oname[[r]] >= 0, device_type)[0])]
            candidates.append((s, row["wasted_s"], row))
        for s, _, row in candidates:
            out[s].append(row)
    # the idle row: host gaps in the step's window
    step_spans = tree.base["step"] + np.arange(tree.n_steps)
    idle = tree.col("idle_s")[step_spans]
    util = met.util[step_spans]
    with np.errstate(divide="ignore", invalid="ignore"):
        host_share = (np.where(idle > 0, 1.0 - np.minimum(tree.overlap.idle_device_s, idle) / idle, np.nan)
                      if tree.overlap is not None else np.full(tree.n_steps, np.nan))
    idle_fraction = (1.0 - np.nan_to_num(np.asarray(util, np.float64), nan=1.0)).tolist()  # unknown util: no idle claimed
    host_shares = [None if h != h else h for h in np.asarray(host_share, np.float64).tolist()]
    for s, idle_s in enumerate(idle.tolist()):
        if idle_s > 0 and wanted[s]:
            out[s].append({"kernel": IDLE_LABEL, "op": None, "module": None, "calls": 0, "layers": 0,
                           "wasted_s": idle_s, "bound": "idle", "kind": None})
        out[s].sort(key=lambda r: -r["wasted_s"])
        del out[s][rows:]
        for r in out[s]:
            r["suggestion"] = suggestion(r["kernel"] if r["kernel"] != IDLE_LABEL else None, r["op"], r["module"],
                                         r["bound"], r["kind"], idle_fraction[s], device_type=device_type,
                                         idle_row=r["kernel"] == IDLE_LABEL, idle_host_share=host_shares[s],
                                         missing=r.pop("missing", None), precision=r.pop("precision", None),
                                         peak=spec.peak if spec.peak_for is not None else None, native=spec.native)
    return out


# record_function scopes torch itself opens outside the model: an optimizer's step and zero_grad, and the
# DataLoader's fetch of the next batch (on the training thread when num_workers=0).
CONTEXT_SCOPES = ("Optimizer.", "enumerate(DataLoader)")


def _context_scopes(root: np.ndarray, lop: np.ndarray, mod: np.ndarray, op_code: np.ndarray, op_names: list[str],
                    pat_uniq: np.ndarray, mpat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Outside every module, the scope of :data:`CONTEXT_SCOPES` that is the root of the launching op's tree
    names the row's context in the module's place: 'aten::mul_ -> Optimizer.step#AdamW.step', not a bare
    'aten::mul_'. Returns the patterns extended with those scope names and the rows' codes."""
    if not len(op_names) or not (mod < 0).any():
        return pat_uniq, mpat
    scope_names = [i for i, n in enumerate(op_names) if n.startswith(CONTEXT_SCOPES)]
    if not scope_names:
        return pat_uniq, mpat
    is_scope = np.zeros(len(op_names) + 1, bool)  # [-1]: no name
    is_scope[scope_names] = True
    loose = np.nonzero((mod < 0) & (lop >= 0))[0]  # kernels whose op is in no module
    roots = root[lop[loose]]
    code = op_code[roots]
    inside = loose[(roots != lop[loose]) & is_scope[code]]
    if not len(inside):
        return pat_uniq, mpat
    scopes, scope_code = np.unique(op_code[root[lop[inside]]], return_inverse=True)
    mpat = mpat.copy()
    mpat[inside] = len(pat_uniq) + scope_code
    return np.array([*pat_uniq.tolist(), *(op_names[c] for c in scopes.tolist())], dtype=object), mpat


# Why a kernel's bound is unknown, in the order the evidence is needed (see metrics.culprit.suggestion).
MISSING = (None, "launch", "op", "shapes", "formula", "bytes", "peak", "graph")
_MISSING_CODE = {name: code for code, name in enumerate(MISSING)}
UNKNOWN_BOUND = BOUND_CODE["unknown"]


def _missing_evidence(tree: RankTree, j: JoinedRank, met: SpanMetrics, alive: np.ndarray, has_op: np.ndarray,
                      device_type: str) -> np.ndarray:
    """For the alive kernels at positions ``alive`` (into tree.k_rows), the first thing each one's bound
    lacks, as a code into MISSING: no launch record or no op to join it to, its op's shapes or FLOP formula,
    the capture of the CUDA graph that replayed it (its launching op only launched the graph), a byte count,
    or the device's peak or bandwidth (FLOPs and bytes known, yet no bound: the ridge point is unknown).
    ``has_op``: the culprit row names an op (a graph replay names the op its kernels were captured under).
    Called for the few representative kernels of unknown-bound culprit rows."""
    kr = tree.k_rows[alive]
    spans = tree.base["kernel"] + kr
    flops_known = np.nan_to_num(met.coverage[spans]) >= BOUND_EVIDENCE_COVERAGE
    bytes_known = tree.col("bytes")[spans] > 0
    lop = tree.k_launch_op[alive]
    code = np.full(len(kr), _MISSING_CODE["peak"], np.int8)
    code[flops_known & ~bytes_known] = _MISSING_CODE["bytes"]
    # Shapes were recorded when any op has them: then an op without them took no tensors the profiler
    # lists (an annotation such as Optimizer.step#…), and what its kernels lack is a formula, not a recording.
    dims = j.records.ops.column("input_dims") if tree.n_op else None
    recorded_shapes = dims is not None and dims.null_count < len(dims)
    no_flops = ~flops_known
    # the op the row names is the launching op (not a graph replay's capture op)
    own_op = has_op & (lop >= 0)
    code[no_flops & own_op] = _MISSING_CODE["formula" if recorded_shapes else "shapes"]
    code[no_flops & has_op & ~own_op] = 0  # a replayed graph's capture op: no more to say than "no FLOP model"
    if device_type != "cpu":
        n_k = tree.n_k
        real = kr < n_k
        launch = j.kernel_launch[np.minimum(kr, max(n_k - 1, 0))] if n_k else np.full(len(kr), -1)
        code[no_flops & ~has_op & real & (launch < 0)] = _MISSING_CODE["launch"]
        code[no_flops & ~has_op & real & (launch >= 0)] = _MISSING_CODE["op"]
        launched = real & (launch >= 0)
        if launched.any():
            # replayed by a graph launch and not paired with the graph's capture (sources.graph_capture)
            names = j.records.launches.column("name").take(pa.array(launch[launched]))
            graph = pc.is_in(names, value_set=pa.array(GRAPH_LAUNCH_NAMES)).to_numpy(zero_copy_only=False)
            captured = j.records.kernels.column("capture_op").take(pa.array(kr[launched])).is_valid()
            replayed = np.zeros(len(kr), bool)
            replayed[launched] = graph & ~captured.to_numpy(zero_copy_only=False)
            code[no_flops & own_op & replayed] = _MISSING_CODE["graph"]
    else:
        code[no_flops & ~has_op] = 0
    return code


def merge_culprits(lists: list[tuple[int, list[dict[str, Any]]]], rows: int | None = CULPRIT_ROWS) -> list[dict[str, Any]]:
    """Culprit rows of several spans summed by (kernel, op, module), most waste first; the rank losing
    most to a row is named (a row that already names one keeps it where its span's rank is unknown, -1)."""
    merged: dict[tuple[Any, Any, Any], dict[str, Any]] = {}
    for rank, items in lists:
        for r in items:
            key = (r.get("kernel"), r.get("op"), r.get("module"))
            m = merged.get(key)
            if m is None:
                merged[key] = m = {**r, "calls": 0, "layers": 0, "wasted_s": 0.0, "_worst": -1.0}
            m["calls"] += int(r.get("calls") or 0)
            m["layers"] = max(m["layers"], int(r.get("layers") or 0))
            wasted = float(r.get("wasted_s") or 0.0)
            m["wasted_s"] += wasted
            if wasted > m["_worst"]:
                m["_worst"] = wasted
                m["rank"] = rank if rank >= 0 else r.get("rank")
    out = sorted(merged.values(), key=lambda r: -r["wasted_s"])[:rows]
    for r in out:
        r.pop("_worst", None)
    return out


def culprit_columns(n: int, lists: dict[int, list[dict[str, Any]]]) -> dict[str, pa.Array]:
    """plasmient.culprits (JSON rows) and the plasmient.culprit.* attributes of the first row, for the
    n spans of a table of which `lists` (row -> culprit rows) names the few that carry them."""
    have = sorted(i for i, items in lists.items() if items)
    rows = np.array(have, np.int64)
    out: dict[str, pa.Array] = {}
    for k in ("kernel", "op", "module", "rank", "wasted_s", "bound", "suggestion"):
        typ = cv.ATTRIBUTE_BY_NAME[f"plasmient.culprit.{k}"].type
        out[f"plasmient.culprit.{k}"] = cv.scatter_rows(pa.array([lists[i][0].get(k) for i in have], typ), rows, n)
    texts_of: dict[int, str] = {}  # rows shared by several spans (a fleet and its one node) printed once
    texts = []
    for i in have:
        text = texts_of.get(id(lists[i]))
        if text is None:
            text = texts_of[id(lists[i])] = json.dumps(lists[i], separators=(",", ":"))
        texts.append(text)
    out["plasmient.culprits"] = cv.scatter_rows(pa.array(texts, pa.string()), rows, n)
    return out
