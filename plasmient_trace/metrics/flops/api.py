"""The public entry points: the cost of one op (:func:`op_cost`) and of a whole ops record table
(:func:`model_ops`, one formula call per distinct signature)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from ..grouping import group_rows
from .context import SIGNATURE_COLUMNS, apply_context
from .core import _DTYPES, OpArgs, formula_for
from .labels import LabelColumn, Labels
from .moe import MoEConfig


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


def op_cost(name: str | None, dims: Any, types: Any, concrete: Any = None,
            strides: Any = None) -> tuple[float, float, str, str]:
    """(flops, bytes, dtype, model) of one op from its recorded inputs.

    ``dims``/``types``/``concrete``/``strides`` are Kineto's 'Input Dims', 'Input type', 'Concrete Inputs'
    and 'Input Strides' (None: dense inputs), either parsed lists or their JSON text (as stored in the ops
    record table). Pure: the same
    arguments always give the same answer, which is what lets :func:`model_ops` call it once per
    distinct signature.
    """
    t = _as_list(types)
    dtype = _first_dtype(t)
    fn = formula_for(name)
    if fn is None or t is None:
        return 0.0, 0.0, dtype, "none"  # without parsing dims: most signatures are unmodelled views
    d = _as_list(dims)
    if d is None:
        return 0.0, 0.0, dtype, "none"
    try:
        res = fn(OpArgs(d, t, _as_list(concrete), _as_list(strides)))
    except (TypeError, ValueError, IndexError, ZeroDivisionError, OverflowError, AttributeError):
        # Recorded shapes are untrusted input: one malformed record must not abort a 10^6-op pass.
        res = None
    if res is None:
        return 0.0, 0.0, dtype, "none"
    flops, nbytes, model = res
    if not (math.isfinite(flops) and math.isfinite(nbytes)) or flops < 0 or nbytes < 0:
        return 0.0, 0.0, dtype, "none"
    return float(flops), float(nbytes), dtype, model


# op_cost per signature, with the formula it was computed with: live capture models the same few hundred
# signatures every step (40 ms a step of the tiny transformer); a formula registered or replaced since makes
# the entry stale. Cleared when full, which bounds it to a few MB of signature text: a run whose shapes
# never repeat (a decode loop's growing KV cache) gains nothing from it anyway.
_COSTS: dict[tuple[Any, ...], tuple[Any, tuple[float, float, str, str]]] = {}
_MAX_COSTS = 1 << 14


def _signature_cost(name: str | None, dims: Any, types: Any, concrete: Any,
                    strides: Any = None) -> tuple[float, float, str, str]:
    key = (name, dims, types, concrete, strides)
    fn = formula_for(name)
    hit = _COSTS.get(key)
    if hit is not None and hit[0] is fn:
        return hit[1]
    cost = op_cost(name, dims, types, concrete, strides)
    if len(_COSTS) >= _MAX_COSTS:
        _COSTS.clear()
    _COSTS[key] = (fn, cost)
    return cost


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


def _codes(col: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, list[Any]]:
    """Dictionary codes (-1 = null, i = dictionary[i]) and the dictionary values of one column."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if pa.types.is_dictionary(arr.type):
        # Re-encode: chunks of a dictionary column may carry different dictionaries.
        arr = arr.cast(arr.type.value_type)
    enc = pc.dictionary_encode(arr)
    codes = pc.fill_null(enc.indices, -1).to_numpy(zero_copy_only=False).astype(np.int64)
    return codes, enc.dictionary.to_pylist()


@dataclass(frozen=True)
class CodedOpCosts:
    """:class:`OpCosts` with the dtype and model names as codes (what the stitch keeps per op)."""
    flops: np.ndarray
    bytes: np.ndarray
    dtype: Labels
    model: Labels

    def decoded(self) -> OpCosts:
        # Wide enough for any name of MODELS and CANONICAL_DTYPES (callers relabel rows in place), and for
        # whatever a registered formula returned: a name is never cut short.
        return OpCosts(self.flops, self.bytes, _text(self.dtype, 5), _text(self.model, 11))


