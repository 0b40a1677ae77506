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
import pyarrow.compute as pc

from plasmient_trace.conventions import LEVELS, SpanBatch
from plasmient_trace.report.frame import SpanFrame, weighted_mean

# Culprit sources, best first: real kernel spans; op spans (CPU-only traces have no kernels);
# the step's own culprit.* attributes (step-level sampling dropped the subtree).
_SOURCE_KERNEL, _SOURCE_OP, _SOURCE_STEP = 0, 1, 2
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


def fmt_pct(x: float | None) -> str:
    """A fraction as a percentage with one decimal; "n/a" for unknown (never 0)."""
    return "n/a" if _bad(x) else f"{x * 100:.1f}%"


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
    if ax < 1e-3:
        return f"{x * 1e6:.1f} µs"
    if ax < 1:
        return f"{x * 1e3:.2f} ms"
    if ax < 100:
        return f"{x:.3f} s"
    return f"{x:,.0f} s"


def fmt_gpu_hours(x: float | None) -> str:
    if _bad(x):
        return "n/a"
    ax = abs(x)
    if ax >= 100:
        return f"{x:,.1f} GPU-h"
    if ax == 0:
        return "0 GPU-h"
    if ax >= 1e-3:
        return f"{x:.{_sig_decimals(ax, 4)}f} GPU-h"
    return f"{_exp(x)} GPU-h"


# ---- rows ------------------------------------------------------------------------------------


def _culprit_instances(frame: SpanFrame) -> pa.Table:
    """Every span that could be named as a culprit, with its chain, from the best source available."""
    cached = getattr(frame, "_culprit_instances", None)
    if cached is None:
        cached = _build_culprit_instances(frame)
        frame._culprit_instances = cached  # type: ignore[attr-defined]  # rows and totals share it
    return cached


def _build_culprit_instances(frame: SpanFrame) -> pa.Table:
    t = frame.batch.table
    names = t.column("name").combine_chunks()
    module_path = frame.strings("plasmient.module.path")
    module_label = pc.coalesce(module_path, names)
    suggestion_col = frame.strings("plasmient.culprit.suggestion")
    step_kernel_col = frame.strings("plasmient.culprit.kernel")
    step_op_col = frame.strings("plasmient.culprit.op")
    kind_col = frame.strings("plasmient.kernel.kind")
    bound_col = frame.strings("plasmient.bound")
    wasted = frame.num("plasmient.wasted_s")
    parts: list[pa.Table] = []

    def take(col: pa.Array, idx: np.ndarray) -> pa.Array:
        # idx -1 means "no such ancestor": take a null there instead of a wrong row.
        safe = pa.array(np.where(idx < 0, 0, idx))
        out = col.take(safe)
        return pc.if_else(pa.array(idx < 0), pa.nulls(len(idx), out.type), out)

    step_anc = frame.ancestor_at("step", include_self=True)
    for source, level in ((_SOURCE_KERNEL, "kernel"), (_SOURCE_OP, "op")):
        rows = np.nonzero(frame.is_level(level))[0]
        if rows.size == 0:
            continue
        op_anc = frame.ancestor_at("op")[rows] if level == "kernel" else rows
        mod_anc = frame.ancestor_at("module")[rows]
        st = step_anc[rows]
        parts.append(
            pa.table(
                {
                    "trace": pa.array(frame.trace[rows]),
                    "source": pa.array(np.full(rows.size, source, dtype=np.int8)),
                    "kernel": names.take(pa.array(rows)) if level == "kernel" else pa.nulls(rows.size, pa.string()),
                    "op": take(names, op_anc),
                    "module": take(module_label, mod_anc),
                    "rank": pa.array(frame.rank[rows]),
                    "wasted_s": pa.array(wasted[rows]),
                    "time_s": pa.array(frame.device_s[rows]),
                    "bound": bound_col.take(pa.array(rows)),
                    "kind": kind_col.take(pa.array(rows)),
                    "suggestion": take(suggestion_col, st),
                    "step_kernel": take(step_kernel_col, st),
                    "step_op": take(step_op_col, st),
                }
            )
        )
    steps = np.nonzero(frame.is_level("step"))[0]
    if steps.size:
        ck, co, cm = (frame.strings(f"plasmient.culprit.{k}").take(pa.array(steps)) for k in ("kernel", "op", "module"))
        named = pc.or_(pc.or_(pc.is_valid(ck), pc.is_valid(co)), pc.is_valid(cm)).to_numpy(zero_copy_only=False)
        steps = steps[named]
        parts.append(
            pa.table(
                {
                    "trace": pa.array(frame.trace[steps]),
                    "source": pa.array(np.full(steps.size, _SOURCE_STEP, dtype=np.int8)),
                    "kernel": frame.strings("plasmient.culprit.kernel").take(pa.array(steps)),
                    "op": frame.strings("plasmient.culprit.op").take(pa.array(steps)),
                    "module": frame.strings("plasmient.culprit.module").take(pa.array(steps)),
                    "rank": pa.array(frame.rank[steps]),
                    "wasted_s": pa.array(frame.num("plasmient.culprit.wasted_s")[steps]),
                    "time_s": pa.array(np.full(steps.size, np.nan)),
                    "bound": frame.strings("plasmient.culprit.bound").take(pa.array(steps)),
                    "kind": pa.nulls(steps.size, pa.string()),
                    "suggestion": suggestion_col.take(pa.array(steps)),
                    "step_kernel": frame.strings("plasmient.culprit.kernel").take(pa.array(steps)),
                    "step_op": frame.strings("plasmient.culprit.op").take(pa.array(steps)),
                }
            )
        )
    if not parts:
        return pa.table(
            {
                "trace": pa.array([], pa.int32()),
                "source": pa.array([], pa.int8()),
                **{k: pa.array([], pa.string()) for k in ("kernel", "op", "module")},
                "rank": pa.array([], pa.int64()),
                "wasted_s": pa.array([], pa.float64()),
                "time_s": pa.array([], pa.float64()),
                **{k: pa.array([], pa.string()) for k in ("bound", "kind", "suggestion", "step_kernel", "step_op")},
            }
        )
    inst = pa.concat_tables(parts)
    # Keep, per trace, only the best source it has: a step-sampled trace falls back to its
    # culprit.* attributes while a fully traced one in the same batch uses its kernels.
    tr = inst.column("trace").to_numpy()
    src = inst.column("source").to_numpy().astype(np.int64)
    best = np.full(max(len(frame.trace_ids), 1), 99, dtype=np.int64)
    np.minimum.at(best, tr, src)
    return inst.filter(pa.array(src == best[tr]))


