"""Costs that one op's own arguments cannot give, read off neighbouring records of the same table:

* a forward convolution whose stride was not recorded (old Kineto without ``Concrete Inputs``)
  takes its output size from the op that consumes its output next on the same thread (batch_norm,
  relu, add: the first later op whose first tensor is shaped ``[N, C_out, *spatial]``), when that
  size is consistent with the conv's input and kernel; otherwise it stays unknown;
* a legacy conv gradient op (``cudnn_convolution_backward_input`` / ``_weight``, torch < 1.11) takes its
  sizes from the backward op it runs under, the nearest earlier op on its thread that encloses it: its
  own arguments name the sizes it needs without their values. Left to the parent, the two gradients'
  FLOPs were split by kernel time, which gave both the same MFU whatever each achieved;
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

from ..grouping import group_rows
from .conv import CONV_GRADIENT_PARENTS, conv_forward_names, conv_forward_with_output, conv_gradient_cost
from .core import FlopResult, OpArgs
from .labels import LabelColumn
from .moe import MOE_OPS, MoEConfig, moe_forward_cost
from .vendor import VLLM_ATTENTION_OPS, vllm_attention_cost, vllm_batch_stats

# The columns that make two ops the same call, in order (model_ops groups by them too).
SIGNATURE_COLUMNS = ("name", "input_dims", "input_types", "concrete_inputs", "input_strides")
# How far past a conv to look for its consumer: the consumer follows directly in eager code, after
# at most the bookkeeping ops of the conv's own wrappers (resize_, empty, a scalar add).
_LOOKAHEAD = 32
_CONV_GRADIENTS = pa.array(list(CONV_GRADIENT_PARENTS), pa.string())


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

    def __init__(self, ops: pa.Table, encoded: dict[str, tuple[np.ndarray, list[Any]]] | None = None):
        """``encoded``: columns the caller already encoded, as (codes, -1 for null; dictionary values)."""
        self._codes: dict[str, np.ndarray] = {}
        self._values: dict[str, list[Any]] = {}
        self._parsed: dict[str, dict[int, Any]] = {}
        self._index: dict[str, dict[Any, int]] = {}
        for c in SIGNATURE_COLUMNS:
            if encoded is not None and c in encoded:
                self._codes[c], self._values[c] = encoded[c]
                self._parsed[c] = {}
            elif c in ops.column_names:
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

    def code_of(self, column: str, value: Any) -> int:
        """A value's dictionary code in a column (-2: absent, so it matches no row's code, nor a null's -1)."""
        index = self._index.get(column)
        if index is None:
            index = self._index[column] = {v: i for i, v in enumerate(self._values.get(column, []))}
        return index.get(value, -2)

    def name(self, r: int) -> str:
        return str(self._values["name"][self._codes["name"][r]])

    def args(self, r: int) -> OpArgs | None:
        d, t = self.get("input_dims", r), self.get("input_types", r)
        return (OpArgs(d, t, self.get("concrete_inputs", r), self.get("input_strides", r))
                if isinstance(d, list) and isinstance(t, list) else None)

    def signature(self, r: int) -> tuple[int, ...]:
        return tuple(self.code(c, r) for c in SIGNATURE_COLUMNS)

    def codes(self, column: str) -> np.ndarray:
        """Every row's dictionary code in a column (-1: null or no such column)."""
        codes = self._codes.get(column)
        return codes if codes is not None else np.full(len(next(iter(self._codes.values()))), -1, np.int64)

    def value(self, column: str, code: int) -> Any:
        """The parsed value of a JSON column's distinct entry."""
        cache = self._parsed[column]
        if code not in cache:
            cache[code] = _loads(self._values[column][code])
        return cache[code]

    def signatures(self, rows: np.ndarray) -> np.ndarray:
        """(len(rows), 4) codes of name, dims, types and concrete inputs: equal rows are the same call."""
        return np.stack([self.codes(c)[rows] for c in SIGNATURE_COLUMNS], axis=1)


