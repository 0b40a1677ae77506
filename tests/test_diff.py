"""`plasmient diff A B` on real traces: its totals and rows against sums taken from the raw span JSON,
a synthetic slowdown it must name first, and the exit status a CI job reads."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import pytest

from capture_helpers import sampled_live_run
from conftest import ALL_TRACES, fifo_fed, ingested, trace_path
from plasmient_trace.cli import main
from plasmient_trace.report.summary import fmt_seconds

VIT = "h100/vit_image_classification.json.gz"
RANK0, RANK1 = "a100_multirank/rank-0.json.gz", "a100_multirank/rank-1.json.gz"


def _ingest(trace: str, out: Path, *extra: str) -> Path:
    assert main(["ingest", str(trace_path(trace)), "--out", str(out), "--quiet", *extra]) == 0
    return out


@pytest.fixture(scope="module")
def spans_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("diff")
    _ingest(VIT, d / "vit.jsonl", "--parquet", str(d / "vit_parquet"))
    _ingest(RANK0, d / "rank0.jsonl")
    _ingest(RANK1, d / "rank1.jsonl")
    return d


# ---- the raw span JSON, read without the project's reader -------------------------------------------


def _value(v: dict):
    for k in ("doubleValue", "intValue", "stringValue", "boolValue"):
        if k in v:
            return float(v[k]) if k == "intValue" else v[k]
    return None


def raw_spans(path: Path) -> list[dict]:
    """Every span of an OTLP JSON lines file as {name, id, parent, trace, attrs}."""
    spans = []
    for line in path.read_text().splitlines():
        for rs in json.loads(line)["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                for s in ss["spans"]:
                    spans.append({"name": s["name"], "id": (s["traceId"], s["spanId"]),
                                  "parent": (s["traceId"], s.get("parentSpanId", "")), "raw": s,
                                  "attrs": {a["key"]: _value(a["value"]) for a in s["attributes"]}})
    return spans


def _sum(spans: list[dict], key: str, level: str) -> float:
    return sum(s["attrs"].get(key) or 0.0 for s in spans if s["attrs"].get("plasmient.level") == level)


def _by_name(spans: list[dict], key: str, level: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for s in spans:
        if s["attrs"].get("plasmient.level") == level and s["attrs"].get(key) is not None:
            out[s["name"]] += s["attrs"][key]
    return out


def run_diff(a: Path, b: Path, tmp: Path, *flags: str) -> tuple[int, dict]:
    out = tmp / "diff.json"
    rc = main(["diff", str(a), str(b), "--json", str(out), *flags])
    return rc, json.loads(out.read_text()) if out.exists() else {}


@pytest.mark.parametrize("width", [80, 40])
def test_a_narrow_console_prints_every_rows_name_whole_beside_its_numbers(spans_dir: Path, tmp_path: Path, width: int) -> None:
    # A pipe or a CI log is an 80-column console: the numbers took it all and the name column folded to
    # four characters, "aten" for aten::nll_loss_backward, the rest of the name lost.
    import io

    from rich.console import Console

    from plasmient_trace.report.diff_cli import NAME_WIDTH, render
    from plasmient_trace.report.summary import _ellipsize

    rc, result = run_diff(spans_dir / "rank0.jsonl", spans_dir / "rank1.jsonl", tmp_path)
    assert rc == 0
    narrow = Console(file=io.StringIO(), width=width, record=True, color_system=None)
    render(result, narrow, 8)
    lines = narrow.export_text().splitlines()
    for dim in ("module", "op", "kernel"):
        for r in result[dim][:8]:
            shown = _ellipsize(r["name"] or "", NAME_WIDTH)
            assert any(shown in line for line in lines), (dim, shown)


# ---- two ranks of one job ---------------------------------------------------------------------


def test_two_ranks_totals_and_rows_equal_the_raw_span_sums(spans_dir: Path, tmp_path: Path, capsys) -> None:
    a, b = raw_spans(spans_dir / "rank0.jsonl"), raw_spans(spans_dir / "rank1.jsonl")
    rc, result = run_diff(spans_dir / "rank0.jsonl", spans_dir / "rank1.jsonl", tmp_path)
    printed = capsys.readouterr().out
    assert rc == 0
    t = result["totals"]
    # The fleet spans' inclusive totals are the oracle for the sums of the exclusive units.
    for key, attr in (("busy_s", "plasmient.busy_s"), ("wasted_s", "plasmient.wasted_s"), ("flops", "plasmient.flops")):
        for side, spans in (("a", a), ("b", b)):
            assert t[key][side] == pytest.approx(_sum(spans, attr, "fleet"), rel=1e-9), (key, side)
    assert t["busy_s"]["a"] == pytest.approx(0.547656, rel=1e-6) and t["busy_s"]["b"] == pytest.approx(0.58005, rel=1e-6)
    # what the terminal table prints is those same totals
    for key in ("busy_s", "wasted_s"):
        assert fmt_seconds(_sum(a, f"plasmient.{key}", "fleet")) in printed
        assert fmt_seconds(_sum(b, f"plasmient.{key}", "fleet")) in printed
    # No device in these traces is named: MFU and $ are unknown, not 0.
    assert t["mfu"]["a"] is None and t["wasted_usd"]["a"] is None
    # per kernel name: the kernel spans' own busy seconds; per op name: the ops' own (.self) seconds
    for dim, level, attr in (("kernel", "kernel", "plasmient.busy_s"), ("op", "op", "plasmient.busy_s.self")):
        rows = {r["name"]: r for r in result[dim]}
        for side, spans in (("a", a), ("b", b)):
            expect = _by_name(spans, attr, level)
            got = {n: r[f"busy_s_{side}"] for n, r in rows.items() if r[f"busy_s_{side}"]}
            assert got.keys() == {n for n, v in expect.items() if v}
            for n, v in expect.items():
                if v:  # an op that launched nothing has no unit, hence no row
                    assert rows[n][f"busy_s_{side}"] == pytest.approx(v, rel=1e-9, abs=1e-15), (dim, n)
    # ranked by |change in wasted seconds|
    deltas = [abs(r["wasted_s_delta"]) for r in result["kernel"]]
    assert deltas == sorted(deltas, reverse=True)
    # the step's host gaps are one row, equal to the steps' own waste
    idle = next(r for r in result["op"] if r["name"] == "[device idle]")
    assert idle["wasted_s_a"] == pytest.approx(_sum(a, "plasmient.wasted_s.self", "step"), rel=1e-9)


@pytest.mark.parametrize("budget", [None, 300])
@pytest.mark.parametrize("name", ALL_TRACES)
def test_every_table_partitions_the_fleet_totals_of_every_shared_trace(name: str, budget: int | None) -> None:
    """Each device-second, wasted second, FLOP, ideal second and wasted dollar of a trace is in exactly one
    row of each table: the rows sum to the fleet spans' inclusive totals, whatever the trace holds (CUDA
    graphs, NCCL, AMD, CPU only, folded kernels, module and op spans a tight span budget folded), and the
    idle row holds the steps' idle gaps, no work."""
    import pyarrow.compute as pc

    from plasmient_trace.report.diff import diff, side_from_batch
    from plasmient_trace.stitch.culprits import IDLE_LABEL

    batch = ingested(name, budget).batch
    side = side_from_batch(batch, name)
    result = diff(side, side)
    fleet = batch.table.filter(pc.equal(batch.table.column("plasmient.level"), "fleet"))
    for q, attr in (("busy_s", "plasmient.busy_s"), ("wasted_s", "plasmient.wasted_s"), ("flops", "plasmient.flops"),
                    ("ideal_s", "plasmient.ideal_s"), ("wasted_usd", "plasmient.cost.wasted_usd")):
        ref = pc.sum(fleet.column(attr)).as_py()
        if q == "ideal_s":  # and the busy seconds of known-FLOP kernels, as the fleet's coverage gives them
            known = pc.sum(pc.multiply(fleet.column("plasmient.flops.coverage"), fleet.column("plasmient.busy_s"))).as_py()
            assert result["totals"]["covered_s"]["a"] == pytest.approx(known, rel=1e-6, abs=1e-12)
        assert (result["totals"][q]["a"] is None) == (ref is None), (q, ref)
        if ref is None:
            continue
        assert result["totals"][q]["a"] == pytest.approx(ref, rel=1e-6, abs=1e-12), q
        for dim in ("module", "op", "kernel"):
            rows = [r[f"{q}_a"] for r in result[dim] if r[f"{q}_a"] is not None]
            assert sum(rows) == pytest.approx(ref, rel=1e-6, abs=1e-12), (q, dim)
    steps = batch.table.filter(pc.equal(batch.table.column("plasmient.level"), "step"))
    idle_s = pc.sum(steps.column("plasmient.idle_s")).as_py() or 0.0
    for dim in ("module", "op", "kernel"):
        idle = [r for r in result[dim] if r["name"] == IDLE_LABEL]
        assert sum(r["wasted_s_a"] or 0.0 for r in idle) == pytest.approx(idle_s, rel=1e-6, abs=1e-12)
        assert all(not r["busy_s_a"] and not r["flops_a"] for r in idle)


