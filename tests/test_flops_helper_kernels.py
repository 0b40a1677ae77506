"""A convolution's FLOPs sit on the kernels that multiply, not on the transposes, fills and casts beside them.

MIOpen runs each convolution of the MI300X ResNet trace as an implicit-GEMM kernel (``igemm_*``, CK's
``kernel_grouped_conv_fwd_*``, Tensile's ``Cijk_*``) wrapped in ``batched_transpose_*`` /
``transpose_NCHW2CNHW`` layout kernels, a ``SubTensorOpWithScalar1d`` fill and a
``SubTensorOpWithCastTensor1d`` cast; cuDNN on the V100 adds ``nchwToNhwcKernel`` and friends. The oracle
here reads the raw JSON on its own: each conv op's kernels are the ones launched directly inside it, its
FLOPs come from its ``Input Dims`` (and ``Concrete Inputs``) by the convolution formula, the kernels that
multiply are named by the regex below, and their FLOPs split by duration among them; every other kernel of
the op carries 0. The op's bytes (each input read once, the output written once) go with its FLOPs, so a
GEMM kernel's arithmetic intensity is its op's; a helper's bytes are outside the op's model (absent), and it
is memory-bound by nature (latency-bound when short). The op's totals are the formula's, as before.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from functools import lru_cache
from math import prod

import numpy as np
import pytest

from conftest import ingested, ns_of_us, raw_trace

MI300X = "mi300x/resnet_act_checkpoint_rank0_of8.json.gz"
V100 = "v100/resnet50_training.json.gz"

# The oracle's own reading of the names in these two traces: kernels that do a convolution's multiplies
# (MIOpen/CK/Tensile implicit GEMMs; cuDNN's implicit/explicit GEMM, dgrad/wgrad engines, Winograd stages,
# cuBLAS sgemm) and the data-movement helpers the audit found carrying FLOPs.
MULTIPLIES = re.compile(r"igemm_|kernel_grouped_conv_fwd|kernel_batched_gemm|^Cijk_|scudnn|sgemm|convolve_sgemm"
                        r"|dgrad_engine|wgrad_alg\d_engine|winograd")
HELPER = re.compile(r"batched_transpose|transpose_(NCHW2CNHW|CNHW2NCHW)|SubTensorOp|nchwToNhwc|nhwcToNchw")
RUNTIME = {"cuda_runtime", "Runtime"}
KERNEL = {"kernel", "Kernel"}
OPS = {"cpu_op", "Operator"}


def _ints(text: str) -> list[int]:
    return [int(v) for v in ast.literal_eval(text)]


ELEMENT_SIZE = {"c10::BFloat16": 2, "c10::Half": 2, "float": 4}


def _conv_forward_cost(e: dict, out_spatial: list[int]) -> tuple[float, float]:
    """(FLOPs, bytes) of a forward convolution without bias: 2 * numel(out) * prod(weight[1:]); input, weight
    read once, output written once."""
    x, w = e["args"]["Input Dims"][0], e["args"]["Input Dims"][1]
    out = x[0] * w[0] * prod(out_spatial)
    es = ELEMENT_SIZE[e["args"]["Input type"][0]]
    return 2.0 * out * prod(w[1:]), float((prod(x) + prod(w) + out) * es)


def _miopen_forward(e: dict, _trace: str) -> tuple[float, float]:
    """aten::miopen_convolution(self, weight, bias, padding, stride, dilation, groups, benchmark, deterministic)."""
    dims, ci = e["args"]["Input Dims"], e["args"]["Concrete Inputs"]
    assert dims[2] == []  # no bias
    pad, stride, dil = _ints(ci[3]), _ints(ci[4]), _ints(ci[5])
    k = dims[1][2:]
    out = [(i + 2 * p - d * (kk - 1) - 1) // s + 1 for i, p, s, d, kk in zip(dims[0][2:], pad, stride, dil, k)]
    return _conv_forward_cost(e, out)


def _backward(e: dict, _trace: str) -> tuple[float, float]:
    """aten::convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
    output_padding, groups, output_mask): the forward's FLOPs once per gradient output_mask asks for; grad_output,
    input and weight read, each gradient asked for written."""
    dims, ci = e["args"]["Input Dims"], e["args"]["Concrete Inputs"]
    mask = ast.literal_eval(ci[10])
    g, x, w = (prod(d) for d in dims[:3])
    es = ELEMENT_SIZE[e["args"]["Input type"][0]]
    nbytes = (g + x + w + x * mask[0] + w * mask[1] + dims[2][0] * mask[2]) * es
    return 2.0 * g * prod(dims[2][1:]) * (int(mask[0]) + int(mask[1])), float(nbytes)


def _cudnn_forward(e: dict, trace: str) -> tuple[float, float]:
    """The V100 trace's aten::cudnn_convolution records no stride: the output size is the first later op on the
    thread whose first input is [N, C_out, H, W] (its batch_norm)."""
    x, w = e["args"]["Input Dims"][0], e["args"]["Input Dims"][1]
    end = e["ts"] + e["dur"]
    later = sorted((o for o in _ops(trace)[e["tid"]] if o["ts"] >= end), key=lambda o: o["ts"])
    for o in later:
        first = (o["args"].get("Input Dims") or [[]])[0]
        if len(first) == 4 and first[:2] == [x[0], w[0]]:
            return _conv_forward_cost(e, first[2:])
    raise AssertionError(f"no consumer of {e['name']} {x}x{w}")


@lru_cache(maxsize=None)
def _ops(name: str) -> dict:
    """The raw trace's ops by thread."""
    out = defaultdict(list)
    for e in raw_trace(name)["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") in OPS:
            out[e["tid"]].append(e)
    return out


