"""`plasmient diff` rows checked against the span file they come from, read here without the project's reader:
which rows a module table has, and how a change is printed."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import pytest

from conftest import trace_path
from test_diff import edit_spans
from test_diff import raw_spans as _spans
from plasmient_trace.cli import main

MI300X = "mi300x/resnet_act_checkpoint_rank0_of8.json.gz"  # training with activation checkpointing


def _phase_label(module: dict) -> str:
    """A module span's row: its path's pattern (layer numbers as *) and which pass ran it: the backward pass
    (plasmient.module.phase) or the forward recomputed in it (activation checkpointing: the span's name says)."""
    path = re.sub(r"(?<=[_.])\d+(?=\.|$)", "*", module["attrs"]["plasmient.module.path"])
    if module["attrs"].get("plasmient.module.phase") == "backward":
        return path + " [backward]"
    return path + (" [recompute]" if module["name"].endswith(" [recompute]") else "")


def test_a_modules_forward_backward_and_recompute_are_separate_rows(tmp_path: Path) -> None:
    """The module table keyed a row by the module's path, so a layer's forward, its backward and its recompute
    (three spans, three passes) were summed into one row: a slower backward read as a slower layer, and the
    mi300x training trace's 693 module spans gave 21 rows, none of them a backward. Each pass is now its own
    row, named as the culprit rows name it. Oracle: each unit of exclusive busy time in the span file (a
    kernel's busy_s.self, and what an op or module span's busy_s.self holds beyond its kernel children: the
    kernels the span budget folded), summed per nearest module's pattern and pass."""
    spans_file = tmp_path / "mi300x.jsonl"
    assert main(["ingest", str(trace_path(MI300X)), "--out", str(spans_file), "--quiet"]) == 0
    spans = _spans(spans_file)
    by_id = {s["id"]: s for s in spans}
    kernel_self: dict[tuple, float] = defaultdict(float)
    for s in spans:
        if s["attrs"]["plasmient.level"] == "kernel":
            kernel_self[s["parent"]] += s["attrs"].get("plasmient.busy_s.self") or 0.0
    expected: dict[str, float] = defaultdict(float)
    for s in spans:
        level = s["attrs"]["plasmient.level"]
        if level not in ("kernel", "op", "module"):
            continue
        own = (s["attrs"].get("plasmient.busy_s.self") or 0.0) - (0.0 if level == "kernel" else kernel_self[s["id"]])
        cur = s
        while cur is not None and cur["attrs"]["plasmient.level"] != "module":
            cur = by_id.get(cur["parent"])
        expected[_phase_label(cur) if cur is not None else "(no module)"] += own
    passes = {label.rsplit(" [", 1)[-1] if " [" in label else "forward" for label in expected}
    assert passes == {"forward", "backward]", "recompute]"}

    out = tmp_path / "diff.json"
    assert main(["diff", str(spans_file), str(spans_file), "--quiet", "--json", str(out)]) == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())["module"]}
    assert len(rows) == len(json.loads(out.read_text())["module"])  # one row per name
    for label, busy in expected.items():
        if abs(busy) > 1e-12:
            assert label in rows, label
            assert rows[label]["busy_s_a"] == pytest.approx(busy, rel=1e-9, abs=1e-12), label
    named = {n for n in rows if not n.startswith(("[", "("))}
    assert named == {label for label, busy in expected.items() if abs(busy) > 1e-12 and label != "(no module)"}


V100 = "v100/resnet50_training.json.gz"
ZERO_LOOKALIKE = re.compile(r"[+-]0\.0+ (µs|ms|s|pp)\b|[+-]0\.0+%|\$\d\.\d+e-1\d|\$\d\.\d+e-[2-9]\d")


def _diff_text(a: Path, b: Path, tmp: Path, capsys, *flags: str) -> tuple[int, str, dict]:
    capsys.readouterr()
    rc = main(["diff", str(a), str(b), "--json", str(tmp / "d.json"), "--top", "100", *flags])
    said = capsys.readouterr()  # the tables on stdout, the gate's line on stderr
    return rc, said.out + said.err, json.loads((tmp / "d.json").read_text())


def _totals_rows(text: str) -> dict[str, list[str]]:
    return {cells[0]: cells[1:] for line in text.splitlines() if line.startswith("│")
            for cells in [[c.strip() for c in line.strip().strip("│").split("│")]] if len(cells) == 4}


