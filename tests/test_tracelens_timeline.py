"""The device timeline of a rank (busy, idle, communication and copies, exposed and hidden) against TraceLens's
GPU-timeline breakdown: its golden sheet for the vLLM CUDA-graph replay, and its definitions recomputed here
from the raw JSON over the whole trace for the other shared traces.

TraceLens (``GPUEventAnalyser.compute_metrics``) measures one window, from the first GPU activity's start to the
last one's end; plasmient tiles each rank's device timeline into step windows whose first one opens at the first
step's CPU start. So plasmient's idle time holds, on top of TraceLens's, the lead gap before the first kernel;
busy, communication and copies are unions of the same intervals and must agree to the nanosecond rounding,
but for copies of two steps that ran at once (a pipelined job's next input beside this step's), which count
in each of the two steps.
Categories follow plasmient's (docs/hta-tracelens.md lists where TraceLens's differ: memsets count as
computation there, and its exposed memcpy also subtracts communication); the opt-in comparison with TraceLens
itself is tests/test_tracelens_compare.py.
"""

from __future__ import annotations

import csv

import pytest
from conftest import TRACES, raw_activities, raw_trace, union_ns
from device_timeline import COMM_NAME, COPY_CATS, rank_timeline, raw_timeline

REPLAY = "cc94_vllm_decode/graph_execution.json.gz"
GOLDEN = TRACES / "cc94_vllm_decode" / "tracelens_golden" / "gpu_timeline.csv"

# mi300x: 968 kernels launched before the capture began (no launch record) run through the first 30 ms while
# the device catches up with the host; they must stay in the first step, not fall into the next one by time.
COMM_TRACES = ["b200/eager_rank0_of8.json.gz", "a100/nccl_training_rank0_of2.json.gz",
               "a100/cuda_graphs_rank0_of16.json.gz", "mi300x/resnet_act_checkpoint_rank0_of8.json.gz"]
TIMELINE_TRACES = ["b200/eager_rank0_of8.json.gz", "a100/nccl_training_rank0_of2.json.gz",
                   "a100/cuda_graphs_rank0_of16.json.gz",
                   "mi300x/resnet_act_checkpoint_rank0_of8.json.gz",
                   "v100/resnet50_training.json.gz", "a100_multirank/rank-1.json.gz", REPLAY]



def _copies_of_two_steps_at_once(name: str) -> tuple[float, float]:
    """Copy time (and exposed copy time) that steps' own unions count more than once over the whole trace: the
    sum over steps of the union of each step's copies, less the union of all copies (seconds), from the raw
    JSON. Zero unless copies of different steps overlapped."""
    acts = [a for a in raw_activities(raw_trace(name)) if a["step"] is not None]
    twice = twice_exposed = 0
    for dev in {a["event"].get("args", {}).get("device", 0) for a in acts}:
        on_dev = [a for a in acts if a["event"].get("args", {}).get("device", 0) == dev]
        copies = [a for a in on_dev if a["event"]["cat"] in COPY_CATS]
        compute = [(a["start_ns"], a["end_ns"]) for a in on_dev
                   if a["event"]["cat"] not in COPY_CATS and not COMM_NAME.search(str(a["event"].get("name", "")))]

        def exposed(intervals, compute=compute):
            return union_ns(intervals + compute) - union_ns(compute)

        every = [(a["start_ns"], a["end_ns"]) for a in copies]
        for step in {a["step"] for a in copies}:
            mine = [(a["start_ns"], a["end_ns"]) for a in copies if a["step"] == step]
            twice += union_ns(mine)
            twice_exposed += exposed(mine)
        twice -= union_ns(every)
        twice_exposed -= exposed(every)
    return twice / 1e9, twice_exposed / 1e9


def _golden() -> dict[str, float]:
    with open(GOLDEN, newline="") as f:
        return {row["type"]: float(row["time ms"]) / 1e3 for row in csv.DictReader(f)}


def test_replay_timeline_matches_the_tracelens_golden_sheet():
    """TraceLens's gpu_timeline sheet for the vLLM decode replay (one CUDA graph, no collectives): busy,
    copies, computation and idle agree once the lead gap, host time before the graph's first kernel that
    plasmient's step window holds and TraceLens's window does not, is taken off."""
    if not GOLDEN.exists():
        pytest.skip(f"{GOLDEN} not present")
    gold, ours = _golden(), rank_timeline(REPLAY)
    us = 1e-6
    assert ours["busy_s"] == pytest.approx(gold["busy_time"], abs=us)
    assert ours["comm.total_s"] == gold["total_comm_time"] == 0.0
    assert ours["comm.exposed_s"] == gold["exposed_comm_time"] == 0.0
    assert ours["memcpy.total_s"] == pytest.approx(gold["total_memcpy_time"], abs=us)
    assert ours["memcpy.exposed_s"] == pytest.approx(gold["exposed_memcpy_time"], abs=us)
    # TraceLens's computation is the union of compute kernels: busy less what copies and collectives expose
    computation = ours["busy_s"] - ours["comm.exposed_s"] - ours["memcpy.exposed_s"]
    assert computation == pytest.approx(gold["computation_time"], abs=us)
    assert ours["lead_gap_s"] > 1e-3  # the replay's host-side launch (8.4 ms) precedes the graph's kernels
    assert ours["idle_s"] - ours["lead_gap_s"] == pytest.approx(gold["idle_time"], abs=us)
    assert ours["busy_s"] + ours["idle_s"] - ours["lead_gap_s"] == pytest.approx(gold["total_time"], abs=us)


@pytest.mark.parametrize("name", COMM_TRACES)
def test_communication_over_the_whole_trace(name):
    """Summed over the rank's steps, collective time and its exposed part (collective time with no compute
    kernel running) equal TraceLens's total_comm_time and exposed_comm_time over the whole trace."""
    whole, ours = raw_timeline(name), rank_timeline(name)
    assert ours["comm.total_s"] == pytest.approx(whole["comm"], abs=5e-6)
    assert ours["comm.exposed_s"] == pytest.approx(whole["comm_exposed"], abs=5e-6)


@pytest.mark.parametrize("name", TIMELINE_TRACES)
def test_device_timeline_over_the_whole_trace(name):
    """Summed over the rank's steps, busy time, copy time and its exposed part, and idle time less the lead
    gap equal TraceLens's busy_time, memcpy times and idle_time (in plasmient's categories) over the whole
    trace; TraceLens reads neither v100 nor a100_multirank (old 'Kernel' categories), its definitions do."""
    whole, ours = raw_timeline(name), rank_timeline(name)
    twice, twice_exposed = _copies_of_two_steps_at_once(name)
    assert ours["busy_s"] == pytest.approx(whole["busy"], abs=5e-6)
    assert ours["memcpy.total_s"] == pytest.approx(whole["copy"] + twice, abs=5e-6)
    assert ours["memcpy.exposed_s"] == pytest.approx(whole["copy_exposed"] + twice_exposed, abs=5e-6)
    assert ours["lead_gap_s"] >= 0
    assert ours["idle_s"] - ours["lead_gap_s"] == pytest.approx(whole["span"] - whole["busy"], abs=5e-6)
