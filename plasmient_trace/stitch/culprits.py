"""Culprits: where a step's wasted device-seconds live, as a profiler's "by name" table.

Waste is exclusive: each kernel's below-baseline device time, plus the step's idle gaps (host gaps in its
window). Kernels are grouped by (kernel name, launching op name, module pattern), where the pattern drops
layer and instance numbers (``ViTLayer_3`` -> ``ViTLayer_*``, ``layers.3`` -> ``layers.*``), so the same
softmax in twelve layers is one row: "12 calls in 12 layers". Rows are kernel groups or the idle row,
never a span and its ancestor, so they add up: their waste sums to at most the step's device-seconds.
The step span, the terminal summary and the HTML report all read the same list (``plasmient.culprits``).
"""

from __future__ import annotations

import re
from typing import Any, Iterable, NamedTuple

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from .. import conventions as cv
from ..metrics.compute import BOUND_CODE, BOUND_EVIDENCE_COVERAGE
from ..metrics.culprit import suggestion
from ..records import GRAPH_LAUNCH_NAMES
from .inputs import CULPRIT_CARRY, KINDS, DeviceSpec
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


def _name_order(names: list[str], codes: np.ndarray) -> np.ndarray:
    """Per code (an index into ``names``, -1 for none), its name's place among the names the codes use,
    sorted (-1 for none); only those are sorted, not every name of the rank."""
    used = np.unique(codes[codes >= 0])
    place = np.full(len(names) + 1, -1, np.int64)  # [-1]: no name
    place[sorted(used.tolist(), key=names.__getitem__)] = np.arange(len(used))
    return place[codes]


def row_order(r: dict[str, Any]) -> tuple[float, str, str, str]:
    """How culprit rows are listed: most waste first, equal waste by kernel, op and module name."""
    return (-(r.get("wasted_s") or 0.0), r.get("kernel") or "", r.get("op") or "", r.get("module") or "")


def _names(arr: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, list[str]]:
    arr = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
    enc = arr.dictionary_encode()
    return enc.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64), [str(x) for x in enc.dictionary.to_pylist()]


class StepCulprits(NamedTuple):
    """Per step row, its culprit rows (most exclusive waste first, at most ``CULPRIT_CARRY``) and the most
    waste a row left out of them may hold: 0.0 where none was, NaN where the step's rows are unknown."""

    rows: list[list[dict[str, Any]]]
    left_out_s: list[float]


