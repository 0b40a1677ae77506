"""conventions.with_nulls builds the same Arrow arrays as pa.array(values, mask=...) does, for every
dtype the stitcher hands it, and nan_to_null leaves every unknown number absent."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from plasmient_trace.conventions import nan_to_null, with_nulls

RNG = np.random.default_rng(3)
VALUES = {
    "int64": RNG.integers(-(2**62), 2**62, 1000),
    "uint64": RNG.integers(0, 2**63, 1000).astype(np.uint64) * np.uint64(2),
    "int32": RNG.integers(-1000, 1000, 1000).astype(np.int32),
    "float64": np.where(RNG.random(1000) < 0.1, np.nan, RNG.normal(size=1000)),
    "strided": np.arange(2000, dtype=np.float64)[::2],
    "bool": RNG.random(1000) < 0.5,
}


@pytest.mark.parametrize("name", sorted(VALUES))
@pytest.mark.parametrize("null_share", [0.0, 0.3, 1.0])
def test_the_same_array_as_arrows_masked_constructor(name: str, null_share: float) -> None:
    values = VALUES[name]
    null = RNG.random(len(values)) < null_share
    got, want = with_nulls(values, null), pa.array(values, mask=null)
    assert got.type == want.type and got.null_count == want.null_count == int(null.sum())
    assert got.is_null().to_pylist() == want.is_null().to_pylist() == null.tolist()
    filler = False if values.dtype == bool else 0
    # assert_array_equal counts NaN equal to NaN: a NaN under a valid slot stays NaN in both
    np.testing.assert_array_equal(got.fill_null(filler).to_numpy(zero_copy_only=False),
                                  want.fill_null(filler).to_numpy(zero_copy_only=False))
    got.validate(full=True)


def test_nan_and_infinities_are_absent_and_the_rest_kept() -> None:
    got = nan_to_null(np.array([1.5, np.nan, np.inf, -np.inf, -0.0, 0.0]))
    assert got.to_pylist()[:2] == [1.5, None] and got.to_pylist()[2:4] == [None, None]
    assert got.null_count == 3 and str(got.to_pylist()[4]) == "-0.0"


@pytest.mark.parametrize("typ", [pa.float64(), pa.int64(), pa.string()])
def test_blanking_what_step_depth_cannot_know_equals_arrow_if_else(typ):
    """A step-depth step's unmeasurable columns are blanked (step_facts._null_where). For numbers only the
    validity bitmap is rebuilt; the result must be the if_else it replaces, nulls already present included,
    on plain, chunked and sliced inputs."""
    import pyarrow.compute as pc

    from plasmient_trace.stitch.step_facts import _null_where

    rng = np.random.default_rng(5)
    for _ in range(60):
        n = int(rng.integers(0, 40))
        raw = [None if rng.random() < 0.2 else float(rng.integers(-9, 9)) for _ in range(n + 3)]
        arr = pa.array([None if v is None else (str(v) if pa.types.is_string(typ) else v) for v in raw], typ)
        arr = arr.slice(3) if rng.random() < 0.3 else arr.slice(0, n)
        value = pa.chunked_array([arr.slice(0, n // 2), arr.slice(n // 2)], typ) if rng.random() < 0.3 else arr
        mask = rng.random(len(arr)) < 0.4
        got = _null_where(value, mask, typ)
        got.validate(full=True)
        assert got.to_pylist() == pc.if_else(pa.array(mask), pa.nulls(len(arr), typ), arr).to_pylist()
