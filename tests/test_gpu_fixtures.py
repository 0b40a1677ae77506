"""Live capture on an NVIDIA H200, replayed here without a GPU.

``scripts/gpu-check.sh`` recorded, for three workloads (the tiny transformer training, dim 256, batch 16,
in fp32 and under bf16 autocast; a decode loop plus a 4096^3 GEMM as explicit steps), three full-depth steps under live capture: the
raw CUPTI activity buffers exactly as libcupti filled them (``cupti/*.npz``, one per flush, with the record
sizes the collector measured and the kernel names their pointers held), the op, module and step
tables of the native op observer (``records/``), and torch.profiler's trace of the same three steps
of the same program on the same machine (``profiler.json.gz``). torch 2.11.0+cu130, CUPTI 13.0.

The oracles: torch.profiler's own trace, read here directly from its JSON (no plasmient code), and
torch's FlopCounterMode formulas.
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from plasmient_trace.capture import cupti
from plasmient_trace.capture import cupti_records as cr
from plasmient_trace.pipeline import IngestOptions, stitch_records
from plasmient_trace.records import DeviceInfo, RecordSet

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "gpu"
WORKLOADS = ("tiny_transformer", "decode_gemm", "bf16_autocast")


def raw_activity(workload: str) -> tuple[cr.RawActivity, int]:
    """Every recorded flush of the workload as one batch, and the CUPTI -> epoch clock offset."""
    raws, offset = [], 0
    for meta_path in sorted((FIXTURES / workload / "cupti").glob("*.json")):
        meta = json.loads(meta_path.read_text())
        with np.load(meta_path.with_suffix(".npz")) as npz:
            buffers = [npz[f"arr_{i}"] for i in range(len(npz.files))]
        raws.append(cr.RawActivity(buffers=buffers, sizes={int(k): v for k, v in meta["sizes"].items()},
                                   names={int(p): n for p, n in meta["names"].items()}))
        offset = meta["epoch_offset_ns"]
    return cr.RawActivity.concat(raws), offset


def records(workload: str) -> RecordSet:
    """The live RecordSet: kernels, launches and correlations parsed from the raw buffers here."""
    directory = FIXTURES / workload / "records"
    meta = json.loads((directory / "meta.json").read_text())
    rs = RecordSet(devices=[DeviceInfo(**d) for d in meta["devices"]], resource=meta["resource"], source=meta["source"],
                   clock=meta["clock"], counters=meta["counters"])
    for name in ("ops", "modules", "steps", "samples"):
        with pa.memory_map(str(directory / f"{name}.arrow")) as source:
            setattr(rs, name, pa.ipc.open_file(source).read_all())
    raw, offset = raw_activity(workload)
    for name, table in cupti.tables(raw, offset).items():
        setattr(rs, name, table)
    return rs


def profiler_counts(workload: str, cats: tuple[str, ...], key) -> list[Counter]:
    """Per ProfilerStep, ``key(event, op_of)`` of each GPU activity of the categories ``cats`` as
    torch.profiler recorded it (``op_of``: External id -> op name); its launch's time places it in a step."""
    with gzip.open(FIXTURES / workload / "profiler.json.gz") as f:
        events = json.load(f)["traceEvents"]
    op_of = {e["args"]["External id"]: e["name"] for e in events if e.get("cat") == "cpu_op"}
    launch_ts = {e["args"]["correlation"]: e["ts"] for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")}
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#"))
    out = [Counter() for _ in steps]
    for e in events:
        if e.get("cat") in cats:
            ts = launch_ts[e["args"]["correlation"]]
            k = next(i for i, (a, b) in enumerate(steps) if a <= ts <= b)
            out[k][key(e, op_of)] += 1
    return out


def profiler_joins(workload: str) -> list[Counter]:
    """Per ProfilerStep, (op, kernel) pairs as torch.profiler recorded them: each GPU activity's
    External id names the op it ran for."""
    return profiler_counts(workload, ("kernel", "gpu_memcpy", "gpu_memset"),
                           lambda e, op_of: (op_of.get(e["args"].get("External id"), "?"), e["name"]))


def live_joins(table: pa.Table) -> list[Counter]:
    rows = table.select(["span_id", "parent_span_id", "name", "plasmient.level", "plasmient.step"]).to_pylist()
    name_of = {r["span_id"]: r["name"] for r in rows}
    by_step: dict[int, Counter] = {}
    for r in rows:
        if r["plasmient.level"] == "kernel":
            by_step.setdefault(r["plasmient.step"], Counter())[(name_of[r["parent_span_id"]], r["name"])] += 1
    return [by_step[s] for s in sorted(by_step)]


@pytest.fixture(scope="module", params=WORKLOADS)
def replay(request):
    rs = records(request.param)
    return request.param, rs, stitch_records([rs], IngestOptions(job_id=f"h200-{request.param}")).batch.table


def test_every_kernel_joins_the_op_torch_profiler_says_launched_it(replay):
    workload, _, table = replay
    live, prof = live_joins(table), profiler_joins(workload)
    assert len(live) == len(prof) == 3
    for mine, theirs in zip(live, prof):
        assert sum(theirs.values()) > 0
        assert mine == theirs  # names too: demangled symbols, "Memcpy DtoD (Device -> Device)", as Kineto writes them
    assert ("?" not in {p for c in prof for p, _ in c})


def test_the_raw_buffers_hold_only_whole_records_of_the_measured_sizes(replay):
    workload, _, _ = replay
    raw, _ = raw_activity(workload)
    assert raw.sizes[cr.KIND_CONCURRENT_KERNEL] == 216  # CUpti_ActivityKernel10, as CUDA 13's header has it
    from test_capture_cupti import _walk_one_by_one  # a record at a time, as cuptiActivityGetNextRecord walks

    total = 0
    for data in raw.buffers:
        offsets, kinds = cr.walk(data, raw.sizes)
        assert offsets.tolist() == _walk_one_by_one(data, raw.sizes)
        total += len(offsets)
    assert cr.parse(raw).skipped_buffers == 0 and total > 0
    assert cr.name_table(raw) == dict(raw.names)  # the recording kept exactly the names its kernels point at


def test_each_kernel_starts_after_its_launch_on_one_clock(replay):
    """CUPTI stamps launches and kernels with one clock; shifted together onto the epoch, every kernel
    begins after the API call that launched it, and inside the capture's steps."""
    _, rs, _ = replay
    k = rs.kernels
    launch_start = dict(zip(rs.launches.column("correlation_id").to_pylist(), rs.launches.column("start_ns").to_pylist()))
    starts = k.column("start_ns").to_pylist()
    ends = k.column("end_ns").to_pylist()
    corr = k.column("correlation_id").to_pylist()
    assert all(launch_start[c] <= s <= e for c, s, e in zip(corr, starts, ends))
    first, last = pc.min(rs.steps.column("start_ns")).as_py(), pc.max(rs.steps.column("end_ns")).as_py()
    assert first <= min(starts) and max(ends) <= last + 10**9


def test_gemm_and_attention_flops_match_torch_flop_counter_formulas(replay):
    from torch.utils.flop_counter import mm_flop, sdpa_backward_flop_count, sdpa_flop_count

    workload, _, table = replay
    ops = table.filter(pc.and_(pc.equal(table.column("plasmient.level"), "op"), pc.equal(table.column("plasmient.step"), 1)))
    flops = Counter()
    for r in ops.select(["name", "plasmient.flops.self"]).to_pylist():
        flops[r["name"]] += r["plasmient.flops.self"] or 0
    if workload == "decode_gemm":
        # 8 tokens x 4 layers of (1, 2048) @ (2048, 2048), then one 4096^3 GEMM
        assert flops["aten::mm"] == 8 * 4 * mm_flop((1, 2048), (2048, 2048)) + mm_flop((4096, 4096), (4096, 4096))
        return
    # the tiny transformer: 2 layers, batch 16, 4 heads of 64, sequence 64 (query, key, value alike); in fp32
    # the efficient-attention kernels run it, under bf16 autocast cuDNN's
    q = (16, 4, 64, 64)
    attention = "_cudnn_attention" if workload == "bf16_autocast" else "_efficient_attention"
    assert flops[f"aten::{attention}_forward"] == 2 * sdpa_flop_count(q, q, q)
    assert flops[f"aten::{attention}_backward"] == 2 * sdpa_backward_flop_count(q, q, q, q)
    assert flops["aten::mm"] == 7_784_628_224  # as in fp32: FlopCounterMode's count, checked below
    step = table.filter(pc.and_(pc.equal(table.column("plasmient.level"), "step"), pc.equal(table.column("plasmient.step"), 1)))
    assert step.column("plasmient.flops").to_pylist()[0] == pytest.approx(sum(flops.values()))


def test_the_tiny_transformers_matmul_flops_equal_flop_counter_mode_on_the_same_model():
    """FlopCounterMode counts the same model's training step on this CPU: its aten.mm total equals what
    the H200 recording measured (addmm differs only by the bias adds we count and it does not)."""
    import sys

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import train_tiny_transformer as tt

    model, opt, data = tt.build(dim=256, layers=2, batch=16, seed=0)
    with FlopCounterMode(display=False) as counter:
        logits = model(data[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), data[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    counts = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    table = stitch_records([records("tiny_transformer")], IngestOptions(job_id="h200")).batch.table
    ops = table.filter(pc.and_(pc.equal(table.column("plasmient.level"), "op"), pc.equal(table.column("plasmient.step"), 1)))
    mine = Counter()
    for r in ops.select(["name", "plasmient.flops.self"]).to_pylist():
        mine[r["name"]] += r["plasmient.flops.self"] or 0
    assert mine["aten::mm"] == counts["aten.mm"]
    assert counts["aten.addmm"] < mine["aten::addmm"] <= counts["aten.addmm"] * 1.002


def test_copies_and_memsets_keep_the_sizes_torch_profiler_recorded(replay):
    """The sizes read from CUPTI's memcpy/memset records are the spans' bytes: per step, the (name, bytes) of
    every copy and memset equal those of torch.profiler's gpu_memcpy/gpu_memset events of the same steps."""
    workload, _, table = replay
    prof = profiler_counts(workload, ("gpu_memcpy", "gpu_memset"), lambda e, _: (e["name"], e["args"]["bytes"]))
    rows = table.select(["name", "plasmient.level", "plasmient.step", "plasmient.bytes"]).to_pylist()
    live: dict[int, Counter] = {}
    for r in rows:
        if r["plasmient.level"] == "kernel" and r["name"].startswith(("Memcpy", "Memset")):
            live.setdefault(r["plasmient.step"], Counter())[(r["name"], r["plasmient.bytes"])] += 1
    assert sum(len(c) for c in prof) > 0 or workload == "decode_gemm"  # its steps copy nothing
    assert [live.get(s, Counter()) for s in sorted(set(r["plasmient.step"] for r in rows if r["plasmient.level"] == "step"))] == prof
