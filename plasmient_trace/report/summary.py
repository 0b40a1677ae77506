"""The terminal summary printed at the end of `plasmient ingest` / `plasmient run`.

Per step (one trace per step): wall time, util.resident beside MFU, the gap between them in
GPU-hours and dollars, and the top culprits as a chain kernel -> op -> module -> rank with the
step's suggestion. :func:`summary_rows` returns exactly the numbers :func:`render_summary` prints,
so tests (and the HTML report, which shows the same table) can check them. The number formats here
are mirrored one-for-one by ``assets/report.js``; change both together.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pyarrow as pa

from plasmient_trace.conventions import LEVELS, SpanBatch
from plasmient_trace.metrics.compute import FULL_COVERAGE
from plasmient_trace.report.frame import SpanFrame, weighted_mean
# the culprit rows live in report.culprits; these names are read from here too (html, diff_cli, tests)
from plasmient_trace.report.culprits import (  # noqa: F401
    _culprit, _ellipsize, _top_spans, _trace_culprits, chain_text, culprits_from_frame, merged_culprits, top_culprits)

MAX_STEP_ROWS = 20


# ---- number formats (mirrored in assets/report.js) -------------------------------------------


def _bad(x: float | None) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def _sig_decimals(ax: float, sig: int) -> int:
    return max(0, min(12, sig - 1 - math.floor(math.log10(ax))))


def _exp(x: float) -> str:
    """3 significant digits in exponent form, as JavaScript's toExponential(2) writes it (1.28e-7)."""
    mant, exp = f"{x:.2e}".split("e")
    return f"{mant}e{int(exp):+d}"


def one_decimal(v: float, signed: bool = False) -> str:
    """``v`` with one decimal, or two significant digits where one decimal would round a nonzero ``v`` to
    0.0 (below 0.05): a known small number must not read as a zero. ``signed``: with its + or - sign."""
    sign = "+" if signed else ""
    if v != 0 and abs(v) < 0.05:
        return f"{v:{sign}.{_sig_decimals(abs(v), 2)}f}"
    return f"{v:{sign}.1f}"


def fmt_pct(x: float | None) -> str:
    """A fraction as a percentage with one decimal, or two significant digits below 0.05% (an MI250's
    MFU of 8.8e-7 reads 0.000088%, not 0.0%: a known small number must not look like a zero); "n/a" for
    unknown (never 0). The page's fmtPct (assets/report.js) writes the same text."""
    if _bad(x):
        return "n/a"
    return one_decimal(x * 100) + "%"


def fmt_usd(x: float | None) -> str:
    """Dollars: cents from $1 up, else 4 significant digits, exponent form under a tenth of a cent
    (one step of a small job costs micro-dollars)."""
    if _bad(x):
        return "n/a"
    sign, ax = ("-" if x < 0 else ""), abs(x)
    if ax >= 1 or ax == 0:
        return f"{sign}${ax:,.2f}"
    if ax >= 1e-3:
        return f"{sign}${ax:.{_sig_decimals(ax, 4)}f}"
    return f"{sign}${_exp(ax)}"


def fmt_seconds(x: float | None) -> str:
    if _bad(x):
        return "n/a"
    ax = abs(x)
    if ax < 1e-3:  # two significant digits below 0.05 µs, so a known small time does not read as 0.0 µs
        return one_decimal(x * 1e6) + " µs"
    if ax < 1:
        return f"{x * 1e3:.2f} ms"
    if ax < 100:
        return f"{x:.3f} s"
    return f"{x:,.0f} s"


def fmt_gpu_hours(x: float | None, device: str = "GPU") -> str:
    """Device-hours: GPU-h, or CPU-h for a CPU run."""
    if _bad(x):
        return "n/a"
    ax = abs(x)
    unit = f"{device}-h"
    if ax >= 100:
        return f"{x:,.1f} {unit}"
    if ax == 0:
        return f"0 {unit}"
    if ax >= 1e-3:
        return f"{x:.{_sig_decimals(ax, 4)}f} {unit}"
    return f"{_exp(x)} {unit}"


# ---- rows ------------------------------------------------------------------------------------


def summary_rows(batch: SpanBatch, top: int = 5) -> list[dict[str, Any]]:
    """One row per trace (= per step of the job): the numbers the terminal summary prints."""
    if batch.table.num_rows == 0:
        return []
    return rows_from_frame(SpanFrame(batch), top)


