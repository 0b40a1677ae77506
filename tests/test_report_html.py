"""The HTML report: one self-contained page (icicle, timeline, roofline, bill), checked in a real
headless Chromium against the span attributes it was built from."""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from conftest import ingest_batch

from plasmient_trace.conventions import SpanBatch
from plasmient_trace.export.otlp_json import write_jsonl
from plasmient_trace.report import html as report_html
from plasmient_trace.report.cli import main as report_main
from plasmient_trace.report.html import build_report, report_data, write_report
from plasmient_trace.report.summary import fmt_pct, fmt_usd, summary_rows
from browser import Browser, chromium_path
from report_batches import H100_BW, H100_PEAK, PRICE, make_job, replicate

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces"
ARTIFACTS = ROOT / "test-artifacts"


def spans(batch: SpanBatch) -> list[dict]:
    return batch.table.to_pylist()


def by_span_id(batch: SpanBatch) -> dict[str, dict]:
    return {f"{s['span_id']:016x}": s for s in spans(batch)}


def embedded(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="plasmient-data">(.*?)</script>', page, re.S)
    assert m, "the data block is missing"
    return orjson.loads(m.group(1))


def device_weighted(rows: list[dict], key: str) -> float:
    w = sum(r["plasmient.wall_s"] * r["plasmient.gpus"] for r in rows)
    return sum(r[key] * r["plasmient.wall_s"] * r["plasmient.gpus"] for r in rows) / w


# ---- the page without a browser ---------------------------------------------------------------


def test_page_is_one_file_that_fetches_nothing():
    page = build_report(make_job(), title="job 7")
    assert re.search(r"https?://", page) is None
    assert not re.search(r"<(link|img|iframe)\b", page) and "<script src" not in page
    assert "default-src 'none'" in page  # the CSP forbids any fetch even if a name looked like a URL
    assert "<title>job 7</title>" in page


def test_names_cannot_break_out_of_the_data_block():
    batch = make_job(steps=1, nodes=1, layers=1)
    evil = "</script><script>alert(1)</script><!--"
    names = batch.table.column("name").to_pylist()
    names[-1] = evil
    import pyarrow as pa

    batch = SpanBatch(batch.table.set_column(batch.table.schema.get_field_index("name"), "name", pa.array(names)), batch.resources)
    page = build_report(batch)
    assert evil not in page and page.count("</script>") == 2
    data = embedded(page)
    assert evil in data["tree"]["names"]


def test_icicle_cap_keeps_the_largest_spans_and_folds_the_rest_conserving_time():
    batch = make_job(steps=2, nodes=2, layers=4, kernels_per_op=3)
    full = report_data(batch)["tree"]
    capped = report_data(batch, max_nodes=120)["tree"]
    assert full["spans_shown"] == len(batch) and full["folded_cells"] == 0
    assert len(capped["parent"]) <= 120 and capped["folded_cells"] > 0
    # Every kept span is still under its real parent, and each parent's children (kept + folded)
    # still add up to the device time of all its real children.
    ids = by_span_id(batch)
    real_children: dict[str, float] = {}

    def width(s: dict) -> float:  # device time down to the step, GPU-resident time below it
        below = s["plasmient.level"] in ("module", "op", "kernel")
        return s["plasmient.busy_s"] if below else s["plasmient.wall_s"] * s["plasmient.gpus"]

    for s in spans(batch):
        if s["parent_span_id"]:
            key = f"{s['parent_span_id']:016x}"
            real_children[key] = real_children.get(key, 0.0) + width(s)
    value = np.array(capped["value"], dtype=np.float64)
    parent = np.array(capped["parent"])
    for i, sid in enumerate(capped["span_id"]):
        if sid is None or capped["parent"][i] < 0:
            continue
        psid = capped["span_id"][parent[i]]
        if psid is not None:
            assert ids[sid]["parent_span_id"] == int(psid, 16)
        if sid in real_children:
            assert value[parent == i].sum() == pytest.approx(real_children[sid], rel=1e-5)


def test_timeline_past_the_cap_merges_short_kernels_into_bins_conserving_time():
    batch = make_job(steps=2, nodes=2, layers=6, kernels_per_op=4)
    kernels = [s for s in spans(batch) if s["plasmient.level"] == "kernel"]
    total_us = sum((k["end_ns"] - k["start_ns"]) / 1e3 for k in kernels)
    exact = report_data(batch)["timeline"]
    assert exact["mode"] == "kernels" and exact["drawn"] == len(kernels)
    assert sum(exact["dur"]) == pytest.approx(total_us)
    binned = report_data(batch, max_kernels=50)["timeline"]
    assert binned["mode"] == "binned" and binned["kernels_total"] == len(kernels)
    assert all(d >= binned["bin_us"] for d in binned["dur"])
    assert sum(binned["dur"]) + sum(binned["bin_time"]) == pytest.approx(total_us)
    assert sum(binned["bin_kernels"]) + binned["drawn"] == len(kernels)
    lanes = {(k["plasmient.rank"], k["plasmient.gpu.device"], k["plasmient.gpu.stream"]) for k in kernels}
    assert {(la["rank"], la["device"], la["stream"]) for la in exact["lanes"]} == lanes


def test_roofline_points_are_the_kernel_attributes_under_the_device_roof():
    batch = make_job(steps=1, nodes=2, layers=2)
    roof = report_data(batch)["roofline"]
    kernels = [s for s in spans(batch) if s["plasmient.level"] == "kernel"]
    plotted = [k for k in kernels if k["plasmient.flops"] and k["plasmient.bytes"]]
    assert roof["excluded"] == len(kernels) - len(plotted) > 0  # the all-reduce has no FLOPs
    got = np.array(sorted(zip(roof["x"], roof["y"])))
    want = np.array(sorted((k["plasmient.arithmetic_intensity"], k["plasmient.flops"] / k["plasmient.wall_s"]) for k in plotted))
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert roof["roofs"] == [{"model": "NVIDIA H100 80GB HBM3", "peak_flops": H100_PEAK, "peak_bandwidth": H100_BW}]


def test_bill_inputs_come_from_the_fleet_spans():
    batch = make_job(steps=3, nodes=2)
    fleet = [s for s in spans(batch) if s["plasmient.level"] == "fleet"]
    bill = report_data(batch, fleet_gpus=64)["bill"]
    assert bill["fleet_gpus"] == 64 and bill["price_source"] == "trace"
    assert bill["price_per_gpu_hour"] == pytest.approx(PRICE)
    assert bill["mfu"] == pytest.approx(device_weighted(fleet, "plasmient.mfu"))
    assert bill["util"] == pytest.approx(device_weighted(fleet, "plasmient.util.resident"))
    assert report_data(make_job(price=None))["bill"]["price_source"] == "assumed"
    assert report_data(batch, price_per_gpu_hour=3.0)["bill"]["price_per_gpu_hour"] == 3.0


def test_the_bill_says_why_its_mfu_is_unknown():
    """The page's bill gives the terminal summary's reason: the A100's peak is known, but a trace recorded
    without shapes knows only its collectives' and copies' FLOPs (zero); a job naming no GPU lacks the peak."""
    no_shapes = ingest_batch([TRACES / "a100" / "nccl_training_rank0_of2.json.gz"], "no-shapes")
    bill = report_data(no_shapes)["bill"]
    assert bill["mfu"] is None and "do no math" in bill["mfu_unknown_why"] and "peak" not in bill["mfu_unknown_why"]
    bill = report_data(make_job(steps=1, nodes=1, peak=None))["bill"]
    assert bill["mfu"] is None and "peak FLOP/s is unknown" in bill["mfu_unknown_why"]
    assert report_data(make_job(steps=1, nodes=1))["bill"]["mfu_unknown_why"] is None
    assert "bill.mfu_unknown_why" in report_html._asset("report.js")


@pytest.mark.parametrize("name", ["v100/resnet50_training.json.gz", "a100/cuda_graphs_rank0_of16.json.gz"])
def test_the_header_counts_the_kernels_the_span_budget_folded_too(name):
    # a 1,000-rank page said "500 kernels": the kernel spans left by the budget, not the kernels run
    from conftest import ingested, raw_activities, raw_trace

    in_steps = sum(1 for a in raw_activities(raw_trace(name)) if a["step"] is not None)
    whole = report_data(ingested(name, max_spans=10**9).batch)["meta"]
    budget = report_data(ingested(name, max_spans=1500).batch)["meta"]
    assert whole["kernels"] == whole["kernel_spans"] == budget["kernels"] == in_steps
    assert budget["kernel_spans"] < in_steps


def test_the_header_leaves_the_kernel_total_unknown_when_a_step_lacks_its_count():
    batch = ingest_batch([TRACES / "h100" / "bert_small_inference.json.gz"], "bert")
    table = batch.table
    col = table.schema.get_field_index("plasmient.kernels")
    steps = pc.equal(table.column("plasmient.level"), "step")
    nulled = pc.if_else(steps, pa.scalar(None, pa.int64()), table.column("plasmient.kernels"))
    meta = report_data(SpanBatch(table.set_column(col, "plasmient.kernels", nulled), batch.resources))["meta"]
    assert meta["kernels"] is None and meta["kernel_spans"] > 0


def test_cli_reads_span_files_and_writes_the_report(tmp_path, capsys):
    a, b = tmp_path / "node0.jsonl", tmp_path / "node1.jsonl"
    write_jsonl(make_job(job_id="j1", nodes=1), a)
    write_jsonl(make_job(job_id="j2", nodes=1), b)
    out = tmp_path / "r.html"
    assert report_main([str(a), str(b), "--html", str(out), "--quiet", "--fleet-gpus", "16"]) == 0
    assert capsys.readouterr().err == ""
    data = embedded(out.read_text())
    assert sorted(data["meta"]["jobs"]) == ["j1", "j2"] and data["bill"]["fleet_gpus"] == 16
    assert data["meta"]["spans"] == len(make_job(job_id="j1", nodes=1)) * 2
    assert report_main([str(a)]) == 0
    summary = capsys.readouterr()
    assert "util.resident" in summary.out and "util.resident" not in summary.err  # the table is the output
    assert report_main([str(tmp_path / "missing.jsonl"), "--html", str(out)]) == 2


# ---- in a real browser ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    if chromium_path() is None:
        msg = "/usr/bin/chromium is missing: run scripts/install-test-deps.sh"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    with Browser(width=1400, height=1000) as b:
        yield b


def open_page(browser: Browser, batch: SpanBatch, path: Path, **kw) -> dict:
    write_report(batch, path, **kw)
    before = len(browser.events)
    browser.goto(path.resolve().as_uri())
    assert browser.eval("document.body.getAttribute('data-ready')") == "1"
    errors = browser.js_errors(since=before)
    assert errors == [], errors
    urls = [ev["params"]["request"]["url"] for ev in browser.events[before:] if ev.get("method") == "Network.requestWillBeSent"]
    assert urls == [path.resolve().as_uri()], f"the page fetched something: {urls}"
    return embedded(path.read_text())


STEP_ROWS_JS = """[...document.querySelectorAll('#steps tbody tr[data-trace-id]')].map(tr => {
  const o = {trace_id: tr.dataset.traceId};
  tr.querySelectorAll('td[data-field]').forEach(td => { o[td.dataset.field] = [td.textContent, td.dataset.value]; });
  return o; })"""

CELLS_JS = """[...document.querySelectorAll('#icicle .cell')].map(c => ({
  span: c.dataset.spanId, level: c.dataset.level, util: c.querySelector('[data-field=util]').textContent,
  mfu: c.querySelector('[data-field=mfu]').textContent, width: c.getBoundingClientRect().width,
  left: c.getBoundingClientRect().left, name: c.querySelector('.nm').textContent, title: c.title }))"""

BILL_JS = """Object.fromEntries(['bill-util','bill-mfu','bill-spend-day','bill-idle-day','bill-wasted-day','bill-wasted-year']
  .map(id => [id, [document.getElementById(id).textContent, document.getElementById(id).dataset.value]]))"""


def check_numbers_against_spans(browser: Browser, batch: SpanBatch) -> None:
    """Steps table and icicle cells show exactly the span attributes, formatted as summary.py does."""
    ids = by_span_id(batch)
    fleet = {s["trace_id"].hex(): s for s in spans(batch) if s["plasmient.level"] == "fleet"}
    shown = browser.eval(STEP_ROWS_JS)
    assert len(shown) == len(fleet)
    for row in shown:
        f = fleet[row["trace_id"]]
        # the text as summary.py formats it, and the exact float behind it
        assert row["util"][0] == fmt_pct(f["plasmient.util.resident"])
        assert float(row["util"][1]) == f["plasmient.util.resident"]
        if f["plasmient.mfu"] is None:
            assert row["mfu"] == ["n/a", ""]
        else:
            assert row["mfu"][0] == fmt_pct(f["plasmient.mfu"]) and float(row["mfu"][1]) == f["plasmient.mfu"]
        assert row["wasted_usd"][0] == fmt_usd(f["plasmient.cost.wasted_usd"])
    cells = browser.eval(CELLS_JS)
    checked = 0
    for c in cells:
        if not c["span"]:
            continue
        s = ids[c["span"]]
        assert c["level"] == s["plasmient.level"]
        assert c["util"] == "util " + fmt_pct(s["plasmient.util.resident"])
        assert c["mfu"] == "MFU " + fmt_pct(s["plasmient.mfu"])
        if len(s["name"]) <= report_html.NAME_MAX:
            assert s["name"] in c["title"]
        checked += 1
    assert checked >= min(len(ids), 20)


def test_synthetic_job_page_numbers_bill_and_zoom(browser, tmp_path):
    batch = make_job(steps=2, nodes=2, layers=3)
    data = open_page(browser, batch, tmp_path / "job.html", fleet_gpus=8)
    check_numbers_against_spans(browser, batch)

    # the bill: measured values, then proportional to the fleet size the reader types
    fleet = [s for s in spans(batch) if s["plasmient.level"] == "fleet"]
    bill = browser.eval(BILL_JS)
    mfu, util = device_weighted(fleet, "plasmient.mfu"), device_weighted(fleet, "plasmient.util.resident")
    assert bill["bill-mfu"][0] == fmt_pct(mfu) and bill["bill-util"][0] == fmt_pct(util)
    spend = 8 * PRICE * 24
    assert float(bill["bill-spend-day"][1]) == pytest.approx(spend) and bill["bill-spend-day"][0] == fmt_usd(spend)
    wasted = spend * max(0.0, 1 - mfu / data["bill"]["baseline_mfu"])
    assert float(bill["bill-wasted-day"][1]) == pytest.approx(wasted, rel=1e-9)
    assert bill["bill-wasted-day"][0] == fmt_usd(float(bill["bill-wasted-day"][1]))
    assert float(bill["bill-wasted-year"][1]) == pytest.approx(365 * wasted, rel=1e-9)
    assert float(bill["bill-idle-day"][1]) == pytest.approx(spend * (1 - util), rel=1e-9)
    browser.type_into("#bill-gpus", "24")
    bill3 = browser.eval(BILL_JS)
    for key in ("bill-spend-day", "bill-idle-day", "bill-wasted-day", "bill-wasted-year"):
        assert float(bill3[key][1]) == pytest.approx(3 * float(bill[key][1]), rel=1e-12)
    browser.type_into("#bill-price", str(PRICE * 2))
    assert float(browser.eval(BILL_JS)["bill-spend-day"][1]) == pytest.approx(6 * spend)

    # zoom: click a module cell; the view's root becomes that module and shows only its subtree
    ids = by_span_id(batch)
    module = max((c for c in browser.eval(CELLS_JS) if c["level"] == "module"), key=lambda c: c["width"])
    browser.click(f'#icicle .cell[data-span-id="{module["span"]}"]')
    assert browser.eval("document.getElementById('icicle').dataset.rootSpanId") == module["span"]
    crumbs = browser.eval("[...document.querySelectorAll('#icicle-crumbs [data-idx]')].map(e => e.dataset.level)")
    assert crumbs == ["job", "fleet", "node", "rank", "step", "module"]
    assert browser.eval("document.querySelector('#icicle-crumbs .here').title") == ids[module["span"]]["name"]
    zoomed = browser.eval(CELLS_JS)
    root_cell = next(c for c in zoomed if c["span"] == module["span"])
    assert root_cell["width"] == pytest.approx(browser.eval("document.getElementById('icicle').clientWidth"), abs=2)
    assert root_cell["width"] > module["width"]

    def under(sid: str, anc: str) -> bool:
        s = ids[sid]
        while s["parent_span_id"]:
            if f"{s['parent_span_id']:016x}" == anc:
                return True
            s = ids[f"{s['parent_span_id']:016x}"]
        return sid == anc

    assert all(under(c["span"], module["span"]) for c in zoomed if c["span"])
    assert {c["level"] for c in zoomed} >= {"module", "op", "kernel"}
    detail = browser.eval("document.querySelector('#icicle-detail [data-field=MFU]').textContent")
    assert detail == fmt_pct(ids[module["span"]]["plasmient.mfu"])
    ARTIFACTS.mkdir(exist_ok=True)
    shot = browser.screenshot(ARTIFACTS / "report-synthetic-zoomed.png")
    assert _png_size(shot)[0] >= 1000
    browser.click("#icicle-up")
    parent_of_module = f"{ids[module['span']]['parent_span_id']:016x}"
    assert browser.eval("document.getElementById('icicle').dataset.rootSpanId") == parent_of_module
    browser.click("#icicle-crumbs a[data-level=job]")
    assert browser.eval("document.getElementById('icicle').dataset.rootLevel") == "job"


def test_unknown_peak_and_cpu_only_pages_say_na(browser, tmp_path):
    data = open_page(browser, make_job(steps=1, nodes=1, peak=None), tmp_path / "nopeak.html")
    bill = browser.eval(BILL_JS)
    assert bill["bill-mfu"] == ["n/a", ""] and bill["bill-wasted-day"] == ["n/a", ""]
    # the fleet size starts at the GPUs in the data (editable); spend is known, waste is not
    fleet_gpus = max(s["plasmient.gpus"] for s in spans(make_job(steps=1, nodes=1, peak=None)) if s["plasmient.level"] == "fleet")
    assert data["bill"]["fleet_gpus"] == fleet_gpus
    assert bill["bill-spend-day"][0] == fmt_usd(fleet_gpus * PRICE * 24)
    assert browser.eval(STEP_ROWS_JS)[0]["mfu"] == ["n/a", ""]
    assert all(r["peak_flops"] is None for r in data["roofline"]["roofs"])
    assert browser.eval("document.querySelectorAll('#roofline .roof').length") == 0
    assert int(browser.eval("document.getElementById('roofline').dataset.points")) > 0
    cpu = make_job(steps=1, nodes=1, with_kernels=False)
    for res in cpu.resources:  # a live CPU rank names its CPU, never a GPU
        if "plasmient.rank" in res:
            res.pop("plasmient.gpu.model", None)
            res["plasmient.cpu.model"] = "AMD EPYC (2 threads)"
    open_page(browser, cpu, tmp_path / "cpu.html")
    check_numbers_against_spans(browser, cpu)
    meta = browser.eval("document.getElementById('meta').textContent")
    assert "AMD EPYC (2 threads)" in meta and "GPU" not in meta
    assert browser.eval("document.getElementById('timeline').dataset.drawn") == "0"
    assert browser.eval("document.getElementById('roofline').dataset.points") == "0"


def _without_mfu_on_step(batch: SpanBatch, step: int) -> SpanBatch:
    """The batch with every span of one step's trace lacking an MFU, as a live step with nothing to carry."""
    import pyarrow as pa

    t = batch.table
    on_step = np.asarray(t.column("plasmient.step").to_numpy(zero_copy_only=False) == step)
    mfu = t.column("plasmient.mfu").combine_chunks()
    cleared = pa.array([None if hit else v for hit, v in zip(on_step.tolist(), mfu.to_pylist())], pa.float64())
    i = t.schema.get_field_index("plasmient.mfu")
    return SpanBatch(table=t.set_column(i, t.schema.field(i), cleared), resources=batch.resources)


def test_a_bill_whose_mfu_covers_some_steps_says_over_how_much_device_time(browser, tmp_path):
    batch = _without_mfu_on_step(make_job(steps=3, nodes=1), step=2)
    fleet = [s for s in spans(batch) if s["plasmient.level"] == "fleet"]
    device_s = {s["plasmient.step"]: s["plasmient.wall_s"] * s["plasmient.gpus"] for s in fleet}  # as device_weighted
    data = open_page(browser, batch, tmp_path / "partial.html")
    assert data["bill"]["device_s"] == pytest.approx(sum(device_s.values()))
    assert data["bill"]["mfu_device_s"] == pytest.approx(device_s[0] + device_s[1])
    assert data["bill"]["mfu"] == pytest.approx(device_weighted([s for s in fleet if s["plasmient.step"] != 2], "plasmient.mfu"))
    note = browser.eval("document.getElementById('bill-note').textContent")
    share = fmt_pct((device_s[0] + device_s[1]) / sum(device_s.values()))
    assert re.search(r"\(MFU over the \S+ \S+ of it whose steps have one, " + re.escape(share) + r"\)", note), note
    whole = open_page(browser, make_job(steps=3, nodes=1), tmp_path / "whole.html")
    assert whole["bill"]["mfu_device_s"] == pytest.approx(whole["bill"]["device_s"])
    assert "whose steps have one" not in browser.eval("document.getElementById('bill-note').textContent")


def test_a_sampled_live_cpu_runs_bill_says_its_util_covers_the_full_depth_steps(browser, tmp_path):
    # On a CPU the ops are the device's kernels and a step-depth step records none: util.resident is known on
    # the full-depth steps alone (2 of 12 here), MFU on every step (carried). The bill weighs each over the
    # device time that has it, and says how much that is.
    from capture_helpers import sampled_live_run
    from ingest_checks import by_level, spans as raw_spans

    path = sampled_live_run(tmp_path / "live.jsonl", every=10)
    fleet = by_level(raw_spans(path), "fleet")
    assert len(fleet) == 12
    device_s = [float(a["plasmient.device.window_s"]) * int(a["plasmient.gpus"]) for a in fleet]
    with_util = [(a["plasmient.util.resident"], d) for a, d in zip(fleet, device_s) if "plasmient.util.resident" in a]
    assert len(with_util) == 2 and all("plasmient.mfu" in a for a in fleet)
    page = tmp_path / "live.html"
    assert report_main([str(path), "--html", str(page), "--quiet"]) == 0
    browser.goto(page.resolve().as_uri())
    assert browser.eval("document.body.getAttribute('data-ready')") == "1"
    data = embedded(page.read_text())
    bill = data["bill"]
    assert bill["device_s"] == pytest.approx(sum(device_s), rel=1e-9)
    assert bill["util_device_s"] == pytest.approx(sum(d for _, d in with_util), rel=1e-9)
    assert bill["util"] == pytest.approx(sum(u * d for u, d in with_util) / sum(d for _, d in with_util), rel=1e-9)
    assert bill["mfu_device_s"] == pytest.approx(bill["device_s"], rel=1e-9)
    note = browser.eval("document.getElementById('bill-note').textContent")
    share = fmt_pct(bill["util_device_s"] / bill["device_s"])
    assert re.search(r"\(util over the \S+ \S+ of it whose steps have one, " + re.escape(share) + r"\)", note), note
    assert "MFU over the" not in note


def test_a_hundred_thousand_spans_still_give_a_page_that_loads(browser, tmp_path):
    batch = replicate(make_job(steps=1, nodes=2, ranks_per_node=4, layers=24, kernels_per_op=5), 21)
    assert len(batch) > 100_000
    data = open_page(browser, batch, tmp_path / "big.html")
    size = (tmp_path / "big.html").stat().st_size
    assert size < 12e6, f"page is {size / 1e6:.1f} MB"
    assert len(data["tree"]["parent"]) <= report_html.ICICLE_MAX_NODES
    assert data["timeline"]["mode"] == "binned" and data["roofline"]["mode"] == "by_name"
    assert 0 < int(browser.eval("document.getElementById('icicle').dataset.cells")) <= 4000
    assert int(browser.eval("document.getElementById('timeline').dataset.drawn")) > 0
    assert "largest of" in browser.eval("document.getElementById('icicle-note').textContent")
    rows = summary_rows(batch)
    assert len(browser.eval(STEP_ROWS_JS)) == len(rows) == 21
    browser.screenshot(ARTIFACTS / "report-100k-spans.png")


# ---- real traces through the real pipeline ----------------------------------------------------------


ingest = ingest_batch  # shared with the other report tests (conftest)


def test_real_h100_trace_page_from_the_span_file(browser, tmp_path):
    """End to end: Kineto file -> pipeline -> OTLP JSON lines -> `plasmient report` -> page."""
    from plasmient_trace.export.otlp_json import read_jsonl

    ingested = ingest([TRACES / "h100" / "bert_small_inference.json.gz"], "bert-small")
    jsonl, page = tmp_path / "traces.jsonl", tmp_path / "bert.html"
    write_jsonl(ingested, jsonl)
    assert report_main([str(jsonl), "--html", str(page), "--quiet", "--title", "bert_small_inference"]) == 0
    batch = read_jsonl(jsonl)
    assert len(batch) == len(ingested)
    before = len(browser.events)
    browser.goto(page.resolve().as_uri())
    assert browser.eval("document.body.getAttribute('data-ready')") == "1" and browser.js_errors(since=before) == []
    data = embedded(page.read_text())
    check_numbers_against_spans(browser, batch)
    rank_peaks = {s["plasmient.peak_flops"] for s in spans(batch) if s["plasmient.level"] == "rank"}
    assert None not in rank_peaks, "H100 has a known peak"
    # each plotted kernel under the roof of its own precision (bert's fp32 elementwise work: FP32's)
    kernel_peaks = {s["plasmient.peak_flops"] for s in spans(batch)
                    if s["plasmient.level"] == "kernel" and s.get("plasmient.flops") and s.get("plasmient.bytes")}
    assert {r["peak_flops"] for r in data["roofline"]["roofs"]} == kernel_peaks and None not in kernel_peaks
    modules = [c for c in browser.eval(CELLS_JS) if c["level"] == "module"]
    assert modules, "the H100 trace has nn.Module events"
    target = max(modules, key=lambda c: c["width"])
    browser.click(f'#icicle .cell[data-span-id="{target["span"]}"]')
    assert browser.eval("document.getElementById('icicle').dataset.rootSpanId") == target["span"]
    assert browser.eval("document.querySelector('#icicle-crumbs .here').dataset.level") == "module"
    kernels = [s for s in spans(batch) if s["plasmient.level"] == "kernel"]
    assert data["timeline"]["kernels_total"] == len(kernels) > 0
    # the step's culprit cell names the fleet span's first culprit row: kernel, then op · module
    fleet = next(s for s in spans(batch) if s["plasmient.level"] == "fleet")
    first = json.loads(fleet["plasmient.culprits"])[0]
    cell = browser.eval("[...document.querySelectorAll('#steps td.chain')][0].innerText")
    assert first["kernel"][:40] in cell and (first["op"] is None or first["op"] in cell)
    ARTIFACTS.mkdir(exist_ok=True)
    browser.screenshot(ARTIFACTS / "report-h100-bert.png")


def test_a_page_says_how_many_kernels_the_span_budget_folded(browser, tmp_path):
    from conftest import ingested, raw_activities, raw_trace

    name = "v100/resnet50_training.json.gz"
    in_steps = sum(1 for a in raw_activities(raw_trace(name)) if a["step"] is not None)
    data = open_page(browser, ingested(name, max_spans=1500).batch, tmp_path / "budget.html")
    drawn = data["meta"]["kernel_spans"]
    header = browser.eval("document.getElementById('meta').innerText")
    assert f"{in_steps} kernels ({drawn} drawn as spans" in header
    note = browser.eval("document.getElementById('timeline-note').innerText")
    assert f"All {drawn} kernel spans drawn one by one. The other {in_steps - drawn} kernels were folded" in note


def test_a_tiny_known_mfu_reads_as_in_the_terminal_not_as_zero(browser, tmp_path):
    # the MI250 toy trains at an MFU near 1e-6: the page and the terminal both give its digits
    batch = ingest([TRACES / "mi250" / "minitoy_train.json.gz"], "minitoy")
    mfus = [s["plasmient.mfu"] for s in spans(batch) if s["plasmient.level"] == "fleet" and s["plasmient.mfu"] is not None]
    assert mfus and all(0 < m < 5e-4 for m in mfus)
    open_page(browser, batch, tmp_path / "minitoy.html", title="mi250 minitoy")
    check_numbers_against_spans(browser, batch)
    assert all(fmt_pct(m) != "0.0%" for m in mfus)


def test_real_two_rank_job_page(browser, tmp_path):
    batch = ingest(sorted((TRACES / "a100_multirank").glob("rank-*.json.gz")), "multirank")
    data = open_page(browser, batch, tmp_path / "multirank.html", title="a100 multirank")
    check_numbers_against_spans(browser, batch)
    kernels = [s for s in spans(batch) if s["plasmient.level"] == "kernel"]
    lanes = {(k["plasmient.rank"], k["plasmient.gpu.device"], k["plasmient.gpu.stream"]) for k in kernels}
    assert len(data["timeline"]["lanes"]) == len(lanes)
    assert {la["rank"] for la in data["timeline"]["lanes"]} == {k["plasmient.rank"] for k in kernels}
    assert len({la["rank"] for la in data["timeline"]["lanes"]}) == 2
    ARTIFACTS.mkdir(exist_ok=True)
    browser.screenshot(ARTIFACTS / "report-a100-multirank.png")


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_timeline_starts_at_the_step_and_shows_its_leading_host_gap_as_idle(browser, tmp_path):
    """ViT inference on an H100: the GPU waits 0.25 ms for the host before the step's first kernel.
    That gap is the step's idle time and must be on the timeline, not cut off by starting at the first kernel."""
    batch = ingest([TRACES / "h100" / "vit_image_classification.json.gz"], "vit")
    data = open_page(browser, batch, tmp_path / "vit.html")
    step = next(s for s in spans(batch) if s["plasmient.level"] == "step")
    kernels = [s for s in spans(batch) if s["plasmient.level"] == "kernel"]
    gap_ns = min(k["start_ns"] for k in kernels) - step["plasmient.device.start_ns"]
    assert gap_ns > 1e5 and step["plasmient.idle_s"] >= gap_ns / 1e9 * 0.999
    tl = data["timeline"]
    assert tl["steps"][0]["start"] == 0.0 and min(tl["start"]) == pytest.approx(gap_ns / 1e3, abs=1.0)
    # hover the middle of the gap on the first lane: the page says the device is idle there
    x, y = browser.eval(f"""(() => {{ const c = document.getElementById('timeline'); c.scrollIntoView({{block: 'center'}});
      const r = c.getBoundingClientRect(), plotW = c.clientWidth - 190 - 8, [v0, v1] = c.dataset.view.split(',').map(Number);
      return [r.left + 190 + ({gap_ns / 2e3} - v0) * plotW / (v1 - v0), r.top + 34 + 7]; }})()""")
    browser.send("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": x, "y": y})
    tip = browser.eval("document.getElementById('timeline-tip').textContent")
    assert "idle" in tip, tip
    assert "host gap" in browser.eval("document.getElementById('timeline-note').textContent")


