"""End to end: `plasmient ingest` of a real trace, over real OTLP (gRPC and HTTP) to a receiver on
127.0.0.1, into the embedded-default JSONL file, and into Parquet; what arrived is parsed and compared."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import orjson
import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from conftest import ingested, trace_path
from otlp_receiver import OtlpReceiver

from plasmient_trace.cli import main
from plasmient_trace.export import otlp_json
from plasmient_trace.pipeline import IngestOptions, ingest_paths

TRACE = "h100/bert_small_inference.json.gz"
MULTI = "a100/nccl_training_rank0_of2.json.gz"


def _arrived(receiver: OtlpReceiver) -> dict[tuple[str, str], dict]:
    spans = {}
    for request in receiver.traces:
        for rs in request.resource_spans:
            res = {kv.key: kv.value for kv in rs.resource.attributes}
            for ss in rs.scope_spans:
                for span in ss.spans:
                    attrs = {kv.key: json_format.MessageToDict(kv.value) for kv in span.attributes}
                    spans[(span.trace_id.hex(), span.span_id.hex())] = {"name": span.name, "attrs": attrs, "resource": res,
                                                                      "parent": span.parent_span_id.hex(),
                                                                      "start": span.start_time_unix_nano}
    return spans


def _expected(name: str) -> dict[tuple[str, str], dict]:
    table = ingested(name).batch.table
    out = {}
    for row in table.select(["trace_id", "span_id", "parent_span_id", "name", "start_ns", "plasmient.level", "plasmient.mfu"]).to_pylist():
        out[(row["trace_id"].hex(), f"{row['span_id']:016x}")] = row
    return out


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf", "http/json"])
def test_ingest_sends_every_span_over_real_otlp(protocol, tmp_path, monkeypatch, capsys):
    with OtlpReceiver() as receiver:
        endpoint = receiver.grpc_endpoint if protocol == "grpc" else receiver.http_endpoint
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
        monkeypatch.chdir(tmp_path)
        code = main(["ingest", str(trace_path(MULTI)), "--job-id", "test-job", "--quiet"])
        assert code == 0, capsys.readouterr().err
        arrived = _arrived(receiver)
        expected = _expected(MULTI)
    assert set(arrived) == set(expected)
    for key, row in expected.items():
        got = arrived[key]
        assert got["name"] == row["name"]
        assert got["start"] == row["start_ns"]
        assert got["parent"] == (f"{row['parent_span_id']:016x}" if row["parent_span_id"] else "")
        assert got["attrs"]["plasmient.level"] == {"stringValue": row["plasmient.level"]}
        if row["plasmient.mfu"] is not None:
            assert got["attrs"]["plasmient.mfu"]["doubleValue"] == pytest.approx(row["plasmient.mfu"])
    assert not (tmp_path / "traces.jsonl").exists()  # an endpoint was configured: no file fallback
    # step metrics came too, and every exemplar names a trace that was sent
    trace_ids = {t for t, _ in expected}
    exemplar_traces = {ex.trace_id.hex() for req in receiver.metrics for rm in req.resource_metrics
                       for sm in rm.scope_metrics for m in sm.metrics
                       for dp in (list(m.gauge.data_points) + list(m.sum.data_points)) for ex in dp.exemplars}
    assert exemplar_traces and exemplar_traces <= trace_ids
    names = {m.name for req in receiver.metrics for rm in req.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    assert {"plasmient.step.util.resident", "plasmient.step.wasted_usd"} <= names
    # an MFU point where a step span has an MFU, none where it is unknown (this trace was recorded without
    # shapes: its steps' only known FLOPs are their collectives' zero, so their MFU is absent, not 0)
    has_mfu = any(r["plasmient.mfu"] is not None for r in expected.values() if r["plasmient.level"] in ("rank", "fleet"))
    assert ("plasmient.step.mfu" in names) == has_mfu


def test_collector_down_is_one_line_exit_1_and_the_spans_wait_in_the_spill_directory(tmp_path, monkeypatch, capsys):
    with OtlpReceiver() as receiver:
        dead = receiver.grpc_endpoint
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", dead)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "2000")
    code = main(["ingest", str(trace_path(TRACE)), "--job-id", "j", "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 1
    assert "Traceback" not in err and len(err.splitlines()) == 1
    assert dead.split("//")[1] in err and "plasmient replay" in err
    spilled = (tmp_path / "plasmient-spill" / "traces.jsonl").read_bytes().splitlines()
    expected = ingest_paths([trace_path(TRACE)], IngestOptions(job_id="j")).batch
    assert sum(len(otlp_json.batch_from_otlp_dicts([orjson.loads(line)])) for line in spilled) == len(expected)


def test_embedded_default_writes_collector_file_format(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
    proc = subprocess.run([sys.executable, "-m", "plasmient_trace.cli", "ingest", str(trace_path(TRACE)), "--job-id", "demo"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "traces.jsonl"
    assert out.exists() and "traces.jsonl" in proc.stderr
    lines = out.read_text().splitlines()
    assert len(lines) == 1  # one step in this trace -> one ExportTraceServiceRequest line
    request = json_format.Parse(lines[0], trace_service_pb2.ExportTraceServiceRequest())
    spans = [s for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert len(spans) == len(ingested(TRACE).batch)
    raw = json.loads(lines[0])
    first = raw["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert len(first["traceId"]) == 32 and all(c in "0123456789abcdef" for c in first["traceId"])
    # `plasmient link` prints the same trace id
    link = subprocess.run([sys.executable, "-m", "plasmient_trace.cli", "link", "--job-id", "demo", "--step", "6"],
                          capture_output=True, text=True, timeout=60)
    assert link.stdout.strip() == first["traceId"]
    # the terminal summary ran
    assert "MFU" in proc.stdout or "mfu" in proc.stdout.lower()


def test_out_dash_streams_the_spans_to_stdout_and_the_summary_elsewhere(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
    cmd = [sys.executable, "-m", "plasmient_trace.cli", "ingest", str(trace_path(TRACE)), "--job-id", "demo"]
    to_file = subprocess.run([*cmd, "--out", str(tmp_path / "file.jsonl"), "--quiet"], cwd=tmp_path, env=env,
                             capture_output=True, timeout=120)
    assert to_file.returncode == 0
    piped = subprocess.run([*cmd, "--out", "-"], cwd=tmp_path, env=env, capture_output=True, timeout=120)
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == (tmp_path / "file.jsonl").read_bytes()  # the spans alone, as the file holds them
    assert b"MFU" in piped.stderr and b"to /dev/stdout" in piped.stderr  # the summary went to stderr
    assert not (tmp_path / "-").exists()
    # `-` as the input reads stdin, gzip'd or not: `zcat trace.json.gz | plasmient ingest - --out -`
    for data in (trace_path(TRACE).read_bytes(), gzip.decompress(trace_path(TRACE).read_bytes())):
        both = subprocess.run([*cmd[:4], "-", *cmd[5:], "--out", "-", "--quiet"], input=data, cwd=tmp_path, env=env,
                              capture_output=True, timeout=120)
        assert both.returncode == 0, both.stderr
        (tmp_path / "stdin.jsonl").write_bytes(both.stdout)
        assert otlp_json.read_jsonl(tmp_path / "stdin.jsonl").table.equals(otlp_json.read_jsonl(tmp_path / "file.jsonl").table)
        assert b'"plasmient.source","value":{"stringValue":"/dev/stdin"}' in both.stdout  # where it came from
    # `>> all.jsonl`: appended where the shell's redirection points, not renamed over the file
    collected = tmp_path / "all.jsonl"
    collected.write_bytes(b'{"resourceSpans":[]}\n')
    with open(collected, "ab") as out:
        assert subprocess.run([*cmd, "--out", "-", "--quiet"], cwd=tmp_path, env=env, stdout=out, timeout=120).returncode == 0
    assert collected.read_bytes() == b'{"resourceSpans":[]}\n' + piped.stdout


def _into_a_closed_pipe(cmd: list[str], cwd) -> subprocess.CompletedProcess:
    """Run a command whose stdout is a pipe nobody reads any more, as `plasmient ... | head -1` leaves it
    once head has its line."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
        return subprocess.run(cmd, cwd=cwd, env=env, stdout=write_end, stderr=subprocess.PIPE, timeout=180)
    finally:
        os.close(write_end)


