"""Cost models of single torch ops: useful FLOPs and ideal device-memory bytes from the recorded shapes.

One job: turn an op record (name, Kineto ``Input Dims``, ``Input type`` and, where recorded,
``Concrete Inputs``) into ``(flops, bytes, dtype, model)`` for that op *alone*. Which op owns which
kernels (the innermost modelled op) is the stitcher's decision, not this module's.

Definitions used throughout
---------------------------
* **flops** are useful math of the op as written, counted the way the PyTorch profiler
  (``with_flops``) and ``torch.utils.flop_counter`` count it: a multiply-add is 2 FLOPs, nothing
  is added for data movement, padding, recomputation or the kernel's choice of algorithm.
* **bytes** are what an ideal implementation moves to and from device memory: every tensor input
  read once plus every output written once (in-place ops write ``self``). Caches, re-reads and
  workspaces are not counted, so measured DRAM traffic is >= this number.
* **dtype** is the canonical dtype (fp32 | tf32 | bf16 | fp16 | fp8 | int8 | fp64 | other) of the
  first tensor input. ``tf32`` is never produced from a trace: Kineto records ``float`` whether or
  not TF32 was allowed, and the peak policy for fp32 lives in :mod:`plasmient_trace.metrics.hardware`.
  8-bit integer types map to int8 (their GEMMs run at the int8 rate); wider ints and bool to other.
* **model** names the formula that produced the numbers:
  gemm | conv | attention | norm | softmax | elementwise | embedding | reduction | none.
  Unknown ops, and known ops whose shapes are missing or malformed, get 0 flops, 0 bytes, ``none``.

Formulas (M, N, K: GEMM sizes; B: batch; numel(x): element count)
-----------------------------------------------------------------
* mm 2MNK; addmm 2MNK + MN (the bias add); bmm 2BMNK; baddbmm 2BMNK + BMN; mv/addmv 2MK (+M);
  dot 2K; matmul with numpy broadcasting of batch dims and the 1-D cases; linear
  2*prod(batch)*N*K (+ prod(batch)*N with a bias); _scaled_mm/_int_mm 2MNK.
* convolution (every aten/cudnn/miopen/mkldnn spelling): 2 * numel(out) * Cin/groups * prod(kernel),
  i.e. 2 * numel(out) * prod(weight.shape[1:]); no bias flops. The output size comes from stride,
  padding and dilation in ``Concrete Inputs``. **When they were not recorded** (older Kineto, or a
  source without concrete inputs) the model assumes stride 1 with 'same' padding, i.e. output
  spatial size = input spatial size; that over-counts strided convs (4x for stride 2) and is the
  documented price of missing data. Transposed convs need no stride: 2 * numel(input) *
  prod(weight.shape[1:]). ``convolution_backward`` costs the forward once per gradient its
  output_mask asks for (2x when unknown). The legacy ``cudnn_convolution_backward_input`` /
  ``_weight`` children are left unmodelled on purpose: ``_weight`` lacks the weight shape, and
  their parent ``cudnn_convolution_backward`` is modelled exactly, so its 2x covers their kernels.
* attention (sdpa and its flash / efficient / cudnn / math / cpu variants, aten::_flash_attention_*,
  aten::_efficient_attention_*, flash_attn::*): 2*B*H*Lq*Lk*(D + Dv) (= 4*B*H*Lq*Lk*D), halved
  only when the recorded ``is_causal`` (or custom_mask_type 1/2) says causal; backward 2.5x the
  forward (the FlashAttention-2 accounting: five GEMMs against two). Varlen (packed 3-D q) uses
  total_q * min(total_k, max_k): exact for one sequence, an upper bound for a packed batch.
* norms, per element of the input: layer/group/batch (training) norm 5 (mean 1, centre 1,
  square-accumulate 2, scale by rstd 1) + 1 per affine parameter (weight, bias) -> 7 with both;
  rms norm 3 + 1 with a weight -> 4; batch norm in eval 2 (folded scale and shift); batch norm
  with unknown mode is assumed training. Backward norms cost 2x their forward count per element.
* softmax / log_softmax 5 per element (max, subtract, exp, sum, divide); their backward 4.
* elementwise (add, mul, div, gelu, silu, where, copy_, ... and the *_backward activations): 1 FLOP
  per element of the broadcast output (addcmul/addcdiv/lerp 2; copies and fills 0); their bytes are
  what make them memory-bound.
* embedding 0 flops, bytes = gathered rows read + written + the indices; embedding_dense_backward
  1 FLOP per gradient element (the scatter-add).
* reductions (sum, mean, amax, norm, ...) 1 FLOP per input element (std/var/logsumexp 3, vector norms
  2); the output size comes from the recorded dim/keepdim, else a full reduction is assumed.
* pooling: out elements * kernel window (stride/padding from concrete inputs), else 1 per input.

Autograd nodes (``XBackward0``, ``autograd::engine::evaluate_function: ...``) carry only the
grad_output shape, so they are ``none``; the aten ops inside them carry full shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Sequence

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["MODELS", "CANONICAL_DTYPES", "OpCosts", "op_cost", "model_ops", "canonical_dtype", "element_size"]

MODELS = ("gemm", "conv", "attention", "norm", "softmax", "elementwise", "embedding", "reduction", "none")
CANONICAL_DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8", "int8", "fp64", "other")

# Kineto's 'Input type' strings for tensors -> (canonical dtype, element bytes). Strings that are
# not here ('Scalar', 'ScalarList', 'TensorList', 'GenericList', '', and the capitalised legacy
# scalar tags 'Int', 'Bool', 'Double') are non-tensor arguments.
_DTYPES: dict[str, tuple[str, float]] = {
    "float": ("fp32", 4), "double": ("fp64", 8),
    "c10::Half": ("fp16", 2), "c10::BFloat16": ("bf16", 2),
    "c10::Float8_e4m3fn": ("fp8", 1), "c10::Float8_e5m2": ("fp8", 1),
    "c10::Float8_e4m3fnuz": ("fp8", 1), "c10::Float8_e5m2fnuz": ("fp8", 1),
    "c10::Float8_e8m0fnu": ("fp8", 1),
    "c10::Float4_e2m1fn_x2": ("other", 1),
    "signed char": ("int8", 1), "unsigned char": ("int8", 1),
    "c10::qint8": ("int8", 1), "c10::quint8": ("int8", 1), "c10::quint4x2": ("other", 1),
    "c10::qint32": ("other", 4),
    "short int": ("other", 2), "short": ("other", 2), "unsigned short": ("other", 2),
    "int": ("other", 4), "unsigned int": ("other", 4),
    "long int": ("other", 8), "long": ("other", 8), "long long": ("other", 8),
    "long long int": ("other", 8), "unsigned long": ("other", 8), "unsigned long int": ("other", 8),
    "bool": ("other", 1),
    "c10::complex<c10::Half>": ("other", 4), "c10::complex<float>": ("other", 8),
    "c10::complex<double>": ("other", 16),
}

# Element size assumed for members of a TensorList: Kineto records the list's shapes but only the
# tag 'TensorList' as its type. Lists of that kind are optimizer state, which is fp32 in practice.
_LIST_ELEMENT_BYTES = 4.0


def canonical_dtype(kineto_type: str | None) -> str:
    """Canonical dtype of one Kineto 'Input type' string ('other' for anything unknown)."""
    entry = _DTYPES.get(kineto_type or "")
    return entry[0] if entry else "other"


def element_size(kineto_type: str | None) -> float:
    """Bytes per element of a Kineto tensor type string (0 for non-tensor arguments)."""
    entry = _DTYPES.get(kineto_type or "")
    return entry[1] if entry else 0.0


def _prod(xs: Sequence[int]) -> int:
    p = 1
    for x in xs:
        p *= x
    return p


def _is_shape(d: Any) -> bool:
    return isinstance(d, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in d)


def _parse_scalar(s: Any) -> Any:
    """One 'Concrete Inputs' entry -> python value; None when not recorded ('' is a tensor slot)."""
    if not isinstance(s, str):
        return s
    s = s.strip()
    if not s:
        return None
    if s == "True":
        return True
    if s == "False":
        return False
    if s[0] == "[":
        try:
            return orjson.loads(s.replace("True", "true").replace("False", "false"))
        except orjson.JSONDecodeError:
            return s
    try:
        return int(s)
    except ValueError:
        pass
    try:
        return float(s)
    except ValueError:
        return s


def _ints(v: Any, n: int) -> list[int] | None:
    """A stride/padding/dilation value expanded to n spatial dims, or None when unusable."""
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, int):
        return [v] * n
    if isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        if len(v) == n:
            return v
        if len(v) == 1:
            return v * n
    return None


def _broadcast(shapes: list[list[int]]) -> list[int]:
    nd = max(len(s) for s in shapes)
    out = [1] * nd
    for s in shapes:
        off = nd - len(s)
        for i, x in enumerate(s):
            j = off + i
            # max() also covers mismatched non-1 sizes in a malformed record without failing.
            out[j] = x if out[j] == 1 else (out[j] if x == 1 else max(out[j], x))
    return out


class _Args:
    """Accessors over one op's recorded inputs."""

    __slots__ = ("dims", "types", "conc")

    def __init__(self, dims: list[Any], types: list[Any], conc: list[Any] | None):
        self.dims = dims
        self.types = types
        self.conc = conc

    def is_tensor(self, i: int) -> bool:
        return (i < len(self.types) and i < len(self.dims) and self.types[i] in _DTYPES
                and _is_shape(self.dims[i]))

    def shape(self, i: int) -> list[int] | None:
        return self.dims[i] if self.is_tensor(i) else None

    def es(self, i: int) -> float:
        return _DTYPES[self.types[i]][1] if self.is_tensor(i) else 0.0

    def numel(self, i: int) -> int:
        s = self.shape(i)
        return _prod(s) if s is not None else 0

    def nbytes(self, i: int) -> float:
        s = self.shape(i)
        return _prod(s) * self.es(i) if s is not None else 0.0

    def tensors(self) -> list[int]:
        return [i for i in range(min(len(self.dims), len(self.types))) if self.is_tensor(i)]

    def value(self, i: int | None) -> Any:
        if i is None or self.conc is None or i >= len(self.conc):
            return None
        return _parse_scalar(self.conc[i])

    def shape_list(self, i: int) -> list[list[int]] | None:
        """Shapes of a TensorList argument when Kineto recorded them (newer versions nest them)."""
        if i >= len(self.dims):
            return None
        d = self.dims[i]
        if isinstance(d, list) and d and all(_is_shape(x) for x in d):
            return d
        return None


