"""Which kernels of a matmul or convolution take its work (metrics.flops.kernel_roles, ownership.split_op_work),
on made-up ops; tests/test_flops_helper_kernels.py checks the real MI300X and V100 traces."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from plasmient_trace.metrics.flops import split_op_work
from plasmient_trace.metrics.flops.kernel_roles import ROLE_ARITHMETIC, ROLE_MOVES, ROLE_OTHER, kernel_role, kernel_roles

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
    share, passed = split_op_work(owner, owner >= 0, np.asarray(durations), np.asarray(roles, np.int8),
                                  np.asarray(models), len(models))
    return share.tolist(), passed.tolist()


def test_a_conv_puts_its_work_on_its_gemms_by_duration():
    #          transpose     igemm            fill        other GEMM       the next op's kernel
    share, passed = _split([ROLE_MOVES, ROLE_ARITHMETIC, ROLE_MOVES, ROLE_ARITHMETIC, ROLE_ARITHMETIC],
                           [999, 2999, 999, 999, 0], [0, 0, 0, 0, 1], ["conv", "gemm"])
    assert share == pytest.approx([0, 0.75, 0, 0.25, 1])
    assert passed == [True, False, True, False, False]


def test_with_no_gemm_kernel_recognised_the_work_keeps_the_duration_split_less_the_helpers():
    # an unrecognised kernel beside a transpose: the unrecognised one multiplies
    assert _split([ROLE_MOVES, ROLE_OTHER, ROLE_OTHER], [99, 199, 99], [0, 0, 0], ["gemm"]) == (
        pytest.approx([0, 2 / 3, 1 / 3]), [True, False, False])
    # only kernels no list knows, or only helpers: the plain duration split, nothing dropped
    for role in (ROLE_OTHER, ROLE_MOVES):
        assert _split([role, role], [299, 99], [0, 0], ["conv"]) == (pytest.approx([0.75, 0.25]), [False, False])


def test_other_ops_and_unowned_kernels_keep_the_duration_split():
    # an elementwise op's kernels share by time whatever their names; a kernel no op owns gets nothing
    assert _split([ROLE_MOVES, ROLE_ARITHMETIC, ROLE_OTHER], [299, 99, 5], [0, 0, -1], ["elementwise"]) == (
        pytest.approx([0.75, 0.25, 0]), [False, False, False])
