"""`plasmient diff` rows checked against the span file they come from, read here without the project's reader:
which rows a module table has, and how a change is printed."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import pytest

from conftest import trace_path
from plasmient_trace.cli import main

MI300X = "mi300x/resnet_act_checkpoint_rank0_of8.json.gz"  # training with activation checkpointing


def _spans(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        for rs in json.loads(line)["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                for s in ss["spans"]:
                    out.append({"name": s["name"], "id": (s["traceId"], s["spanId"]),
                                "parent": (s["traceId"], s.get("parentSpanId", "")),
                                "attrs": {a["key"]: next(iter(a["value"].values())) for a in s["attributes"]}})
    return out


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
