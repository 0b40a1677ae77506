"""The terminal summary: per step wall, util.resident vs MFU, the gap in GPU-hours and dollars, and
the top culprits kernel -> op -> module -> rank with their suggestion."""

from __future__ import annotations

import json
import re

import io
import math
from pathlib import Path

import pytest

from conftest import ingest_batch, trace_path
from rich.console import Console

from plasmient_trace.conventions import SpanBatch
from plasmient_trace.report.cli import merge_batches
from plasmient_trace.report.summary import (
    fmt_gpu_hours,
    fmt_pct,
    fmt_seconds,
    fmt_usd,
    progress,
    render_summary,
    summary_rows,
    top_culprits,
)
from report_batches import make_job

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"


def spans(batch: SpanBatch) -> list[dict]:
    return batch.table.to_pylist()


def fleet_span(batch: SpanBatch, trace_id_hex: str) -> dict:
    (row,) = [s for s in spans(batch) if s["plasmient.level"] == "fleet" and s["trace_id"].hex() == trace_id_hex]
    return row


def rendered(batch: SpanBatch, **kw) -> str:
    console = Console(file=io.StringIO(), width=600, record=True, color_system=None)  # wide: no cell wraps
    render_summary(batch, console=console, **kw)
    return console.export_text()


def step_cells(text: str, step: int) -> dict[str, str]:
    """The cells of one step's row in the rendered steps table, by column header."""
    lines = text.splitlines()
    header = next(line for line in lines if "util.resident" in line)
    names = [c.strip() for c in header.strip("┃").split("┃")]
    row = next(line for line in lines if line.startswith(f"│ {step:>4} "))
    return dict(zip(names, (c.strip() for c in row.strip("│").split("│"))))


def walk_chain(batch: SpanBatch, kernel: dict) -> tuple[str | None, str | None, int | None]:
    """Independent reference: follow parent_span_id links span by span with a dict."""
    by_id = {(s["trace_id"], s["span_id"]): s for s in spans(batch)}
    op = module = None
    cur = kernel
    while cur["parent_span_id"]:
        cur = by_id[(cur["trace_id"], cur["parent_span_id"])]
        if cur["plasmient.level"] == "op" and op is None:
            op = cur["name"]
        if cur["plasmient.level"] == "module" and module is None:
            module = cur["plasmient.module.path"] or cur["name"]
    return op, module, kernel["plasmient.rank"]


# ---- rows -----------------------------------------------------------------------------------


def test_one_row_per_step_with_the_fleet_span_numbers():
    batch = make_job(steps=3, nodes=2)
    rows = summary_rows(batch)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        f = fleet_span(batch, r["trace_id"])
        assert r["level"] == "fleet" and r["ranks"] == 2
        assert r["wall_s"] == f["plasmient.wall_s"]
        assert r["util"] == f["plasmient.util.resident"]
        assert r["mfu"] == f["plasmient.mfu"]
        assert r["wasted_usd"] == f["plasmient.cost.wasted_usd"]
        assert r["cost_usd"] == f["plasmient.cost.usd"]
        expected_gap = (f["plasmient.util.resident"] - f["plasmient.mfu"]) * f["plasmient.wall_s"] * f["plasmient.gpus"] / 3600
        assert r["gap_gpu_hours"] == pytest.approx(expected_gap, rel=1e-12)
        assert r["suggestion"] == f["plasmient.culprit.suggestion"]


def _pattern(path):
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", path) if path else None


def test_the_terminal_names_the_culprits_of_the_fleet_span_in_its_order():
    batch = make_job(steps=1, nodes=2, layers=3)
    (row,) = summary_rows(batch, top=3)
    fleet = fleet_span(batch, row["trace_id"])
    expected = json.loads(fleet["plasmient.culprits"])[:3]
    got = [(c["kernel"], c["op"], c["module"], c["rank"], c["wasted_s"]) for c in row["culprits"]]
    assert got == [(c["kernel"], c["op"], c["module"], c.get("rank"), c["wasted_s"]) for c in expected]
    top = row["culprits"][0]
    assert (top["kernel"], top["op"]) == (fleet["plasmient.culprit.kernel"], fleet["plasmient.culprit.op"])
    assert top["chain"] == " -> ".join(p for p in (top["kernel"], top["op"], top["module"]) if p) + f" -> rank {top['rank']}"
    wasted = [c["wasted_s"] for c in row["culprits"]]
    assert wasted == sorted(wasted, reverse=True)


