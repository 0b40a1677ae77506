"""Stragglers at the collectives: on the two ranks of one real job (a100_multirank), the fleet span's skew,
straggler rank and the seconds it cost the other rank equal what the raw JSON of both files says (to the
1 µs the parser keeps of these older files)."""

from __future__ import annotations

from collections import defaultdict

import pytest

from conftest import raw_trace, trace_path

FILES = ["a100_multirank/rank-0.json.gz", "a100_multirank/rank-1.json.gz"]
RUNTIME_CATS = {"cuda_runtime", "Runtime", "cuda_driver"}


def _collectives(name: str) -> dict[int, list[tuple[str, int, int]]]:
    """Per ProfilerStep number, the (name, start, end) in ns of the collective kernels launched inside that
    step's CPU range."""
    doc = raw_trace(name)
    base = doc.get("baseTimeNanoseconds") or 0
    launch, steps, kernels = {}, [], []
    for e in doc["traceEvents"]:
        if e.get("ph") != "X":
            continue
        ts = base + round(float(e["ts"]) * 1000)
        if e.get("cat") in RUNTIME_CATS and "correlation" in e.get("args", {}):
            launch[e["args"]["correlation"]] = ts
        elif str(e.get("name", "")).startswith("ProfilerStep#"):
            steps.append((ts, ts + round(float(e["dur"]) * 1000), int(e["name"][13:])))
        elif e.get("cat") == "kernel" and str(e.get("name", "")).lower().startswith("nccl"):
            kernels.append((ts, ts + round(float(e["dur"]) * 1000), e["name"], e["args"].get("correlation")))
    out: dict[int, list[tuple[str, int, int]]] = defaultdict(list)
    for ts, end, kname, corr in sorted(kernels):
        at = launch.get(corr, ts)
        step = next((n for a, b, n in steps if a <= at < b), None)
        if step is not None:
            out[step].append((kname, ts, end))
    return out


def test_fleet_names_the_straggler_and_what_it_cost():
    """Both ranks run one kernel name for every collective of the step (a send/recv ring), and their counts
    differ (602 and 577 kernels a step): the k-th kernel of a name on each rank is not one collective. Pairs
    are read from the raw JSON here as two kernels of one name that end within 1 ms of each other and both
    started before either ended (no rank leaves a collective before the last one arrives)."""
    from plasmient_trace.pipeline import IngestOptions, ingest_paths

    result = ingest_paths([trace_path(f) for f in FILES], IngestOptions(job_id="strag", gpu_model="NVIDIA A100-SXM4-80GB"))
    assert set(result.stats["clock_offsets_ns"].values()) == {0}  # these two files share a clock
    rows = result.batch.table.to_pylist()
    fleets = {r["plasmient.step"]: r for r in rows if r["plasmient.level"] == "fleet"}
    comm = {(r["plasmient.step"], r["plasmient.rank"]): r["plasmient.comm.total_s"] for r in rows
            if r["plasmient.level"] == "rank"}
    per_rank = [_collectives(f) for f in FILES]
    assert set(fleets) == {551, 552}
    for step, fleet in fleets.items():
        skews, imposed = [], defaultdict(float)
        for n0, s0, e0 in per_rank[0][step]:
            for n1, s1, e1 in per_rank[1][step]:
                if n0 == n1 and abs(e0 - e1) <= 1_000_000 and max(s0, s1) <= min(e0, e1):
                    skews.append(abs(s0 - s1) / 1e9)
                    imposed[0 if s0 > s1 else 1] += abs(s0 - s1) / 1e9
        assert fleet["plasmient.collectives.matched"] == len(skews) > 0
        assert fleet["plasmient.collectives.skew_max_s"] == pytest.approx(max(skews), abs=2e-6)
        assert fleet["plasmient.collectives.skew_mean_s"] == pytest.approx(sum(skews) / len(skews), abs=2e-6)
        worst = max(imposed, key=imposed.get)
        assert fleet["plasmient.straggler.rank"] == worst
        assert fleet["plasmient.straggler.wait_s"] == pytest.approx(imposed[worst], abs=2e-6 * len(skews))
        # the others waited inside their own collectives: never longer than those took (0.31 s against
        # 0.20 s when the k-th kernels were paired)
        waited = 1 - worst
        assert fleet["plasmient.straggler.wait_s"] <= comm[(step, waited)]


