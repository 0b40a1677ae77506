"""A culprit's suggestion names the kind of memory-bound work its kernel and op names show, in a fixed order
(attention, then GEMM, then convolution, then elementwise), and only for memory-bound rows."""

from __future__ import annotations

import json

import pyarrow.compute as pc

import pytest

from plasmient_trace.metrics.culprit import suggestion


@pytest.mark.parametrize(("kernel", "op", "words"), [
    ("flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4>>", "aten::_flash_attention_forward", "attention"),
    ("ampere_sgemm_128x64_tn", "aten::addmm", "GEMM"),
    # an implicit-GEMM convolution is a convolution (its advice: channels_last, bf16), whatever GEMM it says:
    # MIOpen's igemm kernels were told to "raise batch x sequence"
    ("implicit_convolve_sgemm", "aten::cudnn_convolution", "convolution"),
    ("igemm_fwd_gtcx35_nhwc_fp32_bx0_ex1_bt64x64x16", "aten::miopen_convolution", "convolution"),
    # Tensile/hipBLASLt GEMMs by their kernel name alone (a graph replay without its capture has no op)
    ("Cijk_Ailk_Bljk_SB_MT64x64x16_MI16x16x4x1", "", "GEMM"),
    ("cudnn::winograd::generateWinogradTilesKernel", "aten::cudnn_convolution", "convolution"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "aten::add", "elementwise"),
    ("some_custom_kernel", "my::op", "raise arithmetic intensity"),
    ("aten::gelu_backward", "aten::gelu_backward", "elementwise"),  # a CPU run: the op is its own kernel
    ("aten::sqrt", "aten::sqrt", "elementwise"),
])
def test_memory_bound_work_is_named_by_its_first_matching_family(kernel: str, op: str, words: str) -> None:
    for _ in range(2):  # the second call is answered from the per-name cache
        assert words in suggestion(kernel, op, "model.layer", "memory", "kernel")


def test_a_compute_bound_gemm_gets_compute_advice_not_the_memory_family() -> None:
    text = suggestion("ampere_sgemm_128x64_tn", "aten::addmm", None, "compute", "kernel")
    assert text.startswith("compute-bound") and "GEMM" not in text


# --- An unknown bound says what it lacks, from the trace's own evidence (read here from the raw JSON) ---

RUNTIME_CATS = {"cuda_runtime", "cuda_driver", "hip_runtime", "hip_driver", "Runtime", "Driver"}


def _all_rows(batch) -> list[dict]:
    """The culprit rows of every span that carries a culprit list."""
    return [r for t in batch.table.column("plasmient.culprits").drop_null().to_pylist() for r in json.loads(t)]


def _unknown_rows(name: str) -> list[dict]:
    """The culprit rows with an unknown bound."""
    from conftest import ingested

    return [r for r in _all_rows(ingested(name).batch) if r["bound"] == "unknown"]


def _raw_ops(name: str) -> list[dict]:
    from conftest import raw_trace

    return [e for e in raw_trace(name)["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")]


@pytest.mark.parametrize("name", ["h100/qwen1.5_0.5b_chat_inference.json.gz", "mi300x/resnet_act_checkpoint_rank0_of8.json.gz"])
def test_a_kernel_with_no_launch_record_is_said_to_lack_one_not_shapes(name: str) -> None:
    from conftest import raw_trace

    events = raw_trace(name)["traceEvents"]
    launched = {e["args"].get("correlation") for e in events if e.get("cat") in RUNTIME_CATS and "args" in e}
    kernels = [e for e in events if e.get("cat") == "kernel"]
    no_launch = {e["name"] for e in kernels if e["args"].get("correlation") not in launched}
    assert no_launch, "the trace has kernels whose launch it did not record"
    rows = [r for r in _unknown_rows(name) if r["op"] is None]
    assert rows
    for r in rows:
        assert r["suggestion"].startswith("no launch record joins this kernel to an op"), r
        assert "record_shapes" not in r["suggestion"]
        assert any(k.startswith(r["kernel"].split("…")[0]) for k in no_launch), r["kernel"]
    assert not [r for r in _unknown_rows(name) if r["op"] is not None and "no launch record" in r["suggestion"]]


