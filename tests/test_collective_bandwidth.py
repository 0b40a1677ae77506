"""Message size, algorithm and bus bandwidth of NCCL/RCCL collective kernels, checked on the shared multi-GPU
traces against values recomputed here from the raw JSON with this file's own copy of the nccl-tests formulas
(NVIDIA nccl-tests doc/PERFORMANCE.md; alltoall.cu and sendrecv.cu for all_to_all and send/recv):

    S = elements x dtype size of the whole array (all_gather: the output, reduce_scatter: the input)
    algbw = S / t        busbw = algbw x factor(n)
    all_reduce 2(n-1)/n | all_gather, reduce_scatter, all_to_all (n-1)/n | broadcast, reduce, send, recv 1

t is the kernel's own duration (Kineto 'dur'), n the 'Group size' the kernel's args carry, and the link peak
the GPU's one-direction NVLink / Infinity Fabric bandwidth from its datasheet.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
from conftest import RAW_COLLECTIVE_KERNEL, ingested, raw_activities, raw_trace, trace_path

SIZED = ["a100/nccl_training_rank0_of2.json.gz", "mi300x/resnet_act_checkpoint_rank0_of8.json.gz",
         "b200/eager_rank0_of8.json.gz"]

# Which element count is S, and the bus factor, by c10d collective name (as the traces spell them).
FORMULA = {
    "allreduce": ("In msg nelems", lambda n: 2 * (n - 1) / n),
    "broadcast": ("In msg nelems", lambda n: 1.0),
    "_allgather_base": ("Out msg nelems", lambda n: (n - 1) / n),
    "all_gather": ("Out msg nelems", lambda n: (n - 1) / n),
    "_reduce_scatter_base": ("In msg nelems", lambda n: (n - 1) / n),
    "all_to_all": ("In msg nelems", lambda n: (n - 1) / n),
}
ELEMENT_BYTES = {"Float": 4, "BFloat16": 2, "Half": 2, "Long": 8, "Int": 4, "Double": 8, "Byte": 1}
# Datasheet GPU-to-GPU bandwidth, both directions, halved: nccl-tests' busbw is a one-direction number.
LINK_PEAK_GBS = {
    "NVIDIA A100-PG509-200": 600 / 2,   # A100 SXM4 board: NVLink 3, 600 GB/s
    "NVIDIA A100-SXM4-80GB": 600 / 2,
    "AMD Instinct MI300X": 896 / 2,     # 7 Infinity Fabric links x 128 GB/s
    "NVIDIA B200": 1800 / 2,            # NVLink 5, 1.8 TB/s
}


def _is_collective_kernel(e: dict) -> bool:
    return e.get("ph") == "X" and e.get("cat") == "kernel" and RAW_COLLECTIVE_KERNEL.search(str(e.get("name", ""))) is not None


def _expected(name: str) -> tuple[dict[int, dict], float]:
    """Per collective kernel (by correlation id): its step (conftest.raw_activities: the ProfilerStep whose CPU
    range holds its launch, None outside every step)
    and, where its args carry the NCCL metadata, bytes / algbw / busbw; and the link peak in GB/s."""
    doc = raw_trace(name)
    out = {}
    for activity in raw_activities(doc):
        e, step = activity["event"], activity["step"]
        if not _is_collective_kernel(e):
            continue
        a = e["args"]
        row = {"step": step, "dur_s": float(e["dur"]) / 1e6}
        if "Collective name" in a:
            count_key, factor = FORMULA[a["Collective name"]]
            size = a[count_key] * ELEMENT_BYTES[a["dtype"]]
            algbw = size / row["dur_s"]
            row.update(collective=a["Collective name"], bytes=float(size), algbw=algbw, busbw=algbw * factor(a["Group size"]))
        assert a["correlation"] not in out, "correlation ids identify the kernels of these traces"
        out[a["correlation"]] = row
    return out, LINK_PEAK_GBS[doc["deviceProperties"][0]["name"]]


def _spans(name: str, level: str, max_spans: int | None = None) -> list[dict]:
    return [r for r in ingested(name, max_spans).batch.table.to_pylist() if r["plasmient.level"] == level]


@pytest.mark.parametrize("name", SIZED)
def test_each_collective_kernel_carries_its_bytes_and_bandwidths(name):
    expected, peak = _expected(name)
    sized = {c: x for c, x in expected.items() if "bytes" in x and x["step"] is not None}
    kernels = {r["plasmient.correlation_id"]: r for r in _spans(name, "kernel") if r["plasmient.comm.bytes"] is not None}
    # every sized collective of these traces runs inside a ProfilerStep and is exported as a span
    assert set(kernels) == set(sized)
    for corr, x in sized.items():
        span = kernels[corr]
        assert span["plasmient.kernel.kind"] == "collective"
        assert span["plasmient.comm.bytes"] == x["bytes"]
        assert span["plasmient.comm.algbw_gbs"] == pytest.approx(x["algbw"] / 1e9, rel=1e-6)
        assert span["plasmient.comm.busbw_gbs"] == pytest.approx(x["busbw"] / 1e9, rel=1e-6)
        assert span["plasmient.comm.busbw_fraction"] == pytest.approx(x["busbw"] / 1e9 / peak, rel=1e-6)
        # the measured fraction is at most 1 here; above it the step counts the kernel (test below)
        assert span["plasmient.comm.busbw_fraction"] <= 1.0


@pytest.mark.parametrize("name", SIZED)
def test_steps_sum_bytes_and_weight_bus_bandwidth_by_bytes(name):
    expected, peak = _expected(name)
    steps = {r["plasmient.step"]: r for r in _spans(name, "step")}
    ranks = {r["plasmient.step"]: r for r in _spans(name, "rank")}
    with_comm = {x["step"] for x in expected.values() if x["step"] is not None}
    assert with_comm and with_comm <= set(steps)
    for step, span in steps.items():
        mine = [x for x in expected.values() if x["step"] == step]
        sized = [x for x in mine if "bytes" in x]
        if not mine:
            assert span["plasmient.comm.unsized"] is None and span["plasmient.comm.link_peak_gbs"] is None
            continue
        assert span["plasmient.comm.unsized"] == len(mine) - len(sized)
        assert span["plasmient.comm.link_peak_gbs"] == pytest.approx(peak)
        if not sized:
            assert span["plasmient.comm.bytes"] is None and span["plasmient.comm.busbw_gbs"] is None
            continue
        total = sum(x["bytes"] for x in sized)
        assert span["plasmient.comm.bytes"] == pytest.approx(total, rel=1e-12)
        weighted = sum(x["bytes"] * x["busbw"] for x in sized) / total / 1e9
        assert span["plasmient.comm.busbw_gbs"] == pytest.approx(weighted, rel=1e-6)
        assert span["plasmient.comm.busbw_fraction"] == pytest.approx(weighted / peak, rel=1e-6)
        assert span["plasmient.comm.over_link_peak"] == sum(x["busbw"] / 1e9 > peak for x in sized)
        longest = max(sized, key=lambda x: x["dur_s"])
        assert span["plasmient.comm.slowest.collective"] == longest["collective"]
        assert span["plasmient.comm.slowest.bytes"] == longest["bytes"]
        assert span["plasmient.comm.slowest.busbw_gbs"] == pytest.approx(longest["busbw"] / 1e9, rel=1e-6)
        assert span["plasmient.comm.slowest.duration_s"] == pytest.approx(longest["dur_s"], rel=1e-6)
        # the rank span of a step carries the step's numbers
        for key in ("plasmient.comm.bytes", "plasmient.comm.busbw_gbs", "plasmient.comm.slowest.collective"):
            assert ranks[step][key] == span[key]


def test_folded_collective_kernels_still_count_in_their_step():
    name = "a100/nccl_training_rank0_of2.json.gz"
    full = {r["plasmient.step"]: r for r in _spans(name, "step")}
    tight = {r["plasmient.step"]: r for r in _spans(name, "step", max_spans=60)}
    kernel_spans = [r for r in _spans(name, "kernel", max_spans=60) if r["plasmient.comm.bytes"] is not None]
    assert len(kernel_spans) < sum(1 for x in _expected(name)[0].values() if "bytes" in x)  # some were folded
    for step, span in full.items():
        for key in ("plasmient.comm.bytes", "plasmient.comm.busbw_gbs", "plasmient.comm.unsized"):
            assert tight[step][key] == span[key]


def test_collectives_without_nccl_metadata_have_no_size_or_bandwidth():
    """a100/cuda_graphs: 80 NCCL SendRecv kernels whose args carry no message metadata (older Kineto)."""
    name = "a100/cuda_graphs_rank0_of16.json.gz"
    expected, _ = _expected(name)
    assert expected and not any("bytes" in x for x in expected.values())
    for level in ("kernel", "step", "rank"):
        for span in _spans(name, level):
            for key in ("plasmient.comm.bytes", "plasmient.comm.algbw_gbs", "plasmient.comm.busbw_gbs",
                        "plasmient.comm.busbw_fraction", "plasmient.comm.slowest.collective"):
                assert span[key] is None, (level, key)
    for span in _spans(name, "step"):
        assert span["plasmient.comm.unsized"] == sum(x["step"] == span["plasmient.step"] for x in expected.values())


def test_a_trace_without_collectives_has_no_comm_attributes():
    for level in ("kernel", "step", "rank"):
        for span in _spans("h100/bert_small_inference.json.gz", level):
            assert all(v is None for k, v in span.items() if k.startswith("plasmient.comm.") and k not in (
                "plasmient.comm.total_s", "plasmient.comm.exposed_s", "plasmient.comm.overlap")), level


def test_absurd_message_sizes_are_unknown_and_counted(tmp_path):
    """The b200 trace's one all_gather with its sizes corrupted: a negative count, a fractional one, a group
    size given as text. Each becomes null (no bytes, no bandwidth) and is counted as an invalid value."""
    from plasmient_trace.sources.kineto import read_kineto

    doc = copy.deepcopy(raw_trace("b200/eager_rank0_of8.json.gz"))
    hit = [e for e in doc["traceEvents"] if _is_collective_kernel(e) and "Collective name" in e["args"]]
    assert len(hit) == 1
    hit[0]["args"].update({"In msg nelems": -25136, "Out msg nelems": 201088.5, "Group size": "8"})
    path = tmp_path / "corrupt.json"
    path.write_text(json.dumps(doc))
    clean = read_kineto(trace_path("b200/eager_rank0_of8.json.gz"))
    records = read_kineto(path)
    assert records.counters["input.invalid_values"] == clean.counters["input.invalid_values"] + 3
    row = records.kernels.filter(records.kernels.column("comm_collective").is_valid()).to_pylist()
    assert len(row) == 1
    assert row[0]["comm_in_nelems"] is None and row[0]["comm_out_nelems"] is None and row[0]["comm_group_size"] is None
    assert row[0]["comm_dtype"] == "BFloat16"

    from plasmient_trace.pipeline import IngestOptions, ingest_paths

    spans = ingest_paths([path], IngestOptions(job_id="corrupt")).batch.table.to_pylist()
    coll = [r for r in spans if r["plasmient.level"] == "kernel" and r["plasmient.kernel.kind"] == "collective"]
    assert coll and all(r["plasmient.comm.bytes"] is None and r["plasmient.comm.busbw_gbs"] is None for r in coll)
    step = next(r for r in spans if r["plasmient.level"] == "step")
    # the all_gather joins the step's symmetric-memory all-reduces, which never carried a size
    unsized_before = next(r for r in ingested("b200/eager_rank0_of8.json.gz").batch.table.to_pylist()
                          if r["plasmient.level"] == "step")["plasmient.comm.unsized"]
    assert step["plasmient.comm.unsized"] == unsized_before + 1 and step["plasmient.comm.bytes"] is None
    assert not math.isnan(step["plasmient.comm.link_peak_gbs"])


# c10d names no shared trace uses, on the b200 all_gather kernel relabelled: (name, In, Out, S elements, factor at n=8)
RELABELLED = [
    ("_reduce_scatter_base", 201088, 25136, 201088, 7 / 8),
    ("reduce_scatter_tensor_coalesced", 201088, 25136, 201088, 7 / 8),
    ("all_to_all", 201088, 201088, 201088, 7 / 8),
    ("allreduce_coalesced", 201088, 201088, 201088, 2 * 7 / 8),
    ("reduce", 201088, 201088, 201088, 1.0),
    ("send", 201088, 201088, 201088, 1.0),
    ("recv", 201088, 201088, 201088, 1.0),
    ("barrier", 1, 1, None, None),
]


@pytest.mark.parametrize(("collective", "n_in", "n_out", "elements", "factor"), RELABELLED)
def test_every_collective_family_uses_its_nccl_tests_size_and_factor(tmp_path, collective, n_in, n_out, elements, factor):
    from plasmient_trace.pipeline import IngestOptions, ingest_paths

    doc = copy.deepcopy(raw_trace("b200/eager_rank0_of8.json.gz"))
    (kernel,) = [e for e in doc["traceEvents"] if _is_collective_kernel(e) and "Collective name" in e["args"]]
    kernel["args"].update({"Collective name": collective, "In msg nelems": n_in, "Out msg nelems": n_out})
    path = tmp_path / "relabelled.json"
    path.write_text(json.dumps(doc))
    spans = ingest_paths([path], IngestOptions(job_id="relabelled")).batch.table.to_pylist()
    (span,) = [r for r in spans if r["plasmient.level"] == "kernel" and r["plasmient.correlation_id"] == kernel["args"]["correlation"]]
    assert span["plasmient.kernel.kind"] == "collective"
    if elements is None:  # nccl-tests has no bus factor for it: no size claimed either
        assert span["plasmient.comm.bytes"] is None and span["plasmient.comm.busbw_gbs"] is None
        return
    size = elements * 2  # BFloat16
    algbw = size / (float(kernel["dur"]) / 1e6)
    assert span["plasmient.comm.bytes"] == size
    assert span["plasmient.comm.busbw_gbs"] == pytest.approx(algbw * factor / 1e9, rel=1e-6)


def test_terminal_summary_line_reports_bytes_and_weighted_bus_bandwidth():
    from plasmient_trace.report.summary import collective_note

    name = "a100/nccl_training_rank0_of2.json.gz"
    expected, peak = _expected(name)
    sized = [x for x in expected.values() if "bytes" in x and x["step"] is not None]
    total = sum(x["bytes"] for x in sized)
    bus = sum(x["bytes"] * x["busbw"] for x in sized) / total / 1e9
    longest = max(sized, key=lambda x: x["dur_s"])
    note = collective_note(ingested(name).batch)
    assert note.startswith(f"collectives: {total / 1e6:.4g} MB over 3 step spans, bus bandwidth {bus:.3g} GB/s")
    assert f"{bus / peak * 100:.1f}% of the {peak:.0f} GB/s link peak" in note
    assert f"longest sized: {longest['collective']} {longest['bytes'] / 1e6:.3g} MB" in note
    unsized = [x for x in expected.values() if "bytes" not in x and x["step"] is not None]
    assert ("more collective kernel(s) had no message size" in note) == bool(unsized)
    # b200 all-reduces through symmetric memory (no NCCL metadata) beside its one sized NCCL all-gather
    expected, _ = _expected("b200/eager_rank0_of8.json.gz")
    unsized = [x for x in expected.values() if "bytes" not in x and x["step"] is not None]
    assert len(unsized) == 73
    assert collective_note(ingested("b200/eager_rank0_of8.json.gz").batch).endswith(
        "; 73 more collective kernel(s) had no message size (no NCCL metadata) and are in none of these")
    # cuda_graphs' Kineto recorded no NCCL metadata at all
    expected, _ = _expected("a100/cuda_graphs_rank0_of16.json.gz")
    in_steps = [x for x in expected.values() if x["step"] is not None]
    assert in_steps and not [x for x in in_steps if "bytes" in x]
    assert collective_note(ingested("a100/cuda_graphs_rank0_of16.json.gz").batch) == (
        f"collectives: {len(in_steps):,} kernel(s), none with a message size (no NCCL metadata in the trace), "
        "so no bus bandwidth")


def test_node_and_fleet_add_their_ranks_bytes_and_weight_bus_bandwidth_by_them(tmp_path):
    """Two ranks of one job (the a100 trace and a copy of it as rank 1, so the oracle is twice the raw JSON):
    node and fleet spans of each step carry the sum of the ranks' message bytes and the bytes-weighted bus
    bandwidth, compared against the raw-JSON values of the step's collectives."""
    import gzip

    from plasmient_trace.pipeline import IngestOptions, ingest_paths

    name = "a100/nccl_training_rank0_of2.json.gz"
    expected, peak = _expected(name)
    doc = raw_trace(name)
    twin = dict(doc, distributedInfo={**doc["distributedInfo"], "rank": 1})
    copy_path = tmp_path / "rank1.json.gz"
    with gzip.open(copy_path, "wt") as f:
        json.dump(twin, f)
    rows = ingest_paths([trace_path(name), copy_path], IngestOptions(job_id="bw")).batch.table.to_pylist()
    tops = [r for r in rows if r["plasmient.level"] in ("node", "fleet")]
    assert {r["plasmient.level"] for r in tops} == {"node", "fleet"}
    checked = 0
    for span in tops:
        sized = [x for x in expected.values() if x["step"] == span["plasmient.step"] and "bytes" in x]
        if not sized:
            assert span["plasmient.comm.bytes"] is None and span["plasmient.comm.busbw_gbs"] is None
            continue
        total = sum(x["bytes"] for x in sized)
        assert span["plasmient.comm.bytes"] == pytest.approx(2 * total, rel=1e-12)
        weighted = sum(x["bytes"] * x["busbw"] for x in sized) / total / 1e9
        assert span["plasmient.comm.busbw_gbs"] == pytest.approx(weighted, rel=1e-6)
        assert span["plasmient.comm.busbw_fraction"] == pytest.approx(weighted / peak, rel=1e-6)
        assert span["plasmient.comm.link_peak_gbs"] == pytest.approx(peak)
        checked += 1
    assert checked >= 2  # a node and a fleet span of at least one step with sized collectives


def test_node_and_fleet_have_no_bytes_without_nccl_metadata():
    rows = ingested("a100/cuda_graphs_rank0_of16.json.gz").batch.table.to_pylist()
    tops = [r for r in rows if r["plasmient.level"] in ("node", "fleet")]
    assert tops and all(r["plasmient.comm.bytes"] is None and r["plasmient.comm.busbw_gbs"] is None for r in tops)
