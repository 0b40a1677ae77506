"""The spill directory and `plasmient replay`: every spilled span reaches the collector exactly once,
even when the replay is killed mid-way or a spiller keeps writing while it runs; processes sharing
a file never tear each other's lines."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import Any

import orjson
import pytest
from conftest import trace_path
from otlp_receiver import OtlpReceiver

from plasmient_trace.conventions import SpanBatch
from plasmient_trace.export import otlp
from plasmient_trace.export.sinks import FileSink
from plasmient_trace.export.otlp_json import batch_from_otlp_dicts, encode_jsonl_lines
from plasmient_trace.export.spill import SpillDir, SpillFull, append_lines, open_for_append, replay

RANK0 = "a100_multirank/rank-0.json.gz"  # two steps, each an OTLP/JSON line of over 3 MiB
REPO = Path(__file__).resolve().parents[1]


@lru_cache(maxsize=None)
def _batch(name: str = RANK0) -> SpanBatch:
    from plasmient_trace.pipeline import IngestOptions, ingest_paths

    return ingest_paths([trace_path(name)], IngestOptions(job_id="spill-job")).batch


def _per_trace(batch: SpanBatch) -> list[SpanBatch]:
    """One batch per trace line, as the live path submits steps."""
    return [batch_from_otlp_dicts([orjson.loads(line)]) for line in encode_jsonl_lines(batch)]


def _span_keys(batch: SpanBatch) -> list[tuple[bytes, int]]:
    return list(zip(batch.table.column("trace_id").to_pylist(), batch.table.column("span_id").to_pylist()))


def _received(rx: OtlpReceiver) -> Counter:
    return Counter((s.trace_id, int.from_bytes(s.span_id, "big"))
                   for req in rx.traces for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans)


def _lines_of(path: Path) -> list[bytes]:
    return [line for line in path.read_bytes().split(b"\n") if line]


def _spans_in_lines(lines: list[bytes]) -> list[tuple[bytes, int]]:
    return [k for line in lines for k in _span_keys(batch_from_otlp_dicts([orjson.loads(line)]))]


# --------------------------------------------------------------------------------------------
# Several writers, one file


def _append_many(path: str, lines: list[bytes], rounds: int) -> None:
    sink = FileSink(path, append=True)
    batches = [batch_from_otlp_dicts([orjson.loads(line)]) for line in lines]
    for _ in range(rounds):
        for b in batches:
            sink.write(b)


def test_processes_appending_megabyte_lines_to_one_file_never_interleave(tmp_path: Path) -> None:
    lines = list(encode_jsonl_lines(_batch()))
    assert max(map(len, lines)) > (1 << 20) > os.pathconf(str(tmp_path), "PC_PIPE_BUF")
    out = tmp_path / "shared.jsonl"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_append_many, args=(str(out), lines, 3)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        assert p.exitcode == 0
    written = _lines_of(out)
    assert len(written) == 3 * 3 * len(lines)  # every line of every process, none torn
    assert Counter(written) == Counter({line.rstrip(b"\n"): 9 for line in lines})


def _append_raw(path: str, fill: bytes, count: int, start: Any) -> None:
    line = b'{"x":"' + fill * 300_000 + b'"}'
    start.wait()  # all at once: a spawned process takes a second or two to import this module
    for _ in range(count):
        fd = open_for_append(path)
        try:
            append_lines(fd, (line,))
        finally:
            os.close(fd)


def test_processes_appending_long_lines_at_once_leave_no_empty_line_between_them(tmp_path: Path) -> None:
    """append_lines ends a line a full disk cut short, seen from the file's last byte. A file's size grows page by
    page while a write copies, so another process's 300 KB line, half copied, read as one cut short and got a
    newline of its own: 272-311 empty lines among these 450 (332-576 among 900 in a script), and an empty line
    in the shared file failed test_torchrun_ranks_sharing_one_out_file_never_tear_a_line once."""
    out = tmp_path / "shared.jsonl"
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(3)
    procs = [ctx.Process(target=_append_raw, args=(str(out), fill, 150, start)) for fill in (b"a", b"b", b"c")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        assert p.exitcode == 0
    data = out.read_bytes()
    assert data.count(b"\n") == 450 and b"\n\n" not in data


# --------------------------------------------------------------------------------------------
# The spill directory


def test_spill_is_bounded_and_segments_seal_at_their_size(tmp_path: Path) -> None:
    lines = list(encode_jsonl_lines(_batch("cpu_only/rank-34.json.gz")))
    spill = SpillDir(tmp_path / "spill", max_bytes=40_000, segment_bytes=20_000)
    written = 0
    with pytest.raises(SpillFull, match="full"):
        for _ in range(100):
            written += spill.append("traces", lines)
    assert written <= 40_000 and spill.size() == written
    assert len(spill.segments("traces")) >= 1  # sealed at 20 kB; the open segment keeps the rest


def _replay_to(rx: OtlpReceiver, spill: SpillDir) -> subprocess.CompletedProcess:
    """`plasmient replay DIR` in a child process, sending to the receiver over gRPC."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OTEL_EXPORTER_OTLP_ENDPOINT=rx.grpc_endpoint)
    return subprocess.run([sys.executable, "-m", "plasmient_trace.cli", "replay", str(spill.path)],
                          env=env, capture_output=True, text=True, timeout=300)


