"""A convolution's FLOPs sit on the kernels that multiply, not on the transposes, fills and casts beside them.

MIOpen runs each convolution of the MI300X ResNet trace as an implicit-GEMM kernel (``igemm_*``, CK's
``kernel_grouped_conv_fwd_*``, Tensile's ``Cijk_*``) wrapped in ``batched_transpose_*`` /
``transpose_NCHW2CNHW`` layout kernels, a ``SubTensorOpWithScalar1d`` fill and a
``SubTensorOpWithCastTensor1d`` cast; cuDNN on the V100 adds ``nchwToNhwcKernel`` and friends. The oracle
here reads the raw JSON on its own: each conv op's kernels are the ones launched directly inside it, its
FLOPs come from its ``Input Dims`` (and ``Concrete Inputs``) by the convolution formula, the kernels that
multiply are named by the regex below, and their FLOPs split by duration among them; every other kernel of
the op carries 0. The op's total is the formula's, as before the split changed.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from functools import lru_cache
from math import prod

import numpy as np
import pyarrow as pa
import pytest

from conftest import ingested, ns_of_us, raw_trace
from plasmient_trace.metrics.flops import split_op_work
from plasmient_trace.metrics.flops.kernel_roles import ROLE_ARITHMETIC, ROLE_MOVES, ROLE_OTHER, kernel_role, kernel_roles

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


def _conv_forward_flops(dims: list, out_spatial: list[int]) -> float:
    x, w = dims[0], dims[1]
    return 2.0 * x[0] * w[0] * prod(out_spatial) * prod(w[1:])


def _miopen_forward(e: dict, _trace: str) -> float:
    """aten::miopen_convolution(self, weight, bias, padding, stride, dilation, groups, benchmark, deterministic)."""
    dims, ci = e["args"]["Input Dims"], e["args"]["Concrete Inputs"]
    pad, stride, dil = _ints(ci[3]), _ints(ci[4]), _ints(ci[5])
    k = dims[1][2:]
    out = [(i + 2 * p - d * (kk - 1) - 1) // s + 1 for i, p, s, d, kk in zip(dims[0][2:], pad, stride, dil, k)]
    return _conv_forward_flops(dims, out)


def _backward(e: dict, _trace: str) -> float:
    """aten::convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
    output_padding, groups, output_mask): the forward's FLOPs once per gradient output_mask asks for."""
    dims, ci = e["args"]["Input Dims"], e["args"]["Concrete Inputs"]
    mask = ast.literal_eval(ci[10])
    return 2.0 * prod(dims[0]) * prod(dims[2][1:]) * (int(mask[0]) + int(mask[1]))