@pytest.mark.parametrize("name", ALL_TRACES)
def test_a_rows_mfu_is_absent_where_it_would_only_be_a_lower_bound_of_zero(name: str) -> None:
    """A row whose known FLOPs are 0 while part of its busy time has unknown FLOPs has no MFU (n/a, not 0.0%);
    a row with known non-zero FLOPs and a known peak has one."""
    from plasmient_trace.report.diff import diff, side_from_batch

    result = ingested(name)
    side = side_from_batch(result.batch, name)
    out = diff(side, side)
    for dim in ("module", "op", "kernel"):
        for r in out[dim]:
            coverage, flops = r["coverage_a"], r["flops_a"]
            if coverage is None:
                continue
            if flops == 0 and coverage < 1 - 1e-9:
                assert r["mfu_a"] is None, (dim, r[dim], coverage)
            if r["mfu_a"] is not None:
                assert flops > 0 or coverage >= 1 - 1e-9, (dim, r[dim])
            if flops and flops > 0 and r["ideal_s_a"] is not None and r["busy_s_a"]:
                assert r["mfu_a"] is not None, (dim, r[dim])


def test_the_table_says_how_much_busy_time_its_flops_cover(tmp_path: Path, capsys) -> None:
    """Beside the known FLOPs, the share of busy time they cover, per side: the fleet spans' coverage-weighted
    busy seconds over their busy seconds (a trace recorded without shapes covers only its collectives and copies)."""
    from plasmient_trace.report.summary import fmt_pct

    a, b = trace_path("a100_multirank/rank-0.json.gz"), trace_path("a100/nccl_training_rank0_of2.json.gz")
    rc, _ = run_diff(a, b, tmp_path)
    printed = capsys.readouterr().out
    assert rc == 0
    (line,) = [x for x in printed.splitlines() if "busy time with known FLOPs" in x]
    for path in (a, b):
        fleet = [r for r in ingested(str(path.relative_to(path.parents[1]))).batch.table.to_pylist()
                 if r["plasmient.level"] == "fleet"]
        busy = sum(r["plasmient.busy_s"] for r in fleet)
        covered = sum(r["plasmient.busy_s"] * r["plasmient.flops.coverage"] for r in fleet)
        assert fmt_pct(covered / busy) in line, (path.name, line)
    assert "MFU (step-weighted)" in printed and "0.0%" not in printed.split("by module")[0]


