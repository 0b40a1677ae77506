"""Peaks that hold (metrics/hardware.py, metrics/cpu_peak.py): per-kernel precision (TF32 on fp32 GEMMs
that ran tensor-core kernels), devices known only by their properties, and a CPU peak that no
recorded op beats by more than 5%."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from conftest import calibrated_cpu, trace_path
from plasmient_trace.metrics import cpu_peak as C
from plasmient_trace.metrics import flops as F
from plasmient_trace.metrics import hardware as H
from plasmient_trace.sources.kineto import read_kineto
from plasmient_trace.stitch.joins import join_rank

GEMM_KERNEL = r"gemm|xmma|tensorop|conv"


@pytest.mark.parametrize("trace", ["a100_multirank/rank-0.json.gz", "a100_multirank/rank-1.json.gz",
                                   "a100/cuda_graphs_rank0_of16.json.gz"])
def test_fp32_gemms_on_tensor_cores_are_tf32_and_then_none_beats_its_peak(trace: str) -> None:
    import pyarrow.compute as pc

    rs = read_kineto(trace_path(trace))
    j, costs = join_rank(rs), F.model_ops(rs.ops)
    names = rs.kernels.column("name")
    is_kernel = np.array(rs.kernels.column("kind").to_pylist()) == "kernel"
    fp32_gemm = np.isin(costs.model, ["gemm", "conv"]) & (costs.dtype == "fp32")
    k = (j.kernel_op >= 0) & is_kernel & fp32_gemm[np.maximum(j.kernel_op, 0)]
    op_dtype = np.where(j.kernel_op >= 0, costs.dtype[np.maximum(j.kernel_op, 0)], "other")
    prec = H.kernel_precision(names, op_dtype)
    # Only fp32 ops change, and only on tensor-core kernel names.
    assert set(prec[op_dtype != "fp32"]) == set(op_dtype[op_dtype != "fp32"])
    assert all(("tensorop_s1688" in n or "tf32" in n) for n in np.array(names.to_pylist())[prec == "tf32"])
    assert not any("sgemm" in n for n in np.array(names.to_pylist())[prec == "tf32"])

    # Each op's rate over its kernels' time, against the peak of the precision it ran at; ops whose
    # main GEMM kernel is not in the trace (only a split-K reduction is) cannot be judged.
    ops = j.kernel_op[k]
    dur = (j.kernel_end - j.kernel_start)[k].astype(np.float64)
    busy = np.bincount(ops, weights=dur, minlength=len(costs))
    has_main = np.bincount(ops, weights=pc.match_substring_regex(names, GEMM_KERNEL).to_numpy(
        zero_copy_only=False)[k].astype(float), minlength=len(costs)) > 0
    tf32 = np.bincount(ops, weights=(prec[k] == "tf32").astype(float), minlength=len(costs)) > 0
    judged = (busy > 0) & has_main
    rate = costs.flops[judged] / (busy[judged] / 1e9)
    a100 = H.SPECS["A100 SXM4 80GB"]
    over_fp32 = int((rate > a100.peak_flops("fp32")).sum())
    peak = np.where(tf32[judged], a100.peak_flops("tf32"), a100.peak_flops("fp32"))
    assert (rate <= peak).all()
    if trace.startswith("a100_multirank"):
        assert over_fp32 > 150  # judged against the fp32 peak, half of these GEMMs were "impossible"


def test_kernel_precision_patterns() -> None:
    names = pa.array(["void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_256x64_16x4_nn_align4>(Params)",
                      "sm80_xmma_fprop_implicit_gemm_indexed_tf32f32_tf32f32_f32_nhwckrsc_nchw",
                      "ampere_sgemm_32x32_sliced1x4_tn", "ampere_s16816gemm_128x128_ldg8_stages_32x3_nn",
                      "cutlass_tensorop_s1688fprop_optimized_tf32_128x128_32x4_nhwc_align4",
                      "ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_nn", None])
    got = H.kernel_precision(names, np.array(["fp32", "fp32", "fp32", "fp32", "fp32", "bf16", "fp32"]))
    assert got.tolist() == ["tf32", "tf32", "fp32", "tf32", "tf32", "bf16", "fp32"]
    # PyTorch's memory-efficient attention: fp32 on sm80+ as 3xTF32 tensor-core math, SIMT before sm80
    fmha = pa.array(["fmha_cutlassF_f32_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<float>)",
                     "fmha_cutlassB_f32_notaligned_64x64_k65536_sm80(PyTorchMemEffAttention::AttentionBackwardKernel)",
                     "fmha_cutlassF_f32_aligned_32x128_gmem_sm75(PyTorchMemEffAttention::AttentionKernel<float>)",
                     "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<bf16>)"])
    got = H.kernel_precision(fmha, np.array(["fp32", "fp32", "fp32", "bf16"]))
    assert got.tolist() == ["3xtf32", "3xtf32", "fp32", "bf16"]
    h200 = H.SPECS["H200 SXM"]
    assert h200.peak_flops("3xtf32") == h200.peak_flops("tf32") / 3


def test_a_device_is_known_by_its_properties_only_when_they_single_it_out() -> None:
    blank = {"name": "", "computeMajor": 9, "computeMinor": 4, "numSms": 304, "totalGlobalMem": 206141652992}
    assert H.lookup(blank).model == "MI300X"
    # A100 SXM4 40GB and PCIe 40GB share cc, SMs and memory but not price: not singled out.
    assert H.lookup({"name": "", "computeMajor": 8, "computeMinor": 0, "numSms": 108,
                     "totalGlobalMem": 40 * 2**30}) is None
    assert H.lookup({**blank, "numSms": 300}) is None
    assert H.lookup({**blank, "name": "Some Future GPU"}) is None  # an unknown name is not overridden


# ------------------------------------------------------------------------------------------- CPU
def _recorded_gemm_rates(tmp_path: Path) -> dict[str, float]:
    """Highest FLOP/s of recorded GEMM ops per dtype, from a profiled run read back like a trace."""
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile

    mats = {n: (torch.randn(n, n), torch.randn(n, n)) for n in (256, 512, 768)}
    for a, b in mats.values():
        a @ b  # warm the BLAS thread pool outside the recording
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(3):
            for a, b in mats.values():
                torch.mm(a, b)
    path = tmp_path / "cpu.json"
    prof.export_chrome_trace(str(path))
    rs = read_kineto(path)
    costs = F.model_ops(rs.ops)
    dur = (rs.ops.column("end_ns").to_numpy() - rs.ops.column("start_ns").to_numpy()) / 1e9
    gemm = (costs.model == "gemm") & (dur > 0)
    return {d: float((costs.flops[gemm & (costs.dtype == d)] / dur[gemm & (costs.dtype == d)]).max())
            for d in set(costs.dtype[gemm])}


def test_no_recorded_cpu_gemm_beats_the_peak_after_it_is_checked(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    spec = H.cpu_spec(cache_dir=calibrated_cpu(tmp_path))
    if C._cpu_has_bf16():
        assert "bf16" in spec.peak  # measured on its own, not borrowed from fp32
    else:
        assert spec.peak_flops("bf16") == spec.peak_flops("fp32")
    observed = _recorded_gemm_rates(tmp_path)
    with caplog.at_level(logging.WARNING, logger=C.__name__):
        checked = H.raise_cpu_peak(spec, observed, cache_dir=tmp_path)
        again = H.raise_cpu_peak(spec, observed, cache_dir=tmp_path)
    for dtype, rate in observed.items():
        assert rate <= 1.05 * checked.peak_flops(dtype)
    raised = [d for d, r in observed.items() if r > 1.05 * spec.peak_flops(d)]
    # Said once per CPU, thread count and dtype, however often the check runs; the cache keeps it.
    assert len([r for r in caplog.records if "raised" in r.getMessage()]) <= len(raised)
    assert again.peak == checked.peak
    assert H.cpu_spec(cache_dir=tmp_path).peak == checked.peak


def test_raising_needs_an_op_over_1_05x(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(C, "_GEMM_N", 32)
    monkeypatch.setattr(C, "_COPY_BYTES", 1 << 16)
    monkeypatch.setattr(C, "_SET_S", 0.005)  # tiny sizes: sets need not last half a second
    spec = H.cpu_spec(cache_dir=tmp_path)
    fp32 = spec.peak_flops("fp32")
    assert H.raise_cpu_peak(spec, {"fp32": 1.04 * fp32}, cache_dir=tmp_path) is spec
    raised = H.raise_cpu_peak(spec, {"fp32": 1.5 * fp32}, cache_dir=tmp_path)
    assert raised.peak_flops("fp32") == 1.5 * fp32 and "raised" in raised.notes
    assert H.cpu_spec(cache_dir=tmp_path).peak_flops("fp32") == 1.5 * fp32


def _autocast_trace(tmp_path: Path) -> Path:
    """A real CPU autocast (bf16) forward pass, recorded by torch.profiler."""
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile

    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    x = torch.randn(512, 256)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)  # warm-up outside the recording
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(3):
                model(x)
    path = tmp_path / "autocast.json"
    prof.export_chrome_trace(str(path))
    return path


def test_an_autocast_wrapper_op_does_not_raise_the_fp32_peak(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under CPU autocast, aten::linear is recorded with its fp32 inputs around the bf16 aten::linear
    that does the math. Its FLOPs over its time is the bf16 GEMM's rate, not an fp32 one: it must not
    raise (and cache) the fp32 peak. It used to: on an avx512_bf16 EPYC a tiny autocast run raised
    fp32 from 97 to 188 GFLOP/s, cached for every later run."""
    import dataclasses
    import json
    from types import MappingProxyType

    from plasmient_trace.pipeline import IngestOptions, rank_input

    path = _autocast_trace(tmp_path)
    # Oracle, from the raw events: each aten::linear with an fp32 operand holds an all-bf16 aten::linear
    # on its thread (the autocast cast happens in between).
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("name") == "aten::linear"]
    outer = [e for e in events if "float" in e["args"]["Input type"][:2]]
    inner = [e for e in events if e["args"]["Input type"][:2] == ["c10::BFloat16"] * 2]
    assert len(outer) == len(inner) == 6
    assert all(any(i["tid"] == o["tid"] and o["ts"] <= i["ts"] and i["ts"] + i["dur"] <= o["ts"] + o["dur"]
                   for i in inner) for o in outer)

    def rate(e: dict) -> float:
        (m, k), (n, _) = e["args"]["Input Dims"][0], e["args"]["Input Dims"][1]
        return 2.0 * m * k * n / (e["dur"] / 1e6)

    wrapper_rate = max(rate(e) for e in outer)
    monkeypatch.setenv("PLASMIENT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(C, "_GEMM_N", 32)
    monkeypatch.setattr(C, "_COPY_BYTES", 1 << 16)
    monkeypatch.setattr(C, "_SET_S", 0.005)  # tiny sizes: sets need not last half a second
    measured = H.cpu_spec()
    # An fp32 peak the wrapper "beats" twice over, a bf16 peak no op reaches: nothing may be raised.
    peak = {"fp32": wrapper_rate / 2, "fp64": wrapper_rate, "bf16": 10 * max(rate(e) for e in inner)}
    spec = dataclasses.replace(measured, peak=MappingProxyType(peak))
    options = IngestOptions(cpu_spec=spec)
    notes: list[str] = []
    rank_input(read_kineto(path), options, notes)
    assert options.cpu_spec.peak_flops("fp32") == peak["fp32"] and notes == []
    assert "raised" not in json.loads((tmp_path / "cache" / C._CACHE_FILE).read_text()).popitem()[1]


def test_a_peak_an_older_version_raised_is_measured_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Caches written before the autocast fix may hold a raise from a wrapper op: re-measured once."""
    import json

    monkeypatch.setattr(C, "_GEMM_N", 32)
    monkeypatch.setattr(C, "_COPY_BYTES", 1 << 16)
    monkeypatch.setattr(C, "_SET_S", 0.005)  # tiny sizes: sets need not last half a second
    fresh = H.cpu_spec(cache_dir=tmp_path)
    path = tmp_path / C._CACHE_FILE
    cache = json.loads(path.read_text())
    key, entry = cache.popitem()
    assert entry["format"] == C._CACHE_FORMAT
    old = {k: v for k, v in entry.items() if k != "format"}
    cache[key] = {**old, "fp32": 1e18, "raised": ["fp32"]}
    path.write_text(json.dumps(cache))
    assert H.cpu_spec(cache_dir=tmp_path).peak_flops("fp32") < 1e18
    # A raise this version made stays; an old entry nothing raised is measured again too, as it was timed
    # before the idle check (tests/test_cpu_calibration.py).
    raised = H.raise_cpu_peak(fresh, {"fp32": 2 * fresh.peak_flops("fp32")}, cache_dir=tmp_path)
    assert H.cpu_spec(cache_dir=tmp_path).peak_flops("fp32") == raised.peak_flops("fp32")
    cache = json.loads(path.read_text())
    cache[key] = {**old, "fp32": 1.0}
    path.write_text(json.dumps(cache))
    assert H.cpu_spec(cache_dir=tmp_path).peak_flops("fp32") > 1.0
    assert json.loads(path.read_text())[key]["format"] == C._CACHE_FORMAT