def test_replay_sends_traces_and_metrics_then_removes_them(tmp_path: Path) -> None:
    batch = _batch()
    spill = SpillDir(tmp_path / "spill")
    for part in _per_trace(batch):
        spill.append("traces", list(encode_jsonl_lines(part)))
    spill.append("metrics", list(encode_jsonl_lines(batch)))
    with OtlpReceiver() as rx:
        proc = _replay_to(rx, spill)
        assert proc.returncode == 0, proc.stderr
        assert _received(rx) == Counter(_span_keys(batch))
        assert rx.metrics  # the step metrics of the metrics segment, recomputed from its spans
    assert not spill.pending() and not list(spill.path.glob("*.jsonl*"))


def test_replay_killed_mid_way_then_rerun_delivers_every_span_exactly_once(tmp_path: Path) -> None:
    # many small lines: one trace from each of 12 jobs, distinct ids
    from plasmient_trace.pipeline import IngestOptions, ingest_paths

    spill = SpillDir(tmp_path / "spill")
    expected: list[tuple[bytes, int]] = []
    for i in range(12):
        b = ingest_paths([trace_path("cpu_only/rank-34.json.gz")], IngestOptions(job_id=f"job-{i}")).batch
        spill.append("traces", list(encode_jsonl_lines(b)))
        expected += _span_keys(b)
    assert len(set(expected)) == len(expected)
    with OtlpReceiver() as rx:
        rx.delay_s = 0.4  # each request takes a while: the kill lands mid-way
        env = dict(os.environ, PYTHONPATH=str(REPO), OTEL_EXPORTER_OTLP_ENDPOINT=rx.grpc_endpoint)
        cmd = [sys.executable, "-m", "plasmient_trace.cli", "replay", str(spill.path)]
        proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
        assert rx.wait_for(requests=3, timeout=120)
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        assert proc.returncode == -signal.SIGTERM  # died of the signal, after committing the line in flight
        assert 3 <= len(rx.traces) < 12
        rx.delay_s = 0.0
        again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, again.stderr
        got = _received(rx)
    assert got == Counter(expected)  # each span once: no loss, no duplicate


def test_a_spiller_writing_during_replay_loses_nothing(tmp_path: Path) -> None:
    lines = list(encode_jsonl_lines(_batch("cpu_only/rank-34.json.gz")))
    spill = SpillDir(tmp_path / "spill")
    sent: list[tuple[bytes, int]] = []
    stop = threading.Event()
    appended = 0
    errors: list[BaseException] = []

    def spiller() -> None:
        # Bounded: an unbounded producer faster than the replay (a loaded machine) would never let it end.
        nonlocal appended
        try:
            while not stop.is_set() and appended < 40:
                spill.append("traces", lines)
                appended += 1
        except BaseException as err:  # noqa: BLE001 - the spiller must never fail: reported below
            errors.append(err)

    t = threading.Thread(target=spiller)
    t.start()
    try:
        for _ in range(5):
            replay(spill.path, {"traces": lambda b: sent.extend(_span_keys(b))})
    finally:
        stop.set()
        t.join()
    replay(spill.path, {"traces": lambda b: sent.extend(_span_keys(b))})
    assert errors == []  # a segment the replay removed while the spiller sized the directory used to raise here
    assert appended > 0 and len(sent) == appended * len(_spans_in_lines(lines))


def test_replay_stops_at_a_dead_collector_and_resumes_without_repeats(tmp_path: Path) -> None:
    spill = SpillDir(tmp_path / "spill")
    lines = list(encode_jsonl_lines(_batch("cpu_only/rank-34.json.gz")))
    for _ in range(6):
        spill.append("traces", lines)
    calls = 0
    sent: list[tuple[bytes, int]] = []

    def flaky(b: SpanBatch) -> None:
        nonlocal calls
        calls += 1
        if calls == 4:
            raise otlp.ExportError("collector went away")
        sent.extend(_span_keys(b))

    with pytest.raises(otlp.ExportError):
        replay(spill.path, {"traces": flaky})
    replay(spill.path, {"traces": flaky})
    assert len(sent) == 6 * len(_spans_in_lines(lines)) and not spill.pending()


