"""The one-pass groupings equal numpy's sort-based answers: ``unique_inverse`` is ``np.unique(...,
return_inverse=True)`` on every integer type, whether the keys ascend, span a small range or neither."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from plasmient_trace.metrics.grouping import first_seen_groups, match_distinct, unique_inverse


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.int32, np.int64, np.uint64])
def test_unique_inverse_is_numpys_unique_with_inverse(dtype: type) -> None:
    rng = np.random.default_rng(7)
    info = np.iinfo(dtype)
    for n in (0, 1, 2, 17, 5000):
        cases = {
            "ascending": np.sort(rng.integers(0, 50, n)).astype(dtype),  # rows ordered by group
            "few devices": rng.integers(0, 8, n).astype(dtype),
            "whole range": rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True),  # the sort fallback
            "sparse": (rng.integers(0, 3, n) * 7).astype(dtype),
        }
        for name, values in cases.items():
            keys, inverse = unique_inverse(values)
            want_keys, want_inverse = np.unique(values, return_inverse=True)
            assert keys.dtype == want_keys.dtype and np.array_equal(keys, want_keys), name
            assert inverse.dtype == np.int64 and np.array_equal(inverse, want_inverse.reshape(-1)), name


def test_first_seen_groups_numbers_groups_by_first_appearance() -> None:
    group, first = first_seen_groups(np.array([9, 4, 9, 9, -1, 4]))
    assert group.tolist() == [0, 1, 0, 0, 2, 1] and first.tolist() == [0, 1, 4]


def test_match_distinct_answers_every_row_as_matching_it_alone_would() -> None:
    names = pa.chunked_array([["ncclKernel_AllReduce", None, "ampere_sgemm", "ncclKernel_AllReduce"], ["", "NCCL_x"]])
    seen: list[int] = []

    def is_nccl(distinct: pa.Array) -> pa.Array:
        seen.append(len(distinct))
        return pc.starts_with(distinct, "nccl")

    got = match_distinct(names, is_nccl)
    want = [v is not None and v.startswith("nccl") for v in names.to_pylist()]
    assert got.tolist() == want and seen == [4]  # null row False; four distinct names matched once
    assert match_distinct(pa.array(["a", "b"]), lambda d: pa.array([None, True])).tolist() == [False, True]
