"""The stitcher on every real trace of ../shared/traces, checked against the raw JSON read independently."""

from __future__ import annotations

from collections import Counter, defaultdict
from functools import lru_cache

import numpy as np
import pytest

from conftest import ALL_TRACES, ingested, raw_trace, union_ns

RUNTIME_CATS = {"cuda_runtime", "Runtime", "cuda_driver"}
KERNEL_CATS = {"kernel", "Kernel", "gpu_memcpy", "Memcpy", "gpu_memset", "Memset"}
OP_CATS = {"cpu_op", "Operator", "user_annotation"}


@lru_cache(maxsize=None)
def _rows(name: str, max_spans: int | None) -> tuple[dict, ...]:
    return tuple(ingested(name, max_spans).batch.table.to_pylist())


def spans(name: str, max_spans: int | None = None) -> tuple[dict, ...]:
    return _rows(name, max_spans)


def by_id(rows: list[dict]) -> dict[tuple[bytes, int], dict]:
    return {(r["trace_id"], r["span_id"]): r for r in rows}


def ext_of(args: dict):
    return args.get("External id", args.get("external id"))


def profiler_steps(doc: dict) -> set[int]:
    out = set()
    for e in doc["traceEvents"]:
        name = e.get("name", "")
        if e.get("ph") == "X" and e.get("cat") in OP_CATS and name.startswith("ProfilerStep#") and name[13:].isdigit():
            out.add(int(name[13:]))
    return out


@pytest.mark.parametrize("name", ALL_TRACES)
def test_one_trace_per_step(name):
    doc = raw_trace(name)
    steps = profiler_steps(doc) or {0}
    rows = spans(name)
    assert {r["trace_id"] for r in rows}.__len__() == len(steps)
    step_rows = [r for r in rows if r["plasmient.level"] == "step"]
    assert sorted(r["plasmient.step"] for r in step_rows) == sorted(steps)
    # exactly one fleet root per trace, and every other span's parent exists in the same trace
    index = by_id(rows)
    roots = Counter(r["trace_id"] for r in rows if r["parent_span_id"] == 0)
    assert set(roots.values()) == {1}
    for r in rows:
        if r["parent_span_id"]:
            assert (r["trace_id"], r["parent_span_id"]) in index, r["name"]


LEVEL_ORDER = ["fleet", "node", "rank", "step", "module", "op", "kernel"]


@pytest.mark.parametrize("name", ALL_TRACES)
def test_tree_levels_nest_in_design_order(name):
    rows = spans(name)
    index = by_id(rows)
    for r in rows:
        if not r["parent_span_id"]:
            assert r["plasmient.level"] == "fleet"
            continue
        parent = index[(r["trace_id"], r["parent_span_id"])]
        child_level, parent_level = LEVEL_ORDER.index(r["plasmient.level"]), LEVEL_ORDER.index(parent["plasmient.level"])
        if r["plasmient.level"] == "module" and r["name"].endswith(" [recompute]") and parent["plasmient.level"] == "op":
            assert "Backward" in parent["name"]  # a recomputed forward hangs under the backward op that re-ran it
        elif r["plasmient.level"] in ("module", "op"):
            assert parent_level <= child_level  # modules and ops nest among themselves
            assert parent["plasmient.level"] in ("step", "module", "op")
        else:
            assert parent_level < child_level
        # a parent's window covers its child's
        assert parent["start_ns"] <= r["start_ns"] and r["end_ns"] <= parent["end_ns"]


