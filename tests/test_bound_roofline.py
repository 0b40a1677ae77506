"""A span's compute/memory bound is read off the roofline of the precision its kernels ran at: compute-bound
when its FLOPs at that precision's peak take at least as long as its bytes at the memory bandwidth.

The device numbers here are the datasheet's, not plasmient's table: NVIDIA V100 (SXM2 / DGX Station) does
15.7 TFLOP/s of FP32 and 125 TFLOP/s on its FP16 tensor cores over 900 GB/s of HBM2. ResNet-50 trained in
FP32 runs its convolutions on the FP32 units, so their ridge point is 15.7e12 / 900e9 = 17.4 FLOP/byte; one
ridge for every kernel taken from the tensor-core peak (139 FLOP/byte) called the convolutions between the
two memory-bound, and every step with them."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import ingested, raw_trace

V100_FP32 = 15.7e12
V100_TENSOR = 125e12
V100_BW = 900e9
TRACE = "v100/resnet50_training.json.gz"


_COLUMNS = ("trace_id", "name", "plasmient.level", "plasmient.bound", "plasmient.flops", "plasmient.bytes",
            "plasmient.flops.coverage", "plasmient.util.resident")


def _spans(level: str) -> list[dict]:
    table = ingested(TRACE).batch.table.select(list(_COLUMNS))
    return [r for r in table.to_pylist() if r["plasmient.level"] == level]


def test_the_v100_trace_is_fp32_throughout() -> None:
    """The premise, from the raw JSON: no op of the trace takes a 16-bit tensor."""
    types = {t for e in raw_trace(TRACE)["traceEvents"] for t in (e.get("args") or {}).get("Input type", [])}
    assert "float" in types and not types & {"c10::Half", "c10::BFloat16", "half", "bfloat16"}


def test_each_kernel_is_bound_by_the_fp32_roofline() -> None:
    kernels = [k for k in _spans("kernel")
               if k.get("plasmient.bound") in ("compute", "memory") and (k.get("plasmient.flops") or 0) > 0]
    flops = np.array([k["plasmient.flops"] for k in kernels])
    nbytes = np.array([k["plasmient.bytes"] for k in kernels])
    assert len(kernels) > 2000 and (nbytes > 0).all()
    intensity = flops / nbytes
    expected = np.where(intensity >= V100_FP32 / V100_BW, "compute", "memory")
    got = np.array([k["plasmient.bound"] for k in kernels])
    assert (got == expected).all(), [(k["name"], i) for k, i, ok in zip(kernels, intensity, got == expected) if not ok][:5]
    # The kernels the tensor-core ridge misplaced: between the two ridges, compute-bound at FP32 (546 here).
    between = (intensity >= V100_FP32 / V100_BW) & (intensity < V100_TENSOR / V100_BW)
    assert between.sum() > 500 and (got[between] == "compute").all()


def test_a_step_is_compute_bound_when_its_math_at_peak_outlasts_its_traffic() -> None:
    """Summed over the step's kernels (FP32 all): FLOPs / FP32 peak against bytes / bandwidth."""
    steps = _spans("step")
    kernels = _spans("kernel")
    trace_of = {}
    for k in kernels:
        trace_of.setdefault(k["trace_id"], []).append(k)
    assert len(steps) == 6
    for step in steps:
        ks = trace_of[step["trace_id"]]
        math_s = sum(k.get("plasmient.flops") or 0.0 for k in ks) / V100_FP32
        traffic_s = sum(k.get("plasmient.bytes") or 0.0 for k in ks) / V100_BW
        assert step["plasmient.flops.coverage"] == 1.0 and step["plasmient.util.resident"] > 0.5
        assert math_s > traffic_s and step["plasmient.bound"] == "compute"
    fleet = _spans("fleet")
    assert [f["plasmient.bound"] for f in fleet] == ["compute"] * 6


