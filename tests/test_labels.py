"""Per-op labels (dtype, FLOP model) as codes: every row decodes to the text it was encoded from, whatever
the text (ASCII of any width, non-ASCII, colliding hashes), checked against numpy's own string handling."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from plasmient_trace.metrics.flops import MODELS, labels
from plasmient_trace.metrics.flops.labels import Labels


def _check(values: np.ndarray) -> Labels:
    got = Labels.encode(values)
    assert got.codes.dtype == np.int32 and len(got) == len(values)
    assert np.array_equal(got.decode(), values)
    assert sorted(got.names.tolist()) == np.unique(values).tolist()  # each distinct text once
    assert got.to_arrow().to_pylist() == values.tolist()
    return got


@pytest.mark.parametrize("vocab", [list(MODELS), ["fp32", "bf16", "fp16", "other"], ["x" * 30 + c for c in "abc"] + ["", "y"],
                                   ["é", "naïve", "fp32"]])
def test_rows_decode_to_their_text(vocab: list[str]) -> None:
    rng = np.random.default_rng(7)
    _check(rng.choice(np.array(vocab), 50_000))


def test_hash_collisions_fall_back_to_exact_grouping(monkeypatch: pytest.MonkeyPatch) -> None:
    # With the mixing constant at 0 the hash ignores everything past the first 8 characters.
    monkeypatch.setattr(labels, "_MIX", np.int64(0))
    values = np.array(["elementwiseA", "elementwiseB", "elementwiseA", "elementwiseC"] * 1000)
    got = _check(values)
    assert len(got.names) == 3


def test_comparisons_slices_and_empty() -> None:
    values = np.array(["gemm", "none", "view", "none", "gemm"])
    got = Labels.encode(values)
    assert got.equals("none").tolist() == (values == "none").tolist()
    assert got.equals("conv").tolist() == [False] * 5  # a label no row has
    assert got.isin(["gemm", "view"]).tolist() == np.isin(values, ["gemm", "view"]).tolist()
    rows = np.array([4, 0, 2])
    assert got[rows].decode().tolist() == values[rows].tolist()
    empty = Labels.encode(np.array([], dtype=str))
    assert len(empty) == 0 and empty.decode().tolist() == [] and empty.to_arrow().equals(pa.array([], pa.string()))
    assert Labels.encode(["fp32", "bf16", "fp32"]).decode().tolist() == ["fp32", "bf16", "fp32"]


def test_a_label_column_relabels_rows_in_place_and_decodes_to_the_same_text():
    """The FLOP context pass rewrites some ops' model names (a conv costed from its consumer): the coded
    column must read back exactly as the text it stands for, new names included."""
    from plasmient_trace.metrics.flops.labels import LabelColumn
    text = np.array(["none", "gemm", "none", "elementwise", "none"])
    col = LabelColumn(["none", "gemm", "elementwise"], np.array([0, 1, 0, 2, 0]))
    assert col.equals("none").tolist() == (text == "none").tolist()
    assert not col.equals("conv").any()  # a name no row has yet
    rows = np.array([0, 4])
    col.codes[rows] = col.code_of("conv")
    text[rows] = "conv"
    assert col.labels().decode().tolist() == text.tolist()
    assert col.labels().to_arrow().to_pylist() == text.tolist()