def rows_from_frame(frame: SpanFrame, top: int = 5) -> list[dict[str, Any]]:
    batch = frame.batch
    top_rows = _top_spans(frame)
    culprits = {tr: [_culprit(c) for c in rows[:top]] for tr, (rows, _) in _trace_culprits(frame).items()}
    t = batch.table
    util, mfu = frame.num("plasmient.util.resident"), frame.num("plasmient.mfu")
    coverage, busy = frame.num("plasmient.flops.coverage"), frame.num("plasmient.busy_s")
    cost, wasted_usd, wasted_s = frame.num("plasmient.cost.usd"), frame.num("plasmient.cost.wasted_usd"), frame.num("plasmient.wasted_s")
    flops = frame.num("plasmient.flops")
    step_idx = frame.num("plasmient.step")
    steps = frame.is_level("step")
    # Only the top spans and the step spans are read as Python values; never the whole table.
    needed = np.union1d(top_rows, np.nonzero(steps)[0])
    needed_arr = pa.array(needed)

    def values(col: pa.Array) -> dict[int, Any]:
        return dict(zip(needed.tolist(), col.take(needed_arr).to_pylist()))

    names = values(t.column("name").combine_chunks())
    dtypes = values(frame.strings("plasmient.device.type"))
    job_col = values(frame.strings("plasmient.job.id"))
    sugg = values(frame.strings("plasmient.culprit.suggestion"))
    sampled = values(frame.strings("plasmient.sampled_depth"))
    culprit_wasted = frame.num("plasmient.culprit.wasted_s")
    rank_spans = np.bincount(frame.trace[frame.is_level("rank")], minlength=len(frame.trace_ids))
    # what the spans say of the peak and FLOPs, per trace (mfu_unknown_reason names no cause they do not show)
    peak_known = frame.traces_with(np.nan_to_num(frame.num("plasmient.peak_flops")) > 0)
    peak_unknown = frame.traces_with(frame.is_level("rank") & (frame.codes("plasmient.peak.source", {"unknown": 1}) == 1))
    flops_uncarried = frame.traces_with(frame.is_level("step") & (frame.codes("plasmient.flops.source", {"unknown": 1}) == 1))
    step_rows_by_trace: dict[int, np.ndarray] = {}
    order = np.argsort(frame.trace[steps], kind="stable")
    st_idx = np.nonzero(steps)[0][order]
    if st_idx.size:
        bounds = np.searchsorted(frame.trace[st_idx], np.arange(len(frame.trace_ids) + 1))
        for tr in range(len(frame.trace_ids)):
            step_rows_by_trace[tr] = st_idx[bounds[tr] : bounds[tr + 1]]

    by_trace: dict[int, list[int]] = {}
    for i in top_rows.tolist():
        by_trace.setdefault(int(frame.trace[i]), []).append(i)

    rows = []
    for tr, idx_list in by_trace.items():
        idx = np.array(idx_list)
        dev = frame.device_s[idx]
        if idx.size == 1:
            i = int(idx[0])
            wall, gpus, device_s = float(frame.wall_s[i]), float(frame.gpus[i]), float(frame.device_s[i])
        else:
            wall = frame.window_extent_s(idx)  # no fleet span: its ranks' windows' extent, as a fleet's window is
            gpus, device_s = float(frame.gpus[idx].sum()), float(dev.sum())
        u, m = weighted_mean(util[idx], dev), weighted_mean(mfu[idx], dev)

        def total(col: np.ndarray, idx: np.ndarray = idx) -> float | None:
            vals = col[idx]
            return None if np.isnan(vals).all() else float(np.nansum(vals))

        suggestion = next((sugg[i] for i in idx_list if sugg[i]), None)
        st = step_rows_by_trace.get(tr, np.array([], dtype=np.int64))
        if suggestion is None and st.size:
            # The step holding the most wasted culprit speaks for the trace.
            cw = np.nan_to_num(culprit_wasted[st], nan=-1.0)
            for j in st[np.argsort(-cw, kind="stable")].tolist():
                if sugg[j]:
                    suggestion = sugg[j]
                    break
        trace_culprits = culprits.get(tr, [])
        if suggestion is None:
            suggestion = next((c["suggestion"] for c in trace_culprits if c["suggestion"]), None)
        first = idx_list[0]
        step_val = step_idx[first]
        if np.isnan(step_val) and st.size:
            step_val = step_idx[st[0]]
        depths = sorted({sampled[j] for j in st.tolist() if sampled[j]})
        rows.append(
            {
                "trace_id": frame.trace_ids[tr].hex(),
                "job_id": job_col[first] or _resource_job(batch, frame, first),
                "step": None if np.isnan(step_val) else int(step_val),
                "name": names[first],
                "level": LEVELS[frame.level[first]] if frame.level[first] >= 0 else None,
                "ranks": int(rank_spans[tr]) if rank_spans.size > tr else 0,
                "gpus": gpus,
                "wall_s": wall,
                "device_s": device_s,
                "util": u,
                "mfu": m,
                "gap_gpu_hours": None if u is None or m is None else (u - m) * device_s / 3600.0,
                "cost_usd": total(cost),
                "wasted_usd": total(wasted_usd),
                "wasted_s": total(wasted_s),
                "flops": total(flops),  # the known FLOPs
                # over busy time; a live step-depth step carries its coverage but has no busy time of its
                # own (CPU), so its device time weighs it instead of hiding a known number
                "coverage": weighted_mean(coverage[idx], np.where(np.nan_to_num(busy[idx]) > 0, busy[idx], dev)),
                "peak": "known" if peak_known[tr] else ("unknown" if peak_unknown[tr] else None),  # None: not said
                "flops_uncarried": bool(flops_uncarried[tr]),  # a live step-depth step with no FLOPs to carry
                "device_type": dtypes[first],
                "sampled_depth": ",".join(depths) or None,
                "suggestion": suggestion,
                "culprits": trace_culprits,
            }
        )
    rows.sort(key=lambda r: (r["job_id"] or "", -1 if r["step"] is None else r["step"], r["trace_id"]))
    return rows


