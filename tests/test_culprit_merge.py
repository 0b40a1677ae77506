"""Culprit rows summed over ranks (node and fleet spans) and over steps (the report) are exact: each is the
waste of its kernel spans, recomputed here from the span rows of a real ingest, not read from a culprit list.

Each rank's step used to cut its rows to the ten its step span shows before they were summed, so a row outside
one rank's top ten lost that rank's time: on a100_multirank step 552 a RadixSort row read 5.605 ms on the
fleet span where its kernels wasted 6.629 ms, and the report's ``--top 20`` printed 12 rows. On mi300x the
report's idle row summed only the steps whose top ten held it (2.41 of 2.60 ms).

The oracle groups every kernel span by its name, its nearest op span's name and its nearest module span's name
with layer numbers as ``*`` (outside every module, the optimizer or DataLoader scope at the root of its ops),
sums ``plasmient.wasted_s.self``, and adds a ``[device idle]`` row of the step spans' ``plasmient.idle_s``.
"""

from __future__ import annotations

import io
import json
import math
import re
from collections import defaultdict

import pyarrow.compute as pc
import pytest
from conftest import trace_path

from plasmient_trace.pipeline import IngestOptions, ingest_paths
from plasmient_trace.report.frame import SpanFrame
from plasmient_trace.report.summary import culprits_from_frame, render_summary
from plasmient_trace.stitch import fleet
from plasmient_trace.stitch.culprits import cut_culprits, merge_culprits
from plasmient_trace.stitch.inputs import NODE_CULPRIT_ROWS

MULTI = ("a100_multirank/rank-0.json.gz", "a100_multirank/rank-1.json.gz")
MI300X = ("mi300x/resnet_act_checkpoint_rank0_of8.json.gz",)
SCOPES = ("Optimizer.", "enumerate(DataLoader)")
LAYER = re.compile(r"(?<=[_.])\d+(?=[.\s]|$)")


@pytest.fixture(scope="module")
def multi():
    return ingest_paths([trace_path(n) for n in MULTI], IngestOptions(job_id="merge", gpu_model="NVIDIA A100-SXM4-80GB"))


@pytest.fixture(scope="module")
def mi300x():
    return ingest_paths([trace_path(n) for n in MI300X], IngestOptions(job_id="merge"))


def _oracle(result) -> dict[str, dict[tuple, dict]]:
    """Per trace id, the culprit rows recomputed from the spans: key -> {wasted_s, calls, by_rank}."""
    assert result.stats["kernels_folded"] == 0, "a folded kernel has no span for the oracle to read"
    t = result.batch.table
    cols = {k: t.column(k).to_pylist() for k in ("trace_id", "span_id", "parent_span_id", "name", "plasmient.level",
                                                 "plasmient.wasted_s.self", "plasmient.idle_s", "resource_index")}
    rank_of = [r.get("plasmient.rank") for r in result.batch.resources]
    spans = {(tr, sid): i for i, (tr, sid) in enumerate(zip(cols["trace_id"], cols["span_id"]))}
    out: dict[str, dict[tuple, dict]] = defaultdict(lambda: defaultdict(lambda: {
        "wasted_s": 0.0, "by_rank": defaultdict(float), "calls_by_rank": defaultdict(int)}))
    for i, level in enumerate(cols["plasmient.level"]):
        tr, rank = cols["trace_id"][i], rank_of[cols["resource_index"][i]]
        if level == "step" and cols["plasmient.idle_s"][i]:
            row = out[tr][("[device idle]", None, None)]
            row["wasted_s"] += cols["plasmient.idle_s"][i]
            row["by_rank"][rank] += cols["plasmient.idle_s"][i]
        if level != "kernel":
            continue
        ops, module, p = [], None, cols["parent_span_id"][i]
        while (tr, p) in spans:
            j = spans[(tr, p)]
            if cols["plasmient.level"][j] == "op":
                ops.append(cols["name"][j])
            elif cols["plasmient.level"][j] == "module" and module is None:
                module = LAYER.sub("*", cols["name"][j])
            p = cols["parent_span_id"][j]
        if module is None and len(ops) > 1 and ops[-1].startswith(SCOPES):
            module = ops[-1]
        row = out[tr][(cols["name"][i], ops[0] if ops else None, module)]
        wasted = cols["plasmient.wasted_s.self"][i]
        assert wasted is not None
        row["wasted_s"] += wasted
        row["by_rank"][rank] += wasted
        row["calls_by_rank"][rank] += 1
    return {tr: {k: v for k, v in rows.items() if v["wasted_s"] > 0} for tr, rows in out.items()}


def _summed(oracle: dict[str, dict[tuple, dict]], width: int = 3) -> dict[tuple, float]:
    """The rows of every trace summed by the first ``width`` parts of their keys."""
    total: dict[tuple, float] = defaultdict(float)
    for rows in oracle.values():
        for key, row in rows.items():
            total[key[:width]] += row["wasted_s"]
    return total


def _key(r: dict) -> tuple:
    return (r["kernel"], r["op"], r["module"])