# ---- a run against itself, and against itself slowed down ----------------------------------------


def _pattern(path: str) -> str:
    return re.sub(r"(?<=[_.])\d+(?=\.|$)", "*", path)


def _module_of(spans: list[dict]) -> dict[tuple, str | None]:
    """Each span's nearest module (itself or an ancestor) as a pattern, by walking parent links."""
    by_id = {s["id"]: s for s in spans}
    out: dict[tuple, str | None] = {}
    for s in spans:
        cur, found = s, None
        while cur is not None:
            if cur["attrs"].get("plasmient.level") == "module":
                found = _pattern(cur["attrs"]["plasmient.module.path"])
                break
            cur = by_id.get(cur["parent"])
        out[s["id"]] = found
    return out


SLOWED = ("plasmient.busy_s", "plasmient.busy_s.self", "plasmient.wasted_s", "plasmient.wasted_s.self",
          "plasmient.cost.wasted_usd", "plasmient.cost.wasted_usd.self")


def edit_spans(src: Path, dst: Path, edit) -> None:
    """A copy of a span file with ``edit(span)`` applied to each span's raw OTLP JSON, in file order."""
    lines = []
    for line in src.read_text().splitlines():
        doc = json.loads(line)
        for rs in doc["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                for span in ss["spans"]:
                    edit(span)
        lines.append(json.dumps(doc))
    dst.write_text("\n".join(lines) + "\n")


def _write_slowed(src: Path, dst: Path, module: str, factor: float) -> None:
    """A copy of the span file with every span under one module pattern `factor` times slower/more wasteful."""
    mod_of = _module_of(raw_spans(src))

    def slow(span: dict) -> None:
        if mod_of[(span["traceId"], span["spanId"])] == module:
            for a in span["attributes"]:
                if a["key"] in SLOWED and "doubleValue" in a["value"]:
                    a["value"]["doubleValue"] *= factor

    edit_spans(src, dst, slow)


def test_a_module_slowed_down_is_named_first(spans_dir: Path, tmp_path: Path) -> None:
    src = spans_dir / "vit.jsonl"
    spans = raw_spans(src)
    mod_of = _module_of(spans)
    # exclusive waste per module pattern: the ops' own waste, under their nearest module
    waste: dict[str, float] = defaultdict(float)
    for s in spans:
        if s["attrs"].get("plasmient.level") == "op" and mod_of[s["id"]]:
            waste[mod_of[s["id"]]] += s["attrs"].get("plasmient.wasted_s.self") or 0.0
    # the least wasteful module that has any waste: a small change must still rank first
    module = min((m for m, w in waste.items() if w > 0), key=lambda m: waste[m])
    assert module != max(waste, key=lambda m: waste[m])
    _write_slowed(src, tmp_path / "slow.jsonl", module, 3.0)
    rc, result = run_diff(src, tmp_path / "slow.jsonl", tmp_path)
    assert rc == 0
    first = result["module"][0]
    assert first["name"] == module
    assert first["wasted_s_delta"] == pytest.approx(2 * waste[module], rel=1e-9)
    assert first["busy_s_delta"] > 0
    assert all(r["wasted_s_delta"] == 0 for r in result["module"][1:])


def test_a_run_against_itself_changes_nothing(spans_dir: Path, tmp_path: Path) -> None:
    src = spans_dir / "vit.jsonl"
    rc, result = run_diff(src, src, tmp_path, "--fail-if-mfu-drops", "5%")
    assert rc == 0
    for dim in ("module", "op", "kernel"):
        assert result[dim], dim
        for r in result[dim]:
            for q in ("busy_s", "wasted_s", "flops", "wasted_usd", "kernels"):
                assert r[f"{q}_delta"] in (0, None), (dim, r["name"], q)
            assert r["busy_s_delta"] == 0
    assert all(t["delta"] == 0 for t in result["totals"].values())
    # a kernel whose FLOPs no model knows (coverage 0 on its spans: a100_multirank's fbgemm kernels; every
    # kernel of vit is modelled) has an unknown MFU, never 0%
    unknown_seen = 0
    for spans in (src, spans_dir / "rank0.jsonl"):
        rows = {r["name"]: r for r in (result if spans == src else run_diff(spans, spans, tmp_path)[1])["kernel"]}
        cov: dict[str, set] = defaultdict(set)
        for s in raw_spans(spans):
            if s["attrs"].get("plasmient.level") == "kernel":
                cov[s["name"]].add(s["attrs"].get("plasmient.flops.coverage"))
        unknown = [n for n, c in cov.items() if c == {0.0}]
        unknown_seen += len(unknown)
        assert all(rows[n]["mfu_a"] is None and rows[n]["coverage_a"] == 0 for n in unknown)
        if spans == src:  # the H100's peak is known (a100_multirank names no GPU: no MFU at all there)
            assert all(rows[n]["mfu_a"] is not None and rows[n]["coverage_a"] == 1 for n, c in cov.items() if c == {1.0})
    assert unknown_seen
    # the trace file itself (ingested on the fly) and the Parquet spans read the same as the span file
    for other in (trace_path(VIT), spans_dir / "vit_parquet"):
        rc, result = run_diff(src, other, tmp_path)
        assert rc == 0 and all(t["delta"] == pytest.approx(0, abs=1e-12) for t in result["totals"].values()), other


# ---- the CI gate ----------------------------------------------------------------------------------


def _edit_step_spans(src: Path, dst: Path, edit) -> None:
    """A copy of a span file with ``edit(span)`` applied to each step span's raw OTLP JSON, in file order."""
    step = {"key": "plasmient.level", "value": {"stringValue": "step"}}
    edit_spans(src, dst, lambda span: edit(span) if step in span["attributes"] else None)


def _scale_step_mfu(src: Path, dst: Path, factor: float) -> float:
    """A copy with the step spans' MFU scaled; returns the original step MFU (one step, one GPU)."""
    found = []

    def scale(span: dict) -> None:
        value = next(a["value"] for a in span["attributes"] if a["key"] == "plasmient.mfu")
        found.append(value["doubleValue"])
        value["doubleValue"] *= factor

    _edit_step_spans(src, dst, scale)
    assert found
    return found[-1]


def test_fail_if_mfu_drops(spans_dir: Path, tmp_path: Path, capsys) -> None:
    src = spans_dir / "vit.jsonl"
    mfu = _scale_step_mfu(src, tmp_path / "slow.jsonl", 0.9)
    rc, result = run_diff(src, tmp_path / "slow.jsonl", tmp_path, "--fail-if-mfu-drops", "5%", "--quiet")
    assert rc == 1
    assert result["totals"]["mfu"]["a"] == pytest.approx(mfu) and result["totals"]["mfu"]["b"] == pytest.approx(0.9 * mfu)
    assert "MFU dropped" in capsys.readouterr().err
    assert run_diff(src, tmp_path / "slow.jsonl", tmp_path, "--fail-if-mfu-drops", "15%", "--quiet")[0] == 0
    assert run_diff(src, tmp_path / "slow.jsonl", tmp_path, "--quiet")[0] == 0  # no gate, no failure
    # B faster than A never fails
    assert run_diff(tmp_path / "slow.jsonl", src, tmp_path, "--fail-if-mfu-drops", "0%", "--quiet")[0] == 0
    capsys.readouterr()
    # "-0" is a zero tolerance, said as one: the line read "limit --0%"
    assert run_diff(src, tmp_path / "slow.jsonl", tmp_path, "--fail-if-mfu-drops", "-0", "--quiet")[0] == 1
    assert "limit -0%)" in capsys.readouterr().err


@pytest.mark.parametrize("factor, rc, said", [(0.95, 0, "-5.0% relative"), (0.9499, 1, "-5.01% relative"),
                                              (0.9501, 0, "-4.99% relative")])
def test_the_mfu_gate_at_its_limit(spans_dir: Path, tmp_path: Path, capsys, factor, rc, said) -> None:
    # A drop of exactly 5% computed as 5.00000000000004% and failed a 5% gate, with a line ("-5.0% relative;
    # limit -5%") that read the same as the passing one; a drop just past the limit said -5.0% too.
    src = spans_dir / "vit.jsonl"
    _scale_step_mfu(src, tmp_path / "b.jsonl", factor)
    assert run_diff(src, tmp_path / "b.jsonl", tmp_path, "--fail-if-mfu-drops", "5%", "--quiet")[0] == rc
    assert f"({said}; limit -5%)" in capsys.readouterr().err


def test_the_gate_says_when_a_sides_mfu_leaves_out_steps_that_have_none(tmp_path: Path, capsys) -> None:
    # a live run whose new input shape could not be measured has steps without MFU: B's step-weighted MFU
    # is over the others only, and the gate's line says so
    a = _ingest("mi300x/resnet_act_checkpoint_rank0_of8.json.gz", tmp_path / "a.jsonl")  # steps that each have an MFU
    left_out: list[str] = []

    def drop_the_first_mfu(span: dict) -> None:
        if not left_out:
            left_out.append(span["spanId"])
            span["attributes"] = [x for x in span["attributes"] if x["key"] != "plasmient.mfu"]

    b = tmp_path / "b.jsonl"
    _edit_step_spans(a, b, drop_the_first_mfu)
    steps = [x for x in raw_spans(b) if x["attrs"].get("plasmient.level") == "step"]
    kept = [x for x in steps if x["raw"]["spanId"] != left_out[0]]
    assert len(kept) == len(steps) - 1 and all(x["attrs"].get("plasmient.mfu") is not None for x in kept)

    def device_s(x: dict) -> float:  # the report's weight: the device window the MFU divides by, times its GPUs
        return x["attrs"]["plasmient.device.window_s"] * (x["attrs"].get("plasmient.gpus") or 1)

    expected = sum(x["attrs"]["plasmient.mfu"] * device_s(x) for x in kept) / sum(device_s(x) for x in kept)
    rc, result = run_diff(a, b, tmp_path, "--fail-if-mfu-drops", "50%", "--quiet")
    assert rc == 0 and result["totals"]["mfu"]["b"] == pytest.approx(expected, rel=1e-9)
    assert result["totals"]["mfu_steps"] == {"a": len(steps), "b": len(kept), "delta": -1}
    err = capsys.readouterr().err
    assert f"(B over {len(kept)} of {len(steps)} steps: the others have no MFU)" in err
    run_diff(a, a, tmp_path, "--fail-if-mfu-drops", "50%", "--quiet")
    assert "have no MFU" not in capsys.readouterr().err


def test_an_unknown_mfu_cannot_pass_the_gate(spans_dir: Path, tmp_path: Path, capsys) -> None:
    rc, _ = run_diff(spans_dir / "rank0.jsonl", spans_dir / "rank1.jsonl", tmp_path, "--fail-if-mfu-drops", "5%", "--quiet")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "rank0.jsonl" in err[0] and "MFU" in err[0]


def _bad_inputs(tmp: Path) -> dict[str, Path]:
    (tmp / "empty.jsonl").write_text("")
    (tmp / "garbage.json").write_text("{not json at all")
    (tmp / "notspans.jsonl").write_text('{"resourceSpans": 3}\n')
    raw = trace_path(VIT).read_bytes()
    (tmp / "cut.json.gz").write_bytes(raw[: len(raw) // 2])
    (tmp / "dir").mkdir()
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"x": [1]}), tmp / "foreign.parquet")
    (tmp / "noise.parquet").write_bytes(b"PAR1 but nothing else")
    return {"missing": tmp / "nope.jsonl", **{p.name: p for p in tmp.iterdir() if p.name != "diff.json"}}