def test_the_same_chain_launched_several_times_is_summed():
    batch = make_job(steps=1, nodes=1, layers=2, kernels_per_op=3)
    (row,) = summary_rows(batch, top=50)
    kernels = [s for s in spans(batch) if s["plasmient.level"] == "kernel"]
    for c in row["culprits"]:
        # one row per kernel, op and module pattern: every launch in every layer is summed into it
        same = [k for k in kernels if k["name"] == c["kernel"] and
                (walk_chain(batch, k)[0], _pattern(walk_chain(batch, k)[1])) == (c["op"], c["module"])]
        assert c["count"] == len(same) == 3 * (2 if c["module"] else 1)
        assert c["layers"] == (2 if c["module"] else 0)
        assert c["wasted_s"] == pytest.approx(sum(k["plasmient.wasted_s"] for k in same))


def test_every_culprit_row_carries_its_own_suggestion():
    batch = make_job(steps=1, nodes=2)
    (row,) = summary_rows(batch, top=10)
    fleet = fleet_span(batch, row["trace_id"])
    rows = json.loads(fleet["plasmient.culprits"])
    assert [c["suggestion"] for c in row["culprits"]] == [r["suggestion"] for r in rows][:len(row["culprits"])]
    assert all(c["suggestion"] for c in row["culprits"])


def test_step_level_sampling_falls_back_to_the_step_culprit_attributes():
    batch = make_job(steps=2, nodes=2, depth="step")
    assert not any(s["plasmient.level"] in ("module", "op", "kernel") for s in spans(batch))
    rows = summary_rows(batch)
    assert rows and all(r["sampled_depth"] == "step" for r in rows)
    for r in rows:
        # the subtree is gone, the fleet span's culprit rows (computed on it) are not
        fleet = fleet_span(batch, r["trace_id"])
        expected = json.loads(fleet["plasmient.culprits"])[:5]
        got = [(c["kernel"], c["op"], c["module"], c["wasted_s"], c["suggestion"]) for c in r["culprits"]]
        assert got == [(c["kernel"], c["op"], c["module"], c["wasted_s"], c["suggestion"]) for c in expected]


def test_a_batch_mixing_full_and_step_sampled_traces_uses_the_best_source_per_trace():
    full, sampled = make_job(job_id="a", steps=1), make_job(job_id="b", steps=1, depth="step")
    rows = {r["job_id"]: r for r in summary_rows(merge_batches([full, sampled]))}
    assert rows["a"]["culprits"] == summary_rows(full)[0]["culprits"]
    assert rows["b"]["culprits"] == summary_rows(sampled)[0]["culprits"]


def test_cpu_only_trace_has_util_but_no_mfu_and_does_not_crash():
    batch = make_job(steps=1, nodes=1, with_kernels=False)
    (row,) = summary_rows(batch)
    assert row["util"] == 0.0 and row["mfu"] is None and row["gap_gpu_hours"] is None
    # nothing was measured below the step: no culprit is invented
    assert row["culprits"] == []
    text = rendered(batch)
    assert "n/a" in text


def test_unknown_peak_prints_na_for_mfu_never_zero():
    batch = make_job(steps=1, nodes=1, peak=None)
    (row,) = summary_rows(batch)
    assert row["mfu"] is None and row["util"] > 0
    text = rendered(batch)
    cells = step_cells(text, 0)
    assert cells["util.resident"] == fmt_pct(row["util"])
    assert cells["MFU"] == "n/a" and cells["gap"] == "n/a"
    assert "peak FLOP/s is unknown" in text


def test_empty_batch_gives_no_rows_and_a_one_line_summary():
    from plasmient_trace.conventions import empty_span_table

    empty = SpanBatch(empty_span_table(), [])
    assert summary_rows(empty) == [] and top_culprits(empty) == []
    assert "no spans" in rendered(empty)


