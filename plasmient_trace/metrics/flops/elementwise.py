"""Elementwise ops: 1 FLOP per element of the broadcast output (addcmul/addcdiv/lerp 2; copies, fills and
joins 0), _foreach_* over the summed list, fused Adam(W) 12 per parameter; their bytes make them memory-bound."""

from __future__ import annotations

from functools import partial

from .core import _LIST_ELEMENT_BYTES, OpArgs, FlopResult, _broadcast, _prod, _reg
from .reduction import _reduction


def _main_es(a: OpArgs, idx: list[int]) -> float:
    """Output element size: that of the largest input (ties: the widest), a type-promotion proxy."""
    best = max(idx, key=lambda i: (a.numel(i), a.es(i)))
    return a.es(best)


def _elementwise(a: OpArgs, k: float = 1.0, bool_out: bool = False, inplace: bool = False,
                 arity: int | None = None) -> FlopResult:
    """``arity``: the most arguments a functional overload of the op takes (FUNCTIONAL_ARITY). More, the last
    a tensor, is the out= overload (relu_ calls clamp_min.out(self, min, out=self)): ``out`` is written, not read."""
    idx = a.tensors()
    if not idx:
        return None
    n_args = min(len(a.dims), len(a.types))
    if not inplace and arity is not None and n_args > arity and len(idx) > 1 and idx[-1] == n_args - 1:
        out_arg = idx.pop()
        n = _prod(_broadcast([a.shape(i) for i in idx]))  # type: ignore[misc]
        return k * n, sum(a.nbytes(i) for i in idx) + a.nbytes(out_arg), "elementwise"
    read = sum(a.nbytes(i) for i in idx)
    if inplace:
        # self (dims[0]) is read and written; the output is self's shape
        n = a.numel(idx[0])
        return k * n, read + a.nbytes(idx[0]), "elementwise"
    out = _broadcast([a.shape(i) for i in idx])  # type: ignore[misc]
    n = _prod(out)
    return k * n, read + n * (1.0 if bool_out else _main_es(a, idx)), "elementwise"


def _copy(a: OpArgs) -> FlopResult:
    # copy_(self, src): read src, write self; no math.
    if not a.is_tensor(0):
        return None
    return 0.0, a.nbytes(0) + (a.nbytes(1) if a.is_tensor(1) else 0), "elementwise"


def _fill(a: OpArgs) -> FlopResult:
    if not a.is_tensor(0):
        return None
    return 0.0, a.nbytes(0), "elementwise"


def _dropout(a: OpArgs) -> FlopResult:
    # native_dropout(input, p, train): draw + compare + scale; writes the output and a bool mask
    X = a.shape(0)
    if X is None:
        return None
    n = _prod(X)
    return 2.0 * n, a.nbytes(0) + n * a.es(0) + n * 1.0, "elementwise"


def _pad(a: OpArgs) -> FlopResult:
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


def _max_min(a: OpArgs) -> FlopResult:
    # aten::max/min: two tensors -> elementwise; one tensor -> reduction (with indices for .dim)
    if len(a.tensors()) >= 2:
        return _elementwise(a)
    return _reduction(a, k=1.0, dim_idx=1, index_out=True)


def _foreach(a: OpArgs, k: float, inplace: bool, zero_flops: bool = False) -> FlopResult:
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


def _fused_adam(a: OpArgs) -> FlopResult:
    # _fused_adam(w)_(params, grads, exp_avgs, exp_avg_sqs, ...): ~12 FLOPs per parameter (moment
    # updates 7, bias-corrected step 5); reads p, g, m, v and writes p, m, v.
    shapes = a.shape_list(0)
    if shapes is None:
        return None
    n = sum(_prod(s) for s in shapes)
    return 12.0 * n, 7 * n * _LIST_ELEMENT_BYTES, "elementwise"



# ---- registrations (positions in the comments above each formula)
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
# The most arguments any functional (not out=) overload of each op takes, in torch 2.13's schemas
# (tests/test_flops.py checks the table against torch): a call with more, the last a tensor, is out=.
FUNCTIONAL_ARITY = {name: arity for arity, names in {
    1: """abs acos angle asin atan bitwise_not ceil cos cosh erf erfc erfinv exp exp2 expm1 floor frac
hardsigmoid hardswish isfinite isinf isnan isneginf isposinf log10 log1p log2 logical_not mish neg
positive reciprocal relu relu6 rsqrt selu sgn sigmoid sign signbit silu sin sinh sqrt square tan
tanh trunc""".split(),
    2: """__and__ __lshift__ __or__ __rshift__ __xor__ _prelu_kernel atan2 bitwise_and bitwise_left_shift
bitwise_or bitwise_right_shift bitwise_xor celu clamp_max clamp_min copysign eq float_power
floor_divide fmax fmin fmod ge gelu glu gt hardshrink hardsigmoid_backward hardswish_backward
heaviside hypot le leaky_relu log logical_and logical_or logical_xor logit lt maximum minimum
mish_backward mul ne nextafter polar pow prelu remainder round sigmoid_backward silu_backward
softshrink tanh_backward true_divide xlogy""".split(),
    3: """_masked_scale _prelu_kernel_backward add clamp clip div gelu_backward glu_backward hardtanh lerp
logit_backward masked_fill native_dropout_backward rsub softplus sub threshold threshold_backward
where""".split(),
    4: """addcdiv addcmul elu hardtanh_backward leaky_relu_backward mse_loss_backward nan_to_num
softplus_backward""".split(),
    5: """rrelu""".split(),
    6: """elu_backward""".split(),
    7: """rrelu_with_noise_backward""".split(),
}.items() for name in names}

