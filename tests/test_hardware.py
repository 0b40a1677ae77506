"""GPU spec table, device matching from real Kineto deviceProperties, overrides and CPU calibration."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from conftest import ALL_TRACES, raw_trace
from plasmient_trace.metrics import cpu_peak as C
from plasmient_trace.metrics import hardware as H
from plasmient_trace.metrics.hardware import DTYPES, SPECS, apply_overrides, cpu_spec, lookup

# What each shared trace ran on (its README and deviceProperties), as table model names.
EXPECTED_MODEL = {
    "a100/alexnet.json.gz": "A100 SXM4 40GB",              # 'NVIDIA A100-PG509-200', 108 SMs, 40 GB
    "a100/cuda_graphs_rank0_of16.json.gz": "A100 SXM4 80GB",
    "a100/nccl_training_rank0_of2.json.gz": "A100 SXM4 40GB",
    "a100/triton_example.json.gz": "A100 SXM4 40GB",
    "b200/eager_rank0_of8.json.gz": "B200",
    "cc94_vllm_decode/graph_execution.json.gz": "MI300X",   # blank name: cc 9.4, 304 CUs, 192 GiB
    "h100/bert_small_inference.json.gz": "H100 SXM",
    "h100/qwen1.5_0.5b_chat_inference.json.gz": "H100 SXM",
    "h100/vit_image_classification.json.gz": "H100 SXM",
    "mi250/minitoy_train.json.gz": "MI250 (per GCD)",       # 'AMD Radeon Graphics', gfx90a, 104 CUs, 64 GB
    "mi300x/resnet_act_checkpoint_rank0_of8.json.gz": "MI300X",
    "v100/resnet50_training.json.gz": "V100 DGXS",
}
NO_DEVICE_PROPERTIES = {"a100_multirank/rank-0.json.gz", "a100_multirank/rank-1.json.gz", "cpu_only/rank-34.json.gz"}

REQUIRED_MODELS = ["V100 SXM2", "V100 PCIe", "V100 DGXS", "A100 SXM4 40GB", "A100 SXM4 80GB", "A100 PCIe 40GB",
                   "A100 PCIe 80GB", "H100 SXM", "H100 PCIe", "H100 NVL", "H200 SXM", "B200", "L4", "L40S", "A10G",
                   "MI250X (per GCD)", "MI250 (per GCD)", "MI300X"]


def test_every_shared_trace_resolves_to_its_gpu() -> None:
    assert set(ALL_TRACES) == set(EXPECTED_MODEL) | NO_DEVICE_PROPERTIES
    for trace in ALL_TRACES:
        props = raw_trace(trace).get("deviceProperties") or []
        if trace in NO_DEVICE_PROPERTIES:
            assert not props
            continue
        assert props
        for p in props:  # every device of the node, not just device 0
            spec = lookup(p)
            assert spec is not None, (trace, p["name"])
            assert spec.model == EXPECTED_MODEL[trace], (trace, p["name"], spec.model)
            assert spec.sm_count == p["numSms"]


def test_unknown_or_loosely_similar_names_are_not_guessed() -> None:
    h100 = {"computeMajor": 9, "computeMinor": 0, "numSms": 132, "totalGlobalMem": 85018279936}
    for name in ["NVIDIA GeForce RTX 4090", "NVIDIA H100", "NVIDIA H100 80GB HBM3 MIG 1g.10gb", "NVIDIA H800",
                 "NVIDIA H100 80GB HBM3e", "Tesla V100", "NVIDIA A100", "A100-SXM4-40GB-custom", "NVIDIA GH200 480GB",
                 "", "AMD Instinct MI210"]:
        assert lookup({**h100, "name": name}) is None, name
    assert lookup({}) is None
    # The generic AMD name only resolves with matching arch, CU count and memory.
    mi250 = {"name": "AMD Radeon Graphics", "computeMajor": 9, "computeMinor": 0, "numSms": 104,
             "totalGlobalMem": 68702699520}
    assert lookup(mi250).model == "MI250 (per GCD)"
    assert lookup({**mi250, "numSms": 110}).model == "MI250X (per GCD)"
    assert lookup({**mi250, "numSms": 12}) is None                     # an APU's iGPU
    assert lookup({**mi250, "computeMinor": 3}) is None
    assert lookup({k: v for k, v in mi250.items() if k != "totalGlobalMem"}) is None
    # A board part number resolves only when its memory says which board.
    pg509 = {"name": "NVIDIA A100-PG509-200", "numSms": 108}
    assert lookup({**pg509, "totalGlobalMem": 42297524224}).model == "A100 SXM4 40GB"
    assert lookup({**pg509, "totalGlobalMem": 85e9}) is None


def test_names_match_case_and_prefix_insensitively() -> None:
    assert lookup({"name": "A100-SXM4-80GB"}).model == "A100 SXM4 80GB"  # pre-R460 drivers: no 'NVIDIA '
    assert lookup({"name": "  nvidia  h100 80gb hbm3 "}).model == "H100 SXM"
    assert lookup({"name": "NVIDIA L40S"}).model == "L40S"


def test_the_tables_own_model_names_resolve_to_themselves() -> None:
    # what a user passes as --gpu-model after reading the hint that lists them
    for model in SPECS:
        assert lookup({"name": model}).model == model
        assert lookup({"name": model.upper()}).model == model


def test_table_covers_the_required_parts_with_sources_and_prices() -> None:
    for model in REQUIRED_MODELS:
        spec = SPECS[model]
        assert spec.source and spec.price_source
        if model.startswith("MI250"):  # no public on-demand price: none, rather than a made-up one
            assert spec.price_per_hour is None and "no public on-demand list price" in spec.price_source
        else:
            assert spec.price_per_hour is not None and spec.price_per_hour > 0
        assert spec.memory_bandwidth > 1e11
        for dtype in DTYPES:
            assert spec.peak_flops(dtype) > 0
        # tensor-core dtypes are never slower than fp32 on these parts
        assert spec.peak_flops("bf16") >= spec.peak_flops("fp32")
        assert spec.peak_flops("fp8") >= spec.peak_flops("bf16") or "fp8" not in spec.peak
        assert math.isclose(spec.ridge_point("bf16"), spec.peak_flops("bf16") / spec.memory_bandwidth)


def test_datasheet_numbers_and_fp32_policy() -> None:
    a100 = SPECS["A100 SXM4 80GB"]
    assert a100.peak_flops("fp32") == 19.5e12      # fp32 ops keep the CUDA-core peak ...
    assert a100.peak_flops("tf32") == 156e12       # ... TF32 is separate
    assert a100.peak_flops("bf16") == 312e12
    assert a100.peak_flops("fp8") == 312e12        # no fp8 on Ampere: bf16 rate
    assert a100.memory_bandwidth == 2039e9
    h100 = SPECS["H100 SXM"]
    assert h100.peak_flops("bf16") == 989.5e12 and h100.peak_flops("fp8") == 1979e12
    assert h100.memory_bandwidth == 3.35e12
    v100 = SPECS["V100 DGXS"]
    assert v100.peak_flops("fp16") == 125e12
    assert v100.peak_flops("bf16") == 125e12       # bf16 falls back to the fp16 tensor-core rate
    assert v100.peak_flops("tf32") == v100.peak_flops("fp32") == 15.7e12
    gcd = SPECS["MI250 (per GCD)"]
    assert gcd.peak_flops("bf16") == pytest.approx(362.1e12 / 2)
    assert gcd.memory_bandwidth == pytest.approx(3.2768e12 / 2)
    assert SPECS["MI300X"].peak_flops("bf16") == 1307.4e12


def test_overrides_replace_numbers_without_touching_the_table() -> None:
    base = SPECS["H100 SXM"]
    spec = apply_overrides(base, peak_tflops=500, bandwidth_gbs=2000, price=2.5)
    assert spec is not base and spec.model == base.model
    assert all(spec.peak_flops(d) == 500e12 for d in DTYPES)
    assert spec.memory_bandwidth == 2000e9 and spec.price_per_hour == 2.5
    assert spec.ridge_point("fp8") == 500e12 / 2000e9
    assert "overridden" in spec.source and spec.price_source.startswith("user")
    assert base.peak_flops("bf16") == 989.5e12 and base.price_per_hour == 12.29  # table unchanged
    only_bf16 = apply_overrides(base, peak_tflops={"bf16": 700})
    assert only_bf16.peak_flops("bf16") == 700e12 and only_bf16.peak_flops("fp8") == 1979e12
    assert apply_overrides(base) is base
    assert apply_overrides(base, price=1.0).peak_flops("bf16") == 989.5e12


def test_overrides_on_an_unknown_device() -> None:
    assert apply_overrides(None) is None
    assert apply_overrides(None, price=3.0) is None  # a price alone has no peak to go with it
    user = apply_overrides(None, peak_tflops=100, price=3.0)
    assert user.source == "user" and user.peak_flops("bf16") == 100e12 and user.price_per_hour == 3.0
    assert math.isnan(user.memory_bandwidth) and math.isnan(user.ridge_point())
    assert apply_overrides(None, peak_tflops=100, bandwidth_gbs=1000).ridge_point() == 100.0


class FakeClock:
    """Each reading advances 0.25 s: every timed run takes exactly 0.25 s."""

    def __init__(self) -> None:
        self.t = 0.0
        self.calls = 0

    def __call__(self) -> float:
        self.calls += 1
        self.t += 0.25
        return self.t


def test_cpu_calibration_measures_once_then_reads_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(C, "_GEMM_N", 64)
    monkeypatch.setattr(C, "_COPY_BYTES", 1 << 20)
    monkeypatch.delenv("PLASMIENT_CPU_PRICE", raising=False)
    clock = FakeClock()
    monkeypatch.setattr(C, "_clock", clock)
    first = cpu_spec(cache_dir=tmp_path)
    assert clock.calls > 0
    assert first.device_type == "cpu" and first.source == "calibrated"
    assert first.peak_flops("fp32") == 2 * 64**3 / 0.25          # 2 n^3 per timed 0.25 s
    assert first.memory_bandwidth == 2 * (1 << 20) / 0.25         # read + write per timed 0.25 s
    assert first.peak_flops("bf16") == first.peak_flops("fp32")
    threads = C._threads()
    assert first.price_per_hour == pytest.approx(H.CPU_PRICE_PER_THREAD_HOUR * threads)

    cache = json.loads((tmp_path / "cpu_calibration.json").read_text())
    assert list(cache) == [C._cache_key(threads)]
    assert cache[C._cache_key(threads)]["fp32"] == first.peak_flops("fp32")

    def no_timing() -> float:
        raise AssertionError("second call must read the cache, not time anything")

    monkeypatch.setattr(C, "_clock", no_timing)
    second = cpu_spec(cache_dir=tmp_path)
    assert second == first

    # Another thread count is another machine setting: measured again, stored beside the first.
    monkeypatch.setattr(C, "_threads", lambda: threads + 1)
    monkeypatch.setattr(C, "_clock", FakeClock())
    cpu_spec(cache_dir=tmp_path)
    assert len(json.loads((tmp_path / "cpu_calibration.json").read_text())) == 2


def test_cpu_cache_dir_and_price_come_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(C, "_GEMM_N", 32)
    monkeypatch.setattr(C, "_COPY_BYTES", 1 << 16)
    monkeypatch.setattr(C, "_clock", FakeClock())
    monkeypatch.setenv("PLASMIENT_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.setenv("PLASMIENT_CPU_PRICE", "0.42")
    spec = cpu_spec()
    assert (tmp_path / "c" / "cpu_calibration.json").exists()
    assert spec.price_per_hour == 0.42 and spec.price_source == "PLASMIENT_CPU_PRICE"
    (tmp_path / "c" / "cpu_calibration.json").write_text("{not json")  # a corrupt cache is re-measured
    assert cpu_spec().peak_flops("fp32") == 2 * 32**3 / 0.25


def test_cpu_calibration_with_the_real_clock_gives_positive_numbers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(C, "_GEMM_N", 128)
    monkeypatch.setattr(C, "_COPY_BYTES", 4 << 20)
    monkeypatch.setattr(C, "_SET_S", 0.005)   # sets short enough to find the machine idle beside other tests
    spec = cpu_spec(cache_dir=tmp_path)
    assert spec.peak_flops("fp32") > 0 and spec.peak_flops("fp64") > 0 and spec.memory_bandwidth > 0
    assert math.isfinite(spec.ridge_point())


_EPYC_CORE = """processor\t: {n}
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC
stepping\t: 1
microcode\t: 0x1000065
cpu MHz\t\t: 2445.428
cache size\t: 512 KB
siblings\t: {cpus}
cpu cores\t: {cpus}
flags\t\t: fpu sse sse2 ssse3 fma avx avx2 hypervisor
bogomips\t: 4890.85

