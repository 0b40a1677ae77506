"""Vendor and serving-stack ops (vLLM ``_C::``, ``vllm::``, aiter, SGLang) modelled from their recorded
shapes and each op's documented argument order (written next to each formula)."""

from __future__ import annotations

import re
from functools import partial

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


def _aiter_rms_norm(a: OpArgs) -> FlopResult:
    # aiter::rms_norm(input [N, D] 0, weight [D] 1, eps 2, sensitive 3) and
    # vllm::rocm_aiter_rms_norm(input 0, weight 1, eps 2): rms norm with a weight, 4 per element
    X = a.shape(0)
    if X is None or not a.is_tensor(1):
        return None
    return 4.0 * _prod(X), 2 * a.nbytes(0) + a.nbytes(1), "norm"


def _aiter_rmsnorm_add(a: OpArgs, x: int, res: int, weight: int) -> FlopResult:
    # aiter::rmsnorm2d_fwd_with_add_ck(out 0, input 1, residual_in 2, residual_out 3, weight 4, eps 5, ...)
    # vllm::rocm_aiter_rmsnorm2d_fwd_with_add(input 0, residual 1, weight 2, eps 3)
    # residual = x + residual; out = rms_norm(residual) * weight: 1 (add) + 4 per element.
    X = a.shape(x)
    if X is None or a.shape(res) != X or not a.is_tensor(weight):
        return None
    writes = a.nbytes(x) * 2  # the normalised output and the updated residual
    return 5.0 * _prod(X), a.nbytes(x) + a.nbytes(res) + a.nbytes(weight) + writes, "norm"


def _vllm_rotary_embedding(a: OpArgs) -> FlopResult:
    # _C::rotary_embedding(positions [T] 0, query [T, Hq*D] 1, key [T, Hk*D] 2, head_size 3,
    # cos_sin_cache [max_pos, rot_dim] 4, is_neox 5), in place on query and key. Each rotated pair
    # (x1, x2) -> (x1*cos - x2*sin, x2*cos + x1*sin) is 6 FLOPs, 3 per rotated element.
    P, Q, K, C = a.shape(0), a.shape(1), a.shape(2), a.shape(4)
    head = a.value(3)
    if P is None or Q is None or C is None or len(C) != 2:
        return None
    if not isinstance(head, int) or isinstance(head, bool) or head <= 0:
        return None
    tokens = _prod(P)
    heads = Q[-1] // head + (K[-1] // head if K is not None and K else 0)
    rot = C[1]
    touched = tokens * heads * rot
    nb = 2 * (a.nbytes(1) + a.nbytes(2)) + a.nbytes(0) + tokens * rot * a.es(4)
    return 3.0 * touched, nb, "elementwise"


def _reshape_and_cache(a: OpArgs) -> FlopResult:
    # _C_cache_ops::reshape_and_cache(_flash)(key [T, Hk, D] 0, value 1, key_cache 2, value_cache 3,
    # slot_mapping [T] 4, ...): scatters this step's K/V into the paged cache, no math.
    if not (a.is_tensor(0) and a.is_tensor(1) and a.is_tensor(4)):
        return None
    kv = a.nbytes(0) + a.nbytes(1)
    return 0.0, 2 * kv + a.nbytes(4), "elementwise"


def _static_scaled_fp8_quant(a: OpArgs) -> FlopResult:
    # _C::static_scaled_fp8_quant(out [..] fp8 0, input [..] 1, scale [1] 2): one multiply by the
    # inverse scale per element (the saturating cast is a conversion, not math).
    X = a.shape(1)
    if X is None or a.shape(0) != X:
        return None
    return float(_prod(X)), a.nbytes(1) + a.nbytes(0) + a.nbytes(2), "elementwise"


_reg(["aiter::rms_norm", "vllm::rocm_aiter_rms_norm"], _aiter_rms_norm)
_reg(["_C::static_scaled_fp8_quant"], _static_scaled_fp8_quant)
_reg(["aiter::rmsnorm2d_fwd_with_add_ck"], partial(_aiter_rmsnorm_add, x=1, res=2, weight=4))
_reg(["vllm::rocm_aiter_rmsnorm2d_fwd_with_add"], partial(_aiter_rmsnorm_add, x=0, res=1, weight=2))
_reg(["_C::rotary_embedding"], _vllm_rotary_embedding)
_reg(["_C_cache_ops::reshape_and_cache_flash", "_C_cache_ops::reshape_and_cache"], _reshape_and_cache)


# ---- vLLM paged/ragged attention: needs the batch's sequence lengths, which the op's own shapes
# lack (the KV cache is addressed through block tables). vLLM's profiler names each engine step
# "execute_<n>_context_<n>(sq<a>sk<b>sqsq<c>sqsk<d>)_generation_<n>(sq..sk..sqsq..sqsk..)": sums over
# the step's requests of query length, KV length, query^2 and query*KV. With them:
#   FLOPs = H_q * (d_qk + d_v) * (2*ctx_sqsk - ctx_sqsq + 2*gen_sqsk)
# (each query attends to its KV tokens; a prefill chunk is causal within itself, so half of its
# sq x sq diagonal block is skipped). Without such an annotation the op stays unknown.
VLLM_ATTENTION_OPS = ("vllm::unified_attention_with_output", "vllm::unified_attention")
_STATS = re.compile(r"sq(\d+)sk(\d+)sqsq(\d+)sqsk(\d+)")
_STEP = re.compile(r"context_\d+\((sq\d+sk\d+sqsq\d+sqsk\d+)\)_generation_\d+\((sq\d+sk\d+sqsq\d+sqsk\d+)\)")


def vllm_batch_stats(annotation: str | None) -> dict[str, int] | None:
    """The per-step sequence statistics in a vLLM step annotation, or None when it has none."""
    m = _STEP.search(annotation or "")
    if m is None:
        return None
    out: dict[str, int] = {}
    for prefix, part in (("c_", m.group(1)), ("g_", m.group(2))):
        sq, sk, sqsq, sqsk = (int(x) for x in _STATS.fullmatch(part).groups())  # type: ignore[union-attr]
        out.update({prefix + "sq": sq, prefix + "sk": sk, prefix + "sqsq": sqsq, prefix + "sqsk": sqsk})
    return out


def vllm_attention_cost(args: OpArgs, stats: dict[str, int]) -> FlopResult:
    """(flops, bytes, 'attention') of vllm::unified_attention_with_output(query [T, Hq, Dqk] 0,
    key [T, Hk, Dqk] 1, value [T, Hk, Dv] 2, output [T, Hq, Dv] 3, ...) in a step with ``stats``."""
    Q, K, V = args.shape(0), args.shape(1), args.shape(2)
    if Q is None or K is None or V is None or len(Q) != 3 or len(K) != 3 or len(V) != 3:
        return None
    hq, dqk = Q[1], Q[2]
    hk, dv = K[1], V[2]
    pairs = 2 * stats["c_sqsk"] - stats["c_sqsq"] + 2 * stats["g_sqsk"]
    flops = float(hq * (dqk + dv) * pairs)
    es = args.es(0)
    kv_es = args.es(1) or es
    new_tokens = stats["c_sq"] + stats["g_sq"]
    cached = (stats["c_sk"] - stats["c_sq"]) + (stats["g_sk"] - stats["g_sq"])
    # Q read and output written per new token; this step's K/V read in the query dtype, the cached
    # K/V read once per request from the cache.
    nb = (new_tokens * (hq * dqk + hq * dv) * es + new_tokens * hk * (dqk + dv) * kv_es
          + cached * hk * (dqk + dv) * kv_es)
    return flops, float(nb), "attention"
