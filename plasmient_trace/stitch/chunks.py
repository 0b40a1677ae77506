"""Cutting one joined rank into chunks of whole steps, so the span tree, its metrics and its span table are
built for a few steps at a time and memory is bounded by a chunk, not by the trace.

Everything a step's spans need lies inside the step (its modules, ops and kernels, their launches), except
the device timeline (``stitch.timeline``), which is measured over the whole rank first and sliced here.
A chunk is a RankInput, JoinedRank and DeviceTimeline of its own, with row numbers renumbered from 0; the
rows it came from travel with it (``JoinedRank.origin``) so span ids are those of the whole rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ..conventions import rows_of
from ..metrics.grouping import unique_inverse
from .inputs import RankInput, default_chunk_rows
from .joins import JoinedRank, RowOrigin
from .overlap import StepOverlap
from .timeline import DeviceTimeline


# Spans every step has whatever it holds: on each rank its step span and that rank's span under the node,
# and once per step the fleet and node spans. A trace of many tiny steps is mostly these.
STEP_SPANS_PER_RANK = 2
STEP_SPANS_SHARED = 2


def rows_per_step(j: JoinedRank, tl: DeviceTimeline) -> np.ndarray:
    """Modules + ops + kernels of each step row, plus the step's own spans on this rank."""
    n_steps = len(j.steps)
    rows = np.full(n_steps, STEP_SPANS_PER_RANK, np.int64)
    for step in (j.module_step, j.op_step, tl.step):
        rows += np.bincount(step[step >= 0], minlength=n_steps)[:n_steps]
    return rows


def _cut(rows: np.ndarray, max_rows: int) -> list[tuple[int, int]]:
    """Consecutive [a, b) ranges of at most ``max_rows`` summed rows each (one item at least)."""
    if len(rows) <= 1 or rows.sum() <= max_rows:
        return [(0, len(rows))]
    chunks, a, held = [], 0, 0
    for i, r in enumerate(rows.tolist()):
        if i > a and held + r > max_rows:
            chunks.append((a, i))
            a, held = i, 0
        held += r
    chunks.append((a, len(rows)))
    return chunks


def step_groups(ranks: list[tuple[JoinedRank, DeviceTimeline]], max_rows: int | None) -> list[list[tuple[int, int]]]:
    """Groups of step numbers, as each rank's [s0, s1) step rows, holding at most ``max_rows`` rows (records
    and the spans every step has) over all ranks (one step at least; None: ``default_chunk_rows`` of the
    total). A step is whole in one group on every rank, so each trace is built at once with its fleet and
    node spans. Step numbers out of time order on a rank: one group."""
    whole = [[(0, len(j.steps)) for j, _ in ranks]]
    numbers = [np.asarray(j.steps, np.int64) for j, _ in ranks]
    if any(len(n) > 1 and not np.all(np.diff(n) > 0) for n in numbers):
        return whole
    every = np.unique(np.concatenate(numbers)) if numbers else np.zeros(0, np.int64)
    rows = np.full(len(every), STEP_SPANS_SHARED, np.int64)
    for (j, tl), n in zip(ranks, numbers):
        rows[np.searchsorted(every, n)] += rows_per_step(j, tl)
    groups = _cut(rows, default_chunk_rows(int(rows.sum())) if max_rows is None else max_rows)
    if len(groups) == 1:
        return whole
    return [[(int(np.searchsorted(n, every[a])), int(np.searchsorted(n, every[b - 1], side="right"))) for n in numbers]
            for a, b in groups]


