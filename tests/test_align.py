"""Clock alignment of ranks on collective kernels (plasmient_trace.stitch.align)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.compute as pc
import pytest
from conftest import trace_path

from plasmient_trace.records import RecordSet, table_from_columns
from plasmient_trace.sources.kineto import read_kineto
from plasmient_trace.stitch.align import (
    DEFAULT_TOLERANCE_NS,
    align_ranks,
    apply_offsets,
    collective_ends,
    collective_skew,
    estimate_alignment,
)


@pytest.fixture(scope="module")
def ranks() -> list[RecordSet]:
    return [read_kineto(trace_path(f"a100_multirank/rank-{i}.json.gz")) for i in (0, 1)]


def _synthetic(ends_by_name: dict[str, list[int]], host: str | None = None) -> RecordSet:
    """A rank with only collective kernels (1 µs long) ending at the given times."""
    names, ends = [], []
    for name, values in ends_by_name.items():
        names += [name] * len(values)
        ends += values
    ends_a = np.asarray(ends, np.int64)
    kernels = table_from_columns("kernels", {
        "device": np.zeros(len(ends_a), np.int32), "start_ns": ends_a - 1_000, "end_ns": ends_a,
        "name": names, "kind": ["collective"] * len(ends_a),
    })
    return RecordSet(kernels=kernels, resource={"host.name": host} if host else {})


def test_real_ranks_on_one_host_need_no_shift(ranks: list[RecordSet]) -> None:
    # The two ranks ran on one host (devices 0 and 1, neighbouring pids): one wall clock, so the
    # send/recv kernels they share already end together and the offset found is ~0.
    report = estimate_alignment(ranks)
    assert report.method[1] == "collectives"
    assert report.matches[1] >= 2
    assert abs(report.offsets[1]) <= DEFAULT_TOLERANCE_NS
    before, after = collective_skew(ranks), collective_skew(ranks, report.offsets)
    print(f"real a100_multirank: offset {report.offsets[1]} ns, skew before {before:.0f} ns, after {after:.0f} ns")
    assert after <= before


@pytest.mark.parametrize("shift_ns", [37_500_000, -2_345_000, 1_500_000_000])
def test_a_shifted_host_clock_is_recovered(ranks: list[RecordSet], shift_ns: int) -> None:
    # Simulate rank 1 on a host whose clock is off by shift_ns: the alignment must undo it.
    baseline = align_ranks(ranks)[1]
    shifted = apply_offsets(ranks, {1: shift_ns})
    offsets = align_ranks(shifted)
    assert offsets[0] == 0
    assert abs(offsets[1] - (baseline - shift_ns)) <= 1_000  # Kineto's 1 µs resolution
    before, after = collective_skew(shifted), collective_skew(shifted, offsets)
    print(f"shift {shift_ns} ns: found {offsets[1]} ns, skew before {before:.0f} ns, after {after:.0f} ns")
    assert after < before


def test_apply_offsets_shifts_every_timestamp_and_leaves_the_input_alone(ranks: list[RecordSet]) -> None:
    shifted = apply_offsets(ranks, {0: 0, 1: 12_345})
    assert shifted[0] is ranks[0]  # zero offset: no copy
    for name in ("kernels", "launches", "ops", "modules", "steps", "samples"):
        old, new = getattr(ranks[1], name), getattr(shifted[1], name)
        assert new.schema.equals(old.schema)
        cols = [f.name for f in old.schema if f.name.endswith("_ns")]
        assert cols, name
        for col in cols:
            a, b = old.column(col).to_numpy(), new.column(col).to_numpy()
            assert np.array_equal(b - a, np.full(len(a), 12_345)), (name, col)
    # Untimed columns and metadata are carried over unchanged.
    assert shifted[1].kernels.column("name").equals(ranks[1].kernels.column("name"))
    assert shifted[1].resource == ranks[1].resource and shifted[1].resource is not ranks[1].resource


def test_collective_ends_are_on_the_launch_clock() -> None:
    # A kernel recorded 5 µs before its launch (GPU clock behind): joins.py shifts it forward, so
    # the alignment must see the shifted end too.
    kernels = table_from_columns("kernels", {
        "device": [0, 0], "start_ns": [1_000, 50_000], "end_ns": [2_000, 60_000],
        "name": ["compute", "ncclAllReduce"], "kind": ["kernel", "collective"], "correlation_id": [7, 8],
    })
    launches = table_from_columns("launches", {
        "pid": [1, 1], "tid": [1, 1], "start_ns": [6_000, 40_000], "end_ns": [6_500, 40_500],
        "name": ["cudaLaunchKernel"] * 2, "correlation_id": [7, 8],
    })
    ends = collective_ends(RecordSet(kernels=kernels, launches=launches))
    assert list(ends.names) == ["ncclAllReduce"]
    assert ends.names["ncclAllReduce"].tolist() == [65_000]


def test_captures_starting_at_different_collectives_still_align() -> None:
    # Periodic all-reduce every 10 ms; rank 1 started capturing two collectives late and its clock
    # is 3.2 ms behind. Matching "the k-th collective" would be off by two periods; voting is not.
    period, shift = 10_000_000, 3_200_000
    truth = [1_000_000_000 + i * period for i in range(20)]
    jitter = [0, 2_000, -1_000, 3_000] * 5
    r0 = _synthetic({"ncclAllReduce": truth})
    r1 = _synthetic({"ncclAllReduce": [t + j - shift for t, j in zip(truth[2:], jitter)]})
    offsets = align_ranks([r0, r1])
    assert abs(offsets[1] - shift) <= 3_000


def test_pipeline_stage_aligns_through_its_neighbour() -> None:
    # Stage 2 exchanges only with stage 1; stage 1 with stage 0. Offsets chain: 0 -> 1 -> 2.
    base = [1_000_000_000 + i * 7_000_000 for i in range(8)]
    other = [1_003_000_000 + i * 11_000_000 for i in range(8)]
    s0 = _synthetic({"SendRecv": base})
    s1 = _synthetic({"SendRecv": [t - 500_000 for t in base] + [t - 500_000 for t in other]})
    s2 = _synthetic({"SendRecv": [t + 2_000_000 for t in other]})
    report = estimate_alignment([s0, s1, s2])
    assert report.offsets == {0: 0, 1: 500_000, 2: -2_000_000}
    assert report.reference[2] == 1 and report.method[2] == "collectives"


def test_rank_without_collectives_falls_back_to_its_host_or_zero() -> None:
    base = [1_000_000_000 + i * 7_000_000 for i in range(6)]
    r0 = _synthetic({"ncclAllReduce": base}, host="a")
    r1 = _synthetic({"ncclAllReduce": [t - 40_000_000 for t in base]}, host="b")
    r2 = RecordSet(resource={"host.name": "b"})  # CPU-only rank on host b
    r3 = RecordSet(resource={"host.name": "c"})
    report = estimate_alignment([r0, r1, r2, r3])
    assert report.offsets == {0: 0, 1: 40_000_000, 2: 40_000_000, 3: 0}
    assert report.method == {0: "reference", 1: "collectives", 2: "same-host", 3: "none"}


def test_aligned_ranks_stitch_into_one_fleet_trace_per_step(ranks: list[RecordSet]) -> None:
    from plasmient_trace.pipeline import IngestOptions, stitch_records

    shifted = apply_offsets(ranks, {1: 25_000_000})
    aligned = apply_offsets(shifted, align_ranks(shifted))
    batch = stitch_records(aligned, IngestOptions(job_id="align-test")).batch
    level = batch.table.column("plasmient.level")
    assert pc.sum(pc.equal(level, "fleet")).as_py() == len(batch.trace_ids())
    # After alignment the two ranks' step spans of one step start within the real 0.2 ms apart.
    steps = batch.table.filter(pc.equal(level, "step"))
    by_step: dict[int, list[int]] = {}
    for s, start in zip(steps.column("plasmient.step").to_pylist(), steps.column("start_ns").to_pylist()):
        by_step.setdefault(s, []).append(start)
    assert by_step and all(len(v) == 2 and max(v) - min(v) < 5_000_000 for v in by_step.values())


def _rank_file(tmp_path, name: str, doc: dict):
    import gzip
    import json

    path = tmp_path / name
    with gzip.open(path, "wt") as f:
        json.dump(doc, f)
    return path


def _shifted(doc: dict, us: float) -> dict:
    return {**doc, "traceEvents": [{**e, "ts": e["ts"] + us} if "ts" in e else e for e in doc["traceEvents"]]}


def _without_step(doc: dict, step: int) -> dict:
    """The events of every step but ``step`` (its ProfilerStep's CPU range and the kernels that ran in it)."""
    marker = next(e for e in doc["traceEvents"] if e.get("name") == f"ProfilerStep#{step}")
    a, b = marker["ts"], marker["ts"] + marker["dur"]
    return {**doc, "traceEvents": [e for e in doc["traceEvents"] if not ("ts" in e and a <= e["ts"] < b)]}


@pytest.mark.parametrize("workers", ["1", "2"])
def test_ingest_says_how_each_rank_clock_was_aligned_and_warns_when_it_could_not_be(tmp_path, capsys, workers):
    """The offsets were kept in internal stats only: a rank 20 s off (past the 10 s search) stayed on its own
    clock (fleet window 20.6 s instead of 0.6 s, no line), and a rank missing a step was moved 373 ms on
    two chance coincidences, silently."""
    from conftest import raw_trace

    from plasmient_trace.cli import main

    docs = [raw_trace(f"a100_multirank/rank-{i}.json.gz") for i in (0, 1)]
    rank0 = _rank_file(tmp_path, "rank-0.json.gz", docs[0])
    cases = {
        "same clock": (docs[1], "rank-1.json.gz +0 µs (3 collectives)", None),
        "20 s ahead": (_shifted(docs[1], 20e6), None, "its clock could not be aligned with the others'"),
        # two chance coincidences moved it 373 ms (its true offset is 0): two are no evidence
        "a step missing": (_without_step(docs[1], 551), None, "(only 2 collective kernels agree on an offset, 3 are needed)"),
    }
    for case, (doc, info, warning) in cases.items():
        (tmp_path / case).mkdir()
        rank1 = _rank_file(tmp_path / case, "rank-1.json.gz", doc)
        code = main(["ingest", str(rank0), str(rank1), "--workers", workers, "--gpu-model", "NVIDIA A100-SXM4-80GB",
                     "--out", str(tmp_path / case / "out.jsonl")])
        err = capsys.readouterr().err
        assert code == 0, err
        said = [line for line in err.splitlines() if "clock" in line]
        if info:
            assert any(line.startswith(f"plasmient: clocks aligned on collective kernel ends against {rank0}: ")
                       and info in line for line in said), (case, said)
        warned = [line for line in said if warning and warning in line]
        assert len(warned) == (1 if warning else 0), (case, said)
        if warning:
            assert warned[0].startswith(f"plasmient: {rank1}: ")
        # a step one input did not record is said, and its fleet span counts the rank it lacks
        lacking = [line for line in err.splitlines() if "missing from some inputs" in line]
        fleet = {}
        for line in (tmp_path / case / "out.jsonl").read_text().splitlines():
            for rs in json.loads(line)["resourceSpans"]:
                for span in rs["scopeSpans"][0]["spans"]:
                    attrs = {a["key"]: next(iter(a["value"].values())) for a in span["attributes"]}
                    if attrs["plasmient.level"] == "fleet":
                        fleet[int(attrs["plasmient.step"])] = int(attrs["plasmient.fleet.ranks_missing"])
        if case == "a step missing":
            assert not any("clocks aligned" in line for line in said)  # left on its clock, which is the shared one
            assert lacking == [f"plasmient: 1 of 2 steps are missing from some inputs (step 551: {rank1}): their fleet "
                               "and node spans are over the ranks that recorded them (plasmient.fleet.ranks_missing "
                               "counts the others)"]
            assert fleet == {551: 1, 552: 0}
        elif case == "same clock":
            assert not lacking and fleet == {551: 0, 552: 0}


def test_inputs_without_a_file_name_are_named_input_i_in_every_message() -> None:
    """Records with no file (an API caller's, a live capture's) are named by their position. The clock lines
    said "input 1" while the unknown-device list said "rank 1" for the same records, and "rank i" is not their
    rank: given in reverse, input 0 is the trace of rank 1 (distributedInfo, read from the raw JSON), which the
    unknown-device line called "rank 0". Every message now says "input i"."""
    from conftest import raw_trace

    from plasmient_trace.pipeline import IngestOptions, stream_records

    names = [f"a100_multirank/rank-{i}.json.gz" for i in (1, 0)]
    assert [raw_trace(n)["distributedInfo"]["rank"] for n in names] == [1, 0]
    records = [read_kineto(trace_path(n)) for n in names]
    for r in records:
        r.source = None
    stats = stream_records(records, IngestOptions(job_id="unnamed")).stats
    assert stats["unknown_devices"] == ["input 0", "input 1"]  # a100_multirank names no GPU
    (line,) = stats["clock_notes"]
    assert "against input 0: input 1 " in line
    assert not any("rank" in text for text in stats["unknown_devices"] + stats["clock_notes"] + stats["warnings"])
