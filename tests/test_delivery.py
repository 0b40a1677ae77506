"""The one delivery path (plasmient_trace.export.delivery + the OTLP client's retry loop): the file is
written before and regardless of the network, the queue is bounded, shutdown interrupts backoff and
slow collectors, Retry-After cannot cause a storm or an endless wait, secrets never reach a message."""

from __future__ import annotations

import errno
import os
import shutil
import socket
import re
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest
from conftest import trace_path
from otlp_receiver import OtlpReceiver, _Failure
from test_export import free_port, small_batch

from plasmient_trace.cli import main
from plasmient_trace.conventions import SpanBatch
from plasmient_trace.export import otlp
from plasmient_trace.export.delivery import Delivery
from plasmient_trace.export.sinks import FileSink, OtlpSink, OutputError, write_output_file
from plasmient_trace.export.otlp import ExportError, OtlpConfig, send_spans
from plasmient_trace.export.otlp_json import read_jsonl
from plasmient_trace.export.spill import SpillDir

TRACE = "cpu_only/rank-34.json.gz"
# a CPU trace names no peak: without one, ingest warns (--quiet too) that its spans have no MFU
KNOWN_PEAK = ("--peak-tflops", "1")


class _RemoteSink:
    """What a network sink has besides export: nothing to reset or close here."""

    signal = "traces"

    def reset(self) -> None:
        pass

    def close(self) -> None:
        pass


class Blocked(_RemoteSink):
    """A network sink that hangs until released (a collector that never answers)."""

    name = "blocked collector"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.got: list[int] = []

    def export(self, batch: SpanBatch, stop: threading.Event, probe: bool = False) -> None:
        self.entered.set()
        while not self.release.wait(0.05):
            if stop.is_set():
                raise ExportError("stopped by shutdown")
        self.got.append(len(batch))