def _text(labels: Labels, width: int) -> np.ndarray:
    return labels.decode().astype(f"<U{max(width, labels.names.dtype.itemsize // 4)}")


def model_ops(ops: pa.Table, moe: MoEConfig | None = None) -> OpCosts:
    """Costs of every op in an ops record table (records.OPS), one :func:`op_cost` call per signature.

    A signature is the distinct (name, input_dims, input_types[, concrete_inputs, input_strides]) combination;
    training and serving loops repeat the same shapes every step, so a 10^6-row table typically has
    a few thousand signatures. The columns are dictionary-encoded, combined into one integer key,
    grouped by hashing (``metrics.grouping``), and the per-signature answers are mapped back with a take. ``moe`` is the
    expert shape from the model's config (:func:`.moe.load_model_config`); without it MoE ops are unknown.
    """
    return coded_model_ops(ops, moe).decoded()


def coded_model_ops(ops: pa.Table, moe: MoEConfig | None = None) -> CodedOpCosts:
    """:func:`model_ops` with the per-op dtype and model names left as codes: as text they would cost 64
    bytes an op (some 170 MB and a third of the FLOP pass at 2.6M ops), to be encoded back right after."""
    n = ops.num_rows
    if n == 0:
        empty = np.empty(0, dtype=np.float64)
        none = Labels(codes=np.zeros(0, np.int32), names=np.zeros(0, "<U1"))
        return CodedOpCosts(empty, empty.copy(), none, none)
    # concrete_inputs joins the signature only when the table has it
    cols = [c for c in SIGNATURE_COLUMNS if c in ops.column_names]
    encoded = [_codes(ops.column(c)) for c in cols]
    inverse, first = group_rows([codes for codes, _ in encoded])
    m = len(first)
    flops_u = np.empty(m, dtype=np.float64)
    bytes_u = np.empty(m, dtype=np.float64)
    dtype_u: list[str] = []
    model_u: list[str] = []
    for j, row in enumerate(first):
        args = {c: values[codes[row]] if codes[row] >= 0 else None for c, (codes, values) in zip(cols, encoded)}
        f, b, dt, mo = _signature_cost(args.get("name"), args.get("input_dims"), args.get("input_types"),
                                       args.get("concrete_inputs"), args.get("input_strides"))
        flops_u[j] = f
        bytes_u[j] = b
        dtype_u.append(dt)
        model_u.append(mo)
    flops, nbytes = flops_u[inverse], bytes_u[inverse]
    dtype, model = LabelColumn(dtype_u, inverse), LabelColumn(model_u, inverse)
    # Ops whose cost depends on their neighbours (a conv's consumer, a vLLM step's batch) or on the
    # model config the user gave (MoE experts' size).
    apply_context(ops, flops, nbytes, model, moe, dict(zip(cols, encoded)))
    _unknown_where_raised(ops, flops, nbytes, model)
    return CodedOpCosts(flops, nbytes, dtype.labels(), model.labels())


def _unknown_where_raised(ops: pa.Table, flops: np.ndarray, nbytes: np.ndarray, model: LabelColumn) -> None:
    """An op that an exception cut off (records.OPS ``raised``) did not do the work its signature models:
    non-reentrant checkpoint's early stop raises inside the recompute's last aten::addmm before its GEMM runs,
    and crediting its 537 MFLOPs in 0.1 ms counted work that never happened and raised the CPU's peak 60x.
    How much of it ran is not recorded (none, there; some of a composite op that failed half-way), so its
    FLOPs and bytes are unknown (model "none"), not 0; its interval stays busy time."""
    if "raised" not in ops.column_names:
        return
    raised = ops.column("raised").fill_null(False).to_numpy(zero_copy_only=False)
    if raised.any():
        flops[raised] = 0.0
        nbytes[raised] = 0.0
        model.codes[raised] = model.code_of("none")
