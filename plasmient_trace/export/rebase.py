"""``--rebase-time``: shift every timestamp of an offline ingest by one constant so its last span ends
now, for UIs that only search a recent window (Phoenix's "last 7 days", Jaeger's lookback).

Every absolute time moves by the same offset, so every duration, gap and ordering is kept; relative
quantities (durations, ``plasmient.clock.offset_ns``) are untouched. The absolute time columns are
found from the span table's own documentation: the core ``start_ns``/``end_ns`` and every attribute
whose description says "Unix epoch". Trace and span ids do not depend on time, so a rebased trace
keeps the id ``plasmient link`` prints.
"""

from __future__ import annotations

import time

import pyarrow as pa
import pyarrow.compute as pc

from plasmient_trace.conventions import SPAN_ATTRIBUTES, SpanBatch

__all__ = ["EPOCH_COLUMNS", "rebase_time"]

EPOCH_COLUMNS: tuple[str, ...] = ("start_ns", "end_ns") + tuple(
    a.name for a in SPAN_ATTRIBUTES if "unix epoch" in a.description.lower())


def rebase_time(batch: SpanBatch, now_ns: int | None = None) -> tuple[SpanBatch, int]:
    """The batch shifted so its latest ``end_ns`` is ``now_ns`` (default: the wall clock), and the
    offset added (ns). An empty batch is returned as is with offset 0."""
    table = batch.table
    if table.num_rows == 0:
        return batch, 0
    now_ns = time.time_ns() if now_ns is None else int(now_ns)
    offset = now_ns - int(pc.max(table.column("end_ns")).as_py())
    shift = pa.scalar(offset, pa.int64())
    for name in EPOCH_COLUMNS:
        if name in table.column_names:
            i = table.schema.get_field_index(name)
            table = table.set_column(i, table.schema.field(i), pc.add_checked(table.column(i), shift))
    return SpanBatch(table=table, resources=batch.resources), offset