def _renumber(old: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """Old row numbers (-1 none) -> their position in ``kept`` (sorted), -1 where not kept. A chunk's rows
    lie in a narrow range of the rank's (records are in time order), so a table over that range answers it;
    rows spread over the whole rank are binary-searched instead. Either way a chunk costs its own size."""
    if not len(kept):
        return np.full(len(old), -1, np.int64)
    lo, hi = int(kept[0]), int(kept[-1])
    if hi - lo < 4 * len(kept) + 1024:
        table = np.full(hi - lo + 2, -1, np.int64)  # the last slot (-1) answers every row outside [lo, hi]
        table[kept - lo] = np.arange(len(kept))
        at = old - lo
        at[(at < 0) | (at > hi - lo)] = hi - lo + 1
        return table[at]
    pos = np.searchsorted(kept, old)
    hit = kept[np.minimum(pos, len(kept) - 1)] == old
    return np.where(hit & (old >= 0), pos, -1)


@dataclass(frozen=True)
class StepRows:
    """Each record kind's rows grouped by step row, built once per rank, so a chunk finds its rows with two
    binary searches instead of a pass over the whole rank (which made many small chunks quadratic)."""

    order: dict[str, np.ndarray]   # kind -> its rows, stably sorted by step row
    steps: dict[str, np.ndarray]   # kind -> the step row of each of those rows

    @classmethod
    def of(cls, j: JoinedRank) -> StepRows:
        order, steps = {}, {}
        for kind, step in (("module", j.module_step), ("op", j.op_step), ("kernel", j.kernel_step)):
            order[kind] = np.argsort(step, kind="stable")
            steps[kind] = step[order[kind]]
        return cls(order=order, steps=steps)

    def within(self, kind: str, s0: int, s1: int) -> np.ndarray:
        """The rows of ``kind`` in steps [s0, s1), ascending."""
        a, b = np.searchsorted(self.steps[kind], [s0, s1])
        rows = self.order[kind][a:b]
        return rows if len(rows) < 2 or bool(np.all(rows[1:] > rows[:-1])) else np.sort(rows)


def slice_rank(inp: RankInput, j: JoinedRank, tl: DeviceTimeline, s0: int, s1: int,
               index: StepRows) -> tuple[RankInput, JoinedRank, DeviceTimeline]:
    """The chunk of steps [s0, s1): its records, joins and device timeline, rows renumbered from 0.
    ``index``: the rank's :class:`StepRows`, built once for all its chunks."""
    rs = inp.records
    n_fwd = rs.modules.num_rows
    n_k = len(j.kernel_start)
    mods, ops, kernels = (index.within(kind, s0, s1) for kind in ("module", "op", "kernel"))
    fwd = mods[mods < n_fwd]
    synth = np.nonzero(np.isin(tl.synth_ops, ops))[0]
    launches = unique_inverse(j.kernel_launch[kernels])[0]  # one pass: kernels in launch order ascend
    launches = launches[launches >= 0]
    step_order = np.argsort(rs.steps.column("start_ns").to_numpy(), kind="stable") if rs.steps.num_rows else None

    # In a time-ordered trace a group's records are a few ascending runs (ops between steps fall out):
    # rows_of slices them, so only the columns the stitch reads are ever copied.
    records = dataclasses.replace(
        rs, kernels=rows_of(rs.kernels, kernels), launches=rows_of(rs.launches, launches), ops=rows_of(rs.ops, ops),
        modules=rows_of(rs.modules, fwd), steps=rows_of(rs.steps, step_order[s0:s1]) if step_order is not None else rs.steps,
    )
    part = RankInput(records=records, spec=inp.spec, op_flops=inp.op_flops[ops], op_bytes=inp.op_bytes[ops],
                     op_dtype=inp.op_dtype[ops], op_model=inp.op_model[ops])

    def module_rows(old: np.ndarray) -> np.ndarray:
        return _renumber(old, mods)

    def op_rows(old: np.ndarray) -> np.ndarray:
        return _renumber(old, ops)

    kernel_origin = np.concatenate([kernels, n_k + synth])
    joined = JoinedRank(
        records=records, steps=j.steps[s0:s1], step_start=j.step_start[s0:s1], step_end=j.step_end[s0:s1],
        op_parent=op_rows(j.op_parent[ops]), op_module=module_rows(j.op_module[ops]), op_step=j.op_step[ops] - s0,
        module_parent=module_rows(j.module_parent[mods]), module_step=j.module_step[mods] - s0,
        module_path=[j.module_path[m] for m in mods.tolist()], module_phase=[j.module_phase[m] for m in mods.tolist()],
        module_start=j.module_start[mods], module_end=j.module_end[mods],
        kernel_start=j.kernel_start[kernels], kernel_end=j.kernel_end[kernels],
        kernel_launch=_renumber(j.kernel_launch[kernels], launches),
        kernel_op=op_rows(j.kernel_op[kernels]), kernel_step=j.kernel_step[kernels] - s0, stats=j.stats,
        step_ops_other_threads=None if j.step_ops_other_threads is None else j.step_ops_other_threads[s0:s1],
        origin=RowOrigin(first_step=j.origin.first_step + s0, module=j.origin.of("module", mods),
                         op=j.origin.of("op", ops), kernel=j.origin.of("kernel", kernel_origin)),
    )
    o = tl.overlap
    timeline = DeviceTimeline(
        synth_ops=op_rows(tl.synth_ops[synth]),
        **{name: getattr(tl, name)[kernel_origin] for name in ("start", "end", "kind", "device", "clip_start",
                                                               "clip_end", "share_s", "role", "fp32_code")},
        step=tl.step[kernel_origin] - s0, tile_start=tl.tile_start[s0:s1], tile_end=tl.tile_end[s0:s1],
        overlap=StepOverlap(**{f.name: getattr(o, f.name)[s0:s1] for f in dataclasses.fields(StepOverlap)}),
        rank_devices=tl.rank_devices, outside_kernels=tl.outside_kernels, op_yields=tl.op_yields[ops],
    )
    return part, joined, timeline