def test_a_cpu_pages_bill_blames_the_cpus_peak():
    """cpu_only/rank-34 covers all its busy time with known FLOPs and has no CPU peak offline: the page says
    so about the CPU, as the terminal does."""
    bill = report_data(ingest_batch([TRACES / "cpu_only" / "rank-34.json.gz"], "cpu"))["bill"]
    assert bill["mfu"] is None and bill["mfu_unknown_why"].startswith("the CPU's peak FLOP/s is unknown")


def test_a_cpu_run_page_speaks_of_cpus_and_folds_no_kernels(browser, tmp_path):
    # A live CPU run's page said "fleet size 2 GPUs", "$ / GPU-hour", "wasted GPU-s", lanes "rank 0 · gpu ?", and
    # "3230 kernels (0 drawn as spans, the rest folded into their ops)": a CPU's kernels are its ops, drawn as
    # op spans, and no span budget folded them.
    from capture_helpers import sampled_live_run

    from plasmient_trace.report.cli import read_span_files

    batch = read_span_files([str(sampled_live_run(tmp_path / "cpu.jsonl", every=1, steps=3))])
    steps = [s for s in spans(batch) if s["plasmient.level"] == "step"]
    assert steps and all(s["plasmient.device.type"] == "cpu" for s in steps)
    data = open_page(browser, batch, tmp_path / "cpu.html")
    assert data["meta"]["device"] == "CPU" and data["meta"]["cpu_kernels"] == data["meta"]["kernels"] > 0
    text = browser.eval("document.body.innerText")
    assert not [line for line in text.splitlines() if "GPU" in line]  # no GPU anywhere on a CPU run's page
    assert browser.eval("document.querySelector('#bill-section .bill-inputs').innerText").split() == \
        ["fleet", "size", "CPUs", "price", "$", "/", "CPU-hour", "baseline", "MFU", "%"]
    header = browser.eval("document.getElementById('meta').innerText")
    assert f"{data['meta']['kernels']} kernels (all of them CPU ops)" in header and "folded" not in header
    assert "folded" not in browser.eval("document.getElementById('timeline-note').innerText")