@pytest.mark.parametrize("name", [n for n in ALL_TRACES if "cpu_only" not in n])
def test_kernel_parent_is_the_op_named_by_the_launch(name):
    doc = raw_trace(name)
    events = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    launches = {e["args"]["correlation"]: e for e in events if e.get("cat") in RUNTIME_CATS and "correlation" in e.get("args", {})}
    ops = [e for e in events if e.get("cat") in OP_CATS and not e["name"].startswith("ProfilerStep#")]
    ops_by_ext = defaultdict(list)
    for e in ops:
        if ext_of(e.get("args", {})) is not None:
            ops_by_ext[ext_of(e["args"])].append(e)
    rows = spans(name)
    index = by_id(rows)
    checked_ext = checked_interval = 0
    for r in rows:
        if r["plasmient.level"] != "kernel":
            continue
        corr = r["plasmient.correlation_id"]
        assert corr is not None
        launch = launches.get(corr)
        parent = index[(r["trace_id"], r["parent_span_id"])]
        if launch is None:
            continue
        ext = ext_of(launch["args"])
        candidates = [o for o in ops_by_ext.get(ext, []) if o.get("tid") == launch.get("tid")
                      and o["ts"] - 1 <= launch["ts"] <= o["ts"] + o["dur"] + 1]
        if candidates:
            assert parent["plasmient.level"] == "op"
            assert parent["plasmient.op.external_id"] == ext
            assert parent["name"] in {c["name"] for c in candidates}
            checked_ext += 1
        elif parent["plasmient.level"] == "op" and checked_interval < 300:  # the scan is O(ops): sample
            # External id absent or not an op (CUDA-graph traces copy the correlation id there):
            # the innermost op on the launching thread containing the launch.
            containing = [o for o in ops if o.get("tid") == launch.get("tid") and o["ts"] <= launch["ts"] <= o["ts"] + o["dur"]]
            assert containing, r["name"]
            shortest = min(o["dur"] for o in containing)
            innermost = {o["name"] for o in containing if o["dur"] == shortest}  # identical intervals tie
            assert parent["name"] in innermost
            assert parent["plasmient.op.cpu_s"] == pytest.approx(shortest / 1e6, abs=2e-6)
            checked_interval += 1
    assert checked_ext + checked_interval > 0


@pytest.mark.parametrize("name", ALL_TRACES)
def test_every_kernel_is_kept_and_unjoined_ones_are_counted(name):
    doc = raw_trace(name)
    n_gpu = sum(1 for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("cat") in KERNEL_CATS)
    result = ingested(name)
    rows = result.batch.table.to_pylist()
    kernels = [r for r in rows if r["plasmient.level"] == "kernel"]
    outside = result.stats["kernels_outside_steps"]
    # folded counts are inclusive: the step's is every kernel of the step that is not a span
    folded = sum(r["plasmient.kernels.folded"] or 0 for r in rows if r["plasmient.level"] == "step")
    assert len(kernels) + folded + outside == n_gpu
    first_steps = [r for r in rows if r["plasmient.level"] == "step" and r["plasmient.kernels.outside_steps"] is not None]
    assert len(first_steps) == 1 and first_steps[0]["plasmient.kernels.outside_steps"] == outside
    index = by_id(rows)
    direct = Counter((k["trace_id"], k["parent_span_id"]) for k in kernels)
    for step in (r for r in rows if r["plasmient.level"] == "step"):
        assert step["plasmient.unjoined_kernels"] == direct[(step["trace_id"], step["span_id"])]
    assert all(index[(k["trace_id"], k["parent_span_id"])]["plasmient.level"] in ("op", "step") for k in kernels)


def children_of(rows):
    kids = defaultdict(list)
    for r in rows:
        kids[(r["trace_id"], r["parent_span_id"])].append(r)
    return kids


@pytest.mark.parametrize("name", ALL_TRACES)
def test_flops_are_conserved_up_the_tree(name):
    rows = spans(name)
    kids = children_of(rows)
    checked = 0
    for r in rows:
        children = kids.get((r["trace_id"], r["span_id"]), [])
        if not children and r["plasmient.level"] == "kernel":
            continue
        if r["plasmient.device.window_s"] is None:  # launched nothing: no device metrics at all
            assert r["plasmient.flops"] is None and all(c["plasmient.flops"] is None for c in children)
            continue
        # folded flops are inclusive: what folds directly into r is its folded minus its children's
        direct_fold = (r["plasmient.kernels.folded_flops"] or 0) - sum(c["plasmient.kernels.folded_flops"] or 0 for c in children)
        if r["plasmient.level"] in ("fleet", "node"):
            direct_fold = 0
        total = sum(c["plasmient.flops"] or 0 for c in children) + direct_fold  # an absent child's are unknown
        if r["plasmient.flops"] is None:
            # unknown, not 0: no known FLOPs under it, beside busy time of unknown work
            assert total == 0 and r["plasmient.flops.coverage"] < 1 - 1e-9, (r["plasmient.level"], r["name"])
            checked += 1
            continue
        assert r["plasmient.flops"] == pytest.approx(total, rel=1e-9, abs=1e-3), (r["plasmient.level"], r["name"])
        checked += 1
    assert checked