def _rank_chains(inst: pa.Table, by_trace: bool, top: int) -> dict[int | None, list[dict[str, Any]]]:
    """Group culprit instances by chain; keep the `top` worst chains per trace (or for the batch).

    Ranked by wasted device-seconds; where a trace has no wasted_s at all (the GPU peak is unknown),
    by device time instead, and each culprit says which it was ranked by. Vectorised: only the kept
    chains become Python dicts.
    """
    chain = ["kernel", "op", "module", "rank"]
    if inst.num_rows == 0:
        return {}
    wasted = inst.column("wasted_s").to_numpy(zero_copy_only=False)
    time_s = inst.column("time_s").to_numpy(zero_copy_only=False)
    inst = inst.append_column("w", pa.array(np.nan_to_num(wasted, nan=0.0)))
    inst = inst.append_column("known", pa.array((~np.isnan(wasted)).astype(np.int64)))
    inst = inst.append_column("t", pa.array(np.nan_to_num(time_s, nan=0.0)))
    # Worst instance first, so "first" takes the bound/suggestion of a chain's worst instance.
    inst = inst.sort_by([("w", "descending"), ("t", "descending")])
    keys = (["trace"] if by_trace else []) + chain
    g = inst.group_by(keys, use_threads=False).aggregate(
        [("w", "sum"), ("t", "sum"), ("known", "sum"), ("w", "count")]
        + [(c, "first") for c in ("bound", "kind", "suggestion", "step_kernel", "step_op")]
    )
    outer = g.column("trace").to_numpy().astype(np.int64) if by_trace else np.zeros(g.num_rows, dtype=np.int64)
    known = g.column("known_sum").to_numpy().astype(np.float64)
    w_sum = g.column("w_sum").to_numpy()
    t_sum = g.column("t_sum").to_numpy()
    by_wasted = (np.bincount(outer, weights=known) > 0)[outer]
    score = np.where(by_wasted, w_sum, t_sum)
    cand = np.nonzero(score > 0)[0]
    order = cand[np.lexsort((-score[cand], outer[cand]))]
    o = outer[order]
    first_of_group = np.searchsorted(o, o, side="left")
    picked = order[(np.arange(order.size) - first_of_group) < top]
    sel = g.take(pa.array(picked)).to_pydict()
    out: dict[int | None, list[dict[str, Any]]] = {}
    for j, row in enumerate(picked.tolist()):
        rank = sel["rank"][j]
        c = {
            "kernel": sel["kernel"][j],
            "op": sel["op"][j],
            "module": sel["module"][j],
            "rank": None if rank is None or rank < 0 else int(rank),
            "wasted_s": float(w_sum[row]) if known[row] else None,
            "time_s": float(t_sum[row]) if t_sum[row] else None,
            "count": int(sel["w_count"][j]),
            "bound": sel["bound_first"][j],
            "kind": sel["kind_first"][j],
            "suggestion": None,
            "ranked_by": "wasted_s" if by_wasted[row] else "time_s",
        }
        c["suggestion"] = _suggestion_for(c, sel["suggestion_first"][j], sel["step_kernel_first"][j], sel["step_op_first"][j])
        c["chain"] = chain_text(c)
        out.setdefault(int(outer[row]) if by_trace else None, []).append(c)
    return out


