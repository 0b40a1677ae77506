"""The span tree: joined records of every rank -> one trace per step, fleet -> node -> rank -> step ->
module -> op -> kernel, with the metrics of DESIGN.md on every span, as a columnar SpanBatch.

Each rank is stitched on its own and reduced to one :class:`~plasmient_trace.stitch.fleet.RankSummary` per
step; the fleet and node spans are built from those summaries by ``fleet.top_spans``, the same builder live
multi-rank capture uses after exchanging summaries. Ranks are independent until that reduce.

A rank is joined and its device timeline measured once (``prepare_rank``: ``stitch.timeline`` holds what
crosses step boundaries), then stitched a group of whole steps at a time (``stitch_steps``: tree, accounting,
culprits, span budget, columns of the group's rows, cut by ``stitch.chunks``), so a long trace never has one
span table. ``stitch_stream`` yields each group's spans of every rank with its fleet and node spans;
``stitch_rank`` (one rank in a worker) merges its groups.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import pyarrow as pa

from .. import conventions as cv
from ..records import RecordSet
from .budget import choose_exported
from .chunks import StepRows, slice_rank, step_groups
from .columns import rank_columns
from .culprits import StepCulprits, step_culprits
from .fleet import RankSummary, merge_span_batches, ranks_missing, top_spans
from .inputs import DEFAULT_MAX_SPANS, KIND_CODE, DeviceSpec, RankInput, StitchOptions
from .joins import JoinedRank, join_rank
from .rank import RankTree, build_rank_tree, derive_metrics
from .step_facts import step_summary_columns
from .timeline import DeviceTimeline, device_timeline

__all__ = ["DEFAULT_MAX_SPANS", "DeviceSpec", "RankInput", "StitchOptions", "StitchResult", "StreamTotals", "allowance_for",
           "stitch_rank", "stitch_stream"]


@dataclass
class StitchResult:
    batch: cv.SpanBatch
    joined: list[JoinedRank]
    stats: dict[str, Any]
    summaries: list[RankSummary] = field(default_factory=list)


@dataclass
class RankResult:
    batch: cv.SpanBatch
    joined: JoinedRank
    summaries: list[RankSummary]
    stats: dict[str, int]


def rank_of(records: RecordSet, position: int) -> int:
    value = records.resource.get("plasmient.rank")
    return int(value) if isinstance(value, int) else position


def node_of(records: RecordSet, rank: int, options: StitchOptions) -> str:
    host = records.resource.get("host.name") or options.host
    return str(host) if host else f"node-{rank // max(options.ranks_per_node, 1)}"


def span_allowance(options: StitchOptions, ranks: int, nodes: int) -> int:
    """Spans one rank may export below its step in each trace: the budget less the fleet and node
    spans, split evenly between the ranks, less the rank's own rank and step spans."""
    per_rank = (options.max_spans - 1 - nodes) // max(ranks, 1)
    return max(per_rank - 2, 0)