def rows_device(rows: list[dict[str, Any]]) -> str:
    """"CPU" when every summary row ran on a CPU, else "GPU"."""
    return "CPU" if all(r.get("device_type") == "cpu" for r in rows) else "GPU"


def mfu_unknown_reason(rows: list[dict[str, Any]]) -> str:
    """Why steps (summary rows) that all lack an MFU lack it, from what their spans show: no FLOP model at
    all (coverage 0), only zero-FLOP kernels known (collectives, copies), or a peak whose source a rank span
    says is unknown, or live step-depth steps with no FLOPs to carry; else (an edited file: MFU or the peak's
    attributes removed) that no reason is recorded."""
    covered = [r for r in rows if r.get("coverage")]
    if not covered and any(r.get("coverage") is not None for r in rows):
        return ("no kernel of these steps has a FLOP model (coverage 0%); record shapes (record_shapes=True) so "
                "the ops can be costed")
    # known FLOPs that are all 0 beside unknown ones: the spans leave their FLOPs absent
    if covered and all(not r.get("flops") and r["coverage"] < FULL_COVERAGE for r in covered):
        lo, hi = min(r["coverage"] for r in covered), max(r["coverage"] for r in covered)
        share = fmt_pct(lo) if lo == hi else f"{fmt_pct(lo)}-{fmt_pct(hi)}"
        return (f"the only kernels with known FLOPs do no math (collectives, copies: {share} of busy time) and "
                f"the others' FLOPs are unknown; the culprits say what each lacks")
    if all(r.get("flops_uncarried") for r in rows):
        return ("these steps ran at step depth with no full-depth step of the same input shapes to carry FLOPs "
                "from (flops.source unknown)")
    if all(r.get("peak") == "unknown" for r in rows):
        return f"the {rows_device(rows)}'s peak FLOP/s is unknown (pass a peak override)"
    return "the reason is not recorded in these spans (their FLOP coverage, FLOPs and peak show none)"


def _resource_job(batch: SpanBatch, frame: SpanFrame, i: int) -> str | None:
    ri = int(frame.resource_index[i])
    if 0 <= ri < len(batch.resources):
        job = batch.resources[ri].get("plasmient.job.id")
        return None if job is None else str(job)
    return None


def totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The whole batch in one line: device-time weighted util and MFU, summed gap and waste."""
    dev = np.array([r["device_s"] for r in rows], dtype=np.float64)
    util = np.array([np.nan if r["util"] is None else r["util"] for r in rows], dtype=np.float64)
    mfu = np.array([np.nan if r["mfu"] is None else r["mfu"] for r in rows], dtype=np.float64)

    def s(key: str) -> float | None:
        vals = [r[key] for r in rows if r[key] is not None]
        return float(sum(vals)) if vals else None

    known_mfu = ~np.isnan(mfu) & (dev > 0)
    return {
        "steps": len(rows),
        "device_s": float(dev.sum()),
        "wall_s": float(sum(r["wall_s"] for r in rows)),
        "util": weighted_mean(util, dev),
        "mfu": weighted_mean(mfu, dev),
        "gap_gpu_hours": s("gap_gpu_hours"),
        "cost_usd": s("cost_usd"),
        "wasted_usd": s("wasted_usd"),
        # what each of those covers: a total over some of the steps is said to be one
        "mfu_device_s": float(dev[known_mfu].sum()),
        "steps_with": {key: sum(r[key] is not None for r in rows) for key in ("util", "mfu", "gap_gpu_hours", "wasted_usd")},
    }


def partial_totals_note(tot: dict[str, Any]) -> str | None:
    """One line when the "all" row's MFU, util, gap or wasted $ come from only some of the steps (the others
    have none: an unknown peak or price, a live step with nothing to carry): which, and over what."""
    n, have = tot["steps"], tot["steps_with"]
    parts = []
    if tot["mfu"] is not None and have["mfu"] < n:
        share = tot["mfu_device_s"] / tot["device_s"] if tot["device_s"] > 0 else None
        parts.append(f"MFU is over the {have['mfu']} of {n} steps that have one ({fmt_pct(share)} of the device time)")
    by_count: dict[int, list[str]] = {}
    for key, label in (("util", "util.resident"), ("gap_gpu_hours", "gap"), ("wasted_usd", "wasted $")):
        if tot[key] is not None and have[key] < n:
            by_count.setdefault(have[key], []).append(label)
    for count, labels in by_count.items():
        parts.append(f"{' and '.join(labels)} {'adds' if len(labels) == 1 else 'add'} up {count} of {n} steps")
    return "all: " + "; ".join(parts) + " (the others have none)" if parts else None


# ---- rendering -------------------------------------------------------------------------------


def print_uncut(console: Any, table: Any) -> None:
    """Print a table of numbers that rich must not cut. A pipe or a CI log is an 80-column console to rich,
    and a table wider than that lost its last columns or ended a number in '…' ("$2.86" for $2.86e-7);
    here the console is widened for this table alone, so its lines run long and every number is whole."""
    from rich.measure import Measurement

    needed = Measurement.get(console, console.options.update_width(10_000), table).maximum
    if needed <= console.width:
        console.print(table)
        return
    saved = getattr(console, "_width", None)  # None: the console measures its terminal at each print
    console.width = needed
    try:
        console.print(table, crop=False)
    finally:
        console._width = saved


def render_summary(batch: SpanBatch, console: Any | None = None, top: int = 5) -> None:
    """Print the per-step table and the top culprits with their suggestions."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = console or Console(stderr=True)
    rows = summary_rows(batch, top=top)
    if not rows:
        console.print("[dim]plasmient: no spans to summarise[/dim]")
        return
    device = rows_device(rows)
    steps = Table(title=f"plasmient: where the {device} time went", title_justify="left", header_style="bold")
    for col, just in (
        ("step", "right"),
        ("ranks", "right"),
        # the device window util and MFU divide by (plasmient.device.window_s), not the step's CPU wall time
        ("window", "right"),
        ("cov.", "right"),
        ("util.resident", "right"),
        ("MFU", "right"),
        ("gap", "right"),
        ("wasted $", "right"),
    ):
        # MFU and its coverage are the point of the table: never squeezed on a narrow terminal
        steps.add_column(col, justify=just, no_wrap=True, min_width={"MFU": 6, "cov.": 5, "util.resident": 13}.get(col))  # type: ignore[arg-type]
    shown = rows if len(rows) <= MAX_STEP_ROWS else rows[:MAX_STEP_ROWS]
    for r in shown:
        steps.add_row(
            "n/a" if r["step"] is None else str(r["step"]),
            str(r["ranks"]),
            fmt_seconds(r["wall_s"]),
            fmt_pct(r["coverage"]),
            fmt_pct(r["util"]),
            Text(fmt_pct(r["mfu"]), style=_mfu_style(r["mfu"])),
            fmt_gpu_hours(r["gap_gpu_hours"], device),
            fmt_usd(r["wasted_usd"]),
        )
    if len(rows) > len(shown):
        steps.add_row(f"… {len(rows) - len(shown)} more", "", "", "", "", "", "", "", style="dim")
    if len(rows) > 1:
        tot = totals(rows)
        steps.add_section()
        steps.add_row(
            "all",
            "",
            fmt_seconds(tot["wall_s"]),
            "",
            fmt_pct(tot["util"]),
            Text(fmt_pct(tot["mfu"]), style=_mfu_style(tot["mfu"])),
            fmt_gpu_hours(tot["gap_gpu_hours"], device),
            fmt_usd(tot["wasted_usd"]),
            style="bold",
        )
    print_uncut(console, steps)
    jobs = list(dict.fromkeys(r["job_id"] for r in rows if r.get("job_id")))
    if len(jobs) > 1:
        # several runs appended to one file (each live run has its own job id): step numbers repeat
        named = ", ".join(f"{j} ({sum(r.get('job_id') == j for r in rows)} steps)" for j in jobs[:4])
        # Text(), not markup: a job id is the user's text, and "[/x]" in it was a rich MarkupError traceback
        console.print(Text(f"{len(jobs)} jobs in these spans: {named}{', …' if len(jobs) > 4 else ''}; "
                           "rows are sorted by job, then step, and the all row adds them all up", style="dim"))
    partial = partial_totals_note(totals(rows)) if len(rows) > 1 else None
    if partial:
        console.print(Text(partial, style="dim"))
    note = collective_note(batch)
    if note:
        console.print(Text(note, style="dim"))
    if all(r["mfu"] is None for r in rows):
        console.print(Text(f"MFU n/a: {mfu_unknown_reason(rows)}.", style="yellow"))
    elif any(r.get("coverage") is not None and r["coverage"] < 0.95 for r in rows):
        console.print("[dim]coverage = share of busy device time whose FLOPs are known; MFU counts only those FLOPs "
                      "(a lower bound where coverage is below 100%).[/dim]")

    merged, left_out = merged_culprits(SpanFrame(batch), top)
    culprits = [_culprit(c) for c in merged]
    if not culprits:
        console.print("[dim]no culprits: no kernel, op or step named any wasted time[/dim]")
        return
    table = Table(title="top culprits (kernel -> op -> module -> rank)" + culprit_steps_note(rows), title_justify="left",
                  header_style="bold")
    table.add_column("#", justify="right")
    table.add_column("culprit", overflow="fold")
    table.add_column("bound", no_wrap=True)
    table.add_column("wasted", justify="right", no_wrap=True)
    table.add_column("suggestion", overflow="fold")
    for n, c in enumerate(culprits, 1):
        label = ("≥ " if c["lower_bound"] else "") + fmt_seconds(c["wasted_s"])
        calls = c.get("count")
        where = chain_text(c, width=60)
        if calls:
            where += f"\n{calls} call{'s' if calls != 1 else ''}" + (f" in {c['layers']} modules" if (c.get("layers") or 0) > 1 else "")
        # Text(), not markup: kernel names such as "[device idle]" or "Kernel<[128]>" are not rich tags, nor is
        # anything a span file says
        table.add_row(str(n), Text(where), Text(c["bound"] or ""), label, Text(c["suggestion"] or ""))
    console.print(table)
    note = culprit_table_note(culprits, left_out, top)
    if note:
        console.print(Text(note, style="dim"))