# ---- rendering --------------------------------------------------------------------------------


def test_render_prints_the_row_numbers_and_culprits_with_suggestions():
    batch = make_job(steps=2, nodes=2)
    rows = summary_rows(batch)
    text = rendered(batch, top=3)
    for r in rows:
        cells = step_cells(text, r["step"])
        assert cells == {
            "step": str(r["step"]),
            "ranks": "2",
            "window": fmt_seconds(r["wall_s"]),  # the device window the ratios divide by
            "cov.": fmt_pct(r["coverage"]),
            "util.resident": fmt_pct(r["util"]),
            "MFU": fmt_pct(r["mfu"]),
            "gap": fmt_gpu_hours(r["gap_gpu_hours"]),
            "wasted $": fmt_usd(r["wasted_usd"]),
        }
        # util and MFU side by side, in that order
        assert list(cells).index("MFU") == list(cells).index("util.resident") + 1
    culprits = top_culprits(batch, top=3)
    assert len(culprits) == 3
    flat = " ".join(text.split())
    for c in culprits:
        assert c["suggestion"] and " ".join(c["suggestion"].split()) in flat
        assert f"rank {c['rank']}" in flat


def test_formats():
    assert fmt_pct(None) == "n/a" and fmt_pct(float("nan")) == "n/a"
    assert fmt_pct(0.0) == "0.0%" and fmt_pct(0.4567) == "45.7%"
    # a known small fraction keeps two significant digits instead of reading as a zero
    assert fmt_pct(8.807945355923446e-07) == "0.000088%" and fmt_pct(0.0004) == "0.040%" and fmt_pct(0.0005) == "0.1%"
    assert fmt_usd(1234.567) == "$1,234.57" and fmt_usd(0.5) == "$0.5000" and fmt_usd(4.0556e-7) == "$4.06e-7"
    assert fmt_usd(0.0) == "$0.00" and fmt_usd(None) == "n/a"
    assert fmt_gpu_hours(1.28e-7) == "1.28e-7 GPU-h" and fmt_gpu_hours(0.25) == "0.2500 GPU-h" and fmt_gpu_hours(1234.5) == "1,234.5 GPU-h"
    assert fmt_seconds(0.000325) == "325.0 µs" and fmt_seconds(0.01461) == "14.61 ms" and fmt_seconds(2.5) == "2.500 s" and fmt_seconds(3600) == "3,600 s"


def test_progress_draws_on_a_terminal_and_quiet_silences_it():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100)
    with progress(console=console) as update:
        update("reading rank-0.json.gz", 0, 2)
        update("stitching", 2, 2)
    assert "stitching" in out.getvalue() or "reading" in out.getvalue()
    out_q = io.StringIO()
    with progress(quiet=True, console=Console(file=out_q, force_terminal=True)) as update:
        update("reading", 0, 1)
    assert out_q.getvalue() == ""


def test_progress_shows_a_file_name_as_it_is_never_as_rich_markup():
    # the bar's label names the user's files: "[/b]" in one was a rich MarkupError traceback mid-ingest
    out = io.StringIO()
    with progress(console=Console(file=out, force_terminal=True, width=120, color_system=None)) as update:
        update("reading run[/b][bold]7.json.gz", 1, 2)
    assert "reading run[/b][bold]7.json.gz" in out.getvalue()


