"""A culprit's suggestion names the kind of memory-bound work its kernel and op names show, in a fixed order
(attention, then GEMM, then convolution, then elementwise), and only for memory-bound rows."""

from __future__ import annotations

import pytest

from plasmient_trace.metrics.culprit import suggestion


@pytest.mark.parametrize(("kernel", "op", "words"), [
    ("flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4>>", "aten::_flash_attention_forward", "attention"),
    ("ampere_sgemm_128x64_tn", "aten::addmm", "GEMM"),
    ("implicit_convolve_sgemm", "aten::cudnn_convolution", "GEMM"),  # 'sgemm' is a GEMM before it is a conv
    ("cudnn::winograd::generateWinogradTilesKernel", "aten::cudnn_convolution", "convolution"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "aten::add", "elementwise"),
    ("some_custom_kernel", "my::op", "raise arithmetic intensity"),
])
def test_memory_bound_work_is_named_by_its_first_matching_family(kernel: str, op: str, words: str) -> None:
    for _ in range(2):  # the second call is answered from the per-name cache
        assert words in suggestion(kernel, op, "model.layer", "memory", "kernel")


def test_a_compute_bound_gemm_gets_compute_advice_not_the_memory_family() -> None:
    text = suggestion("ampere_sgemm_128x64_tn", "aten::addmm", None, "compute", "kernel")
    assert text.startswith("compute-bound") and "GEMM" not in text