def test_a_single_rank_names_no_straggler():
    from plasmient_trace.pipeline import IngestOptions, ingest_paths

    rows = ingest_paths([trace_path(FILES[0])], IngestOptions(job_id="one")).batch.table.to_pylist()
    fleet = [r for r in rows if r["plasmient.level"] == "fleet"]
    assert fleet and all(r["plasmient.straggler.rank"] is None and r["plasmient.collectives.matched"] is None for r in fleet)


def _fleet_rows(summaries) -> dict[int, dict]:
    from plasmient_trace.stitch.fleet import top_spans
    from plasmient_trace.stitch.inputs import StitchOptions

    rows = top_spans(summaries, StitchOptions(job_id="strag")).table.to_pylist()
    return {r["plasmient.step"]: r for r in rows if r["plasmient.level"] == "fleet"}


STRAGGLER_KEYS = ("plasmient.collectives.matched", "plasmient.collectives.skew_max_s",
                  "plasmient.collectives.skew_mean_s", "plasmient.straggler.rank", "plasmient.straggler.wait_s")


def test_live_hosts_with_disagreeing_clocks_are_aligned_before_stragglers_are_named():
    """Live, each host stamps its step summaries with its own wall clock. Rank 1 moved to a second host whose
    clock runs 3.7 s ahead (plus 123 µs): once the fleet aligns hosts on their collective ends, skew,
    straggler and wait are those of the shared-clock run, which the first test checks against the raw JSON."""
    from dataclasses import replace

    from plasmient_trace.pipeline import IngestOptions, ingest_paths
    from plasmient_trace.stitch.align import align_summaries

    result = ingest_paths([trace_path(f) for f in FILES], IngestOptions(job_id="strag", gpu_model="NVIDIA A100-SXM4-80GB"))
    same_clock = [replace(s, host="node-b") if s.rank == 1 else s for s in result.summaries]
    shift = 3_700_123_000

    def skewed(s):
        return replace(s, start_ns=s.start_ns + shift, end_ns=s.end_ns + shift, window_start_ns=s.window_start_ns + shift,
                       window_end_ns=s.window_end_ns + shift,
                       collectives=[[n, a + shift, b + shift] for n, a, b in s.collectives])

    live = [skewed(s) if s.rank == 1 else s for s in same_clock]
    aligned, clocks = align_summaries(live)
    assert clocks == {same_clock[0].host: "reference", "node-b": "collectives"}
    expected, unaligned, got = _fleet_rows(same_clock), _fleet_rows(live), _fleet_rows(aligned)
    assert expected and set(got) == set(expected)
    for step, fleet in expected.items():
        assert fleet["plasmient.straggler.rank"] is not None
        for key in STRAGGLER_KEYS:
            assert got[step][key] == pytest.approx(fleet[key], abs=2e-6), key
        # Unaligned, no kernel ends near another rank's (3.7 s apart): nothing is matched, rather than the
        # clock error read as rank 0 waiting 3.7 s at every collective.
        assert unaligned[step]["plasmient.collectives.matched"] is None
        assert unaligned[step]["plasmient.straggler.rank"] is None


def test_a_host_whose_clock_cannot_be_aligned_claims_no_straggler():
    from dataclasses import replace

    from plasmient_trace.pipeline import IngestOptions, ingest_paths
    from plasmient_trace.stitch.align import align_summaries

    result = ingest_paths([trace_path(f) for f in FILES], IngestOptions(job_id="strag", gpu_model="NVIDIA A100-SXM4-80GB"))
    # The second host's collectives renamed: nothing to vote on, so its clock stays unknown.
    live = [replace(s, host="node-b", collectives=[["other:" + n, a, b] for n, a, b in s.collectives]) if s.rank == 1
            else s for s in result.summaries]
    aligned, clocks = align_summaries(live)
    assert clocks["node-b"] == "none"
    for fleet in _fleet_rows(aligned).values():
        assert fleet["plasmient.straggler.rank"] is None and fleet["plasmient.collectives.matched"] is None
