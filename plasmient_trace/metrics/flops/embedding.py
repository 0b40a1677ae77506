"""Embedding-like gathers: 0 FLOPs, bytes = gathered rows read + written + the indices;
embedding_dense_backward and embedding_bag 1 FLOP per summed element."""

from __future__ import annotations

from .core import OpArgs, FlopResult, _prod, _reg


def _embedding(a: OpArgs) -> FlopResult:
    W, idx = a.shape(0), a.shape(1)
    if W is None or idx is None or len(W) != 2:
        return None
    rows = _prod(idx)
    gathered = rows * W[1] * a.es(0)
    return 0.0, 2 * gathered + a.nbytes(1), "embedding"


def _embedding_backward(a: OpArgs) -> FlopResult:
    # embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq)
    G = a.shape(0)
    if G is None or not G:
        return None
    n = _prod(G)
    num_weights = a.value(2)
    grad_weight = (num_weights * G[-1] if isinstance(num_weights, int) and not isinstance(num_weights, bool)
                   and num_weights > 0 else n) * a.es(0)
    return float(n), a.nbytes(0) + a.nbytes(1) + grad_weight, "embedding"


def _embedding_bag(a: OpArgs) -> FlopResult:
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


def _index_select(a: OpArgs) -> FlopResult:
    # index_select(self, dim, index): rows of self picked along dim (dim 0 when unrecorded)
    X, idx = a.shape(0), a.shape(2)
    if X is None or idx is None or not X:
        return None
    dim = a.value(1)
    d = dim % len(X) if isinstance(dim, int) and not isinstance(dim, bool) else 0
    out = _prod(X) // X[d] * _prod(idx) if X[d] else 0
    return 0.0, 2 * out * a.es(0) + a.nbytes(2), "embedding"


def _gather(a: OpArgs) -> FlopResult:
    # gather(self, dim, index): the output has index's shape
    idx = a.shape(2)
    if idx is None or not a.is_tensor(0):
        return None
    out = _prod(idx)
    return 0.0, 2 * out * a.es(0) + a.nbytes(2), "embedding"



# ---- registrations (positions in the comments above each formula)
_reg(["aten::embedding"], _embedding)
_reg(["aten::embedding_dense_backward", "aten::embedding_backward"], _embedding_backward)
_reg(["aten::_embedding_bag", "aten::embedding_bag", "aten::_embedding_bag_forward_only"], _embedding_bag)
_reg(["aten::index_select"], _index_select)
_reg(["aten::gather"], _gather)

