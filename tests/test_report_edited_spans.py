"""`plasmient report` of span files that a real ingest wrote and the test then edited (attributes or levels
removed, as a user's pipeline may): every number and reason the report prints must follow from what is left."""

from __future__ import annotations

import json
import re

import pytest

from conftest import trace_path


def _edited_report(tmp_path, capsys, name: str, edit) -> tuple[str, list[dict]]:
    """`plasmient report` of the span file a real ingest of ``name`` wrote, after ``edit(attributes)`` ran on each
    span's attribute list (as a user's pipeline may drop or rewrite attributes); its text, and the edited
    spans' attributes (what the report had to go on)."""
    from plasmient_trace.cli import main

    out, edited = tmp_path / "spans.jsonl", tmp_path / "edited.jsonl"
    assert main(["ingest", str(trace_path(name)), "--job-id", "edited", "--out", str(out), "--quiet"]) == 0
    seen = []
    with open(out) as src, open(edited, "w") as dst:
        for line in src:
            doc = json.loads(line)
            for rs in doc["resourceSpans"]:
                for ss in rs["scopeSpans"]:
                    for span in ss["spans"]:
                        span["attributes"] = edit(span["attributes"])
                        seen.append({a["key"]: next(iter(a["value"].values())) for a in span["attributes"]})
            dst.write(json.dumps(doc) + "\n")
    capsys.readouterr()
    assert main(["report", str(edited)]) == 0
    return " ".join(capsys.readouterr().out.split()), seen  # the summary is the command's stdout


def _without(*keys):
    return lambda attrs: [a for a in attrs if a["key"] not in keys]


MFU_KEYS = ("plasmient.mfu", "plasmient.hfu")
PEAK_KEYS = ("plasmient.peak_flops", "plasmient.peak.source", "plasmient.peak_bandwidth")


def test_the_reason_mfu_is_unknown_is_one_the_spans_show_or_says_it_is_not_recorded(tmp_path, capsys):
    """`report` says why MFU is n/a from the spans' own numbers. On a span file whose MFU was removed while its
    FLOPs and peak are there (or whose peak attributes went too), it blamed "the GPU's peak FLOP/s is unknown",
    a cause nothing in the file shows. Each reason is now checked against the edited spans: the peak is blamed
    only where a rank span says its peak's source is unknown, and otherwise the report says the reason is not
    recorded."""
    name = "h100/bert_small_inference.json.gz"
    unknown_peak = "peak FLOP/s is unknown"
    not_recorded = "MFU n/a: the reason is not recorded in these spans"

    text, seen = _edited_report(tmp_path, capsys, name, _without(*MFU_KEYS))
    steps = [s for s in seen if s["plasmient.level"] == "step"]
    assert steps and all(float(s["plasmient.flops"]) > 0 and float(s["plasmient.peak_flops"]) > 0 for s in steps)
    assert unknown_peak not in text and not_recorded in text

    text, seen = _edited_report(tmp_path, capsys, name, _without(*MFU_KEYS, *PEAK_KEYS))
    assert not any(k in s for s in seen for k in PEAK_KEYS + MFU_KEYS)
    assert unknown_peak not in text and not_recorded in text

    def peak_said_unknown(attrs):  # what an ingest of an unknown device writes
        attrs = _without(*MFU_KEYS, "plasmient.peak_flops", "plasmient.peak_bandwidth")(attrs)
        return [{"key": a["key"], "value": {"stringValue": "unknown"}} if a["key"] == "plasmient.peak.source" else a
                for a in attrs]

    text, seen = _edited_report(tmp_path, capsys, name, peak_said_unknown)
    assert [s["plasmient.peak.source"] for s in seen if s["plasmient.level"] == "rank"] == ["unknown"] * len(steps)
    assert "MFU n/a: the GPU's peak FLOP/s is unknown" in text and not_recorded not in text

    def nothing_carried(attrs):  # what a live step-depth step with no full-depth step to carry from writes
        attrs = _without(*MFU_KEYS, "plasmient.flops", "plasmient.flops.coverage", "plasmient.ideal_s")(attrs)
        return [{"key": a["key"], "value": {"stringValue": "unknown"}} if a["key"] == "plasmient.flops.source" else a
                for a in attrs]

    text, seen = _edited_report(tmp_path, capsys, name, nothing_carried)
    assert [s["plasmient.flops.source"] for s in seen if s["plasmient.level"] == "step"] == ["unknown"] * len(steps)
    assert "MFU n/a: these steps ran at step depth with no full-depth step" in text
    assert unknown_peak not in text and not_recorded not in text


