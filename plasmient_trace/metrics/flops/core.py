"""Shared vocabulary of the FLOP models: dtypes, the parsed view of one op's recorded arguments
(:class:`OpArgs`), shape helpers, and the formula registry with its public decorator
:func:`register_flop_formula`. Family modules (gemm, conv, ...) register into it at import."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import orjson

MODELS = ("gemm", "conv", "attention", "norm", "softmax", "elementwise", "embedding", "reduction", "view", "none")
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


class OpArgs:
    """One op's recorded arguments by position: ``shape(i)`` of tensor argument i, ``value(i)`` of a
    scalar/list argument from ``Concrete Inputs`` (None when not recorded), element size and bytes."""

    __slots__ = ("dims", "types", "conc", "strides")

    def __init__(self, dims: list[Any], types: list[Any], conc: list[Any] | None, strides: list[Any] | None = None):
        self.dims = dims
        self.types = types
        self.conc = conc
        self.strides = strides  # Kineto's 'Input Strides' where recorded; None: dense

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
        """Bytes of tensor argument i in memory: a broadcast dimension (stride 0, an ``expand``) holds one
        element however long it is, so its reads are counted once."""
        s = self.shape(i)
        if s is None:
            return 0.0
        st = self.strides[i] if self.strides is not None and i < len(self.strides) else None
        if isinstance(st, list) and len(st) == len(s) and 0 in st:
            return _prod([n for n, k in zip(s, st) if k != 0]) * self.es(i)
        return _prod(s) * self.es(i)

    def dense_bytes(self, i: int) -> float:
        """Bytes of a tensor of argument i's shape and dtype laid out densely: what an output of its shape
        writes, whether or not argument i itself is broadcast."""
        return self.numel(i) * self.es(i)

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






FlopResult = tuple[float, float, str] | None
"""A formula's answer: (flops, bytes, model) with model one of MODELS, or None when the recorded
arguments do not determine the cost (the op then counts as unknown, model 'none')."""
FlopFormula = Callable[[OpArgs], FlopResult]

_REGISTRY: dict[str, FlopFormula] = {}


def register_flop_formula(names: str | Sequence[str], *, replace: bool = True) -> Callable[[FlopFormula], FlopFormula]:
    """Decorator registering ``formula(args: OpArgs) -> (flops, bytes, model) | None`` for op names.

    Modelled on ``torch.utils.flop_counter.register_flop_formula``, but a formula reads recorded
    shapes and concrete values by argument position (``args.shape(0)``, ``args.value(3)``) because a
    trace holds shapes, not tensors. ``names`` are the op names as the trace spells them
    (``"aten::mm"``, ``"mylib::fused_gemm"``). A later registration wins unless ``replace=False``,
    which raises instead, so a user formula can deliberately override a built-in one.
    """
    if isinstance(names, str):
        names = [names]

    def deco(fn: FlopFormula) -> FlopFormula:
        for n in names:
            if not replace and n in _REGISTRY:
                raise ValueError(f"a FLOP formula for {n!r} is already registered")
            _REGISTRY[n] = fn
        return fn
    return deco


def registered_ops() -> frozenset[str]:
    """Every op name that has a FLOP formula."""
    return frozenset(_REGISTRY)


def formula_for(name: str | None) -> FlopFormula | None:
    return _REGISTRY.get(name) if name else None


def _reg(names: Sequence[str], fn: FlopFormula) -> None:
    register_flop_formula(names)(fn)
