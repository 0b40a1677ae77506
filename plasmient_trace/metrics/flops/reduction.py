"""Reductions (sum, mean, amax, norm, ...) 1 FLOP per input element (std/var/logsumexp 3, vector norms 2),
output size from the recorded dim; pooling out elements * window; losses a few FLOPs per element."""

from __future__ import annotations

from functools import partial
from typing import Any

from .core import OpArgs, FlopResult, _ints, _prod, _reg


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


def _reduction(a: OpArgs, k: float = 1.0, dim_idx: int | None = 1, index_out: bool = False,
               out_es: float | None = None) -> FlopResult:
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


def _scan(a: OpArgs) -> FlopResult:
    idx = a.tensors()
    if not idx:
        return None
    n = a.numel(idx[0])
    return float(n), a.nbytes(idx[0]) + a.dense_bytes(idx[0]), "reduction"


def _pool(a: OpArgs, nsp: int = 2, stride_idx: int = 2, pad_idx: int = 3, dil_idx: int | None = 4,
          ceil_idx: int | None = 5, extra: float = 0.0, indices: bool = False) -> FlopResult:
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


def _adaptive_pool(a: OpArgs, nsp: int = 2) -> FlopResult:
    X = a.shape(0)
    if X is None or len(X) < nsp + 1:
        return None
    size = _ints(a.value(1), nsp)
    out = _prod(X[:-nsp]) * (_prod(size) if size is not None else 1)
    return float(_prod(X) + out), a.nbytes(0) + out * a.es(0), "reduction"


def _pool_backward(a: OpArgs) -> FlopResult:
    # *_pool*_backward(grad_output, self, ...): scatter grad_output into a grad_input shaped like self
    G, X = a.shape(0), a.shape(1)
    if G is None or X is None:
        return None
    nb = a.nbytes(0) + a.nbytes(1) + sum(a.nbytes(i) for i in a.tensors()[2:])
    return float(max(_prod(G), _prod(X))), nb, "reduction"


def _nll_forward(a: OpArgs) -> FlopResult:
    X, T = a.shape(0), a.shape(1)
    if X is None or T is None:
        return None
    n = max(_prod(T), 1)
    return float(n), n * a.es(0) + a.nbytes(1) + a.es(0), "reduction"


def _nll_backward(a: OpArgs) -> FlopResult:
    # nll_loss_backward(grad_output, self, target, ...): writes a grad the size of self
    X, T = a.shape(1), a.shape(2)
    if X is None or T is None:
        return None
    n = max(_prod(T), 1)
    return float(n), a.nbytes(0) + a.nbytes(2) + a.nbytes(1), "elementwise"


def _loss(a: OpArgs, k: float) -> FlopResult:
    X = a.shape(0)
    if X is None:
        return None
    return k * _prod(X), sum(a.nbytes(i) for i in a.tensors()) + a.es(0), "reduction"



# ---- registrations (positions in the comments above each formula)
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