_Result = tuple[float, float, str] | None  # (flops, bytes, model)
_ModelFn = Callable[[_Args], _Result]


# ----------------------------------------------------------------------------------------- GEMM
def _mm(a: _Args) -> _Result:
    A, B = a.shape(0), a.shape(1)
    if A is None or B is None or len(A) != 2 or len(B) != 2:
        return None
    (M, K), N = A, B[1]
    return 2.0 * M * N * K, a.nbytes(0) + a.nbytes(1) + M * N * a.es(0), "gemm"


def _addmm(a: _Args, extra_per_out: int = 1) -> _Result:
    A, B = a.shape(1), a.shape(2)
    if A is None or B is None or len(A) != 2 or len(B) != 2:
        return None
    (M, K), N = A, B[1]
    flops = 2.0 * M * N * K + extra_per_out * M * N
    return flops, a.nbytes(0) + a.nbytes(1) + a.nbytes(2) + M * N * a.es(1), "gemm"


def _bmm(a: _Args) -> _Result:
    A, B = a.shape(0), a.shape(1)
    if A is None or B is None or len(A) != 3 or len(B) != 3:
        return None
    (Bt, M, K), N = A, B[2]
    return 2.0 * Bt * M * N * K, a.nbytes(0) + a.nbytes(1) + Bt * M * N * a.es(0), "gemm"


def _baddbmm(a: _Args) -> _Result:
    A, B = a.shape(1), a.shape(2)
    if A is None or B is None or len(A) != 3 or len(B) != 3:
        return None
    (Bt, M, K), N = A, B[2]
    flops = 2.0 * Bt * M * N * K + Bt * M * N
    return flops, a.nbytes(0) + a.nbytes(1) + a.nbytes(2) + Bt * M * N * a.es(1), "gemm"


def _addbmm(a: _Args) -> _Result:
    A, B = a.shape(1), a.shape(2)
    if A is None or B is None or len(A) != 3 or len(B) != 3:
        return None
    (Bt, M, K), N = A, B[2]
    flops = 2.0 * Bt * M * N * K + Bt * M * N
    return flops, a.nbytes(0) + a.nbytes(1) + a.nbytes(2) + M * N * a.es(1), "gemm"


def _mv(a: _Args, mat: int = 0, vec: int = 1, bias: int | None = None) -> _Result:
    A, v = a.shape(mat), a.shape(vec)
    if A is None or v is None or len(A) != 2 or len(v) != 1:
        return None
    M, K = A
    flops = 2.0 * M * K + (M if bias is not None else 0)
    nb = a.nbytes(mat) + a.nbytes(vec) + (a.nbytes(bias) if bias is not None else 0) + M * a.es(mat)
    return flops, nb, "gemm"


def _dot(a: _Args) -> _Result:
    A, B = a.shape(0), a.shape(1)
    if A is None or B is None or len(A) != 1 or len(B) != 1:
        return None
    return 2.0 * A[0], a.nbytes(0) + a.nbytes(1) + a.es(0), "gemm"


