"""The joins of DESIGN.md for one process: kernel -> launch -> op -> module -> step, all vectorised.

1. kernel -> launch: same correlation id (exact; a CUDA-graph launch owns many kernels).
2. launch -> op: the op whose External id the launch carries, accepted only when that op is on the
   launching thread and active at the launch (some exporters write the correlation id into the
   External id field); otherwise the innermost op on the launching thread containing the launch.
3. op -> module: innermost nn.Module interval on the op's thread (root ops; nested ops follow their
   parent op). A forward op whose innermost module started inside its parent op (a ``record_function``
   scope such as ``DistributedDataParallel.forward`` or a user's ``"forward"`` annotation around the
   model's modules) is a root of that module instead: the scope stays an op span beside the modules, and
   the model's ops keep their layers; a backward root inside such a scope (around ``loss.backward()``) is
   mapped as below and leaves the scope when it maps. Backward ops map to the module of the forward op with the same autograd sequence
   number, under a synthesized backward module span (the forward span ended long before). A gradient's
   accumulation (AccumulateGrad, no sequence number) goes with the backward root that ran just before it
   on its thread, the node that produced the gradient, so it lands in the module owning the parameter.
4. everything -> step by time; kernels take the step of the op that launched them (with no launch record: of
   their start, but no later than the next launched kernel's on their stream). Ops of a thread unrelated
   to the steps' (no step, module, backward op or collective on it: a user's background thread) belong to
   no step; each step counts those that ran inside it, and their kernels stay in it without an op.
Kernel timestamps are shifted per device so that no kernel starts before its launch (stitch.clock).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..metrics.grouping import match_distinct
from ..records import RecordSet, collective_op_names
from .nesting import any_ancestor_of, innermost_enclosing, innermost_enclosing_points, tree_depth, tree_root

# Tolerance for "the op is active at the launch": Kineto rounds to 1 ns (new) or 1 µs (old files).
_ACTIVE_SLACK_NS = 1_000
_MAX_MODULE_PATH = 1024


def _no_later_than_next_on_stream(by_time: np.ndarray, rows: np.ndarray, kernel_step: np.ndarray,
                                  device: np.ndarray, stream: np.ndarray, start: np.ndarray) -> np.ndarray:
    """Steps for kernels with no launch record (``rows``), placed by their own start time (``by_time``), capped
    at the step of the next kernel on the same stream whose step is known: a stream runs its kernels in launch
    order, so a kernel that ran before another was launched no later. The device can run tens of ms behind the
    host, and kernels launched before the capture began then run inside a later step's CPU range (mi300x: 185
    kernels from before ProfilerStep#15 fell into #16 by time). Step rows are in time order."""
    order = np.lexsort((-start, stream, device))            # each stream from its last kernel backwards
    known = kernel_step[order] >= 0
    nearest = np.maximum.accumulate(np.where(known, np.arange(len(order)), -1))
    nxt = np.full(len(order), -1, np.int64)
    has = nearest >= 0
    later = order[nearest[has]]
    same = (device[order[has]] == device[later]) & (stream[order[has]] == stream[later])
    nxt[order[has][same]] = kernel_step[later[same]]
    cap = nxt[rows]
    return np.where((cap >= 0) & (by_time > cap), cap, by_time)  # a kernel outside every step stays outside


def _np(table: pa.Table, column: str, fill: int = -1) -> np.ndarray:
    col = table.column(column)
    if col.null_count:
        col = pc.fill_null(col, fill)
    return col.to_numpy().astype(np.int64, copy=False)


def _op_threads(ops: pa.Table) -> np.ndarray:
    return _np(ops, "pid") * (1 << 32) + (_np(ops, "tid") & 0xFFFFFFFF)


def op_parents(ops: pa.Table) -> np.ndarray:
    """Each op's innermost enclosing op on its own thread (-1: a root). Ops nest on their thread only."""
    return innermost_enclosing(_op_threads(ops), _np(ops, "start_ns"), _np(ops, "end_ns"))[0]


