"""`plasmient report FILE.jsonl [FILE.jsonl ...] --html OUT.html`: summary and HTML report from span files.

Several files (e.g. one per rank, or one per node) are read into one batch, so the report covers
the whole job. Wired into the top-level parser by plasmient_trace/cli.py.
"""

from __future__ import annotations

import argparse
import sys
import zlib
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from plasmient_trace import conventions as cv
from plasmient_trace.cli import _console, _fraction, _output_path, _positive_float, _positive_int, stdin_for_dash
from plasmient_trace.conventions import DEFAULT_BASELINE_MFU, SpanBatch
from plasmient_trace.export.sinks import OutputError, check_not_an_input, check_output_path
from plasmient_trace.messages import OneLineErrorParser, say_error


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE.jsonl", help="OTLP JSON lines span files (.gz allowed; - or a pipe reads a stream); several are merged")
    parser.add_argument("--html", type=_output_path, metavar="OUT.html", help="write the self-contained HTML report here")
    parser.add_argument("--title", default=None, help="page title (default: the input file names)")
    parser.add_argument("--fleet-gpus", type=_positive_int, default=None, help="fleet size the bill starts with (default: the GPUs in the data; editable in the page)")
    parser.add_argument("--price-per-gpu-hour", type=_positive_float, default=None, help="USD per GPU-hour for the bill (default: the trace's own cost, else an assumed price)")
    parser.add_argument("--baseline-mfu", type=_fraction, default=DEFAULT_BASELINE_MFU, help="MFU below which time counts as wasted in the bill")
    parser.add_argument("--top", type=_positive_int, default=5, help="culprits to list in the terminal summary")
    parser.add_argument("--quiet", "-q", action="store_true", help="print nothing (the report is still written)")


def merge_batches(batches: list[SpanBatch]) -> SpanBatch:
    """Concatenate batches, re-pointing each span's resource_index into the merged resource list."""
    if len(batches) == 1:
        return batches[0]
    tables, resources = [], []
    for b in batches:
        shift = pa.scalar(len(resources), pa.int32())
        idx = b.table.schema.get_field_index("resource_index")
        tables.append(b.table.set_column(idx, "resource_index", pc.add(b.table.column("resource_index"), shift)))
        resources.extend(b.resources)
    return SpanBatch(pa.concat_tables(tables, promote_options="permissive"), resources)


class ReportInputError(ValueError):
    """A span file the report cannot use; str(err) is one line naming the file."""


# What reading a damaged span file can raise besides the reader's own ValueError: a cut gzip stream
# (EOFError), corrupt gzip (OSError / zlib.error), integers past int64 (OverflowError from Arrow), and
# memory exhaustion on a huge line.
_READ_ERRORS = (ValueError, OverflowError, EOFError, OSError, zlib.error, UnicodeDecodeError, MemoryError,
                pa.ArrowException)


def _problem(exc: BaseException) -> str:
    if isinstance(exc, EOFError):
        return "truncated gzip stream (the file was cut short)"
    if isinstance(exc, OverflowError):
        return f"a timestamp or integer is out of the int64 range ({exc})"
    if isinstance(exc, MemoryError):
        return "not enough memory to read it"
    if isinstance(exc, (OSError, zlib.error)) and not isinstance(exc, FileNotFoundError):
        return f"cannot read ({getattr(exc, 'strerror', None) or exc})"
    return str(exc)


SPAN_FILE_SUFFIXES = (".jsonl", ".jsonl.gz")


