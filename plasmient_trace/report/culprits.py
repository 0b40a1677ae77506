"""The report's culprit rows: each trace's list as its top spans carry it, and the lists of every trace summed.

A fleet span carries its ranks' rows summed before any cut (``stitch.fleet``; it shows the first
``NODE_CULPRIT_ROWS``), so the rows of several steps (and, without a fleet span, of several ranks) are summed
here from those lists and cut to the rows asked for only then: a row eleventh in every step still counts all
its steps. A list that was cut says how much a row it
left out may hold (``plasmient.culprits.left_out_s``), and a row such a list may have left short is marked
``lower_bound``, which the terminal prints as "≥".
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa

from plasmient_trace.conventions import LEVELS, SpanBatch
from plasmient_trace.report.frame import SpanFrame
from plasmient_trace.stitch.culprits import merge_culprits


def _trace_culprits(frame: SpanFrame) -> dict[int, tuple[list[dict[str, Any]], float]]:
    """Per trace, the culprit rows its top spans carry (``plasmient.culprits``, written by the stitcher), summed
    over them where there are several (ranks without a fleet span), and the most a row they leave out may hold
    (``plasmient.culprits.left_out_s``; NaN where a file does not say). A trace whose top spans name no rows
    (a step sampled at step depth) is left out. Files from before the culprit lists fall back to the top
    span's ``plasmient.culprit.*`` attributes. The terminal, the HTML report and the step spans name the same
    culprits in the same order."""
    cached = getattr(frame, "_trace_culprits", None)
    if cached is not None:
        return cached
    top = _top_spans(frame)
    lists = frame.strings("plasmient.culprits").take(pa.array(top)).to_pylist()
    left_out = frame.num("plasmient.culprits.left_out_s")[top]
    single = {k: frame.strings(f"plasmient.culprit.{k}").take(pa.array(top)).to_pylist()
              for k in ("kernel", "op", "module", "bound", "suggestion")}
    single_w = frame.num("plasmient.culprit.wasted_s")[top]
    single_r = frame.num("plasmient.culprit.rank")[top]
    per_trace: dict[int, list[tuple[int, list[dict[str, Any]], float]]] = {}
    for j, (i, text) in enumerate(zip(top.tolist(), lists)):
        rows: list[dict[str, Any]] = []
        if text:
            try:
                rows = json.loads(text)
            except ValueError:
                rows = []
        elif single["kernel"][j] or single["op"][j]:
            rows = [{"kernel": single["kernel"][j], "op": single["op"][j], "module": single["module"][j],
                     "bound": single["bound"][j], "suggestion": single["suggestion"][j], "calls": None, "layers": None,
                     "wasted_s": None if np.isnan(single_w[j]) else float(single_w[j]),
                     "rank": None if np.isnan(single_r[j]) else int(single_r[j])}]
        rank = int(frame.rank[i])
        if rows:
            per_trace.setdefault(int(frame.trace[i]), []).append((rank, rows, float(left_out[j])))
    out = {tr: merge_culprits(items, None) if len(items) > 1 else (items[0][1], items[0][2])
           for tr, items in per_trace.items()}
    frame._trace_culprits = out  # type: ignore[attr-defined]
    return out


def _culprit(r: dict[str, Any]) -> dict[str, Any]:
    c = {
        "kernel": r.get("kernel"), "op": r.get("op"), "module": r.get("module"), "rank": r.get("rank"),
        "wasted_s": r.get("wasted_s"), "time_s": None, "count": r.get("calls"), "layers": r.get("layers"),
        "bound": r.get("bound"), "kind": r.get("kind"), "suggestion": r.get("suggestion"), "ranked_by": "wasted_s",
        # a list it was summed from may have left it out: wasted_s is at least this much
        "lower_bound": bool(r.get("lower_bound")),
    }
    c["chain"] = chain_text(c)
    return c


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


def top_culprits(batch: SpanBatch, top: int = 5) -> list[dict[str, Any]]:
    """The worst culprit chains over the whole batch (all steps, all ranks), summed per chain."""
    if batch.table.num_rows == 0:
        return []
    return culprits_from_frame(SpanFrame(batch), top)


def culprits_from_frame(frame: SpanFrame, top: int = 5) -> list[dict[str, Any]]:
    """The culprit rows of every trace summed by (kernel, op, module), then cut to ``top``: summed from the
    traces' lists (a fleet span carries its ranks' rows summed, the first NODE_CULPRIT_ROWS of them), not from
    each step's first ten, so a row that is eleventh in every step still counts all its steps."""
    return [_culprit(c) for c in merged_culprits(frame, top)[0]]


def merged_culprits(frame: SpanFrame, top: int | None = None) -> tuple[list[dict[str, Any]], float]:
    """The traces' rows summed (as stitched, most waste first, cut to ``top``) and the most a row left out may
    hold (0.0: no row is missing; NaN: unknown, e.g. files from before the lists said)."""
    return merge_culprits([(-1, rows, left) for rows, left in _trace_culprits(frame).values()], top)
