"""The live capture's background half: finished step captures -> one SpanBatch through the shared pipeline.

``record_set`` fills the same Arrow record tables offline ingest reads (ops from the op recorder, modules,
kernels and launches from CUPTI or the Kineto fallback, NVML samples); ``process`` runs
``pipeline.stitch_records`` on them with the steps' facts (depth, signatures, dropped records) as stitch
inputs, remembers what full steps measured for later batches, and lets a multi-rank job rebuild its fleet
and node spans from every rank's summaries. Nothing here edits a stitched table.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..conventions import SpanBatch
from ..records import RecordSet, table_from_columns
from . import distributed
from .config import say_once

if TYPE_CHECKING:
    from .session import CaptureSession, StepCapture


@dataclass
class BatchMemory:
    """What a batch leaves the batches after it (worker thread), and the one request it makes of the
    training thread."""

    measured: dict[str, Any] = field(default_factory=dict)  # signature -> step_facts.CarriedWork
    preceding: tuple[int, int] | None = None   # (step, device window end) of the last stitched step
    last_full: tuple[float, float] | None = None  # (flops, peak) of the latest full-depth step
    want_full: bool = False  # a step-depth step's MFU fell below the threshold: the next step goes full


def record_set(session: CaptureSession, items: list[StepCapture]) -> RecordSet:
    """What the steps captured, as the record tables offline ingest fills from a trace file."""
    from .packed_tables import modules_table

    rs = RecordSet(devices=list(session.sources.devices), resource=dict(session.resource), source=session.sources.label())
    rs.steps = table_from_columns("steps", {
        "step": [c.step for c in items], "start_ns": [c.start_ns for c in items],
        "end_ns": [c.end_ns for c in items], "name": [c.name for c in items],
        "pid": [session._pid] * len(items), "tid": [c.tid for c in items]})
    # One table per run of steps from the same recorder, not one per step: a table of a chunk per step
    # makes every later take and cast of the stitch resolve chunks (a full-depth batch holds up to 32
    # steps). Runs keep the steps' order where the recorder changed mid-batch (auto: dispatch, then native).
    recorded = [c for c in items if c.ops is not None]
    ops = [recorder.table([c.ops for c in run], session._pid, session._epoch)
           for recorder, run in itertools.groupby(recorded, key=lambda c: c.op_recorder)]
    rs.ops = ops[0] if len(ops) == 1 else pa.concat_tables([table_from_columns("ops", {}), *ops])
    traced = kineto_records(items)
    for name in ("ops", "kernels", "launches"):
        # Kineto's ops carry the External ids its launches and kernels point to: they stand in
        # for the dispatch hooks' ops on the steps it profiled, which keeps the join exact.
        tabs = [getattr(rs, name)] + [getattr(r, name) for r in traced]
        tabs = [t for t in tabs if t.num_rows]
        if tabs:
            setattr(rs, name, pa.concat_tables(tabs, promote_options="default") if len(tabs) > 1 else tabs[0])
    rs.modules = modules_table([m for c in items for m in c.modules], session._pid, session._epoch)
    now = session.sources.take_cupti(max(c.end_ns for c in items))
    if now is not None:
        for name, table in now.items():
            if table.num_rows:
                setattr(rs, name, table)
        # the Kineto fallback does not report its dropped records; a count CUPTI would not give is unknown
        if all(c.dropped is not None for c in items):
            rs.counters["cupti.dropped_records"] = int(sum(c.dropped for c in items))
    samples = [c.samples for c in items if c.samples is not None and c.samples.num_rows]
    if samples:
        rs.samples = pa.concat_tables(samples)
    return rs


def kineto_records(items: list[StepCapture]) -> list[RecordSet]:
    """The Kineto fallback's per-step traces, read and moved to their own External/correlation id ranges."""
    from ..sources.kineto import TraceFormatError
    from .kineto_fallback import read_step

    out = []
    for c in items:
        if c.kineto is None:
            continue
        path, c.kineto = c.kineto, None
        try:
            out.append(_shift_ids(read_step(path), (c.step + 1) << _STEP_ID_BITS))
        except TraceFormatError:
            pass  # a step with no profiled events (nothing ran between its boundaries)
    return out