def apply_context(ops: pa.Table, flops: np.ndarray, nbytes: np.ndarray, model: LabelColumn,
                  moe: MoEConfig | None = None, encoded: dict[str, tuple[np.ndarray, list[Any]]] | None = None) -> None:
    """Fill, in place, the costs of ops that need their neighbours or the model config (see the module
    docstring). ``encoded``: signature columns already dictionary-encoded (codes, -1 for null; values)."""
    if not ops.num_rows:
        return
    names = ops.column("name")
    unmodelled = model.equals("none")
    conv = unmodelled & pc.is_in(names, value_set=pa.array(conv_forward_names(), pa.string())).to_numpy(zero_copy_only=False)
    attn = pc.is_in(names, value_set=pa.array(VLLM_ATTENTION_OPS, pa.string())).to_numpy(zero_copy_only=False)
    grads = unmodelled & pc.is_in(names, value_set=_CONV_GRADIENTS).to_numpy(zero_copy_only=False)
    experts = np.zeros(ops.num_rows, bool)
    if moe is not None:
        experts = unmodelled & pc.is_in(names, value_set=pa.array(MOE_OPS, pa.string())).to_numpy(zero_copy_only=False)
    if not conv.any() and not attn.any() and not experts.any() and not grads.any():
        return
    rows = _Rows(ops, encoded)
    if experts.any():
        decided: dict[tuple[int, ...], Any] = {}
        for r in np.nonzero(experts)[0].tolist():
            key = rows.signature(r)
            if key not in decided:
                a = rows.args(r)
                decided[key] = moe_forward_cost(a, moe) if a is not None else None
            if decided[key] is not None:
                flops[r], nbytes[r], label = decided[key]
                model.codes[r] = model.code_of(label)
    start = ops.column("start_ns").to_numpy()
    end = ops.column("end_ns").to_numpy()
    thread = (ops.column("pid").to_numpy().astype(np.int64) * (1 << 32)
              + (ops.column("tid").to_numpy().astype(np.int64) & 0xFFFFFFFF))
    if conv.any():
        _conv_from_consumer(np.nonzero(conv)[0], rows, start, end, thread, flops, nbytes, model)
    if grads.any():
        _conv_gradients_from_parent(np.nonzero(grads)[0], rows, start, end, thread, flops, nbytes, model)
    if attn.any():
        _vllm_attention(np.nonzero(attn & model.equals("none"))[0], ops, rows, start, end, flops, nbytes, model)


def _conv_from_consumer(cands: np.ndarray, rows: _Rows, start: np.ndarray, end: np.ndarray, thread: np.ndarray,
                        flops: np.ndarray, nbytes: np.ndarray, model: LabelColumn) -> None:
    """Per conv, the first later op on its thread (its own children skipped) whose first tensor is shaped
    [N, C_out, *spatial] decides its output size, within _LOOKAHEAD ops. Shapes are parsed once per distinct
    (dims, types) value and the look-ahead runs as one numpy pass per offset over all convs, so a long or
    replicated trace costs a few passes, not a Python loop per conv and neighbour."""
    n = len(start)
    order = np.lexsort((start, thread))
    pos = np.empty(n, np.int64)
    pos[order] = np.arange(n)
    # every op's first tensor shape, parsed per distinct (input_dims, input_types); its (rank, dim 0, dim 1)
    # as one code per distinct triple, read per distinct pair (an (n, 3) copy per op cost more than the look-ahead)
    dims_code, types_code = rows.codes("input_dims"), rows.codes("input_types")
    pair_of, pair_first = group_rows([dims_code, types_code])
    shapes = [_first_tensor_shape(rows.value("input_dims", int(d)), rows.value("input_types", int(t)))
              if d >= 0 and t >= 0 else None for d, t in zip(dims_code[pair_first].tolist(), types_code[pair_first].tolist())]
    triple_code: dict[tuple[int, int, int], int] = {}
    pair_triple = np.array([triple_code.setdefault((len(x), x[0], x[1]), len(triple_code))
                            if x is not None and len(x) >= 2 else -1 for x in shapes], np.int64)
    # each conv's input X and weight W, per distinct signature
    sig_of, sig_first = group_rows(list(rows.signatures(cands).T))
    sig_args, sig_xw = [], []
    for r in cands[sig_first].tolist():
        a = rows.args(r)
        X, W = (a.shape(0), a.shape(1)) if a is not None else (None, None)
        ok = X is not None and W is not None and len(X) == len(W) and len(W) >= 3
        sig_args.append(a)
        sig_xw.append((X, W) if ok else None)
    usable = np.array([xw is not None for xw in sig_xw], bool)[sig_of]
    convs, sig_of = cands[usable], sig_of[usable]
    # the triple a conv's consumer shows, as the same codes (-2: one no op shows, so it matches none)
    want = np.array([triple_code.get((len(xw[1]), xw[0][0], xw[1][0]), -2) if xw is not None else -2 for xw in sig_xw],
                    np.int64)[sig_of]
    # look ahead: the first neighbour past the conv's own children whose first tensor's rank and first two
    # dims fit decides; a neighbour on another thread ends the search
    found = np.full(len(convs), -1, np.int64)
    open_ = np.ones(len(convs), bool)
    for k in range(1, _LOOKAHEAD + 1):
        at = pos[convs] + k
        live = open_ & (at < n)
        open_ &= live
        if not live.any():
            break
        q = order[np.minimum(at, n - 1)]
        same = thread[q] == thread[convs]
        open_ &= same
        candidate = open_ & (start[q] >= end[convs]) & (pair_triple[pair_of[q]] == want)
        found[candidate] = q[candidate]
        open_ &= ~candidate
    # one cost per distinct (conv signature, consumer shape), scattered onto every conv that has it
    hit = np.nonzero(found >= 0)[0]
    if not len(hit):
        return
    key_of, key_first = group_rows([sig_of[hit], pair_of[found[hit]]])
    costs = []
    for i in hit[key_first].tolist():
        g, S = int(sig_of[i]), shapes[int(pair_of[found[i]])]
        X, W = sig_xw[g]
        costs.append(conv_forward_with_output(rows.name(int(convs[i])), sig_args[g], S[2:])
                     if _plausible_output(X[2:], W[2:], S[2:]) else None)
    _scatter_costs(convs[hit], key_of, costs, flops, nbytes, model)


