"""The `plasmient diff A B` command: read both inputs, print the comparison, gate CI on an MFU drop.

An input is a span file (OTLP JSON lines, sniffed by content, so ``traces.json`` works too), a Parquet
``spans.parquet`` (or the directory ``--parquet`` wrote), or a profiler trace that is ingested first with the
usual stitch flags. Exit status: 0, 1 when ``--fail-if-mfu-drops`` trips, 2 for bad input (one line naming
the file), including a gate that cannot be judged because a side has no MFU. The comparison is
``report.diff``; this module only reads, prints and decides the status.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa

from plasmient_trace.conventions import SpanBatch
from plasmient_trace.export.files import remove_written_files
from plasmient_trace.export.sinks import (OutputError, check_distinct_outputs, check_not_an_input, check_output_path,
                                         write_output_file)
from plasmient_trace.messages import say_error
from plasmient_trace.report import diff as D
from plasmient_trace.report.summary import (_ellipsize, _sig_decimals, fmt_pct, fmt_seconds, fmt_usd, one_decimal,
                                             print_uncut, progress)
from plasmient_trace.sources.rawinput import InputError, limits

NAME_WIDTH = 70


class DiffInputError(ValueError):
    """An input the diff cannot use; str(err) is one line naming the file."""


def parse_percent(text: str) -> float:
    """'5%' or '5' -> 0.05: the relative MFU drop the CI gate tolerates."""
    try:
        value = float(text.strip().removesuffix("%"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a percentage (e.g. 5%)") from None
    if not 0 <= value < 100:
        raise argparse.ArgumentTypeError(f"{text!r}: the drop must be between 0% and 100%")
    return value / 100.0 + 0.0  # -0 is 0: the limit line said "--0%"


def add_diff_arguments(parser: argparse.ArgumentParser) -> None:
    from plasmient_trace.cli import _output_path, _positive_int, add_stitch_arguments

    parser.add_argument("a", metavar="A", help="the baseline: span file (.jsonl[.gz], spans.parquet or its directory), a trace, or a directory of a run's "
                             "rank traces; - or a pipe reads a stream")
    parser.add_argument("b", metavar="B", help="the run compared with it, in any of the same forms")
    parser.add_argument("--fail-if-mfu-drops", metavar="PCT", type=parse_percent, default=None,
                        help="exit 1 when B's step-weighted MFU is more than PCT (relative, e.g. 5%%) below A's")
    parser.add_argument("--per-step", action="store_true",
                        help="divide each side's times, FLOPs and $ by its number of detailed steps, those they come from "
                             "(runs that profiled, or sampled at full depth, different step counts)")
    parser.add_argument("--top", type=_positive_int, default=10, help="rows per table (default 10)")
    parser.add_argument("--json", type=_output_path, metavar="OUT.json", help="also write every row of the comparison as JSON")
    parser.add_argument("--parquet", type=_output_path, metavar="OUT.parquet", help="also write every row as one Parquet table (report.diff.DIFF_ROW_SCHEMA)")
    parser.add_argument("--html", type=_output_path, metavar="OUT.html", help="also write B's HTML report with the comparison as its first section")
    parser.add_argument("--quiet", "-q", action="store_true", help="print no tables (the exit status still applies)")
    add_stitch_arguments(parser)


def register(sub: Any) -> None:
    """Add `diff` to the top-level `plasmient` subcommands (called by plasmient_trace/cli.py)."""
    parser = sub.add_parser("diff", help="compare two runs (span files or traces) per module, op and kernel; CI gate on MFU")
    add_diff_arguments(parser)
    parser.set_defaults(func=run_diff)


# ---- inputs -------------------------------------------------------------------------------------


def _read_parquet(path: Path) -> SpanBatch:
    import pyarrow.parquet as pq

    spans = path / "spans.parquet" if path.is_dir() else path
    if not spans.is_file():
        raise DiffInputError(f"{path}: no spans.parquet in this directory")
    table = pq.read_table(spans)
    needed = {"trace_id", "span_id", "parent_span_id", "name", "plasmient.level"}
    if not needed <= set(table.column_names):
        raise DiffInputError(f"{spans}: not a plasmient span table (missing {', '.join(sorted(needed - set(table.column_names)))})")
    # Hex-string ids join parent to child as well as binary ones do; only the resource links are lost.
    if "resource_index" not in table.column_names:
        table = table.append_column("resource_index", pa.array([0] * table.num_rows, pa.int32()))
    return SpanBatch(table, [])


def _rank_traces(directory: Path) -> list[Path]:
    """The traces directly in a directory of a run's ranks (as ``plasmient ingest DIR`` reads them)."""
    from plasmient_trace.sources.rawinput import InputError, traces_in

    try:
        return [Path(p) for p in traces_in([str(directory)])]
    except InputError:
        return []