def _cudnn_forward(e: dict, trace: str) -> float:
    """The V100 trace's aten::cudnn_convolution records no stride: the output size is the first later op on the
    thread whose first input is [N, C_out, H, W] (its batch_norm)."""
    x, w = e["args"]["Input Dims"][0], e["args"]["Input Dims"][1]
    end = e["ts"] + e["dur"]
    later = sorted((o for o in _ops(trace)[e["tid"]] if o["ts"] >= end), key=lambda o: o["ts"])
    for o in later:
        first = (o["args"].get("Input Dims") or [[]])[0]
        if len(first) == 4 and first[:2] == [x[0], w[0]]:
            return _conv_forward_flops([x, w], first[2:])
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
    """Every ``op_name`` op of the raw trace (all of them ran inside the recorded steps): its FLOPs by ``formula``,
    all on the kernels that multiply (by duration among them), 0 on the rest, the op's total unchanged.
    Returns (ops, helper kernels among their kernels)."""
    by_corr, by_id = _spans(name)
    checked = helpers = 0
    for op, kernels in _raw_conv_ops(name, op_name):
        spans = [by_corr.get(k["args"]["correlation"]) for k in kernels]
        assert kernels and all(s is not None for s in spans), op["args"]["Input Dims"]
        want = formula(op, name)
        mult = [MULTIPLIES.search(k["name"]) is not None for k in kernels]
        assert any(mult), [k["name"] for k in kernels]
        weight = np.array([ns_of_us(float(k["dur"])) + 1.0 if m else 0.0 for k, m in zip(kernels, mult)])
        for k, s, m, share in zip(kernels, spans, mult, weight / weight.sum()):
            if m:
                assert _executed(s) == pytest.approx(want * share, rel=1e-3), (op["args"]["Input Dims"], k["name"])
            else:
                assert _executed(s) == 0.0, (op["args"]["Input Dims"], k["name"], _executed(s))
                helpers += bool(HELPER.search(k["name"]))
        assert sum(_executed(s) for s in spans) == pytest.approx(want, rel=1e-12)
        parent = by_id[(spans[0]["trace_id"], spans[0]["parent_span_id"])]
        assert parent["plasmient.level"] == "op" and parent["name"] == op_name
        assert _executed(parent) == pytest.approx(want, rel=1e-12)
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
    2.312e9 / (1307.4e12 x its duration), 0.077-0.079 (it read 0.035 with five helpers sharing the FLOPs)."""
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
                assert s["plasmient.bound"] == "compute"
                if s.get("plasmient.flops"):  # a recomputed forward's MFU leaves its FLOPs out
                    dur_s = (s["end_ns"] - s["start_ns"]) / 1e9
                    assert s["plasmient.mfu"] == pytest.approx(s["plasmient.flops"] / (1307.4e12 * dur_s), rel=1e-6)
                    seen += 1
            else:
                assert HELPER.search(k["name"]) and _executed(s) == 0.0
                assert s["plasmient.bound"] in ("memory", "latency")
                assert s["plasmient.arithmetic_intensity"] == 0.0
    assert seen >= 3


# ---- the rule itself, on made-up ops (kernel_roles / split_op_work)

NAMES = {
    # data movement: by the function name, whatever the template arguments say (cuDNN, cuBLAS types)
    "batched_transpose_32x32_half": ROLE_MOVES,
    "transpose_NCHW2CNHW_V2_2D_WG_off64": ROLE_MOVES,
    "SubTensorOpWithCastTensor1d": ROLE_MOVES,
    "SubTensorOpWithScalar1d": ROLE_MOVES,
    "void nchwToNhwcKernel<float, float, float, true, false, (cudnnKernelDataType_t)0>(int, int, float const*)": ROLE_MOVES,
    "void cudnn::engines_precompiled::nhwcToNchwKernel<__nv_bfloat16, float>(cudnn::engines_precompiled::p)": ROLE_MOVES,
    "cask_cudnn::computeOffsetsKernel(cask_cudnn::ComputeOffsetsParams)": ROLE_MOVES,
    "void cudnn::cnn::im2col4d_kernel<float, long>(cudnn::cnn::im2col4d_params, cudnnConvolutionStruct)": ROLE_MOVES,
    "void splitKreduce_kernel<float, float, float, float>(cublasSplitKParams<float>, float const*)": ROLE_MOVES,
    "void scal_kernel<float, float, 1, false, 6, 5, 5, 3>(cublasTransposeParams<float>, float const*)": ROLE_MOVES,
    "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::direct_copy>>(int)": ROLE_MOVES,
    # the multiplies: anywhere in the name (a CUTLASS GEMM is named in its template argument)
    "igemm_fwd_gtcx3_nhwc_bf16_bx0_ex1_bt128x128x32_wt32x32x8_ws1x1_wr2x2_ta1x4x4x1_1x8x1x32_tb1x4x1x1_1x8x1x32": ROLE_ARITHMETIC,
    "Cijk_Ailk_Bljk_BBS_BH_MT32x32x64_MI16x16x16x1_SN_1LDSB0_APM1_ABV0_ACED0_AF0EM1": ROLE_ARITHMETIC,
    "_ZN2ck16tensor_operation6device12_GLOBAL__N_139kernel_grouped_conv_fwd_xdl_cshuffle_v3INS_28GridwiseGemmE": ROLE_ARITHMETIC,
    "_ZN2ck16tensor_operation6device37kernel_batched_gemm_xdlops_bwd_weightINS_47GridwiseGemm_RightPadIiiEE": ROLE_ARITHMETIC,
    "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x6_tn_align8>(cutlass_80::Params)": ROLE_ARITHMETIC,
    "void cutlass__5x_cudnn::Kernel<cutlass_tensorop_bf16_s16816fprop_optimized_bf16_256x64_32x4_nhwc_align8>(P)": ROLE_ARITHMETIC,
    "volta_scudnn_128x64_relu_interior_nn_v1": ROLE_ARITHMETIC,
    "void cudnn::detail::dgrad_engine<float, 512, 6, 5, 3, 3, 3, false>(int, int, int, float const*)": ROLE_ARITHMETIC,
    "void cudnn::winograd_nonfused::winogradForwardData4x4<float, float>(cudnn::winograd_nonfused::P)": ROLE_ARITHMETIC,
    "nvjet_tst_144x128_64x6_2x1_v_bz_bias_TNN": ROLE_ARITHMETIC,
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1": ROLE_ARITHMETIC,
    "_matmul_ogs_NNT_bf16xbf16xmxfp4_16x128x256x1": ROLE_ARITHMETIC,
    # neither list knows it
    "void pytorch_flash::flash_fwd_kernel<pytorch_flash::Flash_fwd_kernel_traits<64, 128>>(pytorch_flash::P)": ROLE_OTHER,
    "moe_align_block_size_kernel": ROLE_OTHER,
}


def test_kernel_roles_by_name():
    assert {n: kernel_role(n) for n in NAMES} == NAMES
    names = pa.array(list(NAMES) + [None] + list(NAMES)[:3])
    assert kernel_roles(names).tolist() == [*NAMES.values(), ROLE_OTHER, *list(NAMES.values())[:3]]


def _split(roles, durations, owners, models):
    owner = np.asarray(owners)
    return split_op_work(owner, owner >= 0, np.asarray(durations), np.asarray(roles, np.int8), np.asarray(models),
                         len(models))


def test_a_conv_puts_its_flops_on_its_gemms_by_duration_and_its_bytes_on_every_kernel():
    #          transpose     igemm            fill        other GEMM       the next op's kernel
    flop, byte = _split([ROLE_MOVES, ROLE_ARITHMETIC, ROLE_MOVES, ROLE_ARITHMETIC, ROLE_ARITHMETIC],
                        [999, 2999, 999, 999, 0], [0, 0, 0, 0, 1], ["conv", "gemm"])
    assert flop.tolist() == pytest.approx([0, 0.75, 0, 0.25, 1])
    assert byte.tolist() == pytest.approx([1 / 6, 3 / 6, 1 / 6, 1 / 6, 1])


def test_with_no_gemm_kernel_recognised_the_flops_keep_the_duration_split_less_the_helpers():
    # an unrecognised kernel beside a transpose: the unrecognised one multiplies
    flop, _ = _split([ROLE_MOVES, ROLE_OTHER, ROLE_OTHER], [99, 199, 99], [0, 0, 0], ["gemm"])
    assert flop.tolist() == pytest.approx([0, 2 / 3, 1 / 3])
    # only kernels no list knows, or only helpers: today's duration split, nothing dropped
    for role in (ROLE_OTHER, ROLE_MOVES):
        flop, byte = _split([role, role], [299, 99], [0, 0], ["conv"])
        assert flop.tolist() == byte.tolist() == pytest.approx([0.75, 0.25])


def test_other_ops_and_unowned_kernels_keep_the_duration_split():
    # an elementwise op's kernels share by time whatever their names; a kernel no op owns gets nothing
    flop, byte = _split([ROLE_MOVES, ROLE_ARITHMETIC, ROLE_OTHER], [299, 99, 5], [0, 0, -1], ["elementwise"])
    assert flop.tolist() == byte.tolist() == pytest.approx([0.75, 0.25, 0])