def _suggestion_for(c: dict[str, Any], step_text: str | None, step_kernel: str | None, step_op: str | None) -> str | None:
    """The step's own suggestion when this chain is the step's culprit, else a hint for this chain.

    A step names one culprit; the other top chains get the same rule-based hint the metrics use,
    computed for their own kernel/op/bound (idle is a step property, so not applied to a chain).
    """
    if step_text and c["kernel"] == step_kernel and (step_op is None or c["op"] == step_op):
        return step_text
    try:
        from plasmient_trace.metrics.culprit import suggestion
    except ImportError:
        return step_text
    return suggestion(c["kernel"], c["op"], c["module"], c["bound"], c["kind"], 0.0)


def chain_text(c: dict[str, Any], width: int | None = None) -> str:
    parts = [p for p in (c.get("kernel"), c.get("op"), c.get("module")) if p]
    if width:
        parts = [_ellipsize(p, width) for p in parts]
    if c.get("rank") is not None:
        parts.append(f"rank {c['rank']}")
    return " -> ".join(parts) if parts else "n/a"


def _ellipsize(s: str, width: int) -> str:
    if len(s) <= width:
        return s
    half = (width - 1) // 2
    return s[:half] + "…" + s[-(width - 1 - half) :]


def _top_spans(frame: SpanFrame) -> np.ndarray:
    """Per trace, the spans at the highest level present (normally its one fleet span)."""
    lvl = np.where(frame.level < 0, len(LEVELS), frame.level).astype(np.int64)
    best = np.full(max(len(frame.trace_ids), 1), len(LEVELS), dtype=np.int64)
    np.minimum.at(best, frame.trace, lvl)
    top = (lvl == best[frame.trace]) & (frame.level >= 0)
    # Unknown-level traces still get a row from their root spans.
    no_level = best[frame.trace] == len(LEVELS)
    return np.nonzero(top | (no_level & (frame.parent < 0)))[0]


def summary_rows(batch: SpanBatch, top: int = 5) -> list[dict[str, Any]]:
    """One row per trace (= per step of the job): the numbers the terminal summary prints."""
    if batch.table.num_rows == 0:
        return []
    return rows_from_frame(SpanFrame(batch), top)


def rows_from_frame(frame: SpanFrame, top: int = 5) -> list[dict[str, Any]]:
    batch = frame.batch
    top_rows = _top_spans(frame)
    culprits = _rank_chains(_culprit_instances(frame), by_trace=True, top=top)
    t = batch.table
    util, mfu = frame.num("plasmient.util.resident"), frame.num("plasmient.mfu")
    cost, wasted_usd, wasted_s = frame.num("plasmient.cost.usd"), frame.num("plasmient.cost.wasted_usd"), frame.num("plasmient.wasted_s")
    step_idx = frame.num("plasmient.step")
    steps = frame.is_level("step")
    # Only the top spans and the step spans are read as Python values; never the whole table.
    needed = np.union1d(top_rows, np.nonzero(steps)[0])
    needed_arr = pa.array(needed)

    def values(col: pa.Array) -> dict[int, Any]:
        return dict(zip(needed.tolist(), col.take(needed_arr).to_pylist()))

    names = values(t.column("name").combine_chunks())
    job_col = values(frame.strings("plasmient.job.id"))
    sugg = values(frame.strings("plasmient.culprit.suggestion"))
    sampled = values(frame.strings("plasmient.sampled_depth"))
    culprit_wasted = frame.num("plasmient.culprit.wasted_s")
    rank_spans = np.bincount(frame.trace[frame.is_level("rank")], minlength=len(frame.trace_ids))
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
            wall = float((frame.end_ns[idx].max() - frame.start_ns[idx].min()) / 1e9)
            gpus, device_s = float(frame.gpus[idx].sum()), float(dev.sum())
        u, m = weighted_mean(util[idx], dev), weighted_mean(mfu[idx], dev)

        def total(col: np.ndarray) -> float | None:
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
                "sampled_depth": ",".join(depths) or None,
                "suggestion": suggestion,
                "culprits": trace_culprits,
            }
        )
    rows.sort(key=lambda r: (r["job_id"] or "", -1 if r["step"] is None else r["step"], r["trace_id"]))
    return rows