def _spans_of(path) -> list[dict]:
    """Each span's attributes (integers as int: device.start_ns is an epoch nanosecond), with its level."""
    def value(v):
        return int(v["intValue"]) if "intValue" in v else next(iter(v.values()))

    return [{a["key"]: value(a["value"]) for a in span["attributes"]} | {"_start": int(span["startTimeUnixNano"]),
                                                                         "_end": int(span["endTimeUnixNano"])}
            for line in open(path) for rs in json.loads(line)["resourceSpans"] for ss in rs["scopeSpans"]
            for span in ss["spans"]]


def test_without_fleet_spans_the_window_column_is_the_extent_of_the_ranks_device_windows(tmp_path, capsys):
    """The steps table's "window" is the device window the step's util and MFU divide by: a step's, a rank's
    (its step's), and for a node or fleet the extent of its ranks' windows (README, device windows). A span
    file without fleet and node spans (dropped by a pipeline, or a collector that kept some levels) got, for
    several ranks, the extent of the rank spans as drawn (their CPU intervals): 608.10 ms for a100_multirank's
    step 551, whose ranks' device windows span 603.76 ms. The oracle: the ranks' device.start_ns and window_s
    in the file, and the fleet span of the unedited file, which must say the same."""
    from plasmient_trace.cli import main
    from plasmient_trace.report.summary import fmt_seconds

    ranks = [trace_path(f"a100_multirank/rank-{i}.json.gz") for i in (0, 1)]
    out, edited = tmp_path / "spans.jsonl", tmp_path / "no-fleet.jsonl"
    assert main(["ingest", *map(str, ranks), "--job-id", "w", "--out", str(out), "--quiet"]) == 0
    fleet = {s["plasmient.step"]: s["plasmient.device.window_s"] for s in _spans_of(out)
             if s["plasmient.level"] == "fleet"}
    with open(out) as src, open(edited, "w") as dst:
        for line in src:
            doc = json.loads(line)
            for rs in doc["resourceSpans"]:
                for ss in rs["scopeSpans"]:
                    ss["spans"] = [s for s in ss["spans"] if not any(
                        a["key"] == "plasmient.level" and a["value"]["stringValue"] in ("fleet", "node")
                        for a in s["attributes"])]
            dst.write(json.dumps(doc) + "\n")
    rank_spans = [s for s in _spans_of(edited) if s["plasmient.level"] == "rank"]
    assert not [s for s in _spans_of(edited) if s["plasmient.level"] in ("fleet", "node")]
    expected, drawn = {}, {}
    for step in sorted(fleet):
        mine = [s for s in rank_spans if s["plasmient.step"] == step]
        assert len(mine) == 2
        ends = [s["plasmient.device.start_ns"] + round(s["plasmient.device.window_s"] * 1e9) for s in mine]
        expected[step] = (max(ends) - min(s["plasmient.device.start_ns"] for s in mine)) / 1e9
        drawn[step] = (max(s["_end"] for s in mine) - min(s["_start"] for s in mine)) / 1e9
        assert expected[step] == pytest.approx(fleet[step], abs=1e-9)
        assert fmt_seconds(drawn[step]) != fmt_seconds(expected[step])  # the two differ as printed
    capsys.readouterr()
    assert main(["report", str(edited)]) == 0
    text = capsys.readouterr().out
    for step, window in expected.items():
        (row,) = [line for line in text.splitlines() if re.match(rf"│\s+{step} │", line)]
        assert row.split("│")[3].strip() == fmt_seconds(window), (row, fmt_seconds(drawn[step]))
