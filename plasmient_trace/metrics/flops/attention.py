"""Attention (sdpa and its flash / efficient / cudnn / math / cpu variants, aten::_flash_attention_*,
aten::_efficient_attention_*, flash_attn::*): 2*B*H*Lq*Lk*(D + Dv), halved only when the recorded
``is_causal`` (or custom_mask_type 1/2) says causal; backward 2.5x the forward (FlashAttention-2's
accounting). Varlen (packed 3-D q) uses total_q * min(total_k, max_k): exact for one sequence, an
upper bound for a packed batch.

Argument positions: each _AttnLayout names the index of q (k and v follow), is_causal / the
mask type and max_seqlen_k in that op's schema."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from .core import OpArgs, FlopResult, _reg


@dataclass(frozen=True)
class _AttnLayout:
    layout: str          # 'bhld' (sdpa family) or 'blhd' (flash/efficient kernels)
    q: int = 0
    causal: int | None = None
    mask_type: int | None = None   # xformers custom_mask_type: 1/2 are causal
    max_k: int | None = None
    backward: bool = False


def _attention(a: OpArgs, lay: _AttnLayout) -> FlopResult:
    Q, K, V = a.shape(lay.q), a.shape(lay.q + 1), a.shape(lay.q + 2)
    if Q is None or K is None or V is None or len(Q) != len(K) or len(Q) not in (3, 4) or len(V) != len(Q):
        return None
    if len(Q) == 3 and lay.layout == "bhld":
        B, Lq, D = Q  # sdpa without a head dim: [N, L, E]
        H, Lk = 1, K[1]
    elif len(Q) == 3:
        # Packed varlen [total, H, D]: per-sequence lengths live in tensors Kineto never records.
        total_q, H, D = Q
        total_k = K[0]
        max_k = a.value(lay.max_k)
        lk = min(total_k, max_k) if isinstance(max_k, int) and not isinstance(max_k, bool) and max_k > 0 else total_k
        B, Lq, Lk = 1, total_q, lk
    elif lay.layout == "bhld":
        B, H, Lq, D = Q
        Lk = K[2]
    else:
        B, Lq, H, D = Q
        Lk = K[1]
    Dv = V[-1]
    flops = 2.0 * B * H * Lq * Lk * (D + Dv)
    causal = a.value(lay.causal) is True
    if lay.mask_type is not None:
        mt = a.value(lay.mask_type)
        causal = causal or (isinstance(mt, int) and not isinstance(mt, bool) and mt in (1, 2))
    if causal:
        flops *= 0.5
    es = a.es(lay.q)
    qkv = a.nbytes(lay.q) + a.nbytes(lay.q + 1) + a.nbytes(lay.q + 2)
    out = B * H * Lq * Dv * es if len(Q) == 4 else Lq * H * Dv * es
    if lay.backward:
        # reads dout, q, k, v, out; writes dq, dk, dv
        return 2.5 * flops, 2 * qkv + 2 * out, "attention"
    return flops, qkv + out, "attention"



# ---- registrations (positions in the comments above each formula)

_ATTN: dict[str, _AttnLayout] = {
    "aten::scaled_dot_product_attention": _AttnLayout("bhld", causal=5),
    "aten::_scaled_dot_product_attention_math": _AttnLayout("bhld", causal=5),
    "aten::_scaled_dot_product_flash_attention": _AttnLayout("bhld", causal=4),
    "aten::_scaled_dot_product_flash_attention_for_cpu": _AttnLayout("bhld", causal=4),
    "aten::_scaled_dot_product_efficient_attention": _AttnLayout("bhld", causal=6),
    "aten::_scaled_dot_product_cudnn_attention": _AttnLayout("bhld", causal=6),
    "aten::_scaled_dot_product_fused_attention_overrideable": _AttnLayout("bhld", causal=5),
    "aten::_cudnn_attention_forward": _AttnLayout("bhld", causal=10, max_k=7),
    "aten::_flash_attention_forward": _AttnLayout("blhd", causal=8, max_k=6),
    "aten::_efficient_attention_forward": _AttnLayout("blhd", mask_type=9, max_k=7),
    "flash_attn::_flash_attn_forward": _AttnLayout("blhd", causal=5),
    "flash_attn::_flash_attn_varlen_forward": _AttnLayout("blhd", causal=9, max_k=6),
    "aten::_scaled_dot_product_flash_attention_backward": _AttnLayout("bhld", q=1, causal=11, backward=True),
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": _AttnLayout("bhld", q=1, causal=7, backward=True),
    "aten::_scaled_dot_product_efficient_attention_backward": _AttnLayout("bhld", q=1, causal=11, backward=True),
    "aten::_scaled_dot_product_cudnn_attention_backward": _AttnLayout("bhld", q=1, causal=14, backward=True),
    "aten::_scaled_dot_product_fused_attention_overrideable_backward": _AttnLayout("bhld", q=1, causal=13, backward=True),
    "aten::_cudnn_attention_backward": _AttnLayout("bhld", q=1, causal=14, max_k=12, backward=True),
    "aten::_flash_attention_backward": _AttnLayout("blhd", q=1, causal=11, max_k=9, backward=True),
    "aten::_efficient_attention_backward": _AttnLayout("blhd", q=1, mask_type=14, max_k=9, backward=True),
    "flash_attn::_flash_attn_backward": _AttnLayout("blhd", q=1, causal=11, backward=True),
    "flash_attn::_flash_attn_varlen_backward": _AttnLayout("blhd", q=1, causal=15, max_k=12, backward=True),
}
for _name, _lay in _ATTN.items():
    _reg([_name], partial(_attention, lay=_lay))

