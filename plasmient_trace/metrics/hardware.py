"""Peak FLOP/s, memory bandwidth and price of the device a trace ran on (GPU table, calibrated CPU).

One job: answer "what could this device have done?" so MFU, ridge points and cost have a
denominator. GPU numbers come from vendor datasheets, dense (no structured sparsity): where a
datasheet only prints the 2:4-sparse figure (marked * there), the dense peak is half of it.

Which peak applies to which dtype
---------------------------------
* ``fp32`` is the non-tensor FP32 peak on NVIDIA. Kineto records ``float`` whether or not TF32
  ran, so the op's dtype cannot tell; the kernel can: :func:`kernel_precision` says ``tf32`` for an
  fp32 op whose kernel is a tensor-core one (``cutlass_80_tensorop_s1688gemm``, ``sm80_xmma_*tf32*``,
  ``cutlass_tensorop_s1688fprop_*_tf32_*``), and that kernel is judged against the TF32 peak.
  PyTorch's memory-efficient attention runs fp32 on tensor cores too, as three TF32 products per
  multiply-add (CUTLASS ``OpMultiplyAddFastF32``: fp32 accuracy): its ``fmha_cutlass[FB]_f32_*_sm80``
  kernels are ``3xtf32``, judged against a third of the TF32 peak.
* On AMD CDNA, ``fp32``/``fp64`` are the matrix-core (MFMA) peaks: those are full-precision IEEE
  math, and what rocBLAS/hipBLASLt fp32 and fp64 GEMMs run on.
* ``fp64`` on NVIDIA is the FP64 Tensor Core peak where the part has one (A100, H100, H200, B200).
* A dtype the part has no units for falls back: tf32 -> fp32; bf16 -> fp16 -> fp32 (V100 has no
  bf16 path); fp8 -> bf16 -> fp16 -> fp32; int8 -> fp32; anything else -> fp32.

Prices are **assumptions**, not quotes: a rough public on-demand list price per GPU-hour (USD)
with its basis next to it, meant to be overridden with ``--gpu-price``.

Device matching (:func:`lookup`) is by exact, normalised device name (a leading "NVIDIA " is
optional, case and spacing are ignored), then by deviceProperties (compute capability, SM/CU count,
memory) where the name is blank, generic ('AMD Radeon Graphics') or covers two parts: a blank name
with cc 9.4, 304 CUs and 192 GiB is an MI300X. Properties that fit no part, or two parts with
different numbers, return None: no guessing from substrings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .grouping import match_distinct

__all__ = [
    "DTYPES",
    "SPECS",
    "GpuSpec",
    "apply_overrides",
    "cpu_spec",  # noqa: F822 -- resolved lazily by __getattr__ (cpu_peak)
    "kernel_precision",
    "tf32_kernels",
    "fast_fp32_kernels",
    "fp32_precision_codes",
    "FAST_FP32",
    "FP32_PRECISIONS",
    "lookup",
    "raise_cpu_peak",  # noqa: F822 -- resolved lazily by __getattr__ (cpu_peak)
    "start_cpu_calibration",  # noqa: F822 -- resolved lazily by __getattr__ (cpu_peak)
]

DTYPES = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8", "int8")
FAST_FP32 = "3xtf32"  # fp32 math as three TF32 tensor-core products (see the module docstring)

_FALLBACK: dict[str, tuple[str, ...]] = {
    "tf32": ("fp32",),
    "bf16": ("fp16", "fp32"),
    "fp16": ("fp32",),
    "fp8": ("bf16", "fp16", "fp32"),
    "int8": ("fp32",),
    "fp64": ("fp32",),
}

T = 1e12
TB = 1e12
GB = 1e9


@dataclass(frozen=True)
class GpuSpec:
    """Peak numbers of one device model (per device as the trace sees it: one MI250 GCD is one)."""

    model: str
    peak: Mapping[str, float]            # FLOP/s per canonical dtype, dense
    memory_bandwidth: float              # bytes/s
    price_per_hour: float | None         # USD per device-hour (an assumption; None = unknown)
    source: str                          # datasheet the peaks come from, or 'calibrated' / 'user'
    price_source: str = ""
    vendor: str = ""
    device_type: str = "gpu"             # 'gpu' | 'cpu'
    sm_count: int | None = None          # SMs (NVIDIA) / CUs (AMD) of the full part
    memory_bytes: float | None = None    # nominal memory, bytes
    notes: str = ""
    # GPU-to-GPU fabric (NVLink / Infinity Fabric xGMI), bytes/s per GPU in ONE direction: what nccl-tests'
    # bus bandwidth is compared against. None = no such fabric on the part, or no vendor number.
    link_bandwidth: float | None = None
    link_source: str = ""

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]:
        # The peaks are a read-only view, which pickle refuses; a spec crosses to the live capture's batch
        # process as plain fields and is read-only again there.
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["peak"] = dict(self.peak)
        return _spec_from_fields, (fields,)

    def peak_flops(self, dtype: str = "fp32") -> float:
        """Dense peak FLOP/s for a canonical dtype, following the documented fallback chain."""
        if dtype == FAST_FP32 and dtype not in self.peak:
            return self.peak_flops("tf32") / 3  # each fp32 multiply-add is three TF32 ones
        if dtype in self.peak:
            return self.peak[dtype]
        for alt in _FALLBACK.get(dtype, ("fp32",)):
            if alt in self.peak:
                return self.peak[alt]
        return self.peak.get("fp32", next(iter(self.peak.values())) if self.peak else float("nan"))

    def ridge_point(self, dtype: str = "fp32") -> float:
        """FLOP per byte where the roofline turns from memory- to compute-bound."""
        bw = self.memory_bandwidth
        return self.peak_flops(dtype) / bw if bw and bw > 0 else float("nan")


def _spec_from_fields(fields: dict[str, Any]) -> GpuSpec:
    return GpuSpec(**{**fields, "peak": MappingProxyType(dict(fields["peak"]))})


def _spec(model: str, vendor: str, source: str, peak: dict[str, float], bw: float, price: float | None,
          price_source: str, sms: int | None, mem_gb: float | None, notes: str = "") -> GpuSpec:
    return GpuSpec(model=model, peak=MappingProxyType(dict(peak)), memory_bandwidth=bw, price_per_hour=price,
                   source=source, price_source=price_source, vendor=vendor, sm_count=sms,
                   memory_bytes=mem_gb * GB if mem_gb else None, notes=notes)


_NV = "nvidia"
_AMD = "amd"
_AWS_2024 = "AWS on-demand us-east-1 list price (2024) / GPUs per instance; AWS cut P4/P5 prices in 2025"

# Per-GPU GPU-to-GPU fabric bandwidth. Datasheets print the total of both directions; nccl-tests' busbw is a
# one-direction number (doc/PERFORMANCE.md: "The measurement is of a unidirectional bandwidth"), so the
# table holds half the datasheet figure. Parts whose NVLink is an optional bridge between 2-4 cards (PCIe,
# NVL) have no entry: whether it was fitted is not in the trace.
_LINKS: dict[str, tuple[float, str]] = {
    "V100 SXM2": (150 * GB, "NVIDIA Tesla V100 datasheet: NVLink 300 GB/s (both directions; 6 links x 25 GB/s each way)"),
    **{f"A100 SXM4 {mem}GB": (300 * GB, "NVIDIA A100 datasheet: NVLink 600 GB/s (both directions; 12 links x 25 GB/s each way)")
       for mem in (40, 80)},
    "H100 SXM": (450 * GB, "NVIDIA H100 datasheet (SXM): NVLink 900 GB/s (both directions; 18 links x 25 GB/s each way)"),
    "H200 SXM": (450 * GB, "NVIDIA H200 datasheet (SXM): NVLink 900 GB/s (both directions)"),
    "B200": (900 * GB, "NVIDIA HGX B200 datasheet: NVLink 5, 1.8 TB/s GPU-to-GPU (both directions)"),
    "MI300X": (448 * GB, "AMD Instinct MI300X datasheet: 7 Infinity Fabric links x 128 GB/s (both directions), 896 GB/s in all"),
}


def _with_link(spec: GpuSpec) -> GpuSpec:
    link = _LINKS.get(spec.model)
    return dataclasses.replace(spec, link_bandwidth=link[0], link_source=link[1]) if link else spec


SPECS: Mapping[str, GpuSpec] = MappingProxyType({s.model: _with_link(s) for s in [
    # ------------------------------------------------------------------------------ Volta
    _spec("V100 SXM2", _NV, "NVIDIA Tesla V100 GPU Accelerator datasheet (SXM2 column)",
          {"fp64": 7.8 * T, "fp32": 15.7 * T, "fp16": 125 * T}, 900 * GB,
          3.06, "AWS p3.2xlarge (1x V100 16GB) on-demand us-east-1", 80, 32),
    _spec("V100 PCIe", _NV, "NVIDIA Tesla V100 GPU Accelerator datasheet (PCIe column)",
          {"fp64": 7.0 * T, "fp32": 14.0 * T, "fp16": 112 * T}, 900 * GB,
          2.48, "GCP on-demand NVIDIA V100 GPU price per GPU-hour (VM extra)", 80, 32),
    _spec("V100S PCIe", _NV, "NVIDIA V100S datasheet",
          {"fp64": 8.2 * T, "fp32": 16.4 * T, "fp16": 130 * T}, 1134 * GB,
          2.48, "priced as V100 PCIe (no hyperscaler V100S SKU)", 80, 32),
    _spec("V100 DGXS", _NV,
          "NVIDIA DGX Station datasheet (4x Tesla V100, 500 TFLOPS mixed precision = 125 per GPU); "
          "the DGXS part is an NVLink V100 at the SXM2 boost clock, so SXM2 datasheet numbers",
          {"fp64": 7.8 * T, "fp32": 15.7 * T, "fp16": 125 * T}, 900 * GB,
          3.06, "priced as V100 SXM2 (DGX Station is not rented by the hour)", 80, 32),
    # ------------------------------------------------------------------------------ Ampere
    *[_spec(f"A100 {form} {mem}GB", _NV, f"NVIDIA A100 Tensor Core GPU datasheet ({mem}GB {form}); dense = sparse*/2",
            {"fp64": 19.5 * T, "fp32": 19.5 * T, "tf32": 156 * T, "bf16": 312 * T, "fp16": 312 * T, "int8": 624 * T},
            bw * GB, price, price_src, 108, mem,
            notes="fp64 is the FP64 Tensor Core peak (9.7 TFLOP/s without tensor cores)")
      for form, mem, bw, price, price_src in [
          ("SXM4", 40, 1555, 4.10, f"{_AWS_2024}: p4d.24xlarge $32.77 / 8"),
          ("SXM4", 80, 2039, 5.12, f"{_AWS_2024}: p4de.24xlarge $40.97 / 8"),
          ("PCIe", 40, 1555, 3.67, "priced as the 80GB PCIe (no hyperscaler 40GB PCIe SKU)"),
          ("PCIe", 80, 1935, 3.67, "Azure NC24ads A100 v4 (1x A100 80GB PCIe) on-demand, rounded"),
      ]],
    _spec("A10G", _NV,
          "AWS-only part, no public NVIDIA datasheet: figures as published for the G5 instances "
          "(NVIDIA A10 datasheet for memory); tensor rates are half the A10's",
          {"fp64": 31.52 / 64 * T, "fp32": 31.52 * T, "tf32": 35 * T, "bf16": 70 * T, "fp16": 70 * T, "int8": 140 * T},
          600 * GB, 1.01, "AWS g5.xlarge (1x A10G) on-demand us-east-1 $1.006", 80, 24,
          notes="fp64 derived: GA102 runs FP64 at 1/64 of FP32 (not in any datasheet)"),
    # ------------------------------------------------------------------------------ Ada
    _spec("L4", _NV, "NVIDIA L4 Tensor Core GPU datasheet; dense = sparse*/2",
          {"fp64": 30.3 / 64 * T, "fp32": 30.3 * T, "tf32": 60 * T, "bf16": 121 * T, "fp16": 121 * T,
           "fp8": 242.5 * T, "int8": 242.5 * T}, 300 * GB,
          0.80, "AWS g6.xlarge (1x L4) on-demand us-east-1 $0.805", 58, 24,
          notes="fp64 derived: Ada runs FP64 at 1/64 of FP32 (not in the datasheet)"),
    _spec("L40S", _NV, "NVIDIA L40S datasheet (dense column)",
          {"fp64": 91.6 / 64 * T, "fp32": 91.6 * T, "tf32": 183 * T, "bf16": 362.05 * T, "fp16": 362.05 * T,
           "fp8": 733 * T, "int8": 733 * T}, 864 * GB,
          1.86, "AWS g6e.xlarge (1x L40S) on-demand us-east-1 $1.861", 142, 48,
          notes="fp64 derived: Ada runs FP64 at 1/64 of FP32 (not in the datasheet)"),
    # ------------------------------------------------------------------------------ Hopper
    _spec("H100 SXM", _NV, "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column); dense = sparse*/2",
          {"fp64": 67 * T, "fp32": 67 * T, "tf32": 494.5 * T, "bf16": 989.5 * T, "fp16": 989.5 * T,
           "fp8": 1979 * T, "int8": 1979 * T}, 3.35 * TB,
          12.29, f"{_AWS_2024}: p5.48xlarge $98.32 / 8", 132, 80,
          notes="fp64 is the FP64 Tensor Core peak (34 TFLOP/s without)"),
    _spec("H100 PCIe", _NV, "NVIDIA H100 Tensor Core GPU datasheet (H100 PCIe column); dense = sparse*/2",
          {"fp64": 51 * T, "fp32": 51 * T, "tf32": 378 * T, "bf16": 756.5 * T, "fp16": 756.5 * T,
           "fp8": 1513 * T, "int8": 1513 * T}, 2.0 * TB,
          6.98, "priced as H100 NVL (no hyperscaler H100 PCIe SKU)", 114, 80,
          notes="fp64 is the FP64 Tensor Core peak (26 TFLOP/s without)"),
    _spec("H100 NVL", _NV, "NVIDIA H100 NVL datasheet (per GPU, 94GB); dense = sparse*/2",
          {"fp64": 60 * T, "fp32": 60 * T, "tf32": 417.5 * T, "bf16": 835.5 * T, "fp16": 835.5 * T,
           "fp8": 1670.5 * T, "int8": 1670.5 * T}, 3.9 * TB,
          6.98, "Azure NC40ads H100 v5 (1x H100 NVL) on-demand, rounded", 132, 94,
          notes="fp64 is the FP64 Tensor Core peak (30 TFLOP/s without)"),
    _spec("H200 SXM", _NV, "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column); dense = sparse*/2",
          {"fp64": 67 * T, "fp32": 67 * T, "tf32": 494.5 * T, "bf16": 989.5 * T, "fp16": 989.5 * T,
           "fp8": 1979 * T, "int8": 1979 * T}, 4.8 * TB,
          10.60, "rough hyperscaler on-demand price per H200 (8-GPU instances ~ $85/h), rounded", 132, 141,
          notes="fp64 is the FP64 Tensor Core peak (34 TFLOP/s without)"),
    _spec("H200 NVL", _NV, "NVIDIA H200 Tensor Core GPU datasheet (H200 NVL column); dense = sparse*/2",
          {"fp64": 60 * T, "fp32": 60 * T, "tf32": 417.5 * T, "bf16": 835.5 * T, "fp16": 835.5 * T,
           "fp8": 1670.5 * T, "int8": 1670.5 * T}, 4.8 * TB,
          10.60, "priced as H200 SXM", 132, 141,
          notes="fp64 is the FP64 Tensor Core peak (30 TFLOP/s without)"),
    # ------------------------------------------------------------------------------ Blackwell
    _spec("B200", _NV, "NVIDIA HGX B200 datasheet (8-GPU figures / 8); dense = sparse*/2",
          {"fp64": 37 * T, "fp32": 75 * T, "tf32": 1125 * T, "bf16": 2250 * T, "fp16": 2250 * T,
           "fp8": 4500 * T, "int8": 4500 * T}, 8.0 * TB,
          14.24, "AWS p6-b200.48xlarge on-demand $113.93 / 8", 148, 180,
          notes="HGX B200 board (700-1000 W parts differ slightly); fp64 = FP64 Tensor Core"),
    # ------------------------------------------------------------------------------ AMD CDNA2 (per GCD)
    _spec("MI250X (per GCD)", _AMD,
          "AMD Instinct MI250X datasheet, halved: each of the 2 GCDs is one device to HIP/Kineto",
          {"fp64": 47.85 * T, "fp32": 47.85 * T, "bf16": 191.5 * T, "fp16": 191.5 * T, "int8": 191.5 * T},
          1.6384 * TB, None, "no public on-demand list price: cost only with --gpu-price",
          110, 64, notes="card: 95.7 TF fp64/fp32 matrix, 383 TF fp16/bf16, 3.2768 TB/s, 128 GB"),
    _spec("MI250 (per GCD)", _AMD,
          "AMD Instinct MI250 datasheet, halved: each of the 2 GCDs is one device to HIP/Kineto",
          {"fp64": 45.25 * T, "fp32": 45.25 * T, "bf16": 181.05 * T, "fp16": 181.05 * T, "int8": 181.05 * T},
          1.6384 * TB, None, "no public on-demand list price: cost only with --gpu-price",
          104, 64, notes="card: 90.5 TF fp64/fp32 matrix, 362.1 TF fp16/bf16, 3.2768 TB/s, 128 GB"),
    # ------------------------------------------------------------------------------ AMD CDNA3
    _spec("MI300X", _AMD, "AMD Instinct MI300X datasheet (dense)",
          {"fp64": 163.4 * T, "fp32": 163.4 * T, "tf32": 653.7 * T, "bf16": 1307.4 * T, "fp16": 1307.4 * T,
           "fp8": 2614.9 * T, "int8": 2614.9 * T}, 5.3 * TB,
          6.00, "Azure ND MI300X v5 on-demand $48 / 8", 304, 192),
]})

# Exact device names (normalised: lower case, single spaces, no leading 'nvidia ') -> model.
_NAMES: dict[str, str] = {
    "tesla v100-sxm2-16gb": "V100 SXM2", "tesla v100-sxm2-32gb": "V100 SXM2",
    "tesla v100-pcie-16gb": "V100 PCIe", "tesla v100-pcie-32gb": "V100 PCIe",
    "tesla v100s-pcie-32gb": "V100S PCIe",
    "tesla v100-dgxs-16gb": "V100 DGXS", "tesla v100-dgxs-32gb": "V100 DGXS",
    "a100-sxm4-40gb": "A100 SXM4 40GB", "a100-sxm4-80gb": "A100 SXM4 80GB",
    "a100-pcie-40gb": "A100 PCIe 40GB", "a100 80gb pcie": "A100 PCIe 80GB", "a100-pcie-80gb": "A100 PCIe 80GB",
    "a10g": "A10G", "l4": "L4", "l40s": "L40S",
    "h100 80gb hbm3": "H100 SXM", "h100 pcie": "H100 PCIe", "h100 nvl": "H100 NVL",
    "h200": "H200 SXM", "h200 nvl": "H200 NVL",
    "b200": "B200",
    "amd instinct mi250x": "MI250X (per GCD)", "amd instinct mi250": "MI250 (per GCD)",
    "amd instinct mi300x": "MI300X", "amd instinct mi300x vf": "MI300X",
}

# Board part numbers some OEM/hyperscaler A100s report instead of a marketing name: PG509 is the
# SXM4 board; the memory size, checked against totalGlobalMem, says which one.
_BOARD_NAMES: dict[str, dict[int, str]] = {
    "a100-pg509-200": {40: "A100 SXM4 40GB"},
}

# Generic or shared names resolved from (computeMajor, computeMinor, numSms/CUs, memory GB).
_BY_PROPERTIES: dict[str, list[tuple[tuple[int, int], int, int, str]]] = {
    # gfx90a reports 9.0; one MI250 GCD has 104 CUs and 64 GB, one MI250X GCD 110 CUs.
    "amd radeon graphics": [((9, 0), 104, 64, "MI250 (per GCD)"), ((9, 0), 110, 64, "MI250X (per GCD)"),
                            ((9, 4), 304, 192, "MI300X")],
    "amd instinct mi250x/mi250": [((9, 0), 104, 64, "MI250 (per GCD)"), ((9, 0), 110, 64, "MI250X (per GCD)")],
    "amd instinct mi250x / mi250": [((9, 0), 104, 64, "MI250 (per GCD)"), ((9, 0), 110, 64, "MI250X (per GCD)")],
}


# Compute capability of each part, for identification from properties alone (blank names).
_CC: dict[str, tuple[int, int]] = {
    "V100 SXM2": (7, 0), "V100 PCIe": (7, 0), "V100S PCIe": (7, 0), "V100 DGXS": (7, 0),
    "A100 SXM4 40GB": (8, 0), "A100 SXM4 80GB": (8, 0), "A100 PCIe 40GB": (8, 0), "A100 PCIe 80GB": (8, 0),
    "A10G": (8, 6), "L4": (8, 9), "L40S": (8, 9), "H100 SXM": (9, 0), "H100 PCIe": (9, 0), "H100 NVL": (9, 0),
    "H200 SXM": (9, 0), "H200 NVL": (9, 0), "B200": (10, 0),
    "MI250X (per GCD)": (9, 0), "MI250 (per GCD)": (9, 0), "MI300X": (9, 4),
}


def _by_properties(props: Mapping[str, Any]) -> GpuSpec | None:
    """The one part whose compute capability, SM/CU count and memory all fit; None unless exactly
    one fits, or all that fit share every number (same silicon sold under two names)."""
    cc = (props.get("computeMajor"), props.get("computeMinor"))
    sms, mem = props.get("numSms"), _mem_gb(props)
    fits = [SPECS[m] for m, c in _CC.items() if c == cc and SPECS[m].sm_count == sms
            and SPECS[m].memory_bytes is not None and _close(mem, round(SPECS[m].memory_bytes / GB))]
    if len({(tuple(sorted(f.peak.items())), f.memory_bandwidth, f.price_per_hour) for f in fits}) != 1:
        return None
    return fits[0]


def _normalise(name: str) -> str:
    n = " ".join(name.strip().lower().split())
    return n.removeprefix("nvidia ")


_MODELS = {_normalise(model): model for model in SPECS}


def _mem_gb(props: Mapping[str, Any]) -> float | None:
    mem = props.get("totalGlobalMem")
    return float(mem) / GB if isinstance(mem, (int, float)) and mem > 0 else None


def _close(mem_gb: float | None, nominal: int) -> bool:
    # Usable memory is a little below nominal (ECC, reserved); 'GB' is 1e9 or 2^30 by vendor.
    return mem_gb is not None and 0.85 * nominal <= mem_gb <= 1.15 * nominal * (2**30 / 1e9)


def knows_name(name: str) -> bool:
    """Whether a device name (as Kineto records it, or a table model as a user names it) is one :func:`lookup`
    can match, given the device's memory where the name leaves it open."""
    key = _normalise(name)
    return key in _NAMES or key in _MODELS or key in _BOARD_NAMES or key in _BY_PROPERTIES