def test_bad_inputs_exit_2_with_one_line(spans_dir: Path, tmp_path: Path, capsys) -> None:
    good = spans_dir / "vit.jsonl"
    for what, bad in _bad_inputs(tmp_path).items():
        for args in ((bad, good), (good, bad)):
            rc = main(["diff", str(args[0]), str(args[1]), "--quiet"])
            err = capsys.readouterr().err.strip().splitlines()
            assert rc == 2, what
            assert len(err) == 1 and str(bad) in err[0] and "Traceback" not in err[0], (what, err)
    # an output that cannot be written is bad input too, said before any table is drawn
    (tmp_path / "plain").write_text("a file, not a folder")
    for flag in ("--json", "--parquet", "--html"):
        out = tmp_path / "plain" / "diff.out"
        rc = main(["diff", str(good), str(good), flag, str(out)])
        captured = capsys.readouterr()
        err = captured.err.strip().splitlines()
        assert rc == 2 and err == [f"plasmient diff: error: {out}: {tmp_path / 'plain'} is not a directory"], (flag, err)
        assert captured.out == "", flag
    # folders that do not exist yet are made, as for every other output
    rc = main(["diff", str(good), str(good), "--quiet", "--json", str(tmp_path / "new" / "dir" / "diff.json")])
    assert rc == 0 and json.loads((tmp_path / "new" / "dir" / "diff.json").read_text())["totals"]


