"""Many ranks of one job as map tasks, the fleet as a reduce: the multi-rank ingest for a process pool or Ray.

The single-process ``pipeline.stitch_records`` needs every rank's record tables in one place only twice:
to align the clocks and to build the fleet and node spans. Both need far less than the tables, so here
each rank's work runs where its file was read and only small results travel:

* map 1, :func:`parse_rank`: read one rank's file (and pair a CUDA-graph replay with its capture, as
  ``ingest_paths`` does) -> its RecordSet, which the engine keeps near the worker, and a
  :class:`RankDigest`: rank id, node, host and collective end times, what alignment and budget read.
* reduce 1, :func:`plan_ranks`: clock offsets (``align.alignment_from_ends``, the method of
  ``estimate_alignment``) and each rank's share of the span budget (``tree.allowance_for``, the rule
  ``stitch`` applies) -> one :class:`StitchJob` per rank.
* map 2, :func:`stitch_part`: shift the rank onto the reference clock, FLOP models
  (``pipeline.rank_input``), ``tree.stitch_rank`` -> a :class:`RankPart`: the rank's spans (rank span
  and below) and one ``RankSummary`` per step.
* reduce 2, :func:`finish`: ``fleet.top_spans`` over all summaries (the builder live multi-rank capture
  feeds with the summaries ranks exchange) merged with the rank batches in input order.

Every step is the single-process code applied to the same values in the same order, so the result is
the same span table, ids included. The engines (``runners.py``: a local process pool, Ray) only move
these functions and their arguments.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .conventions import SpanBatch
from .records import RecordSet
from .stitch.align import (
    AlignmentReport,
    CollectiveEnds,
    alignment_from_ends,
    alignment_lines,
    apply_offsets,
    collective_ends,
)
from .stitch.fleet import RankSummary, merge_span_batches, missing_steps_warning, ranks_missing, top_spans
from .stitch.tree import allowance_for, node_of, rank_of, stitch_rank

if TYPE_CHECKING:  # pipeline imports this module lazily
    from .pipeline import IngestOptions, IngestResult


@dataclass
class RankDigest:
    """What reduce 1 needs of one parsed rank."""

    index: int                  # position among the inputs (input 0 is the clock reference)
    rank: int
    node: str
    host: str | None            # the trace's host.name: ranks on one host share a clock
    ends: CollectiveEnds
    note: str | None = None     # the CUDA-graph pairing note, if the rank had a capture
    label: str = ""             # how messages name it (its file)
    steps: list[int] = field(default_factory=list)  # the step numbers it recorded


@dataclass
class StitchJob:
    """What map 2 needs besides the rank's records."""

    index: int
    rank: int
    node: str
    offset_ns: int
    allowance: int


@dataclass
class RankPart:
    """One rank's stitched spans and what the reduce adds up."""

    index: int
    batch: SpanBatch            # rank span and below; batch.summaries: one RankSummary per step
    stats: dict[str, int]
    unknown_device: str | None  # the rank's source when its device is unknown (no MFU on its spans)
    unknown_device_type: str | None = None  # "gpu" or "cpu" where unknown_device is set
    notes: list[str] = field(default_factory=list)
    records: RecordSet | None = None      # only when IngestOptions.keep_records
    worker: tuple[int, int | None, float] = (0, None, 0.0)  # worker_peak() of the process that stitched it

    @property
    def summaries(self) -> list[RankSummary]:
        return self.batch.summaries


@dataclass
class Plan:
    jobs: list[StitchJob]
    offsets: dict[int, int]
    method: dict[int, str]
    clock_notes: list[str] = field(default_factory=list)  # stitch.align.alignment_lines
    clock_warnings: list[str] = field(default_factory=list)


def parse_rank(path: str | Path, index: int, options: IngestOptions) -> tuple[RecordSet, RankDigest]:
    """Map 1: one rank's records and their digest."""
    from .pipeline import input_label, pair_capture
    from .sources.kineto import read_kineto

    path = Path(path)
    records, note = pair_capture(path, read_kineto(path), options)
    rank = rank_of(records, index)
    digest = RankDigest(index=index, rank=rank, node=node_of(records, rank, _stitch_options(options)),
                        host=records.resource.get("host.name"), ends=collective_ends(records), note=note,
                        label=input_label(records, index), steps=records.steps.column("step").to_pylist())
    return records, digest


def plan_ranks(digests: list[RankDigest], options: IngestOptions) -> Plan:
    """Reduce 1: clock offsets (only with several ranks, as stitch_records) and the span allowance."""
    allowance = allowance_for(_stitch_options(options), [d.rank for d in digests], [d.node for d in digests])
    offsets: dict[int, int] = {}
    method: dict[int, str] = {}
    notes: tuple[list[str], list[str]] = ([], [])
    if len(digests) > 1:
        report = alignment_from_ends([d.ends for d in digests], [d.host for d in digests])
        offsets, method = report.offsets, report.method
        notes = input_lines(report, [d.label for d in digests], [set(d.steps) for d in digests])
    jobs = [StitchJob(index=d.index, rank=d.rank, node=d.node, offset_ns=int(offsets.get(d.index, 0)),
                      allowance=allowance) for d in digests]
    return Plan(jobs=jobs, offsets=offsets, method=method, clock_notes=notes[0], clock_warnings=notes[1])