def culprit_table_note(culprits: list[dict[str, Any]], left_out_s: float, top: int) -> str | None:
    """What the culprits table cannot say by its rows alone: that a "≥" row may be short (a list it was summed
    from was cut), that a row the lists left out may outrank the last rows, or, when it lists fewer than
    ``top``, that there are no more (rather than printing fewer rows without a word)."""
    lines = []
    if any(c["lower_bound"] for c in culprits):
        lines.append("≥: at least this much; a step's or rank's culprit list it was summed from was cut and may hold more")
    unknown = left_out_s != left_out_s
    last = culprits[-1]["wasted_s"] if culprits else None
    if unknown:
        lines.append("these span files do not say how much their culprit lists left out: a row they left out may "
                     "be missing or short here")
    elif left_out_s > 0 and (len(culprits) < top or (last is not None and left_out_s > last)):
        lines.append(f"the span files' culprit lists left out rows of up to {fmt_seconds(left_out_s)} each"
                     + (f": fewer than the {top} asked for" if len(culprits) < top else ", which may outrank the last rows"))
    elif len(culprits) < top:
        lines.append(f"{len(culprits)} culprit rows: every kernel group and idle row that wasted time")
    return "; ".join(lines) or None


def culprit_steps_note(rows: list[dict[str, Any]]) -> str:
    """The culprits table sums every step's culprit rows: when some steps have none (a live run's steps sampled at
    step depth), over how many steps its times are ("" when every step has culprits)."""
    unnamed = [r for r in rows if not r["culprits"]]
    if not unnamed:
        return ""
    note = f", summed over the {len(rows) - len(unnamed)} of {len(rows)} steps that name culprits"
    return note + ("; the others ran at step depth" if all(r["sampled_depth"] == "step" for r in unnamed) else "")


