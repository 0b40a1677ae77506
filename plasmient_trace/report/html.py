"""The self-contained HTML report: one file, no network, four views of one SpanBatch.

(a) the vertical stack fleet -> node -> rank -> step -> module -> op -> kernel as a zoomable icicle
coloured by MFU, util and MFU side by side in every cell (widths: :func:`.html_views.icicle_value`); (b) a
timeline of kernels per (rank, GPU, stream) coloured by bound; (c) a roofline of kernels; (d) the
bill, recomputed in the page for a fleet size and GPU price the reader edits. This module assembles the
JSON of the page (the views' data from :mod:`.html_views`, with its caps so a 10^5..10^6-span batch still
gives a page that loads; the bill; the diff section) and inlines ``assets/report.js`` and
``assets/report.css``; all drawing happens in the page.
"""

from __future__ import annotations

import html as html_lib
from importlib import resources as importlib_resources
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow.compute as pc

from plasmient_trace.conventions import BOUNDS, DEFAULT_BASELINE_MFU, SpanBatch
from plasmient_trace.export.sinks import write_output_file
from plasmient_trace.report.frame import SpanFrame, weighted_mean
from plasmient_trace.report.html_views import (ICICLE_MAX_NODES, NAME_MAX, PAGE_LEVELS, ROOFLINE_MAX_POINTS, TIMELINE_BINS,
                                               TIMELINE_MAX_KERNELS, icicle_data, roofline_data, timeline_data)
from plasmient_trace.report.summary import _top_spans, culprits_from_frame, mfu_unknown_reason, rows_device, rows_from_frame

DIFF_TOP_ROWS = 20  # rows per table of the diff section; the --json output of `plasmient diff` has them all
# Used only when neither the caller nor the trace (plasmient.cost.usd) gives a price; the page says so.
DEFAULT_PRICE_PER_GPU_HOUR = 2.0


def _asset(name: str) -> str:
    return importlib_resources.files("plasmient_trace.report").joinpath("assets", name).read_text(encoding="utf-8")


# ---- (d) the bill ------------------------------------------------------------------------------


def _bill(frame: SpanFrame, rows: list[dict[str, Any]], fleet_gpus: int | None, price: float | None,
          baseline: float) -> dict[str, Any]:
    top = _top_spans(frame)
    if fleet_gpus is None:
        # the fleet the data describes: the most GPUs any step's top spans were charged for
        per_trace = np.zeros(max(len(frame.trace_ids), 1))
        np.add.at(per_trace, frame.trace[top], frame.gpus[top])
        fleet_gpus = int(per_trace.max()) if top.size else 1
    dev = frame.device_s[top]
    util, mfu = frame.num("plasmient.util.resident")[top], frame.num("plasmient.mfu")[top]
    cost = frame.num("plasmient.cost.usd")[top]
    wasted = frame.num("plasmient.cost.wasted_usd")[top]
    known_cost = ~np.isnan(cost) & (dev > 0)
    source = "argument"
    if price is None:
        if known_cost.any():
            # Rounded to 1/100 cent: it lands in an input box the reader edits.
            price = round(float(cost[known_cost].sum() / (dev[known_cost].sum() / 3600.0)), 4)
            source = "trace"
        else:
            price, source = DEFAULT_PRICE_PER_GPU_HOUR, "assumed"
    return {
        "fleet_gpus": int(fleet_gpus),
        "price_per_gpu_hour": float(price),
        "price_source": source,
        "baseline_mfu": float(baseline),
        "mfu": weighted_mean(mfu, dev),
        "util": weighted_mean(util, dev),
        "device_s": float(dev.sum()),
        # the part of it whose MFU is known (a step with none, e.g. a live step with nothing to carry, is left out)
        "mfu_device_s": float(dev[~np.isnan(mfu) & (dev > 0)].sum()),
        # and whose util is (a live CPU step at step depth records no ops, so it has none)
        "util_device_s": float(dev[~np.isnan(util) & (dev > 0)].sum()),
        # why the MFU is unknown, when it is (the terminal summary's sentence)
        "mfu_unknown_why": mfu_unknown_reason(rows) if rows and np.isnan(mfu).all() else None,
        "cost_usd": None if np.isnan(cost).all() else float(np.nansum(cost)),
        "wasted_usd": None if np.isnan(wasted).all() else float(np.nansum(wasted)),
    }


# ---- page --------------------------------------------------------------------------------------


def _kernels_covered(frame: SpanFrame) -> int | None:
    """Kernels the traces hold, the ones the span budget folded into their ops included: each counts once, in
    its step span's plasmient.kernels. None (unknown) when a step span lacks the count; a page that said
    "500 kernels" of a 1,000-rank job with millions read as if the job had run 500."""
    counts = frame.num("plasmient.kernels")[frame.is_level("step")]
    return int(counts.sum()) if len(counts) and np.isfinite(counts).all() else None