@lru_cache(maxsize=None)
def _raw_conv_ops(name: str, op_name: str) -> list[tuple[dict, list[dict]]]:
    """Each raw op called ``op_name`` with the kernels launched directly inside it (no deeper op on its thread
    encloses the launch)."""
    ev = raw_trace(name)["traceEvents"]
    kernel_of = {e["args"]["correlation"]: e for e in ev if e.get("ph") == "X" and e.get("cat") in KERNEL}
    launches = defaultdict(list)
    for e in ev:
        if e.get("ph") == "X" and e.get("cat") in RUNTIME and e["args"].get("correlation") in kernel_of:
            launches[e["tid"]].append(e)
    out = []
    for tid, ops in _ops(name).items():
        for op in ops:
            if op["name"] != op_name:
                continue
            lo, hi = op["ts"], op["ts"] + op["dur"]
            inner = [o for o in ops if o is not op and lo <= o["ts"] and o["ts"] + o["dur"] <= hi]
            out.append((op, [kernel_of[e["args"]["correlation"]] for e in launches[tid] if lo <= e["ts"] <= hi
                             and not any(o["ts"] <= e["ts"] <= o["ts"] + o["dur"] for o in inner)]))
    return out


@lru_cache(maxsize=None)
def _spans(name: str) -> tuple[dict, dict]:
    """Kernel spans by correlation id, and every span by (trace, span id)."""
    rows = ingested(name).batch.table.to_pylist()
    by_corr = {r["plasmient.correlation_id"]: r for r in rows if r["plasmient.level"] == "kernel"}
    by_id = {(r["trace_id"], r["span_id"]): r for r in rows}
    return by_corr, by_id


def _executed(span: dict) -> float:
    """Model FLOPs plus the recomputed forward's (activation checkpointing reports those apart)."""
    return (span.get("plasmient.flops") or 0.0) + (span.get("plasmient.flops.recompute") or 0.0)


