"""The live capture's background half: finished step captures -> one SpanBatch through the shared pipeline.

``record_set`` fills the same Arrow record tables offline ingest reads (ops from the op recorder, modules,
kernels and launches from CUPTI or the Kineto fallback, NVML samples); ``process`` runs
``pipeline.stitch_records`` on them with the steps' facts (depth, signatures, dropped records) as stitch
inputs, remembers what full steps measured for later batches, and lets a multi-rank job rebuild its fleet
and node spans from every rank's summaries. Nothing here edits a stitched table.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..conventions import SpanBatch
from ..records import RecordSet, table_from_columns
from . import distributed
from .config import say_once

if TYPE_CHECKING:
    from .session import CaptureSession, StepCapture


def record_set(session: CaptureSession, items: list[StepCapture]) -> RecordSet:
    """What the steps captured, as the record tables offline ingest fills from a trace file."""
    from . import cupti as cupti_mod
    from . import cupti_records
    from .torch_hooks import modules_table

    rs = RecordSet(devices=list(session.devices), resource=dict(session.resource), source=session._source())
    rs.steps = table_from_columns("steps", {
        "step": [c.step for c in items], "start_ns": [c.start_ns for c in items],
        "end_ns": [c.end_ns for c in items], "name": [c.name for c in items]})
    # One table per run of steps from the same recorder, not one per step: a table of a chunk per step
    # makes every later take and cast of the stitch resolve chunks (a full-depth batch holds up to 64
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
    collector = session.cupti
    if session.on_gpu and collector is not None and (collector.available or session._cupti_later):
        # everything CUPTI recorded up to now, parsed at once: one pass of numpy work per batch
        raw = collector.flush() if collector.available else cupti_records.RawActivity()
        cutoff = max(c.end_ns for c in items)
        cols = cupti_records.parse(raw, keep_from=max(cutoff - collector.epoch_offset_ns, 0))
        if cols.skipped_buffers:
            say_once("cupti-layout", f"{cols.skipped_buffers} CUPTI buffer(s) did not match the record sizes "
                                     f"{dict(raw.sizes)} and were skipped: their steps miss kernels")
        parsed = cupti_records.tables(cols, collector.epoch_offset_ns, cupti_mod.default_api_name)
        now, session._cupti_later = split_at(concat_records(session._cupti_later, parsed), cutoff)
        for name, table in now.items():
            if table.num_rows:
                setattr(rs, name, table)
        # the Kineto fallback does not report its dropped records; a count CUPTI would not give is unknown
        if session.cupti is not None and all(c.dropped is not None for c in items):
            rs.counters["cupti.dropped_records"] = int(sum(c.dropped for c in items))
    samples = [c.samples for c in items if c.samples is not None and c.samples.num_rows]
    if samples:
        rs.samples = pa.concat_tables(samples)
    return rs


def concat_records(earlier: dict[str, pa.Table], parsed: dict[str, pa.Table]) -> dict[str, pa.Table]:
    return {name: pa.concat_tables([earlier[name], table]) if name in earlier and earlier[name].num_rows else table
            for name, table in parsed.items()}


def split_at(tables: dict[str, pa.Table], cutoff_ns: int) -> tuple[dict[str, pa.Table], dict[str, pa.Table]]:
    """CUPTI records of this batch's steps, and those of the step still open when the worker flushed
    (launched at or after ``cutoff_ns``, the batch's last step end), kept for the next batch. A kernel
    goes with its launch when that is among the records (a step's kernels may run after it ends),
    else by its own start; external correlations go with their launches.

    The open step's API calls are all kept (``parse(keep_from=)``): a launch whose kernel was still
    running at the flush finds it in the next batch. Of the earlier calls, only those whose device
    work is here go on, as ``parse`` keeps them (the carried ones that launched nothing stop here)."""
    kernels, launches, ext = tables["kernels"], tables["launches"], tables["external_correlation"]
    kernel_ids = kernels.column("correlation_id").combine_chunks()
    launch_ids = launches.column("correlation_id").combine_chunks()
    launched_later = pc.greater_equal(launches.column("start_ns"), cutoff_ns)
    launch_now = pc.and_(pc.invert(launched_later), pc.is_in(launch_ids, value_set=kernel_ids))
    later_ids = launch_ids.filter(launched_later)
    kernel_later = pc.if_else(pc.is_in(kernel_ids, value_set=launch_ids),
                              pc.is_in(kernel_ids, value_set=later_ids),
                              pc.greater_equal(kernels.column("start_ns"), cutoff_ns))
    ext_ids = ext.column("correlation_id")
    ext_later = pc.is_in(ext_ids, value_set=later_ids)
    ext_now = pc.and_(pc.invert(ext_later), pc.is_in(ext_ids, value_set=kernel_ids))
    parts = {"kernels": (kernels, pc.invert(kernel_later), kernel_later),
             "launches": (launches, launch_now, launched_later),
             "external_correlation": (ext, ext_now, ext_later)}
    now = {name: table.filter(keep) for name, (table, keep, _) in parts.items()}
    later = {name: table.filter(carry) for name, (table, _, carry) in parts.items()}
    return now, later


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

    rs = record_set(session, items)
    full = {c.step for c in items if c.full}
    facts = StepFacts(signatures={c.step: c.signature for c in items if c.signature is not None},
                      measured=session._measured, not_carried={c.step for c in items if c.compiled},
                      dropped_records={c.step: c.dropped for c in items if c.dropped is not None}
                      if session.cupti is not None else None,
                      preceding=session._preceding)
    options = IngestOptions(job_id=session.job_id, peak_tflops=session.config.peak_tflops, gpu_price=session.config.gpu_price,
                            service_name=session.config.service_name, full_depth_steps=full, step_facts=facts,
                            cpu_spec=session.cpu_spec_for_stitch(),
                            # each rank stitches alone: its share of the trace's span budget
                            world_size=distributed.world_size())
    result = stitch_records([rs], options)
    facts.remember(result.summaries)  # later batches carry what this batch's full steps measured
    session._preceding = facts.preceding  # and open their first tile where this batch's last one closed
    batch = result.batch
    update_threshold(session, batch.table, items)
    # Multi-rank: this rank's fleet/node rows give way to ones built from every rank's summary.
    return distributed.coordinate(batch, session.job_id, stitch_options(options), say_once)


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
                session._last_full = (f, p)
        elif session.config.mfu_threshold is not None and session._last_full is not None and w > 0:
            # Same work as the last full step (fixed shapes), longer wall time: MFU fell.
            lf, lp = session._last_full
            if lf / (lp * w) < session.config.mfu_threshold:
                session._force_full = True


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