def test_fp32_attention_on_an_h200_is_3xtf32_tensor_core_math_and_memory_bound() -> None:
    """PyTorch's memory-efficient attention runs fp32 on sm80+ tensor cores as three TF32 products per
    multiply-add (CUTLASS OpMultiplyAddFastF32, in mem_eff_attention/gemm_kernel_utils.h), so its roof is a
    third of the TF32 peak: H200 SXM, 989 TFLOP/s of TF32 with 2:4 sparsity (494.7 dense) and 4.8 TB/s.
    On the H200 recording of the fp32 tiny transformer (tests/fixtures/gpu), its kernels do 16-20 FLOP a
    byte, under that ridge (34): memory-bound, where the non-tensor FP32 peak (67 TFLOP/s, ridge 14) would
    call them compute-bound."""
    from test_gpu_fixtures import records
    from plasmient_trace.pipeline import IngestOptions, stitch_records

    table = stitch_records([records("tiny_transformer")], IngestOptions(job_id="g")).batch.table
    rows = [r for r in table.select(list(_COLUMNS) + ["plasmient.ideal_s"]).to_pylist()
            if r["plasmient.level"] == "kernel" and r["name"].startswith("fmha_cutlass")]
    assert len(rows) >= 12 and all("_f32_" in r["name"] and "_sm80" in r["name"] for r in rows)
    roof = 989e12 / 2 / 3
    for r in rows:
        assert r["plasmient.flops"] / r["plasmient.ideal_s"] == pytest.approx(roof, rel=1e-3)
        assert r["plasmient.flops"] / r["plasmient.bytes"] < roof / 4.8e12
        assert r["plasmient.bound"] == "memory"


def test_a_kernel_carries_the_peak_of_its_precision_and_the_roofline_draws_it_under_that_roof() -> None:
    """Every v100 kernel with FLOPs is fp32 work with V100's FP32 roof, and so is every point of the page's
    roofline (the 125 TFLOP/s tensor-core roof is no kernel's). Kernels above it are the ones whose modelled
    FLOPs exceed what 15.7 TFLOP/s allows in their time (cuDNN's Winograd transforms and their GEMMs: the
    direct-convolution count over fewer multiplies), as many as the steps count in kernels.over_peak."""
    from plasmient_trace.report.html import report_data

    columns = [*_COLUMNS, "plasmient.peak_flops", "plasmient.wall_s", "plasmient.kernels.over_peak"]
    rows = ingested(TRACE).batch.table.select(columns).to_pylist()
    working = [r for r in rows if r["plasmient.level"] == "kernel" and (r["plasmient.flops"] or 0) > 0]
    assert working and all(r["plasmient.peak_flops"] == V100_FP32 for r in working)
    above = sum(r["plasmient.flops"] / r["plasmient.wall_s"] > V100_FP32 for r in working)
    assert above == sum(r["plasmient.kernels.over_peak"] for r in rows if r["plasmient.level"] == "step") > 0
    roofline = report_data(ingested(TRACE).batch)["roofline"]
    assert roofline["roofs"] == [{"model": "V100 DGXS", "peak_flops": V100_FP32, "peak_bandwidth": V100_BW}]
    assert roofline["above_roof"] == above


def test_a_step_s_mfu_is_its_flops_over_peak_times_window_even_where_kernels_beat_the_peak() -> None:
    """DESIGN's MFU is flops / (peak * window * gpus). The 132 Winograd kernels of each v100 step compute
    more model FLOPs than 15.7 TFLOP/s allows in their time; capping their ideal time at their duration made
    every step's MFU 11% lower than its own flops said (23.6% against 26.6% on step 5). Their ideal time is
    flops/peak like every kernel's; a kernel's own MFU is still at most its util."""
    columns = [*_COLUMNS, "plasmient.peak_flops", "plasmient.wall_s", "plasmient.ideal_s", "plasmient.mfu",
               "plasmient.util.resident", "plasmient.device.window_s", "plasmient.gpus", "plasmient.kernels.over_peak"]
    rows = ingested(TRACE).batch.table.select(columns).to_pylist()
    steps = [r for r in rows if r["plasmient.level"] == "step"]
    assert steps and all(r["plasmient.kernels.over_peak"] > 0 for r in steps)
    for step in steps:
        kernels = [r for r in rows if r["trace_id"] == step["trace_id"] and r["plasmient.level"] == "kernel"
                   and (r["plasmient.flops"] or 0) > 0]
        ideal = sum(r["plasmient.flops"] / r["plasmient.peak_flops"] for r in kernels)
        assert step["plasmient.ideal_s"] == pytest.approx(ideal, rel=1e-9)
        window = step["plasmient.device.window_s"] * step["plasmient.gpus"]
        assert step["plasmient.mfu"] == pytest.approx(min(ideal / window, step["plasmient.util.resident"]), rel=1e-9)
        assert ideal / window < step["plasmient.util.resident"]  # the util bound is not what sets these
    beyond = [r for r in rows if r["plasmient.level"] == "kernel" and (r["plasmient.flops"] or 0) > 0
              and r["plasmient.flops"] / r["plasmient.peak_flops"] > r["plasmient.wall_s"]]
    assert beyond
    for r in beyond:
        assert r["plasmient.ideal_s"] == pytest.approx(r["plasmient.flops"] / r["plasmient.peak_flops"], rel=1e-9)
        assert r["plasmient.mfu"] == r["plasmient.util.resident"]
