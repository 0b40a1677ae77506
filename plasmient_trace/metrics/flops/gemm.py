"""GEMM family: mm 2MNK; addmm 2MNK + MN (the bias add); bmm 2BMNK; baddbmm 2BMNK + BMN; mv/addmv 2MK (+M);
dot 2K; matmul with numpy broadcasting of batch dims and the 1-D cases; linear 2*prod(batch)*N*K
(+ prod(batch)*N with a bias); _scaled_mm/_int_mm 2MNK. Bytes: operands read once, output written once.
Operands whose contracted sizes differ cannot be multiplied (an op a TorchScript graph ran records the
interpreter's stack before its own arguments): they have no model, not a count of other tensors' sizes."""

from __future__ import annotations

from functools import partial

from .core import FlopResult, OpArgs, _broadcast, _prod, _reg


def _mm(a: OpArgs) -> FlopResult:
    # mm(self [M, K] 0, mat2 [K, N] 1)
    A, B = a.shape(0), a.shape(1)
    if A is None or B is None or len(A) != 2 or len(B) != 2 or A[1] != B[0]:
        return None
    (M, K), N = A, B[1]
    return 2.0 * M * N * K, a.nbytes(0) + a.nbytes(1) + M * N * a.es(0), "gemm"


def _addmm(a: OpArgs, extra_per_out: int = 1) -> FlopResult:
    # addmm(self (bias) 0, mat1 [M, K] 1, mat2 [K, N] 2, beta, alpha); _addmm_activation adds 1 more per output
    A, B = a.shape(1), a.shape(2)
    if A is None or B is None or len(A) != 2 or len(B) != 2 or A[1] != B[0]:
        return None
    (M, K), N = A, B[1]
    flops = 2.0 * M * N * K + extra_per_out * M * N
    return flops, a.nbytes(0) + a.nbytes(1) + a.nbytes(2) + M * N * a.es(1), "gemm"


def _bmm(a: OpArgs) -> FlopResult:
    # bmm(self [B, M, K] 0, mat2 [B, K, N] 1)
    A, B = a.shape(0), a.shape(1)
    if A is None or B is None or len(A) != 3 or len(B) != 3 or A[2] != B[1]:
        return None
    (Bt, M, K), N = A, B[2]
    return 2.0 * Bt * M * N * K, a.nbytes(0) + a.nbytes(1) + Bt * M * N * a.es(0), "gemm"


def _baddbmm(a: OpArgs, summed: bool = False) -> FlopResult:
    # baddbmm(self 0, batch1 [B, M, K] 1, batch2 [B, K, N] 2, beta, alpha): writes [B, M, N];
    # addbmm (summed=True) adds the B products into one [M, N] output.
    A, B = a.shape(1), a.shape(2)
    if A is None or B is None or len(A) != 3 or len(B) != 3 or A[2] != B[1]:
        return None
    (Bt, M, K), N = A, B[2]
    flops = 2.0 * Bt * M * N * K + Bt * M * N
    out = M * N if summed else Bt * M * N
    return flops, a.nbytes(0) + a.nbytes(1) + a.nbytes(2) + out * a.es(1), "gemm"


def _mv(a: OpArgs, mat: int = 0, vec: int = 1, bias: int | None = None) -> FlopResult:
    # mv(self [M, K] 0, vec [K] 1); addmv(self (bias) 0, mat 1, vec 2, beta, alpha)
    A, v = a.shape(mat), a.shape(vec)
    if A is None or v is None or len(A) != 2 or len(v) != 1 or A[1] != v[0]:
        return None
    M, K = A
    flops = 2.0 * M * K + (M if bias is not None else 0)
    nb = a.nbytes(mat) + a.nbytes(vec) + (a.nbytes(bias) if bias is not None else 0) + M * a.es(mat)
    return flops, nb, "gemm"


def _dot(a: OpArgs) -> FlopResult:
    # dot/vdot(self [K] 0, tensor [K] 1)
    A, B = a.shape(0), a.shape(1)
    if A is None or B is None or len(A) != 1 or len(B) != 1 or A[0] != B[0]:
        return None
    return 2.0 * A[0], a.nbytes(0) + a.nbytes(1) + a.es(0), "gemm"


def _matmul(a: OpArgs) -> FlopResult:
    # matmul(self 0, other 1), numpy semantics: 1-D operands, broadcast batch dims
    A, B = a.shape(0), a.shape(1)
    if A is None or B is None or not A or not B or A[-1] != (B[0] if len(B) == 1 else B[-2]):
        return None  # operands that cannot be multiplied: a record's shapes are not these arguments'
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


def _linear(a: OpArgs) -> FlopResult:
    # linear(input [..., K] 0, weight [N, K] 1, bias [N] 2 optional)
    X, W = a.shape(0), a.shape(1)
    if X is None or W is None or not X or len(W) not in (1, 2) or X[-1] != W[-1]:
        return None  # weight [N, K] or [K]: an input whose last size is not K is another op's record
    rows = _prod(X[:-1])
    K = X[-1]
    N = W[0] if len(W) == 2 else 1
    has_bias = a.is_tensor(2)
    flops = 2.0 * rows * N * K + (rows * N if has_bias else 0)
    return flops, a.nbytes(0) + a.nbytes(1) + a.nbytes(2) + rows * N * a.es(0), "gemm"


def _scaled_mm(a: OpArgs, out_es: float = 2.0) -> FlopResult:
    # _scaled_mm(self [M, K] 0, mat2 [K, N] 1, scale_a 2, scale_b 3, bias 4, ...); _int_mm(self 0, mat2 1)
    # fp8 GEMMs write bf16/fp32 (the out_dtype arg is a ScalarType code Kineto rarely records): 2 bytes.
    A, B = a.shape(0), a.shape(1)
    if A is None or B is None or len(A) != 2 or len(B) != 2 or A[1] != B[0]:
        return None
    (M, K), N = A, B[1]
    has_bias = a.is_tensor(4)
    flops = 2.0 * M * N * K + (M * N if has_bias else 0)
    nb = sum(a.nbytes(i) for i in a.tensors()) + M * N * out_es
    return flops, nb, "gemm"



# ---- registrations (positions in the comments above each formula)
_reg(["aten::mm"], _mm)
_reg(["aten::addmm"], _addmm)
_reg(["aten::_addmm_activation"], partial(_addmm, extra_per_out=2))
_reg(["aten::bmm"], _bmm)
_reg(["aten::baddbmm"], _baddbmm)
_reg(["aten::addbmm"], partial(_baddbmm, summed=True))
_reg(["aten::mv"], _mv)
_reg(["aten::addmv"], partial(_mv, mat=1, vec=2, bias=0))
_reg(["aten::dot", "aten::vdot"], _dot)
_reg(["aten::matmul"], _matmul)
_reg(["aten::linear"], _linear)
_reg(["aten::_scaled_mm"], _scaled_mm)
_reg(["aten::_int_mm"], partial(_scaled_mm, out_es=4.0))