def read_span_files(files: list[str], notes: list[str] | None = None,
                    progress: Callable[[str, int, int], None] | None = None) -> SpanBatch:
    """Read and merge span files, refusing what would draw a wrong report: every failure is one line.
    Only plasmient's spans (those with a ``plasmient.level``) are kept: a Collector's file exporter
    writes every service's spans into one file, and an HTTP handler's span is no step. A span that
    appears again with the same ids and times (a delivery retried) is counted once, and ``notes`` gets
    a line saying so; the same ids with other times (two runs under one job id) are refused. With
    ``notes``, a file's incomplete last line (a live run still writing it) is left out with a note;
    without, it is refused as any bad line is."""
    from plasmient_trace.export.otlp_json_read import open_span_file, read_jsonl
    from plasmient_trace.sources.rawinput import InputError, files_in

    try:  # a directory: its span files, as the ranks of a live run write them (traces.rank<R>.jsonl)
        files = files_in(files, SPAN_FILE_SUFFIXES, "span file")
    except InputError as err:
        raise ReportInputError(str(err)) from None
    batches = []
    # the bar counts MiB of the regular files as stored; a pipe's size is not known
    mib = [Path(f).stat().st_size >> 20 if Path(f).is_file() else 0 for f in files]
    total, before = sum(mib), 0
    noted = len(notes) if notes is not None else 0
    for f, f_mib in zip(files, mib):
        if not Path(f).exists():
            raise ReportInputError(f"{f}: no such file")
        try:
            # one pass over the stream, so a pipe or stdin reads as a file does
            with open_span_file(f) as (_, stream):
                try:  # peeked at, not consumed: a pipe cannot be read twice
                    head = stream.peek(1 << 16)[: 1 << 16]
                except _READ_ERRORS:
                    head = b""  # cut off or damaged in its first block: the read says so
                if b'"resourceSpans"' not in head and any(k in head for k in (b'"traceEvents"', b'"schemaVersion"', b'"deviceProperties"')):
                    raise ReportInputError(f"{f}: a Kineto trace, not a span file: turn it into spans with `plasmient ingest "
                                           f"{f} --out spans.jsonl` and report those (`plasmient diff` takes traces as they are)")
                shown = f"reading {Path(f).name} (MiB)"
                batch = read_jsonl(stream, None if progress is None else
                                   lambda done: progress(shown, before + (done >> 20), total), notes=notes)
        except _READ_ERRORS as exc:
            text = _problem(exc)
            raise ReportInputError(text if text.startswith(str(f)) else f"{f}: {text}") from None
        ours = batch.table.column("plasmient.level").is_valid()
        if len(batch) and not pc.any(ours).as_py():
            raise ReportInputError(f"{f}: none of its {len(batch)} span(s) is plasmient's (no plasmient.level): "
                                   "not a plasmient trace")
        if not pc.all(ours).as_py():
            batch = SpanBatch(table=batch.table.filter(ours), resources=batch.resources, summaries=batch.summaries)
        if notes is not None:  # a live run's file is read up to the line being written, and a note says so
            if len(batch) == 0 and len(notes) > noted:
                raise ReportInputError(notes.pop())  # nothing but a cut line: that is the problem to name
            noted = len(notes)
        _check_times(f, batch)
        _check_ranges(f, batch)
        batches.append(batch)
        before += f_mib
    batch = merge_batches(batches)
    if len(batch) == 0:
        raise ReportInputError(f"{', '.join(files)}: no spans to report")
    return _once_each(batch, ", ".join(files), notes)


def _once_each(batch: SpanBatch, name: str, notes: list[str] | None) -> SpanBatch:
    """The batch with each (trace id, span id) once. Repeats with the first one's start and end are the
    same span delivered twice (OTLP is at-least-once: a retried request the collector had taken); other
    times under the same ids are another run that computed the same trace ids, whose numbers would be
    added to this one's."""
    t = batch.table
    trace = t.column("trace_id").combine_chunks()
    words = np.frombuffer(trace.buffers()[1], np.uint64)[2 * trace.offset: 2 * (trace.offset + len(trace))].reshape(-1, 2)
    span = t.column("span_id").to_numpy()
    order = np.lexsort((span, words[:, 1], words[:, 0]))
    repeat = np.zeros(len(order), bool)
    repeat[1:] = (span[order[1:]] == span[order[:-1]]) & (words[order[1:]] == words[order[:-1]]).all(axis=1)
    if not repeat.any():
        return batch
    first = order[np.flatnonzero(~repeat)[np.cumsum(~repeat) - 1]]  # each sorted row's first occurrence
    rows, of = order[repeat], first[repeat]
    start, end = t.column("start_ns").to_numpy(), t.column("end_ns").to_numpy()
    differ = (start[rows] != start[of]) | (end[rows] != end[of])
    if differ.any():
        job = t.column("plasmient.job.id").combine_chunks()[int(rows[differ][0])].as_py()
        raise ReportInputError(
            f"{name}: {int(differ.sum())} span id(s) appear again with other times: two runs wrote the same trace ids "
            f"(job id {job!r}) and their numbers would be added up; give each run its own PLASMIENT_JOB_ID, or "
            "report each run's lines apart")
    other = _other_numbers(t, rows, of)
    if other is not None:
        job = t.column("plasmient.job.id").combine_chunks()[int(rows[0])].as_py()
        raise ReportInputError(
            f"{name}: {other[0]} span(s) appear again with the same ids and times but another {other[1]}: one trace "
            f"ingested twice with other options (job id {job!r}); keeping either would hide the other's numbers, "
            "so report each file apart")
    if notes is not None:
        notes.append(f"{name}: {len(rows)} span(s) appeared twice with the same ids and times (a delivery retried): "
                     "counted once")
    keep = np.ones(len(span), bool)
    keep[rows] = False
    return SpanBatch(table=t.filter(pa.array(keep)), resources=batch.resources, summaries=batch.summaries)


# The numbers a second ingest of one trace with other options (--gpu-model, --gpu-price, --peak-tflops,
# --baseline-mfu) changes: a repeat that differs in one of them is not a retried delivery.
_REPEAT_NUMBERS = ("plasmient.mfu", "plasmient.ideal_s", "plasmient.flops", "plasmient.cost.usd",
                   "plasmient.wasted_s", "plasmient.busy_s")


