"""Norms and softmax, per element of the input: layer/group/batch (training) norm 5 + 1 per affine
parameter; rms norm 3 + 1 with a weight; batch norm in eval 2; backward norms 2x their forward.
softmax / log_softmax 5 per element, their backward 4.

Argument positions: each _NormLayout names the index of input, weight, bias, the training flag
and grad_output in that op's schema."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from .core import OpArgs, FlopResult, _prod, _reg


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


def _norm(a: OpArgs, lay: _NormLayout) -> FlopResult:
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
        return 2.0 * per * n, gb + xb + params + a.dense_bytes(lay.input) + params, "norm"
    return float(per * n), xb + a.dense_bytes(lay.input) + params, "norm"


def _softmax(a: OpArgs) -> FlopResult:
    X = a.shape(0)
    if X is None:
        return None
    return 5.0 * _prod(X), a.nbytes(0) + a.dense_bytes(0), "softmax"


def _softmax_backward(a: OpArgs) -> FlopResult:
    G = a.shape(0)
    if G is None:
        return None
    return 4.0 * _prod(G), a.nbytes(0) + a.nbytes(1) + a.dense_bytes(0), "softmax"



# ---- registrations (positions in the comments above each formula)
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

_reg(["aten::softmax", "aten::_softmax", "aten::log_softmax", "aten::_log_softmax", "aten::_safe_softmax",
      "aten::special_softmax", "aten::special_log_softmax"], _softmax)
_reg(["aten::_softmax_backward_data", "aten::_log_softmax_backward_data"], _softmax_backward)

