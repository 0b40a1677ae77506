"""Reading ranks in a process pool gives the same record tables, in the same order, as reading them one
by one; a bad file among them fails with its own one-line error."""

from __future__ import annotations

import pytest

from conftest import trace_path

from plasmient_trace.sources.kineto import TraceFormatError, read_kineto
from plasmient_trace.sources.parallel import read_many

FILES = ("a100_multirank/rank-0.json.gz", "a100_multirank/rank-1.json.gz", "mi250/minitoy_train.json.gz")


def test_pool_read_equals_sequential_read_in_input_order():
    paths = [trace_path(f) for f in FILES]
    seen = []
    pooled = read_many(paths, workers=2, progress=lambda what, done, total: seen.append((what, done, total)))
    for path, got in zip(paths, pooled):
        want = read_kineto(path)
        assert got.source == str(path)
        for name, table in want.tables().items():
            assert getattr(got, name).equals(table), (path, name)
        assert got.resource == want.resource and got.devices == want.devices and got.counters == want.counters
    assert [d for _, d, _ in seen] == [0, 1, 2]


def test_a_bad_rank_file_fails_with_its_own_message(tmp_path):
    bad = tmp_path / "rank-7.json.gz"
    bad.write_bytes(trace_path(FILES[0]).read_bytes()[:5000])
    with pytest.raises(TraceFormatError, match=r"rank-7\.json\.gz: truncated gzip stream"):
        read_many([trace_path(FILES[0]), bad, trace_path(FILES[1])], workers=2)