METRICS = ["plasmient.busy_s", "plasmient.util.resident", "plasmient.idle_fraction",
           "plasmient.bound", "plasmient.wall_s", "plasmient.gpus", "plasmient.device.window_s"]
DEVICE_METRICS = ["plasmient.flops", "plasmient.busy_s", "plasmient.util.resident", "plasmient.mfu", "plasmient.bound",
                  "plasmient.wasted_s", "plasmient.cost.usd", "plasmient.gpus"]


@pytest.mark.parametrize("name", ALL_TRACES)
def test_every_span_has_the_metrics_in_range(name):
    result = ingested(name)
    rows = result.batch.table.to_pylist()
    known = not result.stats["unknown_devices"]
    for r in rows:
        if r["plasmient.device.window_s"] is None:
            # a span that launched nothing has no device metrics at all, not zeros
            assert r["plasmient.level"] in ("module", "op"), r["name"]
            assert all(r[key] is None for key in DEVICE_METRICS), r["name"]
            continue
        # a window of zero length (a kernel under the trace's clock resolution) has no utilisation: 0/0
        zero_window = r["plasmient.device.window_s"] == 0
        for key in METRICS:
            if zero_window and key in ("plasmient.util.resident", "plasmient.idle_fraction"):
                assert r[key] is None, (key, r["name"])
                continue
            assert r[key] is not None, (key, r["name"])
        util, mfu = r["plasmient.util.resident"], r["plasmient.mfu"]
        assert zero_window or 0.0 <= util <= 1.0
        assert zero_window or r["plasmient.idle_fraction"] == pytest.approx(1 - util)
        assert r["plasmient.bound"] in ("compute", "memory", "latency", "communication", "idle", "unknown")
        coverage = r["plasmient.flops.coverage"]
        partial = coverage is not None and coverage < 1 - 1e-9
        # a number, or absent because it would be a 0 that says nothing; a known zero stays 0
        assert r["plasmient.flops"] is not None and r["plasmient.flops"] >= 0 or partial, r["name"]
        assert r["plasmient.flops"] is None or r["plasmient.flops"] > 0 or not partial, r["name"]
        # bytes have a coverage of their own (a collective's or a join's are unknown): absent, or a number
        assert r["plasmient.bytes"] is None or r["plasmient.bytes"] >= 0
        if r["plasmient.flops"] is None:
            assert r["plasmient.ideal_s"] is None
        executed = (r["plasmient.flops"] or 0) + (r["plasmient.flops.recompute"] or 0)
        bound_of_zero = executed == 0 and partial  # no measurement
        if known and coverage:
            assert r["plasmient.wasted_s"] is not None and r["plasmient.wasted_s"] >= 0
            # a part without a public list price (MI250) has no cost, never a made-up one
            priced = "mi250/" not in name
            assert (r["plasmient.cost.usd"] is not None and r["plasmient.cost.usd"] >= 0) == priced, r["name"]
            assert not priced or 0 <= r["plasmient.cost.wasted_usd"] <= r["plasmient.cost.usd"] + 1e-15
        if known and coverage and not bound_of_zero:
            assert mfu is not None and 0.0 <= mfu <= util + 1e-12, (r["name"], mfu, util)
            if r["plasmient.busy_s"] > 0:
                assert 0.0 <= r["plasmient.stall_fraction"] <= 1.0
        else:
            assert mfu is None and r["plasmient.stall_fraction"] is None  # no invented MFU, no bound of 0 as one
        if not coverage:
            assert mfu is None  # nothing measured is never MFU 0
        if (r["plasmient.bytes"] or 0) > 0 and coverage and not bound_of_zero:
            hardware_flops = r["plasmient.flops"] + (r["plasmient.flops.recompute"] or 0)  # the roofline is about executed work
            assert r["plasmient.arithmetic_intensity"] == pytest.approx(hardware_flops / r["plasmient.bytes"])
        if r["plasmient.level"] in ("step", "rank", "node", "fleet") and r["plasmient.kernels"]:
            assert r["plasmient.culprit.kernel"] and r["plasmient.culprit.suggestion"]