def _ingest(paths: list[Path], args: argparse.Namespace, job_id: str,
            progress: Callable[[str, int, int], None] | None) -> SpanBatch:
    """A run's traces (one per rank) as spans, stitched as `plasmient ingest` stitches them."""
    from plasmient_trace.cli import stitch_options_from_args
    from plasmient_trace.pipeline import ingest_paths

    return ingest_paths(paths, stitch_options_from_args(args, job_id, inputs=len(paths)), progress=progress).batch


def load_side(path_text: str, args: argparse.Namespace,
              progress: Callable[[str, int, int], None] | None = None) -> SpanBatch:
    """One input as a SpanBatch; every failure is a DiffInputError naming the file. A pipe or stdin (``-``)
    is read once into a private temporary file, since what it holds is known only from its bytes, and
    the reader of that kind then opens it again."""
    path = Path("/dev/stdin" if path_text == "-" else path_text)
    if not path.exists() or path.is_dir() or path.is_file():
        return _load_file(path, args, progress=progress)
    with tempfile.TemporaryDirectory(prefix="plasmient-diff-") as tmp:
        copy = Path(tmp) / "stream"
        # under the cap a trace is read under: /dev/zero was copied until the disk was full
        try:
            max_bytes, _ = limits()
            with open(path, "rb") as src, open(copy, "wb") as dst:
                while block := src.read(min(1 << 20, max_bytes + 1 - dst.tell())):
                    dst.write(block)
                    if dst.tell() > max_bytes:
                        raise DiffInputError(f"{path}: over {max_bytes / 1e6:,.0f} MB, the size limit "
                                             "(raise PLASMIENT_MAX_TRACE_BYTES to accept it)")
        except InputError as err:
            raise DiffInputError(str(err)) from None
        except OSError as err:
            raise DiffInputError(f"{path}: cannot read ({err.strerror or err})") from None
        try:
            return _load_file(copy, args, job_id=path.name.split(".")[0], progress=progress)
        except DiffInputError as err:
            raise DiffInputError(str(err).replace(str(copy), str(path))) from None


def _load_file(path: Path, args: argparse.Namespace, job_id: str | None = None,
               progress: Callable[[str, int, int], None] | None = None) -> SpanBatch:
    from plasmient_trace.cli import _job_id_of_input
    from plasmient_trace.report.cli import SPAN_FILE_SUFFIXES, ReportInputError, file_head, read_span_files
    from plasmient_trace.sources.kineto import TraceFormatError

    path_text = str(path)
    if not path.exists():
        raise DiffInputError(f"{path}: no such file")
    try:
        head = b"" if path.is_dir() else file_head(path)
        ranks = _rank_traces(path) if path.is_dir() and not (path / "spans.parquet").is_file() else []
        # a live run's ranks each write their span file (traces.rank<R>.jsonl): the folder reads as report reads it
        span_files = path.is_dir() and not ranks and not (path / "spans.parquet").is_file() and any(
            f.name.endswith(SPAN_FILE_SUFFIXES) for f in path.iterdir())
        if ranks:
            batch = _ingest(ranks, args, args.job_id or job_id or _job_id_of_input(path_text), progress)
        elif path.is_dir() and not span_files or path.suffix == ".parquet" or head[:4] == b"PAR1":
            batch = _read_parquet(path)
        elif span_files or b'"resourceSpans"' in head:
            notes: list[str] = []
            batch = read_span_files([path_text], notes, progress=progress)
            for note in notes if not getattr(args, "quiet", False) else ():
                print(f"plasmient diff: {note}", file=sys.stderr)
        else:
            batch = _ingest([path], args, args.job_id or job_id or _job_id_of_input(path_text), progress)
    except (ReportInputError, TraceFormatError, DiffInputError) as err:
        raise DiffInputError(str(err) if str(err).startswith(str(path)) else f"{path}: {err}") from None
    except (ValueError, IndexError, TypeError, ArithmeticError, MemoryError, OSError, EOFError, zlib.error,
            pa.ArrowException) as err:
        what = (str(err).splitlines() or [""])[0][:200]
        raise DiffInputError(f"{path}: cannot read ({type(err).__name__}{': ' + what if what else ''})") from None
    if len(batch) == 0:
        raise DiffInputError(f"{path}: no spans to compare")
    return batch


# ---- output -------------------------------------------------------------------------------------


def _delta(fmt: Any, x: float | None) -> str:
    if x is None:
        return "n/a"
    return ("+" if x > 0 else "") + fmt(x) if x != 0 else "0"


def _pp(x: float | None) -> str:
    """A change of MFU in percentage points: one decimal, two significant digits below 0.05 pp (as fmt_pct),
    so a small change does not read +0.0 pp, a zero."""
    if x is None:
        return "n/a"
    if not x:
        return "0"
    return one_decimal(x * 100, signed=True) + " pp"


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else num / den


