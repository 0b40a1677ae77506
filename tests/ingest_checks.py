"""Helpers for the ingest tests: run `plasmient ingest` in-process, read back its spans, list every span whose
numbers are out of range, and compare two ingests of one input span for span."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa

from plasmient_trace.cli import main

# Attributes that are fractions of a device window, and those that are amounts: their legal ranges.
FRACTIONS = ("plasmient.util.resident", "plasmient.mfu", "plasmient.stall_fraction", "plasmient.idle_fraction")
AMOUNTS = ("plasmient.wall_s", "plasmient.busy_s", "plasmient.ideal_s", "plasmient.flops", "plasmient.bytes",
           "plasmient.cost.usd", "plasmient.cost.wasted_usd", "plasmient.wasted_s", "plasmient.kernels")


def write_trace(path: Path, doc: Any) -> Path:
    path.write_bytes(json.dumps(doc).encode())
    return path


def ingest(path: Path, out: Path, capsys: Any, *extra: str) -> tuple[int, str]:
    """(exit status, stderr) of `plasmient ingest PATH --out OUT --quiet`, run in this process."""
    code = main(["ingest", str(path), "--out", str(out), "--quiet", "--job-id", "hostile", *extra])
    return code, capsys.readouterr().err.strip()


def spans(jsonl: Path) -> list[dict[str, Any]]:
    """Every span of an OTLP/JSON lines file as {name, start, end, attribute: value}."""
    out = []
    for line in jsonl.read_bytes().splitlines():
        for rs in orjson.loads(line)["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                for sp in ss["spans"]:
                    attrs = {a["key"]: next(iter(a["value"].values())) for a in sp["attributes"]}
                    attrs.update(name=sp["name"], start=int(sp["startTimeUnixNano"]), end=int(sp["endTimeUnixNano"]))
                    out.append(attrs)
    return out


def out_of_range(all_spans: list[dict[str, Any]]) -> list[str]:
    """One line per violated rule; empty when every number is in range."""
    bad = []
    for s in all_spans:
        if s["end"] < s["start"]:
            bad.append(f"{s['name']}: ends before it starts")
        for key in FRACTIONS:
            if key in s and not 0.0 <= float(s[key]) <= 1.0 + 1e-9:
                bad.append(f"{s['name']}: {key} = {s[key]}")
        for key in AMOUNTS:
            if key in s and not float(s[key]) >= 0.0:
                bad.append(f"{s['name']}: {key} = {s[key]}")
    return bad


def by_level(all_spans: list[dict[str, Any]], level: str) -> list[dict[str, Any]]:
    return [s for s in all_spans if s["plasmient.level"] == level]


def rows_by_id(batch: Any) -> pa.Table:
    """A span table sorted by (trace id, span id), each row's resource written out in place of its index."""
    table = batch.table
    resources = [json.dumps(r, sort_keys=True) for r in batch.resources]
    table = table.append_column("resource", pa.array([resources[i] for i in table.column("resource_index").to_pylist()]))
    return table.drop_columns(["resource_index"]).sort_by([("trace_id", "ascending"), ("span_id", "ascending")])


def assert_same_trace(got: Any, want: Any) -> None:
    """Two IngestResults hold the same spans (ids, attributes, resources), summaries and counts."""
    g, w = rows_by_id(got.batch), rows_by_id(want.batch)
    assert g.num_rows == w.num_rows and g.schema == w.schema
    for name in w.column_names:
        assert g.column(name).equals(w.column(name)), name
    assert [s.to_json() for s in got.summaries] == [s.to_json() for s in want.summaries]
    for key in ("ranks", "traces", "spans", "kernels", "kernels_folded", "clock_offsets_ns", "clock_alignment",
                "unknown_devices"):
        assert got.stats.get(key) == want.stats.get(key), key