@pytest.mark.parametrize("command", ["ingest --out -", "ingest --out out.jsonl", "diff"])
def test_a_reader_that_stops_reading_ends_the_command_quietly_with_sigpipes_status(tmp_path, command):
    # `plasmient ingest t.json.gz --out - | head -1`, or `plasmient diff a b | head`: the reader took what
    # it wanted. Not an error line, and not exit 1, which diff uses for "MFU dropped" (rich's own handling
    # of a closed pipe): 141, as a shell reports for a program SIGPIPE ended.
    trace = str(trace_path(TRACE))
    cli = [sys.executable, "-m", "plasmient_trace.cli"]
    argv = {"ingest --out -": ["ingest", trace, "--out", "-"],
            "ingest --out out.jsonl": ["ingest", trace, "--out", "out.jsonl"],  # the summary on a closed stdout
            "diff": ["diff", trace, trace]}[command]
    proc = _into_a_closed_pipe([*cli, *argv], tmp_path)
    if command == "ingest --out out.jsonl":  # the spans were written before the summary found no reader
        spans = len(ingested(TRACE).batch)
        assert len(otlp_json.read_jsonl(tmp_path / "out.jsonl")) == spans
        assert (proc.returncode, proc.stderr) == (141, f"plasmient: wrote 1 trace(s), {spans} spans to out.jsonl\n".encode())
    else:
        assert (proc.returncode, proc.stderr) == (141, b"")