def _top_level_rows(result, level: str) -> list[dict]:
    t = result.batch.table
    return t.filter(pc.equal(t.column("plasmient.level"), level)).to_pylist()


def test_fleet_rows_are_every_ranks_kernels_summed(multi):
    oracle = _oracle(multi)
    fleets = _top_level_rows(multi, "fleet")
    assert len(fleets) == 2 and len(multi.batch.resources) >= 4  # two steps, two ranks
    # the audit's row first: rank 0 had it outside its top ten on step 552 (it read rank 1's 5.605 ms alone)
    step = next(s for s in fleets if s["plasmient.step"] == 552)
    radix = max((k for k in oracle[step["trace_id"]] if "DeviceRadixSortOnesweep" in k[0]),
                key=lambda k: oracle[step["trace_id"]][k]["wasted_s"])
    by_rank = oracle[step["trace_id"]][radix]["by_rank"]
    got = next(r for r in json.loads(step["plasmient.culprits"]) if _key(r) == radix)
    assert len(by_rank) == 2 and got["wasted_s"] == pytest.approx(by_rank[0] + by_rank[1], rel=1e-9)
    for span in fleets + _top_level_rows(multi, "node"):
        rows = json.loads(span["plasmient.culprits"])
        want = oracle[span["trace_id"]]
        # the NODE_CULPRIT_ROWS most wasteful rows, exact (not the display's ten), and what the rest may hold
        assert len(rows) == min(NODE_CULPRIT_ROWS, len(want)) and len(want) > NODE_CULPRIT_ROWS
        assert {_key(r): r["wasted_s"] for r in rows} == pytest.approx({k: want[k]["wasted_s"] for k in map(_key, rows)}, rel=1e-9)
        rest = [v["wasted_s"] for k, v in want.items() if k not in set(map(_key, rows))]
        assert min(r["wasted_s"] for r in rows) >= max(rest) * (1 - 1e-9)
        for r in rows:
            row = want[_key(r)]
            if r["kernel"] != "[device idle]":  # the calls of the ranks it wasted time on (elsewhere it is no culprit)
                assert r["calls"] == sum(n for rk, n in row["calls_by_rank"].items() if row["by_rank"][rk] > 0), r
            assert r["rank"] == max(sorted(row["by_rank"]), key=row["by_rank"].__getitem__), r
            assert "lower_bound" not in r  # no rank left a row out
        assert [r["wasted_s"] for r in rows] == sorted((r["wasted_s"] for r in rows), reverse=True)
        assert span["plasmient.culprits.left_out_s"] == pytest.approx(max(rest), rel=1e-9)


def test_step_spans_show_their_ten_worst_rows_and_say_what_they_leave_out(multi):
    oracle = _oracle(multi)
    for span in _top_level_rows(multi, "step"):
        rank = multi.batch.resources[span["resource_index"]]["plasmient.rank"]
        mine = sorted(((k, v["by_rank"][rank]) for k, v in oracle[span["trace_id"]].items() if v["by_rank"].get(rank, 0) > 0),
                      key=lambda kv: -kv[1])
        rows = json.loads(span["plasmient.culprits"])
        assert len(mine) > 10 and len(rows) == 10
        assert [r["wasted_s"] for r in rows] == pytest.approx([w for _, w in mine[:10]], rel=1e-9)
        assert span["plasmient.culprits.left_out_s"] == pytest.approx(mine[10][1], rel=1e-9)


@pytest.mark.parametrize("top", [10, 20])
def test_the_report_sums_steps_and_ranks_before_it_cuts(multi, top):
    want = sorted(_summed(_oracle(multi)).items(), key=lambda kv: -kv[1])[:top]
    got = culprits_from_frame(SpanFrame(multi.batch), top)
    assert len(got) == top
    assert [(_key(c), c["wasted_s"]) for c in got] == [(k, pytest.approx(w, rel=1e-9)) for k, w in want]
    assert not any(c["lower_bound"] for c in got)
    # the terminal prints as many rows as asked for
    from rich.console import Console

    console = Console(file=io.StringIO(), width=200, record=True)
    render_summary(multi.batch, console=console, top=top)
    text = console.export_text()
    numbered = re.findall(r"^│ +(\d+) │ (?!.*GPU-h)", text, re.M)
    assert numbered == [str(n) for n in range(1, top + 1)]
    assert "≥" not in text


