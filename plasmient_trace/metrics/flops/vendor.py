"""Vendor and serving-stack ops (vLLM ``_C::``, ``vllm::``, aiter, SGLang) modelled from their recorded
shapes and each op's documented argument order (written next to each formula)."""

from __future__ import annotations

from .core import FlopResult, OpArgs, _prod, _reg


def _vllm_rms_norm(a: OpArgs) -> FlopResult:
    # _C::rms_norm(out, input, weight, eps)
    X = a.shape(1)
    if X is None:
        return None
    return 4.0 * _prod(X), a.nbytes(0) + a.nbytes(1) + a.nbytes(2), "norm"


def _vllm_fused_add_rms_norm(a: OpArgs) -> FlopResult:
    # _C::fused_add_rms_norm(input, residual, weight, eps): residual += input; input = rms_norm(residual)
    X = a.shape(0)
    if X is None:
        return None
    return 5.0 * _prod(X), 2 * (a.nbytes(0) + a.nbytes(1)) + a.nbytes(2), "norm"


# -------------------------------------------------------------------------------------- softmax


_reg(["_C::rms_norm"], _vllm_rms_norm)
_reg(["_C::fused_add_rms_norm"], _vllm_fused_add_rms_norm)