def _shared_seconds(kernels: list[tuple[int, int, object]]) -> dict[object, float]:
    """Oracle: each kernel's share of its device when the kernels resident at an instant split it equally,
    by a sweep over the segments between kernel boundaries (kernels as (start ns, end ns, key))."""
    bounds = sorted({t for s, e, _ in kernels for t in (s, e)})
    starts = sorted(kernels)
    share: dict[object, float] = {}
    active: list[tuple[int, int, object]] = []
    i = 0
    for lo, hi in zip(bounds, bounds[1:]):
        while i < len(starts) and starts[i][0] <= lo:
            active.append(starts[i])
            i += 1
        active = [k for k in active if k[1] > lo]
        for _, _, key in active:
            share[key] = share.get(key, 0.0) + (hi - lo) / len(active) / 1e9
    return share


@pytest.mark.parametrize("name", ALL_TRACES)
def test_busy_time_is_the_shared_time_of_the_steps_kernels(name):
    """A step's busy seconds are its kernels' shares of the device inside the rank's device time (concurrent
    kernels split each instant, whichever step they belong to), and its resident utilization is the union of every kernel of the rank
    inside its window: where no other step's kernel overlaps, both are the union of its own kernels."""
    rows = spans(name)
    steps = [r for r in rows if r["plasmient.level"] == "step"]
    if any(s["plasmient.kernels.folded"] or s["plasmient.gpus"] != 1 for s in steps):
        return
    # the rank's device time runs from its first window's start to its last one's end: a kernel that started
    # before the first step (and ran into it) is its step's work from there on
    first = min(s["plasmient.device.start_ns"] for s in steps)
    last = max(s["plasmient.device.start_ns"] + round(s["plasmient.device.window_s"] * 1e9) for s in steps)
    kernels = [(max(k["start_ns"], first), min(k["end_ns"], last), (k["trace_id"], k["span_id"])) for k in rows
               if k["plasmient.level"] == "kernel" and min(k["end_ns"], last) > max(k["start_ns"], first)]
    if not kernels:
        return
    share = _shared_seconds(kernels)
    for step in steps:
        lo = step["plasmient.device.start_ns"]
        hi = lo + round(step["plasmient.device.window_s"] * 1e9)
        own = [k for k in kernels if k[2][0] == step["trace_id"]]
        assert step["plasmient.busy_s"] == pytest.approx(sum(share.get(k[2], 0.0) for k in own), rel=1e-6, abs=2e-9)
        resident = union_ns([(min(max(s, lo), hi), min(max(e, lo), hi)) for s, e, _ in kernels])
        assert step["plasmient.util.resident"] == pytest.approx(resident / 1e9 / step["plasmient.device.window_s"], rel=1e-6)


def _dims(op_row):
    import json

    return json.loads(op_row["plasmient.op.input_dims"])


@pytest.mark.parametrize("name", [n for n in ALL_TRACES if "cpu_only" not in n])
def test_gemm_flops_are_2mnk_from_the_recorded_shapes(name):
    rows = spans(name)
    checked = 0
    for r in rows:
        if r["plasmient.level"] != "op" or not r["plasmient.op.input_dims"]:
            continue
        dims = _dims(r)
        if r["name"] == "aten::mm" and len(dims) >= 2 and len(dims[0]) == 2 and len(dims[1]) == 2:
            (m, k), (_, n) = dims[0], dims[1]
            assert r["plasmient.op.model_flops"] == 2 * m * n * k
            checked += 1
        elif r["name"] == "aten::addmm" and len(dims) >= 3 and len(dims[1]) == 2 and len(dims[2]) == 2:
            (m, k), (_, n) = dims[1], dims[2]
            assert 2 * m * n * k <= r["plasmient.op.model_flops"] <= 2 * m * n * k + 2 * m * n
            checked += 1
        elif r["name"] == "aten::bmm" and len(dims) >= 2 and len(dims[0]) == 3:
            (b, m, k), (_, _, n) = dims[0], dims[1]
            assert r["plasmient.op.model_flops"] == 2 * b * m * n * k
            checked += 1
    if name.split("/")[0] in ("h100", "b200", "v100", "mi300x"):
        assert checked > 0, "these traces record GEMM shapes"