def test_ops_recorded_without_shapes_are_told_to_record_them() -> None:
    name = "a100/alexnet.json.gz"
    assert not [e for e in _raw_ops(name) if e.get("args", {}).get("Input Dims")], "no op of this trace has shapes"
    rows = _unknown_rows(name)
    assert {r["op"] for r in rows} >= {"aten::addmm", "aten::cudnn_convolution"}
    for r in rows:
        assert r["suggestion"].startswith(f"{r['op']} was recorded without input shapes"), r
        assert "record_shapes=True" in r["suggestion"]


def test_an_op_without_shapes_in_a_trace_that_recorded_them_lacks_a_formula() -> None:
    """Optimizer.step#FusedAdam.step is an annotation: recording shapes would not give it any."""
    name = "a100/cuda_graphs_rank0_of16.json.gz"
    ops = _raw_ops(name)
    assert any(e.get("args", {}).get("Input Dims") for e in ops)
    assert not [e for e in ops if e["name"].startswith("Optimizer.step#") and e.get("args", {}).get("Input Dims")]
    rows = [r for r in _unknown_rows(name) if (r["op"] or "").startswith("Optimizer.step#")]
    assert rows
    for r in rows:
        assert r["suggestion"].startswith(f"no FLOP formula for {r['op']}"), r
        assert "record_shapes" not in r["suggestion"]


def test_a_kernel_replayed_from_a_graph_whose_capture_is_missing_asks_for_the_capture() -> None:
    """cuda_graphs replays torch.compile graphs with cudaGraphLaunch inside CompiledFunction(Backward): that op only
    launched the graph, so no formula of its own would help; the capture holds the ops the kernels ran."""
    from conftest import raw_trace

    name = "a100/cuda_graphs_rank0_of16.json.gz"
    events = raw_trace(name)["traceEvents"]
    launch = {e["args"].get("correlation"): e["name"] for e in events if e.get("cat") in RUNTIME_CATS and "args" in e}
    by_launch: dict[str, set[str]] = {}
    for e in events:
        if e.get("cat") == "kernel":
            by_launch.setdefault(e["name"], set()).add(launch.get(e["args"].get("correlation")))
    # launched by graph replays only (a few kernels of the trace have no launch record at all)
    replayed_only = {k for k, how in by_launch.items() if "cudaGraphLaunch" in how and how <= {"cudaGraphLaunch", None}}
    assert replayed_only
    rows = [r for r in _unknown_rows(name) if r["op"] is not None and r["kernel"] in replayed_only]
    assert {r["op"] for r in rows} >= {"CompiledFunctionBackward"}
    for r in rows:
        assert r["suggestion"].startswith(f"replayed from a CUDA/HIP graph that {r['op']} launched"), r
        assert "--graph-capture" in r["suggestion"] and "register one" not in r["suggestion"]
    # kernels that a normal launch ran still lack what they lacked
    assert [r for r in _unknown_rows(name) if (r["op"] or "").startswith("Optimizer.step#")]
    # a replay paired with its capture (execution_details.json beside it) is not told to find one
    assert not [r for r in _all_rows(__import__("conftest").ingested("cc94_vllm_decode/graph_execution.json.gz").batch)
                if "--graph-capture" in (r["suggestion"] or "")]


def test_known_flops_and_bytes_on_an_unknown_device_ask_for_its_peaks() -> None:
    name = "a100_multirank/rank-0.json.gz"
    from conftest import raw_trace

    assert not raw_trace(name).get("deviceProperties"), "the trace does not say which GPU it ran on"
    mm = [e for e in _raw_ops(name) if e["name"] == "aten::mm"]
    assert all(e.get("args", {}).get("Input Dims") for e in mm), "every aten::mm has its shapes"
    rows = [r for r in _unknown_rows(name) if r["op"] == "aten::mm"]
    assert rows
    for r in rows:
        assert r["suggestion"].startswith("the device's peak FLOP/s or memory bandwidth is unknown"), r
        assert "--gpu-model" in r["suggestion"]