def _lookup(sorted_keys: np.ndarray, sorted_pos: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """Index of each query in a sorted key array (via sorted_pos), -1 where absent."""
    if len(sorted_keys) == 0:
        return np.full(len(queries), -1, np.int64)
    k = np.searchsorted(sorted_keys, queries)
    k = np.minimum(k, len(sorted_keys) - 1)
    hit = sorted_keys[k] == queries
    return np.where(hit, sorted_pos[k], -1)


@dataclass
class JoinStats:
    kernels: int = 0
    kernels_with_launch: int = 0
    launches_by_external_id: int = 0
    launches_by_interval: int = 0
    kernels_with_op: int = 0
    kernels_by_external_id: int = 0
    ops_outside_steps: int = 0
    kernels_outside_steps: int = 0
    backward_ops_mapped: int = 0
    clock_offset_ns: dict[int, int] = field(default_factory=dict)
    kernels_clamped_to_launch: int = 0   # a kernel far before its launch, past the device's clock shift


# A device clock behind the host's puts its kernels before their launches: the device is shifted by the lag
# that at least this many of its kernels show (at least 3, or 1 in 1,000), so one corrupt timestamp cannot
# move every kernel of the device (one kernel 1 s early made a 4.4 ms step 1.004 s). Kernels still before
# their launch after the shift start at it (their duration kept) where they then still end within the
# device's recorded activity; those more than _CLAMP_TOLERANCE_NS before it are counted in
# plasmient.input.clamped_events, moved or not.
_SHIFT_SUPPORT = (3, 0.001)
_CLAMP_TOLERANCE_NS = 10_000


def _kernels_after_launches(k_start: np.ndarray, k_end: np.ndarray, k_dev: np.ndarray, kernel_launch: np.ndarray,
                            l_start: np.ndarray, stats: JoinStats) -> tuple[np.ndarray, np.ndarray]:
    joined = np.nonzero(kernel_launch >= 0)[0]
    launch = l_start[kernel_launch[joined]]
    lag = launch - k_start[joined]
    devs = k_dev[joined]
    if not (lag > 0).any():
        for dev in np.unique(devs):
            stats.clock_offset_ns[int(dev)] = 0
        return k_start, k_end
    k_start, k_end = k_start.copy(), k_end.copy()   # Arrow's buffers are read-only
    for dev in np.unique(devs):
        mine = devs == dev
        ordered = np.sort(lag[mine])
        support = min(len(ordered), max(_SHIFT_SUPPORT[0], int(np.ceil(_SHIFT_SUPPORT[1] * len(ordered)))))
        shift = int(max(0, ordered[-support]))
        stats.clock_offset_ns[int(dev)] = shift
        on_dev = k_dev == dev
        if shift:
            k_start[on_dev] += shift
            k_end[on_dev] += shift
        early = joined[mine][lag[mine] > shift]
        if len(early):
            moved = l_start[kernel_launch[early]] - k_start[early]
            # Either timestamp may be the corrupt one: a launch recorded 1 s late would drag its kernel past
            # everything the device ran (a 4.4 ms step read 1 s). A kernel is moved only where it still ends
            # within the device's recorded activity; otherwise it stays as recorded. Either way it is counted.
            fits = k_end[early] + moved <= k_end[on_dev].max()
            k_end[early[fits]] += moved[fits]
            k_start[early[fits]] += moved[fits]
            stats.kernels_clamped_to_launch += int((moved > _CLAMP_TOLERANCE_NS).sum())
    return k_start, k_end


@dataclass
class RowOrigin:
    """Where a chunk's rows came from (``stitch.chunks``): the whole rank's row of each module, op and kernel
    (None: the rows are the rank's own) and its first step's row, so a chunk's span ids are the rank's."""

    first_step: int = 0
    module: np.ndarray | None = None
    op: np.ndarray | None = None
    kernel: np.ndarray | None = None   # real kernels, then synthetic ones numbered after the rank's real kernels

    def of(self, kind: str, rows: np.ndarray) -> np.ndarray:
        mapping = getattr(self, kind)
        return rows if mapping is None else mapping[rows]


@dataclass
class JoinedRank:
    """Join results for one RecordSet; every *_idx array indexes the matching record table."""

    records: RecordSet
    steps: np.ndarray          # step numbers, one per step row
    step_start: np.ndarray
    step_end: np.ndarray
    op_parent: np.ndarray      # op -> parent op (-1)
    op_module: np.ndarray      # op -> module row (-1); forward rows < n_modules, backward rows >= n_modules
    op_step: np.ndarray        # op -> step row (-1: outside every step)
    module_parent: np.ndarray  # module row -> parent module row (-1), over forward + backward rows
    module_step: np.ndarray
    module_path: list[str]
    module_phase: list[str]
    module_start: np.ndarray   # own interval (backward rows: empty, filled by the tree from children)
    module_end: np.ndarray
    kernel_start: np.ndarray   # mapped onto the CPU clock
    kernel_end: np.ndarray
    kernel_launch: np.ndarray  # kernel -> launch row (-1)
    kernel_op: np.ndarray      # kernel -> launching op (-1)
    kernel_step: np.ndarray    # kernel -> step row (-1)
    stats: JoinStats
    origin: RowOrigin = field(default_factory=RowOrigin)
    # per step row: ops of threads unrelated to the step's that ran inside it (None: the steps name no thread)
    step_ops_other_threads: np.ndarray | None = None


def join_rank(records: RecordSet) -> JoinedRank:
    stats = JoinStats()
    ops, launches, kernels, modules = records.ops, records.launches, records.kernels, records.modules
    o_start, o_end = _np(ops, "start_ns"), _np(ops, "end_ns")
    o_ext = _np(ops, "external_id")
    o_thread = _op_threads(ops)

    op_parent = op_parents(ops)

    # ---- steps
    steps_t = records.steps
    if steps_t.num_rows:
        order = np.argsort(_np(steps_t, "start_ns"), kind="stable")
        steps = _np(steps_t, "step")[order]
        step_start = _np(steps_t, "start_ns")[order]
        step_end = _np(steps_t, "end_ns")[order]
    else:
        starts = [a for a in (o_start, _np(kernels, "start_ns"), _np(launches, "start_ns")) if len(a)]
        ends = [a for a in (o_end, _np(kernels, "end_ns"), _np(launches, "end_ns")) if len(a)]
        lo = int(min(a.min() for a in starts)) if starts else 0
        hi = int(max(a.max() for a in ends)) if ends else lo + 1
        steps, step_start, step_end = np.array([0]), np.array([lo]), np.array([max(hi, lo + 1)])
    # Steps are disjoint in time; any thread's event belongs to the step containing its start.
    no_group = np.zeros(len(steps), np.int64)

    # Disjoint steps in time order (the usual case): one search per time instead of the general nesting sort.
    disjoint = bool(np.all(step_start[1:] >= np.maximum(step_end[:-1], step_start[:-1] + 1)))

    def to_step(times: np.ndarray) -> np.ndarray:
        if disjoint:
            # half-open [start, end), a zero-length step 1 ns long, as innermost_enclosing defines them
            idx = np.searchsorted(step_start, times, side="right") - 1
            inside = (idx >= 0) & (times < np.maximum(step_end, step_start + 1)[np.maximum(idx, 0)])
            return np.where(inside, idx, -1)
        idx = innermost_enclosing_points(no_group, step_start, step_end, np.zeros(len(times), np.int64), times)
        return idx

    op_step = to_step(o_start)
    stats.ops_outside_steps = int((op_step < 0).sum())

    # ---- modules: nesting, path, step
    n_mod = modules.num_rows
    m_start, m_end = _np(modules, "start_ns"), _np(modules, "end_ns")
    m_thread = _np(modules, "pid") * (1 << 32) + (_np(modules, "tid") & 0xFFFFFFFF)
    m_parent, _ = innermost_enclosing(m_thread, m_start, m_end)
    m_names = modules.column("name").to_pylist()
    m_path = _module_paths(m_names, m_parent)
    m_step = to_step(m_start)

    fwd_tid = _np(ops, "fwd_thread_id", fill=0)
    seq = _np(ops, "sequence_number")
    names = ops.column("name")
    is_bwd_name = pc.starts_with(names, "autograd::engine::evaluate_function").to_numpy(zero_copy_only=False) if len(o_start) else np.zeros(0, bool)
    is_backward = (fwd_tid > 0) | is_bwd_name

    # ---- ops of threads unrelated to the steps' (a user's background thread): in no step, counted per step
    unrelated = _ops_of_unrelated_threads(records, o_thread, is_backward, m_thread, seq)
    step_ops_other_threads = None
    if unrelated is not None:
        unrelated &= op_step >= 0
        step_ops_other_threads = np.bincount(op_step[unrelated], minlength=len(steps))
        op_step = np.where(unrelated, -1, op_step)

    # ---- op -> module (root ops only), forward
    op_module = np.full(len(o_start), -1, np.int64)
    if n_mod and len(o_start):
        # op_parent is this function's own array (op_parents above): edited in place
        op_parent[_ops_in_modules_inside_their_parent(op_parent, o_thread, o_start, o_end, is_backward, m_thread,
                                                      m_start, m_end)] = -1
    roots = np.nonzero(op_parent < 0)[0]
    if n_mod and len(roots):
        root_mod = innermost_enclosing_points(m_thread, m_start, m_end, o_thread[roots], o_start[roots])
        op_module[roots] = root_mod

    # ---- backward ops -> forward module via the autograd sequence number
    bwd_parent = np.full(0, -1, np.int64)
    bwd_rows = np.zeros(0, np.int64)
    if n_mod and len(o_start):
        # A backward root that a forward scope holds (a record_function around loss.backward(), which runs the
        # engine on the calling thread) is mapped as a root too; op_parent gives it up only if it maps.
        bparent = _without_scoped_backward_roots(op_parent, is_backward)
        fwd_with_seq = np.nonzero(~is_backward & (seq >= 0))[0]
        # The forward op's module: its root op's module.
        root_of = tree_root(bparent)
        fwd_mod = op_module[root_of[fwd_with_seq]]
        keep = fwd_mod >= 0
        fwd_seq, fwd_mod = seq[fwd_with_seq][keep], fwd_mod[keep]
        # Innermost wins on duplicate sequence numbers: take the deepest module.
        if len(fwd_seq):
            depth = tree_depth(m_parent)[fwd_mod]
            order = np.lexsort((-depth, fwd_seq))
            fwd_seq, fwd_mod = fwd_seq[order], fwd_mod[order]
            first = np.concatenate([[True], fwd_seq[1:] != fwd_seq[:-1]])
            fwd_seq, fwd_mod = fwd_seq[first], fwd_mod[first]
            # Kineto and RecordFunction put the sequence number on the autograd node's op
            # ('MmBackward0'), inside an 'autograd::engine::evaluate_function' root that has none:
            # a backward root takes the sequence number of its outermost node op.
            root_seq = np.where(bparent < 0, seq, -1)
            nodes = np.nonzero((fwd_tid > 0) & (seq >= 0) & (bparent >= 0))[0]
            if len(nodes):
                nodes = nodes[np.argsort(tree_depth(bparent)[nodes], kind="stable")[::-1]]
                roots_of_nodes = root_of[nodes]
                unset = root_seq[roots_of_nodes] < 0
                # Fancy assignment keeps the last write: deepest first, so the outermost node wins.
                root_seq[roots_of_nodes[unset]] = seq[nodes[unset]]
            bwd_roots = np.nonzero(is_backward & (bparent < 0) & (root_seq >= 0))[0]
            target = _lookup(fwd_seq, fwd_mod, root_seq[bwd_roots])
            same_step = target >= 0
            same_step[same_step] = m_step[target[same_step]] == op_step[bwd_roots[same_step]]
            hit_ops, hit_mod = bwd_roots[same_step], target[same_step]
            grads_ops, grads_mod = _accumulate_grad_owners(names, is_backward & (bparent < 0), root_seq, o_thread,
                                                           o_start, op_step, hit_ops, hit_mod)
            hit_ops, hit_mod = np.concatenate([hit_ops, grads_ops]), np.concatenate([hit_mod, grads_mod])
            stats.backward_ops_mapped = len(hit_ops)
            if len(hit_ops):
                # A backward span for each module on the mapped modules' ancestor chains.
                needed = np.zeros(n_mod, bool)
                cur = np.unique(hit_mod)
                while len(cur):
                    needed[cur] = True
                    cur = m_parent[cur]
                    cur = np.unique(cur[(cur >= 0)])
                    cur = cur[~needed[cur]]
                bwd_rows = np.nonzero(needed)[0]
                bwd_index = np.full(n_mod, -1, np.int64)
                bwd_index[bwd_rows] = n_mod + np.arange(len(bwd_rows))
                par = m_parent[bwd_rows]
                bwd_parent = np.where(par >= 0, bwd_index[np.maximum(par, 0)], -1)
                op_module[hit_ops] = bwd_index[hit_mod]
                op_parent[hit_ops] = -1  # mapped backward roots leave a forward scope that held them

    module_parent = np.concatenate([m_parent, bwd_parent])
    module_step = np.concatenate([m_step, m_step[bwd_rows]])
    module_path = m_path + [m_path[r] for r in bwd_rows]
    module_phase = ["forward"] * n_mod + ["backward"] * len(bwd_rows)
    # Backward spans have no interval of their own: the tree widens them around their children.
    big = np.iinfo(np.int64).max
    module_start = np.concatenate([m_start, np.full(len(bwd_rows), big, np.int64)])
    module_end = np.concatenate([m_end, np.full(len(bwd_rows), -big, np.int64)])

    # ---- launch -> op
    n_l = launches.num_rows
    l_start, l_tid, l_pid = _np(launches, "start_ns"), _np(launches, "tid"), _np(launches, "pid")
    l_thread = l_pid * (1 << 32) + (l_tid & 0xFFFFFFFF)
    l_ext = _np(launches, "external_id")
    launch_op = np.full(n_l, -1, np.int64)
    # ops by External id, sorted once: launches and launch-less kernels both look up here
    ext_rows = np.nonzero(o_ext >= 0)[0]
    ext_rows = ext_rows[np.argsort(o_ext[ext_rows], kind="stable")]
    ext_keys = o_ext[ext_rows]
    if n_l and len(o_start):
        cand = _lookup(ext_keys, ext_rows, l_ext)
        ok = cand >= 0
        c = np.maximum(cand, 0)
        ok &= o_thread[c] == l_thread
        if not records.source.startswith("live:"):
            # Files may carry the correlation id in the External id field; a live capture pushed the
            # id itself, so there it is exact even when the CUPTI and host clocks differ by microseconds.
            ok &= (o_start[c] <= l_start + _ACTIVE_SLACK_NS) & (l_start <= o_end[c] + _ACTIVE_SLACK_NS)
        launch_op[ok] = cand[ok]
        stats.launches_by_external_id = int(ok.sum())
        rest = np.nonzero(~ok)[0]
        if len(rest):
            inner = innermost_enclosing_points(o_thread, o_start, o_end, l_thread[rest], l_start[rest])
            launch_op[rest] = inner
            stats.launches_by_interval = int((inner >= 0).sum())

    # ---- kernel -> launch
    n_k = kernels.num_rows
    k_corr = _np(kernels, "correlation_id")
    k_start, k_end = _np(kernels, "start_ns"), _np(kernels, "end_ns")
    k_dev = _np(kernels, "device")
    kernel_launch = np.full(n_k, -1, np.int64)
    if n_k and n_l:
        l_corr = _np(launches, "correlation_id")
        l_order = np.argsort(l_corr, kind="stable")
        kernel_launch = _lookup(l_corr[l_order], l_order, np.where(k_corr >= 0, k_corr, -2))
    # A trace with kernels but no recorded launches at all (runtime events filtered out) has nothing to index.
    kernel_op = (np.where(kernel_launch >= 0, launch_op[np.maximum(kernel_launch, 0)], -1) if n_l
                 else np.full(n_k, -1, np.int64))
    if n_k and len(o_start):
        # No recorded launch (trimmed trace, launch before the capture): the External id Kineto copied
        # onto the activity itself still names the op exactly.
        k_ext = _np(kernels, "external_id")
        orphan = np.nonzero((kernel_op < 0) & (k_ext >= 0))[0]
        if len(orphan):
            found = _lookup(ext_keys, ext_rows, k_ext[orphan])
            kernel_op[orphan] = found
            stats.kernels_by_external_id = int((found >= 0).sum())
    if unrelated is not None and n_k and unrelated.any():
        # an unrelated thread's kernels are its work, not a step op's: they stay in the step's device time
        # (the device was busy), by their launch, with no op
        of_unrelated = (kernel_op >= 0) & unrelated[np.maximum(kernel_op, 0)]
        kernel_op = np.where(of_unrelated, -1, kernel_op)
    stats.kernels = n_k
    stats.kernels_with_launch = int((kernel_launch >= 0).sum())
    stats.kernels_with_op = int((kernel_op >= 0).sum())

    # ---- clock: no kernel before its launch
    if n_k and stats.kernels_with_launch:
        k_start, k_end = _kernels_after_launches(k_start, k_end, k_dev, kernel_launch, l_start, stats)

    # ---- kernel -> step: the launching op's step, else the launch's, else the kernel's own time
    if n_k:
        kernel_step = np.where(kernel_op >= 0, op_step[np.maximum(kernel_op, 0)], -1) if len(o_start) else np.full(n_k, -1)
        need = kernel_step < 0
        has_launch = need & (kernel_launch >= 0)
        if has_launch.any():
            kernel_step[has_launch] = to_step(l_start[kernel_launch[has_launch]])
        need = kernel_step < 0
        if need.any():
            by_time = to_step(k_start[need])
            # one that started before every step and ran into one is that step's: it held the device there
            before = by_time < 0
            if before.any():
                late = np.nonzero(need)[0][before]
                by_time[before] = to_step(np.maximum(k_end[late] - 1, k_start[late]))
            kernel_step[need] = _no_later_than_next_on_stream(
                by_time, np.nonzero(need)[0], kernel_step, k_dev, _np(kernels, "stream"), k_start)
        stats.kernels_outside_steps = int((kernel_step < 0).sum())
    else:
        kernel_step = np.zeros(0, np.int64)

    return JoinedRank(
        records=records, steps=steps, step_start=step_start, step_end=step_end,
        op_parent=op_parent, op_module=op_module, op_step=op_step,
        module_parent=module_parent, module_step=module_step, module_path=module_path,
        module_phase=module_phase, module_start=module_start, module_end=module_end,
        kernel_start=k_start, kernel_end=k_end, kernel_launch=kernel_launch, kernel_op=kernel_op,
        kernel_step=kernel_step, stats=stats, step_ops_other_threads=step_ops_other_threads,
    )


def _ops_of_unrelated_threads(records: RecordSet, o_thread: np.ndarray, is_backward: np.ndarray,
                              m_thread: np.ndarray, seq: np.ndarray) -> np.ndarray | None:
    """Per op: does it run on a thread unrelated to the steps? Related are the threads that ran a step
    (ProfilerStep's, the training loop's), an nn.Module call or a forward op whose autograd node a backward
    op ran (DataParallel's replicas, with or without module events), a backward op (the autograd engine's
    device threads) or a collective (a backend's worker). torch's FlopCounterMode counts the same: the
    step's thread and the autograd engine it drives. None where the steps name no thread (synthetic steps,
    older records) or one that ran no op: nothing to tell them apart by."""
    steps = records.steps
    if not steps.num_rows or "tid" not in steps.column_names or not len(o_thread):
        return None
    known = pc.and_(pc.is_valid(steps.column("pid")), pc.is_valid(steps.column("tid")))
    if not pc.any(known).as_py():
        return None
    known_steps = steps.filter(known)
    step_thread = _np(known_steps, "pid") * (1 << 32) + (_np(known_steps, "tid") & 0xFFFFFFFF)
    if not np.isin(step_thread, o_thread).any():
        return None  # the steps' ids are not the ops' (a trace whose ProfilerStep has a pid of its own)
    unrelated = ~np.isin(o_thread, np.concatenate([step_thread, m_thread, o_thread[is_backward]]))
    if unrelated.any():
        # sequence numbers count per thread, so another thread's may collide: that errs towards keeping its ops
        backprop = np.unique(seq[is_backward & (seq >= 0)])
        fed_backward = unrelated & ~is_backward & (seq >= 0) & np.isin(seq, backprop)
        unrelated &= ~np.isin(o_thread, o_thread[fed_backward])
    if unrelated.any():
        rows = np.nonzero(unrelated)[0]
        collective = match_distinct(records.ops.column("name").take(rows), collective_op_names)
        unrelated &= ~np.isin(o_thread, o_thread[rows[collective]])
    return unrelated


def _without_scoped_backward_roots(op_parent: np.ndarray, is_backward: np.ndarray) -> np.ndarray:
    """``op_parent`` with every outermost backward op made a root: one whose parent is a forward op and that has
    no backward op above it."""
    cand = np.nonzero(is_backward & (op_parent >= 0))[0]
    cand = cand[~is_backward[op_parent[cand]]]  # most have a backward parent: dropped before any walk
    cand = cand[~any_ancestor_of(cand, op_parent, is_backward)]
    if not len(cand):
        return op_parent
    out = op_parent.copy()
    out[cand] = -1
    return out


def _ops_in_modules_inside_their_parent(op_parent: np.ndarray, o_thread: np.ndarray, o_start: np.ndarray,
                                        o_end: np.ndarray, is_backward: np.ndarray, m_thread: np.ndarray,
                                        m_start: np.ndarray, m_end: np.ndarray) -> np.ndarray:
    """Forward ops whose innermost module on their thread lies inside their parent op: a scope op that wraps
    module calls (``DistributedDataParallel.forward``, a ``record_function`` around the forward pass). Such an
    op belongs to that module, not to the scope; following the scope would hand every op of the model to
    the module around the scope. Backward work is left alone: modules inside a backward op are
    activation-checkpointing recompute (``stitch.recompute``), which hangs them under that op."""
    # Only an op with a module starting inside it can be such a scope: the few innermost ops around module starts.
    holder = innermost_enclosing_points(o_thread, o_start, o_end, m_thread, m_start)
    scopes = np.unique(holder[holder >= 0])
    # a scope in a backward node holds recompute modules
    scopes = scopes[~(is_backward[scopes] | any_ancestor_of(scopes, op_parent, is_backward))]
    child = np.nonzero(np.isin(op_parent, scopes) & ~is_backward)[0] if len(scopes) else np.zeros(0, np.int64)
    if not len(child):
        return child
    module = innermost_enclosing_points(m_thread, m_start, m_end, o_thread[child], o_start[child])
    child, module = child[module >= 0], module[module >= 0]
    p = op_parent[child]
    ms, me, ps, pe = m_start[module], m_end[module], o_start[p], o_end[p]
    # strictly inside: a module and its scope over the same instants are ambiguous, and stay as recorded
    inside = (ms >= ps) & (me <= pe) & ((ms > ps) | (me < pe))
    return child[inside]


def _module_paths(names: list[str], parent: np.ndarray) -> list[str]:
    """Dotted path from the outermost module; module events are few (one per forward call)."""
    paths: list[str] = [""] * len(names)
    order = np.argsort(tree_depth(parent), kind="stable")
    for i in order:
        p = parent[i]
        path = names[i] if p < 0 else f"{paths[p]}.{names[i]}"
        # Real paths are a few hundred characters; a hostile file nesting 32k modules would otherwise
        # build quadratic gigabytes of path text. Keep the innermost end, marked as cut.
        paths[i] = path if len(path) <= _MAX_MODULE_PATH else "…" + path[-(_MAX_MODULE_PATH - 1):]
    return paths


def _accumulate_grad_owners(names, backward_root: np.ndarray, root_seq: np.ndarray, thread: np.ndarray,
                            start: np.ndarray, step: np.ndarray, mapped_ops: np.ndarray,
                            mapped_mod: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Backward roots that accumulate a parameter's gradient (``evaluate_function: AccumulateGrad``, no
    sequence number) -> the module of the backward root that ran just before them on their thread.

    The autograd engine runs a ready AccumulateGrad node before any other (its sequence number is the
    largest), so it runs right after the node that produced its gradient: ConvolutionBackward0 of a conv's
    weight, CudnnBatchNormBackward0 of a batch norm's weight and bias. That producer's forward op lies in the
    module that owns the parameter. Only a producer mapped to a module in the same step is followed."""
    rows = np.nonzero(backward_root)[0]
    if not len(rows) or not len(mapped_ops):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    grads = pc.match_substring(names.take(rows), "AccumulateGrad").fill_null(False).to_numpy(zero_copy_only=False)
    grads &= root_seq[rows] < 0
    if not grads.any():
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    order = np.lexsort((start[rows], thread[rows]))
    rows, grads = rows[order], grads[order]
    # the latest producer (a root that is not an AccumulateGrad) at or before each root, on its own thread
    pos = np.arange(len(rows))
    new_thread = np.ones(len(rows), bool)
    new_thread[1:] = thread[rows][1:] != thread[rows][:-1]
    last = np.maximum.accumulate(np.where(~grads, pos, -1))
    thread_first = np.maximum.accumulate(np.where(new_thread, pos, 0))
    producer = np.where((last >= thread_first) & grads, last, -1)
    module_of = np.full(len(step), -1, np.int64)
    module_of[mapped_ops] = mapped_mod
    ok = producer >= 0
    owner = np.full(len(rows), -1, np.int64)
    owner[ok] = module_of[rows[producer[ok]]]
    ok &= owner >= 0
    ok[ok] = step[rows[producer[ok]]] == step[rows[ok]]
    return rows[ok], owner[ok]