def input_lines(report: AlignmentReport, labels: list[str], steps_of: list[set[int]]) -> tuple[list[str], list[str]]:
    """What several inputs came to before they are stitched, in words: (informational lines, warnings) on how
    each one's clock was aligned and which steps some did not record."""
    info, warnings = alignment_lines(report, labels)
    missing = missing_steps_warning(steps_of, labels)
    return info, warnings + ([missing] if missing else [])


def stitch_part(records: RecordSet, job: StitchJob, options: IngestOptions) -> RankPart:
    """Map 2: the rank on the reference clock, stitched alone with its share of the budget."""
    from .pipeline import input_label, rank_input

    if job.offset_ns:
        records = apply_offsets([records], {0: job.offset_ns})[0]
    notes: list[str] = []
    inp = rank_input(records, options, notes)
    result = stitch_rank(inp, job.rank, job.node, _stitch_options(options), job.allowance)
    stats = {**result.stats, "ops_outside_steps": result.joined.stats.ops_outside_steps,
             "kernels_outside_steps": result.joined.stats.kernels_outside_steps}
    unknown = input_label(records, job.index) if inp.spec.source == "unknown" else None
    return RankPart(index=job.index, batch=result.batch, stats=stats, unknown_device=unknown,
                    unknown_device_type=inp.spec.device_type if unknown else None, notes=notes,
                    records=records if options.keep_records else None, worker=worker_peak())


def finish(digests: list[RankDigest], plan: Plan, parts: list[RankPart], options: IngestOptions) -> IngestResult:
    """Reduce 2: fleet and node spans from every rank's summaries, merged with the rank spans.

    ``IngestResult.joined`` stays empty (the joined tables never leave the workers); ``records`` holds
    each rank's tables only when ``options.keep_records``."""
    from .pipeline import IngestResult

    parts = sorted(parts, key=lambda p: p.index)
    summaries = [s for p in parts for s in p.summaries]
    missing = ranks_missing(summaries, len(parts)) if len(parts) > 1 else None
    batch = merge_span_batches([top_spans(summaries, _stitch_options(options), ranks_missing=missing)]
                               + [p.batch for p in parts])
    stats: dict[str, Any] = {
        "ranks": len(parts), "traces": len({s.step for s in summaries}), "spans": batch.table.num_rows,
        **{key: sum(p.stats[key] for p in parts)
           for key in ("kernels", "kernels_folded", "ops_outside_steps", "kernels_outside_steps")},
        "notes": [d.note for d in digests if d.note] + [n for p in parts for n in p.notes],
        "unknown_devices": [p.unknown_device for p in parts if p.unknown_device],
        "unknown_device_types": sorted({p.unknown_device_type for p in parts if p.unknown_device_type}),
        "worker_peak_rss_kib": _peaks(parts),
        "worker_cpu_s": _cpu(parts),
    }
    if len(digests) > 1:
        stats["clock_offsets_ns"] = plan.offsets
        stats["clock_alignment"] = plan.method
        stats["clock_notes"], stats["warnings"] = plan.clock_notes, plan.clock_warnings
    records = [p.records for p in parts] if options.keep_records else []
    return IngestResult(batch=batch, records=records, joined=[], stats=stats, summaries=summaries)


def ingest_ranks(
    paths: list[Path],
    options: IngestOptions,
    progress: Callable[[str, int, int], None] | None = None,
    runner: Any = None,
) -> IngestResult:
    """Both maps and both reduces on ``runner`` (default: Ray when options.ray is set, else a process pool)."""
    from .runners import open_runner

    engine = runner if runner is not None else open_runner(options, len(paths))
    aborted = True  # an error, Ctrl-C or SIGTERM on the way: what still runs is of no use
    try:
        digests, handles = [], []
        for i, (digest, handle) in enumerate(engine.parse(paths, options)):
            if progress:
                progress(f"read {paths[i].name}", i + 1, len(paths) + 1)
            digests.append(digest)
            handles.append(handle)
        plan = plan_ranks(digests, options)
        parts = []
        for i, part in enumerate(engine.stitch(handles, plan.jobs, options)):
            if progress:
                progress(f"stitched {paths[i].name}", i + 1, len(paths) + 1)
            parts.append(part)
        aborted = False
    finally:
        engine.close(abort=aborted)
    return finish(digests, plan, parts, options)


def worker_peak() -> tuple[int, int | None, float]:
    """(pid, peak resident set in KiB, CPU seconds so far) of this process; None where /proc does not say."""
    cpu = time.process_time()
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return os.getpid(), int(line.split()[1]), cpu
    except OSError:
        pass
    return os.getpid(), None, cpu


def _peaks(parts: list[RankPart]) -> dict[int, int]:
    out: dict[int, int] = {}
    for pid, kib, _ in (p.worker for p in parts):
        if kib is not None:
            out[pid] = max(out.get(pid, 0), kib)
    return out


def _cpu(parts: list[RankPart]) -> float:
    """CPU seconds the workers spent, as far as the last task each ran (a worker's clock only grows)."""
    out: dict[int, float] = {}
    for pid, _, cpu in (p.worker for p in parts):
        out[pid] = max(out.get(pid, 0.0), cpu)
    return sum(out.values())


def _stitch_options(options: IngestOptions) -> Any:
    from .pipeline import stitch_options

    return stitch_options(options)
