"""Parquet: every record table, the spans and their resources, for analysis in any engine.

``write_parquet`` writes one file per table into a directory:

* ``<table>.parquet`` for each record table (records.TABLE_SCHEMAS), all ranks concatenated, with
  ``rank`` (the resource's ``plasmient.rank``, null when unknown) and ``source`` (the input file or
  live source) added so rows stay attributable;
* ``spans.parquet``: the span table with ``trace_id`` as 32 and ``span_id``/``parent_span_id`` as
  16 lowercase hex characters (the OTLP/JSON spelling, so a span joins to what a trace backend
  shows, and no engine has to cope with unsigned or binary ids); roots have a null parent;
* ``resources.parquet``: one row per resource, ``resource_index`` plus one column per attribute.

Tables with no rows still get a file carrying the schema, so queries over a directory never fail
on a missing table. Each file is written beside its name and renamed into place
(``sinks.write_output_file``), so a reader never sees a half-written file and a failure leaves none.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from plasmient_trace.conventions import SPAN_TABLE_SCHEMA, SpanBatch
from plasmient_trace.export.pieces import hex_matrix, u64_be_matrix
from plasmient_trace.export.files import remove_written_files
from plasmient_trace.export.sinks import write_output_file
from plasmient_trace.export.span_columns import grouped_rows, id_matrix
from plasmient_trace.records import TABLE_SCHEMAS, RecordSet

__all__ = ["write_parquet", "spans_table", "resources_table"]

_COMPRESSION = "zstd"


def _with_origin(table: pa.Table, rank: int | None, source: str) -> pa.Table:
    n = table.num_rows
    table = table.append_column(pa.field("rank", pa.int64()), pa.array([rank] * n if rank is not None else pa.nulls(n, pa.int64()), pa.int64()))
    return table.append_column(pa.field("source", pa.string()), pa.array([source] * n, pa.string()))


def _rank_of(rs: RecordSet) -> int | None:
    rank = rs.resource.get("plasmient.rank")
    try:
        return int(rank) if rank is not None else None
    except (TypeError, ValueError):
        return None


def _record_table(name: str, record_sets: list[RecordSet]) -> pa.Table:
    schema = TABLE_SCHEMAS[name]
    parts = [_with_origin(rs.tables()[name].cast(schema), _rank_of(rs), rs.source) for rs in record_sets]
    if not parts:
        return _with_origin(schema.empty_table(), None, "")
    return pa.concat_tables(parts)


def _hex_ids(values: np.ndarray, width: int, valid: np.ndarray | None = None) -> pa.Array:
    """(n, k) id bytes -> string array of 2k hex characters each (null where not ``valid``)."""
    n = len(values)
    hexed = hex_matrix(values) if n else np.empty((0, 2 * width), dtype=np.uint8)
    offsets = np.arange(n + 1, dtype=np.int32) * (2 * width)
    validity, nulls = None, 0
    if valid is not None and n and not valid.all():
        validity, nulls = pa.py_buffer(np.packbits(valid, bitorder="little")), int(n - np.count_nonzero(valid))
    return pa.Array.from_buffers(pa.string(), n, [validity, pa.py_buffer(offsets), pa.py_buffer(np.ascontiguousarray(hexed))], null_count=nulls)


def spans_table(batch: SpanBatch) -> pa.Table:
    """The span table with hex-string ids (see module docstring), its rows in the order the JSON lines
    hold them, so one process and a pool write the same file."""
    table = batch.table
    rows = grouped_rows(table)
    if rows is not None:
        table = table.take(pa.array(rows))
    trace = _hex_ids(id_matrix(table.column("trace_id"), 16), 16)
    span_ids = table.column("span_id").to_numpy().astype(np.uint64)
    parent_ids = table.column("parent_span_id").to_numpy().astype(np.uint64)
    span = _hex_ids(u64_be_matrix(span_ids), 8)
    parent = _hex_ids(u64_be_matrix(parent_ids), 8, valid=parent_ids != 0)
    for name, values in (("trace_id", trace), ("span_id", span), ("parent_span_id", parent)):
        i = table.schema.get_field_index(name)
        table = table.set_column(i, pa.field(name, pa.string(), nullable=name == "parent_span_id"), values)
    return table


def _empty_spans_table() -> pa.Table:
    return spans_table(SpanBatch(SPAN_TABLE_SCHEMA.empty_table(), []))


def resources_table(resources: list[dict[str, Any]]) -> pa.Table:
    """One row per resource: resource_index plus one column per attribute key (mixed types as text)."""
    keys: list[str] = []
    for r in resources:
        for k in r:
            if k not in keys:
                keys.append(k)
    columns: dict[str, pa.Array] = {"resource_index": pa.array(range(len(resources)), pa.int32())}
    for k in keys:
        values = [r.get(k) for r in resources]
        try:
            arr = pa.array(values)
            if pa.types.is_null(arr.type):
                arr = arr.cast(pa.string())
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            arr = pa.array([None if v is None else str(v) for v in values], pa.string())
        columns[k] = arr
    return pa.table(columns)


def _write(table: pa.Table, path: Path) -> Path:
    # as every whole output file: beside its name, synced, renamed into place, no temporary file left
    return write_output_file(path, lambda f: pq.write_table(table, f, compression=_COMPRESSION))


def write_parquet(record_sets: list[RecordSet], batch: SpanBatch | None, out_dir: str | os.PathLike[str]) -> list[Path]:
    """Write all record tables, the spans and the resources under ``out_dir``; returns the files.

    With ``batch=None`` spans.parquet is written empty and resources.parquet holds the record
    sets' resources.
    """
    out = Path(out_dir)
    created = not out.exists()   # a directory made here and left empty by a failure goes too
    out.mkdir(parents=True, exist_ok=True)
    files: list[Path] = []
    try:
        files += [_write(_record_table(name, record_sets), out / f"{name}.parquet") for name in TABLE_SCHEMAS]
        files.append(_write(spans_table(batch) if batch is not None else _empty_spans_table(), out / "spans.parquet"))
        resources = batch.resources if batch is not None else [rs.resource for rs in record_sets]
        files.append(_write(resources_table(resources), out / "resources.parquet"))
    except BaseException:
        # a set missing a table reads as a whole one with nothing in it: none of it, as for every output
        remove_written_files(files)
        if created:
            try:
                out.rmdir()
            except OSError:
                pass   # not empty: something else wrote there meanwhile
        raise
    return files


def parquet_files(out_dir: str | os.PathLike[str]) -> list[Path]:
    """The files :func:`write_parquet` writes under ``out_dir``."""
    return [Path(out_dir) / f"{name}.parquet" for name in (*TABLE_SCHEMAS, "spans", "resources")]
