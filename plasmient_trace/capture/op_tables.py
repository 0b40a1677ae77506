"""Recorded ops and module calls -> the ``ops`` and ``modules`` record tables, on the worker thread.

The training thread only appends tuples (:mod:`.torch_hooks`); naming the ops, spelling their argument
shapes and dtypes as Kineto does (the FLOP models read that spelling) and moving timestamps onto the Unix
epoch happen here, off the training thread, once per batch.
"""

from __future__ import annotations

from time import perf_counter_ns
from typing import Any

import orjson
import pyarrow as pa
import torch

from ..records import table_from_columns

# Kineto's spelling of dtypes, which the FLOP model (metrics.flops) reads.
_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half",
    torch.bfloat16: "c10::BFloat16", torch.int64: "long int", torch.int32: "int", torch.int16: "short int",
    torch.int8: "signed char", torch.uint8: "unsigned char", torch.bool: "bool",
    torch.complex64: "c10::complex<float>", torch.complex128: "c10::complex<double>",
    torch.complex32: "c10::complex<c10::Half>",
}
for _name, _spelling in (("float8_e4m3fn", "c10::Float8_e4m3fn"), ("float8_e5m2", "c10::Float8_e5m2"),
                         ("float8_e4m3fnuz", "c10::Float8_e4m3fnuz"), ("float8_e5m2fnuz", "c10::Float8_e5m2fnuz")):
    if hasattr(torch, _name):
        _DTYPE_NAMES[getattr(torch, _name)] = _spelling

TENSOR_LIST = "TensorList"


_NAME_CACHE: dict[Any, str] = {}
_SIGNATURE_CACHE: dict[tuple, tuple[str, str, str]] = {}
_SIGNATURE_CACHE_MAX = 100_000


def op_name(func: Any) -> str:
    name = _NAME_CACHE.get(func)
    if name is None:
        try:
            name = func._schema.name  # 'aten::mm' (the overload name stays out, as in Kineto)
        except AttributeError:
            name = str(func)
        _NAME_CACHE[func] = name
    return name


def _arg_columns(meta: list[Any]) -> tuple[list[Any], list[str], list[str]]:
    dims: list[Any] = []
    types: list[str] = []
    concrete: list[str] = []
    for a in meta:
        if type(a) is tuple and len(a) == 2 and isinstance(a[1], torch.dtype):
            dims.append(list(a[0]))
            types.append(_DTYPE_NAMES.get(a[1], str(a[1]).replace("torch.", "")))
            concrete.append("")
        elif type(a) is tuple and len(a) == 2 and a[0] == TENSOR_LIST:
            dims.append([list(s) for s in a[1]])
            types.append(TENSOR_LIST)
            concrete.append("")
        elif a is None:
            dims.append([])
            types.append("")
            concrete.append("")
        elif isinstance(a, (bool, int, float)):
            dims.append([])
            types.append("Scalar")
            concrete.append(str(a))
        elif isinstance(a, tuple):
            dims.append([])
            types.append("ScalarList")
            concrete.append("[" + ", ".join(str(x) for x in a) + "]")
        else:
            dims.append([])
            types.append("String")
            concrete.append(str(a))
    return dims, types, concrete


def ops_table(ops: list[tuple], pid: int, epoch_offset_ns: int, with_external_id: bool = True) -> pa.Table:
    """OpRecorder tuples -> the ``ops`` record table (one Python pass per op; ops are per full-depth
    step only, a few thousand at most, so this stays off the per-kernel hot path)."""
    n = len(ops)
    if n == 0:
        return table_from_columns("ops", {})
    names, start, end, tid, seq, fwd, ext, dims, types, conc = [], [], [], [], [], [], [], [], [], []
    for func, t0, t1, thread, s, backward, eid, meta in ops:
        names.append(op_name(func))
        start.append(t0 + epoch_offset_ns)
        end.append(t1 + epoch_offset_ns)
        tid.append(thread)
        seq.append(s if s >= 0 else None)
        # fwd_thread_id > 0 marks a backward op for the stitcher (Kineto's convention).
        fwd.append(1 if backward else 0)
        ext.append(eid)
        # A training loop repeats the same op signatures every step: encode each once.
        try:
            key = (func, tuple(meta))
            enc = _SIGNATURE_CACHE.get(key)
        except TypeError:  # an unhashable argument
            key, enc = None, None
        if enc is None:
            d, t, c = _arg_columns(meta)
            enc = (orjson.dumps(d).decode(), orjson.dumps(t).decode(), orjson.dumps(c).decode())
            if key is not None and len(_SIGNATURE_CACHE) < _SIGNATURE_CACHE_MAX:
                _SIGNATURE_CACHE[key] = enc
        dims.append(enc[0])
        types.append(enc[1])
        conc.append(enc[2])
    cols: dict[str, Any] = {
        "pid": [pid] * n, "tid": tid, "start_ns": start, "end_ns": end, "name": names,
        "category": ["cpu_op"] * n, "sequence_number": seq, "fwd_thread_id": fwd,
        "input_dims": dims, "input_types": types, "concrete_inputs": conc,
    }
    if with_external_id:
        cols["external_id"] = ext
    return table_from_columns("ops", cols)


def epoch_offset_ns() -> int:
    """perf_counter_ns + offset = Unix epoch ns (perf_counter is monotonic, so spans never run backwards)."""
    import time

    a = time.time_ns()
    b = perf_counter_ns()
    c = time.time_ns()
    return (a + c) // 2 - b