def test_replay_counts_trace_spans_once_and_keeps_lines_with_no_spans(tmp_path: Path) -> None:
    # the metrics lines' spans were added to the traces' (1,256 "spans" for 628 sent), and a JSON line with no
    # spans in it ({"x": 1}) was "replayed" as nothing and deleted instead of kept with the bad lines
    spill = SpillDir(tmp_path / "spill")
    lines = list(encode_jsonl_lines(_batch("cpu_only/rank-34.json.gz")))
    spill.append("traces", [*lines, b'{"x": 1}\n'])
    spill.append("metrics", lines[:1])
    sent: dict[str, int] = {"traces": 0, "metrics": 0}

    def sender(signal_name: str):
        def send(b: SpanBatch) -> None:
            sent[signal_name] += len(b)
        return send

    stats = replay(spill.path, {"traces": sender("traces"), "metrics": sender("metrics")})
    assert (stats.traces, stats.spans, stats.metric_lines, stats.bad_lines) == (
        len(lines), len(_spans_in_lines(lines)), 1, 1)
    assert stats.spans == sent["traces"]
    assert (spill.path / "bad.jsonl").read_bytes() == b'{"x": 1}\n'


def test_replay_of_an_empty_or_missing_directory_is_one_line_and_exit_2(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    (tmp_path / "empty").mkdir()
    # a missing one used to be "no spilled spans there" too, which sends the user looking in the wrong place
    for name, said in (("nothing", "nothing: no such directory"), ("empty", "empty: no spilled spans there")):
        proc = subprocess.run([sys.executable, "-m", "plasmient_trace.cli", "replay", str(tmp_path / name)],
                              env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and said in proc.stderr, proc.stderr


def test_sealing_moves_the_open_segment_aside_for_a_replay(tmp_path: Path) -> None:
    spill = SpillDir(tmp_path / "spill")
    assert spill.seal("traces") is None  # nothing spilled, nothing sealed
    spill.append("traces", [b'{"resourceSpans":[]}'])
    sealed = spill.seal("traces")
    assert sealed is not None and sealed.read_bytes() == b'{"resourceSpans":[]}\n'
    assert spill.segments("traces") == [sealed] and not spill.live("traces").exists()


def test_lines_replay_cannot_send_are_kept_counted_and_said_never_deleted_unseen(tmp_path: Path) -> None:
    """A segment with good traces, a line that is not OTLP/JSON and a last line cut short (a write that failed
    half way, as on a full disk): the good ones reach a real receiver, the other two are kept in bad.jsonl
    byte for byte and named on stderr. The torn tail used to be deleted with its segment without a word."""
    batch = _batch()
    good = [line for part in _per_trace(batch) for line in encode_jsonl_lines(part)]
    spill = SpillDir(tmp_path / "spill")
    spill.append("traces", good[:1] + [b"not json at all"] + good[1:])
    torn = good[0][: len(good[0]) // 2]
    with open(spill.live("traces"), "ab") as f:
        f.write(torn)  # no newline: cut short
    with OtlpReceiver() as rx:
        proc = _replay_to(rx, spill)
        assert proc.returncode == 0, proc.stderr
        assert _received(rx) == Counter(_span_keys(batch))
    assert "2 line(s) could not be sent (1 not OTLP/JSON, 1 cut short by a failed write)" in proc.stderr
    assert (spill.path / "bad.jsonl").read_bytes() == b"not json at all\n" + torn + b"\n"
    assert not spill.pending()


def test_replay_of_a_run_directory_leaves_the_runs_own_traces_file_alone(tmp_path: Path) -> None:
    # replay renames what it sends and deletes it once sent: `plasmient replay .` where a live run wrote
    # its default traces.jsonl would have taken that file, the run's only output
    run_dir = tmp_path / "run"
    SpillDir(tmp_path / "real").append("traces", [b'{"resourceSpans":[]}'])
    run_dir.mkdir()
    (run_dir / "traces.jsonl").write_bytes((tmp_path / "real" / "traces.jsonl").read_bytes())
    before = sorted(p.name for p in run_dir.iterdir())
    proc = subprocess.run([sys.executable, "-m", "plasmient_trace.cli", "replay", str(run_dir), "--endpoint",
                           "http://127.0.0.1:9"], env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"plasmient: error: {run_dir}: not a spill directory (plasmient leaves a .lock in the ones it spills to); "
        "replay deletes what it sends, so it does not touch other files"]
    assert sorted(p.name for p in run_dir.iterdir()) == before == ["traces.jsonl"]
    assert (tmp_path / "real" / ".lock").is_file()  # what the spiller leaves: replay takes that directory


def test_an_output_that_is_no_file_spills_into_the_working_directory(monkeypatch, tmp_path: Path) -> None:
    # `--out /dev/null` with a collector down made /dev/plasmient-spill (as root) and told the user to replay it
    from plasmient_trace.export.spill import default_spill_dir

    monkeypatch.chdir(tmp_path)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for out in ("/dev/null", "/dev/stdout", str(fifo)):
        assert default_spill_dir(out, {}) == tmp_path / "plasmient-spill", out
    assert default_spill_dir(str(tmp_path / "runs" / "t.jsonl"), {}) == tmp_path / "runs" / "plasmient-spill"


def test_paths_from_the_environment_expand_a_leading_tilde(monkeypatch, tmp_path: Path) -> None:
    # an env file or a pod spec passes "~/..." as it is: no shell expands it, and a folder named "~" appeared
    from plasmient_trace.capture.config import CaptureConfig
    from plasmient_trace.export.spill import default_spill_dir
    from plasmient_trace.metrics.cpu_peak import _cache_dir
    from plasmient_trace.native_build import cache_dir

    monkeypatch.setenv("HOME", str(tmp_path))
    assert CaptureConfig.from_env({"PLASMIENT_OUT": "~/runs/t.jsonl"}).out == str(tmp_path / "runs" / "t.jsonl")
    assert default_spill_dir(None, {"PLASMIENT_SPILL_DIR": "~/spill"}) == tmp_path / "spill"
    monkeypatch.setenv("PLASMIENT_CACHE_DIR", "~/cache")
    assert _cache_dir(None) == tmp_path / "cache" and cache_dir() == tmp_path / "cache" / "native"


def _replayed_after_a_failure(tmp_path: Path, capsys, rerun_request_mib: float | None) -> tuple[SpanBatch, Counter, int]:
    """A spill of one trace line replayed in 32 KiB requests (so the line takes several) to a collector that
    refuses the third for good, then replayed again (at ``rerun_request_mib``, None: the default size): the
    line's spans, how often each reached the collector, and the requests it got."""
    from otlp_receiver import _Failure

    from plasmient_trace.cli import main

    batch = _batch("h100/bert_small_inference.json.gz")
    spill = SpillDir(tmp_path / "spill")
    spill.append("traces", list(encode_jsonl_lines(batch)))
    with OtlpReceiver() as rx:
        requests = []

        def third_fails():
            requests.append(1)
            return _Failure(1, None, 400, None) if len(requests) == 3 else None   # a permanent error: no retry

        rx._take_failure = third_fails
        argv = ["replay", str(spill.path), "--endpoint", rx.http_endpoint, "--protocol", "http/protobuf"]
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("PLASMIENT_OTLP_MAX_REQUEST_MIB", str(32 / 1024))
            assert main(argv) == 1 and "replay stopped" in capsys.readouterr().err
            if rerun_request_mib is None:
                mp.delenv("PLASMIENT_OTLP_MAX_REQUEST_MIB")
            else:
                mp.setenv("PLASMIENT_OTLP_MAX_REQUEST_MIB", str(rerun_request_mib))
            assert main(argv) == 0
        keys = Counter((span.trace_id, span.span_id) for request in rx.traces for rs in request.resource_spans
                       for ss in rs.scope_spans for span in ss.spans)
    assert not spill.pending()
    return batch, keys, len(requests)


def test_a_line_sent_in_several_requests_resumes_inside_it_without_repeats(tmp_path: Path, capsys) -> None:
    # A trace line over the request size goes out in several requests; progress was committed per line, so
    # a replay that failed between two of them sent the earlier ones again (4,199 of 18,171 spans twice).
    batch, keys, requests = _replayed_after_a_failure(tmp_path, capsys, 32 / 1024)
    assert requests > 4 and len(keys) == len(batch) and set(keys.values()) == {1}


def test_a_line_resumed_under_another_request_size_is_sent_whole_not_cut(tmp_path: Path, capsys) -> None:
    # Progress inside a line is a count of requests: rerun with a larger request size, the line fit in one
    # request, which counted as sent, and 608 of 628 spans were lost with exit 0. Under another split the
    # line is sent whole again.
    batch, keys, _ = _replayed_after_a_failure(tmp_path, capsys, None)
    assert len(keys) == len(batch)


def test_a_spilled_line_a_full_disk_cut_short_is_ended_before_the_next_one(tmp_path: Path, nearly_full_disk) -> None:
    """The spill appends as the live file does: a line the disk held only part of is ended with a newline
    before the next line, once there is room, so that line is whole and replay sends it."""
    spill = SpillDir(tmp_path / "spill")
    disk = nearly_full_disk(10)
    with pytest.raises(OSError, match="short write"):
        spill.append("traces", [b'{"resourceSpans": []}'])
    disk.full = False
    spill.append("traces", [b'{"resourceSpans": [1]}'])
    assert spill.live("traces").read_bytes().splitlines() == [b'{"resource', b'{"resourceSpans": [1]}']