# ---- the HTML section ----------------------------------------------------------------------------


DIFF_ROWS_JS = """Object.fromEntries([...document.querySelectorAll('table.diff')].map(t => [t.dataset.dimension,
  [...t.querySelectorAll('tbody tr[data-name]')].map(tr => Object.fromEntries([...tr.querySelectorAll('td[data-field]')]
    .map(td => [td.dataset.field, [td.textContent, td.dataset.value]])))]))"""


def test_html_report_of_b_opens_with_the_diff(spans_dir: Path, tmp_path: Path) -> None:
    from browser import Browser, chromium_path

    if chromium_path() is None:
        pytest.skip("/usr/bin/chromium is missing: run scripts/install-test-deps.sh")
    src = spans_dir / "vit.jsonl"
    spans = raw_spans(src)
    module = "ViTModel_*.ViTEncoder_*.ViTLayer_*.LayerNorm_*"
    _write_slowed(src, tmp_path / "slow.jsonl", module, 3.0)
    page = tmp_path / "diff.html"
    rc, result = run_diff(src, tmp_path / "slow.jsonl", tmp_path, "--html", str(page), "--quiet")
    assert rc == 0
    plain = tmp_path / "plain.html"
    assert main(["report", str(src), "--html", str(plain), "--quiet"]) == 0
    with Browser(width=1400, height=1000) as b:
        b.goto(page.resolve().as_uri())
        assert b.eval("document.body.getAttribute('data-ready')") == "1"
        assert b.js_errors() == []
        assert b.eval("document.getElementById('diff-section').hidden") is False
        shown = b.eval(DIFF_ROWS_JS)
        totals = b.eval("Object.fromEntries([...document.querySelectorAll('#diff-totals tr[data-total]')]"
                        ".map(tr => [tr.dataset.total, [...tr.querySelectorAll('td')].map(td => td.textContent)]))")
        b.goto(plain.resolve().as_uri())
        assert b.eval("document.getElementById('diff-section').hidden") is True
    first = shown["module"][0]
    assert first["name"][0] == module
    # the page's numbers are the slowed spans' own: 2x the module's exclusive waste, from the raw JSON
    mod_of = _module_of(spans)
    waste = sum(s["attrs"].get("plasmient.wasted_s.self") or 0.0 for s in spans
                if s["attrs"].get("plasmient.level") == "op" and mod_of[s["id"]] == module)
    assert float(first["wasted_s_delta"][1]) == pytest.approx(2 * waste, rel=1e-9)
    assert first["wasted_s_delta"][0] == "+" + fmt_seconds(2 * waste)
    assert [r["name"][0] for r in shown["op"]] == [r["name"] for r in result["op"][:len(shown["op"])]]
    assert totals["wasted"][1] == fmt_seconds(sum(s["attrs"]["plasmient.wasted_s"] for s in spans
                                                  if s["attrs"].get("plasmient.level") == "fleet"))