def test_the_idle_row_counts_every_step(mi300x):
    """mi300x's idle row is in the top ten of one of its three steps only. Its rows are compared by kernel and
    op: a recomputed (activation-checkpointed) kernel's row names the module its op ran in ("ReLU_* [backward]"),
    where its span hangs under the recompute's module span ("BatchNorm2d_* [recompute]")."""
    oracle = _oracle(mi300x)
    idle = sum(rows[("[device idle]", None, None)]["wasted_s"] for rows in oracle.values())
    steps = _top_level_rows(mi300x, "step")
    assert len(steps) == 3 and idle == pytest.approx(sum(s["plasmient.idle_s"] for s in steps))
    assert sum("[device idle]" in s["plasmient.culprits"] for s in steps) == 1  # shown on one step span of three
    got: dict[tuple, float] = defaultdict(float)
    every = culprits_from_frame(SpanFrame(mi300x.batch), 10**6)
    for c in every:
        got[_key(c)[:2]] += c["wasted_s"]
    assert got[("[device idle]", None)] == pytest.approx(idle, rel=1e-9)
    # summed over steps from the fleet spans' rows (each its NODE_CULPRIT_ROWS most wasteful): never more than
    # the kernels' waste, and the most wasteful rows whole
    want = _summed(oracle, 2)
    assert all(value <= want[key] * (1 + 1e-9) for key, value in got.items())
    whole = _summed(oracle, 3)
    top = culprits_from_frame(SpanFrame(mi300x.batch), 5)
    assert sum(_key(c) in whole for c in top) >= 4  # (a recomputed kernel's row names its op's module instead)
    for c in top:  # whole, or marked as a lower bound where a step's cut may have shortened it
        truth = whole.get(_key(c), c["wasted_s"])
        assert c["wasted_s"] <= truth * (1 + 1e-9) if c.get("lower_bound") else c["wasted_s"] == pytest.approx(truth, rel=1e-9), c
    assert sum(not c.get("lower_bound") for c in top) >= 3


def test_a_cut_list_marks_the_rows_it_may_have_shorted():
    a = [{"kernel": "k1", "op": "o", "module": None, "calls": 2, "layers": 1, "wasted_s": 5.0},
         {"kernel": "k2", "op": "o", "module": None, "calls": 1, "layers": 1, "wasted_s": 3.0}]
    b = [{"kernel": "k1", "op": "o", "module": None, "calls": 1, "layers": 1, "wasted_s": 4.0}]  # cut: rows of <= 2.0 left out
    rows, left = merge_culprits([(0, a, 0.0), (1, b, 2.0)], None)
    assert [(r["kernel"], r["wasted_s"], r.get("lower_bound", False), r["rank"]) for r in rows] == [
        ("k1", 9.0, False, 0), ("k2", 3.0, True, 0)]  # k2 may hold up to 2.0 more on rank 1
    assert left == 2.0  # a row neither names: up to 2.0 (rank 1's)
    # cut after the sums: k2's upper bound (5.0) is what the cut list may now be missing
    top, left = merge_culprits([(0, a, 0.0), (1, b, 2.0)], 1)
    assert [r["kernel"] for r in top] == ["k1"] and left == 5.0
    # unknown left-outs stay unknown; a complete list stays exact
    rows, left = merge_culprits([(0, a, 0.0), (1, b, float("nan"))], None)
    assert math.isnan(left) and rows[1]["lower_bound"]
    rows, left = merge_culprits([(0, a, 0.0)], None)
    assert left == 0.0 and not any("lower_bound" in r for r in rows)
    assert cut_culprits(a, 0.0, 1) == (a[:1], 3.0)
    # a summary that does not say how much it left out is unknown on the wire, not 0
    doc = {k: v for k, v in fleet.RankSummary(
        job_id="j", step=1, rank=0, host="h", start_ns=0, end_ns=1, window_start_ns=0, window_end_ns=1, gpus=1,
        flops=0.0, ideal_s=0.0, busy_s=0.0, union_s=0.0, known_s=0.0, bytes=0.0, kernels=0, kernel_s=0.0, comm_s=0.0,
        copy_s=0.0, wasted_s=0.0, charged_s=0.0, idle_s=0.0, price_per_hour=1.0, bandwidth=1.0).to_json().items()}
    assert doc["culprits_left_out_s"] is None
    assert math.isnan(fleet.RankSummary.from_json(doc).culprits_left_out_s)


def test_culprit_rows_are_strict_json_with_unknowns_as_null():
    """plasmient.culprits is read by collectors and UIs with strict JSON parsers: an unknown (None, or a NaN
    that reached a row) is null, never the bare NaN that Python's json module writes; numpy numbers are
    plain numbers."""
    import numpy as np
    import orjson

    from plasmient_trace.stitch.culprits import culprit_columns

    rows = [{"kernel": "k", "op": "aten::mm", "module": "l.*", "rank": np.int64(3), "wasted_s": float("nan"),
             "bound": "memory", "suggestion": None, "calls": 2, "layers": np.int64(1), "lower_bound": False},
            {"kernel": "ü", "op": None, "module": None, "rank": 3, "wasted_s": np.float64(0.25), "bound": None,
             "suggestion": None, "calls": 1, "layers": 0, "lower_bound": True}]
    cols = culprit_columns(3, {1: rows}, {1: 0.0})
    texts = cols["plasmient.culprits"].to_pylist()
    assert texts[0] is None and texts[2] is None
    parsed = orjson.loads(texts[1])  # orjson refuses NaN
    assert parsed[0]["wasted_s"] is None and parsed[0]["rank"] == 3 and parsed[0]["layers"] == 1
    assert parsed[1] == {**rows[1], "rank": 3, "wasted_s": 0.25}