def collective_note(batch: SpanBatch) -> str | None:
    """One line on the collectives, from the step spans: for those whose NCCL metadata gave a message size, total
    bytes, their bytes-weighted bus bandwidth (and its share of the link peak) and the longest one; and how many
    had no size (no NCCL metadata: symmetric-memory all-reduces, older Kineto), which no bandwidth includes."""
    steps = [r for r in batch.table.select(["plasmient.level", "plasmient.comm.bytes", "plasmient.comm.busbw_gbs",
                                            "plasmient.comm.link_peak_gbs", "plasmient.comm.slowest.collective",
                                            "plasmient.comm.slowest.bytes", "plasmient.comm.slowest.busbw_gbs",
                                            "plasmient.comm.slowest.duration_s", "plasmient.comm.unsized"]).to_pylist()
             if r["plasmient.level"] == "step"]
    unsized = sum(r["plasmient.comm.unsized"] or 0 for r in steps)
    rows = [r for r in steps if r["plasmient.comm.busbw_gbs"] is not None]
    if not rows:
        if not unsized:
            return None
        return (f"collectives: {unsized:,} kernel(s), none with a message size (no NCCL metadata in the trace), "
                f"so no bus bandwidth")
    total = sum(r["plasmient.comm.bytes"] for r in rows)
    bus = sum(r["plasmient.comm.bytes"] * r["plasmient.comm.busbw_gbs"] for r in rows) / total
    peak = max((r["plasmient.comm.link_peak_gbs"] or 0.0 for r in rows), default=0.0)
    share = f", {fmt_pct(bus / peak)} of the {peak:.0f} GB/s link peak" if peak else ""
    worst = max(rows, key=lambda r: r["plasmient.comm.slowest.duration_s"] or 0.0)
    without = (f"; {unsized:,} more collective kernel(s) had no message size (no NCCL metadata) and are in none of "
               f"these" if unsized else "")
    return (f"collectives: {total / 1e6:.4g} MB over {len(rows)} step spans, bus bandwidth {bus:.3g} GB/s "
            f"(bytes-weighted nccl-tests busbw{share}); longest sized: {worst['plasmient.comm.slowest.collective']} "
            f"{worst['plasmient.comm.slowest.bytes'] / 1e6:.3g} MB in {fmt_seconds(worst['plasmient.comm.slowest.duration_s'])} "
            f"at {worst['plasmient.comm.slowest.busbw_gbs']:.3g} GB/s{without}")


def _mfu_style(mfu: float | None) -> str:
    if mfu is None:
        return "dim"
    from plasmient_trace.conventions import DEFAULT_BASELINE_MFU

    if mfu >= DEFAULT_BASELINE_MFU:
        return "green"
    return "yellow" if mfu >= DEFAULT_BASELINE_MFU / 2 else "red"


@contextmanager
def progress(quiet: bool = False, console: Any | None = None) -> Iterator[Callable[[str, int, int], None]]:
    """A progress bar for long ingests; yields `update(label, done, total)`, the callback shape
    `pipeline.ingest_paths(progress=...)` takes. `quiet`, or output that is not a terminal, draws nothing."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    console = console or Console(stderr=True)
    if quiet or not console.is_terminal:
        yield lambda label, done, total: None
        return
    with Progress(
        # the label names the user's files: plain text, never rich markup ("[/b]" in a name raised MarkupError)
        TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=True
    ) as bar:
        task = bar.add_task("ingesting", total=None)

        def update(label: str, done: int, total: int) -> None:
            bar.update(task, description=label, completed=done, total=total or None)

        yield update