def test_a_cpu_whose_bandwidth_is_unknown_is_not_told_to_name_its_gpu(tmp_path) -> None:
    # A live CPU run given PLASMIENT_PEAK_TFLOPS skips the calibration that measures the CPU's bandwidth, so its
    # bounds are unknown; its culprits said "name the GPU (--gpu-model)", and a transpose that took longer than
    # 10 us "no byte count for aten::t: register a formula that returns bytes".
    from capture_helpers import sampled_live_run

    from plasmient_trace.report.cli import read_span_files

    batch = read_span_files([str(sampled_live_run(tmp_path / "cpu.jsonl", every=1, steps=3))])
    steps = batch.table.filter(pc.equal(batch.table.column("plasmient.level"), "step")).to_pylist()
    assert steps and all(s["plasmient.device.type"] == "cpu" and s["plasmient.peak_bandwidth"] is None for s in steps)
    rows = _all_rows(batch)
    assert [r for r in rows if r["bound"] == "unknown"]
    assert not [r for r in rows if "GPU" in r["suggestion"] or "gpu" in r["suggestion"]]
    peak = [r for r in rows if r["bound"] == "unknown" and r["op"] in ("aten::addmm", "aten::mm")]  # FLOPs, bytes known
    assert all(r["suggestion"].startswith("the CPU's peak FLOP/s or memory bandwidth is unknown") and
               "--bandwidth-gbs" in r["suggestion"] for r in peak)
    said = suggestion("aten::addmm", "aten::addmm", "Sequential.*", "unknown", "kernel", device_type="cpu", missing="peak")
    assert said.startswith("the CPU's peak FLOP/s or memory bandwidth is unknown, so the bound is too in Sequential.*")
    # A shape-only op (aten::t) moves and computes nothing: its time is per-op overhead however long it took,
    # never an unknown bound that asks for a byte count.
    ops = batch.table.filter(pc.equal(batch.table.column("plasmient.level"), "op")).to_pylist()
    views = [o for o in ops if o["plasmient.op.flops_model"] == "view" and o["plasmient.busy_s"]]
    assert {o["name"] for o in views} >= {"aten::t"}
    assert all(o["plasmient.bound"] == "latency" for o in views)
    assert not [r for r in _all_rows(batch) if r["op"] == "aten::t" and r["bound"] != "latency"]


def test_every_unknown_bound_on_every_shared_trace_names_what_it_lacks() -> None:
    from conftest import ALL_TRACES

    generic = suggestion(None, None, None, "unknown", "kernel")
    for name in ALL_TRACES:
        for r in _unknown_rows(name):
            assert r["suggestion"] != generic, (name, r)


@pytest.mark.parametrize(("missing", "words"), [
    ("launch", "no launch record"), ("op", "inside no op"), ("shapes", "record_shapes=True"),
    ("formula", "register one"), ("bytes", "returns bytes"), ("peak", "--peak-tflops"), ("graph", "--graph-capture"),
    (None, "no FLOP model"),
])
def test_each_missing_piece_of_evidence_has_its_own_advice(missing: str | None, words: str) -> None:
    assert words in suggestion("k", "my::op", "model.block", "unknown", "kernel", missing=missing)


def test_a_softmax_is_attention_only_inside_an_attention_module() -> None:
    """A loss's log_softmax is elementwise work; the softmax of an unfused attention is attention."""
    loss = suggestion("aten::_log_softmax_backward_data", "aten::_log_softmax_backward_data", None, "memory", "kernel")
    assert "elementwise" in loss and "attention" not in loss
    attn = suggestion("softmax_warp_forward", "aten::_softmax", "Bert.encoder.layer.*.attention.self", "memory", "kernel")
    assert attn.startswith("memory-bound attention")


def test_cpu_attention_advice_names_no_gpu_kernel() -> None:
    text = suggestion("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::scaled_dot_product_attention",
                      "TinyLM.layers.*.attn", "memory", "kernel", device_type="cpu")
    assert text.startswith("memory-bound attention") and "flash-decoding" not in text and "paged" not in text


def test_a_cpu_run_counts_its_gap_in_cpu_hours() -> None:
    from plasmient_trace.report.summary import fmt_gpu_hours

    assert fmt_gpu_hours(2.5e-6, "CPU") == "2.50e-6 CPU-h" and fmt_gpu_hours(2.5e-6) == "2.50e-6 GPU-h"