def _other_numbers(t: pa.Table, rows: np.ndarray, of: np.ndarray) -> tuple[int, str] | None:
    """(how many repeats, which attribute) where a repeated span's numbers differ from its first copy's."""
    for column in _REPEAT_NUMBERS:
        if column not in t.column_names:
            continue
        values = pc.fill_null(t.column(column).cast(pa.float64()), np.nan).to_numpy()
        a, b = values[rows], values[of]
        differ = ~((a == b) | (np.isnan(a) & np.isnan(b)))
        if differ.any():
            return int(differ.sum()), column
    return None


def file_head(path: Path, size: int = 4096) -> bytes:
    """The first ``size`` bytes of the file, decompressed when it is gzip."""
    from plasmient_trace.export.otlp_json_read import open_span_file

    with open_span_file(path) as (_, f):
        return f.read(size)


def _check_times(name: str, batch: SpanBatch) -> None:
    """Spans must have non-negative epoch times and end no earlier than they start."""
    if not len(batch):
        return
    start = batch.table.column("start_ns").to_numpy()
    end = batch.table.column("end_ns").to_numpy()
    bad = (start < 0) | (end < start)
    if bad.any():
        raise ReportInputError(f"{name}: {int(bad.sum())} span(s) end before they start or have negative "
                               "timestamps")


# Floating-point slack on a share's upper bound: a ratio of sums can land a few ulps above 1.
_SHARE_SLACK = 1e-9


def _check_ranges(name: str, batch: SpanBatch) -> None:
    """Every numeric attribute within the range plasmient computes it in (conventions.value_range): a
    share in [0, 1], an amount at least 0. A value outside it (an edited file, another producer's
    attribute of the same name) would be drawn as if measured, so the file is refused, naming it."""
    for f in batch.table.schema:
        attribute = cv.ATTRIBUTE_BY_NAME.get(f.name)
        bounds = None if attribute is None else cv.value_range(attribute)
        if bounds is None:
            continue
        column = batch.table.column(f.name)
        if column.null_count == len(column):
            continue
        low, high = bounds
        extremes = pc.min_max(column)
        least, most = extremes["min"].as_py(), extremes["max"].as_py()
        if least >= low and most <= high + _SHARE_SLACK:
            continue
        outside = pc.or_(pc.less(column, low), pc.greater(column, high + _SHARE_SLACK))
        count = pc.sum(pc.cast(outside, pa.int64())).as_py()
        example = least if least < low else most
        span = "[0, 1]" if high == 1.0 else "[0, inf)"
        raise ReportInputError(f"{name}: {f.name} = {example!r} on {count} span(s), outside {span} where plasmient "
                               "writes it: an edited file, or another producer's attribute of that name")


def run_report(args: argparse.Namespace) -> int:
    from plasmient_trace.report.html import write_report
    from plasmient_trace.report.summary import progress, render_summary

    console = _console(stderr=True)  # progress and what is said about the run; the summary itself is stdout's
    try:
        args.files = stdin_for_dash(args.files, "zcat spans.jsonl.gz | plasmient report -")
        if args.html:
            check_output_path(args.html)  # before the reading and the summary, not after them
            check_not_an_input(args.html, list(args.files))
        notes: list[str] = []
        with progress(quiet=args.quiet, console=console) as update:
            batch = read_span_files(list(args.files), notes, progress=update)
    except (ReportInputError, OutputError, ValueError) as exc:
        # Plain print, not the rich console: rich wraps long lines, and this must stay one line.
        say_error("plasmient report", str(exc))
        return 2
    out = None
    if args.html:
        # written before the summary is shown: a report that cannot be written is one line (the tables first,
        # then the error, read as a failure's output of 55 lines)
        title = args.title or "plasmient-trace: " + ", ".join(Path(f).name for f in args.files[:4]) + (" …" if len(args.files) > 4 else "")
        try:
            out = write_report(batch, args.html, title=title, fleet_gpus=args.fleet_gpus,
                               price_per_gpu_hour=args.price_per_gpu_hour, baseline_mfu=args.baseline_mfu)
        except OutputError as exc:
            say_error("plasmient report", str(exc))
            return 2
    if not args.quiet:
        for note in notes:
            print(f"plasmient report: {note}", file=sys.stderr)
        # the command's own output: `plasmient report spans.jsonl > summary.txt` or `| less -R` gets it
        render_summary(batch, console=_console(), top=args.top)
    if out is not None:
        if not args.quiet:
            # one line, the path as it is: rich would wrap it at the console's width and read [..] in it as markup
            console.print(f"report: {out} ({out.stat().st_size / 1e6:.2f} MB, {len(batch)} spans)", soft_wrap=True,
                          markup=False, highlight=False)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(prog="plasmient report", description=__doc__.splitlines()[0])
    add_report_arguments(parser)
    return run_report(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
