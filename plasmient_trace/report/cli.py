"""`plasmient report FILE.jsonl [FILE.jsonl ...] --html OUT.html`: summary and HTML report from span files.

Several files (e.g. one per rank, or one per node) are read into one batch, so the report covers
the whole job. Wired into the top-level parser by plasmient_trace/cli.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from plasmient_trace.conventions import DEFAULT_BASELINE_MFU, SpanBatch


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE.jsonl", help="OTLP JSON lines span files (.gz allowed); several are merged")
    parser.add_argument("--html", metavar="OUT.html", help="write the self-contained HTML report here")
    parser.add_argument("--title", default=None, help="page title (default: the input file names)")
    parser.add_argument("--fleet-gpus", type=int, default=8, help="fleet size the bill starts with (editable in the page)")
    parser.add_argument("--price-per-gpu-hour", type=float, default=None, help="USD per GPU-hour for the bill (default: the trace's own cost, else an assumed price)")
    parser.add_argument("--baseline-mfu", type=float, default=DEFAULT_BASELINE_MFU, help="MFU below which time counts as wasted in the bill")
    parser.add_argument("--top", type=int, default=5, help="culprits to list in the terminal summary")
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


def run_report(args: argparse.Namespace) -> int:
    from rich.console import Console

    from plasmient_trace.export.otlp_json import read_jsonl
    from plasmient_trace.report.html import write_report
    from plasmient_trace.report.summary import render_summary

    console = Console(stderr=True)
    missing = [f for f in args.files if not Path(f).is_file()]
    if missing:
        console.print(f"[red]plasmient report: no such file: {', '.join(missing)}[/red]")
        return 2
    try:
        batch = merge_batches([read_jsonl(f) for f in args.files])
    except ValueError as exc:
        console.print(f"[red]plasmient report: {exc}[/red]")
        return 2
    if not args.quiet:
        render_summary(batch, console=console, top=args.top)
    if args.html:
        title = args.title or "plasmient-trace: " + ", ".join(Path(f).name for f in args.files[:4]) + (" …" if len(args.files) > 4 else "")
        out = write_report(
            batch,
            args.html,
            title=title,
            fleet_gpus=args.fleet_gpus,
            price_per_gpu_hour=args.price_per_gpu_hour,
            baseline_mfu=args.baseline_mfu,
        )
        if not args.quiet:
            console.print(f"report: {out} ({out.stat().st_size / 1e6:.2f} MB, {len(batch)} spans)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="plasmient report", description=__doc__.splitlines()[0])
    add_report_arguments(parser)
    return run_report(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