def test_parquet_holds_every_record_even_when_spans_are_folded(tmp_path, capsys):
    out = tmp_path / "pq"
    code = main(["ingest", str(trace_path(MULTI)), "--job-id", "p", "--out", str(tmp_path / "t.jsonl"),
                 "--parquet", str(out), "--max-spans", "500", "--quiet"])
    assert code == 0, capsys.readouterr().err
    records = ingested(MULTI).records[0]
    assert pq.read_table(out / "kernels.parquet").num_rows == records.kernels.num_rows
    assert pq.read_table(out / "ops.parquet").num_rows == records.ops.num_rows
    spans = pq.read_table(out / "spans.parquet")
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    exported = sum(len(s["spans"]) for line in lines for rs in json.loads(line)["resourceSpans"] for s in rs["scopeSpans"])
    assert spans.num_rows == exported
    assert exported < len(ingested(MULTI).batch)


def test_resource_comes_from_the_trace_and_on_request_from_the_environment(tmp_path, monkeypatch, capsys):
    from plasmient_trace.export.otlp_json import read_jsonl

    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test,team=ml")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("POD_NAME", "trainer-0")
    out = tmp_path / "t.jsonl"
    assert main(["ingest", str(trace_path(MULTI)), "--job-id", "r", "--out", str(out), "--quiet", "--resource-from-env"]) == 0
    batch = read_jsonl(out)
    rank_res = next(r for r in batch.resources if "plasmient.rank" in r)
    assert rank_res["deployment.environment"] == "test" and rank_res["team"] == "ml"
    assert rank_res["plasmient.slurm.job_id"] == "4242" and rank_res["k8s.pod.name"] == "trainer-0"
    assert rank_res["plasmient.rank"] == 0 and rank_res["plasmient.world_size"] == 2  # from distributedInfo
    assert rank_res["plasmient.job.id"] == "r"
    out2 = tmp_path / "plain.jsonl"
    assert main(["ingest", str(trace_path(MULTI)), "--job-id", "r", "--out", str(out2), "--quiet"]) == 0
    plain = next(r for r in read_jsonl(out2).resources if "plasmient.rank" in r)
    assert "k8s.pod.name" not in plain and plain["team"] == "ml"


@pytest.mark.parametrize("argv", [["ingest", "-", "--out", "o.jsonl"], ["report", "-"], ["diff", str(trace_path(TRACE)), "-"]])
def test_dash_on_a_terminal_is_refused_in_one_line_instead_of_waiting_for_typed_json(tmp_path, argv):
    # `plasmient report -` typed without the pipe: it read the terminal, waiting with nothing on the screen
    import pty

    leader, follower = pty.openpty()
    try:
        proc = subprocess.run([sys.executable, "-m", "plasmient_trace.cli", *argv], cwd=tmp_path, stdin=follower,
                              capture_output=True, timeout=120)
    finally:
        os.close(follower)
        os.close(leader)
    lines = proc.stderr.decode().strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "-: stdin is a terminal, not a file: pipe one in (" in lines[0], lines


@pytest.mark.parametrize("argv", [["ingest", "-", "-", "--out", "o.jsonl"], ["report", "-", "-"], ["diff", "-", "-"]])
def test_dash_twice_is_refused_in_one_line(tmp_path, argv):
    # stdin can be read once: the second '-' would get nothing, or (stdin a file) the same trace again
    with open(trace_path(TRACE), "rb") as stdin:
        proc = subprocess.run([sys.executable, "-m", "plasmient_trace.cli", *argv], cwd=tmp_path, stdin=stdin,
                              capture_output=True, timeout=120)
    lines = proc.stderr.decode().strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].endswith("-: given twice, but stdin can be read only once"), lines
