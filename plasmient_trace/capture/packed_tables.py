"""Record tables from what the training thread packed: the native op observer's columns (with the signature
table that names them) and the module recorder's call tuples.

Torch-free on purpose: the live capture's batch process (``capture.batch_process``) builds the same tables
from what each batch brings, without importing torch. The dispatch hook's records, which hold torch objects,
are ``capture.op_tables``'.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from ..records import table_from_columns

# Ops that only make a new view or an uninitialised allocation: they launch no kernel on any device and
# cost no FLOPs, yet are about 40% of what RecordFunction sees in a training step (aten::t ->
# aten::transpose -> aten::as_strided under every aten::linear). Live capture leaves them out of its
# op spans (their time stays inside their parent op) unless autograd numbered them; anything they
# enclose that does work is kept.
SHAPE_ONLY_OPS = frozenset(f"aten::{n}" for n in (
    "as_strided", "view", "_unsafe_view", "_reshape_alias", "t", "transpose", "permute", "expand", "expand_as",
    "view_as", "unsqueeze", "squeeze", "select", "slice", "narrow", "unflatten", "alias", "detach", "lift_fresh",
    "resolve_conj", "resolve_neg", "empty", "empty_like", "empty_strided", "split", "chunk", "unbind",
)) | {"detach"}


# The packed columns of a native chunk (op_observer.cpp's take()) and their dtypes.
_NATIVE_COLUMNS = (("start_ns", np.int64), ("end_ns", np.int64), ("tid", np.int64), ("sequence_number", np.int64),
                   ("fwd_thread_id", np.int64), ("external_id", np.int64), ("signature", np.uint32),
                   ("scope", np.uint8), ("raised", np.uint8))


class SignatureTable:
    """The native observer's op signatures (name, JSON dims, types, concrete inputs) by number, and the
    ops table a step's packed chunks make with them. The live batch process keeps a replica, extended by
    what each batch brings (:meth:`since`), so it builds the same table without the observer."""

    def __init__(self, scope_user: int) -> None:
        self.scope_user = scope_user
        self.columns: list[pa.Array] = [pa.array([], pa.string()) for _ in range(4)]
        self.shape_only = np.zeros(0, bool)

    @property
    def size(self) -> int:
        return len(self.columns[0])

    def extend(self, columns: list[list[str]]) -> None:
        self.columns = [pa.concat_arrays([old, pa.array(col, pa.string())]) for old, col in zip(self.columns, columns)]
        self.shape_only = np.concatenate([self.shape_only, [n in SHAPE_ONLY_OPS for n in columns[0]]])

    def since(self, size: int) -> list[list[str]]:
        """The signatures numbered from ``size`` on, as :meth:`extend` takes them."""
        return [col.slice(size).to_pylist() for col in self.columns]

    def table(self, chunks: list[dict[str, bytes]], pid: int, epoch_offset_ns: int) -> pa.Table:
        chunks = [c for c in chunks if c and len(c["signature"])]
        if not chunks:
            return table_from_columns("ops", {})
        col = {name: np.concatenate([np.frombuffer(c[name], dtype) for c in chunks])
               for name, dtype in _NATIVE_COLUMNS}
        # one that made an autograd node stays: its sequence number maps the node's backward ops
        # to their forward module
        keep = ~self.shape_only[col["signature"]] | (col["sequence_number"] >= 0)
        col = {name: values[keep] for name, values in col.items()}
        names, dims, types, concrete = (s.take(pa.array(col["signature"])) for s in self.columns)
        seq = col["sequence_number"]
        return table_from_columns("ops", {
            "pid": pa.array(np.full(len(seq), pid, np.int64)), "tid": col["tid"],
            "start_ns": col["start_ns"] + epoch_offset_ns, "end_ns": col["end_ns"] + epoch_offset_ns,
            "name": names,
            "category": pa.array(np.where(col["scope"] == self.scope_user, "user_annotation", "cpu_op")),
            "sequence_number": pa.array(seq, mask=seq < 0), "fwd_thread_id": col["fwd_thread_id"],
            "input_dims": dims, "input_types": types, "concrete_inputs": concrete,
            "external_id": col["external_id"], "raised": col["raised"] != 0,
        })


def modules_table(records: list[tuple], pid: int, epoch_offset_ns: int) -> pa.Table:
    if not records:
        return table_from_columns("modules", {})
    tid, t0, t1, name = zip(*records)
    return table_from_columns("modules", {
        "pid": [pid] * len(records), "tid": list(tid),
        "start_ns": [t + epoch_offset_ns for t in t0], "end_ns": [t + epoch_offset_ns for t in t1],
        "name": list(name), "phase": ["forward"] * len(records),
    })