def _matmul(a: _Args) -> _Result:
    A, B = a.shape(0), a.shape(1)
    if A is None or B is None or not A or not B:
        return None
    if len(A) == 1 and len(B) == 1:
        flops, out = 2.0 * A[0], 1
    elif len(B) == 1:
        batch, (M, K) = A[:-2], A[-2:]
        flops, out = 2.0 * _prod(batch) * M * K, _prod(batch) * M
    elif len(A) == 1:
        batch, (K, N) = B[:-2], B[-2:]
        flops, out = 2.0 * _prod(batch) * K * N, _prod(batch) * N
    else:
        batch = _broadcast([A[:-2], B[:-2]]) if (len(A) > 2 or len(B) > 2) else []
        (M, K), N = A[-2:], B[-1]
        flops, out = 2.0 * _prod(batch) * M * N * K, _prod(batch) * M * N
    return flops, a.nbytes(0) + a.nbytes(1) + out * a.es(0), "gemm"


def _linear(a: _Args) -> _Result:
    X, W = a.shape(0), a.shape(1)
    if X is None or W is None or not X or len(W) not in (1, 2):
        return None
    rows = _prod(X[:-1])
    K = X[-1]
    N = W[0] if len(W) == 2 else 1
    has_bias = a.is_tensor(2)
    flops = 2.0 * rows * N * K + (rows * N if has_bias else 0)
    return flops, a.nbytes(0) + a.nbytes(1) + a.nbytes(2) + rows * N * a.es(0), "gemm"


def _scaled_mm(a: _Args, out_es: float = 2.0) -> _Result:
    # fp8 GEMMs write bf16/fp32 (the out_dtype arg is a ScalarType code Kineto rarely records): 2 bytes.
    A, B = a.shape(0), a.shape(1)
    if A is None or B is None or len(A) != 2 or len(B) != 2:
        return None
    (M, K), N = A, B[1]
    has_bias = a.is_tensor(4)
    flops = 2.0 * M * N * K + (M * N if has_bias else 0)
    nb = sum(a.nbytes(i) for i in a.tensors()) + M * N * out_es
    return flops, nb, "gemm"


# ----------------------------------------------------------------------------------------- conv
@dataclass(frozen=True)
class _ConvLayout:
    stride: int | None = None
    padding: int | None = None
    dilation: int | None = None
    transposed: int | bool | None = False  # arg index of the flag, or a fixed answer
    bias: int | None = None
    groups: int | None = None


def _conv_forward(a: _Args, lay: _ConvLayout) -> _Result:
    X, W = a.shape(0), a.shape(1)
    if X is None or W is None or len(W) < 3 or len(X) not in (len(W), len(W) - 1):
        return None
    nsp = len(W) - 2
    batched = len(X) == len(W)
    N = X[0] if batched else 1
    cin = X[1] if batched else X[0]
    sp_in = X[-nsp:]
    if isinstance(lay.transposed, bool):
        transposed = lay.transposed
    else:
        flag = a.value(lay.transposed)
        if isinstance(flag, bool):
            transposed = flag
        else:
            # Unrecorded flag: a regular conv needs Cin divisible by weight.shape[1]; when it is
            # not but Cin equals weight.shape[0], only the transposed reading is consistent.
            transposed = W[1] > 0 and cin % W[1] != 0 and cin == W[0]
    w_inner = _prod(W[1:])
    bias_bytes = a.nbytes(lay.bias) if lay.bias is not None else 0.0
    if transposed:
        flops = 2.0 * N * cin * _prod(sp_in) * w_inner
        g = a.value(lay.groups)
        groups = g if isinstance(g, int) and not isinstance(g, bool) and g > 0 else 1
        stride = _ints(a.value(lay.stride), nsp)
        pad = _ints(a.value(lay.padding), nsp) or [0] * nsp
        dil = _ints(a.value(lay.dilation), nsp) or [1] * nsp
        if stride is not None:
            sp_out = [(i - 1) * s - 2 * p + d * (k - 1) + 1 for i, s, p, d, k in zip(sp_in, stride, pad, dil, W[2:])]
        else:
            sp_out = sp_in
        out_numel = N * W[1] * groups * _prod(sp_out)
    else:
        sp_out = _conv_out_spatial(a, lay, sp_in, W[2:])
        out_numel = N * W[0] * _prod(sp_out)
        flops = 2.0 * out_numel * w_inner
    nb = a.nbytes(0) + a.nbytes(1) + bias_bytes + out_numel * a.es(0)
    return flops, nb, "conv"