def test_reading_span_files_reports_its_progress_in_mib_of_the_files_as_stored(tmp_path, monkeypatch):
    # `plasmient report` on 3 GB of spans read for a minute with nothing on the screen. The bar counts
    # MiB of the files as stored (a .gz by its compressed bytes), over every file given.
    import gzip as gz

    from conftest import ingested
    from plasmient_trace.export import otlp_json_read
    from plasmient_trace.export.otlp_json import write_jsonl
    from plasmient_trace.report.cli import read_span_files

    plain = tmp_path / "v100.jsonl"
    write_jsonl(ingested("v100/resnet50_training.json.gz").batch, plain)
    packed = tmp_path / "v100-again.jsonl.gz"
    packed.write_bytes(gz.compress(plain.read_bytes(), compresslevel=1))  # the same spans: counted once, noted
    monkeypatch.setattr(otlp_json_read, "_PROGRESS_EVERY_S", 0.0)
    seen: list[tuple[str, int, int]] = []
    batch = read_span_files([str(plain)], progress=lambda *a: seen.append(a))
    sizes = plain.stat().st_size >> 20
    assert len(batch) and seen and {total for _, _, total in seen} == {sizes} and sizes >= 60
    done = [d for _, d, _ in seen]
    assert done == sorted(done) and 0 <= done[0] and done[-1] <= sizes and done[-1] >= sizes - 16
    assert {label for label, _, _ in seen} == {"reading v100.jsonl (MiB)"}
    # a gzip'd file counts its stored bytes; two files add up under one total
    seen.clear()
    notes: list[str] = []
    read_span_files([str(plain), str(packed)], notes, progress=lambda *a: seen.append(a))
    assert len(notes) == 1 and "counted once" in notes[0]
    total = sizes + (packed.stat().st_size >> 20)
    assert {t for _, _, t in seen} == {total}
    second = [d for label, d, _ in seen if "again" in label]
    assert second and second[0] >= sizes and second[-1] <= total and second == sorted(second)


# ---- real traces through the real pipeline ----------------------------------------------------------


ingest = ingest_batch  # shared with the other report tests (conftest)


def test_real_h100_trace_summary_matches_its_fleet_spans():
    batch = ingest([TRACES / "h100" / "bert_small_inference.json.gz"], "bert-small")
    rows = summary_rows(batch)
    assert rows
    for r in rows:
        f = fleet_span(batch, r["trace_id"])
        assert r["util"] == f["plasmient.util.resident"] and r["wall_s"] == f["plasmient.device.window_s"]
        assert r["mfu"] == f["plasmient.mfu"]
        assert r["mfu"] is not None, "H100 has a known peak"
        assert r["util"] >= r["mfu"]
    kernel_names = {s["name"] for s in spans(batch) if s["plasmient.level"] == "kernel"}
    culprits = [c for r in rows for c in r["culprits"]]
    assert culprits and all(c["kernel"] in kernel_names | {"[device idle]"} for c in culprits if c["kernel"])
    text = rendered(batch)
    assert fmt_pct(rows[0]["util"]) in text and fmt_pct(rows[0]["mfu"]) in text


def test_real_two_rank_job_summary_covers_both_ranks():
    batch = ingest(sorted((TRACES / "a100_multirank").glob("rank-*.json.gz")), "multirank")
    rows = summary_rows(batch)
    assert rows and all(r["ranks"] == 2 for r in rows)
    ranks = {c["rank"] for r in rows for c in r["culprits"]}
    assert ranks <= {s["plasmient.rank"] for s in spans(batch) if s["plasmient.level"] == "rank"}
    rendered(batch)


def test_real_cpu_only_trace_does_not_crash():
    batch = ingest([TRACES / "cpu_only" / "rank-34.json.gz"], "cpu")
    rows = summary_rows(batch)
    assert all(r["mfu"] is None or math.isfinite(r["mfu"]) for r in rows)
    rendered(batch)


# a job id is the user's text: "[/b]" in it was a rich MarkupError traceback, "[bold]" vanished
@pytest.mark.parametrize("jobs", [("run-a", "run-b"), ("nightly[/b]", "run[bold]")])
def test_spans_of_several_runs_say_how_many_jobs_the_rows_belong_to(jobs):
    # each live run has its own job id, and several runs may append to one --out file: step numbers repeat
    from plasmient_trace.pipeline import IngestOptions, ingest_paths

    trace = TRACES / "v100" / "resnet50_training.json.gz"
    runs = [ingest_paths([trace], IngestOptions(job_id=job)).batch for job in jobs]
    steps = sum(1 for s in spans(runs[0]) if s["plasmient.level"] == "step")
    text = rendered(merge_batches(runs))
    a, b = jobs
    assert f"2 jobs in these spans: {a} ({steps} steps), {b} ({steps} steps); rows are sorted by job, then step, " \
           "and the all row adds them all up" in " ".join(text.split())
    assert "jobs in these spans" not in rendered(runs[0])


