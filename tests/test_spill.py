"""Export robustness (plasmient_trace.export.spill): a collector outage never blocks the job and loses no span."""

from __future__ import annotations

import threading
import time
from functools import lru_cache
from pathlib import Path

import pytest
from conftest import trace_path
from otlp_receiver import OtlpReceiver

from plasmient_trace.conventions import SpanBatch
from plasmient_trace.export.otlp import ExportError, OtlpConfig
from plasmient_trace.export.spill import SpillingExporter, replay, spill_files

MULTIRANK = ["a100_multirank/rank-0.json.gz", "a100_multirank/rank-1.json.gz"]
SUBMIT_BOUND_S = 1.0  # generous: a submit only enqueues (or appends to a local file)


@lru_cache(maxsize=None)
def _batch() -> SpanBatch:
    from plasmient_trace.pipeline import IngestOptions, ingest_paths

    return ingest_paths([trace_path(p) for p in MULTIRANK], IngestOptions(job_id="spill-job")).batch


def _chunks(batch: SpanBatch, n: int) -> list[SpanBatch]:
    size = -(-len(batch) // n)
    return [SpanBatch(batch.table.slice(i, size), batch.resources) for i in range(0, len(batch), size)]


def _ids(batch: SpanBatch) -> list[tuple[bytes, int]]:
    return list(zip(batch.table.column("trace_id").to_pylist(), batch.table.column("span_id").to_pylist()))


def _received(rx: OtlpReceiver) -> list[tuple[bytes, int]]:
    return [(s.trace_id, int.from_bytes(s.span_id, "big"))
            for req in rx.traces for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]


def _config(rx: OtlpReceiver, protocol: str = "grpc") -> OtlpConfig:
    endpoint = rx.grpc_endpoint if protocol == "grpc" else rx.http_endpoint
    # A short timeout so a dead collector is noticed quickly; the exporter's own retries come on top.
    return OtlpConfig.from_env({}, endpoint=endpoint, protocol=protocol, timeout_s=0.5, retry_initial_s=0.05, retry_max_s=0.1)


def _submit_all(exporter: SpillingExporter, batches: list[SpanBatch]) -> float:
    slowest = 0.0
    for b in batches:
        t0 = time.monotonic()
        exporter.submit(b)
        slowest = max(slowest, time.monotonic() - t0)
    return slowest


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_collector_killed_mid_run_then_replay_delivers_every_span(tmp_path: Path, protocol: str) -> None:
    batch = _batch()
    parts = _chunks(batch, 24)
    spill = tmp_path / "spill.jsonl"
    with OtlpReceiver() as rx:
        config = _config(rx, protocol)
        exporter = SpillingExporter(config, spill, max_attempts=2, initial_backoff_s=0.05, probe_interval_s=0.2)
        slowest = _submit_all(exporter, parts[:8])
        assert exporter.flush(30)
        rx.stop()  # the collector dies mid-run
        slowest = max(slowest, _submit_all(exporter, parts[8:16]))
        assert exporter.flush(60)
        assert exporter.collector_down and spill.exists()
        rx.start()  # back on the same ports
        time.sleep(0.3)  # past the probe interval: the next batch probes and finds it alive
        slowest = max(slowest, _submit_all(exporter, parts[16:]))
        stats = exporter.close(60)
        assert slowest < SUBMIT_BOUND_S, f"a submit took {slowest:.3f}s"
        assert stats.submitted_spans == len(batch)
        assert stats.sent_spans + stats.spilled_spans == len(batch) and stats.spilled_spans > 0
        assert not exporter.collector_down  # it noticed the collector came back

        delivered = replay(spill, config)
        assert delivered == stats.spilled_spans
        assert spill_files(spill) == []  # replayed files are removed
        got = _received(rx)
    expected = _ids(batch)
    assert set(got) == set(expected)  # every span arrived; duplicates would be allowed, none expected
    assert len(got) == len(expected)


def test_a_full_queue_spills_instead_of_growing(tmp_path: Path) -> None:
    batch = _batch()
    parts = _chunks(batch, 10)
    release = threading.Event()
    sent: list[SpanBatch] = []

    def slow_send(b: SpanBatch) -> None:  # a collector that hangs until released
        release.wait(30)
        sent.append(b)

    spill = tmp_path / "spill.jsonl"
    bound = 2 * len(parts[0])
    exporter = SpillingExporter(send=slow_send, spill_path=spill, max_queue_spans=bound)
    peak = 0
    accepted = []
    for p in parts:
        t0 = time.monotonic()
        accepted.append(exporter.submit(p))
        assert time.monotonic() - t0 < SUBMIT_BOUND_S
        peak = max(peak, exporter.queued_spans)
    assert peak <= bound
    assert accepted[:2] == [True, True] and not any(accepted[2:])
    release.set()
    stats = exporter.close(30)
    assert stats.sent_spans == sum(len(b) for b in sent) == 2 * len(parts[0])
    assert stats.spilled_spans == len(batch) - stats.sent_spans
    replayed: list[SpanBatch] = []
    assert replay(spill, send=replayed.append) == stats.spilled_spans
    got = [i for b in sent + replayed for i in _ids(b)]
    assert sorted(got) == sorted(_ids(batch))


def test_spill_file_rotates_at_its_cap_and_replay_reads_every_rotation(tmp_path: Path) -> None:
    batch = _batch()

    def down(b: SpanBatch) -> None:
        raise ConnectionRefusedError("collector down")

    spill = tmp_path / "spill.jsonl"
    exporter = SpillingExporter(send=down, spill_path=spill, max_attempts=1, probe_interval_s=60, spill_max_bytes=200_000)
    _submit_all(exporter, _chunks(batch, 6))
    stats = exporter.close(30)
    files = spill_files(spill)
    assert stats.spilled_spans == len(batch) and stats.spill_rotations >= 2
    assert len(files) == stats.spill_rotations + 1 and files[-1] == spill
    assert all(f.stat().st_size <= 200_000 or sum(1 for _ in open(f, "rb")) == 1 for f in files)
    order: list[SpanBatch] = []
    assert replay(spill, send=order.append) == len(batch)
    assert sorted(i for b in order for i in _ids(b)) == sorted(_ids(batch))
    assert spill_files(spill) == []


def test_replay_interrupted_by_a_dead_collector_resumes_where_it_stopped(tmp_path: Path) -> None:
    batch = _batch()

    def down(b: SpanBatch) -> None:
        raise ConnectionRefusedError("collector down")

    spill = tmp_path / "spill.jsonl"
    with SpillingExporter(send=down, spill_path=spill, max_attempts=1) as exporter:
        _submit_all(exporter, _chunks(batch, 4))
    lines_before = sum(1 for _ in open(spill, "rb"))
    assert lines_before >= 2  # one line per trace at least (2 steps)

    calls = {"n": 0}
    first: list[SpanBatch] = []

    def dies_after_one(b: SpanBatch) -> None:
        calls["n"] += 1
        if calls["n"] > 1:
            raise ExportError("collector went away")
        first.append(b)

    with pytest.raises(ExportError):
        replay(spill, send=dies_after_one)
    assert sum(1 for _ in open(spill, "rb")) == lines_before - 1  # the delivered line is gone
    rest: list[SpanBatch] = []
    replay(spill, send=rest.append)
    assert sorted(i for b in first + rest for i in _ids(b)) == sorted(_ids(batch))


def test_cli_replay_sends_the_spill_file(tmp_path: Path) -> None:
    from plasmient_trace.cli import main

    batch = _batch()

    def down(b: SpanBatch) -> None:
        raise ConnectionRefusedError("collector down")

    spill = tmp_path / "spill.jsonl"
    with SpillingExporter(send=down, spill_path=spill, max_attempts=1) as exporter:
        exporter.submit(batch)
    with OtlpReceiver() as rx:
        assert main(["replay", str(spill), "--endpoint", rx.http_endpoint, "--protocol", "http/protobuf"]) == 0
        assert sorted(_received(rx)) == sorted(_ids(batch))
    assert not spill.exists()
    # Nothing left: a second replay says so and exits with the bad-input status.
    assert main(["replay", str(spill)]) == 2