def _conv_out_spatial(a: _Args, lay: _ConvLayout, sp_in: list[int], kernel: list[int]) -> list[int]:
    nsp = len(kernel)
    pad_v = a.value(lay.padding)
    if isinstance(pad_v, str):  # conv2d.padding overload: 'same' keeps the size, 'valid' pads 0
        if pad_v == "same":
            return list(sp_in)
        pad_v = 0
    stride = _ints(a.value(lay.stride), nsp)
    if stride is None:
        # Documented assumption: stride 1, 'same' padding when the trace did not record them.
        return list(sp_in)
    pad = _ints(pad_v, nsp) or [0] * nsp
    dil = _ints(a.value(lay.dilation), nsp) or [1] * nsp
    out = []
    for i, s, p, d, k in zip(sp_in, stride, pad, dil, kernel):
        out.append(max((i + 2 * p - d * (k - 1) - 1) // max(s, 1) + 1, 0))
    return out


@dataclass(frozen=True)
class _ConvBwdLayout:
    grad_out: int
    input: int
    weight: int
    transposed: int | bool | None = None
    mask: int | None = None


def _conv_backward(a: _Args, lay: _ConvBwdLayout) -> _Result:
    G, X, W = a.shape(lay.grad_out), a.shape(lay.input), a.shape(lay.weight)
    if G is None or X is None or W is None or len(W) < 3:
        return None
    if isinstance(lay.transposed, bool):
        transposed = lay.transposed
    else:
        flag = a.value(lay.transposed)
        transposed = flag if isinstance(flag, bool) else False
    w_inner = _prod(W[1:])
    fwd = 2.0 * (_prod(X) if transposed else _prod(G)) * w_inner
    mask = a.value(lay.mask)
    if isinstance(mask, list) and len(mask) >= 2 and all(isinstance(m, bool) for m in mask):
        want_in, want_w = mask[0], mask[1]
        want_b = len(mask) > 2 and mask[2]
    else:
        want_in, want_w, want_b = True, True, False
    flops = fwd * (int(want_in) + int(want_w))
    es = a.es(lay.grad_out)
    nb = (a.nbytes(lay.grad_out) + a.nbytes(lay.input) + a.nbytes(lay.weight)
          + (a.nbytes(lay.input) if want_in else 0) + (a.nbytes(lay.weight) if want_w else 0)
          + ((W[1] if transposed else W[0]) * es if want_b else 0))
    return flops, nb, "conv"


# ------------------------------------------------------------------------------------ attention
@dataclass(frozen=True)
class _AttnLayout:
    layout: str          # 'bhld' (sdpa family) or 'blhd' (flash/efficient kernels)
    q: int = 0
    causal: int | None = None
    mask_type: int | None = None   # xformers custom_mask_type: 1/2 are causal
    max_k: int | None = None
    backward: bool = False


def _attention(a: _Args, lay: _AttnLayout) -> _Result:
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


# ---------------------------------------------------------------------------------------- norms
_NORM_BASE = {"layer": 5, "group": 5, "batch": 5, "rms": 3}


@dataclass(frozen=True)
class _NormLayout:
    kind: str
    input: int = 0
    weight: int | None = None
    bias: int | None = None
    training: int | bool | None = None   # arg index, or a fixed answer
    backward: bool = False
    grad_out: int | None = None


def _norm(a: _Args, lay: _NormLayout) -> _Result:
    X = a.shape(lay.input)
    if X is None:
        return None
    n = _prod(X)
    has_w = lay.weight is not None and a.is_tensor(lay.weight)
    has_b = lay.bias is not None and a.is_tensor(lay.bias)
    if lay.backward and lay.bias is None and lay.kind != "rms":
        has_b = has_w  # batch/group norm backward take no bias argument; affine norms have both
    if lay.kind == "batch":
        training = lay.training if isinstance(lay.training, bool) else a.value(lay.training)
        per = 2 if training is False else _NORM_BASE["batch"] + int(has_w) + int(has_b)
    else:
        per = _NORM_BASE[lay.kind] + int(has_w) + int(has_b)
    w_bytes = a.nbytes(lay.weight) if has_w else 0.0
    params = w_bytes + ((a.nbytes(lay.bias) if lay.bias is not None else w_bytes) if has_b else 0.0)
    xb = a.nbytes(lay.input)
    if lay.backward:
        gb = a.nbytes(lay.grad_out) if lay.grad_out is not None else xb
        # reads grad_out, input, params; writes grad_input and the parameter gradients
        return 2.0 * per * n, gb + xb + params + xb + params, "norm"
    return float(per * n), xb + xb + params, "norm"


def _vllm_rms_norm(a: _Args) -> _Result:
    # _C::rms_norm(out, input, weight, eps)
    X = a.shape(1)
    if X is None:
        return None
    return 4.0 * _prod(X), a.nbytes(0) + a.nbytes(1) + a.nbytes(2), "norm"


def _vllm_fused_add_rms_norm(a: _Args) -> _Result:
    # _C::fused_add_rms_norm(input, residual, weight, eps): residual += input; input = rms_norm(residual)
    X = a.shape(0)
    if X is None:
        return None
    return 5.0 * _prod(X), 2 * (a.nbytes(0) + a.nbytes(1)) + a.nbytes(2), "norm"


# -------------------------------------------------------------------------------------- softmax
def _softmax(a: _Args) -> _Result:
    X = a.shape(0)
    if X is None:
        return None
    return 5.0 * _prod(X), 2 * a.nbytes(0), "softmax"


def _softmax_backward(a: _Args) -> _Result:
    G = a.shape(0)
    if G is None:
        return None
    return 4.0 * _prod(G), a.nbytes(0) + a.nbytes(1) + a.nbytes(0), "softmax"


# ---------------------------------------------------------------------------------- elementwise
def _main_es(a: _Args, idx: list[int]) -> float:
    """Output element size: that of the largest input (ties: the widest), a type-promotion proxy."""
    best = max(idx, key=lambda i: (a.numel(i), a.es(i)))
    return a.es(best)


def _elementwise(a: _Args, k: float = 1.0, bool_out: bool = False, inplace: bool = False) -> _Result:
    idx = a.tensors()
    if not idx:
        return None
    read = sum(a.nbytes(i) for i in idx)
    if inplace:
        # self (dims[0]) is read and written; the output is self's shape
        n = a.numel(idx[0])
        return k * n, read + a.nbytes(idx[0]), "elementwise"
    out = _broadcast([a.shape(i) for i in idx])  # type: ignore[misc]
    n = _prod(out)
    return k * n, read + n * (1.0 if bool_out else _main_es(a, idx)), "elementwise"


def _copy(a: _Args) -> _Result:
    # copy_(self, src): read src, write self; no math.
    if not a.is_tensor(0):
        return None
    return 0.0, a.nbytes(0) + (a.nbytes(1) if a.is_tensor(1) else 0), "elementwise"


def _fill(a: _Args) -> _Result:
    if not a.is_tensor(0):
        return None
    return 0.0, a.nbytes(0), "elementwise"


def _dropout(a: _Args) -> _Result:
    # native_dropout(input, p, train): draw + compare + scale; writes the output and a bool mask
    X = a.shape(0)
    if X is None:
        return None
    n = _prod(X)
    return 2.0 * n, a.nbytes(0) + a.nbytes(0) + n * 1.0, "elementwise"


def _pad(a: _Args) -> _Result:
    X = a.shape(0)
    if X is None:
        return None
    pad = a.value(1)
    out = list(X)
    if isinstance(pad, list) and len(pad) % 2 == 0 and all(isinstance(p, int) for p in pad):
        for j in range(len(pad) // 2):
            d = len(out) - 1 - j
            if d >= 0:
                out[d] = max(out[d] + pad[2 * j] + pad[2 * j + 1], 0)
    return 0.0, a.nbytes(0) + _prod(out) * a.es(0), "elementwise"


def _max_min(a: _Args) -> _Result:
    # aten::max/min: two tensors -> elementwise; one tensor -> reduction (with indices for .dim)
    if len(a.tensors()) >= 2:
        return _elementwise(a)
    return _reduction(a, k=1.0, dim_idx=1, index_out=True)


def _foreach(a: _Args, k: float, inplace: bool, zero_flops: bool = False) -> _Result:
    # _foreach_<op>[_](self: TensorList, other: TensorList | Scalar, ...) over optimizer state
    shapes = a.shape_list(0)
    if shapes is None:
        return None
    n = sum(_prod(s) for s in shapes)
    # Every list argument as long as self is read; self (in place) or a new list is written.
    lists = 1 + sum(1 for i in range(1, len(a.dims)) if (sl := a.shape_list(i)) is not None and len(sl) == len(shapes))
    if zero_flops and inplace:
        lists -= 1  # _foreach_zero_ / _foreach_copy_ write self without reading it
    reads = lists * n * _LIST_ELEMENT_BYTES + sum(a.nbytes(i) for i in a.tensors())
    return (0.0 if zero_flops else k * n), reads + n * _LIST_ELEMENT_BYTES, "elementwise"


def _fused_adam(a: _Args) -> _Result:
    # _fused_adam(w)_(params, grads, exp_avgs, exp_avg_sqs, ...): ~12 FLOPs per parameter (moment
    # updates 7, bias-corrected step 5); reads p, g, m, v and writes p, m, v.
    shapes = a.shape_list(0)
    if shapes is None:
        return None
    n = sum(_prod(s) for s in shapes)
    return 12.0 * n, 7 * n * _LIST_ELEMENT_BYTES, "elementwise"


# ------------------------------------------------------------------------------------ embedding
def _embedding(a: _Args) -> _Result:
    W, idx = a.shape(0), a.shape(1)
    if W is None or idx is None or len(W) != 2:
        return None
    rows = _prod(idx)
    gathered = rows * W[1] * a.es(0)
    return 0.0, 2 * gathered + a.nbytes(1), "embedding"


def _embedding_backward(a: _Args) -> _Result:
    # embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq)
    G = a.shape(0)
    if G is None or not G:
        return None
    n = _prod(G)
    num_weights = a.value(2)
    grad_weight = (num_weights * G[-1] if isinstance(num_weights, int) and not isinstance(num_weights, bool)
                   and num_weights > 0 else n) * a.es(0)
    return float(n), a.nbytes(0) + a.nbytes(1) + grad_weight, "embedding"


def _embedding_bag(a: _Args) -> _Result:
    # _embedding_bag(weight, indices, offsets, scale_grad_by_freq, mode, sparse, psw, include_last_offset, ...)
    W, idx, off = a.shape(0), a.shape(1), a.shape(2)
    if W is None or idx is None or len(W) != 2:
        return None
    D = W[1]
    n_idx = _prod(idx)
    bags = _prod(off) if off is not None else (idx[0] if len(idx) == 2 else 1)
    if a.value(7) is True and off is not None:
        bags = max(bags - 1, 0)
    nb = n_idx * D * a.es(0) + a.nbytes(1) + a.nbytes(2) + bags * D * a.es(0)
    return float(n_idx * D), nb, "embedding"


def _index_select(a: _Args) -> _Result:
    # index_select(self, dim, index): rows of self picked along dim (dim 0 when unrecorded)
    X, idx = a.shape(0), a.shape(2)
    if X is None or idx is None or not X:
        return None
    dim = a.value(1)
    d = dim % len(X) if isinstance(dim, int) and not isinstance(dim, bool) else 0
    out = _prod(X) // X[d] * _prod(idx) if X[d] else 0
    return 0.0, 2 * out * a.es(0) + a.nbytes(2), "embedding"


def _gather(a: _Args) -> _Result:
    # gather(self, dim, index): the output has index's shape
    idx = a.shape(2)
    if idx is None or not a.is_tensor(0):
        return None
    out = _prod(idx)
    return 0.0, 2 * out * a.es(0) + a.nbytes(2), "embedding"


# ------------------------------------------------------------------------------------ reductions
def _reduced_numel(shape: list[int], dim: Any) -> int:
    """Output elements of reducing `shape` over `dim` (None / [] = everything)."""
    n = _prod(shape)
    if dim is None or (isinstance(dim, list) and not dim):
        return 1
    dims = [dim] if isinstance(dim, int) else dim
    if not all(isinstance(d, int) and not isinstance(d, bool) for d in dims) or not shape:
        return 1
    red = 1
    for d in set(x % len(shape) for x in dims):
        red *= shape[d]
    return n // red if red else 0


def _reduction(a: _Args, k: float = 1.0, dim_idx: int | None = 1, index_out: bool = False,
               out_es: float | None = None) -> _Result:
    idx = a.tensors()
    if not idx:
        return None
    src = idx[0]
    X = a.shape(src)
    n = _prod(X)  # type: ignore[arg-type]
    # The dim argument only exists in overloads with a keepdim after it (otherwise that slot is a
    # dtype) and only where self is argument 0; else a full reduction is assumed, as it is when
    # nothing was recorded.
    dim = a.value(dim_idx) if dim_idx is not None and src == 0 and len(a.dims) > dim_idx + 1 else None
    if isinstance(dim, bool) or not isinstance(dim, (int, list)):
        dim = None
    out = _reduced_numel(X, dim)  # type: ignore[arg-type]
    es = a.es(src) if out_es is None else out_es
    nb = a.nbytes(src) + out * es + (out * 8 if index_out and isinstance(dim, int) else 0)
    return k * n, nb, "reduction"


def _scan(a: _Args) -> _Result:
    idx = a.tensors()
    if not idx:
        return None
    n = a.numel(idx[0])
    return float(n), 2 * a.nbytes(idx[0]), "reduction"


def _pool(a: _Args, nsp: int = 2, stride_idx: int = 2, pad_idx: int = 3, dil_idx: int | None = 4,
          ceil_idx: int | None = 5, extra: float = 0.0, indices: bool = False) -> _Result:
    # max_pool2d_with_indices(self, kernel_size, stride, padding, dilation, ceil_mode) and kin
    X = a.shape(0)
    if X is None or len(X) < nsp + 1:
        return None
    kernel = _ints(a.value(1), nsp)
    stride = _ints(a.value(stride_idx), nsp)
    if kernel is None:
        # Window unknown: each input element is compared/added once.
        return float(_prod(X)), a.nbytes(0), "reduction"
    if stride is None:
        stride = kernel  # torch's pooling default when stride is omitted
    pad = _ints(a.value(pad_idx), nsp) or [0] * nsp
    dil = _ints(a.value(dil_idx), nsp) if dil_idx is not None else None
    dil = dil or [1] * nsp
    ceil_mode = a.value(ceil_idx) is True if ceil_idx is not None else False
    sp = []
    for i, k, s, p, d in zip(X[-nsp:], kernel, stride, pad, dil):
        span = i + 2 * p - d * (k - 1) - 1
        sp.append(max((-(-span // s) if ceil_mode else span // s) + 1, 0))
    out = _prod(X[:-nsp]) * _prod(sp)
    flops = out * (_prod(kernel) + extra)
    nb = a.nbytes(0) + out * a.es(0) + (out * 8 if indices else 0)
    return float(flops), nb, "reduction"


def _adaptive_pool(a: _Args, nsp: int = 2) -> _Result:
    X = a.shape(0)
    if X is None or len(X) < nsp + 1:
        return None
    size = _ints(a.value(1), nsp)
    out = _prod(X[:-nsp]) * (_prod(size) if size is not None else 1)
    return float(_prod(X) + out), a.nbytes(0) + out * a.es(0), "reduction"


def _pool_backward(a: _Args) -> _Result:
    # *_pool*_backward(grad_output, self, ...): scatter grad_output into a grad_input shaped like self
    G, X = a.shape(0), a.shape(1)
    if G is None or X is None:
        return None
    nb = a.nbytes(0) + a.nbytes(1) + sum(a.nbytes(i) for i in a.tensors()[2:])
    return float(max(_prod(G), _prod(X))), nb, "reduction"


def _nll_forward(a: _Args) -> _Result:
    X, T = a.shape(0), a.shape(1)
    if X is None or T is None:
        return None
    n = max(_prod(T), 1)
    return float(n), n * a.es(0) + a.nbytes(1) + a.es(0), "reduction"


def _nll_backward(a: _Args) -> _Result:
    # nll_loss_backward(grad_output, self, target, ...): writes a grad the size of self
    X, T = a.shape(1), a.shape(2)
    if X is None or T is None:
        return None
    n = max(_prod(T), 1)
    return float(n), a.nbytes(0) + a.nbytes(2) + a.nbytes(1), "elementwise"


def _loss(a: _Args, k: float) -> _Result:
    X = a.shape(0)
    if X is None:
        return None
    return k * _prod(X), sum(a.nbytes(i) for i in a.tensors()) + a.es(0), "reduction"


# ------------------------------------------------------------------------------------ registry
_REGISTRY: dict[str, _ModelFn] = {}


def _reg(names: Sequence[str], fn: _ModelFn) -> None:
    for n in names:
        _REGISTRY[n] = fn


_reg(["aten::mm"], _mm)
_reg(["aten::addmm"], _addmm)
_reg(["aten::_addmm_activation"], partial(_addmm, extra_per_out=2))
_reg(["aten::bmm"], _bmm)
_reg(["aten::baddbmm"], _baddbmm)
_reg(["aten::addbmm"], _addbmm)
_reg(["aten::mv"], _mv)
_reg(["aten::addmv"], partial(_mv, mat=1, vec=2, bias=0))
_reg(["aten::dot", "aten::vdot"], _dot)
_reg(["aten::matmul"], _matmul)
_reg(["aten::linear"], _linear)
_reg(["aten::_scaled_mm"], _scaled_mm)
_reg(["aten::_int_mm"], partial(_scaled_mm, out_es=4.0))

_CONV_STD = _ConvLayout(stride=3, padding=4, dilation=5, transposed=False, bias=2)
_reg(["aten::conv1d", "aten::conv2d", "aten::conv3d", "aten::_convolution_mode",
      "aten::cudnn_convolution_relu"], partial(_conv_forward, lay=_CONV_STD))
_reg(["aten::convolution", "aten::_convolution", "aten::convolution_overrideable"],
     partial(_conv_forward, lay=_ConvLayout(stride=3, padding=4, dilation=5, transposed=6, bias=2, groups=8)))
_reg(["aten::cudnn_convolution"], partial(_conv_forward, lay=_ConvLayout(padding=2, stride=3, dilation=4)))
_reg(["aten::miopen_convolution", "aten::miopen_depthwise_convolution", "aten::mkldnn_convolution"],
     partial(_conv_forward, lay=_ConvLayout(padding=3, stride=4, dilation=5, bias=2)))
_reg(["aten::cudnn_convolution_add_relu"],
     partial(_conv_forward, lay=_ConvLayout(stride=5, padding=6, dilation=7, bias=4)))
_reg(["aten::_slow_conv2d_forward", "aten::thnn_conv2d"],
     partial(_conv_forward, lay=_ConvLayout(stride=4, padding=5, bias=3)))
_reg(["aten::slow_conv_dilated2d", "aten::slow_conv_dilated3d", "aten::slow_conv3d_forward", "aten::slow_conv3d"],
     partial(_conv_forward, lay=_ConvLayout(stride=4, padding=5, dilation=6, bias=3)))
_reg(["aten::_nnpack_spatial_convolution"], partial(_conv_forward, lay=_ConvLayout(padding=3, stride=4, bias=2)))
_reg(["aten::conv_transpose1d", "aten::conv_transpose2d", "aten::conv_transpose3d"],
     partial(_conv_forward, lay=_ConvLayout(stride=3, padding=4, dilation=7, transposed=True, bias=2, groups=6)))
_reg(["aten::cudnn_convolution_transpose"],
     partial(_conv_forward, lay=_ConvLayout(padding=2, stride=4, dilation=5, transposed=True, groups=6)))
_reg(["aten::miopen_convolution_transpose"],
     partial(_conv_forward, lay=_ConvLayout(padding=3, stride=5, dilation=6, transposed=True, bias=2, groups=7)))
_reg(["aten::slow_conv_transpose2d", "aten::slow_conv_transpose3d"],
     partial(_conv_forward, lay=_ConvLayout(stride=4, padding=5, dilation=7, transposed=True, bias=3)))
_reg(["aten::convolution_backward", "aten::convolution_backward_overrideable"],
     partial(_conv_backward, lay=_ConvBwdLayout(grad_out=0, input=1, weight=2, transposed=7, mask=10)))
# Legacy (torch < 1.11) spellings: (self, grad_output, weight, padding, stride, dilation, groups, ...).
_reg(["aten::cudnn_convolution_backward"],
     partial(_conv_backward, lay=_ConvBwdLayout(grad_out=1, input=0, weight=2, transposed=False, mask=10)))
_reg(["aten::miopen_convolution_backward"],
     partial(_conv_backward, lay=_ConvBwdLayout(grad_out=1, input=0, weight=2, transposed=False, mask=9)))
_reg(["aten::cudnn_convolution_transpose_backward"],
     partial(_conv_backward, lay=_ConvBwdLayout(grad_out=1, input=0, weight=2, transposed=True, mask=11)))

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
    _REGISTRY[_name] = partial(_attention, lay=_lay)

_reg(["aten::layer_norm", "aten::native_layer_norm"], partial(_norm, lay=_NormLayout("layer", weight=2, bias=3)))
_reg(["aten::rms_norm", "aten::_fused_rms_norm"], partial(_norm, lay=_NormLayout("rms", weight=2)))
_reg(["aten::group_norm"], partial(_norm, lay=_NormLayout("group", weight=2, bias=3)))
_reg(["aten::native_group_norm"], partial(_norm, lay=_NormLayout("group", weight=1, bias=2)))
_reg(["aten::batch_norm", "aten::native_batch_norm", "aten::_batch_norm_impl_index", "aten::cudnn_batch_norm",
      "aten::miopen_batch_norm", "aten::_native_batch_norm_legit", "aten::_batch_norm_with_update",
      "aten::native_batch_norm_legit_functional"],
     partial(_norm, lay=_NormLayout("batch", weight=1, bias=2, training=5)))
_reg(["aten::_native_batch_norm_legit_no_training", "aten::_batch_norm_no_update"],
     partial(_norm, lay=_NormLayout("batch", weight=1, bias=2, training=False)))
_reg(["aten::instance_norm"], partial(_norm, lay=_NormLayout("batch", weight=1, bias=2, training=True)))
_reg(["aten::native_layer_norm_backward"],
     partial(_norm, lay=_NormLayout("layer", input=1, weight=5, bias=6, backward=True, grad_out=0)))
_reg(["aten::_fused_rms_norm_backward"],
     partial(_norm, lay=_NormLayout("rms", input=1, weight=4, backward=True, grad_out=0)))
_reg(["aten::native_group_norm_backward"],
     partial(_norm, lay=_NormLayout("group", input=1, weight=4, backward=True, grad_out=0)))
_reg(["aten::native_batch_norm_backward", "aten::batch_norm_backward"],
     partial(_norm, lay=_NormLayout("batch", input=1, weight=2, training=True, backward=True, grad_out=0)))
_reg(["aten::cudnn_batch_norm_backward", "aten::miopen_batch_norm_backward"],
     partial(_norm, lay=_NormLayout("batch", input=0, weight=2, training=True, backward=True, grad_out=1)))
_reg(["_C::rms_norm"], _vllm_rms_norm)
_reg(["_C::fused_add_rms_norm"], _vllm_fused_add_rms_norm)

_reg(["aten::softmax", "aten::_softmax", "aten::log_softmax", "aten::_log_softmax", "aten::_safe_softmax",
      "aten::special_softmax", "aten::special_log_softmax"], _softmax)
_reg(["aten::_softmax_backward_data", "aten::_log_softmax_backward_data"], _softmax_backward)

_reg(["aten::embedding"], _embedding)
_reg(["aten::embedding_dense_backward", "aten::embedding_backward"], _embedding_backward)
_reg(["aten::_embedding_bag", "aten::embedding_bag", "aten::_embedding_bag_forward_only"], _embedding_bag)
_reg(["aten::index_select"], _index_select)
_reg(["aten::gather"], _gather)

# Elementwise ops: 1 FLOP per output element unless listed with another count.
_UNARY = """abs neg exp exp2 expm1 log log2 log10 log1p sqrt rsqrt reciprocal sin cos tan asin acos atan sinh cosh
tanh sigmoid relu relu6 gelu silu mish elu selu celu leaky_relu hardtanh hardswish hardsigmoid softplus softshrink
hardshrink erf erfc erfinv sign sgn floor ceil round trunc frac square clamp clamp_min clamp_max clip nan_to_num
bitwise_not logit threshold prelu _prelu_kernel rrelu glu polar angle positive""".split()
_BINARY = """add sub rsub mul div true_divide floor_divide remainder fmod pow float_power maximum minimum fmax fmin
atan2 hypot copysign xlogy bitwise_and bitwise_or bitwise_xor bitwise_left_shift bitwise_right_shift
__and__ __or__ __xor__ __lshift__ __rshift__ where masked_fill heaviside nextafter""".split()
_BACKWARD_EW = """threshold_backward gelu_backward silu_backward sigmoid_backward tanh_backward hardtanh_backward
leaky_relu_backward elu_backward softplus_backward hardswish_backward hardsigmoid_backward mish_backward
logit_backward rrelu_with_noise_backward native_dropout_backward _masked_scale glu_backward
_prelu_kernel_backward""".split()
_COMPARE = """eq ne lt le gt ge logical_and logical_or logical_xor logical_not isnan isinf isfinite isposinf
isneginf signbit""".split()
_TWO_FLOPS = {"addcmul": 2.0, "addcdiv": 2.0, "lerp": 2.0}

for _base in _UNARY + _BINARY:
    _REGISTRY[f"aten::{_base}"] = _elementwise
    _REGISTRY[f"aten::{_base}_"] = partial(_elementwise, inplace=True)
for _base in _BACKWARD_EW:
    _REGISTRY[f"aten::{_base}"] = _elementwise
for _base in _COMPARE:
    _REGISTRY[f"aten::{_base}"] = partial(_elementwise, bool_out=True)
    _REGISTRY[f"aten::{_base}_"] = partial(_elementwise, inplace=True)
for _base, _k in _TWO_FLOPS.items():
    _REGISTRY[f"aten::{_base}"] = partial(_elementwise, k=_k)
    _REGISTRY[f"aten::{_base}_"] = partial(_elementwise, k=_k, inplace=True)
_reg(["aten::mse_loss_backward"], partial(_elementwise, k=3.0))
_reg(["aten::copy_"], _copy)
_reg(["aten::fill_", "aten::zero_", "aten::normal_", "aten::uniform_", "aten::bernoulli_", "aten::random_",
      "aten::exponential_"], _fill)
_reg(["aten::native_dropout"], _dropout)
_reg(["aten::constant_pad_nd"], _pad)
_reg(["aten::max", "aten::min"], _max_min)
for _base in ["add", "sub", "mul", "div", "clamp", "clamp_min", "clamp_max", "neg", "sqrt", "exp", "abs", "pow",
              "reciprocal", "sign", "maximum", "minimum"]:
    _REGISTRY[f"aten::_foreach_{_base}_"] = partial(_foreach, k=1.0, inplace=True)
    _REGISTRY[f"aten::_foreach_{_base}"] = partial(_foreach, k=1.0, inplace=False)
for _base in ["addcmul", "addcdiv", "lerp"]:
    _REGISTRY[f"aten::_foreach_{_base}_"] = partial(_foreach, k=2.0, inplace=True)
    _REGISTRY[f"aten::_foreach_{_base}"] = partial(_foreach, k=2.0, inplace=False)
_reg(["aten::_foreach_copy_", "aten::_foreach_zero_"], partial(_foreach, k=0.0, inplace=True, zero_flops=True))
_reg(["aten::_fused_adam_", "aten::_fused_adamw_", "aten::_fused_adam", "aten::_fused_adamw"], _fused_adam)

_reg(["aten::sum", "aten::nansum", "aten::mean", "aten::nanmean", "aten::amax", "aten::amin", "aten::prod",
      "aten::aminmax"], _reduction)
_reg(["aten::any", "aten::all"], partial(_reduction, out_es=1.0))
_reg(["aten::argmax", "aten::argmin"], partial(_reduction, out_es=8.0))
_reg(["aten::logsumexp"], partial(_reduction, k=3.0))
_reg(["aten::std", "aten::var", "aten::std_mean", "aten::var_mean"], partial(_reduction, k=3.0))
_reg(["aten::linalg_vector_norm", "aten::norm"], partial(_reduction, k=2.0, dim_idx=2))
_reg(["aten::cumsum", "aten::cumprod", "aten::logcumsumexp"], _scan)
for _nsp in (1, 2, 3):
    _reg([f"aten::max_pool{_nsp}d_with_indices"], partial(_pool, nsp=_nsp, indices=True))
    _reg([f"aten::max_pool{_nsp}d"], partial(_pool, nsp=_nsp))
    _reg([f"aten::avg_pool{_nsp}d"], partial(_pool, nsp=_nsp, dil_idx=None, ceil_idx=4, extra=1.0))
    _reg([f"aten::adaptive_avg_pool{_nsp}d", f"aten::_adaptive_avg_pool{_nsp}d", f"aten::adaptive_max_pool{_nsp}d"],
         partial(_adaptive_pool, nsp=_nsp))
_reg(["aten::max_pool2d_with_indices_backward", "aten::max_pool3d_with_indices_backward",
      "aten::avg_pool2d_backward", "aten::avg_pool3d_backward", "aten::_adaptive_avg_pool2d_backward",
      "aten::_adaptive_avg_pool3d_backward", "aten::adaptive_max_pool2d_backward"], _pool_backward)
_reg(["aten::nll_loss_forward", "aten::nll_loss2d_forward"], _nll_forward)
_reg(["aten::nll_loss_backward", "aten::nll_loss2d_backward"], _nll_backward)
_reg(["aten::mse_loss", "aten::l1_loss"], partial(_loss, k=3.0))
_reg(["aten::smooth_l1_loss", "aten::huber_loss"], partial(_loss, k=4.0))
_reg(["aten::binary_cross_entropy_with_logits", "aten::binary_cross_entropy"], partial(_loss, k=5.0))


# ---------------------------------------------------------------------------------------- API
def _as_list(v: Any) -> list[Any] | None:
    if v is None:
        return None
    if isinstance(v, (bytes, str)):
        try:
            v = orjson.loads(v)
        except orjson.JSONDecodeError:
            return None
    return v if isinstance(v, list) else None


def _first_dtype(types: list[Any] | None) -> str:
    if types:
        for t in types:
            entry = _DTYPES.get(t) if isinstance(t, str) else None
            if entry is not None:
                return entry[0]
    return "other"


def op_cost(name: str | None, dims: Any, types: Any, concrete: Any = None) -> tuple[float, float, str, str]:
    """(flops, bytes, dtype, model) of one op from its recorded inputs.

    ``dims``/``types``/``concrete`` are Kineto's 'Input Dims', 'Input type' and 'Concrete Inputs',
    either parsed lists or their JSON text (as stored in the ops record table). Pure: the same
    arguments always give the same answer, which is what lets :func:`model_ops` call it once per
    distinct signature.
    """
    t = _as_list(types)
    dtype = _first_dtype(t)
    fn = _REGISTRY.get(name) if name else None
    if fn is None or t is None:
        return 0.0, 0.0, dtype, "none"  # without parsing dims: most signatures are unmodelled views
    d = _as_list(dims)
    if d is None:
        return 0.0, 0.0, dtype, "none"
    try:
        res = fn(_Args(d, t, _as_list(concrete)))
    except (TypeError, ValueError, IndexError, ZeroDivisionError, OverflowError, AttributeError):
        # Recorded shapes are untrusted input: one malformed record must not abort a 10^6-op pass.
        res = None
    if res is None:
        return 0.0, 0.0, dtype, "none"
    flops, nbytes, model = res
    if not (math.isfinite(flops) and math.isfinite(nbytes)) or flops < 0 or nbytes < 0:
        return 0.0, 0.0, dtype, "none"
    return float(flops), float(nbytes), dtype, model


@dataclass(frozen=True)
class OpCosts:
    """Per-op costs, aligned row for row with the ops table they were computed from."""

    flops: np.ndarray   # float64, useful FLOPs of the op alone
    bytes: np.ndarray   # float64, ideal device-memory bytes read + written
    dtype: np.ndarray   # str: fp32 | tf32 | bf16 | fp16 | fp8 | int8 | fp64 | other
    model: np.ndarray   # str: one of MODELS

    def __len__(self) -> int:
        return len(self.flops)

    def to_table(self) -> pa.Table:
        return pa.table({
            "flops": pa.array(self.flops, pa.float64()),
            "bytes": pa.array(self.bytes, pa.float64()),
            "dtype": pa.array(self.dtype.astype(object), pa.string()).dictionary_encode(),
            "model": pa.array(self.model.astype(object), pa.string()).dictionary_encode(),
        })


# Signature columns, in order; concrete_inputs joins the key only when the table has it.
_SIGNATURE_COLUMNS = ("name", "input_dims", "input_types", "concrete_inputs")


def _codes(col: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, list[Any]]:
    """Dictionary codes (0 = null, i+1 = dictionary[i]) and the dictionary values of one column."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if pa.types.is_dictionary(arr.type):
        # Re-encode: chunks of a dictionary column may carry different dictionaries.
        arr = arr.cast(arr.type.value_type)
    enc = pc.dictionary_encode(arr)
    codes = pc.fill_null(enc.indices, -1).to_numpy(zero_copy_only=False).astype(np.int64) + 1
    return codes, enc.dictionary.to_pylist()


def model_ops(ops: pa.Table) -> OpCosts:
    """Costs of every op in an ops record table (records.OPS), one :func:`op_cost` call per signature.

    A signature is the distinct (name, input_dims, input_types[, concrete_inputs]) combination;
    training and serving loops repeat the same shapes every step, so a 10^6-row table typically has
    a few thousand signatures. The columns are dictionary-encoded, combined into one integer key,
    made unique with numpy, and the per-signature answers are mapped back with a take.
    """
    n = ops.num_rows
    if n == 0:
        empty = np.empty(0, dtype=np.float64)
        return OpCosts(empty, empty.copy(), np.empty(0, dtype="<U5"), np.empty(0, dtype="<U11"))
    cols = [c for c in _SIGNATURE_COLUMNS if c in ops.column_names]
    encoded = [_codes(ops.column(c)) for c in cols]
    key = np.zeros(n, dtype=np.int64)
    radix = 1
    fits = True
    for codes, values in encoded:
        size = len(values) + 1
        if radix * size >= 2**62:
            fits = False
            break
        key += codes * radix
        radix *= size
    if fits:
        _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    else:  # dictionaries too large for one int64 key: unique rows of the code matrix instead
        stacked = np.stack([c for c, _ in encoded], axis=1)
        _, first, inverse = np.unique(stacked, axis=0, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    m = len(first)
    flops_u = np.empty(m, dtype=np.float64)
    bytes_u = np.empty(m, dtype=np.float64)
    dtype_u: list[str] = []
    model_u: list[str] = []
    for j, row in enumerate(first):
        args = [values[codes[row] - 1] if codes[row] else None for codes, values in encoded]
        name, dims, types = args[0], args[1] if len(args) > 1 else None, args[2] if len(args) > 2 else None
        conc = args[3] if len(args) > 3 else None
        f, b, dt, mo = op_cost(name, dims, types, conc)
        flops_u[j] = f
        bytes_u[j] = b
        dtype_u.append(dt)
        model_u.append(mo)
    return OpCosts(
        flops=flops_u[inverse],
        bytes=bytes_u[inverse],
        dtype=np.array(dtype_u, dtype="<U5")[inverse],
        model=np.array(model_u, dtype="<U11")[inverse],
    )