@pytest.mark.parametrize("name", ["a100/nccl_training_rank0_of2.json.gz", "a100/alexnet.json.gz"])
def test_mfu_unknown_because_only_zero_flop_kernels_are_known_is_said_so_not_blamed_on_the_peak(name):
    """Both traces were recorded without shapes (read from the raw JSON); the A100's peak is known. The only
    kernels with known FLOPs are collectives and copies, so MFU is unknown, and the note gives that reason."""
    from conftest import raw_trace

    events = raw_trace(name)["traceEvents"]
    assert not [e for e in events if e.get("cat") == "cpu_op" and e.get("args", {}).get("Input Dims")]
    batch = ingest([TRACES / name], "no-shapes")
    rows = summary_rows(batch)
    assert rows and all(r["mfu"] is None and r["flops"] is None and 0 < r["coverage"] < 1 for r in rows)
    text = " ".join(rendered(batch).split())
    assert "the only kernels with known FLOPs do no math" in text
    assert "peak FLOP/s is unknown" not in text
    for r in rows:
        assert fmt_pct(r["coverage"]) in text


def test_a_fully_covered_step_without_mfu_blames_the_unknown_peak():
    """cpu_only/rank-34 is a CPU trace whose ops' FLOPs are all known (coverage 100%); offline its CPU's peak
    is unknown, which is the one reason its MFU is n/a."""
    batch = ingest([TRACES / "cpu_only" / "rank-34.json.gz"], "cpu")
    rows = summary_rows(batch)
    assert rows and all(r["mfu"] is None and r["coverage"] == pytest.approx(1.0) for r in rows)
    text = " ".join(rendered(batch).split())
    assert "MFU n/a: the CPU's peak FLOP/s is unknown" in text and "do no math" not in text


def test_the_culprits_table_says_over_how_many_steps_a_sampled_live_run_sums_them(tmp_path, capsys):
    # A live run exports culprits on its full-depth steps only (2 of 12 here): the table's wasted times are
    # theirs, and its title says so.
    from capture_helpers import sampled_live_run
    from ingest_checks import by_level, spans as raw_spans
    from plasmient_trace.report.cli import main as report_main

    path = sampled_live_run(tmp_path / "live.jsonl", every=10)
    steps = by_level(raw_spans(path), "step")
    named = [s for s in steps if "plasmient.culprits" in s]
    assert (len(named), len(steps)) == (2, 12)
    capsys.readouterr()
    assert report_main([str(path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "top culprits (kernel -> op -> module -> rank), summed over the 2 of 12 steps that name culprits; " \
           "the others ran at step depth" in out
    # an ingested trace names culprits on every step: the title stays as it is
    batch = ingest_batch([trace_path("h100/vit_image_classification.json.gz")], "v")
    text = rendered(batch)
    assert "top culprits (kernel -> op -> module -> rank)" in text and "summed over" not in text


@pytest.mark.parametrize("width", [80, 40])
def test_a_pipe_or_narrow_terminal_gets_every_number_whole(width):
    # A pipe or a CI log is an 80-column console to rich. The steps table is wider than that, and rich cut
    # its cells: an H100 BERT step read "4.37 …" for its wall, "100.…" for its coverage, "$1.48e…" wasted.
    batch = ingest([TRACES / "h100" / "bert_small_inference.json.gz"], "bert-small")
    narrow = Console(file=io.StringIO(), width=width, record=True, color_system=None)
    render_summary(batch, console=narrow)
    text = narrow.export_text()
    wide = rendered(batch)
    for r in summary_rows(batch):
        assert step_cells(text, r["step"]) == step_cells(wide, r["step"])
        assert fmt_usd(r["wasted_usd"]) in text and fmt_gpu_hours(r["gap_gpu_hours"], "GPU") in text
    # only the steps table runs long; the culprit table still folds its text to the console's width
    culprits = text[text.index("top culprits"):]
    assert max(len(line) for line in culprits.splitlines()) <= width