def test_attention_is_called_a_decode_only_where_its_names_say_so() -> None:
    """On the H200 recordings (training: a backward pass) and every shared trace, a memory-bound attention row
    calls itself a decode only when a kernel or op name says split-KV, paged, decode or unified attention,
    and a backward pass's attention is never one."""
    import re

    from conftest import ALL_TRACES, ingested
    from plasmient_trace.pipeline import IngestOptions, stitch_records
    from test_gpu_fixtures import WORKLOADS, records

    rows = [r for w in WORKLOADS for r in _all_rows(stitch_records([records(w)], IngestOptions(job_id="g")).batch)]
    backward = [r for r in rows if r["bound"] == "memory" and "attention_backward" in (r["op"] or "")]
    assert backward, "the H200 training recordings have memory-bound attention backward rows"
    assert all("decode" not in r["suggestion"] and "backward" in r["suggestion"] for r in backward)
    for name in ALL_TRACES:
        rows += _all_rows(ingested(name).batch)
    decode = re.compile(r"splitkv|split_kv|paged|decode|unified_attention", re.I)
    for r in rows:
        if "(decode)" in r["suggestion"]:
            assert decode.search(f"{r['kernel']} {r['op']}"), r


def test_cudnn_batch_norm_is_norm_work_not_a_convolution() -> None:
    """v100/resnet50's cuDNN batch-norm kernels (bn_fw_tr_1C11…, bn_bw_1C11…: their raw names carry 'cudnn')
    are memory-bound norm work, not convolutions."""
    from conftest import ingested, raw_trace

    name = "v100/resnet50_training.json.gz"
    assert any(e.get("cat") in ("kernel", "Kernel") and e["name"].startswith("void cudnn::bn_") for e in raw_trace(name)["traceEvents"])
    rows = [r for r in _all_rows(ingested(name).batch) if "batch_norm" in (r["op"] or "") and r["bound"] == "memory"]
    assert rows
    for r in rows:
        assert "convolution" not in r["suggestion"] and "elementwise/norm" in r["suggestion"], r


def test_a_convolutions_layout_transposes_are_told_to_use_channels_last() -> None:
    """mi300x's MIOpen convolutions launch batched_transpose kernels (raw JSON) that carry a duration share of
    the convolution's FLOPs, hence 'compute'/'memory' bounds of their own: their rows name the layout fix."""
    from conftest import ingested, raw_trace

    name = "mi300x/resnet_act_checkpoint_rank0_of8.json.gz"
    assert any(e.get("cat") == "kernel" and e["name"].startswith("batched_transpose") for e in raw_trace(name)["traceEvents"])
    transposes = [r for r in _all_rows(ingested(name).batch) if (r["kernel"] or "").startswith("batched_transpose")
                  and r["bound"] in ("compute", "memory", "latency")]
    rows = [r for r in transposes if r["op"]]
    assert rows and all("convolution" in r["op"] for r in rows)
    for r in rows:
        assert r["suggestion"].startswith(f"layout transposes inside {r['op']}") and "channels_last" in r["suggestion"], r
    # a few launched outside every op (the fleet span's rows past the top ten name them) name no convolution
    assert all("layout transposes" not in r["suggestion"] for r in transposes if not r["op"])


def test_an_optimizers_per_parameter_ops_are_named_under_its_step_and_told_to_batch() -> None:
    """v100/resnet50's SGD runs one aten::add_ per parameter inside each Optimizer.step#SGD.step scope (read
    from the raw JSON): outside every module, the culprit row names that scope as its context, counts those
    calls, and advises foreach/fused."""
    from collections import Counter

    from conftest import ingested, raw_trace

    name = "v100/resnet50_training.json.gz"
    events = [e for e in raw_trace(name)["traceEvents"] if e.get("ph") == "X"]
    scopes = [e for e in events if e["name"] == "Optimizer.step#SGD.step"]
    adds = [e for e in events if e["name"] == "aten::add_" and e.get("cat") in ("Operator", "cpu_op")]
    raw_calls = Counter(sum(1 for a in adds if o["ts"] <= a["ts"] and a["ts"] + a["dur"] <= o["ts"] + o["dur"]) for o in scopes)
    assert raw_calls and min(raw_calls) > 100, raw_calls
    table = ingested(name).batch.table
    steps = [r for r in table.to_pylist() if r["plasmient.level"] == "step"]
    rows = [r for s in steps for r in json.loads(s["plasmient.culprits"]) if r["op"] == "aten::add_"
            and r["module"] == "Optimizer.step#SGD.step"]
    assert Counter(r["calls"] for r in rows) == raw_calls
    for r in rows:
        assert r["suggestion"].startswith("the optimizer's per-parameter aten::add_ in Optimizer.step#SGD.step")
        assert "foreach=True" in r["suggestion"]


