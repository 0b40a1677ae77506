"""Trace links: Jaeger trace page and Grafana Explore with a Tempo query (plasmient_trace.export.links)."""

from __future__ import annotations

import json
import subprocess
import sys
from urllib.parse import parse_qs, urlsplit

import pytest

from plasmient_trace.export.links import jaeger_link, tempo_link
from plasmient_trace.stitch import ids

TRACE = ids.trace_id("job-42", 7).hex()


def test_jaeger_link_is_the_trace_page() -> None:
    assert jaeger_link("http://localhost:16686/", TRACE) == f"http://localhost:16686/trace/{TRACE}"
    assert jaeger_link("https://jaeger.example/ui", TRACE.upper()) == f"https://jaeger.example/ui/trace/{TRACE}"


def test_tempo_link_opens_explore_with_a_trace_id_query() -> None:
    url = tempo_link("http://localhost:3000/", TRACE, datasource="tempo-uid", org_id=3)
    parts = urlsplit(url)
    assert (parts.scheme, parts.netloc, parts.path) == ("http", "localhost:3000", "/explore")
    query = parse_qs(parts.query, strict_parsing=True)
    assert query["schemaVersion"] == ["1"] and query["orgId"] == ["3"]
    panes = json.loads(query["panes"][0])
    (pane,) = panes.values()
    assert pane["datasource"] == "tempo-uid"
    (q,) = pane["queries"]
    assert q["datasource"] == {"type": "tempo", "uid": "tempo-uid"}
    assert q["queryType"] == "traceql" and q["query"] == TRACE
    assert set(pane["range"]) == {"from", "to"}
    # Every reserved character of the JSON is percent-encoded: the URL survives copy/paste and chat tools.
    assert not set(parts.query) & set('{}"[] ')


def test_tempo_link_keeps_a_grafana_sub_path() -> None:
    url = tempo_link("https://example.org/grafana", TRACE)
    assert url.startswith("https://example.org/grafana/explore?schemaVersion=1&panes=")


@pytest.mark.parametrize("bad", ["", "abc", "z" * 32, TRACE + "00"])
def test_a_bad_trace_id_is_rejected(bad: str) -> None:
    with pytest.raises(ValueError):
        tempo_link("http://localhost:3000", bad)
    with pytest.raises(ValueError):
        jaeger_link("http://localhost:16686", bad)


def test_a_url_without_scheme_is_rejected() -> None:
    with pytest.raises(ValueError):
        jaeger_link("localhost:16686", TRACE)


def test_cli_link_prints_the_tempo_link_of_the_step() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "plasmient_trace.cli", "link", "--job-id", "job-42", "--step", "7",
         "--tempo", "http://localhost:3000"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout.strip()
    assert out == tempo_link("http://localhost:3000", TRACE)


@pytest.mark.parametrize("flag", ["--jaeger", "--tempo"])
def test_cli_link_to_a_url_without_scheme_is_one_line_and_exit_2(flag: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "plasmient_trace.cli", "link", "--job-id", "job-42", "--step", "7",
                           flag, "localhost:16686"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == ["plasmient link: error: expected an http(s) URL, got 'localhost:16686'"]


def test_cli_link_prints_every_link_asked_for_each_on_its_line() -> None:
    # with --jaeger and --tempo, the Tempo link was dropped without a word
    out = subprocess.run([sys.executable, "-m", "plasmient_trace.cli", "link", "--job-id", "job-42", "--step", "7",
                          "--jaeger", "http://localhost:16686", "--tempo", "http://localhost:3000"],
                         capture_output=True, text=True, check=True, timeout=60).stdout.splitlines()
    assert out == [jaeger_link("http://localhost:16686", TRACE), tempo_link("http://localhost:3000", TRACE)]


@pytest.mark.parametrize("step", ["-1", "seven", "9007199254740993"])
def test_cli_link_to_a_step_no_trace_can_have_is_one_line_and_exit_2(step: str) -> None:
    # --step -1 printed the id of a trace that no ingest or live run ever writes
    proc = subprocess.run([sys.executable, "-m", "plasmient_trace.cli", "link", "--job-id", "job-42", "--step", step],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines()[-1].startswith("plasmient link: error: argument --step: ")