for _base in _UNARY + _BINARY:
    _reg([f"aten::{_base}"], partial(_elementwise, arity=FUNCTIONAL_ARITY.get(_base)))
    _reg([f"aten::{_base}_"], partial(_elementwise, inplace=True))
for _base in _BACKWARD_EW:
    _reg([f"aten::{_base}"], partial(_elementwise, arity=FUNCTIONAL_ARITY.get(_base)))
for _base in _COMPARE:
    _reg([f"aten::{_base}"], partial(_elementwise, bool_out=True, arity=FUNCTIONAL_ARITY.get(_base)))
    _reg([f"aten::{_base}_"], partial(_elementwise, inplace=True))
for _base, _k in _TWO_FLOPS.items():
    _reg([f"aten::{_base}"], partial(_elementwise, k=_k, arity=FUNCTIONAL_ARITY.get(_base)))
    _reg([f"aten::{_base}_"], partial(_elementwise, k=_k, inplace=True))
_reg(["aten::mse_loss_backward"], partial(_elementwise, k=3.0, arity=FUNCTIONAL_ARITY.get("mse_loss_backward")))
_reg(["aten::copy_"], _copy)
_reg(["aten::fill_", "aten::zero_", "aten::normal_", "aten::uniform_", "aten::bernoulli_", "aten::random_",
      "aten::exponential_"], _fill)
_reg(["aten::native_dropout"], _dropout)
_reg(["aten::constant_pad_nd"], _pad)
_reg(["aten::max", "aten::min"], _max_min)
for _base in ["add", "sub", "mul", "div", "clamp", "clamp_min", "clamp_max", "neg", "sqrt", "exp", "abs", "pow",
              "reciprocal", "sign", "maximum", "minimum"]:
    _reg([f"aten::_foreach_{_base}_"], partial(_foreach, k=1.0, inplace=True))
    _reg([f"aten::_foreach_{_base}"], partial(_foreach, k=1.0, inplace=False))
for _base in ["addcmul", "addcdiv", "lerp"]:
    _reg([f"aten::_foreach_{_base}_"], partial(_foreach, k=2.0, inplace=True))
    _reg([f"aten::_foreach_{_base}"], partial(_foreach, k=2.0, inplace=False))
_reg(["aten::_foreach_copy_", "aten::_foreach_zero_"], partial(_foreach, k=0.0, inplace=True, zero_flops=True))
_reg(["aten::_fused_adam_", "aten::_fused_adamw_", "aten::_fused_adam", "aten::_fused_adamw"], _fused_adam)



# Shape-only ops change a tensor's metadata, never its data: a known zero of FLOPs and bytes (model "view"),
# so a CPU run, where such a leaf op is its own unit of work, does not count them as unknown work.
SHAPE_ONLY_OPS = tuple(f"aten::{n}" for n in (
    "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "expand_as", "unsqueeze", "squeeze",
    "as_strided", "alias", "detach", "unbind", "split", "split_with_sizes", "chunk", "select", "slice", "narrow",
    "flatten", "unflatten", "view_as", "numpy_T", "lift_fresh", "_reshape_alias",
    # their in-place forms change the tensor's own metadata
    "t_", "transpose_", "detach_", "squeeze_", "unsqueeze_", "as_strided_", "swapaxes_", "swapdims_"))


def _shape_only(a: OpArgs) -> FlopResult:
    return 0.0, 0.0, "view"


_reg(SHAPE_ONLY_OPS, _shape_only)


# Joining tensors copies them and computes nothing: zero FLOPs, known from the name alone (shapes or not). Its
# bytes are not: Kineto and the live observer record a TensorList's shapes with no element type, so they stay
# unknown (0 bytes, no bound from a roofline) rather than a guessed dtype. cat takes 2-4% of the device time of
# a100_multirank and h100/qwen.
JOIN_OPS = ("aten::cat", "aten::_cat", "aten::concat", "aten::concatenate", "aten::stack")


def _join(a: OpArgs) -> FlopResult:
    return 0.0, 0.0, "elementwise"


_reg(JOIN_OPS, _join)