def process(session: CaptureSession, items: list[StepCapture]) -> SpanBatch:
    """Finished steps -> one SpanBatch through the shared pipeline (one trace per step)."""
    from ..pipeline import IngestOptions, stitch_options, stitch_records
    from ..stitch.step_facts import StepFacts

    agree_job_id(session)
    rs = record_set(session, items)
    # once per batch: the training thread may find the process group between the stitch and the exchange
    multi_rank = distributed.active()
    full = {c.step for c in items if c.full}
    facts = StepFacts(signatures={c.step: c.signature for c in items if c.signature is not None},
                      measured=session.memory.measured, not_carried={c.step for c in items if c.compiled},
                      dropped_records={c.step: c.dropped for c in items if c.dropped is not None}
                      if session.sources.cupti is not None else None,
                      preceding=session.memory.preceding, opened_at_call={c.step for c in items if c.opened_at_call})
    options = IngestOptions(job_id=session.job_id, peak_tflops=session.config.peak_tflops, gpu_price=session.config.gpu_price,
                            service_name=session.config.service_name, full_depth_steps=full, step_facts=facts,
                            cpu_spec=session.sources.cpu_spec_for_stitch(lambda: session.closed),
                            cpu_price=session.sources.cpu_price_per_hour(), cpu_threads=session.sources.cpu_threads(),
                            # each rank stitches alone: its share of the trace's span budget; the fleet and
                            # node spans are built from every rank's summaries (distributed.coordinate)
                            world_size=distributed.world_size(), top_spans=not multi_rank)
    result = stitch_records([rs], options)
    facts.remember(result.summaries)  # later batches carry what this batch's full steps measured
    session.memory.preceding = facts.preceding  # and open their first tile where this batch's last one closed
    batch = result.batch
    update_threshold(session, batch.table, items)
    # Multi-rank: the fleet and node spans built from every rank's summary join this rank's subtree.
    return distributed.coordinate(batch, session.job_id, stitch_options(options), say_once) if multi_rank else batch


def agree_job_id(session: CaptureSession) -> None:
    """Ranks whose environment named no job id (torchrun's static rendezvous, a Kubernetes PyTorchJob)
    take rank 0's, so a step is one trace on every rank and no other run shares its ids. Once, at the
    first batch that finds the process group; a rank that waits in vain keeps its own and says so."""
    if session.job_id_shared or not distributed.active():
        return
    wait = distributed.wait_s(session.config.environ)
    attempt = (session.config.environ.get("TORCHELASTIC_RESTART_COUNT") or "0").strip()
    shared = distributed.shared_job_id(session.job_id, wait, attempt=attempt)
    session.job_id_shared = True  # one try: a later batch must not wait again
    if shared is None:
        say_once("job-id-not-shared", f"rank 0's job id did not arrive within {wait:g}s: this rank's traces carry its own "
                                      f"({session.job_id!r}); set PLASMIENT_JOB_ID to name the job")
        return
    session.job_id = shared
    session.resource["plasmient.job.id"] = shared


def update_threshold(session: CaptureSession, table: pa.Table, items: list[StepCapture]) -> None:
    """Ask for a full-depth step when a step-depth step's MFU, estimated from the last full step's FLOPs
    over its own wall time, fell below the configured threshold."""
    is_step = pc.equal(table.column("plasmient.level"), "step").to_numpy(zero_copy_only=False)
    steps = table.column("plasmient.step").to_numpy()[is_step]
    flops = table.column("plasmient.flops").to_numpy(zero_copy_only=False)[is_step]
    peak = table.column("plasmient.peak_flops").fill_null(np.nan).to_numpy(zero_copy_only=False)[is_step]
    wall = table.column("plasmient.wall_s").to_numpy(zero_copy_only=False)[is_step]
    full = {c.step for c in items if c.full}
    for s, f, p, w in sorted(zip(steps.tolist(), flops.tolist(), peak.tolist(), wall.tolist())):
        if s in full:
            if f == f and f > 0 and p == p and p > 0:
                session.memory.last_full = (f, p)
        elif session.config.mfu_threshold is not None and session.memory.last_full is not None and w > 0:
            # Same work as the last full step (fixed shapes), longer wall time: MFU fell.
            lf, lp = session.memory.last_full
            if lf / (lp * w) < session.config.mfu_threshold:
                session.memory.want_full = True


# The live joins look External ids and correlation ids up across the whole batch, without a time
# check. Each profiler run numbers its External ids afresh (from 1, as the dispatch hooks do), so
# every profiled step gets its own id range above any the dispatch hooks hand out.
_STEP_ID_BITS = 40


def _shift_ids(records: RecordSet, offset: int) -> RecordSet:
    for name, columns in (("ops", ("external_id",)), ("launches", ("external_id", "correlation_id")),
                          ("kernels", ("external_id", "correlation_id"))):
        table = getattr(records, name)
        for col in columns:
            i = table.schema.get_field_index(col)
            if i >= 0 and table.num_rows:
                table = table.set_column(i, table.schema.field(i), pc.add(table.column(i), offset))
        setattr(records, name, table)
    return records
