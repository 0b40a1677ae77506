"""Bad input never gives a traceback: one line naming the file and the problem, exit status 2."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import trace_path

from plasmient_trace.cli import main


def _real_gzip_bytes() -> bytes:
    return trace_path("h100/bert_small_inference.json.gz").read_bytes()


def _real_trace_text() -> str:
    return gzip.decompress(_real_gzip_bytes()).decode()


def _write(tmp: Path, name: str, data: bytes) -> Path:
    path = tmp / name
    path.write_bytes(data)
    return path


def _kernel_without_ts() -> bytes:
    doc = {"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "dur": 3, "args": {"correlation": 1}}]}
    return json.dumps(doc).encode()


def _dur_is_text() -> bytes:
    doc = {"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1.0, "dur": "long", "pid": 1, "tid": 1}]}
    return json.dumps(doc).encode()


def _dur_is_true() -> bytes:
    # JSON true was taken as a duration of 1 us (exit 0, nothing counted)
    doc = {"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1.0, "dur": True, "pid": 1, "tid": 1}]}
    return json.dumps(doc).encode()


def _bad_utf8_in_third_event() -> bytes:
    event = b'{"ph": "X", "cat": "cpu_op", "name": "%s", "ts": 1, "dur": 2, "pid": 1, "tid": 1}'
    return b'{"traceEvents": [' + b", ".join(event % name for name in (b"a", b"b", b"c\xff")) + b"]}"


BAD_INPUTS = {
    "plain text": (lambda: b"this is not a trace\n", "not JSON"),
    "truncated gzip": (lambda: _real_gzip_bytes()[: len(_real_gzip_bytes()) // 2], "truncated gzip"),
    "corrupt gzip": (lambda: _real_gzip_bytes()[:20] + b"\x00" * 200 + _real_gzip_bytes()[220:], "gzip"),
    "truncated json": (lambda: gzip.decompress(_real_gzip_bytes())[:5000], "invalid or truncated JSON"),
    "json but no traceEvents": (lambda: b'{"foo": 1, "bar": [1, 2]}', "no 'traceEvents'"),
    "json scalar": (lambda: b"42", "not a Chrome trace"),
    "traceEvents not a list": (lambda: b'{"traceEvents": {"a": 1}}', "expected a list"),
    "no events": (lambda: b'{"traceEvents": []}', "no events"),
    "empty file": (lambda: b"", "file is empty"),
    # a valid gzip of nothing was called "truncated": the file was whole
    "gzip of nothing": (lambda: gzip.compress(b""), "its gzip stream decompresses to nothing"),
    "gzip of blanks, twice": (lambda: gzip.compress(b"  \n") * 2, "its gzip stream decompresses to nothing"),
    "kernel without ts": (_kernel_without_ts, "missing field 'ts'"),
    "dur is text": (_dur_is_text, "unexpected field types"),
    "dur is true": (_dur_is_true, "got `bool` at dur"),
    "png image": (lambda: b"\x89PNG\r\n\x1a\n" + b"\x00" * 64, "not JSON"),
    # a real trace saved by a Windows tool as UTF-16 or UTF-32 was only "not JSON" or "malformed"
    "utf-16 with a byte order mark": (lambda: _real_trace_text().encode("utf-16"), "UTF-16 text, not UTF-8 JSON"),
    "utf-16le without one": (lambda: _real_trace_text().encode("utf-16-le"), "UTF-16 text, not UTF-8 JSON"),
    "utf-32be without one": (lambda: _real_trace_text().encode("utf-32-be"), "UTF-32 text, not UTF-8 JSON"),
    # the label named the event before the one that did not decode
    "invalid utf-8 in a later event": (_bad_utf8_in_third_event, "event #2: malformed event (Invalid UTF-8"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_gives_one_clear_line_and_exit_2(case, tmp_path, capsys):
    make, expected = BAD_INPUTS[case]
    path = _write(tmp_path, f"bad_{case.replace(' ', '_')}.json.gz", make())
    code = main(["ingest", str(path), "--out", str(tmp_path / "out.jsonl"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert str(path) in err and expected in err, err
    assert not (tmp_path / "out.jsonl").exists()


def test_missing_file_and_directory(tmp_path, capsys):
    assert main(["ingest", str(tmp_path / "nope.json.gz"), "--quiet"]) == 2
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "notes.txt").write_text("not a trace")
    assert main(["ingest", str(tmp_path), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"plasmient: error: {tmp_path}: a directory with no trace in it (no file ending in .json or .json.gz)"
    assert main(["ingest", "--quiet"]) == 2
    assert capsys.readouterr().err.startswith("plasmient: error: no trace given")
    # a rank whose trace is a dangling link is named, not skipped: the fleet would be stitched without it
    (tmp_path / "rank-0.json.gz").symlink_to(trace_path("h100/vit_image_classification.json.gz"))
    (tmp_path / "rank-1.json.gz").symlink_to(tmp_path / "gone.json.gz")
    assert main(["ingest", str(tmp_path), "--quiet", "--out", str(tmp_path / "out.jsonl")]) == 2
    assert capsys.readouterr().err.strip() == f"plasmient: error: {tmp_path / 'rank-1.json.gz'}: no such file"


@pytest.mark.parametrize("workers", ["1", "2"])
def test_one_trace_given_as_two_ranks_is_refused(workers, tmp_path, capsys):
    # overlapping shell globs, a link, a downloaded copy: stitched, one rank twice, every number doubled
    real = trace_path("h100/vit_image_classification.json.gz")
    link, copy = tmp_path / "link.json.gz", tmp_path / "copy.json.gz"
    link.symlink_to(real)
    copy.write_bytes(real.read_bytes())
    out = tmp_path / "out.jsonl"
    for twice, why in ([real, real], "one file given twice"), ([real, link], "one file given twice"), \
                      ([real, copy], "a byte-for-byte copy"):
        assert main(["ingest", *map(str, twice), "--quiet", "--workers", workers, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"plasmient: error: {twice[1]}: the same trace as {twice[0]} ({why}): each rank's trace once, "
                       "or its numbers count twice"]
        assert not out.exists()
    # two ranks of one job, of the same size or not, are two ranks
    ranks = [trace_path(f"a100_multirank/rank-{r}.json.gz") for r in (0, 1)]
    assert main(["ingest", *map(str, ranks), "--quiet", "--workers", workers, "--out", str(out)]) == 0
    # files of one size and one first MiB are read whole before they are called copies
    from plasmient_trace.sources.rawinput import repeated_input

    body = bytearray(os.urandom(3 << 20))
    a, b, c = tmp_path / "a.bin", tmp_path / "b.bin", tmp_path / "c.bin"
    a.write_bytes(bytes(body))
    body[-1] ^= 1
    b.write_bytes(bytes(body))
    c.write_bytes(a.read_bytes())
    assert repeated_input([a, b]) is None
    assert repeated_input([a, b, c]) == f"{c}: the same trace as {a} (a byte-for-byte copy)"


def test_console_script_reports_bad_input_without_traceback(tmp_path):
    bad = _write(tmp_path, "cut.json.gz", _real_gzip_bytes()[:1000])
    proc = subprocess.run([sys.executable, "-m", "plasmient_trace.cli", "ingest", str(bad), "--quiet"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("plasmient: error:") and "Traceback" not in proc.stderr
    assert "truncated gzip" in proc.stderr


def test_bad_flag_values_are_rejected_by_argparse(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["ingest", "x.json", "--max-spans", "0"])
    assert exc.value.code == 2
    assert "must be a positive integer" in capsys.readouterr().err


TRACE = "a100/alexnet.json.gz"


@pytest.mark.parametrize("argv, problem", [
    (["ingest", TRACE, "--peak-tflops", "inf"], "must be a positive number up to 1e+09"),
    (["ingest", TRACE, "--peak-tflops", "nan"], "must be a positive number"),
    (["ingest", TRACE, "--peak-tflops", "1e308"], "must be a positive number"),
    (["ingest", TRACE, "--gpu-price", "inf"], "must be a positive number"),
    (["ingest", TRACE, "--bandwidth-gbs", "-2"], "must be a positive number"),
    (["ingest", TRACE, "--peak-tflops", "fast"], "not a number: 'fast'"),
    (["ingest", TRACE, "--baseline-mfu", "7"], "must be a fraction in (0, 1]"),
    (["report", "x.jsonl", "--price-per-gpu-hour", "-5"], "must be a positive number"),
    (["report", "x.jsonl", "--baseline-mfu", "7"], "must be a fraction in (0, 1]"),
    (["report", "x.jsonl", "--fleet-gpus", "-3"], "must be a positive integer"),
    # past 2^64 the page's JSON encoder raised a TypeError traceback
    (["report", "x.jsonl", "--fleet-gpus", "18446744073709551616"], "must be a positive integer up to 2^53"),
    (["report", "x.jsonl", "--top", "0"], "must be a positive integer"),
    (["diff", "a.jsonl", "b.jsonl", "--top", "-1"], "must be a positive integer"),
    (["run", "--mfu-threshold", "2", "--", "true"], "must be a fraction in (0, 1]"),
    # an empty output path (an unset variable in a script) wrote nothing, exit 0
    (["ingest", TRACE, "--parquet", ""], "an empty path"),
    (["ingest", TRACE, "--out", " "], "an empty path"),
    (["report", "x.jsonl", "--html", ""], "an empty path"),
    (["diff", "a.jsonl", "b.jsonl", "--json", ""], "an empty path"),
])
def test_absurd_numbers_in_flags_are_refused_with_exit_2(argv, problem, capsys):
    """Each used to be taken: an infinite peak wrote MFU 0 on every span, an infinite price printed numpy
    warnings and null costs, a negative price made the report's bill negative."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    # one line, as every other bad input: argparse's usage block before it made it 14
    (line,) = capsys.readouterr().err.splitlines()
    assert problem in line and line.startswith(f"plasmient {argv[0]}: error: argument ") and line.endswith(" --help)")


