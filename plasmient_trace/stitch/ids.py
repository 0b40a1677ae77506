"""Deterministic trace and span ids (DESIGN.md, join 5).

trace_id = first 16 bytes of sha256("plasmient/v1/{job_id}/{step}"): every process of a job computes the
same id for the same step with no coordination. Fleet, node, rank and step span ids are sha256-derived
the same way from their path. Spans below the step (modules, ops, kernels: up to 10^6 a trace) get
splitmix64(step_span_id XOR key) where the key packs the record's kind and row index: a vectorised,
well-mixed hash, so re-ingesting the same input yields the same ids.
"""

from __future__ import annotations

import hashlib

import numpy as np

_PREFIX = "plasmient/v1"
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)

# Kinds of record below the step, packed into the top bits of the per-span key.
KIND_MODULE = 1
KIND_MODULE_BACKWARD = 2
KIND_OP = 3
KIND_KERNEL = 4


def trace_id(job_id: str, step: int) -> bytes:
    return hashlib.sha256(f"{_PREFIX}/{job_id}/{step}".encode()).digest()[:16]


def _span_id_from_path(path: str) -> int:
    value = int.from_bytes(hashlib.sha256(path.encode()).digest()[:8], "big")
    return value or 1


def fleet_span_id(job_id: str, step: int) -> int:
    return _span_id_from_path(f"{_PREFIX}/{job_id}/{step}/fleet")


def node_span_id(job_id: str, step: int, node: str) -> int:
    return _span_id_from_path(f"{_PREFIX}/{job_id}/{step}/node/{node}")


def rank_span_id(job_id: str, step: int, rank: int) -> int:
    return _span_id_from_path(f"{_PREFIX}/{job_id}/{step}/rank/{rank}")


def step_span_id(job_id: str, step: int, rank: int) -> int:
    return _span_id_from_path(f"{_PREFIX}/{job_id}/{step}/rank/{rank}/step")


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser, elementwise on uint64 (wrapping arithmetic is intended)."""
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def child_span_ids(step_span_ids: np.ndarray, kind: int, rows: np.ndarray) -> np.ndarray:
    """Span ids for records of one kind below their steps; never 0."""
    key = (np.uint64(kind) << np.uint64(56)) | (rows.astype(np.uint64) & np.uint64((1 << 56) - 1))
    ids = splitmix64(step_span_ids.astype(np.uint64) ^ key)
    return np.where(ids == 0, np.uint64(1), ids)