def lookup(device_properties: Mapping[str, Any]) -> GpuSpec | None:
    """The table entry for one Kineto ``deviceProperties`` entry, or None for an unknown device."""
    name = device_properties.get("name")
    if not isinstance(name, str) or not name.strip():
        return _by_properties(device_properties)
    key = _normalise(name)
    if key in _NAMES:
        return SPECS[_NAMES[key]]
    if key in _MODELS:  # the table's own names ("H100 SXM"), as a user gives --gpu-model
        return SPECS[_MODELS[key]]
    mem = _mem_gb(device_properties)
    if key in _BOARD_NAMES:
        for nominal, model in _BOARD_NAMES[key].items():
            if _close(mem, nominal):
                return SPECS[model]
        return None
    if key in _BY_PROPERTIES:
        cc = (device_properties.get("computeMajor"), device_properties.get("computeMinor"))
        sms = device_properties.get("numSms")
        for want_cc, want_sms, nominal, model in _BY_PROPERTIES[key]:
            if cc == want_cc and sms == want_sms and _close(mem, nominal):
                return SPECS[model]
    return None


# Tensor-core kernels that run fp32 GEMMs/convs as TF32 (NVIDIA Ampere and later): CUTLASS
# 'tensorop_s1688'/'s16816' (single-precision in, tensor-core MMA shape), cuDNN/xmma '*tf32*'.
# cuBLAS SIMT fp32 kernels ('ampere_sgemm_*', 'volta_sgemm_*') match none of these.
_TF32_KERNEL = r"(?i)tf32|tensorop_s(1688|16816)|(^|[^a-z0-9])s(1688|16816)(gemm|fprop|dgrad|wgrad)"


