"""Which op's FLOPs count when modelled ops nest: the "same class of work" rule.

A profiler records aten::linear around aten::addmm and aten::layer_norm around
aten::native_layer_norm; both carry the same work. The outer op *yields* to a modelled op below
it of the same class, so nothing is counted twice. GEMM, convolution and attention form one class
(scaled_dot_product_attention over bmm); an op over a different class keeps its FLOPs (addmm over
the copy_ of its bias).
"""

from __future__ import annotations

import numpy as np

from .kernel_roles import ROLE_ARITHMETIC, ROLE_MOVES, ROLE_OTHER
from .labels import Labels, as_labels

__all__ = ["GEMM_LIKE", "ARITHMETIC_MODELS", "flop_owners", "split_op_work", "yields_flops"]

GEMM_LIKE = ("gemm", "conv", "attention")
# Ops whose FLOPs are a matmul's or a convolution's: their FLOPs go to the kernels that multiply (split_op_work).
ARITHMETIC_MODELS = ("gemm", "conv")


def _yields_to(op_parent: np.ndarray, cls: np.ndarray, k: int, below: np.ndarray) -> np.ndarray:
    """Per op: does an op marked in ``below`` of the same class sit anywhere under it?"""
    if k <= 64:
        return _yields_to_bits(op_parent, cls, below)
    return _yields_to_pairs(op_parent, cls, k, below)


def _yields_to_bits(op_parent: np.ndarray, cls: np.ndarray, below: np.ndarray) -> np.ndarray:
    """``_yields_to`` with each op's classes below it as the bits of one integer (at most 64 classes). The
    marked ops' class bits climb one level per round; an ancestor passes on only the bits new to it, and
    takes part once per round however many children reached it, so a round costs its frontier, not n."""
    n = len(op_parent)
    have = np.zeros(n, np.uint64)
    slot = np.zeros(n, np.int64)  # scratch: which entry of a round wrote a node last
    node = op_parent[below]
    bits = np.left_shift(np.uint64(1), np.asarray(cls, np.int64)[below].astype(np.uint64))
    for _ in range(256):
        keep = node >= 0
        node, bits = node[keep], bits[keep]
        if not len(node):
            break
        before = have[node]
        np.bitwise_or.at(have, node, bits)
        new = have[node] & ~before  # the same for every entry of a node: all its children's new bits
        fresh = new != 0
        node, new = node[fresh], new[fresh]
        # one entry per distinct node climbs: the last writer of each node's slot
        idx = np.arange(len(node))
        slot[node] = idx
        first = slot[node] == idx
        node, bits = op_parent[node[first]], new[first]
    return ((have >> np.asarray(cls, np.int64).astype(np.uint64)) & np.uint64(1)).astype(bool)


def _yields_to_pairs(op_parent: np.ndarray, cls: np.ndarray, k: int, below: np.ndarray) -> np.ndarray:
    """``_yields_to`` for any number of classes: one numpy step per tree level, the (ancestor, class)
    pairs of a level deduplicated before climbing."""
    n = len(op_parent)
    yields = np.zeros(n, bool)
    seen = np.zeros(n * k, bool)
    node, c = op_parent[below], cls[below]
    for _ in range(256):
        keep = node >= 0
        key = np.unique(node[keep] * k + c[keep], sorted=False)  # a set: order is irrelevant, hashing beats sorting
        key = key[~seen[key]]
        if not len(key):
            break
        seen[key] = True
        node, c = key // k, key % k
        yields[node[cls[node] == c]] = True
        node = op_parent[node]
    return yields