def test_a_join_with_unknown_bytes_is_told_to_avoid_the_copy_not_to_register_a_formula() -> None:
    """h100/qwen's aten::cat (rotate_half in every attention layer) records a TensorList with no element type,
    so its bytes cannot be known from the trace: its row says it copies and computes nothing, and what helps."""
    cats = [e for e in _raw_ops("h100/qwen1.5_0.5b_chat_inference.json.gz") if e["name"] == "aten::cat"]
    assert cats and all(e["args"]["Input type"][0] == "TensorList" for e in cats)
    rows = [r for r in _unknown_rows("h100/qwen1.5_0.5b_chat_inference.json.gz") if r["op"] == "aten::cat"]
    assert rows
    for r in rows:
        assert "computes nothing" in r["suggestion"] and "preallocated buffer" in r["suggestion"], r
        assert "register" not in r["suggestion"]


def test_moe_experts_without_the_models_config_are_told_to_give_it() -> None:
    """The vLLM gpt-oss replay and b200/eager spend most of their device time in vllm::moe_forward, whose
    experts' sizes are in no Kineto argument (b200's raw JSON records a hidden-states tensor and the router
    logits, nothing else). Their rows say to give the model's config.json; given it, none does."""
    from conftest import trace_path
    from test_flops_moe import GPT_OSS_20B

    from plasmient_trace.metrics.flops.moe import moe_config_from_dict
    from plasmient_trace.pipeline import IngestOptions, ingest_paths

    moe = [e for e in _raw_ops("b200/eager_rank0_of8.json.gz") if e["name"] == "vllm::moe_forward"]
    assert moe and all([len(d) for d in e["args"]["Input Dims"]] == [2, 2, 0] for e in moe)
    for name in ("cc94_vllm_decode/graph_execution.json.gz", "b200/eager_rank0_of8.json.gz"):
        rows = [r for r in _unknown_rows(name) if r["op"] == "vllm::moe_forward"]
        assert rows and all("--model-config" in r["suggestion"] and "register" not in r["suggestion"] for r in rows)
    name = "cc94_vllm_decode/graph_execution.json.gz"
    given = ingest_paths([trace_path(name)], IngestOptions(job_id="moe", moe=moe_config_from_dict(GPT_OSS_20B)))
    assert not [r for r in _all_rows(given.batch) if "--model-config" in r["suggestion"]]