def step_culprits(tree: RankTree, j: JoinedRank, met: SpanMetrics, spec: DeviceSpec,
                  rows: int = CULPRIT_CARRY, wanted: np.ndarray | None = None) -> StepCulprits:
    """Per step row, its ``rows`` most wasteful culprit rows. Not cut to the display size (the step span's
    plasmient.culprits cuts them, :func:`culprit_columns`): the node and fleet spans sum them over ranks,
    and a row summed from lists cut before it would lose a rank's time. ``wanted`` (per step row) limits
    them to those steps, the others getting none (and an unknown left-out): a step sampled at step depth
    has no kernel FLOPs, and its culprits would be left out of its spans (``step_facts.NEEDS_KERNEL_FLOPS``)
    once ranked. ``spec``: the device: its type, and the precisions and peaks a compute-bound row's
    suggestion names."""
    device_type = spec.device_type
    out: list[list[dict[str, Any]]] = [[] for _ in range(tree.n_steps)]
    wanted = np.ones(tree.n_steps, bool) if wanted is None else np.asarray(wanted, bool)[:tree.n_steps]
    left_out = np.where(wanted, 0.0, np.nan)
    if not wanted.any():
        return StepCulprits(out, left_out.tolist())
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
        # most waste first; equal waste by name, not by the codes (the order names were met in), so a step
        # stitched alone or beside others lists and cuts its rows alike
        ties = [_name_order(names, groups[:, c]) for c, names in enumerate((all_k_names, op_names, pat_uniq), 1)]
        by = np.lexsort((ties[2], ties[1], ties[0], -g_waste, groups[:, 0]))
        # each step's `rows` most wasteful groups: rank within the step, in one pass
        group_step = groups[by, 0]
        starts = np.r_[0, np.nonzero(group_step[1:] != group_step[:-1])[0] + 1] if len(by) else np.zeros(0, np.int64)
        rank = np.arange(len(by)) - np.repeat(starts, np.diff(np.r_[starts, len(by)]))
        # a group that wasted nothing (every kernel at or above the baseline MFU) is no culprit
        positive = g_waste[by] > 0
        chosen = by[(rank < rows) & positive]
        # the most wasteful group each step leaves out: the first one past the cut
        past = by[(rank == rows) & positive]
        left_out[groups[past, 0]] = g_waste[past]
        reps = rep[chosen]
        bound_codes = kernel_bound[reps]
        unknown = np.flatnonzero(bound_codes == UNKNOWN_BOUND)
        missing = np.zeros(len(chosen), np.int64)
        if len(unknown):  # one call for every unknown-bound row, not one per row
            missing[unknown] = _missing_evidence(tree, j, met, alive[reps[unknown]], oname[reps[unknown]] >= 0, device_type)
        kinds = kind[reps]
        for gi, r, bound_code, kind_code, miss in zip(chosen.tolist(), reps.tolist(), bound_codes.tolist(),
                                                      kinds.tolist(), missing.tolist()):
            out[int(groups[gi, 0])].append({
                "kernel": all_k_names[groups[gi, 1]][:1024] if groups[gi, 1] >= 0 else None,
                "op": op_names[groups[gi, 2]] if groups[gi, 2] >= 0 else None,
                "module": str(pat_uniq[groups[gi, 3]]) if groups[gi, 3] >= 0 else None,
                "calls": int(g_calls[gi]), "layers": int(g_layers[gi]),
                "wasted_s": float(g_waste[gi]),
                "bound": cv.BOUNDS[bound_code] if bound_code >= 0 else None,
                "kind": KINDS[int(kind_code)],
                "missing": MISSING[int(miss)] if bound_code == UNKNOWN_BOUND else None,
                "precision": str(precision.names[precision.codes[kr[alive[r]]]]),
            })
    # the idle row: host gaps in the step's window
    step_spans = tree.base["step"] + np.arange(tree.n_steps)
    idle = tree.col("idle_s")[step_spans]
    util = met.util[step_spans]
    with np.errstate(divide="ignore", invalid="ignore"):
        host_share = (np.where(idle > 0, 1.0 - np.minimum(tree.overlap.idle_device_s, idle) / idle, np.nan)
                      if tree.overlap is not None else np.full(tree.n_steps, np.nan))
    idle_fraction = (1.0 - np.nan_to_num(np.asarray(util, np.float64), nan=1.0)).tolist()  # unknown util: no idle claimed
    host_shares = [None if h != h else h for h in np.asarray(host_share, np.float64).tolist()]
    # Steps repeat their rows: one suggestion text per distinct row, shared by every step (and summary) naming it.
    said: dict[tuple[Any, ...], str] = {}
    peak = spec.peak if spec.peak_for is not None else None
    for s, idle_s in enumerate(idle.tolist()):
        if idle_s > 0 and wanted[s]:
            out[s].append({"kernel": IDLE_LABEL, "op": None, "module": None, "calls": 0, "layers": 0,
                           "wasted_s": idle_s, "bound": "idle", "kind": None})
        out[s].sort(key=row_order)
        if len(out[s]) > rows:
            left_out[s] = max(left_out[s], out[s][rows]["wasted_s"])
            del out[s][rows:]
        for r in out[s]:
            idle_row = r["kernel"] == IDLE_LABEL
            key = (r["kernel"], r["op"], r["module"], r["bound"], r["kind"], r.pop("missing", None), r.pop("precision", None),
                   *((idle_fraction[s], host_shares[s]) if idle_row else ()))
            text = said.get(key)
            if text is None:
                text = said[key] = suggestion(None if idle_row else r["kernel"], r["op"], r["module"], r["bound"],
                                              r["kind"], idle_fraction[s], device_type=device_type, idle_row=idle_row,
                                              idle_host_share=host_shares[s], missing=key[5], precision=key[6],
                                              peak=peak, native=spec.native)
            r["suggestion"] = text
    return StepCulprits(out, left_out.tolist())


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