def tf32_kernels(kernel_names: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Per kernel, whether its name is a tensor-core kernel that runs fp32 math as TF32 (see _TF32_KERNEL)."""
    return match_distinct(kernel_names, lambda names: pc.match_substring_regex(names, _TF32_KERNEL))


# PyTorch's memory-efficient attention (from xformers) for fp32 on sm80 and later: a CUTLASS TensorOp
# GEMM with OpMultiplyAddFastF32 (mem_eff_attention/gemm_kernel_utils.h), three TF32 products per fp32
# multiply-add. Its sm50/sm70/sm75 fp32 kernels are SIMT, plain fp32.
_FAST_FP32_KERNEL = r"^fmha_cutlass[FB]_f32_\w*_sm80"


def fast_fp32_kernels(kernel_names: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Per kernel, whether its name is one that runs fp32 math as 3xTF32 (see _FAST_FP32_KERNEL)."""
    return match_distinct(kernel_names, lambda names: pc.match_substring_regex(names, _FAST_FP32_KERNEL))


# What an fp32 op's math runs at, by its kernel's name (fp32_precision_codes indexes this).
FP32_PRECISIONS = ("fp32", "tf32", FAST_FP32)


def fp32_precision_codes(kernel_names: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Per kernel, the precision an fp32 op's math ran at on it, as an index into FP32_PRECISIONS: ``tf32``
    on a tensor-core kernel (see _TF32_KERNEL), ``3xtf32`` on one that splits each fp32 product into three
    TF32 ones (see _FAST_FP32_KERNEL), plain ``fp32`` otherwise."""
    code = np.zeros(len(kernel_names), np.int64)
    code[tf32_kernels(kernel_names)] = FP32_PRECISIONS.index("tf32")
    code[fast_fp32_kernels(kernel_names)] = FP32_PRECISIONS.index(FAST_FP32)
    return code


def kernel_precision(kernel_names: pa.Array | pa.ChunkedArray, op_dtype: np.ndarray) -> np.ndarray:
    """Per kernel, the precision its math ran at: ``op_dtype`` (the launching op's canonical dtype), where
    that is fp32 the one its kernel ran it at (fp32_precision_codes)."""
    out = np.asarray(op_dtype).astype(object).copy()
    if len(out) == 0:
        return out
    fp32 = out == "fp32"
    out[fp32] = np.array(FP32_PRECISIONS, object)[fp32_precision_codes(kernel_names)][fp32]
    return out


def apply_overrides(spec: GpuSpec | None, peak_tflops: float | Mapping[str, float] | None = None,
                    bandwidth_gbs: float | None = None, price: float | None = None) -> GpuSpec | None:
    """A copy of ``spec`` with the user's numbers in place (``--peak-tflops``, ``--bandwidth-gbs``, ``--gpu-price``).

    ``peak_tflops`` as one number replaces the peak of every dtype (the user states what their
    device does); as a mapping it replaces only the dtypes it names. With ``spec=None`` a
    user-defined spec is made when a peak is given (bandwidth NaN and price None unless given);
    without a peak there is nothing to build and None comes back.
    """
    if spec is None:
        if peak_tflops is None:
            return None
        spec = GpuSpec(model="user-specified", peak=MappingProxyType({}), memory_bandwidth=float("nan"),
                       price_per_hour=None, source="user", price_source="")
    changes: dict[str, Any] = {}
    if peak_tflops is not None:
        if isinstance(peak_tflops, Mapping):
            peak = dict(spec.peak)
            peak.update({k: float(v) * T for k, v in peak_tflops.items()})
        else:
            peak = {d: float(peak_tflops) * T for d in DTYPES}
        changes["peak"] = MappingProxyType(peak)
        changes["source"] = f"{spec.source}; peak overridden by user" if spec.source != "user" else "user"
    if bandwidth_gbs is not None:
        changes["memory_bandwidth"] = float(bandwidth_gbs) * GB
    if price is not None:
        changes["price_per_hour"] = float(price)
        changes["price_source"] = "user (--gpu-price)"
    return dataclasses.replace(spec, **changes) if changes else spec


# The CPU as a device (calibrated peaks) lives in cpu_peak; its entry points are part of this API,
# resolved on first use because cpu_peak builds on GpuSpec above.
_CPU_API = ("cpu_spec", "raise_cpu_peak", "start_cpu_calibration", "CPU_PRICE_PER_THREAD_HOUR")


def __getattr__(name: str) -> Any:
    if name in _CPU_API:
        from . import cpu_peak

        return getattr(cpu_peak, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