def test_kernel_flops_come_from_the_op_that_launched_them():
    rows = spans("h100/bert_small_inference.json.gz")
    kids = children_of(rows)
    gemm_ops = [r for r in rows if r["plasmient.level"] == "op" and r["name"] in ("aten::addmm", "aten::mm") and r["plasmient.op.model_flops"]]
    assert gemm_ops
    for op in gemm_ops:
        kernels = [k for k in kids[(op["trace_id"], op["span_id"])] if k["plasmient.level"] == "kernel"]
        if kernels:
            assert sum(k["plasmient.flops"] for k in kernels) == pytest.approx(op["plasmient.op.model_flops"])
            assert op["plasmient.flops"] == pytest.approx(op["plasmient.op.model_flops"])


def test_backward_ops_are_parented_under_backward_module_spans():
    name = "mi300x/resnet_act_checkpoint_rank0_of8.json.gz"
    rows = spans(name)
    index = by_id(rows)
    bwd_modules = [r for r in rows if r["plasmient.level"] == "module" and r["plasmient.module.phase"] == "backward"]
    assert bwd_modules
    fwd_paths = {r["plasmient.module.path"] for r in rows if r["plasmient.level"] == "module" and r["plasmient.module.phase"] == "forward"}
    for m in bwd_modules:
        assert m["plasmient.module.path"] in fwd_paths
    # backward ops found under them are autograd ops, and their sequence number is a forward op's under the same path
    fwd_seq_path = {}
    for r in rows:
        if r["plasmient.level"] == "op" and r["plasmient.op.sequence_number"] is not None:
            anc = r
            while anc["plasmient.level"] == "op":
                anc = index[(anc["trace_id"], anc["parent_span_id"])]
            if anc["plasmient.level"] == "module" and anc["plasmient.module.phase"] == "forward":
                fwd_seq_path.setdefault((r["trace_id"], r["plasmient.op.sequence_number"]), set()).add(anc["plasmient.module.path"])
    checked = 0
    for r in rows:
        if r["plasmient.level"] != "op":
            continue
        parent = index[(r["trace_id"], r["parent_span_id"])]
        if parent["plasmient.level"] == "module" and parent["plasmient.module.phase"] == "backward":
            assert "Backward" in r["name"] or r["name"].startswith("autograd::")
            if r["name"].endswith("AccumulateGrad"):
                continue  # no sequence number: it follows its gradient's producer (test_recompute.py)
            paths = fwd_seq_path.get((r["trace_id"], r["plasmient.op.sequence_number"]), set())
            assert any(p == parent["plasmient.module.path"] or p.startswith(parent["plasmient.module.path"] + ".") for p in paths)
            checked += 1
    assert checked > 10


def test_unknown_gpu_is_reported_and_gets_no_mfu():
    result = ingested("a100_multirank/rank-0.json.gz")  # deviceProperties is empty in this file
    assert result.stats["unknown_devices"]
    rows = result.batch.table.to_pylist()
    assert all(r["plasmient.mfu"] is None for r in rows)
    rank = next(r for r in rows if r["plasmient.level"] == "rank")
    assert rank["plasmient.peak.source"] == "unknown"


def test_known_gpus_are_matched_from_device_properties():
    expect = {"h100/bert_small_inference.json.gz": "H100", "b200/eager_rank0_of8.json.gz": "B200",
              "a100/alexnet.json.gz": "A100", "v100/resnet50_training.json.gz": "V100",
              "mi300x/resnet_act_checkpoint_rank0_of8.json.gz": "MI300X", "mi250/minitoy_train.json.gz": "MI250"}
    for name, model in expect.items():
        batch = ingested(name).batch
        rank_res = [res for res in batch.resources if "plasmient.rank" in res]
        assert model in rank_res[0]["plasmient.gpu.model"], (name, rank_res[0])


def test_resource_attributes_follow_semantic_conventions():
    batch = ingested("b200/eager_rank0_of8.json.gz").batch
    rank_res = next(res for res in batch.resources if "plasmient.rank" in res)
    assert rank_res["service.name"] == "plasmient-trace"
    assert rank_res["plasmient.job.id"] == "test-job"
    assert rank_res["plasmient.rank"] == 0 and rank_res["plasmient.world_size"] == 8
    assert rank_res["process.pid"] == 6583
    assert rank_res["plasmient.distributed.backend"] == "nccl"
    assert "host.name" in rank_res
    used = set(batch.table.column("resource_index").to_pylist())
    assert used <= set(range(len(batch.resources)))