def test_one_run_at_two_span_budgets_differs_by_exactly_zero(tmp_path: Path, capsys, monkeypatch) -> None:
    """The same trace ingested at the default budget and at --max-spans 300 is the same run: its units of device
    time fall in other rows (folded kernels become [kernels not exported]), but its totals, and a row both
    files hold whole such as [device idle], are the same numbers summed in another order. Their float round-off
    (6.7e-16 s of 0.60 s) printed as "+0.0 µs", "+0.0 pp", "-0.0 µs" and "-$5.96e-19", and the gate line as
    "+0.0% relative". Oracle: each file's fleet busy_s and its steps' idle_s, summed here, agree to round-off."""
    monkeypatch.setenv("COLUMNS", "250")
    full, small = tmp_path / "full.jsonl", tmp_path / "small.jsonl"
    assert main(["ingest", str(trace_path(V100)), "--out", str(full), "--quiet"]) == 0
    assert main(["ingest", str(trace_path(V100)), "--out", str(small), "--quiet", "--max-spans", "300"]) == 0
    sums = {}
    for f in (full, small):
        spans = _spans(f)
        sums[f] = {"busy_s": sum(float(s["attrs"]["plasmient.busy_s"]) for s in spans
                                 if s["attrs"]["plasmient.level"] == "fleet"),
                   "idle": sum(float(s["attrs"]["plasmient.idle_s"]) for s in spans
                               if s["attrs"]["plasmient.level"] == "step")}
    for q in ("busy_s", "idle"):
        assert sums[full][q] == pytest.approx(sums[small][q], rel=1e-13)
    rc, text, result = _diff_text(full, small, tmp_path, capsys, "--fail-if-mfu-drops", "5%")
    assert rc == 0
    t = result["totals"]
    for q in ("busy_s", "wasted_s", "flops", "ideal_s", "covered_s", "wasted_usd", "mfu"):
        assert t[q]["delta"] == 0, (q, t[q])
    for dim in ("module", "op", "kernel"):
        (idle,) = [r for r in result[dim] if r["name"] == "[device idle]"]
        assert idle["wasted_s_a"] == pytest.approx(sums[full]["idle"], rel=1e-12)
        assert all(idle[f"{q}_delta"] in (0, None) for q in ("busy_s", "wasted_s", "wasted_usd", "flops")), idle
    printed = _totals_rows(text)
    for row in ("MFU (step-weighted)", "device time (busy)", "FLOPs", "busy time with known FLOPs", "wasted",
                "wasted $"):
        assert printed[row][2] == "0", (row, printed[row])
    assert "MFU 28.2% -> 28.2% (0% relative" in " ".join(text.split())
    assert not ZERO_LOOKALIKE.search(text), ZERO_LOOKALIKE.search(text)


def test_a_small_real_change_is_printed_with_its_digits_not_as_zero(tmp_path: Path, capsys, monkeypatch) -> None:
    """B is A with one kernel 30 ns longer and every step's MFU 1e-7 higher, edited into the span file: the
    changes print as +0.030 µs and +0.000010 pp (they printed +0.0 µs and +0.0 pp, which read as no change),
    and the gate's relative change (5e-5 of bert's 0.2% MFU) with two significant digits, not as +0.0%."""
    monkeypatch.setenv("COLUMNS", "250")
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert main(["ingest", str(trace_path("h100/bert_small_inference.json.gz")), "--out", str(a), "--quiet"]) == 0
    spans = _spans(a)
    by_id = {s["id"]: s for s in spans}
    kernel = max((s for s in spans if s["attrs"]["plasmient.level"] == "kernel"),
                 key=lambda s: float(s["attrs"]["plasmient.busy_s"]))
    chain, cur = {kernel["id"]}, by_id.get(kernel["parent"])
    while cur is not None:
        chain.add(cur["id"])
        cur = by_id.get(cur["parent"])
    parent = kernel["parent"]
    extra = 30e-9

    def lengthen(s: dict) -> None:
        sid = (s["traceId"], s["spanId"])
        for attr in s["attributes"]:
            v = attr["value"]
            if attr["key"] == "plasmient.busy_s" and sid in chain:
                v["doubleValue"] += extra  # inclusive: the kernel and every span above it
            elif attr["key"] == "plasmient.busy_s.self" and sid in (kernel["id"], parent):
                v["doubleValue"] += extra  # the kernel's own, and its op's own kernels
            elif attr["key"] == "plasmient.mfu" and any(
                    x["key"] == "plasmient.level" and x["value"]["stringValue"] == "step" for x in s["attributes"]):
                v["doubleValue"] += 1e-7

    edit_spans(a, b, lengthen)
    rc, text, result = _diff_text(a, b, tmp_path, capsys, "--fail-if-mfu-drops", "5%")
    assert rc == 0
    assert result["totals"]["busy_s"]["delta"] == pytest.approx(extra, rel=1e-6)
    assert result["totals"]["mfu"]["delta"] == pytest.approx(1e-7, rel=1e-6)
    printed = _totals_rows(text)
    assert printed["device time (busy)"][2] == "+0.030 µs"
    assert printed["MFU (step-weighted)"][2] == "+0.000010 pp"
    (row,) = [r for r in result["kernel"] if r["name"] == kernel["name"]]
    assert row["busy_s_delta"] == pytest.approx(extra, rel=1e-6)
    relative = 1e-7 / result["totals"]["mfu"]["a"] * 100
    said = re.search(r"\(([+-][\d.]+)% relative", text).group(1)
    assert float(said) == pytest.approx(relative, rel=0.02) and len(said.lstrip("+-0.")) == 2, said
    assert not ZERO_LOOKALIKE.search(text), ZERO_LOOKALIKE.search(text)
