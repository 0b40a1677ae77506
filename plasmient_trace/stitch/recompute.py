"""Activation-checkpointing recompute: forward work the backward pass runs again.

With ``torch.utils.checkpoint`` the backward pass re-runs a module's forward to rebuild the activations it
did not keep. Those ops are forward ops (conv2d, linear, batch_norm, ...) recorded *inside* an autograd
backward node, and because grad mode is on while they run, autograd numbers them: an op that carries a
sequence number, is not itself a backward node, and sits under a backward node is a recompute root.
Everything under a root is recompute too. Ordinary backward ops run with grad mode off and carry no
sequence number, so they are never mistaken for recompute. A backward run with ``create_graph=True`` (a gradient
penalty, a Hessian-vector product) numbers its ops too; where modules are recorded, a recompute root must lie in a
module call made during the backward or in a backward node that made one (the recompute re-runs the checkpointed
function: its modules, and its functional ops beside them), which those ops never do.

Recomputed FLOPs are hardware work, not model work: they count in ``plasmient.hfu`` and not in
``plasmient.mfu`` (PaLM's MFU/HFU). Module events recorded during the recompute become
``<module> [recompute]`` spans under the backward op that triggered them, and the recomputed ops move under
them, so the recompute reads as part of the backward of the module that owns it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow.compute as pc

from ..records import RecordSet
from .joins import JoinedRank
from .nesting import any_ancestor, innermost_enclosing_points

_BACKWARD_SCOPE = "autograd::engine::evaluate_function"


def _col(table, name: str, fill: int) -> np.ndarray:
    return table.column(name).fill_null(fill).to_numpy().astype(np.int64)


@dataclass
class Recompute:
    ops: np.ndarray            # bool per op: recomputed forward work
    modules: np.ndarray        # bool per module row: recorded during a recompute
    module_parent_op: np.ndarray  # per module row: op to hang a top recompute module under (-1 none)
    op_module: np.ndarray      # per op: recompute module to hang a recompute root under (-1 none)


def find_recompute(rs: RecordSet, j: JoinedRank) -> Recompute:
    n_op, n_mod_all = len(j.op_parent), len(j.module_parent)
    none = Recompute(np.zeros(n_op, bool), np.zeros(n_mod_all, bool), np.full(n_mod_all, -1, np.int64),
                     np.full(n_op, -1, np.int64))
    if n_op == 0:
        return none
    ops = rs.ops
    seq = _col(ops, "sequence_number", -1)
    fwd_tid = _col(ops, "fwd_thread_id", 0)
    is_node = (fwd_tid > 0) | pc.starts_with(ops.column("name"), _BACKWARD_SCOPE).fill_null(False).to_numpy(zero_copy_only=False)
    in_backward = any_ancestor(j.op_parent, is_node)
    numbered = in_backward & (seq >= 0) & ~is_node
    if not numbered.any():
        return none
    root = numbered & ~any_ancestor(j.op_parent, numbered)  # the outermost numbered op: conv2d, not the convolution in it

    def recomputed(roots: np.ndarray) -> np.ndarray:
        return (roots | any_ancestor(j.op_parent, roots)) & ~is_node

    # modules recorded while a backward op ran: innermost op on the same thread around their start
    n_mod = rs.modules.num_rows
    if n_mod == 0:
        return Recompute(recomputed(root), none.modules, none.module_parent_op, none.op_module)
    o_thread = _col(ops, "pid", 0) * (1 << 32) + (_col(ops, "tid", 0) & 0xFFFFFFFF)
    m_thread = _col(rs.modules, "pid", 0) * (1 << 32) + (_col(rs.modules, "tid", 0) & 0xFFFFFFFF)
    m_start, m_end = _col(rs.modules, "start_ns", 0), _col(rs.modules, "end_ns", 0)
    around = innermost_enclosing_points(o_thread, _col(ops, "start_ns", 0), _col(ops, "end_ns", 0), m_thread, m_start)
    backward_op = (around >= 0) & (is_node[np.maximum(around, 0)] | in_backward[np.maximum(around, 0)])
    modules = np.zeros(n_mod_all, bool)
    modules[:n_mod] = backward_op
    parent_op = np.full(n_mod_all, -1, np.int64)
    parent_op[:n_mod] = np.where(backward_op, around, -1)
    # recompute roots go under the innermost recompute module around them
    rc_mods = np.nonzero(backward_op)[0]
    roots = np.nonzero(root)[0]
    op_module = np.full(n_op, -1, np.int64)
    if len(rc_mods) and len(roots):
        inner = innermost_enclosing_points(m_thread[rc_mods], m_start[rc_mods], m_end[rc_mods], o_thread[roots],
                                           _col(ops, "start_ns", 0)[roots])
        op_module[roots] = np.where(inner >= 0, rc_mods[np.maximum(inner, 0)], -1)
    # Where modules are recorded, a recompute re-runs a module's forward: a backward node that called no module
    # ran a backward that builds a graph of its own (create_graph=True: a gradient penalty, a Hessian-vector
    # product), whose ops autograd numbers too. That is model work, not recompute. In a node that called one,
    # every numbered op is the recompute (a checkpointed function's functional ops beside its modules).
    node_of = _nearest_marked(j.op_parent, is_node)
    recomputing = np.unique(node_of[np.maximum(around[rc_mods], 0)]) if len(rc_mods) else np.zeros(0, np.int64)
    root &= (op_module >= 0) | np.isin(node_of, recomputing[recomputing >= 0])
    return Recompute(recomputed(root), modules, parent_op, op_module)


def _nearest_marked(parent: np.ndarray, mark: np.ndarray) -> np.ndarray:
    """Per row, the nearest row at or above it (itself, its parent, ...) that ``mark`` holds; -1 where none."""
    out = np.where(mark, np.arange(len(parent)), -1)
    todo = np.nonzero(~mark & (parent >= 0))[0]
    cur = parent[todo]
    while len(todo):
        hit = mark[cur]
        out[todo[hit]] = cur[hit]
        keep = ~hit & (parent[cur] >= 0)
        todo, cur = todo[keep], parent[cur[keep]]
    return out