def merge_culprits(lists: Iterable[tuple[int, list[dict[str, Any]], float]],
                   rows: int | None = CULPRIT_CARRY) -> tuple[list[dict[str, Any]], float]:
    """Culprit rows of several lists (a node's or the fleet's ranks, the report's steps) summed by (kernel,
    op, module), most waste first, cut to ``rows`` only after the sums; and the most waste a row left out of
    the result may hold (NaN: unknown). Each list is (rank, rows, left_out_s): its rank (-1: unknown, a row
    naming one keeps it) and the most a row it left out may hold (0.0: none, NaN: unknown). The rank losing
    most to a row is named. A row is exact when every list that left rows out names it; else it is at least
    its sum and says so ("lower_bound": true), as does a row summed from one that says so."""
    # per row, in one list (no dict writes per input row: a 1,000-rank fleet sums 225,000 rows a step):
    # [first row, calls, layers, waste, worst waste, its rank, last list, cut lists naming it, their left-outs,
    #  may be short, some waste known, a suggestion]
    acc: dict[tuple[Any, Any, Any], list[Any]] = {}
    cut_lists, cut_total = 0, 0.0  # lists that left rows out (or may have), and the most those rows may hold, summed
    for n, (rank, items, left_out_s) in enumerate(lists):
        left = float("nan") if left_out_s is None else float(left_out_s)
        cut = left != 0.0  # NaN too: unknown whether rows were left out
        cut_lists += cut
        cut_total += left if cut else 0.0
        for r in items:
            get = r.get
            key = (get("kernel"), get("op"), get("module"))
            a = acc.get(key)
            if a is None:
                a = acc[key] = [r, 0, 0, 0.0, -1.0, None, -1, 0, 0.0, False, False, get("suggestion")]
            a[1] += get("calls") or 0
            layers = get("layers") or 0
            if layers > a[2]:
                a[2] = layers
            wasted = get("wasted_s")
            if wasted is None:  # unknown: summed as 0.0, and the sum may be short
                a[9] = True
                wasted = 0.0
            else:
                a[10] = True
            a[3] += wasted
            if get("lower_bound"):
                a[9] = True
            if not a[11]:
                a[11] = get("suggestion")
            if cut and a[6] != n:  # a list naming a row twice counts once
                a[7] += 1
                a[8] += left
            a[6] = n
            if wasted > a[4]:
                a[4] = wasted
                a[5] = rank if rank >= 0 else get("rank")
    out, upper = [], []  # upper: the most each row may hold (NaN: unknown)
    for first, calls, layers, wasted, _, worst_rank, _, cut_in, cut_in_s, short, known, said in acc.values():
        r = {k: v for k, v in first.items() if k != "lower_bound"}
        r.update(calls=int(calls), layers=int(layers), wasted_s=wasted if known else None)  # unknown, not 0
        if "suggestion" in r or said:
            r["suggestion"] = said
        r["rank"] = worst_rank
        missed = cut_in < cut_lists  # a list that left rows out does not name it
        if known and (short or missed):
            r["lower_bound"] = True
        upper.append(float("nan") if short else wasted + max(cut_total - cut_in_s, 0.0) if missed else wasted)
        out.append(r)
    order = sorted(range(len(out)), key=lambda i: row_order(out[i]))
    out, upper = [out[i] for i in order], [upper[i] for i in order]
    left_out = cut_total  # a row no list names holds at most what they all left out
    if rows is not None and len(out) > rows:
        cut_upper = upper[rows:]
        left_out = float("nan") if any(u != u for u in cut_upper) else max(left_out, *cut_upper)
        del out[rows:]
    return out, left_out


def cut_culprits(rows: list[dict[str, Any]], left_out_s: float, limit: int | None) -> tuple[list[dict[str, Any]], float]:
    """The first ``limit`` rows of a list (most waste first), and the most waste a row the cut list leaves
    out may hold: what the list left out, or the first row cut (NaN where a cut row is a lower bound)."""
    if limit is None or len(rows) <= limit:
        return rows, left_out_s
    if any(r.get("lower_bound") or r.get("wasted_s") is None for r in rows[limit:]):
        return rows[:limit], float("nan")
    return rows[:limit], max(left_out_s, float(rows[limit]["wasted_s"]))


def culprit_columns(n: int, lists: dict[int, list[dict[str, Any]]], left_out: dict[int, float],
                    limit: int | None = None) -> dict[str, pa.Array]:
    """plasmient.culprits (JSON rows, cut to ``limit``), plasmient.culprits.left_out_s (the most a row the
    list leaves out may hold) and the plasmient.culprit.* attributes of the first row, for the n spans of a
    table of which `lists` (row -> culprit rows) and `left_out` (row -> what those rows leave out) name the
    few that carry them."""
    have = sorted(i for i, items in lists.items() if items)
    rows = np.array(have, np.int64)
    out: dict[str, pa.Array] = {}
    for k in ("kernel", "op", "module", "rank", "wasted_s", "bound", "suggestion"):
        typ = cv.ATTRIBUTE_BY_NAME[f"plasmient.culprit.{k}"].type
        out[f"plasmient.culprit.{k}"] = cv.scatter_rows(pa.array([lists[i][0].get(k) for i in have], typ), rows, n)
    texts_of: dict[int, tuple[str, float]] = {}  # rows shared by several spans (a fleet and its one node) printed once
    texts, left = [], []
    for i in have:
        done = texts_of.get(id(lists[i]))
        if done is None:
            shown, rest = cut_culprits(lists[i], left_out.get(i, float("nan")), limit)
            done = texts_of[id(lists[i])] = (orjson.dumps(shown, option=orjson.OPT_SERIALIZE_NUMPY).decode(), rest)
        texts.append(done[0])
        left.append(done[1])
    out["plasmient.culprits"] = cv.scatter_rows(pa.array(texts, pa.string()), rows, n)
    out["plasmient.culprits.left_out_s"] = cv.scatter_rows(pa.array(left, pa.float64(), from_pandas=True), rows, n)
    return out