def test_a_baseline_mfu_near_zero_is_taken_without_numpy_warnings(tmp_path, capsys):
    # 1e-320 made ideal/baseline overflow: two RuntimeWarnings (four lines) on a --quiet ingest
    import warnings

    out = tmp_path / "o.jsonl"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning is a failure here, not a line pytest keeps for itself
        assert main(["ingest", str(trace_path("h100/bert_small_inference.json.gz")), "--out", str(out), "--quiet",
                     "--baseline-mfu", "1e-320"]) == 0
    assert capsys.readouterr().err == "" and out.stat().st_size > 0


def test_a_cpu_price_that_is_not_a_price_falls_back_to_the_default_and_says_so(monkeypatch):
    from plasmient_trace.metrics import cpu_peak

    for bad in ("-1", "inf", "nan", "cheap"):
        monkeypatch.setenv("PLASMIENT_CPU_PRICE", bad)
        price, source = cpu_peak._cpu_price(4)
        assert price == cpu_peak.CPU_PRICE_PER_THREAD_HOUR * 4
        assert f"PLASMIENT_CPU_PRICE={bad!r} ignored" in source
    monkeypatch.setenv("PLASMIENT_CPU_PRICE", "0.42")
    assert cpu_peak._cpu_price(4) == (0.42, "PLASMIENT_CPU_PRICE")


