"""Integration with Arize Phoenix, a real traces-only backend: `plasmient ingest` of a real trace over
OTLP (gRPC and HTTP) arrives whole, as Phoenix's REST API lists it: every span, parents that
resolve, attribute types kept; the step metrics Phoenix cannot take cost one line and exit 0;
`--rebase-time` puts an old recording inside Phoenix's "last 7 days", and without it the trace is
found by the id `plasmient link` prints.

Phoenix is never installed into the shared venv. Install it in a throwaway one and point the test at it:

    python3 -m venv /tmp/phoenix && /tmp/phoenix/bin/pip install arize-phoenix
    PLASMIENT_PHOENIX=/tmp/phoenix/bin/phoenix pytest tests/test_phoenix.py

Without it (or a `phoenix` on PATH) the tests are skipped, saying so.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import orjson
import pytest

from conftest import trace_path

from plasmient_trace.cli import main
from plasmient_trace.pipeline import IngestOptions, ingest_paths

TRACE = "h100/bert_small_inference.json.gz"  # one step, 628 spans, recorded in 2025


def _phoenix_bin() -> str | None:
    given = os.environ.get("PLASMIENT_PHOENIX")
    if given:
        return given if os.access(given, os.X_OK) else None
    return shutil.which("phoenix")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as resp:  # noqa: S310 - a local test server
        return orjson.loads(resp.read())


@pytest.fixture(scope="module")
def phoenix(tmp_path_factory):
    binary = _phoenix_bin()
    if binary is None:
        pytest.skip("Arize Phoenix is not installed: `python3 -m venv /tmp/phoenix && /tmp/phoenix/bin/pip install "
                    "arize-phoenix`, then set PLASMIENT_PHOENIX=/tmp/phoenix/bin/phoenix (never the shared venv)")
    work = tmp_path_factory.mktemp("phoenix")
    http_port, grpc_port = _free_port(), _free_port()
    env = dict(os.environ, PHOENIX_WORKING_DIR=str(work), PHOENIX_PORT=str(http_port), PHOENIX_GRPC_PORT=str(grpc_port),
               PHOENIX_HOST="127.0.0.1")
    log = open(work / "phoenix.log", "wb")  # noqa: SIM115 - closed at teardown
    proc = subprocess.Popen([binary, "serve"], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=work)
    base = f"http://127.0.0.1:{http_port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            _get(f"{base}/v1/projects")
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                tail = (work / "phoenix.log").read_bytes()[-2000:].decode("utf-8", "replace")
                pytest.fail(f"Phoenix ({binary}) did not start: {tail}")
            time.sleep(1)
    yield {"http": base, "grpc": f"http://127.0.0.1:{grpc_port}"}
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def _spans(base: str, project: str, expected: int, **query: str) -> list[dict]:
    """Every span of the project as the REST API lists it, once Phoenix's batched insert settled."""
    deadline = time.monotonic() + 120
    while True:
        spans, cursor = [], None
        while True:
            params = {"limit": "1000", **query, **({"cursor": cursor} if cursor else {})}
            try:
                page = _get(f"{base}/v1/projects/{urllib.parse.quote(project)}/spans?{urllib.parse.urlencode(params)}")
            except urllib.error.HTTPError as err:
                if err.code != 404:  # 404: the project appears with its first inserted span
                    raise
                page = {"data": []}
            spans += page["data"]
            cursor = page.get("next_cursor")
            if not cursor:
                break
        if len(spans) >= expected or time.monotonic() > deadline:
            return spans
        time.sleep(1)


def _ingest(endpoint: str, protocol: str, project: str, tmp_path: Path, monkeypatch, *extra: str) -> int:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    # Phoenix files spans under the project their resource names.
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", f"openinference.project.name={project}")
    # Phoenix keeps one span per span id across projects, and span ids derive from the job id: one job per project.
    return main(["ingest", str(trace_path(TRACE)), "--job-id", project, "--quiet", *extra])


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_phoenix_lists_every_span_with_its_parent_and_typed_attributes(phoenix, protocol, tmp_path, monkeypatch, capsys) -> None:
    project = f"plasmient-{protocol.replace('/', '-')}"
    endpoint = phoenix["grpc"] if protocol == "grpc" else phoenix["http"]
    code = _ingest(endpoint, protocol, project, tmp_path, monkeypatch)
    err = capsys.readouterr().err
    assert code == 0, err
    # Phoenix takes no metrics: one line saying so and how to stop it.
    assert err.count("takes no metrics") == 1 and "OTEL_METRICS_EXPORTER=none" in err
    expected = ingest_paths([trace_path(TRACE)], IngestOptions(job_id=project)).batch.table
    spans = _spans(phoenix["http"], project, expected.num_rows)
    assert len(spans) == expected.num_rows == 628
    got = {s["context"]["span_id"]: s for s in spans}
    rows = {f"{r['span_id']:016x}": r for r in expected.select(
        ["span_id", "parent_span_id", "trace_id", "name", "plasmient.level", "plasmient.step", "plasmient.mfu"]).to_pylist()}
    assert set(got) == set(rows)
    for sid, row in rows.items():
        span = got[sid]
        assert span["name"] == row["name"] and span["context"]["trace_id"] == row["trace_id"].hex()
        assert span["parent_id"] == (f"{row['parent_span_id']:016x}" if row["parent_span_id"] else None)
        attrs = span["attributes"]
        assert attrs["plasmient.level"] == row["plasmient.level"]
        assert type(attrs["plasmient.step"]) is int and attrs["plasmient.step"] == row["plasmient.step"]
        if row["plasmient.mfu"] is not None:
            assert type(attrs["plasmient.mfu"]) is float and attrs["plasmient.mfu"] == pytest.approx(row["plasmient.mfu"])
    roots = [s for s in spans if s["parent_id"] is None]
    assert len(roots) == 1 and roots[0]["attributes"]["plasmient.level"] == "fleet"


def test_rebase_time_puts_an_old_recording_in_phoenixs_last_7_days(phoenix, tmp_path, monkeypatch, capsys) -> None:
    week_ago = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=7)).isoformat()
    for project, extra in (("plasmient-as-recorded", ()), ("plasmient-rebased", ("--rebase-time",))):
        monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
        assert _ingest(phoenix["http"], "http/protobuf", project, tmp_path, monkeypatch, *extra) == 0
    assert "takes no metrics" not in capsys.readouterr().err  # OTEL_METRICS_EXPORTER=none: not even tried
    assert len(_spans(phoenix["http"], "plasmient-as-recorded", 628)) == 628
    assert _spans(phoenix["http"], "plasmient-as-recorded", 0, start_time=week_ago) == []  # all 628 are in: no wait
    assert len(_spans(phoenix["http"], "plasmient-rebased", 628, start_time=week_ago)) == 628
    # Without rebasing, the trace is found by the id `plasmient link` prints (step 6 of this recording).
    assert main(["link", "--job-id", "plasmient-as-recorded", "--step", "6"]) == 0
    trace_id = capsys.readouterr().out.strip()
    assert len(_spans(phoenix["http"], "plasmient-as-recorded", 628, trace_id=trace_id)) == 628
