"""Shared fixtures: the real traces in ../shared/traces, ingested once per test session."""

from __future__ import annotations

import gzip
import json
import os
import sys
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO.parent / "shared" / "traces"
sys.path.insert(0, str(Path(__file__).resolve().parent))

ALL_TRACES = sorted(str(p.relative_to(TRACES)) for p in TRACES.glob("*/*.json.gz")) if TRACES.is_dir() else []


def union_ns(intervals: list[tuple[int, int]]) -> int:
    """Length of the union of [start, end) intervals: the oracle's own sweep, independent of the stitcher's."""
    total, cur_s, cur_e = 0, None, None
    for s, e in sorted(i for i in intervals if i[1] > i[0]):
        if cur_e is None or s > cur_e:
            total += (cur_e - cur_s) if cur_e is not None else 0
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + ((cur_e - cur_s) if cur_e is not None else 0)


def trace_path(name: str) -> Path:
    path = TRACES / name
    if not path.exists():
        if os.environ.get("CI"):
            raise FileNotFoundError(f"{path} missing: CI must have ../shared/traces beside the repo")
        pytest.skip(f"{path} not present")
    return path


@lru_cache(maxsize=None)
def raw_trace(name: str) -> dict:
    """The trace as plain json, read independently of the project's parser."""
    with gzip.open(trace_path(name), "rt") as f:
        doc = json.load(f)
    return doc if isinstance(doc, dict) else {"traceEvents": doc}


@lru_cache(maxsize=None)
def ingested(name: str, max_spans: int | None = None):
    from plasmient_trace.pipeline import IngestOptions, ingest_paths

    options = IngestOptions(job_id="test-job")
    if max_spans is not None:
        options.max_spans = max_spans
    return ingest_paths([trace_path(name)], options)


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    if not TRACES.is_dir():
        pytest.fail(f"{TRACES} is missing: the tests read the shared real traces")
    return TRACES


def ingest_batch(paths: list[Path], job_id: str):
    """SpanBatch of real shared traces through the real pipeline (one file per rank)."""
    from plasmient_trace.pipeline import IngestOptions, ingest_paths

    for p in paths:
        assert p.is_file(), f"missing shared trace {p}"
    return ingest_paths([str(p) for p in paths], IngestOptions(job_id=job_id)).batch


@pytest.fixture(scope="session", autouse=True)
def native_observer():
    """The native op observer, built (or read from the cache) before any capture test runs, so every
    session and example subprocess under the default PLASMIENT_OP_HOOK=auto starts on it; the test
    machines have a C++ compiler, so a failed build is a failure, not a skip."""
    from plasmient_trace.capture import native

    observer = native.load()
    if observer is None:
        pytest.fail(f"the native op observer did not build: {native.failure()}")
    return observer