def _flops(x: float | None) -> str:
    """FLOPs with an SI prefix and 3 significant digits (1.65 TFLOP), as the page's fmtSi writes them."""
    if x is None:
        return "n/a"
    if x == 0:
        return "0"
    prefixes, i, v = ("", "k", "M", "G", "T", "P", "E"), 0, x
    while abs(v) >= 1000 and i < len(prefixes) - 1:
        v, i = v / 1000, i + 1
    return f"{v:.3g} {prefixes[i]}FLOP"


def render(result: dict[str, Any], console: Any, top: int) -> None:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    t = result["totals"]
    per = " (per step)" if result["per_step"] else ""
    head = Table(title=f"plasmient diff{per}: A = {result['a']}, B = {result['b']}", title_justify="left", header_style="bold")
    for col in ("", "A", "B", "change"):
        head.add_column(col, justify="right" if col else "left", no_wrap=True)
    head.add_row("steps", str(t["steps"]["a"]), str(t["steps"]["b"]), f"{t['steps']['delta']:+d}")
    sampled = _sampled_note(result)
    if sampled:
        d = t["detailed_steps"]
        head.add_row("  at full depth", str(d["a"]), str(d["b"]), f"{d['delta']:+d}")
    head.add_row("MFU (step-weighted)", fmt_pct(t["mfu"]["a"]), fmt_pct(t["mfu"]["b"]), _pp(t["mfu"]["delta"]))
    head.add_row("device time (busy)", fmt_seconds(t["busy_s"]["a"]), fmt_seconds(t["busy_s"]["b"]), _delta(fmt_seconds, t["busy_s"]["delta"]))
    head.add_row("FLOPs", _flops(t["flops"]["a"]), _flops(t["flops"]["b"]), _delta(_flops, t["flops"]["delta"]))
    # the FLOPs are the known ones: how much of each side's busy time that is
    cov = {side: _ratio(t["covered_s"][side], t["busy_s"][side]) for side in ("a", "b")}
    head.add_row("  busy time with known FLOPs", fmt_pct(cov["a"]), fmt_pct(cov["b"]),
                 _pp(None if None in cov.values() else D.change(cov["a"], cov["b"])))
    head.add_row("wasted", fmt_seconds(t["wasted_s"]["a"]), fmt_seconds(t["wasted_s"]["b"]), _delta(fmt_seconds, t["wasted_s"]["delta"]))
    head.add_row("wasted $", fmt_usd(t["wasted_usd"]["a"]), fmt_usd(t["wasted_usd"]["b"]), _delta(fmt_usd, t["wasted_usd"]["delta"]))
    print_uncut(console, head)
    if sampled:
        console.print(Text(sampled, style="dim"))
    for dim in D.DIMENSIONS:
        rows = result[dim]
        table = Table(title=f"by {dim}{' pattern' if dim == 'module' else ' name'} (largest change in wasted time first)",
                      title_justify="left", header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False)
        # Numbers first, then the name, cut to NAME_WIDTH, on the row's one line: folded into the width the
        # numbers left on an 80-column console (a pipe, a CI log) it read "aten" for aten::nll_loss_backward.
        for col in ("Δ time", "Δ FLOPs", "MFU A → B", "Δ wasted", "Δ wasted $"):
            table.add_column(col, justify="right", no_wrap=True)
        table.add_column(dim, no_wrap=True)
        for r in rows[:top]:
            name = _ellipsize(r["name"] or "", NAME_WIDTH) + ("" if r["in_a"] else " (new)") + ("" if r["in_b"] else " (gone)")
            table.add_row(_delta(fmt_seconds, r["busy_s_delta"]), _delta(_flops, r["flops_delta"]),
                          f"{fmt_pct(r['mfu_a'])} → {fmt_pct(r['mfu_b'])}", _delta(fmt_seconds, r["wasted_s_delta"]),
                          _delta(fmt_usd, r["wasted_usd_delta"]), Text(name))
        if len(rows) > top:
            table.add_row(*[""] * 5, f"… {len(rows) - top} more", style="dim")
        print_uncut(console, table)
    console.print(Text("time and wasted are exclusive (each kernel once, host gaps as [device idle]); a row's MFU "
                       "counts its known FLOPs only (n/a where none is known, or only zeros beside unknown ones; coverage per row in "
                       "--json)", style="dim"))


def _sampled_note(result: dict[str, Any]) -> str:
    """What the totals and tables cover when a side sampled steps at step depth ("" when neither did)."""
    t = result["totals"]
    d, steps = t["detailed_steps"], t["steps"]
    if d["a"] == steps["a"] and d["b"] == steps["b"]:
        return ""
    note = ("device time, FLOPs, waste and the tables below are over the full-depth steps alone (the others ran at "
            "step depth and exported no kernels); MFU is over every step that has one")
    if d["a"] != d["b"] and not result["per_step"]:
        note += f"; A has {d['a']} full-depth steps and B {d['b']}: compare them with --per-step"
    return note