"""


def _epyc(cpus: int = 2) -> str:
    """A VM's /proc/cpuinfo that names its CPU only "AMD EPYC" (as this test machine's does)."""
    return "".join(_EPYC_CORE.format(n=n, cpus=cpus) for n in range(cpus))


def test_cpus_that_share_a_generic_model_name_never_share_a_calibration(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The calibration cache was keyed by the model name and thread count. In a VM the name can be "AMD EPYC"
    with no model number, for a Zen 3 and for a Zen 4 with AVX-512, so the second machine read the first
    one's measured peak (and an op that beat it raised the first one's). Each CPU that differs in what sets a
    GEMM's rate (its model number, its SIMD extensions, its number of cores) now gets its own entry, measured
    on it; the same CPU after a reboot or a microcode update (another clock speed, bogomips, microcode, in
    another order) reads its own entry without measuring."""
    import builtins

    cpuinfo = tmp_path / "cpuinfo"
    real_open = builtins.open

    def fake_open(file, *args, **kwargs):
        return real_open(cpuinfo if str(file) == "/proc/cpuinfo" else file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    measured: list[str] = []

    def measure(threads: int, deadline_s: float = 0.0) -> dict:
        # each measurement a peak of its own, so whose entry a spec was read from shows in its peak
        measured.append(cpuinfo.read_text())
        peak = float(len(measured)) * 1e9
        return {"fp32": peak, "fp64": peak, "bf16": peak, "bandwidth": 1e9, "format": C._CACHE_FORMAT}

    monkeypatch.setattr(C, "_measure_all", measure)
    cache = tmp_path / "cache"
    machines = {
        "zen3": _epyc(),
        "zen4 (model 17, AVX-512 with bf16)": _epyc().replace("model\t\t: 1\n", "model\t\t: 17\n")
                                                      .replace("avx avx2", "avx avx2 avx512f avx512_bf16"),
        "zen3 with 4 cores": _epyc(4),
        "zen3 of another stepping": _epyc().replace("stepping\t: 1\n", "stepping\t: 2\n"),
    }
    peaks: dict[str, float] = {}
    for name, text in machines.items():
        cpuinfo.write_text(text)
        before = len(measured)
        peaks[name] = cpu_spec(cache_dir=cache, threads=2).peak_flops("fp32")
        assert len(measured) == before + 1 and measured[-1] == text, f"{name} read another CPU's peak"
    assert len(set(peaks.values())) == len(machines)
    assert len(json.loads((cache / C._CACHE_FILE).read_text())) == len(machines)

    rebooted = machines["zen3"].replace("2445.428", "3100.002").replace("4890.85", "6200.00")
    rebooted = rebooted.replace("0x1000065", "0x1000066").replace("fma avx avx2", "avx2 avx fma")
    for again in (machines["zen3"], rebooted):
        cpuinfo.write_text(again)
        before = len(measured)
        assert cpu_spec(cache_dir=cache, threads=2).peak_flops("fp32") == peaks["zen3"]
        assert len(measured) == before

    # An op that beats the zen4's peak raises the zen4's entry, not the zen3's.
    cpuinfo.write_text(machines["zen4 (model 17, AVX-512 with bf16)"])
    zen4 = cpu_spec(cache_dir=cache, threads=2)
    H.raise_cpu_peak(zen4, {"fp32": 1.5 * zen4.peak_flops("fp32")}, threads=2, cache_dir=cache, say=lambda _: None)
    cpuinfo.write_text(machines["zen3"])
    assert cpu_spec(cache_dir=cache, threads=2).peak_flops("fp32") == peaks["zen3"]
    cpuinfo.write_text(machines["zen4 (model 17, AVX-512 with bf16)"])
    assert cpu_spec(cache_dir=cache, threads=2).peak_flops("fp32") == 1.5 * peaks["zen4 (model 17, AVX-512 with bf16)"]