def test_an_unknown_gpu_model_is_one_line_naming_the_models_that_would_work(tmp_path, capsys):
    # a typo was a warning and exit 0, and the device the trace named (matched without the flag) was dropped:
    # no MFU, no cost on any span
    trace = str(trace_path("h100/bert_small_inference.json.gz"))
    with pytest.raises(SystemExit) as exit_:
        main(["ingest", trace, "--out", str(tmp_path / "t.jsonl"), "--gpu-model", "H100-ish"])
    (line,) = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 2 and not (tmp_path / "t.jsonl").exists()
    assert line.startswith("plasmient ingest: error: argument --gpu-model: 'H100-ish' is none of") and "H100 SXM" in line
    # one of the names it lists is taken
    assert main(["ingest", trace, "--out", str(tmp_path / "t.jsonl"), "--gpu-model", "H100 SXM"]) == 0
    assert "unknown device" not in capsys.readouterr().err


def test_an_exporter_no_one_can_use_is_said_with_quiet_too(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    trace = str(trace_path("h100/bert_small_inference.json.gz"))
    assert main(["ingest", trace, "--out", str(tmp_path / "t.jsonl"), "--quiet"]) == 0
    assert capsys.readouterr().err.splitlines() == [
        "plasmient: OTEL_TRACES_EXPORTER='zipkin': plasmient exports traces with otlp, console, none; ignoring zipkin"]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_cpu_trace_is_told_only_a_peak_helps_not_a_gpu_model(tmp_path, capsys, workers):
    """cpu_only/rank-34 is a CPU-only trace (read raw: no deviceProperties, no GPU activity): naming a GPU
    model cannot give it a peak. A second rank with a GPU trace that names no GPU keeps both hints."""
    from conftest import raw_trace

    assert not raw_trace("cpu_only/rank-34.json.gz").get("deviceProperties")
    cpu = str(trace_path("cpu_only/rank-34.json.gz"))
    assert main(["ingest", cpu, "--out", str(tmp_path / "t.jsonl"), "--workers", workers]) == 0
    (note,) = [line for line in capsys.readouterr().err.splitlines() if "unknown device" in line]
    assert "set --peak-tflops" in note and "--gpu-model" not in note
    gpu = str(trace_path("a100_multirank/rank-0.json.gz"))
    assert main(["ingest", cpu, gpu, "--out", str(tmp_path / "t.jsonl"), "--workers", workers]) == 0
    (note,) = [line for line in capsys.readouterr().err.splitlines() if "unknown device" in line]
    assert "--gpu-model" in note and "--peak-tflops" in note


def test_a_name_longer_than_the_file_system_allows_is_one_line_in_every_command(tmp_path, capsys):
    # ENAMETOOLONG escaped as a 25-line traceback, exit 1, from each of these
    trace = str(trace_path("h100/bert_small_inference.json.gz"))
    spans = tmp_path / "spans.jsonl"
    assert main(["ingest", trace, "--out", str(spans), "--quiet"]) == 0
    capsys.readouterr()
    long = str(tmp_path / ("a" * 300))
    for argv, prefix in [
        (["ingest", long + ".json"], "plasmient: error: "),
        (["ingest", trace, "--out", long + ".jsonl", "--quiet"], "plasmient: error: "),
        (["ingest", trace, "--out", str(tmp_path / "o.jsonl"), "--parquet", long, "--quiet"], "plasmient: error: "),
        (["report", long + ".jsonl"], "plasmient report: error: "),
        (["report", str(spans), "--html", long + ".html", "--quiet"], "plasmient report: error: "),
        (["diff", long + ".jsonl", str(spans)], "plasmient diff: error: "),
        (["diff", str(spans), str(spans), "--json", long + ".json", "--quiet"], "plasmient diff: error: "),
        (["replay", long], "plasmient: error: "),
    ]:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith(prefix) and "too long" in err[0], (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spans.jsonl"]  # and nothing left behind


def test_outputs_are_all_written_or_none_and_never_over_each_other_or_the_model_config(tmp_path, capsys):
    trace = str(trace_path("h100/bert_small_inference.json.gz"))
    spans = tmp_path / "spans.jsonl"
    assert main(["ingest", trace, "--out", str(spans), "--quiet"]) == 0
    config = tmp_path / "moe.json"
    config.write_text('{"hidden_size":1024,"intermediate_size":512,"num_experts":8,"num_experts_per_tok":2,"moe_gated":true}')
    kept = config.read_bytes()
    (tmp_path / "pq").mkdir()
    (tmp_path / "pq" / "spans.parquet").symlink_to("/dev/full")
    (tmp_path / "pq2").mkdir()
    capsys.readouterr()
    for argv, line in [
        # --out over the model config replaced it with spans, exit 0 (traces were already protected)
        (["ingest", trace, "--model-config", str(config), "--out", str(config), "--quiet"],
         f"plasmient: error: {config}: is the input {config}; writing there would destroy it"),
        (["diff", str(spans), trace, "--model-config", str(config), "--json", str(config), "--quiet"],
         f"plasmient diff: error: {config}: is the input {config}; writing there would destroy it"),
        # two outputs at one path: the second replaced the first, exit 0
        (["ingest", trace, "--out", str(tmp_path / "pq2" / "spans.parquet"), "--parquet", str(tmp_path / "pq2"), "--quiet"],
         f"plasmient: error: {tmp_path / 'pq2' / 'spans.parquet'}: given as both --out and --parquet (spans.parquet); "
         "one would overwrite the other"),
        (["diff", str(spans), str(spans), "--json", str(tmp_path / "x.out"), "--html", str(tmp_path / "x.out"), "--quiet"],
         f"plasmient diff: error: {tmp_path / 'x.out'}: given as both --json and --html; one would overwrite the other"),
        # a later output that fails took the earlier ones with it: diff's JSON stayed, ingest's seven tables
        (["diff", str(spans), str(spans), "--json", str(tmp_path / "j.json"), "--html", "/dev/full", "--quiet"],
         "plasmient diff: error: /dev/full: No space left on device"),
        (["ingest", trace, "--out", str(tmp_path / "o.jsonl"), "--parquet", str(tmp_path / "pq"), "--quiet"],
         f"plasmient: error: cannot write {tmp_path / 'pq' / 'spans.parquet'}: No space left on device"),
    ]:
        assert main(argv) == 2, argv
        assert capsys.readouterr().err.strip().splitlines() == [line], argv
    assert config.read_bytes() == kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["moe.json", "pq", "pq2", "spans.jsonl"]
    assert [p.name for p in (tmp_path / "pq").iterdir()] == ["spans.parquet"] and not any((tmp_path / "pq2").iterdir())


def test_an_output_that_is_one_of_the_inputs_is_refused_and_the_input_kept(tmp_path, capsys):
    # `--out trace.json.gz` on the trace itself replaced the profile with its spans, exit 0
    trace = tmp_path / "trace.json.gz"
    trace.write_bytes(trace_path("h100/vit_image_classification.json.gz").read_bytes())
    link = tmp_path / "link.json.gz"
    link.symlink_to(trace)
    spans = tmp_path / "spans.jsonl"
    assert main(["ingest", str(trace), "--out", str(spans), "--quiet"]) == 0
    kept = {p: p.read_bytes() for p in (trace, spans)}
    commands = [
        (["ingest", str(trace), "--out", str(trace), "--quiet"], "plasmient: error: ", trace, trace),
        (["ingest", str(trace), "--out", str(link), "--quiet"], "plasmient: error: ", link, trace),
        (["report", str(spans), "--html", str(spans), "--quiet"], "plasmient report: error: ", spans, spans),
        (["diff", str(trace), str(spans), "--json", str(spans), "--quiet"], "plasmient diff: error: ", spans, spans),
    ]
    for argv, prefix, out, source in commands:
        assert main(argv) == 2, argv
        assert capsys.readouterr().err.strip().splitlines() == [
            f"{prefix}{out}: is the input {source}; writing there would destroy it"], argv
        assert {p: p.read_bytes() for p in kept} == kept


def test_a_file_name_with_a_newline_or_an_escape_stays_on_its_one_line_in_every_command(tmp_path, capsys):
    # "plasmient: error: /runs/trunc" then "ated.json: not JSON" on a line of its own: a log grep for the error
    # line saw half of it, and an escape in a name recoloured the terminal
    for name in ("trunc\nated", "esc\x1b[31mred"):
        bad = tmp_path / f"{name}.json"
        bad.write_bytes(b"xx")
        shown = str(bad).replace("\n", "\\n").replace("\x1b", "\\x1b")
        for argv, prefix in [(["ingest", str(bad), "--out", str(tmp_path / "o.jsonl"), "--quiet"], "plasmient: error: "),
                             (["report", str(bad)], "plasmient report: error: "),
                             (["diff", str(bad), str(bad)], "plasmient diff: error: "),
                             (["replay", str(bad)], "plasmient: error: ")]:
            assert main(argv) == 2, argv
            err = capsys.readouterr().err.splitlines()
            assert len(err) == 1 and err[0].startswith(prefix) and shown in err[0], (argv, err)
            assert "\x1b" not in err[0]


def _raw_kineto(name: str) -> dict:
    import gzip
    import json

    with gzip.open(trace_path(name), "rt") as f:
        return json.load(f)


def _levels(path) -> dict[str, list[dict]]:
    import orjson

    out: dict[str, list[dict]] = {}
    for line in path.read_bytes().splitlines():
        for rs in orjson.loads(line).get("resourceSpans", []):
            for ss in rs["scopeSpans"]:
                for sp in ss["spans"]:
                    a = {x["key"]: _value(x["value"]) for x in sp["attributes"]}
                    out.setdefault(a["plasmient.level"], []).append({"name": sp["name"], "span_id": sp["spanId"], **a})
    return out


def _value(v: dict):
    (kind, value), = v.items()
    return int(value) if kind == "intValue" else value


def test_a_device_clock_behind_the_host_is_shifted_and_one_kernel_before_its_launch_is_clamped(tmp_path, capsys):
    import json

    trace = trace_path("h100/bert_small_inference.json.gz")
    assert main(["ingest", str(trace), "--out", str(tmp_path / "plain.jsonl"), "--quiet"]) == 0
    plain = _levels(tmp_path / "plain.jsonl")["step"][0]
    device = ("kernel", "gpu_memcpy", "gpu_memset")
    # Every device event 50 us early (a GPU clock behind the host's): the stitch refused the trace ("cannot
    # stitch (ValueError: assignment destination is read-only)").
    skewed = _raw_kineto("h100/bert_small_inference.json.gz")
    for e in skewed["traceEvents"]:
        if e.get("cat") in device:
            e["ts"] -= 50
    (tmp_path / "skew.json").write_text(json.dumps(skewed))
    assert main(["ingest", str(tmp_path / "skew.json"), "--out", str(tmp_path / "skew.jsonl"), "--quiet"]) == 0
    rank = _levels(tmp_path / "skew.jsonl")["rank"][0]
    # the lag of the kernels that ran soonest after their launch: 50 us less their shortest queue wait
    raw = _raw_kineto("h100/bert_small_inference.json.gz")["traceEvents"]
    launch = {e["args"]["correlation"]: e["ts"] for e in raw if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    waits = sorted(e["ts"] - launch[e["args"]["correlation"]] for e in raw
                   if e.get("cat") == "kernel" and e["args"].get("correlation") in launch)
    assert rank["plasmient.clock.offset_ns"] == pytest.approx((50 - waits[2]) * 1000, abs=2)
    # One kernel recorded 1 s before its launch moved every kernel of the device by 1 s (a 4.4 ms step read
    # 1.004 s, MFU 8.3e-6): now it alone starts at its launch, and is counted.
    early = _raw_kineto("h100/bert_small_inference.json.gz")
    kernels = [e for e in early["traceEvents"] if e.get("cat") == "kernel"]
    kernels[len(kernels) // 2]["ts"] -= 1e6
    (tmp_path / "early.json").write_text(json.dumps(early))
    assert main(["ingest", str(tmp_path / "early.json"), "--out", str(tmp_path / "early.jsonl"), "--quiet"]) == 0
    _assert_one_clamped_and_as_plain(tmp_path / "early.jsonl", plain)
    # The mirror case: a launch recorded 1 s late. Moving its kernel to it made the step read 1.002 s; the
    # kernel stays where it was recorded (it would end past everything the device ran), and is counted.
    late = _raw_kineto("h100/bert_small_inference.json.gz")
    launches = [e for e in late["traceEvents"] if e.get("name") == "cudaLaunchKernel"]
    launches[len(launches) // 2]["ts"] += 1e6
    (tmp_path / "late.json").write_text(json.dumps(late))
    assert main(["ingest", str(tmp_path / "late.json"), "--out", str(tmp_path / "late.jsonl"), "--quiet"]) == 0
    _assert_one_clamped_and_as_plain(tmp_path / "late.jsonl", plain)


def _assert_one_clamped_and_as_plain(spans, plain: dict) -> None:
    step = _levels(spans)["step"][0]
    assert step["plasmient.input.clamped_events"] == 1
    for key in ("plasmient.wall_s", "plasmient.mfu", "plasmient.util.resident", "plasmient.cost.usd"):
        assert step[key] == plain[key], key


def test_a_profiler_step_written_twice_is_one_step(tmp_path):
    import copy
    import json

    doc = _raw_kineto("h100/bert_small_inference.json.gz")
    (step,) = [e for e in doc["traceEvents"]
               if str(e.get("name", "")).startswith("ProfilerStep#") and e.get("cat") == "user_annotation"]
    doc["traceEvents"].append(copy.deepcopy(step))
    (tmp_path / "twice.json").write_text(json.dumps(doc))
    assert main(["ingest", str(tmp_path / "twice.json"), "--out", str(tmp_path / "twice.jsonl"), "--quiet"]) == 0
    assert main(["ingest", str(trace_path("h100/bert_small_inference.json.gz")), "--out", str(tmp_path / "once.jsonl"),
                 "--quiet"]) == 0
    twice, once = _levels(tmp_path / "twice.jsonl"), _levels(tmp_path / "once.jsonl")
    # it made two rank and step spans under one span id, a node of 2 GPUs and twice the cost
    for level in ("fleet", "node", "rank", "step"):
        assert len(twice[level]) == 1, level
        assert twice[level][0]["plasmient.cost.usd"] == once[level][0]["plasmient.cost.usd"], level
    assert twice["node"][0]["plasmient.gpus"] == 1
    assert twice["step"][0]["plasmient.input.dropped_events"] == 1


def test_a_full_disk_leaves_no_temporary_file_nor_empty_directory(tmp_path):
    import subprocess

    from conftest import cli_with_file_size_limit

    trace = str(trace_path("h100/bert_small_inference.json.gz"))
    for out in (["--out", str(tmp_path / "x.jsonl")], ["--out", str(tmp_path / "x.jsonl.gz")],
                ["--out", str(tmp_path / "y.jsonl"), "--parquet", str(tmp_path / "pq")]):
        proc = subprocess.run(cli_with_file_size_limit(50_000, "ingest", trace, *out, "--quiet"),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, (out, proc.stderr)
        assert "File too large" in proc.stderr
        assert list(tmp_path.iterdir()) == [], (out, list(tmp_path.iterdir()))


def test_an_op_name_or_input_shapes_of_megabytes_are_cut_in_the_spans(tmp_path):
    # A 240 MB op name became one 241 MB line (and one OTLP request); 180 MB of Input Dims 121 MB of output.
    import json

    doc = _raw_kineto("h100/bert_small_inference.json.gz")
    ops = [e for e in doc["traceEvents"] if e.get("cat") == "cpu_op"]
    ops[0]["name"] = "aten::" + "x" * 2_000_000
    ops[1]["args"]["Input Dims"] = [[1] * 500_000]
    ops[1]["args"]["Input type"] = ["float"]
    (tmp_path / "long.json").write_text(json.dumps(doc))
    assert main(["ingest", str(tmp_path / "long.json"), "--out", str(tmp_path / "long.jsonl"), "--quiet"]) == 0
    spans = _levels(tmp_path / "long.jsonl")["op"]
    assert max(len(s["name"]) for s in spans) == 1024
    dims = [s["plasmient.op.input_dims"] for s in spans if "plasmient.op.input_dims" in s]
    assert max(len(d) for d in dims) == 16385 and sum(d.endswith("…") for d in dims) == 1
    assert (tmp_path / "long.jsonl").stat().st_size < 20 * 2**20


def test_a_report_that_cannot_be_written_is_one_line_even_without_quiet(tmp_path, capsys):
    # the summary's tables went to stderr first, then the error: 55 lines for a failure
    spans = tmp_path / "spans.jsonl"
    assert main(["ingest", str(trace_path("h100/bert_small_inference.json.gz")), "--out", str(spans), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["report", str(spans), "--html", "/dev/full"]) == 2
    assert capsys.readouterr().err.splitlines() == ["plasmient report: error: /dev/full: No space left on device"]