def allowance_for(options: StitchOptions, ranks: list[int], nodes: list[str]) -> int:
    """Each rank's span allowance when these ranks (on these nodes) are stitched together, from their
    rank ids and nodes alone, so ranks stitched in other processes get the same share."""
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"two inputs claim the same rank ({sorted(ranks)}); pass one file per rank")
    world = options.world_size or len(ranks)
    return span_allowance(options, world, len(set(nodes)) if world == len(ranks) else max(world // max(options.ranks_per_node, 1), 1))


@dataclass
class PreparedRank:
    """One rank joined and its device timeline measured: what every chunk of its steps reads."""

    inp: RankInput
    joined: JoinedRank
    timeline: DeviceTimeline
    rank: int
    node: str

    @cached_property
    def step_rows(self) -> StepRows:
        """The rank's rows by step, built once for all of its chunks."""
        return StepRows.of(self.joined)


def prepare_rank(inp: RankInput, rank: int, node: str, options: StitchOptions) -> PreparedRank:
    j = join_rank(inp.records)
    return PreparedRank(inp=inp, joined=j, timeline=device_timeline(inp, j, options), rank=rank, node=node)


def stitch_rank(inp: RankInput, rank: int, node: str, options: StitchOptions, allowance: int) -> RankResult:
    """One rank's subtree (rank span and below) and its step summaries, built chunk by chunk of steps."""
    prepared = prepare_rank(inp, rank, node, options)
    groups = step_groups([(prepared.joined, prepared.timeline)], _chunk_rows(options))
    parts = [stitch_steps(prepared, *group[0], options, allowance) for group in groups]
    return _merged(prepared, parts)


def _merged(prepared: PreparedRank, parts: list[RankResult]) -> RankResult:
    if len(parts) == 1:
        return parts[0]
    batch = merge_span_batches([p.batch for p in parts])
    stats = {key: sum(p.stats[key] for p in parts) for key in parts[0].stats}
    return RankResult(batch=batch, joined=prepared.joined, summaries=batch.summaries, stats=stats)


def stitch_steps(prepared: PreparedRank, s0: int, s1: int, options: StitchOptions, allowance: int) -> RankResult:
    """The rank's spans and summaries of its steps [s0, s1) (step rows, in time order)."""
    inp, j, tl = prepared.inp, prepared.joined, prepared.timeline
    if (s0, s1) != (0, len(j.steps)):
        inp, j, tl = slice_rank(inp, j, tl, s0, s1, prepared.step_rows)
    rank, node = prepared.rank, prepared.node
    tree = build_rank_tree(inp, j, options, tl)
    bandwidth = inp.spec.bandwidth or float("nan")
    met = derive_metrics(tree, bandwidth)
    facts = tree.facts
    culprits = step_culprits(tree, j, met, inp.spec, wanted=None if facts is None else facts.full)
    export = choose_exported(tree, allowance, options.full_depth_steps, j.steps.astype(np.int64))
    batch = rank_columns(inp, j, tree, met, export, rank, node, options, culprits)
    service = batch.resources[0].get("service.name") if batch.resources else None
    folded = _folded_by_step(batch.table, int(np.count_nonzero(export[:tree.n_steps])))
    tiled = _tiled_stretch(prepared, options)
    summaries = [RankSummary(job_id=options.job_id, rank=rank, host=node, price_per_hour=float(tree.price),
                             bandwidth=bandwidth, device_type=inp.spec.device_type, service_name=service,
                             tiled_start_ns=tiled[0], tiled_end_ns=tiled[1],
                             **fields, **folded.get(fields["step"], {}))
                 for fields in _summary_fields(tree, j, culprits)]
    stats = {"spans": int(export.sum()), "kernels": tree.n_k,
             "kernels_folded": int((~export[tree.base["kernel"]:tree.base["kernel"] + tree.n_k] &
                                    tree.alive[tree.base["kernel"]:tree.base["kernel"] + tree.n_k]).sum())}
    batch.summaries = summaries
    return RankResult(batch=batch, joined=prepared.joined, summaries=summaries, stats=stats)


def _tiled_stretch(prepared: PreparedRank, options: StitchOptions) -> tuple[int | None, int | None]:
    """Where the rank's step windows begin and end over the whole input (every group of its steps); open
    (None) live, where the steps of earlier and later batches tile on."""
    tl = prepared.timeline
    if options.step_facts is not None or not len(tl.tile_start):
        return None, None
    return int(tl.tile_start[0]), int(tl.tile_end[-1])


# The rank span's totals a summary carries as they are (flops, ideal_s and kernels are derived below).
_SUMMED = ("busy_s", "known_s", "bytes_known_s", "bytes", "kernel_s", "comm_s", "copy_s", "wasted_s", "charged_s", "idle_s", "recompute_flops")


_FOLDED_COLUMNS = ("plasmient.kernels.folded", "plasmient.kernels.folded_s", "plasmient.kernels.folded_flops",
                   "plasmient.spans.folded")


def _folded_by_step(table: pa.Table, rank_spans: int) -> dict[int, dict[str, Any]]:
    """Per step, what the span budget folded under the rank span, as its row says (for fleet.RankSummary).
    ``rank_spans``: how many rank spans the table has; they are its first rows (the tree's first rows,
    RankTree.base["rank"] = 0, and the table keeps the tree's order), so no column is searched for them."""
    # the five columns read, not the span table's 120: it runs once per group of steps
    ranks = table.select(["plasmient.step", *_FOLDED_COLUMNS]).slice(0, rank_spans)
    if ranks.num_rows == 0:
        return {}
    flops = ranks.column("plasmient.kernels.folded_flops").fill_null(np.nan).to_numpy(zero_copy_only=False)
    return {step: {"kernels_folded": k, "kernels_folded_s": s, "kernels_folded_flops": f, "spans_folded": p}
            for step, k, s, f, p in zip(ranks.column("plasmient.step").to_pylist(),
                                        ranks.column("plasmient.kernels.folded").fill_null(0).to_pylist(),
                                        ranks.column("plasmient.kernels.folded_s").fill_null(0.0).to_pylist(),
                                        flops.tolist(), ranks.column("plasmient.spans.folded").fill_null(0).to_pylist())}


def _summary_fields(tree: RankTree, j: JoinedRank, culprits: StepCulprits) -> list[dict[str, Any]]:
    """The per-step fields of the rank's summaries (fleet.RankSummary), each read from the step's rank span
    row as one array per field, not one numpy scalar per field and step."""
    n = tree.n_steps
    rows = tree.base["rank"] + np.arange(n)
    col = {k: tree.col(k)[rows] for k in (*_SUMMED, "flops", "ideal_s", "recompute_ideal_s", "kernels")}
    o = tree.overlap
    idle_device = o.idle_device_s[:n]
    unknown = np.full(n, np.nan)
    recompute_ideal = col["recompute_ideal_s"] if tree.peak_known else unknown
    columns: dict[str, list[Any]] = {k: col[k].tolist() for k in _SUMMED}
    columns.update(
        flops=(col["flops"] - col["recompute_flops"]).tolist(),
        comm_total_s=o.comm_total_s[:n].tolist(), comm_exposed_s=o.comm_exposed_s[:n].tolist(),
        copy_total_s=o.copy_total_s[:n].tolist(), copy_exposed_s=o.copy_exposed_s[:n].tolist(),
        # min(idle_device, idle) as Python's min() reads a NaN: the second wins only when smaller
        idle_device_s=np.where(col["idle_s"] < idle_device, col["idle_s"], idle_device).tolist(),
        queue_mean=o.queue_mean[:n].tolist(), queue_max=o.queue_max[:n].astype(np.float64).tolist(),
        step=j.steps[:n].astype(np.int64).tolist(), start_ns=tree.start[rows].astype(np.int64).tolist(),
        end_ns=tree.end[rows].astype(np.int64).tolist(), window_start_ns=tree.win_start[rows].astype(np.int64).tolist(),
        window_end_ns=tree.win_end[rows].astype(np.int64).tolist(), gpus=tree.gpus[rows].astype(np.int64).tolist(),
        ideal_s=(col["ideal_s"] - recompute_ideal if tree.peak_known else unknown).tolist(),
        recompute_ideal_s=recompute_ideal.tolist(), union_s=tree.union_s[rows].astype(np.float64).tolist(),
        kernels=col["kernels"].astype(np.int64).tolist(), culprits=list(culprits.rows[:n]),
        culprits_left_out_s=culprits.left_out_s[:n],
    )
    cb = tree.comm_bw
    if cb is not None and len(cb.step_bytes):
        # what node and fleet spans need to add bytes up and weight bus bandwidth by them across ranks
        columns.update(comm_bytes=cb.step_bytes[:n].astype(np.float64).tolist(),
                       comm_rated_bytes=cb.step_rated_bytes[:n].astype(np.float64).tolist(),
                       comm_busbw=cb.step_busbw[:n].astype(np.float64).tolist(), link_peak=[float(cb.link_peak)] * n)
    columns.update(step_summary_columns(tree))
    collectives = _collectives_by_step(tree, j)
    columns["collectives"] = [collectives.get(s, []) for s in range(n)]
    names = list(columns)
    return [dict(zip(names, values)) for values in zip(*columns.values())]


# A summary carries at most this many collectives per step (what stragglers are computed from).
MAX_COLLECTIVES_PER_STEP = 4096


def _collectives_by_step(tree: RankTree, j: JoinedRank) -> dict[int, list[list[Any]]]:
    """Per step row, its collective kernels in start order as [name, start_ns, end_ns]."""
    comm = tree.k_kind == KIND_CODE["collective"]
    rows = tree.k_rows[comm & (tree.k_rows < tree.n_k)]
    if not len(rows):
        return {}
    steps = tree.step_row[tree.base["kernel"] + rows]
    starts, ends = j.kernel_start[rows], j.kernel_end[rows]
    names = j.records.kernels.column("name").take(rows).to_pylist()
    out: dict[int, list[list[Any]]] = {}
    for i in np.lexsort((starts, steps)).tolist():
        items = out.setdefault(int(steps[i]), [])
        if len(items) < MAX_COLLECTIVES_PER_STEP:
            items.append([names[i], int(starts[i]), int(ends[i])])
    return out


def _chunk_rows(options: StitchOptions) -> int | None:
    # Live batches carry FLOPs from step to step within the batch (step_facts): they are stitched whole.
    return options.chunk_rows if options.step_facts is None else np.iinfo(np.int64).max


def stitch_stream(inputs: list[RankInput], options: StitchOptions, with_top_spans: bool = True,
                  on_groups: Callable[[int, int], None] | None = None) -> Iterator[StitchResult]:
    """The spans of ``stitch``, a group of steps at a time (``options.chunk_rows`` records per group over all
    ranks): every rank's spans of those steps with their fleet and node spans, so each trace is whole in one
    part and memory holds one group's spans. ``StitchResult.summaries`` of a part are rank by rank."""
    ranks = [rank_of(r.records, i) for i, r in enumerate(inputs)]
    nodes = [node_of(r.records, rk, options) for r, rk in zip(inputs, ranks)]
    allowance = allowance_for(options, ranks, nodes)
    prepared = [prepare_rank(inp, rk, nd, options) for inp, rk, nd in zip(inputs, ranks, nodes)]
    joined = [p.joined for p in prepared]
    groups = step_groups([(p.joined, p.timeline) for p in prepared], _chunk_rows(options))
    for done, group in enumerate(groups, 1):
        results = [stitch_steps(p, s0, s1, options, allowance) for p, (s0, s1) in zip(prepared, group) if s1 > s0]
        summaries = [s for r in results for s in r.summaries]
        batches = [r.batch for r in results]
        if with_top_spans:
            missing = ranks_missing(summaries, len(inputs)) if len(inputs) > 1 else None
            batches.insert(0, top_spans(summaries, options, ranks_missing=missing))
        stats = {key: sum(r.stats[key] for r in results) for key in ("kernels", "kernels_folded")}
        yield StitchResult(batch=merge_span_batches(batches), joined=joined, stats=stats, summaries=summaries)
        if on_groups is not None:
            on_groups(done, len(groups))


@dataclass
class StreamTotals:
    """What the stats of a stitch add up over its parts."""

    kernels: int = 0
    kernels_folded: int = 0
    spans: int = 0
    steps: set[int] = field(default_factory=set)
    by_rank: dict[int, list[RankSummary]] = field(default_factory=dict)

    def add(self, part: StitchResult) -> None:
        self.kernels += part.stats["kernels"]
        self.kernels_folded += part.stats["kernels_folded"]
        self.spans += part.batch.table.num_rows
        for summary in part.summaries:
            self.steps.add(summary.step)
            self.by_rank.setdefault(summary.rank, []).append(summary)

    def summaries(self) -> list[RankSummary]:
        """Rank by rank, each rank's steps in order, whatever groups the steps were stitched in."""
        return [s for rank in self.by_rank.values() for s in rank]

    def stats(self, joined: list[JoinedRank]) -> dict[str, Any]:
        return {
            "ranks": len(joined), "traces": len(self.steps), "spans": self.spans, "kernels": self.kernels,
            "kernels_folded": self.kernels_folded,
            "ops_outside_steps": sum(j.stats.ops_outside_steps for j in joined),
            "kernels_outside_steps": sum(j.stats.kernels_outside_steps for j in joined),
        }