class Trickle:
    """An HTTP 'collector' that reads the request, then answers one byte every 0.1 s for minutes."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            try:
                conn.recv(1 << 20)
                for byte in b"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\n" * 100:
                    if self.stop.wait(0.1):
                        return
                    conn.sendall(bytes([byte]))
            except OSError:
                return

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


def _file_spans(path: Path) -> int:
    return len(read_jsonl(path)) if path.exists() else 0


# --------------------------------------------------------------------------------------------
# Delivery


def test_the_file_is_written_at_submit_while_the_collector_hangs(tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl"
    blocked = Blocked()
    d = Delivery([FileSink(out, append=True)], [blocked], SpillDir(tmp_path / "spill"), say=lambda k, m: None)
    batch = small_batch()
    for _ in range(3):
        d.submit(batch)
        assert blocked.entered.wait(30)
    assert _file_spans(out) == 3 * len(batch)  # all three, although the collector has taken none
    stats = d.shutdown(0.2)  # interrupts the hung export: it and the queued ones go to the spill
    assert stats.spilled["traces"] == 3 * len(batch) and not blocked.got


def test_a_full_queue_spills_at_submit_and_nothing_is_lost(tmp_path: Path) -> None:
    blocked = Blocked()
    said: list[str] = []
    batch = small_batch()
    d = Delivery([], [blocked], SpillDir(tmp_path / "spill"), max_queue_spans=2 * len(batch), say=lambda k, m: said.append(k))
    for _ in range(10):
        d.submit(batch)
    blocked.release.set()
    stats = d.shutdown(None)
    assert sum(blocked.got) + stats.spilled["traces"] == 10 * len(batch)
    assert stats.spilled["traces"] >= 7 * len(batch) and set(said) == {"queue-full"}  # one key: said once


def test_shutdown_interrupts_the_backoff_of_a_dead_collector(tmp_path: Path) -> None:
    config = OtlpConfig.from_env({}, endpoint=f"http://127.0.0.1:{free_port()}", protocol="http/protobuf",
                                 timeout_s=600, retry_initial_s=5, retry_max_s=5)
    sink = OtlpSink(config)
    d = Delivery([], [sink], SpillDir(tmp_path / "spill"), say=lambda k, m: None)
    d.submit(small_batch())
    deadline = time.monotonic() + 60
    while (sink._client is None or sink._client.attempts == 0) and time.monotonic() < deadline:
        time.sleep(0.01)
    start = time.monotonic()
    stats = d.shutdown(0.1)
    assert time.monotonic() - start < 60  # not the 600 s timeout: the backoff wait was cut short
    assert stats.spilled["traces"] == len(small_batch())
    assert "stopped by shutdown" in stats.errors["traces"]


def test_a_dead_collector_is_reported_once_and_probed_not_hammered(tmp_path: Path) -> None:
    said: list[tuple[str, str]] = []
    config = OtlpConfig.from_env({}, endpoint=f"http://127.0.0.1:{free_port()}", protocol="grpc", timeout_s=0.3,
                                 retry_initial_s=0.05)
    d = Delivery([], [OtlpSink(config), OtlpSink(config, "metrics")], SpillDir(tmp_path / "spill"), probe_interval_s=3600,
                 say=lambda k, m: said.append((k, m)))
    for _ in range(5):
        d.submit(small_batch())
    stats = d.shutdown(None)
    assert [k for k, _ in said] == ["down"] and "plasmient replay" in said[0][1]
    assert stats.spilled == {"traces": 5 * len(small_batch()), "metrics": 5 * len(small_batch())}
    assert SpillDir(tmp_path / "spill").live("metrics").exists()


def test_a_refused_collector_costs_one_retry_loop_then_one_attempt_per_batch_for_each_signal(tmp_path: Path) -> None:
    # ingest of a long trace against a refused port took 93 s: every batch ran a full retry loop for traces and
    # another for metrics. The collector is down for both signals once one finds no server there.
    config = OtlpConfig.from_env({}, endpoint=f"http://127.0.0.1:{free_port()}", protocol="http/protobuf", timeout_s=2,
                                 retry_initial_s=0.05)
    traces, metrics = OtlpSink(config), OtlpSink(config, "metrics")
    d = Delivery([], [traces, metrics], SpillDir(tmp_path / "spill"), probe_interval_s=0, say=lambda k, m: None)
    for _ in range(4):
        d.submit(small_batch())
    stats = d.shutdown(None)
    first_loop = int(re.search(r"\[(\d+) attempts", stats.errors["traces"]).group(1))
    assert first_loop >= 2  # the first failure is retried until the deadline, as any failure
    assert traces.attempts == first_loop + 3  # each later batch probes with one request
    assert metrics.attempts == 4  # down with the traces' collector: probes only, never a retry loop of its own
    assert stats.spilled == {"traces": 4 * len(small_batch()), "metrics": 4 * len(small_batch())}
    spilled = [len(read_jsonl(p)) for p in (tmp_path / "spill").glob("traces*.jsonl")]
    assert sum(spilled) == 4 * len(small_batch())


class Broken(_RemoteSink):
    """A sink whose export raises what no exporter should (a library's bug) the first ``times`` calls."""

    name = "broken collector"

    def __init__(self, times: int) -> None:
        self.times = times
        self.got: list[int] = []

    def export(self, batch: SpanBatch, stop: threading.Event, probe: bool = False) -> None:
        if self.times:
            self.times -= 1
            raise KeyError("a bug in a library, quoting http://bob:s3cret-hunter2@collector:4318")
        self.got.append(len(batch))


def test_an_unexpected_error_in_an_export_spills_the_batch_and_the_thread_goes_on(tmp_path: Path) -> None:
    # it used to end the delivery thread with a traceback: every later batch waited in a queue no one read
    said: list[tuple[str, str]] = []
    sink = Broken(times=1)
    d = Delivery([], [sink], SpillDir(tmp_path / "spill"), probe_interval_s=0, say=lambda k, m: said.append((k, m)))
    d.submit(small_batch())
    d.submit(small_batch())
    stats = d.shutdown(30)
    assert stats.spilled == {"traces": len(small_batch())} and sink.got == [len(small_batch())]
    assert [k for k, _ in said] == ["down", "up"] and "KeyError" in said[0][1] and "broken collector" in said[0][1]
    assert "hunter2" not in said[0][1] and "***@collector" in said[0][1]  # redacted as our own messages are


class Answering:
    """An HTTP peer that answers every POST with one fixed status, headers and body (a proxy, say)."""

    def __init__(self, status: int, headers: dict[str, str], body: bytes = b"") -> None:
        import http.server

        paths = self.paths = []  # of the requests, in order

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
                paths.append(self.path)
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self.send_response(status)
                for key, value in {**headers, "Content-Length": str(len(body))}.items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # noqa: ANN002 - quiet
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def __enter__(self) -> Answering:
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()


def test_a_collector_busy_past_the_budget_is_not_asked_again_for_the_metrics(tmp_path, monkeypatch, capsys) -> None:
    # Traces spent the backpressure budget on 503s, then the metrics spent it again: an ingest against an
    # always-busy collector took 35 s of a 20 s budget. The metrics of the batch now go where the traces went.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PLASMIENT_OTLP_BACKPRESSURE_S", "1")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "2000")
    monkeypatch.setenv("PLASMIENT_SPILL_DIR", str(tmp_path / "spill"))
    with Answering(503, {"Retry-After": "1"}) as peer:
        code = main(["ingest", str(trace_path(TRACE)), "--quiet", "--protocol", "http/protobuf",
                     "--endpoint", peer.endpoint])
    assert code == 1 and "busy" in capsys.readouterr().err.lower()
    assert peer.paths and all(p.endswith("/v1/traces") for p in peer.paths), peer.paths


def test_a_200_whose_body_is_no_otlp_answer_counts_as_taken() -> None:
    # a proxy in front of the collector answering its own page: the spans were taken, nothing is said about
    # partial success; the protobuf reader raised DecodeError out of the delivery thread
    with Answering(200, {"Content-Type": "text/html"}, b"<html>OK, proxied</html>") as peer:
        for protocol in ("http/protobuf", "http/json"):
            stats = send_spans(small_batch(), OtlpConfig.from_env({}, endpoint=peer.endpoint, protocol=protocol))
            assert stats.spans == len(small_batch()) and stats.rejected == 0, protocol


def test_a_redirect_names_where_it_points_and_is_not_followed() -> None:
    with Answering(308, {"Location": "https://user:pw@collector.example.com/v1/traces"}) as peer:
        with pytest.raises(ExportError) as err:
            send_spans(small_batch(), OtlpConfig.from_env({}, endpoint=peer.endpoint, protocol="http/protobuf"))
    text = str(err.value)
    assert "HTTP 308 Permanent Redirect to https://" in text and "collector.example.com/v1/traces: name that endpoint" in text
    assert "1 attempt " in text and "user:pw" not in text  # credentials in the target are not printed


def test_a_forked_child_starts_with_an_empty_queue_and_its_own_thread(tmp_path: Path) -> None:
    blocked = Blocked()
    d = Delivery([], [blocked], SpillDir(tmp_path / "spill"), say=lambda k, m: None)
    d.submit(small_batch())
    assert blocked.entered.wait(30)  # the parent's thread is busy, holding nothing the child needs
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        ok = d.force_flush(5) and d.shutdown(5).spilled == {}
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    blocked.release.set()
    d.shutdown(None)
    assert os.waitstatus_to_exitcode(status) == 0 and blocked.got == [len(small_batch())]


# --------------------------------------------------------------------------------------------
# The retry loop


def test_retry_after_zero_still_backs_off(tmp_path: Path) -> None:
    with OtlpReceiver() as rx:
        rx.fail_next(4, http_status=503, retry_after="0")
        config = OtlpConfig.from_env({}, endpoint=rx.http_endpoint, protocol="http/protobuf", retry_initial_s=0.1,
                                     retry_max_s=0.2, timeout_s=60)
        start = time.monotonic()
        stats = send_spans(small_batch(), config)
        elapsed = time.monotonic() - start
    assert stats.retries == 4
    # the floor of the backoff (0.1, 0.2, 0.2, 0.2 s, -20% jitter) was waited, not four instant retries
    assert elapsed >= 0.8 * (0.1 + 0.2 + 0.2 + 0.2)


def test_an_absurd_retry_after_ends_the_export_instead_of_waiting() -> None:
    with OtlpReceiver() as rx:
        rx.fail_next(1, http_status=429, retry_after="999999")
        config = OtlpConfig.from_env({}, endpoint=rx.http_endpoint, protocol="http/protobuf", timeout_s=120)
        start = time.monotonic()
        with pytest.raises(ExportError, match=r"asked to retry after 999999s, past the deadline.*\[1 attempt "):
            send_spans(small_batch(), config)
    assert time.monotonic() - start < 60  # far below both the hint and the timeout


@pytest.mark.parametrize("after", [None, 0.0, 1.0, 1e9, float("inf")])
def test_backoff_wait_is_never_below_the_backoff_and_never_negative(after: float | None) -> None:
    wait = otlp.backoff_wait(after, 0.5, 5.0)
    assert wait >= 0.4 and (after is None or wait >= after)


def test_a_collector_trickling_its_answer_is_cut_off_at_the_deadline() -> None:
    trickle = Trickle()
    try:
        config = OtlpConfig.from_env({"OTEL_EXPORTER_OTLP_TIMEOUT": "1000"}, endpoint=f"http://127.0.0.1:{trickle.port}",
                                     protocol="http/protobuf")
        start = time.monotonic()
        with pytest.raises(ExportError, match="timed out"):
            send_spans(small_batch(), config)
        assert time.monotonic() - start < 60  # the answer would take minutes at one byte per 0.1 s
    finally:
        trickle.close()


def test_ingest_to_a_trickling_collector_ends_spills_and_exits_1(tmp_path: Path, monkeypatch, capsys) -> None:
    trickle = Trickle()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1000")
    try:
        code = main(["ingest", str(trace_path(TRACE)), "--quiet", *KNOWN_PEAK, "--out", "t.jsonl", "--protocol",
                     "http/protobuf", "--endpoint", f"http://127.0.0.1:{trickle.port}"])
    finally:
        trickle.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and "timed out" in err[0]
    assert _file_spans(tmp_path / "t.jsonl") == _file_spans_of_spill(tmp_path / "plasmient-spill") > 0


def _file_spans_of_spill(path: Path) -> int:
    return sum(len(read_jsonl(p)) for p in path.glob("traces*.jsonl"))


# --------------------------------------------------------------------------------------------
# Secrets and output errors


def test_secrets_never_reach_an_error_line(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "500")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer%20tok-hunter2,x-api=k3y-hunter2")
    for protocol in ("grpc", "http/protobuf"):
        code = main(["ingest", str(trace_path(TRACE)), "--quiet", "--protocol", protocol,
                     "--endpoint", f"http://alice:pa55-hunter2@127.0.0.1:{free_port()}"])
        err = capsys.readouterr().err
        assert code == 1 and "127.0.0.1" in err and "***@" in err
        assert "hunter2" not in err, err
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer%0Atok-hunter2")
    code = main(["ingest", str(trace_path(TRACE)), "--quiet", "--endpoint", "http://127.0.0.1:1"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "authorization" in err and "hunter2" not in err


@pytest.mark.parametrize("endpoint", ["http://user:pa/ss-hunter2@127.0.0.1:{port}", "http://user:p#ss-hunter2@127.0.0.1:{port}",
                                      "user:pass-hunter2@127.0.0.1:{port}", "http://user:p'w-hunter2@127.0.0.1:99999",
                                      'http://user:p"w-hunter2@127.0.0.1:99999', "user:p'w-hunter2@127.0.0.1:99999"])
@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_a_password_a_url_cannot_hold_is_not_quoted_by_the_error(endpoint, protocol, monkeypatch, capsys) -> None:
    # A '/' or '#' in the password ends the URL's authority for its parser: the password was printed whole
    # ("OTLP endpoint 'http://user:pa/ss...@...'"), and the parser's own words quoted a piece of it ("as 'pa'").
    # With no scheme, a gRPC target's user:password@ was printed as given.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "500")   # a usable target is tried, against a closed port
    url = endpoint.format(port=free_port())
    code = main(["ingest", str(trace_path(TRACE)), "--quiet", "--protocol", protocol, "--endpoint", url])
    err = capsys.readouterr().err
    assert code in (1, 2) and "***@127.0.0.1" in err, err
    assert "hunter2" not in err and "'pa'" not in err and "'p'" not in err, err


@pytest.mark.parametrize("protocol, name", [("grpc", "%zz"), ("grpc", "x tenant"), ("http/protobuf", "x tenant")])
def test_a_header_name_the_protocol_cannot_carry_is_one_line_before_anything_is_sent(protocol, name, tmp_path) -> None:
    # '%zz' went as far as gRPC's C core, which wrote its own 8 lines to the process's stderr (a job's, when
    # live) before refusing it; a name is not a secret, so it is shown
    import subprocess
    import sys

    env = {**os.environ, "OTEL_EXPORTER_OTLP_HEADERS": f"{name}=1", "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
           "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
    proc = subprocess.run([sys.executable, "-m", "plasmient_trace.cli", "ingest", str(trace_path(TRACE)), "--quiet"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    kind = "gRPC metadata key" if protocol == "grpc" else "HTTP header name"
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        f"plasmient: error: OTLP header name {name!r} is not a valid {kind}"], proc.stderr
    assert list(tmp_path.iterdir()) == []


_UNUSABLE = [("http://", "no host"), ("http://[::1", "Invalid IPv6 URL"), ("http://127.0.0.1:99999", "Port out of range"),
             ("http://al:pa55-hunter2@127.0.0.1:99999", "Port out of range")]


# over gRPC a target of another scheme (unix:, dns:) is gRPC's to read, so ftp:// is refused over HTTP only
@pytest.mark.parametrize("protocol, endpoint, problem", [
    *(("grpc", e, p) for e, p in _UNUSABLE), *(("http/protobuf", e, p) for e, p in _UNUSABLE),
    ("http/protobuf", "ftp://127.0.0.1:4317", "not an http"),
])
def test_an_endpoint_that_cannot_be_one_is_a_setting_error_not_an_outage(protocol, endpoint, problem, tmp_path,
                                                                          monkeypatch, capsys) -> None:
    # these were tried five times, then reported as a collector down (exit 1) with the traces spilled
    monkeypatch.chdir(tmp_path)
    code = main(["ingest", str(trace_path(TRACE)), "--quiet", "--out", "/dev/null", "--endpoint", endpoint,
                 "--protocol", protocol])
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("plasmient: error: OTLP endpoint '") and problem in err[0], err
    assert "hunter2" not in err[0] and list(tmp_path.iterdir()) == []


def test_spans_a_spill_directory_cannot_keep_are_said_lost_never_spilled(tmp_path, monkeypatch, capsys) -> None:
    # "traces of 0 span(s) ... spilled to /dev/full; resend with `plasmient replay /dev/full`; 1256 could not be
    # spilled and are lost": the line told the user to replay spans that were gone
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PLASMIENT_SPILL_DIR", "/dev/full")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "500")
    out = tmp_path / "t.jsonl"
    code = main(["ingest", str(trace_path(TRACE)), "--quiet", *KNOWN_PEAK, "--out", str(out), "--protocol",
                 "http/protobuf", "--endpoint", f"http://127.0.0.1:{free_port()}"])
    (line,) = capsys.readouterr().err.strip().splitlines()
    spans = len(read_jsonl(out))  # the file is written first, whatever the network does
    assert code == 1 and "resend" not in line and "replay" not in line
    assert line.endswith(f"; traces of {spans} span(s) and metrics of {spans} span(s) could not be spilled to /dev/full "
                         "and are lost"), line


def test_a_header_entry_without_key_value_is_named_on_the_failure_never_shown(caplog) -> None:
    # "Authorization Bearer <token>" (a space, not '=') is skipped, as the spec allows: the collector then
    # answers 401 with no clue why; and the skipped entry, token and all, went to the logging warning
    import logging

    import grpc

    env = {"OTEL_EXPORTER_OTLP_HEADERS": "Authorization Bearer tok-hunter2,x-tenant=a"}
    with OtlpReceiver() as rx, caplog.at_level(logging.WARNING):
        for protocol, endpoint in (("grpc", rx.grpc_endpoint), ("http/protobuf", rx.http_endpoint)):
            rx.fail_next(1, grpc_code=grpc.StatusCode.UNAUTHENTICATED, http_status=401)
            with pytest.raises(ExportError) as err:
                send_spans(small_batch(), OtlpConfig.from_env(env, endpoint=endpoint, protocol=protocol, timeout_s=10))
            assert "1 entry of OTEL_EXPORTER_OTLP_HEADERS had no key=value and was not sent" in str(err.value)
            assert "hunter2" not in str(err.value)
    assert caplog.messages and not any("hunter2" in m for m in caplog.messages), caplog.messages
    # in a traced job's stderr (Python's last-resort handler prints the bare message) it says whose it is
    assert [m for m in caplog.messages if "header entr" in m][0].startswith("plasmient: ignoring 1 OTLP header entry")


def test_redact_covers_the_escaped_forms_messages_quote() -> None:
    config = OtlpConfig(headers={"authorization": "Bearer tok-hunter2"})
    for text in ("Bearer tok-hunter2", "b'Bearer tok-hunter2'", "Bearer%20tok-hunter2", "tok-hunter2"):
        assert "hunter2" not in otlp.redact(f"error: {text}", config)
    assert otlp.redact_url("https://u:p@host:4318/v1/traces") == "https://***@host:4318/v1/traces"
    assert "hunter2" not in repr(config)


def test_ingest_to_a_directory_is_one_line_exit_2(tmp_path: Path, capsys) -> None:
    code = main(["ingest", str(trace_path(TRACE)), "--quiet", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "is a directory" in err[0] and str(tmp_path) in err[0]


def test_a_full_disk_leaves_no_partial_file(tmp_path: Path, monkeypatch, capsys) -> None:
    import plasmient_trace.export.otlp_json as otlp_json

    def full(batch: SpanBatch, f, append: bool = False) -> int:
        f.write(b'{"resourceSpans": [')
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(otlp_json, "write_jsonl", full)
    code = main(["ingest", str(trace_path(TRACE)), "--quiet", *KNOWN_PEAK, "--out", str(tmp_path / "t.jsonl")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "No space left on device" in err[0] and "t.jsonl" in err[0]
    assert list(tmp_path.iterdir()) == []  # neither the file nor its temporary


def test_output_to_a_fifo_is_written_in_place_and_the_fifo_stays_a_fifo(tmp_path: Path, capsys) -> None:
    """``--out /dev/null``, ``/dev/stdout`` or a named pipe: the ingest used to write a temporary file and
    rename it over the path, which turned /dev/full into a regular file (run as root). A FIFO stands in for
    the devices here, so a regression cannot harm the machine running the test."""
    import stat

    assert main(["ingest", str(trace_path(TRACE)), "--quiet", "--out", str(tmp_path / "plain.jsonl")]) == 0
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    assert main(["ingest", str(trace_path(TRACE)), "--quiet", "--out", str(fifo)]) == 0
    reader.join(timeout=60)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert got == [(tmp_path / "plain.jsonl").read_bytes()]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.fifo", "plain.jsonl"]  # no temporary left


def test_output_through_a_symlink_replaces_the_file_it_names_not_the_link(tmp_path: Path, capsys) -> None:
    (tmp_path / "data").mkdir()
    target = tmp_path / "data" / "traces.jsonl"
    target.write_text("old\n")
    link = tmp_path / "traces.jsonl"
    link.symlink_to(target)
    assert main(["ingest", str(trace_path(TRACE)), "--quiet", "--out", str(link)]) == 0
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert main(["ingest", str(trace_path(TRACE)), "--quiet", "--out", str(tmp_path / "plain.jsonl")]) == 0
    assert target.read_bytes() == (tmp_path / "plain.jsonl").read_bytes()
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["traces.jsonl"]


def test_gpu_check_without_a_gpu_says_skipped_and_exits_0(tmp_path: Path) -> None:
    import subprocess

    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu-check.sh"
    proc = subprocess.run(["bash", str(script)], env={"PATH": str(tmp_path) + ":/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("gpu-check: SKIPPED:") and len(proc.stdout.splitlines()) == 1
    (tmp_path / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed: no devices were found' >&2\nexit 6\n")
    (tmp_path / "nvidia-smi").chmod(0o755)
    proc = subprocess.run(["bash", str(script)], env={"PATH": str(tmp_path) + ":/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "SKIPPED" in proc.stdout and "no devices were found" in proc.stdout


def test_gpu_check_with_a_cpu_only_torch_says_skipped_and_exits_0() -> None:
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    torch_has_cuda = "SKIPPED" not in proc.stdout
    if torch_has_cuda:
        pytest.skip("this machine has CUDA: the check itself ran")
    assert proc.returncode == 0 and proc.stdout.strip().count("\n") == 0 and "torch.cuda.is_available() is False" in proc.stdout


def test_ingest_below_a_file_is_one_line_exit_2(tmp_path: Path, capsys) -> None:
    (tmp_path / "plain").write_text("not a folder")
    code = main(["ingest", str(trace_path(TRACE)), "--quiet", "--out", str(tmp_path / "plain" / "t.jsonl")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "is not a directory" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain"]


def test_ingest_folders_below_a_file_name_the_file_in_one_line(tmp_path: Path, capsys) -> None:
    (tmp_path / "plain").write_text("not a folder")
    code = main(["ingest", str(trace_path(TRACE)), "--quiet", "--out", str(tmp_path / "plain" / "runs" / "t.jsonl")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and f"{tmp_path / 'plain'} is not a directory" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain"]


@pytest.mark.parametrize("where", ["a file", "below a file"])
def test_ingest_parquet_folder_that_cannot_be_one_is_one_line_and_no_output(tmp_path: Path, capsys, where: str) -> None:
    (tmp_path / "plain").write_text("not a folder")
    folder, problem = {"a file": (tmp_path / "plain", "is a file, not a directory"),
                       "below a file": (tmp_path / "plain" / "pq", f"{tmp_path / 'plain'} is not a directory")}[where]
    code = main(["ingest", str(trace_path(TRACE)), "--quiet", "--out", str(tmp_path / "t.jsonl"), "--parquet", str(folder)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"plasmient: error: cannot write {folder}: {problem}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain"]


@pytest.mark.parametrize("below", [("t.jsonl",), ("runs", "t.jsonl")])
def test_live_file_below_a_file_says_which_path_is_not_a_folder(tmp_path: Path, below: tuple[str, ...]) -> None:
    # mkdir under a regular file fails with "File exists" or "Not a directory": neither says what to fix
    (tmp_path / "plain").write_text("not a folder")
    out = tmp_path.joinpath("plain", *below)
    with pytest.raises(OutputError) as failed:
        FileSink(out, append=True).write(small_batch())
    assert str(failed.value) == f"{out}: {tmp_path / 'plain'} is not a directory"
    assert (tmp_path / "plain").read_text() == "not a folder"


def test_a_whole_file_output_that_fails_mid_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    out.write_text("the previous report")

    def half_then_disk_full(f) -> None:
        f.write(b"<html>half a page")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OutputError) as failed:
        write_output_file(out, half_then_disk_full)
    assert str(failed.value) == f"{out}: {os.strerror(errno.ENOSPC)}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"] and out.read_text() == "the previous report"
    write_output_file(out, lambda f: f.write(b"the new report"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"] and out.read_text() == "the new report"


def _other_file_system_than(path: Path) -> Path | None:
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shm.stat().st_dev != path.stat().st_dev:
        return shm
    return None


@pytest.mark.parametrize("target_on", ["the same file system", "another file system"])
def test_a_whole_file_output_through_a_symlink_replaces_the_file_it_names(tmp_path: Path, target_on: str) -> None:
    # the temporary file goes beside the target, not the link: a rename cannot cross file systems
    if target_on == "the same file system":
        folder = tmp_path / "data"
    else:
        other = _other_file_system_than(tmp_path)
        if other is None:
            pytest.skip("no writable /dev/shm on another file system here")
        folder = Path(tempfile.mkdtemp(dir=other))
    try:
        folder.mkdir(exist_ok=True)
        target = folder / "report.html"
        target.write_text("the previous report")
        link = tmp_path / "report.html"
        link.symlink_to(target)
        write_output_file(link, lambda f: f.write(b"the new report"))
        assert link.is_symlink() and os.readlink(link) == str(target) and target.read_text() == "the new report"
        assert sorted(p.name for p in folder.iterdir()) == ["report.html"]
    finally:
        if target_on != "the same file system":
            shutil.rmtree(folder, ignore_errors=True)


def test_the_output_file_has_the_mode_any_new_file_gets(tmp_path: Path) -> None:
    # written beside its final name and renamed into place, it must not keep the temp file's private 0600
    out = tmp_path / "t.jsonl"
    assert main(["ingest", str(trace_path(TRACE)), "--quiet", "--out", str(out)]) == 0
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask


def test_an_output_named_gz_is_gzip_and_every_reader_takes_it(tmp_path: Path, capsys) -> None:
    # it used to be plain JSON lines under a .gz name, which `plasmient report` then refused as "not gzipped"
    import gzip

    trace = str(trace_path("h100/vit_image_classification.json.gz"))
    plain, packed = tmp_path / "spans.jsonl", tmp_path / "spans.jsonl.gz"
    assert main(["ingest", trace, "--job-id", "j", "--out", str(plain), "--quiet"]) == 0
    assert main(["ingest", trace, "--job-id", "j", "--out", str(packed), "--quiet"]) == 0
    assert packed.read_bytes()[:2] == b"\x1f\x8b" and gzip.decompress(packed.read_bytes()) == plain.read_bytes()
    assert packed.stat().st_size * 5 < plain.stat().st_size
    # live: every line its own gzip member, so processes appending to one file still never interleave
    live = FileSink(tmp_path / "live.jsonl.gz", append=True)
    live.write(small_batch())
    live.write(small_batch())
    text = gzip.decompress((tmp_path / "live.jsonl.gz").read_bytes()).splitlines()
    assert len(text) == live.lines and all(line.startswith(b'{"resourceSpans"') for line in text)
    assert len(read_jsonl(tmp_path / "live.jsonl.gz")) == 2 * len(small_batch())
    # read by their bytes, not their names: plain lines under a .gz name from an older run still read
    (tmp_path / "old.jsonl.gz").write_bytes(plain.read_bytes())
    assert read_jsonl(tmp_path / "old.jsonl.gz").table.equals(read_jsonl(packed).table)
    assert main(["report", str(packed), "--quiet"]) == 0


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_credentials_in_the_endpoint_url_are_sent_as_basic_auth_and_never_printed(protocol: str) -> None:
    # over gRPC the target kept them ("Misformatted domain name": no export ever), over HTTP they were dropped
    # without a word and the collector answered 401
    import base64

    with OtlpReceiver() as rx:
        base = rx.grpc_endpoint if protocol == "grpc" else rx.http_endpoint
        endpoint = base.replace("://", "://alice:pa%3A55-hunter2@")
        stats = send_spans(small_batch(), OtlpConfig.from_env({}, endpoint=endpoint, protocol=protocol, timeout_s=10))
        assert stats.spans == len(small_batch())
        assert rx.received and all(r.headers["authorization"] == "Basic " + base64.b64encode(b"alice:pa:55-hunter2").decode()
                                   for r in rx.received)
        # a header the user set wins
        rx.clear()
        send_spans(small_batch(), OtlpConfig.from_env({"OTEL_EXPORTER_OTLP_HEADERS": "Authorization=Bearer t0ken"},
                                                     endpoint=endpoint, protocol=protocol, timeout_s=10))
        assert rx.received and all(r.headers["authorization"] == "Bearer t0ken" for r in rx.received)
    config = OtlpConfig.from_env({}, endpoint=endpoint, protocol=protocol)
    basic = base64.b64encode(b"alice:pa:55-hunter2").decode()
    assert "hunter2" not in otlp.redact(f"failed at {endpoint} with {basic}", config)
    assert basic not in otlp.redact(f"failed at {endpoint} with {basic}", config)


@pytest.mark.parametrize("protocol", ["http/protobuf", "http/json"])
def test_a_batch_that_fails_part_way_spills_only_the_traces_the_collector_did_not_take(tmp_path: Path, protocol) -> None:
    # The whole batch was spilled when its third request failed: the two traces the collector had already
    # taken came twice after `plasmient replay` (an audit saw 30 of 300 traces twice, 4,199 of 18,171 spans).
    import orjson

    batch = small_batch()
    with OtlpReceiver() as rx:
        answered = []
        refuse = _Failure(1 << 30, grpc.StatusCode.INVALID_ARGUMENT, 400, None)   # permanent: no retry

        def first_two_then_refuse():
            answered.append(1)
            return None if len(answered) <= 2 else refuse

        rx._take_failure = first_two_then_refuse
        sink = OtlpSink(OtlpConfig.from_env({}, endpoint=rx.http_endpoint, protocol=protocol))
        delivery = Delivery([], [sink], SpillDir(tmp_path / "spill"), probe_interval_s=0, say=lambda k, m: None)
        delivery.submit(batch)
        stats = delivery.shutdown(60)
        taken = {span.trace_id for request in rx.traces for rs in request.resource_spans
                 for ss in rs.scope_spans for span in ss.spans}
    spilled = {bytes.fromhex(span["traceId"]) for line in (tmp_path / "spill" / "traces.jsonl").read_bytes().splitlines()
               for rs in orjson.loads(line)["resourceSpans"] for ss in rs["scopeSpans"] for span in ss["spans"]}
    every = set(batch.table.column("trace_id").to_pylist())
    assert len(taken) == 2 and taken | spilled == every and not taken & spilled
    assert stats.spilled["traces"] + stats.sent["traces"] == len(batch)
    assert stats.requests["traces"] == 2  # the two that went through (it said 0)


def test_the_loss_at_exit_counts_trace_spans_once_and_names_the_metrics_apart(monkeypatch, capsys) -> None:
    # A full spill dropped 2,264 trace spans and the metrics of 3,491: the line said "5755 span(s) could not be
    # delivered nor spilled", more than the 3,491 spans the job made (a metrics line holds its trace's spans).
    from plasmient_trace.capture import config as config_mod
    from plasmient_trace.export.delivery import DeliveryStats

    monkeypatch.setattr(config_mod, "_said", set())
    config_mod.report_delivery(DeliveryStats(dropped={"metrics": 3491, "traces": 2264}))
    (line,) = capsys.readouterr().err.splitlines()
    assert line.endswith("2264 span(s) of traces and the step metrics of 3491 span(s) could not be delivered nor spilled")


def test_a_live_line_a_full_disk_cut_short_leaves_every_other_trace_readable(tmp_path: Path, nearly_full_disk) -> None:
    """Live, the file grows a line per trace. A write the disk could hold only part of left that part without
    its newline and the job went on; once the disk had room again the next trace's line was glued to it, and
    `plasmient report` refused the whole file ("t.jsonl:1: not valid JSON"), every trace in it lost, not the
    one cut short."""
    path = tmp_path / "t.jsonl"
    sink = FileSink(path, append=True)
    disk = nearly_full_disk(600)
    with pytest.raises(OutputError, match="short write"):
        sink.write(small_batch())  # the first trace's line is cut at 600 bytes
    disk.full = False  # another job's checkpoint is removed
    sink.write(small_batch())
    notes: list[str] = []
    whole = read_jsonl(path, notes=notes)
    assert notes == [f"{path}:1: cut short (a write that failed, e.g. on a full disk): left out"]
    assert sorted(set(whole.table.column("trace_id").to_pylist())) == sorted(set(small_batch().table.column("trace_id").to_pylist()))
    assert main(["report", str(path)]) == 0
