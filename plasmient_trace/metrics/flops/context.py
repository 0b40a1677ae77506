"""Costs that one op's own arguments cannot give, read off neighbouring records of the same table:

* a forward convolution whose stride was not recorded (old Kineto without ``Concrete Inputs``)
  takes its output size from the op that consumes its output next on the same thread (batch_norm,
  relu, add: the first later op whose first tensor is shaped ``[N, C_out, *spatial]``), when that
  size is consistent with the conv's input and kernel; otherwise it stays unknown;
* vLLM's paged attention takes the batch's sequence statistics from the engine-step annotation
  that encloses it (see :mod:`.vendor`);
* MoE expert GEMMs take the experts' size from the model config the user gave (see :mod:`.moe`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from .conv import conv_forward_names, conv_forward_with_output
from .core import OpArgs
from .moe import MOE_OPS, MoEConfig, moe_forward_cost
from .vendor import VLLM_ATTENTION_OPS, vllm_attention_cost, vllm_batch_stats

# How far past a conv to look for its consumer: the consumer follows directly in eager code, after
# at most the bookkeeping ops of the conv's own wrappers (resize_, empty, a scalar add).
_LOOKAHEAD = 32


def _loads(v: Any) -> Any:
    try:
        return orjson.loads(v) if isinstance(v, (str, bytes)) else v
    except orjson.JSONDecodeError:
        return None


def _first_tensor_shape(dims: Any, types: Any) -> list[int] | None:
    if not isinstance(dims, list) or not isinstance(types, list):
        return None
    for d, t in zip(dims, types):
        if isinstance(d, list) and d and all(isinstance(x, int) for x in d) and OpArgs([d], [t], None).is_tensor(0):
            return d
    return None


def _plausible_output(sp_in: list[int], kernel: list[int], sp_out: list[int]) -> bool:
    # Some stride >= 1 with padding <= kernel - 1 can produce each output size: 1 <= out <= in + k - 1.
    return bool(sp_out) and all(1 <= o <= i + k - 1 for i, k, o in zip(sp_in, kernel, sp_out))


class _Rows:
    """Row access to the few ops the passes look at: each column is dictionary-encoded once, and a
    distinct value is parsed once however many ops share it (a replicated or long trace repeats its
    signatures), so the passes cost a few dict lookups per op, not a JSON parse."""

    def __init__(self, ops: pa.Table):
        self._codes: dict[str, np.ndarray] = {}
        self._values: dict[str, list[Any]] = {}
        self._parsed: dict[str, dict[int, Any]] = {}
        for c in ("name", "input_dims", "input_types", "concrete_inputs"):
            if c in ops.column_names:
                enc = pc.dictionary_encode(ops.column(c).combine_chunks())
                self._codes[c] = enc.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
                self._values[c] = enc.dictionary.to_pylist()
                self._parsed[c] = {}

    def code(self, column: str, r: int) -> int:
        codes = self._codes.get(column)
        return -1 if codes is None else int(codes[r])

    def get(self, column: str, r: int) -> Any:
        """A JSON column's parsed value at row r."""
        k = self.code(column, r)
        if k < 0:
            return None
        cache = self._parsed[column]
        if k not in cache:
            cache[k] = _loads(self._values[column][k])
        return cache[k]

    def name(self, r: int) -> str:
        return str(self._values["name"][self._codes["name"][r]])

    def args(self, r: int) -> OpArgs | None:
        d, t = self.get("input_dims", r), self.get("input_types", r)
        return OpArgs(d, t, self.get("concrete_inputs", r)) if isinstance(d, list) and isinstance(t, list) else None

    def signature(self, r: int) -> tuple[int, ...]:
        return tuple(self.code(c, r) for c in ("name", "input_dims", "input_types", "concrete_inputs"))


