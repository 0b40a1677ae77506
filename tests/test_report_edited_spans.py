"""`plasmient report` of span files that a real ingest wrote and the test then edited (attributes or levels
removed, as a user's pipeline may): every number and reason the report prints must follow from what is left."""

from __future__ import annotations

import json

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
    return " ".join(capsys.readouterr().err.split()), seen  # the report is drawn on stderr


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
