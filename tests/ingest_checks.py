"""Helpers for the hostile-input and fuzz tests: run `plasmient ingest` in-process, read back its spans,
and list every span whose numbers are out of range."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson

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