def apply_context(ops: pa.Table, flops: np.ndarray, nbytes: np.ndarray, model: np.ndarray,
                  moe: MoEConfig | None = None) -> None:
    """Fill, in place, the costs of ops that need their neighbours or the model config (see the module
    docstring)."""
    if not ops.num_rows:
        return
    names = ops.column("name")
    conv = (model == "none") & pc.is_in(names, value_set=pa.array(conv_forward_names())).to_numpy(zero_copy_only=False)
    attn = pc.is_in(names, value_set=pa.array(VLLM_ATTENTION_OPS)).to_numpy(zero_copy_only=False)
    experts = np.zeros(ops.num_rows, bool)
    if moe is not None:
        experts = (model == "none") & pc.is_in(names, value_set=pa.array(MOE_OPS)).to_numpy(zero_copy_only=False)
    if not conv.any() and not attn.any() and not experts.any():
        return
    rows = _Rows(ops)
    if experts.any():
        decided: dict[tuple[int, ...], Any] = {}
        for r in np.nonzero(experts)[0].tolist():
            key = rows.signature(r)
            if key not in decided:
                a = rows.args(r)
                decided[key] = moe_forward_cost(a, moe) if a is not None else None
            if decided[key] is not None:
                flops[r], nbytes[r], model[r] = decided[key]
    start = ops.column("start_ns").to_numpy()
    end = ops.column("end_ns").to_numpy()
    if conv.any():
        thread = (ops.column("pid").to_numpy().astype(np.int64) * (1 << 32)
                  + (ops.column("tid").to_numpy().astype(np.int64) & 0xFFFFFFFF))
        _conv_from_consumer(np.nonzero(conv)[0], rows, start, end, thread, flops, nbytes, model)
    if attn.any():
        _vllm_attention(np.nonzero(attn & (model == "none"))[0], ops, rows, start, end, flops, nbytes, model)


def _conv_from_consumer(cands: np.ndarray, rows: _Rows, start: np.ndarray, end: np.ndarray, thread: np.ndarray,
                        flops: np.ndarray, nbytes: np.ndarray, model: np.ndarray) -> None:
    order = np.lexsort((start, thread))
    pos = np.empty(len(order), np.int64)
    pos[order] = np.arange(len(order))
    parsed: dict[tuple[int, int], list[int] | None] = {}
    decided: dict[tuple[int, ...], Any] = {}

    def shape_of(r: int) -> list[int] | None:
        key = (rows.code("input_dims", r), rows.code("input_types", r))
        if key not in parsed:
            parsed[key] = _first_tensor_shape(rows.get("input_dims", r), rows.get("input_types", r))
        return parsed[key]

    for r in cands.tolist():
        a = rows.args(r)
        X, W = (a.shape(0), a.shape(1)) if a is not None else (None, None)
        if X is None or W is None or len(X) != len(W) or len(W) < 3:
            continue
        nsp = len(W) - 2
        for q in order[pos[r] + 1: pos[r] + 1 + _LOOKAHEAD].tolist():
            if thread[q] != thread[r]:
                break
            if start[q] < end[r]:
                continue  # the conv's own children
            S = shape_of(q)
            if S is None or len(S) != nsp + 2 or S[0] != X[0] or S[1] != W[0]:
                continue
            if _plausible_output(X[2:], W[2:], S[2:]):
                key = rows.signature(r) + tuple(S)
                if key not in decided:
                    decided[key] = conv_forward_with_output(rows.name(r), a, S[2:])
                res = decided[key]
                if res is not None:
                    flops[r], nbytes[r], model[r] = res
            break  # the first op reading a [N, C_out, ...] tensor decides; no further guessing


def _vllm_attention(cands: np.ndarray, ops: pa.Table, rows: _Rows, start: np.ndarray, end: np.ndarray,
                    flops: np.ndarray, nbytes: np.ndarray, model: np.ndarray) -> None:
    steps = step_annotations(ops)
    if not steps:
        return
    s_rows = np.array([i for i, _ in steps])
    s_start, s_end = start[s_rows], end[s_rows]
    for r in cands.tolist():
        inside = np.nonzero((s_start <= start[r]) & (start[r] < s_end))[0]
        if len(inside) != 1:
            continue  # no step, or overlapping steps: which batch it ran in is not known
        a = rows.args(r)
        res = vllm_attention_cost(a, steps[int(inside[0])][1]) if a is not None else None
        if res is not None:
            flops[r], nbytes[r], model[r] = res


def step_annotations(ops: pa.Table) -> list[tuple[int, dict[str, int]]]:
    """(row, sequence statistics) of every vLLM engine-step annotation in an ops table."""
    ann = np.nonzero(ops.column("category").to_numpy(zero_copy_only=False) == "user_annotation")[0]
    names = ops.column("name")
    return [(int(i), s) for i in ann.tolist() if (s := vllm_batch_stats(names[int(i)].as_py()))]