def test_per_step_divides_each_side_by_its_step_count(spans_dir: Path, tmp_path: Path) -> None:
    a, v = raw_spans(spans_dir / "rank0.jsonl"), raw_spans(spans_dir / "vit.jsonl")
    steps_a = sum(1 for s in a if s["attrs"].get("plasmient.level") == "step")
    assert steps_a == 2
    rc, result = run_diff(spans_dir / "rank0.jsonl", spans_dir / "vit.jsonl", tmp_path, "--per-step", "--quiet")
    assert rc == 0 and result["per_step"] is True
    t = result["totals"]
    assert t["busy_s"]["a"] == pytest.approx(_sum(a, "plasmient.busy_s", "fleet") / steps_a, rel=1e-9)
    assert t["busy_s"]["b"] == pytest.approx(_sum(v, "plasmient.busy_s", "fleet"), rel=1e-9)  # one step
    kernels = _by_name(a, "plasmient.wasted_s", "kernel")
    rows = {r["name"]: r for r in result["kernel"]}
    for name, w in kernels.items():
        assert rows[name]["wasted_s_a"] == pytest.approx(w / steps_a, rel=1e-9, abs=1e-15)
    only_a = kernels.keys() - _by_name(v, "plasmient.wasted_s", "kernel").keys()
    assert only_a and all(rows[n]["in_b"] is False and rows[n]["wasted_s_b"] == 0 for n in only_a)


