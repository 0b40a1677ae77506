"""Convolutions (every aten/cudnn/miopen/mkldnn spelling): 2 * numel(out) * prod(weight.shape[1:]), no bias
flops. The output size comes from stride, padding and dilation in ``Concrete Inputs``; when the stride
was not recorded the op is left unknown here (model 'none') and :mod:`.conv_stride` may recover it
from the op that consumes the conv's output. Transposed convs need no stride: 2 * numel(input) *
prod(weight.shape[1:]). ``convolution_backward`` costs the forward once per gradient its output_mask
asks for (2x when unknown). Before torch 1.11 cuDNN's and MIOpen's backward ran each gradient as an op of
its own under the backward op (``cudnn_convolution_backward_input`` and ``_weight``), whose arguments
lack the sizes their cost needs: :mod:`.context` costs each from its parent's (``conv_gradient_cost``).

Argument positions: each registration's _ConvLayout names the index of stride, padding, dilation,
transposed, bias and groups in that spelling's schema."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from .core import OpArgs, FlopResult, _ints, _prod, _reg


@dataclass(frozen=True)
class _ConvLayout:
    stride: int | None = None
    padding: int | None = None
    dilation: int | None = None
    transposed: int | bool | None = False  # arg index of the flag, or a fixed answer
    bias: int | None = None
    groups: int | None = None


def _conv_forward(a: OpArgs, lay: _ConvLayout, out_spatial: list[int] | None = None) -> FlopResult:
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
        sp_out = out_spatial if out_spatial is not None else _conv_out_spatial(a, lay, sp_in, W[2:])
        if sp_out is None:
            return None  # stride not recorded: unknown here; the table pass may read it off the consumer
        out_numel = N * W[0] * _prod(sp_out)
        flops = 2.0 * out_numel * w_inner
    nb = a.nbytes(0) + a.nbytes(1) + bias_bytes + out_numel * a.es(0)
    return flops, nb, "conv"


def _conv_out_spatial(a: OpArgs, lay: _ConvLayout, sp_in: list[int], kernel: list[int]) -> list[int] | None:
    nsp = len(kernel)
    pad_v = a.value(lay.padding)
    if isinstance(pad_v, str):  # conv2d.padding overload: 'same' keeps the size, 'valid' pads 0
        if pad_v == "same":
            return list(sp_in)
        pad_v = 0
    stride = _ints(a.value(lay.stride), nsp)
    if stride is None:
        return None  # never guessed: stride 2 would make the output 4x smaller
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


def _conv_backward(a: OpArgs, lay: _ConvBwdLayout) -> FlopResult:
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



# ---- registrations (positions in the comments above each formula)
_FORWARD: dict[str, _ConvLayout] = {}


def _reg_fwd(names: list[str], lay: _ConvLayout) -> None:
    for n in names:
        _FORWARD[n] = lay
    _reg(names, partial(_conv_forward, lay=lay))


def conv_forward_with_output(name: str, args: OpArgs, out_spatial: list[int]) -> FlopResult:
    """Cost of a regular (not transposed) forward conv whose output spatial size is known from
    elsewhere (the op that consumes it), for traces that did not record the stride."""
    lay = _FORWARD.get(name)
    return None if lay is None else _conv_forward(args, lay, out_spatial=out_spatial)


def conv_forward_names() -> list[str]:
    """Op names of forward convolutions whose output size depends on a stride."""
    return [n for n, lay in _FORWARD.items() if lay.transposed is not True]


_CONV_STD = _ConvLayout(stride=3, padding=4, dilation=5, transposed=False, bias=2)
_reg_fwd(["aten::conv1d", "aten::conv2d", "aten::conv3d", "aten::_convolution_mode",
          "aten::cudnn_convolution_relu"], _CONV_STD)
_reg_fwd(["aten::convolution", "aten::_convolution", "aten::convolution_overrideable"],
         _ConvLayout(stride=3, padding=4, dilation=5, transposed=6, bias=2, groups=8))
_reg_fwd(["aten::cudnn_convolution"], _ConvLayout(padding=2, stride=3, dilation=4))
_reg_fwd(["aten::miopen_convolution", "aten::miopen_depthwise_convolution", "aten::mkldnn_convolution"],
         _ConvLayout(padding=3, stride=4, dilation=5, bias=2))
_reg_fwd(["aten::cudnn_convolution_add_relu"], _ConvLayout(stride=5, padding=6, dilation=7, bias=4))
_reg_fwd(["aten::_slow_conv2d_forward", "aten::thnn_conv2d"], _ConvLayout(stride=4, padding=5, bias=3))
_reg_fwd(["aten::slow_conv_dilated2d", "aten::slow_conv_dilated3d", "aten::slow_conv3d_forward", "aten::slow_conv3d"],
         _ConvLayout(stride=4, padding=5, dilation=6, bias=3))
_reg_fwd(["aten::_nnpack_spatial_convolution"], _ConvLayout(padding=3, stride=4, bias=2))
_reg_fwd(["aten::conv_transpose1d", "aten::conv_transpose2d", "aten::conv_transpose3d"],
         _ConvLayout(stride=3, padding=4, dilation=7, transposed=True, bias=2, groups=6))
_reg_fwd(["aten::cudnn_convolution_transpose"], _ConvLayout(padding=2, stride=4, dilation=5, transposed=True, groups=6))
_reg_fwd(["aten::miopen_convolution_transpose"],
         _ConvLayout(padding=3, stride=5, dilation=6, transposed=True, bias=2, groups=7))
_reg_fwd(["aten::slow_conv_transpose2d", "aten::slow_conv_transpose3d"],
         _ConvLayout(stride=4, padding=5, dilation=7, transposed=True, bias=3))
_reg(["aten::convolution_backward", "aten::convolution_backward_overrideable"],
     partial(_conv_backward, lay=_ConvBwdLayout(grad_out=0, input=1, weight=2, transposed=7, mask=10)))
# Legacy (torch < 1.11) spellings: (self, grad_output, weight, padding, stride, dilation, groups, ...).
_reg(["aten::cudnn_convolution_backward"],
     partial(_conv_backward, lay=_ConvBwdLayout(grad_out=1, input=0, weight=2, transposed=False, mask=10)))
_reg(["aten::miopen_convolution_backward"],
     partial(_conv_backward, lay=_ConvBwdLayout(grad_out=1, input=0, weight=2, transposed=False, mask=9)))
_reg(["aten::cudnn_convolution_transpose_backward"],
     partial(_conv_backward, lay=_ConvBwdLayout(grad_out=1, input=0, weight=2, transposed=True, mask=11)))


# Legacy (torch < 1.11) gradient ops, each one forward's work, and the backward op they run under. The
# parent's arguments (self, grad_output, weight) give their cost; their own lack a size (grad_input's
# for the input gradient, the kernel's for the weight gradient: IntArrayRef arguments Kineto recorded
# without values).
CONV_GRADIENT_PARENTS = {
    "aten::cudnn_convolution_backward_input": "aten::cudnn_convolution_backward",
    "aten::cudnn_convolution_backward_weight": "aten::cudnn_convolution_backward",
    "aten::miopen_convolution_backward_input": "aten::miopen_convolution_backward",
    "aten::miopen_convolution_backward_weight": "aten::miopen_convolution_backward",
}


def conv_gradient_cost(parent: OpArgs) -> FlopResult:
    """Either gradient of a legacy conv backward, from its parent's arguments (self, grad_output, weight): the
    forward's FLOPs; bytes read (grad_output and the weight, or grad_output and the input) and written (the
    gradient), the three tensors either way."""
    X, G, W = parent.shape(0), parent.shape(1), parent.shape(2)
    if X is None or G is None or W is None or len(W) < 3 or len(X) != len(W) or len(G) != len(W):
        return None
    flops = 2.0 * _prod(G) * _prod(W[1:])
    return flops, parent.nbytes(1) + parent.nbytes(0) + parent.nbytes(2), "conv"
