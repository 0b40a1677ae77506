"""Fleet and node spans built from per-rank summaries equal the ones the stitcher builds when it sees
every rank: the contract that lets live ranks each stitch only themselves."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from plasmient_trace import pipeline
from plasmient_trace.stitch import fleet, ids
from plasmient_trace.stitch.inputs import CULPRIT_ROWS
from plasmient_trace.stitch.tree import StitchOptions

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
R0, R1 = TRACES / "a100_multirank" / "rank-0.json.gz", TRACES / "a100_multirank" / "rank-1.json.gz"
OPTIONS = pipeline.IngestOptions(job_id="x", gpu_model="NVIDIA A100-SXM4-80GB")
# Equal within float rounding: the joint stitch sums kernels in a different order.
FLOAT_ATTRS = ("plasmient.flops", "plasmient.busy_s", "plasmient.mfu", "plasmient.util.resident", "plasmient.cost.usd",
               "plasmient.cost.wasted_usd", "plasmient.wasted_s", "plasmient.ideal_s", "plasmient.bytes",
               "plasmient.culprit.wasted_s", "plasmient.device.window_s", "plasmient.idle_s")
EXACT_ATTRS = ("trace_id", "parent_span_id", "resource_index", "name", "plasmient.level", "plasmient.step",
               "plasmient.gpus", "plasmient.kernels", "plasmient.bound", "plasmient.device.type",
               "plasmient.culprit.rank", "plasmient.culprit.kernel", "plasmient.culprit.op", "plasmient.device.start_ns")


@pytest.fixture(scope="module")
def ingested():
    alone = [pipeline.ingest_paths([p], OPTIONS) for p in (R0, R1)]
    joint = pipeline.ingest_paths([R0, R1], OPTIONS)
    return alone, joint


def _top_rows(table: pa.Table) -> dict[int, dict]:
    top = table.filter(pc.is_in(table.column("plasmient.level"), value_set=pa.array(["fleet", "node"])))
    return {r["span_id"]: r for r in top.to_pylist()}


def _summaries(results) -> list:
    """The stitcher's rank summaries, copied: the tests below change them."""
    return [dataclasses.replace(s) for r in results for s in r.summaries]


def test_summaries_are_one_per_rank_span(ingested):
    alone, _ = ingested
    summaries = _summaries(alone[:1])
    rank_rows = alone[0].batch.table.filter(pc.equal(alone[0].batch.table.column("plasmient.level"), "rank"))
    assert sorted(s.step for s in summaries) == sorted(rank_rows.column("plasmient.step").to_pylist())
    first = summaries[0]
    assert first.rank == 0 and first.host == "node-0" and first.gpus == 1
    assert first.price_per_hour > 0 and first.kernels > 0
    # these steps are all-to-all heavy: the rank span carries the collective seconds
    assert 0 < first.comm_s < first.kernel_s
    # a summary is its rank span's totals
    by_step = {r["plasmient.step"]: r for r in rank_rows.to_pylist()}
    for s in summaries:
        row = by_step[s.step]
        assert s.flops == pytest.approx(row["plasmient.flops"], rel=1e-9)
        assert s.busy_s == pytest.approx(row["plasmient.busy_s"], rel=1e-9)
        assert s.wasted_s == pytest.approx(row["plasmient.wasted_s"], rel=1e-9)
        assert s.kernels == row["plasmient.kernels"] and s.window_start_ns == row["plasmient.device.start_ns"]
        # the rank span shows the first CULPRIT_ROWS; the summary hands on every row (nothing left out here)
        assert s.culprits[:CULPRIT_ROWS] == json.loads(row["plasmient.culprits"])
        assert len(s.culprits) > CULPRIT_ROWS and s.culprits_left_out_s == 0.0
        assert row["plasmient.culprits.left_out_s"] == pytest.approx(s.culprits[CULPRIT_ROWS]["wasted_s"])
    # the wire form survives JSON (NaN travels as null; compared on the wire, since NaN != NaN)
    wire = json.loads(json.dumps(first.to_json()))
    assert fleet.RankSummary.from_json(wire).to_json() == first.to_json()
    assert math.isnan(fleet.RankSummary.from_json(wire).comm_bytes)  # this trace has no NCCL message sizes


def test_top_spans_from_summaries_equal_the_joint_stitch(ingested):
    alone, joint = ingested
    summaries = _summaries(alone)
    top = fleet.top_spans(summaries, StitchOptions(job_id="x"))
    mine, ref = _top_rows(top.table), _top_rows(joint.batch.table)
    # both files are one node: per step one fleet and one node span, the same ids as the joint stitch
    assert set(mine) == set(ref) and len(mine) == 2 * len({s.step for s in summaries})
    assert {ids.fleet_span_id("x", s.step) for s in summaries} <= set(mine)
    # The joint stitch aligns the ranks' clocks first; these two files need no shift (offsets 0),
    # so the windows agree exactly as well.
    assert set(joint.stats["clock_offsets_ns"].values()) == {0}
    for span_id, row in mine.items():
        other = ref[span_id]
        for name in EXACT_ATTRS + ("start_ns", "end_ns"):
            assert row[name] == other[name], (row["name"], name)
        for name in FLOAT_ATTRS:
            assert row[name] == pytest.approx(other[name], rel=1e-9), (row["name"], name)
        assert row["plasmient.gpus"] == 2
    assert top.resources == joint.batch.resources[:len(top.resources)]


def test_node_spans_split_by_host_and_fleet_can_be_left_out(ingested):
    alone, _ = ingested
    summaries = _summaries(alone)
    for s in summaries:
        s.host = f"host-{s.rank}"
    step = summaries[0].step
    top = fleet.top_spans([s for s in summaries if s.step == step], StitchOptions(job_id="x"))
    rows = top.table.to_pylist()
    assert [r["plasmient.level"] for r in rows] == ["fleet", "node", "node"]
    fleet_row, nodes = rows[0], rows[1:]
    assert all(n["parent_span_id"] == fleet_row["span_id"] for n in nodes)
    assert {n["span_id"] for n in nodes} == {ids.node_span_id("x", step, f"host-{r}") for r in (0, 1)}
    assert [n["plasmient.gpus"] for n in nodes] == [1, 1] and fleet_row["plasmient.gpus"] == 2
    assert fleet_row["plasmient.flops"] == pytest.approx(sum(n["plasmient.flops"] for n in nodes))
    assert fleet_row["plasmient.cost.usd"] == pytest.approx(sum(n["plasmient.cost.usd"] for n in nodes), rel=1e-3)
    assert top.resources[top.table.column("resource_index")[2].as_py()]["host.name"] == "host-1"

    only = fleet.top_spans(summaries, StitchOptions(job_id="x"), local_hosts={"host-1"}, include_fleet=False)
    assert set(only.table.column("plasmient.level").to_pylist()) == {"node"}
    assert set(only.table.column("name").to_pylist()) == {"node host-1"}


def test_unmeasured_rank_leaves_fleet_flops_absent(ingested):
    alone, _ = ingested
    summaries = [s for s in _summaries(alone) if s.step == 551]
    summaries[1].flops = math.nan  # a step-level (shallow) step on rank 1
    summaries[1].ideal_s = math.nan
    row = fleet.top_spans(summaries, StitchOptions(job_id="x"), include_fleet=True).table.to_pylist()[0]
    assert row["plasmient.flops"] is None and row["plasmient.mfu"] is None and row["plasmient.bound"] is None
    assert row["plasmient.busy_s"] > 0 and row["plasmient.culprit.rank"] is None