def _resource_job(batch: SpanBatch, frame: SpanFrame, i: int) -> str | None:
    ri = int(frame.resource_index[i])
    if 0 <= ri < len(batch.resources):
        job = batch.resources[ri].get("plasmient.job.id")
        return None if job is None else str(job)
    return None


def top_culprits(batch: SpanBatch, top: int = 5) -> list[dict[str, Any]]:
    """The worst culprit chains over the whole batch (all steps, all ranks), summed per chain."""
    if batch.table.num_rows == 0:
        return []
    return culprits_from_frame(SpanFrame(batch), top)


def culprits_from_frame(frame: SpanFrame, top: int = 5) -> list[dict[str, Any]]:
    return _rank_chains(_culprit_instances(frame), by_trace=False, top=top).get(None, [])


def totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The whole batch in one line: device-time weighted util and MFU, summed gap and waste."""
    dev = np.array([r["device_s"] for r in rows], dtype=np.float64)
    util = np.array([np.nan if r["util"] is None else r["util"] for r in rows], dtype=np.float64)
    mfu = np.array([np.nan if r["mfu"] is None else r["mfu"] for r in rows], dtype=np.float64)

    def s(key: str) -> float | None:
        vals = [r[key] for r in rows if r[key] is not None]
        return float(sum(vals)) if vals else None

    return {
        "steps": len(rows),
        "device_s": float(dev.sum()),
        "wall_s": float(sum(r["wall_s"] for r in rows)),
        "util": weighted_mean(util, dev),
        "mfu": weighted_mean(mfu, dev),
        "gap_gpu_hours": s("gap_gpu_hours"),
        "cost_usd": s("cost_usd"),
        "wasted_usd": s("wasted_usd"),
    }


# ---- rendering -------------------------------------------------------------------------------


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
    steps = Table(title="plasmient: where the GPU time went", title_justify="left", header_style="bold")
    for col, just in (
        ("step", "right"),
        ("ranks", "right"),
        ("wall", "right"),
        ("util.resident", "right"),
        ("MFU", "right"),
        ("gap", "right"),
        ("wasted $", "right"),
    ):
        steps.add_column(col, justify=just, no_wrap=True)  # type: ignore[arg-type]
    shown = rows if len(rows) <= MAX_STEP_ROWS else rows[:MAX_STEP_ROWS]
    for r in shown:
        steps.add_row(
            "n/a" if r["step"] is None else str(r["step"]),
            str(r["ranks"]),
            fmt_seconds(r["wall_s"]),
            fmt_pct(r["util"]),
            Text(fmt_pct(r["mfu"]), style=_mfu_style(r["mfu"])),
            fmt_gpu_hours(r["gap_gpu_hours"]),
            fmt_usd(r["wasted_usd"]),
        )
    if len(rows) > len(shown):
        steps.add_row(f"… {len(rows) - len(shown)} more", "", "", "", "", "", "", style="dim")
    if len(rows) > 1:
        tot = totals(rows)
        steps.add_section()
        steps.add_row(
            "all",
            "",
            fmt_seconds(tot["wall_s"]),
            fmt_pct(tot["util"]),
            Text(fmt_pct(tot["mfu"]), style=_mfu_style(tot["mfu"])),
            fmt_gpu_hours(tot["gap_gpu_hours"]),
            fmt_usd(tot["wasted_usd"]),
            style="bold",
        )
    console.print(steps)
    if all(r["mfu"] is None for r in rows):
        console.print("[yellow]MFU n/a: the GPU's peak FLOP/s is unknown (pass a peak override).[/yellow]")

    culprits = top_culprits(batch, top=top)
    if not culprits:
        console.print("[dim]no culprits: no kernel, op or step named any wasted time[/dim]")
        return
    table = Table(title="top culprits (kernel -> op -> module -> rank)", title_justify="left", header_style="bold")
    table.add_column("#", justify="right")
    table.add_column("culprit", overflow="fold")
    table.add_column("bound", no_wrap=True)
    table.add_column("wasted", justify="right", no_wrap=True)
    table.add_column("suggestion", overflow="fold")
    for n, c in enumerate(culprits, 1):
        amount = c["wasted_s"] if c["ranked_by"] == "wasted_s" else c["time_s"]
        label = fmt_seconds(amount) + ("" if c["ranked_by"] == "wasted_s" else " (time)")
        table.add_row(str(n), chain_text(c, width=60), c["bound"] or "", label, c["suggestion"] or "")
    console.print(table)


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
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = console or Console(stderr=True)
    if quiet or not console.is_terminal:
        yield lambda label, done, total: None
        return
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=True
    ) as bar:
        task = bar.add_task("ingesting", total=None)

        def update(label: str, done: int, total: int) -> None:
            bar.update(task, description=label, completed=done, total=total or None)

        yield update