def _scatter_costs(ops: np.ndarray, key_of: np.ndarray, costs: list[FlopResult], flops: np.ndarray, nbytes: np.ndarray,
                   model: LabelColumn) -> None:
    """Each op of ``ops`` takes the cost of its key (``costs[key_of[i]]``), where that cost is known."""
    take = np.array([c is not None for c in costs], bool)[key_of]
    if not take.any():
        return
    r, k = ops[take], key_of[take]
    per_key = [c if c is not None else (0.0, 0.0, "") for c in costs]
    flops[r] = np.array([c[0] for c in per_key], np.float64)[k]
    nbytes[r] = np.array([c[1] for c in per_key], np.float64)[k]
    model.codes[r] = model.codes_of(c[2] for c in per_key)[k]


def _conv_gradients_from_parent(cands: np.ndarray, rows: _Rows, start: np.ndarray, end: np.ndarray,
                                thread: np.ndarray, flops: np.ndarray, nbytes: np.ndarray, model: LabelColumn) -> None:
    """Per legacy conv gradient op, its parent: the nearest earlier op on its thread, within _LOOKAHEAD ops,
    that encloses it and is the backward op it belongs to (conv.CONV_GRADIENT_PARENTS). Its cost comes from
    the parent's arguments, when the two agree on grad_output's shape; otherwise it stays unknown."""
    n = len(start)
    order = np.lexsort((-end, start, thread))  # an op before the ops it encloses, even when they start together
    pos = np.empty(n, np.int64)
    pos[order] = np.arange(n)
    name_code = rows.codes("name")
    # each candidate's parent name code, looked up once per distinct gradient op name
    _, first_of_name, own_of = np.unique(name_code[cands], return_index=True, return_inverse=True)
    want = np.array([rows.code_of("name", CONV_GRADIENT_PARENTS[rows.name(r)]) for r in cands[first_of_name].tolist()],
                    np.int64)[own_of.reshape(-1)]
    found = np.full(len(cands), -1, np.int64)
    open_ = np.ones(len(cands), bool)
    for k in range(1, _LOOKAHEAD + 1):
        at = pos[cands] - k
        open_ &= at >= 0
        if not open_.any():
            break
        q = order[np.maximum(at, 0)]
        open_ &= thread[q] == thread[cands]
        hit = open_ & (name_code[q] == want) & (start[q] <= start[cands]) & (end[q] >= end[cands])
        found[hit] = q[hit]
        open_ &= ~hit
    kids = np.nonzero(found >= 0)[0]
    if not len(kids):
        return
    # one cost per distinct (gradient op signature, parent signature)
    key_of, key_first = group_rows([*rows.signatures(cands[kids]).T, *rows.signatures(found[kids]).T])
    costs = []
    for i in kids[key_first].tolist():
        child, parent = rows.args(int(cands[i])), rows.args(int(found[i]))
        agree = child is not None and parent is not None and child.shape(1) is not None and child.shape(1) == parent.shape(1)
        costs.append(conv_gradient_cost(parent) if agree else None)
    _scatter_costs(cands[kids], key_of, costs, flops, nbytes, model)


def _vllm_attention(cands: np.ndarray, ops: pa.Table, rows: _Rows, start: np.ndarray, end: np.ndarray,
                    flops: np.ndarray, nbytes: np.ndarray, model: LabelColumn) -> None:
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
            flops[r], nbytes[r], label = res
            model.codes[r] = model.code_of(label)


def step_annotations(ops: pa.Table) -> list[tuple[int, dict[str, int]]]:
    """(row, sequence statistics) of every vLLM engine-step annotation in an ops table."""
    ann = np.nonzero(ops.column("category").to_numpy(zero_copy_only=False) == "user_annotation")[0]
    names = ops.column("name")
    return [(int(i), s) for i in ann.tolist() if (s := vllm_batch_stats(names[int(i)].as_py()))]
