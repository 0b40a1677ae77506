"""conventions.scatter_rows: a few values spread over a span table's rows, null elsewhere, as Arrow's take
with a null-masked index would give, without the memory take reserves for strings."""

from __future__ import annotations

import random

import numpy as np
import pyarrow as pa

from plasmient_trace.conventions import numbers_on_rows, scatter_rows


def _by_take(values: pa.Array, rows: np.ndarray, n: int) -> pa.Array:
    where = np.zeros(n, np.int64)
    where[rows] = np.arange(len(rows))
    valid = np.zeros(n, bool)
    valid[rows] = True
    return values.take(pa.array(where, mask=~valid))


def test_same_values_as_arrow_take_on_random_inputs():
    rng = random.Random(7)
    for _ in range(400):
        m = rng.randint(0, 8)
        n = m + rng.randint(0, 8)
        kind = rng.choice(["string", "binary", "double", "int64", "bool"])
        pick = {"string": lambda: rng.choice([None, "", "a", "bc" * rng.randint(1, 40)]),
                "binary": lambda: rng.choice([None, b"", b"\x00z" * rng.randint(1, 9)]),
                "double": lambda: rng.choice([None, rng.random()]),
                "int64": lambda: rng.choice([None, rng.randint(-5, 5)]),
                "bool": lambda: rng.choice([None, True, False])}[kind]
        offset = rng.randint(0, 2)  # sliced inputs too
        values = pa.array([pick() for _ in range(m + offset)], getattr(pa, {"string": "string", "binary": "binary",
                          "double": "float64", "int64": "int64", "bool": "bool_"}[kind])()).slice(offset, m)
        rows = np.array(sorted(rng.sample(range(n), m)), np.int64)
        got = scatter_rows(values, rows, n)
        got.validate(full=True)
        assert got.type == values.type
        assert got.to_pylist() == _by_take(values, rows, n).to_pylist()


def _peak_bytes(build) -> int:
    """Peak Arrow bytes allocated while building, on a fresh pool of its own."""
    default = pa.default_memory_pool()
    pool = pa.proxy_memory_pool(default)
    pa.set_memory_pool(pool)
    try:
        build()
    finally:
        pa.set_memory_pool(default)
    return pool.max_memory()


def test_long_strings_on_few_rows_cost_their_own_bytes_only():
    # ten 4 kB culprit lists on a 33k-span table
    values = pa.array(["x" * 4000] * 10)
    rows = np.arange(10, dtype=np.int64) * 3300
    out = scatter_rows(values, rows, 33_000)
    assert out.null_count == 33_000 - 10 and out[3300].as_py() == "x" * 4000
    assert _peak_bytes(lambda: scatter_rows(values, rows, 33_000)) < 1 << 20
    assert _peak_bytes(lambda: _by_take(values, rows, 33_000)) > 100 << 20  # what take reserved for them


def test_numbers_on_rows_is_the_masked_dense_column_it_replaces():
    """The step-level columns used to be built dense (n rows, then masked); the scattered form must give
    the same values, with NaN and infinities absent rather than numbers."""
    rng = np.random.default_rng(11)
    for _ in range(300):
        n = int(rng.integers(0, 12))
        m = int(rng.integers(0, n + 1))
        rows = rng.permutation(n)[:m]  # any order: kernel rows and step rows are scattered together
        if rng.random() < 0.5:
            values = rng.choice([1.5, -2.0, 0.0, np.nan, np.inf, -np.inf], m)
        else:
            values = rng.integers(-3, 1_000_000_000_000, m)
        dense = np.full(n, np.nan) if values.dtype.kind == "f" else np.zeros(n, values.dtype)
        dense[rows] = values
        carried = np.zeros(n, bool)
        carried[rows] = True
        if values.dtype.kind == "f":
            carried &= np.isfinite(dense)
        expected = pa.array(dense, mask=~carried)
        got = numbers_on_rows(values, rows, n)
        got.validate(full=True)
        assert got.type == expected.type
        assert got.null_count == n - int(carried.sum())
        assert got.to_pylist() == expected.to_pylist()