def _cpu_kernels(frame: SpanFrame) -> int:
    """Of those, the kernels of CPU steps: ops that stand for kernels, drawn as their op spans, never folded."""
    step = frame.is_level("step")
    cpu = np.asarray(pc.equal(frame.strings("plasmient.device.type"), "cpu").fill_null(False).to_numpy(zero_copy_only=False))
    counts = frame.num("plasmient.kernels")[step & cpu]
    return int(np.nansum(counts))


def report_data(
    batch: SpanBatch,
    title: str = "plasmient-trace report",
    fleet_gpus: int | None = None,
    price_per_gpu_hour: float | None = None,
    baseline_mfu: float = DEFAULT_BASELINE_MFU,
    max_nodes: int = ICICLE_MAX_NODES,
    max_kernels: int = TIMELINE_MAX_KERNELS,
    max_points: int = ROOFLINE_MAX_POINTS,
    diff: dict[str, Any] | None = None,
    diff_top: int = DIFF_TOP_ROWS,
) -> dict[str, Any]:
    """The JSON the page embeds (numpy arrays inside; serialise with orjson OPT_SERIALIZE_NUMPY).

    ``diff``, the result of ``report.diff.diff`` with this batch as its B side, adds the "what changed"
    section: its totals and the first ``diff_top`` rows of each table, in the diff's order."""
    frame = SpanFrame(batch)
    rows = rows_from_frame(frame) if frame.n else []
    res = batch.resources
    meta = {
        "spans": frame.n,
        "traces": len(frame.trace_ids),
        "jobs": sorted({str(r["plasmient.job.id"]) for r in res if r.get("plasmient.job.id") is not None}),
        "hosts": sorted({str(r["host.name"]) for r in res if r.get("host.name") is not None}),
        "ranks": int(np.unique(frame.rank[frame.rank >= 0]).size),
        "gpu_models": sorted({str(r["plasmient.gpu.model"]) for r in res if r.get("plasmient.gpu.model")}),
        "cpu_models": sorted({str(r["plasmient.cpu.model"]) for r in res if r.get("plasmient.cpu.model")}),
        # what the device words of the page say: a CPU-only run's devices are its CPUs
        "device": rows_device(rows) if rows else "GPU",
        "kernel_spans": int(frame.is_level("kernel").sum()),
        "kernels": _kernels_covered(frame),
        "cpu_kernels": _cpu_kernels(frame),
    }
    empty_tree = {"root": -1, "names": [], "name": [], "parent": [], "level": [], "spans_total": 0, "spans_shown": 0, "folded_cells": 0, "max_nodes": max_nodes}
    return {
        "title": title,
        "levels": list(PAGE_LEVELS),
        "bounds": list(BOUNDS),
        "meta": meta,
        "steps": rows,
        "culprits": culprits_from_frame(frame) if frame.n else [],
        "bill": _bill(frame, rows, fleet_gpus, price_per_gpu_hour, baseline_mfu),
        "tree": icicle_data(frame, title, max_nodes) if frame.n else empty_tree,
        "timeline": timeline_data(frame, max_kernels, TIMELINE_BINS),
        "roofline": roofline_data(frame, max_points),
        "diff": None if diff is None else _diff_section(diff, diff_top),
    }


_DIFF_FIELDS = ("name", "in_a", "in_b", "busy_s_a", "busy_s_b", "busy_s_delta", "flops_delta", "mfu_a", "mfu_b",
                "coverage_a", "coverage_b",
                "wasted_s_a", "wasted_s_b", "wasted_s_delta", "wasted_usd_delta")


def _diff_section(diff: dict[str, Any], top: int) -> dict[str, Any]:
    """The diff trimmed for the page: names middle-ellipsized like every other name in it."""
    out: dict[str, Any] = {"a": diff["a"], "b": diff["b"], "totals": diff["totals"], "top": top}
    for dim in ("module", "op", "kernel"):
        rows = [{k: r[k] for k in _DIFF_FIELDS} for r in diff[dim][:top]]
        for r in rows:
            if r["name"] and len(r["name"]) > NAME_MAX:
                half = (NAME_MAX - 1) // 2
                r["name"] = r["name"][:half] + "…" + r["name"][-(NAME_MAX - 1 - half):]
        out[dim] = {"rows": rows, "total_rows": len(diff[dim])}
    return out


def _json_for_script(data: dict[str, Any]) -> str:
    raw = orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS)
    # "<" never appears raw, so no name can close the <script> element or open a comment.
    return raw.replace(b"<", b"\\u003c").decode("utf-8")