@pytest.mark.parametrize("name", ["a100/cuda_graphs_rank0_of16.json.gz", "h100/qwen1.5_0.5b_chat_inference.json.gz"])
def test_ids_are_deterministic(name):
    from plasmient_trace.pipeline import IngestOptions, ingest_paths
    from conftest import trace_path

    a = ingest_paths([trace_path(name)], IngestOptions(job_id="again")).batch.table
    b = ingest_paths([trace_path(name)], IngestOptions(job_id="again")).batch.table
    assert a.column("trace_id").equals(b.column("trace_id"))
    assert a.column("span_id").equals(b.column("span_id"))
    assert a.column("parent_span_id").equals(b.column("parent_span_id"))
    span_ids = a.column("span_id").to_numpy()
    assert len(np.unique(span_ids)) == len(span_ids) and (span_ids != 0).all()
    import hashlib

    steps = sorted(set(a.column("plasmient.step").to_pylist()))
    expected = {hashlib.sha256(f"plasmient/v1/again/{s}".encode()).digest()[:16] for s in steps}
    assert set(a.column("trace_id").to_pylist()) == expected


def test_cpu_only_trace_is_handled():
    result = ingested("cpu_only/rank-34.json.gz")
    rows = result.batch.table.to_pylist()
    assert {r["plasmient.level"] for r in rows} >= {"fleet", "node", "rank", "step", "op"}
    rank = next(r for r in rows if r["plasmient.level"] == "rank")
    assert rank["plasmient.device.type"] == "cpu"
    assert all(r["plasmient.mfu"] is None for r in rows)  # no peak known for a foreign CPU


def test_two_ranks_of_one_job_become_one_trace_per_step_with_node_and_fleet():
    from plasmient_trace.pipeline import IngestOptions, ingest_paths
    from conftest import trace_path

    files = [trace_path("a100_multirank/rank-0.json.gz"), trace_path("a100_multirank/rank-1.json.gz")]
    result = ingest_paths(files, IngestOptions(job_id="multi", gpu_model="NVIDIA A100-SXM4-80GB"))
    rows = result.batch.table.to_pylist()
    steps0 = profiler_steps(raw_trace("a100_multirank/rank-0.json.gz"))
    assert len({r["trace_id"] for r in rows}) == len(steps0)
    for trace in {r["trace_id"] for r in rows}:
        levels = Counter(r["plasmient.level"] for r in rows if r["trace_id"] == trace)
        assert levels["fleet"] == 1 and levels["node"] == 1 and levels["rank"] == 2 and levels["step"] == 2
        fleet = next(r for r in rows if r["trace_id"] == trace and r["plasmient.level"] == "fleet")
        ranks = [r for r in rows if r["trace_id"] == trace and r["plasmient.level"] == "rank"]
        assert sorted(r["plasmient.rank"] for r in ranks) == [0, 1]
        assert fleet["plasmient.gpus"] == 2
        assert fleet["plasmient.flops"] == pytest.approx(sum(r["plasmient.flops"] for r in ranks))
        assert fleet["plasmient.busy_s"] == pytest.approx(sum(r["plasmient.busy_s"] for r in ranks))
        assert fleet["plasmient.culprit.rank"] in (0, 1)
        assert 0 <= fleet["plasmient.mfu"] <= fleet["plasmient.util.resident"] <= 1
    assert set(result.stats["clock_offsets_ns"]) == {0, 1}


@pytest.mark.parametrize("name", ["a100/nccl_training_rank0_of2.json.gz", "mi300x/resnet_act_checkpoint_rank0_of8.json.gz",
                                  "h100/vit_image_classification.json.gz"])
def test_no_kernel_starts_before_its_launch(name):
    result = ingested(name)
    joined = result.joined[0]
    records = result.records[0]
    launch_start = records.launches.column("start_ns").to_numpy()
    has = joined.kernel_launch >= 0
    assert has.any()
    assert (joined.kernel_start[has] >= launch_start[joined.kernel_launch[has]]).all()
    rank = next(r for r in result.batch.table.to_pylist() if r["plasmient.level"] == "rank")
    assert rank["plasmient.clock.offset_ns"] >= 0
