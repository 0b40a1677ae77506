"""Attention (sdpa and its flash / efficient / cudnn / math / cpu variants, aten::_flash_attention_*,
aten::_efficient_attention_*, flash_attn::*): 2*B*H*Lq*Lk*(D + Dv) over the score entries the mask keeps;
backward 2.5x the forward (FlashAttention-2's accounting). Varlen (packed 3-D q) uses
total_q * min(total_k, max_k): exact for one sequence, an upper bound for a packed batch.

Causal attention (the recorded ``is_causal``, or custom_mask_type 1/2) keeps half of a square score matrix
(the usual convention, FlashAttention's and TraceLens's). A non-square one (a chunk of queries against a
longer KV cache) keeps what its mask's alignment keeps, counted exactly: PyTorch's sdpa aligns the triangle
to the upper left (``torch.nn.attention.bias.causal_upper_left``: query i sees keys 0..i, so one decode query
sees one key), flash-attn and PyTorch's flash kernels to the lower right (``causal_lower_right``: query i sees
keys 0..i + Lk - Lq, so a decode query sees them all), xformers' mask type 1 upper left and 2 lower right.
Halving those would miscount a prefill chunk against its cache by up to 2x either way. Packed varlen
batches stay halved: their per-sequence lengths are not recorded.

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
    mask_type: int | None = None   # xformers custom_mask_type: 1 causal from the upper left, 2 from the lower right
    max_k: int | None = None
    backward: bool = False
    lower_right: bool = False      # is_causal aligns the triangle to the lower right (flash-attn semantics)


def causal_share(lq: int, lk: int, lower_right: bool) -> float:
    """Share of an Lq x Lk score matrix a causal mask keeps (module docstring): 1/2 when square."""
    if lq == lk or lq <= 0 or lk <= 0:
        return 0.5
    if lower_right:  # query i sees keys 0 .. i + lk - lq
        kept = lq * (lk - lq) + lq * (lq + 1) / 2 if lq <= lk else lk * (lk + 1) / 2
    else:            # query i sees keys 0 .. i
        kept = lq * (lq + 1) / 2 if lq <= lk else lk * (lk + 1) / 2 + (lq - lk) * lk
    return kept / (lq * lk)


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
    lower_right = lay.lower_right
    if lay.mask_type is not None:
        mt = a.value(lay.mask_type)
        if isinstance(mt, int) and not isinstance(mt, bool) and mt in (1, 2):
            causal, lower_right = True, mt == 2
    if causal:
        flops *= 0.5 if len(Q) == 3 else causal_share(Lq, Lk, lower_right)
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
    "aten::_flash_attention_forward": _AttnLayout("blhd", causal=8, max_k=6, lower_right=True),
    "aten::_efficient_attention_forward": _AttnLayout("blhd", mask_type=9, max_k=7),
    "flash_attn::_flash_attn_forward": _AttnLayout("blhd", causal=5, lower_right=True),
    "flash_attn::_flash_attn_varlen_forward": _AttnLayout("blhd", causal=9, max_k=6, lower_right=True),
    "aten::_scaled_dot_product_flash_attention_backward": _AttnLayout("bhld", q=1, causal=11, backward=True),
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": _AttnLayout("bhld", q=1, causal=7, backward=True),
    "aten::_scaled_dot_product_efficient_attention_backward": _AttnLayout("bhld", q=1, causal=11, backward=True),
    "aten::_scaled_dot_product_cudnn_attention_backward": _AttnLayout("bhld", q=1, causal=14, backward=True),
    "aten::_scaled_dot_product_fused_attention_overrideable_backward": _AttnLayout("bhld", q=1, causal=13, backward=True),
    "aten::_cudnn_attention_backward": _AttnLayout("bhld", q=1, causal=14, max_k=12, backward=True),
    "aten::_flash_attention_backward": _AttnLayout("blhd", q=1, causal=11, max_k=9, backward=True, lower_right=True),
    "aten::_efficient_attention_backward": _AttnLayout("blhd", q=1, mask_type=14, max_k=9, backward=True),
    "flash_attn::_flash_attn_backward": _AttnLayout("blhd", q=1, causal=11, backward=True, lower_right=True),
    "flash_attn::_flash_attn_varlen_backward": _AttnLayout("blhd", q=1, causal=15, max_k=12, backward=True, lower_right=True),
}
for _name, _lay in _ATTN.items():
    _reg([_name], partial(_attention, lay=_lay))