def build_report(
    batch: SpanBatch,
    title: str = "plasmient-trace report",
    fleet_gpus: int | None = None,
    price_per_gpu_hour: float | None = None,
    **kw: Any,
) -> str:
    """One self-contained HTML page (inline data, script and style; the CSP forbids any fetch)."""
    data = report_data(batch, title=title, fleet_gpus=fleet_gpus, price_per_gpu_hour=price_per_gpu_hour, **kw)
    js, css = _asset("report.js"), _asset("report.css")
    for asset in (js, css):
        if "</script" in asset.lower() or "</style" in asset.lower():
            raise ValueError("report asset would close its own element")
    t = html_lib.escape(title)
    csp = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:"
    return "\n".join(
        [
            "<!doctype html>",
            '<html lang="en">',
            "<head>",
            '<meta charset="utf-8">',
            f'<meta http-equiv="Content-Security-Policy" content="{csp}">',
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            f"<title>{t}</title>",
            f"<style>\n{css}\n</style>",
            "</head>",
            "<body>",
            _body(t, data["meta"]["device"]),
            f'<script type="application/json" id="plasmient-data">{_json_for_script(data)}</script>',
            f"<script>\n{js}\n</script>",
            "</body>",
            "</html>",
            "",
        ]
    )


def write_report(batch: SpanBatch, path: str | Path, **kw: Any) -> Path:
    """The report as one file at ``path``, whole or not at all (export.sinks.OutputError: one line)."""
    page = build_report(batch, **kw).encode("utf-8")
    return write_output_file(path, lambda f: f.write(page))


def _body(title: str, device: str) -> str:
    lanes = "ops per rank (a CPU's kernels)" if device == "CPU" else "kernels per rank · GPU · stream"
    return _BODY.replace("{title}", title).replace("{device}", device).replace("{timeline_lanes}", lanes)


_BODY = """\
<header>
  <h1 id="title">{title}</h1>
  <div id="meta"></div>
</header>
<main>
<section id="diff-section" hidden>
  <h2>What changed <span class="sub" id="diff-sides"></span></h2>
  <table id="diff-totals"><thead><tr><th></th><th>A</th><th>B</th><th>change</th></tr></thead><tbody></tbody></table>
  <div id="diff-tables"></div>
  <p class="note">Device time is each name's exclusive busy device-seconds (plasmient.busy_s.self of its kernels;
  host gaps are the [device idle] row), wasted its exclusive wasted_s; MFU is ideal over busy seconds.
  Rows are ranked by the absolute change in wasted time.</p>
</section>
<section id="bill-section">
  <h2>The bill</h2>
  <div class="bill-inputs">
    <label>fleet size <input id="bill-gpus" type="number" min="0" step="1"> {device}s</label>
    <label>price <input id="bill-price" type="number" min="0" step="0.01"> $ / {device}-hour</label>
    <label>baseline MFU <input id="bill-baseline" type="number" min="1" max="100" step="1"> %</label>
  </div>
  <div class="bill-outputs">
    <div class="kpi"><div class="k">measured util.resident</div><div class="v" id="bill-util"></div></div>
    <div class="kpi"><div class="k">measured MFU</div><div class="v" id="bill-mfu"></div></div>
    <div class="kpi"><div class="k">fleet spend / day</div><div class="v" id="bill-spend-day"></div></div>
    <div class="kpi"><div class="k">idle / day (what util shows)</div><div class="v" id="bill-idle-day"></div></div>
    <div class="kpi bad"><div class="k">wasted / day (below baseline MFU)</div><div class="v" id="bill-wasted-day"></div></div>
    <div class="kpi bad"><div class="k">wasted / year</div><div class="v" id="bill-wasted-year"></div></div>
  </div>
  <p class="note" id="bill-note"></p>
</section>
<section id="steps-section">
  <h2>Steps</h2>
  <table id="steps"><thead><tr><th>step</th><th>ranks</th><th>wall</th><th>coverage</th><th>util.resident</th><th>MFU</th><th>gap</th><th>wasted $</th><th>top culprit (kernel → op → module → rank)</th></tr></thead><tbody></tbody></table>
  <p class="note" id="steps-note"></p>
</section>
<section id="icicle-section">
  <h2>Vertical trace <span class="sub">fleet → node → rank → step → module → op → kernel, coloured by MFU; click to zoom</span></h2>
  <div class="icicle-bar"><button id="icicle-up" type="button">↑ up</button><nav id="icicle-crumbs"></nav><div id="mfu-legend"></div></div>
  <div id="icicle"></div>
  <div id="icicle-detail"></div>
  <p class="note" id="icicle-note"></p>
</section>
<section id="timeline-section">
  <h2>Timeline <span class="sub">{timeline_lanes}, coloured by bound; wheel to zoom, drag to pan, double-click to reset</span></h2>
  <div id="timeline-legend" class="legend"></div>
  <div id="timeline-wrap"><canvas id="timeline"></canvas><div id="timeline-tip" class="tip"></div></div>
  <p class="note" id="timeline-note"></p>
</section>
<section id="roofline-section">
  <h2>Roofline <span class="sub">kernels: achieved FLOP/s against arithmetic intensity, log-log</span></h2>
  <div id="roofline-legend" class="legend"></div>
  <svg id="roofline"></svg>
  <p class="note" id="roofline-note"></p>
</section>
</main>
<footer>plasmient-trace · self-contained report, no network</footer>"""