def gate(result: dict[str, Any], threshold: float | None) -> tuple[int, str | None]:
    """The CI exit status and the line that explains it."""
    if threshold is None:
        return D.EXIT_OK, None
    drop = D.mfu_drop(result)
    mfu = result["totals"]["mfu"]
    if drop is None:
        if mfu["a"] == 0:
            return D.EXIT_BAD_INPUT, f"{result['a']}: its step-weighted MFU is 0, so a relative drop is undefined"
        side = result["a"] if mfu["a"] is None else result["b"]
        return D.EXIT_BAD_INPUT, f"{side}: no step has a known MFU, so --fail-if-mfu-drops cannot be judged"
    # a drop of exactly the limit passes: 0.95 x the MFU computes as a 5.00000000000004% drop, which failed
    # a 5% gate with a line that read "-5.0% relative; limit -5%"
    failed = drop - threshold > _GATE_SLACK
    digits = 1
    while digits < 6 and abs(drop - threshold) > _GATE_SLACK and round(drop * 100, digits) == round(threshold * 100, digits):
        digits += 1  # near the limit: as many digits as tell the drop from it
    if drop and abs(drop * 100) < 0.05:
        digits = max(digits, _sig_decimals(abs(drop * 100), 2))  # a small change, not "+0.0%", which reads as none
    relative = "0%" if drop == 0 else f"{-drop * 100:+.{digits}f}%"
    line = (f"step-weighted MFU {fmt_pct(mfu['a'])} -> {fmt_pct(mfu['b'])} "
            f"({relative} relative; limit -{threshold * 100:g}%)") + _partial_mfu(result)
    return (D.EXIT_MFU_DROPPED, f"MFU dropped: {line}") if failed else (D.EXIT_OK, line)


# How far past the limit a relative drop must be to fail: float rounding of MFU ratios, not a real drop.
_GATE_SLACK = 1e-9


def _partial_mfu(result: dict[str, Any]) -> str:
    """The gate line's ending for a side whose MFU leaves out steps that have none ("" when neither does)."""
    t = result["totals"]
    parts = [f"{side.upper()} over {t['mfu_steps'][side]} of {t['steps'][side]} steps" for side in ("a", "b")
             if t["mfu_steps"][side] < t["steps"][side]]
    return f" ({', '.join(parts)}: the others have no MFU)" if parts else ""


def run_diff(args: argparse.Namespace) -> int:
    from plasmient_trace.cli import _console, stdin_for_dash

    try:
        stdin_for_dash([args.a, args.b], "plasmient diff before.jsonl - < after.jsonl")
        check_distinct_outputs({"--json": args.json, "--parquet": args.parquet, "--html": args.html})
        for out in (args.json, args.parquet, args.html):
            if out:
                check_output_path(out)  # before the reading and the tables, not after them
                check_not_an_input(out, [args.a, args.b, getattr(args, "model_config", None)])
        with progress(quiet=args.quiet, console=_console(stderr=True)) as update:  # drawn on a terminal only
            a = D.side_from_batch(load_side(args.a, args, update), args.a)
            batch_b = load_side(args.b, args, update)
            b = D.side_from_batch(batch_b, args.b)
    except (DiffInputError, OutputError, ValueError) as err:
        say_error("plasmient diff", str(err))  # plain print: rich would wrap the one line
        return D.EXIT_BAD_INPUT
    result = D.diff(a, b, per_step=args.per_step)
    if not args.quiet:
        render(result, _console(), max(args.top, 1))
    written: list[str] = []
    try:
        if args.json:
            text = json.dumps(result, indent=1, allow_nan=False).encode()
            write_output_file(args.json, lambda f: f.write(text))
            written.append(args.json)
        if args.parquet:
            import pyarrow.parquet as pq

            rows = D.rows_table(result)
            write_output_file(args.parquet, lambda f: pq.write_table(rows, f, compression="zstd"))
            written.append(args.parquet)
        if args.html:
            from plasmient_trace.report.html import write_report

            # B's own report, with the comparison as its first section
            write_report(batch_b, args.html, title=f"plasmient diff: {Path(args.a).name} → {Path(args.b).name}",
                         diff=result)
    except OutputError as err:
        # all the outputs or none: a JSON beside a missing page reads as a run that went through
        remove_written_files(written)
        say_error("plasmient diff", str(err))
        return D.EXIT_BAD_INPUT
    status, line = gate(result, args.fail_if_mfu_drops)
    if line:
        if status == D.EXIT_BAD_INPUT:
            say_error("plasmient diff", line)
        else:
            print(f"plasmient diff: {line}", file=sys.stderr)
    return status