def test_parquet_rows_are_the_json_rows_in_the_documented_schema(spans_dir: Path, tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    from plasmient_trace.report.diff import DIFF_ROW_SCHEMA, diff_document

    out = tmp_path / "rows.parquet"
    rc, result = run_diff(spans_dir / "rank0.jsonl", spans_dir / "rank1.jsonl", tmp_path, "--parquet", str(out), "--quiet")
    assert rc == 0
    table = pq.read_table(out)
    assert table.schema.equals(DIFF_ROW_SCHEMA, check_metadata=False)
    rows = table.to_pylist()
    assert len(rows) == sum(len(result[d]) for d in ("module", "op", "kernel"))
    for dim in ("module", "op", "kernel"):
        mine = [r for r in rows if r["dimension"] == dim]
        assert [r["position"] for r in mine] == list(range(1, len(mine) + 1))
        for r, j in zip(mine, result[dim]):
            assert {k: v for k, v in r.items() if k not in ("dimension", "position")} == {k: j[k] for k in r if k in j}
    documented = {f["name"] for f in diff_document()["rows"]}
    assert documented == set(table.column_names)
    assert documented - {"dimension", "position"} <= set(result["kernel"][0])


def _step_weighted_mfu(spans: list[dict]) -> float:
    steps = [s["attrs"] for s in spans if s["attrs"].get("plasmient.level") == "step"]
    w = [a["plasmient.device.window_s"] * a["plasmient.gpus"] for a in steps]
    return sum(a["plasmient.mfu"] * x for a, x in zip(steps, w)) / sum(w)


def test_gate_on_two_real_ranks_ingested_from_their_traces(tmp_path: Path) -> None:
    """Rank 0 and rank 1 of one job, given as traces with the GPU named: rank 0's MFU is slightly lower, so
    the gate trips only below that relative difference. The MFUs are the raw step spans' own."""
    gpu = ["--gpu-model", "NVIDIA A100-SXM4-80GB"]
    mfu = {}
    for trace in (RANK0, RANK1):
        mfu[trace] = _step_weighted_mfu(raw_spans(_ingest(trace, tmp_path / f"{Path(trace).name}.jsonl", *gpu)))
    drop = (mfu[RANK1] - mfu[RANK0]) / mfu[RANK1]
    assert 0.001 < drop < 0.05, drop
    a, b = trace_path(RANK1), trace_path(RANK0)
    rc, result = run_diff(a, b, tmp_path, *gpu, "--quiet", "--fail-if-mfu-drops", f"{drop * 100 / 2:.3f}%")
    assert rc == 1
    assert result["totals"]["mfu"]["a"] == pytest.approx(mfu[RANK1], rel=1e-9)
    assert result["totals"]["mfu"]["b"] == pytest.approx(mfu[RANK0], rel=1e-9)
    assert run_diff(a, b, tmp_path, *gpu, "--quiet", "--fail-if-mfu-drops", f"{drop * 100 * 2:.3f}%")[0] == 0


def test_a_directory_of_rank_traces_compares_as_its_ingested_span_file(tmp_path: Path) -> None:
    """A multi-rank run is one argument: its directory of traces is stitched as `plasmient ingest DIR` would,
    so comparing it with that ingest's span file changes nothing, and its MFU is the raw step spans'."""
    run = trace_path(RANK0).parent
    gpu = ["--gpu-model", "NVIDIA A100-SXM4-80GB"]
    spans = tmp_path / "run.jsonl"
    assert main(["ingest", str(run), "--out", str(spans), "--quiet", *gpu]) == 0
    rc, result = run_diff(run, spans, tmp_path, *gpu, "--quiet", "--fail-if-mfu-drops", "0%")
    assert rc == 0
    assert result["totals"]["mfu"]["a"] == pytest.approx(_step_weighted_mfu(raw_spans(spans)), rel=1e-9)
    for q in ("busy_s", "wasted_s", "flops"):
        assert result["totals"][q]["a"] == pytest.approx(result["totals"][q]["b"], rel=1e-12), q
        assert result["totals"][q]["a"] > 0
    assert result["totals"]["steps"]["a"] == result["totals"]["steps"]["b"] == 4  # 2 ranks x 2 steps
    # A folder of span files (a live run's ranks each write one) reads as `report DIR` reads it; it was
    # "no spans.parquet in this directory", exit 2. Here the run's lines split over two files.
    live = tmp_path / "live"
    live.mkdir()
    lines = spans.read_bytes().splitlines(keepends=True)
    assert len(lines) >= 2
    (live / "traces.rank0.jsonl").write_bytes(b"".join(lines[0::2]))
    (live / "traces.rank1.jsonl").write_bytes(b"".join(lines[1::2]))
    rc, folder = run_diff(live, spans, tmp_path, "--quiet", "--fail-if-mfu-drops", "0%")
    assert rc == 0 and folder["totals"].keys() == result["totals"].keys()
    for q, sides in result["totals"].items():  # the same sums, added in another order
        assert folder["totals"][q]["a"] == pytest.approx(sides["a"], rel=1e-12), q


def test_a_trace_and_a_span_file_through_pipes_compare_as_the_files_do(spans_dir: Path, tmp_path: Path) -> None:
    # `plasmient diff <(zcat a.json.gz) -`: A pipe was "no such file", and stdin was refused. What a stream
    # holds is known only from its bytes, so it is read once into a private file: the same rows.
    import subprocess
    import sys

    trace = trace_path("h100/bert_small_inference.json.gz")
    cli = [sys.executable, "-m", "plasmient_trace.cli", "diff"]
    for a, b in ((trace, trace), (spans_dir / "vit.jsonl", trace)):
        files = subprocess.run([*cli, str(a), str(b), "--json", str(tmp_path / "files.json"), "--quiet"], cwd=tmp_path,
                               capture_output=True, timeout=300)
        assert files.returncode == 0, files.stderr
        (tmp_path / "a.pipe").unlink(missing_ok=True)
        fifo = fifo_fed(tmp_path, "a.pipe", a.read_bytes())
        with open(b, "rb") as stdin:
            streams = subprocess.run([*cli, str(fifo), "-", "--json", str(tmp_path / "streams.json"), "--quiet"],
                                     cwd=tmp_path, stdin=stdin, capture_output=True, timeout=300)
        assert streams.returncode == 0, streams.stderr
        got, want = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("streams", "files"))
        assert (got.pop("a"), got.pop("b")) == (str(fifo), "-")
        want.pop("a"), want.pop("b")
        assert got == want
    # a bad stream is named as the pipe, not as the private copy
    fifo.unlink()
    fifo = fifo_fed(tmp_path, "a.pipe", b"garbage\n")
    bad = subprocess.run([*cli, str(fifo), str(trace), "--quiet"], cwd=tmp_path, capture_output=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.decode().startswith(f"plasmient diff: error: {fifo}: "), bad.stderr
    assert b"plasmient-diff-" not in bad.stderr


def test_loading_a_side_reports_progress_for_a_span_file_and_for_a_trace(spans_dir: Path, monkeypatch) -> None:
    # diff reads two inputs that can each take minutes: the same bar as report and ingest (on a terminal)
    import argparse

    from plasmient_trace.export import otlp_json_read
    from plasmient_trace.report.diff_cli import add_diff_arguments, load_side

    parser = argparse.ArgumentParser()
    add_diff_arguments(parser)
    monkeypatch.setattr(otlp_json_read, "_PROGRESS_EVERY_S", 0.0)
    for side, want in ((spans_dir / "vit.jsonl", "reading vit.jsonl (MiB)"), (trace_path("h100/bert_small_inference.json.gz"), "stitch")):
        seen: list[tuple[str, int, int]] = []
        args = parser.parse_args([str(side), str(side)])
        assert len(load_side(str(side), args, lambda *a: seen.append(a)))
        assert any(want in label for label, _, _ in seen), (side, seen)


# ---- live runs that sampled at step depth ------------------------------------------------------------


@pytest.fixture(scope="module")
def sampled_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("sampled")
    return sampled_live_run(d / "a.jsonl", every=10), sampled_live_run(d / "b.jsonl", every=4)  # full depth at 0, 10 | 0, 4, 8


def test_sampled_live_runs_compare_over_their_full_depth_steps(sampled_runs, tmp_path: Path, capsys) -> None:
    # Default sampling exports kernels, ops and modules for one step in ten: the device time, FLOPs and
    # waste of the units are those steps' alone, so a per-step comparison divides by them, not by all steps.
    a, b = sampled_runs
    full = {}
    for side, path in (("a", a), ("b", b)):
        steps = [s for s in raw_spans(path) if s["attrs"].get("plasmient.level") == "step"]
        detailed = [s for s in steps if s["attrs"]["plasmient.sampled_depth"] == "full"]
        assert len(steps) == 12 and all(s["attrs"].get("plasmient.busy_s") is None for s in steps if s not in detailed)
        full[side] = (len(detailed), sum(s["attrs"]["plasmient.busy_s"] for s in detailed),
                      sum(s["attrs"]["plasmient.flops"] for s in detailed))
    assert (full["a"][0], full["b"][0]) == (2, 3)

    rc, result = run_diff(a, b, tmp_path, "--per-step")
    assert rc == 0
    t = result["totals"]
    assert t["steps"] == {"a": 12, "b": 12, "delta": 0}
    assert t["detailed_steps"] == {"a": 2, "b": 3, "delta": 1}
    for side in ("a", "b"):
        n, busy, flops = full[side]
        assert t["busy_s"][side] == pytest.approx(busy / n, rel=1e-9)
        assert t["flops"][side] == pytest.approx(flops / n, rel=1e-9)
    out = " ".join(capsys.readouterr().out.split())
    assert "at full depth" in out and "over the full-depth steps alone" in out and "compare them with --per-step" not in out

    # the totals without --per-step are sums over different numbers of steps, and the table says so
    rc, result = run_diff(a, b, tmp_path)
    assert rc == 0 and result["totals"]["busy_s"]["b"] == pytest.approx(full["b"][1], rel=1e-9)
    assert "A has 2 full-depth steps and B 3: compare them with --per-step" in " ".join(capsys.readouterr().out.split())


def test_the_page_says_which_steps_its_diff_covers(sampled_runs, tmp_path: Path) -> None:
    from browser import Browser, chromium_path

    if chromium_path() is None:
        pytest.skip("/usr/bin/chromium is missing: run scripts/install-test-deps.sh")
    page = tmp_path / "diff.html"
    rc, _ = run_diff(*sampled_runs, tmp_path, "--html", str(page), "--quiet")
    assert rc == 0
    with Browser(width=1400, height=1000) as b:
        b.goto(page.resolve().as_uri())
        assert b.eval("document.body.getAttribute('data-ready')") == "1" and b.js_errors() == []
        totals = b.eval("Object.fromEntries([...document.querySelectorAll('#diff-totals tr[data-total]')]"
                        ".map(tr => [tr.dataset.total, [...tr.querySelectorAll('td')].map(td => td.textContent)]))")
        note = b.eval("document.getElementById('diff-sampled').textContent")
    assert totals["steps"] == ["steps", "12", "12", "0"] and totals["at full depth"] == ["at full depth", "2", "3", "+1"]
    assert "full-depth steps alone (A 2 of 12, B 3 of 12)" in note


def test_a_narrow_console_gets_the_totals_whole(spans_dir: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    # rich fits a table to the console (a pipe is 80 columns, COLUMNS when set) by cutting cells; the totals
    # are numbers, so the table runs long instead.
    from plasmient_trace.report.summary import fmt_seconds, fmt_usd

    src = spans_dir / "vit.jsonl"
    _, result = run_diff(src, src, tmp_path)
    capsys.readouterr()
    monkeypatch.setenv("COLUMNS", "40")
    assert main(["diff", str(src), str(src)]) == 0
    text = capsys.readouterr().out
    t = result["totals"]
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:5]]
            for line in text.splitlines() if line.startswith("│")}
    assert rows["wasted $"] == [fmt_usd(t["wasted_usd"]["a"]), fmt_usd(t["wasted_usd"]["b"]), "0"]
    assert rows["device time (busy)"][:2] == [fmt_seconds(t["busy_s"]["a"])] * 2