def _check(name: str, op_name: str, formula) -> tuple[int, int]:
    """Every ``op_name`` op of the raw trace (all of them ran inside the recorded steps): its FLOPs and bytes by
    ``formula``, all on the kernels that multiply (by duration among them); 0 FLOPs and no bytes on the rest,
    which read memory- or latency-bound; the op's totals unchanged. Returns (ops, helper kernels among their
    kernels)."""
    by_corr, by_id = _spans(name)
    checked = helpers = 0
    for op, kernels in _raw_conv_ops(name, op_name):
        spans = [by_corr.get(k["args"]["correlation"]) for k in kernels]
        assert kernels and all(s is not None for s in spans), op["args"]["Input Dims"]
        want, want_bytes = formula(op, name)
        mult = [MULTIPLIES.search(k["name"]) is not None for k in kernels]
        assert any(mult), [k["name"] for k in kernels]
        weight = np.array([ns_of_us(float(k["dur"])) + 1.0 if m else 0.0 for k, m in zip(kernels, mult)])
        for k, s, m, share in zip(kernels, spans, mult, weight / weight.sum()):
            if m:
                assert _executed(s) == pytest.approx(want * share, rel=1e-3), (op["args"]["Input Dims"], k["name"])
                assert s["plasmient.bytes"] == pytest.approx(want_bytes * share, rel=1e-3), k["name"]
            else:
                assert _executed(s) == 0.0, (op["args"]["Input Dims"], k["name"], _executed(s))
                assert s.get("plasmient.bytes") is None and s.get("plasmient.arithmetic_intensity") is None
                assert s["plasmient.bound"] in ("memory", "latency"), (k["name"], s["plasmient.bound"])
                helpers += bool(HELPER.search(k["name"]))
        assert sum(_executed(s) for s in spans) == pytest.approx(want, rel=1e-12)
        assert sum(s.get("plasmient.bytes") or 0.0 for s in spans) == pytest.approx(want_bytes, rel=1e-12)
        parent = by_id[(spans[0]["trace_id"], spans[0]["parent_span_id"])]
        assert parent["plasmient.level"] == "op" and parent["name"] == op_name
        assert _executed(parent) == pytest.approx(want, rel=1e-12)
        assert parent["plasmient.bytes"] == pytest.approx(want_bytes, rel=1e-12)
        checked += 1
    return checked, helpers


def test_mi300x_forward_convolutions_put_their_flops_on_the_implicit_gemm():
    # 480 helpers (transposes, fills, casts) beside the GEMMs of 117 convolutions; the audit's 1,345 helper
    # kernels are these, the backward's 525 and 340 that no launch record joins to an op (no FLOPs at all)
    assert _check(MI300X, "aten::miopen_convolution", _miopen_forward) == (117, 480)


def test_mi300x_convolution_backward_puts_its_flops_on_the_gradient_gemms():
    assert _check(MI300X, "aten::convolution_backward", _backward) == (60, 525)


def test_v100_cudnn_convolutions_keep_layout_kernels_at_zero_flops():
    # 12 nchwToNhwc + 6 nhwcToNchw, beside the GEMMs of one conv a step in each of the 6 steps; the other
    # convs' offset, im2col and scaling kernels carry 0 too
    assert _check(V100, "aten::cudnn_convolution", _cudnn_forward) == (318, 18)


def test_the_audits_example_igemm_carries_the_whole_convolution():
    """[10,512,7,7] x [512,512,3,3]: 2.312 GFLOP, all on its igemm kernel, whose MFU is then
    2.312e9 / (1307.4e12 x its duration), 0.077-0.079 (it read 0.035 with five helpers sharing the FLOPs), and
    whose arithmetic intensity is the op's, 2.312e9 / 5.722e6 bytes = 404 (MI300X's bf16 ridge point: 247)."""
    by_corr, _ = _spans(MI300X)
    seen = 0
    for op, kernels in _raw_conv_ops(MI300X, "aten::miopen_convolution"):
        if op["args"]["Input Dims"][:2] != [[10, 512, 7, 7], [512, 512, 3, 3]]:
            continue
        spans = [by_corr.get(k["args"]["correlation"]) for k in kernels]
        if any(s is None for s in spans):
            continue
        for k, s in zip(kernels, spans):
            if k["name"].startswith("igemm_fwd"):
                assert _executed(s) == pytest.approx(2 * 10 * 512 * 49 * 512 * 9, rel=1e-12)
                assert s["plasmient.bytes"] == pytest.approx((10 * 512 * 49 * 2 + 512 * 512 * 9) * 2, rel=1e-12)
                assert s["plasmient.arithmetic_intensity"] == pytest.approx(404.0658554, rel=1e-9)
                assert s["plasmient.bound"] == "compute"
                if s.get("plasmient.flops"):  # a recomputed forward's MFU leaves its FLOPs out
                    dur_s = (s["end_ns"] - s["start_ns"]) / 1e9
                    assert s["plasmient.mfu"] == pytest.approx(s["plasmient.flops"] / (1307.4e12 * dur_s), rel=1e-6)
                    seen += 1
            else:
                assert HELPER.search(k["name"]) and _executed(s) == 0.0
                assert s["plasmient.bound"] in ("memory", "latency")
                assert s.get("plasmient.arithmetic_intensity") is None
    assert seen >= 3