def test_communication_advice_follows_who_issued_the_collective() -> None:
    """mi300x/resnet trains under DDP: its gradient all-reduce in the backward pass is told about DDP's buckets.
    b200/eager serves a tensor-parallel model: its symmetric-memory all-reduce is told about tensor parallelism,
    not DDP. A collective with no such context keeps the general advice."""
    ddp = [r for r in _all_rows(ingested_batch("mi300x/resnet_act_checkpoint_rank0_of8.json.gz"))
           if r["bound"] == "communication" and (r["module"] or "").startswith("DistributedDataParallel")]
    backward = [r for r in ddp if r["module"].endswith("[backward]")]
    assert backward and all("DDP gradient all-reduce" in r["suggestion"] for r in backward)
    # its forward's small buffer broadcasts (rows past each step's top ten, on the fleet span) are told about those
    assert all("broadcast_buffers=False" in r["suggestion"] for r in ddp if r not in backward)
    tp = [r for r in _all_rows(ingested_batch("b200/eager_rank0_of8.json.gz")) if r["bound"] == "communication"
          and r["op"] == "symm_mem::multimem_all_reduce_"]
    assert tp and all("tensor-parallel" in r["suggestion"] and "DDP" not in r["suggestion"] for r in tp)
    plain = suggestion("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "nccl:all_reduce", None, "communication", "collective")
    assert plain.startswith("communication-bound: overlap collectives with compute")
    # no shared trace has these two: a DDP forward's buffer broadcast, an FSDP all-gather
    forward = suggestion("ncclDevKernel_Broadcast_RING_LL", "record_param_comms", "DistributedDataParallel_*",
                         "communication", "collective")
    assert "broadcast_buffers=False" in forward and "bucket" not in forward
    fsdp = suggestion("ncclDevKernel_AllGather_RING_LL", "nccl:_all_gather_base", "FullyShardedDataParallel_*",
                      "communication", "collective")
    assert "prefetch" in fsdp and "DDP" not in fsdp


def ingested_batch(name: str):
    from conftest import ingested

    return ingested(name).batch


def test_compute_bound_advice_names_the_next_precision_the_device_has() -> None:
    """fp32 work on a V100 is told fp16 (its tensor cores have no bf16) and by how much the peak rises; fp32
    on an A100, bf16; a bf16 kernel is never told to use bf16: fp8 where the part has fp8 units (H100),
    else a better kernel (A100)."""
    from plasmient_trace.metrics import hardware as H

    def advice(part: str, precision: str) -> str:
        spec = H.SPECS[part]
        return suggestion("volta_sgemm_128x64_nn", "aten::mm", "model.fc", "compute", "kernel",
                          precision=precision, peak=spec.peak_flops, native=frozenset(spec.peak))

    v100 = advice("V100 DGXS", "fp32")
    assert "run it in fp16" in v100 and f"({125 / 15.7:.0f}x its peak)" in v100 and "bf16" not in v100
    assert "run it in bf16" in advice("A100 SXM4 80GB", "fp32") and "(16x its peak)" in advice("A100 SXM4 80GB", "fp32")
    assert "(2x its peak)" in advice("A100 SXM4 80GB", "tf32")
    assert "fp8" in advice("H100 SXM", "bf16") and "use bf16" not in advice("H100 SXM", "bf16")
    assert "fp8" not in advice("A100 SXM4 80GB", "bf16") and "better-tuned kernel" in advice("A100 SXM4 80GB", "bf16")


def test_h100_vits_bf16_gemms_are_told_fp8_not_bf16() -> None:
    """h100/vit's compute-bound rows are its MLP GEMMs, recorded with bf16 inputs (raw JSON): already bf16,
    so the next step on an H100 is fp8."""
    from conftest import ingested, raw_trace

    name = "h100/vit_image_classification.json.gz"
    addmm_types = {tuple(e["args"]["Input type"][:3]) for e in raw_trace(name)["traceEvents"]
                   if e.get("name") == "aten::addmm" and "Input type" in e.get("args", {})}
    assert addmm_types == {("c10::BFloat16",) * 3}
    rows = [r for r in _all_rows(ingested(name).batch) if r["bound"] == "compute"]
    assert rows and all(r["op"] == "aten::addmm" for r in rows)
    assert all(" at bf16: fp8 matmuls" in r["suggestion"] and "use bf16" not in r["suggestion"] for r in rows)


def test_a_cpu_runs_dataloader_ops_are_named_under_its_fetch_and_told_to_use_workers() -> None:
    """With num_workers=0 the batch is assembled on the training thread, inside torch's
    enumerate(DataLoader)#... scope, outside every module: its ops (a TensorDataset's aten::select per sample)
    were a bare 'aten::select -> rank 0' row told to fuse them with torch.compile, which cannot help."""
    torch = pytest.importorskip("torch")
    from capture_helpers import live_capture
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(256, 32), torch.randint(0, 8, (256,))), batch_size=32)
    with live_capture(every=2, peak_tflops=0.05, job_id="loader") as (session, sink):
        for x, y in loader:
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    rows = sink.rows()
    by_id = {r["span_id"]: r for r in rows}

    def in_fetch(r: dict) -> bool:
        while r is not None and r["plasmient.level"] == "op":
            if r["name"].startswith("enumerate(DataLoader)#_SingleProcessDataLoaderIter"):
                return True
            r = by_id.get(r["parent_span_id"])
        return False

    full = [r for r in rows if r["plasmient.level"] == "step" and r["plasmient.sampled_depth"] == "full"]
    assert full
    checked = 0
    for step in full:
        # the oracle: the step's op spans under the fetch scope (a span per call where the budget keeps them)
        fetched = {r["name"] for r in rows if r["plasmient.step"] == step["plasmient.step"]
                   and r["plasmient.level"] == "op" and in_fetch(r) and not r["name"].startswith("enumerate(")}
        culprits = json.loads(step["plasmient.culprits"])
        loader_rows = [c for c in culprits if (c["module"] or "").startswith("enumerate(DataLoader)#")]
        assert {c["op"] for c in loader_rows} <= fetched
        assert not [c for c in culprits if c["op"] in fetched and not c["module"]], "a fetch op with no context"
        for c in loader_rows:
            assert "num_workers > 0" in c["suggestion"] and "torch.compile" not in c["suggestion"]
            checked += 1
    assert checked