def yields_flops(op_parent: np.ndarray, op_model: np.ndarray | Labels, op_flops: np.ndarray) -> np.ndarray:
    """Per op: is its work already modelled by an op below it of the same class?

    ``op_parent``: index of each op's parent op (-1 at a root); ``op_model``/``op_flops`` as
    :func:`model_ops` returns them. An op with FLOPs yields only to a same-class descendant that has
    FLOPs itself: aten::mul(param, scalar_tensor) launches an aten::to/copy_ (elementwise, 0 FLOPs)
    for its scalar operand, and yielding to that copy would drop the multiply (AdamW's weight
    decay). An op without FLOPs yields to any modelled same-class descendant, which keeps its bytes
    from being counted beside theirs.
    """
    n = len(op_parent)
    if n == 0:
        return np.zeros(0, bool)
    parent = np.asarray(op_parent, np.int64)
    model = as_labels(op_model)
    flops = np.asarray(op_flops, np.float64)
    # classify the few distinct model names, then look every op up among them by its code
    names = model.names
    name_class = np.unique(np.where(np.isin(names, GEMM_LIKE), "gemm-like", names), return_inverse=True)[1].reshape(-1)
    classes = np.unique(name_class)
    cls = name_class[model.codes]
    modelled = ~model.equals("none")
    to_any = _yields_to(parent, cls, len(classes), modelled)
    to_working = _yields_to(parent, cls, len(classes), modelled & (flops > 0))
    yields = np.where(flops > 0, to_working, to_any)
    # A shape-only op (model "view") that materialises a copy below it (reshape -> clone -> copy_) yields to
    # that work whatever its class: its own known zero must not stand for the copy.
    view = model.equals("view")
    if view.any():
        yields |= view & _yields_to(parent, np.zeros(n, np.int64), 1, modelled & ~view)
    return yields


def flop_owners(launching_op: np.ndarray, op_parent: np.ndarray, op_model: np.ndarray | Labels,
                yields: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per kernel: (owner, counted). The owner is the innermost modelled op on the launching op's ancestor
    chain (-1 none); its work is counted on this kernel unless the owner yields to a same-class op below it
    (``yields`` as :func:`yields_flops` gives it). The stitcher and the CUDA-graph pairing both use this."""
    owner = np.asarray(launching_op, np.int64).copy()
    if len(op_parent) == 0:
        return np.full(len(owner), -1, np.int64), np.zeros(len(owner), bool)
    modelled = ~as_labels(op_model).equals("none")
    for _ in range(256):
        climb = (owner >= 0) & ~modelled[np.maximum(owner, 0)]
        if not climb.any():
            break
        owner[climb] = op_parent[owner[climb]]
    return owner, (owner >= 0) & ~yields[np.maximum(owner, 0)]


def split_op_work(owner: np.ndarray, owned: np.ndarray, duration_ns: np.ndarray, role: np.ndarray,
                  op_model: np.ndarray | Labels, n_op: int) -> tuple[np.ndarray, np.ndarray]:
    """Per kernel, the fraction of its owner op's FLOPs and bytes it carries, and whether it is a helper the
    op's work passed by: (share, passed).

    ``owner``/``owned`` as :func:`flop_owners` gives them (``owned``: the kernel carries its owner's work);
    ``role`` per kernel as :func:`~.kernel_roles.kernel_roles` gives it. ``share`` sums to 1 over an op's owned
    kernels, so an op's and a step's totals are the op model's whatever the split.

    A matmul's or convolution's work (``ARITHMETIC_MODELS``) goes to the kernels of the op's highest role, by
    duration among them: to its GEMM/convolution kernels where one is recognised, else to the kernels not
    recognised as data movement, else (only helpers) to all of them. Bytes go with the FLOPs: the op's
    modelled bytes (each input read once, the output written once) are what its GEMM reads and writes, so
    the GEMM kernel's arithmetic intensity is the op's. A transpose, fill or cast beside it (``passed``)
    carries 0 FLOPs and none of those bytes: what it moves is traffic the op's model leaves out, unknown
    here (its bound is memory by nature, as a copy's). Any other op's work is split by duration over all
    its kernels.
    """
    dur = np.maximum(duration_ns, 0).astype(np.float64) + 1.0
    share = np.zeros(len(owner))
    passed = np.zeros(len(owner), bool)
    if not owned.any():
        return share, passed
    o = owner[owned]
    d = dur[owned]
    # per op, the highest role among its owned kernels; only kernels of that role take a matmul's work
    r = np.asarray(role, np.int64)[owned]
    best = np.full(n_op, ROLE_MOVES, np.int64)
    for level in (ROLE_OTHER, ROLE_ARITHMETIC):  # ascending: a higher role present overrides
        best[np.bincount(o[r == level], minlength=n_op) > 0] = level
    arithmetic_op = as_labels(op_model).isin(ARITHMETIC_MODELS) if n_op else np.zeros(0, bool)
    takes = ~arithmetic_op[o] | (r == best[o])
    w = np.where(takes, d, 0.0)
    share[owned] = w / np.bincount(o, weights=w, minlength=n_op)[o]
    passed[owned] = ~takes
    return share, passed
