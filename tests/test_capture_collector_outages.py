"""A collector that is dead, slow or flapping costs the job nothing and loses no trace: the file holds every
step, what the collector missed is spilled, and `plasmient replay` delivers it once. The collectors are real
receivers on 127.0.0.1. Split from test_capture_never_breaks.py (whose helpers these are) so that its long
subprocess tests and these run side by side under pytest-xdist."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

from otlp_receiver import OtlpReceiver
from test_capture_never_breaks import (STEPS_JOB, TIMEOUT, _env, _plain, _received_ids, _script, _span_ids, _steps,
                                       _traced, _warm_cache)
from test_export import free_port

__all__ = ["_warm_cache"]  # the autouse fixture that fills the native build cache the jobs share


def test_a_dead_collector_spills_every_trace_reports_once_and_replay_delivers_them(tmp_path: Path) -> None:
    script = _script(tmp_path, "steps.py", STEPS_JOB)
    plain = _plain(tmp_path, script, "30", "0")
    traced = _traced(tmp_path, script, "30", "0", OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{free_port()}",
                     OTEL_EXPORTER_OTLP_TIMEOUT="500", PLASMIENT_SPILL_DIR=str(tmp_path / "spill"))
    assert traced.returncode == plain.returncode == 0 and traced.stdout == plain.stdout
    ours = traced.stderr.decode().splitlines()
    assert len(ours) == 1 and "plasmient replay" in ours[0] and str(tmp_path / "spill") in ours[0]
    assert _steps(tmp_path / "t.jsonl") == list(range(30))
    assert _span_ids(tmp_path / "spill") == _span_ids(tmp_path / "t.jsonl")
    with OtlpReceiver() as rx:
        replay = subprocess.run([sys.executable, "-m", "plasmient_trace.cli", "replay", str(tmp_path / "spill")],
                                env=_env(tmp_path, OTEL_EXPORTER_OTLP_ENDPOINT=rx.grpc_endpoint),
                                capture_output=True, timeout=TIMEOUT)
        assert replay.returncode == 0, replay.stderr
        assert _received_ids(rx) == _span_ids(tmp_path / "t.jsonl")  # every span once
        assert rx.metrics  # the live run's step metrics, with their exemplars


def test_a_slow_collector_never_delays_the_file_and_every_span_is_delivered_or_spilled(tmp_path: Path) -> None:
    script = _script(tmp_path, "steps.py", STEPS_JOB)
    with OtlpReceiver() as rx:
        rx.delay_s = 1.5  # every request waits, longer than the job's steps
        traced = _traced(tmp_path, script, "30", "0.02", OTEL_EXPORTER_OTLP_ENDPOINT=rx.grpc_endpoint,
                         OTEL_EXPORTER_OTLP_TIMEOUT="10000", PLASMIENT_SPILL_DIR=str(tmp_path / "spill"),
                         PLASMIENT_EXPORT_INTERVAL_S="0.2")
        received = _received_ids(rx)
    assert traced.returncode == 0, traced.stderr.decode()
    assert _steps(tmp_path / "t.jsonl") == list(range(30))
    spilled = _span_ids(tmp_path / "spill") if (tmp_path / "spill").exists() else Counter()
    assert set(received) | set(spilled) == set(_span_ids(tmp_path / "t.jsonl"))
    # The request in flight when the job exits is cut off and spilled; a collector that still
    # stores it has it twice (at least once, as OTLP is): never more than that one request.
    assert max((received + spilled).values()) <= 2


def test_a_flapping_collector_loses_nothing(tmp_path: Path) -> None:
    script = _script(tmp_path, "steps.py", STEPS_JOB)
    with OtlpReceiver() as rx:
        env = dict(OTEL_EXPORTER_OTLP_ENDPOINT=rx.http_endpoint, OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
                   OTEL_EXPORTER_OTLP_TIMEOUT="1000", PLASMIENT_SPILL_DIR=str(tmp_path / "spill"),
                   PLASMIENT_EXPORT_INTERVAL_S="0.2")
        box: dict[str, subprocess.CompletedProcess] = {}
        job = threading.Thread(target=lambda: box.update(p=_traced(tmp_path, script, "80", "0.05", **env)))
        job.start()
        assert rx.wait_for(requests=1, timeout=TIMEOUT)  # the collector took some steps...
        rx.stop()  # ...went away...
        job.join(3.0)
        rx.start()  # ...and came back on the same ports while the job still runs
        job.join(TIMEOUT)
        received = _received_ids(rx)
    traced = box["p"]
    assert traced.returncode == 0, traced.stderr.decode()
    assert _steps(tmp_path / "t.jsonl") == list(range(80))
    spilled = _span_ids(tmp_path / "spill") if (tmp_path / "spill").exists() else Counter()
    assert set(received) | set(spilled) == set(_span_ids(tmp_path / "t.jsonl"))
    # A request the collector stored but whose answer died with it is sent again (at least once):
    # that repeats at most the one request in flight, never more.
    assert max((received + spilled).values()) <= 2
