"""`plasmient report` on damaged span files: one line naming the file, exit 2, no traceback, no page."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

import pytest

from conftest import ALL_TRACES, fifo_fed, ingested, trace_path

from plasmient_trace.cli import main
from plasmient_trace.export.otlp_json import write_jsonl


@pytest.fixture(scope="module")
def good_jsonl(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("spans") / "bert.jsonl"
    write_jsonl(ingested("h100/bert_small_inference.json.gz").batch, path)
    return path.read_bytes()


def _start_times(text: bytes, value: bytes, count: int = 3) -> bytes:
    return re.sub(rb'"startTimeUnixNano":"\d+"', b'"startTimeUnixNano":' + value, text, count=count)


def _attribute_set(text: bytes, key: bytes, value: bytes, count: int = 3) -> bytes:
    pattern = rb'"key":"' + key.replace(b".", rb"\.") + rb'","value":\{"doubleValue":[^}]*\}'
    out, done = re.subn(pattern, b'"key":"' + key + b'","value":{"doubleValue":' + value + b"}", text, count=count)
    assert done == count
    return out


DAMAGE = {
    "cut in its first line": (lambda t: t[: t.index(b"\n") // 2], "its first line is incomplete"),
    # (a trace's line cut short and ended with a newline is what a live write on a full disk leaves: left out
    # with a note, test_delivery's test_a_live_line_a_full_disk_cut_short_leaves_every_other_trace_readable)
    "a bad line that is not the last": (lambda t: b"#" + t[: t.index(b"\n") // 2] + b"\n" + t, "not valid JSON"),
    "timestamp past int64": (lambda t: _start_times(t, b'"99999999999999999999999"'), "out of the int64 range"),
    "timestamp 1e30": (lambda t: _start_times(t, b"1e30"), "out of the int64 range"),
    "negative end": (lambda t: re.sub(rb'"endTimeUnixNano":"\d+"', b'"endTimeUnixNano":"-5"', t, count=2),
                     "end before they start"),
    "gzip cut short in its first line": (lambda t: gzip.compress(t)[:4000], "its first line is incomplete"),
    "empty": (lambda t: b"", "no spans"),
    # numbers out of the range plasmient computes them in would be drawn as measured ones
    "MFU above 1": (lambda t: _attribute_set(t, b"plasmient.mfu", b"7.5"),
                    "plasmient.mfu = 7.5 on 3 span(s), outside [0, 1]"),
    "a negative cost": (lambda t: _attribute_set(t, b"plasmient.cost.wasted_usd", b"-1e308", count=2),
                        "plasmient.cost.wasted_usd = -1e+308 on 2 span(s), outside [0, inf)"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damaged_span_file_is_one_line_and_exit_2(case, good_jsonl, tmp_path, capsys):
    damage, expected = DAMAGE[case]
    path = tmp_path / ("spans.jsonl.gz" if "gzip" in case else "spans.jsonl")
    path.write_bytes(damage(good_jsonl))
    page = tmp_path / "r.html"
    code = main(["report", str(path), "--html", str(page), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert str(path) in err and expected in err, err
    assert not page.exists()


def test_long_error_lines_are_not_wrapped(good_jsonl, tmp_path, capsys):
    # rich's console wrapped these at the terminal width: "one line" must hold for any path length.
    deep = tmp_path / ("d" * 120)
    deep.mkdir()
    path = deep / "spans.jsonl"
    path.write_bytes(good_jsonl[:1000])
    assert main(["report", str(path), "--quiet"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_good_file_still_reports(good_jsonl, tmp_path, capsys):
    path = tmp_path / "spans.jsonl"
    path.write_bytes(good_jsonl)
    assert main(["report", str(path), "--html", str(tmp_path / "r.html"), "--quiet"]) == 0
    assert (tmp_path / "r.html").stat().st_size > 0


@pytest.mark.parametrize("where", ["a folder", "below a file", "a full device"])
def test_a_page_that_cannot_be_written_is_one_line_and_exit_2(where, good_jsonl, tmp_path, capsys):
    path = tmp_path / "spans.jsonl"
    path.write_bytes(good_jsonl)
    (tmp_path / "plain").write_text("a file, not a folder")
    page, expected = {
        "a folder": (tmp_path, f"{tmp_path}: is a directory, not a file"),
        "below a file": (tmp_path / "plain" / "r.html", f"{tmp_path / 'plain' / 'r.html'}: {tmp_path / 'plain'} is not a directory"),
        "a full device": (Path("/dev/full"), "/dev/full: No space left on device"),
    }[where]
    if not page.exists() and where == "a full device":
        pytest.skip("no /dev/full here")
    code = main(["report", str(path), "--html", str(page)])
    captured = capsys.readouterr()
    assert code == 2
    # a path found wrong before the work is said before the summary is drawn; a failed write after it
    err = captured.err.strip().splitlines()
    assert err[-1] == f"plasmient report: error: {expected}" and "Traceback" not in captured.err
    if where != "a full device":
        assert len(err) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain", "spans.jsonl"]


# A span another service sent through the same Collector (its file exporter writes every service's spans).
FOREIGN_LINE = json.dumps({"resourceSpans": [{
    "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "web"}}]},
    "scopeSpans": [{"scope": {"name": "flask"}, "spans": [{
        "traceId": "0af7651916cd43dd8448eb211c80319c", "spanId": "b7ad6b7169203331", "name": "GET /", "kind": 2,
        "startTimeUnixNano": "1700000000000000000", "endTimeUnixNano": "1700000000100000000",
        "attributes": [{"key": "http.method", "value": {"stringValue": "GET"}}]}]}]}]}).encode() + b"\n"


def test_spans_of_other_services_are_left_out_and_a_file_of_only_theirs_is_one_line(good_jsonl, tmp_path, capsys):
    ours, mixed, theirs = tmp_path / "ours.jsonl", tmp_path / "mixed.jsonl", tmp_path / "theirs.jsonl"
    ours.write_bytes(good_jsonl)
    mixed.write_bytes(FOREIGN_LINE + good_jsonl + FOREIGN_LINE)
    theirs.write_bytes(FOREIGN_LINE)
    assert main(["report", str(ours)]) == 0
    alone = capsys.readouterr().err
    assert main(["report", str(mixed)]) == 0
    assert capsys.readouterr().err == alone  # the HTTP span is no step, no rank, no culprit
    pages = [tmp_path / "ours.html", tmp_path / "mixed.html"]
    for source, page in zip((ours, mixed), pages):
        assert main(["report", str(source), "--html", str(page), "--title", "t", "--quiet"]) == 0
    assert pages[0].read_bytes() == pages[1].read_bytes()
    for command in (["report", str(theirs)], ["diff", str(theirs), str(ours)]):
        assert main(command) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].endswith(f"{theirs}: none of its 1 span(s) is plasmient's (no plasmient.level): "
                                                 "not a plasmient trace"), err


def test_a_span_delivered_twice_counts_once_and_another_run_under_the_same_ids_is_refused(good_jsonl, tmp_path, capsys):
    # OTLP is at-least-once: a retried request the collector had taken writes its spans again
    ours, twice = tmp_path / "ours.jsonl", tmp_path / "twice.jsonl"
    ours.write_bytes(good_jsonl)
    twice.write_bytes(good_jsonl + good_jsonl)
    spans = sum(len(s["spans"]) for line in good_jsonl.splitlines() for rs in json.loads(line)["resourceSpans"]
                for s in rs["scopeSpans"])
    assert main(["report", str(ours)]) == 0
    alone = capsys.readouterr().err
    assert main(["report", str(twice)]) == 0
    note, rest = capsys.readouterr().err.split("\n", 1)
    assert note == (f"plasmient report: {twice}: {spans} span(s) appeared twice with the same ids and times "
                    "(a delivery retried): counted once")
    assert rest == alone  # the numbers of the file alone, not doubled
    # a second run under the same job id: the same trace and span ids, other times
    other = tmp_path / "other.jsonl"
    other.write_bytes(re.sub(rb'"(start|end)TimeUnixNano":"(\d+)"',
                             lambda m: b'"%sTimeUnixNano":"%d"' % (m.group(1), int(m.group(2)) + 60 * 10**9), good_jsonl))
    both = tmp_path / "both.jsonl"
    both.write_bytes(good_jsonl + other.read_bytes())
    for command in (["report", str(both)], ["diff", str(ours), str(both)]):
        assert main(command) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{both}: {spans} span id(s) appear again with other times: two runs wrote the same " \
                                 "trace ids" in err[0] and "PLASMIENT_JOB_ID" in err[0], err


@pytest.mark.parametrize("trace", ALL_TRACES)
def test_a_kineto_trace_given_to_report_says_to_ingest_it(trace, capsys):
    path = trace_path(trace)
    assert main(["report", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"plasmient report: error: {path}: a Kineto trace, not a span file: turn it into spans with "
                   f"`plasmient ingest {path} --out spans.jsonl` and report those (`plasmient diff` takes traces as they are)"]


def test_a_span_file_given_to_ingest_says_to_report_it(good_jsonl, tmp_path, capsys):
    many, one = tmp_path / "spans.jsonl", tmp_path / "one-line.jsonl"
    many.write_bytes(good_jsonl + good_jsonl)
    one.write_bytes(good_jsonl.splitlines(keepends=True)[0])
    for path in (many, one):
        assert main(["ingest", str(path), "--quiet", "--out", str(tmp_path / "out.jsonl")]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [
            f"plasmient: error: {path}: a span file (OTLP JSON lines, what plasmient writes), not a trace: "
            "read it with `plasmient report`"]


def test_a_byte_order_mark_is_read_past_in_a_span_file_and_a_trace(good_jsonl, tmp_path, capsys):
    # Windows editors save UTF-8 with a BOM; JSON parsers may ignore it, and these two said "not JSON"
    plain, marked = tmp_path / "plain.jsonl", tmp_path / "marked.jsonl"
    plain.write_bytes(good_jsonl)
    marked.write_bytes(b"\xef\xbb\xbf" + good_jsonl)
    assert main(["report", str(plain)]) == 0
    alone = capsys.readouterr()
    assert alone.out and main(["report", str(marked)]) == 0 and capsys.readouterr() == alone
    trace = gzip.decompress(trace_path("h100/bert_small_inference.json.gz").read_bytes())
    for name, data in (("plain.json", trace), ("marked.json", b"\xef\xbb\xbf" + trace)):
        (tmp_path / name).write_bytes(data)
        assert main(["ingest", str(tmp_path / name), "--job-id", "j", "--quiet", "--out", str(tmp_path / f"{name}.jsonl")]) == 0
    from plasmient_trace.export.otlp_json import read_jsonl

    assert read_jsonl(tmp_path / "marked.json.jsonl").table.equals(read_jsonl(tmp_path / "plain.json.jsonl").table)


def test_a_culprits_bound_in_a_span_file_is_printed_as_text_not_rich_markup(good_jsonl, tmp_path, capsys):
    # a span file is input like any other: "[/x]" as a culprit's bound was a rich MarkupError traceback
    hostile = re.sub(rb'\\"bound\\":\\"memory\\"', rb'\\"bound\\":\\"[/x]\\"', good_jsonl)
    assert hostile != good_jsonl
    (tmp_path / "spans.jsonl").write_bytes(hostile)
    assert main(["report", str(tmp_path / "spans.jsonl"), "--top", "40"]) == 0
    assert "[/x]" in capsys.readouterr().out


def test_the_report_line_names_a_long_path_whole_on_one_line(good_jsonl, tmp_path, capsys):
    # rich wrapped the line at the console's width, cutting the page's path in two, and read [..] in it as markup
    (tmp_path / "bert.jsonl").write_bytes(good_jsonl)
    page = tmp_path / ("reports-[run 7]-" + "b" * 100) / "page.html"
    page.parent.mkdir()
    assert main(["report", str(tmp_path / "bert.jsonl"), "--html", str(page)]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert f"report: {page} ({page.stat().st_size / 1e6:.2f} MB, 628 spans)" in lines


@pytest.mark.parametrize("form", ["pipe", "gzip'd pipe"])
def test_a_pipe_reads_as_the_file_it_carries(form, good_jsonl, tmp_path, capsys):
    # `plasmient report <(zcat spans.jsonl.gz)` was "no such file": a pipe is no regular file, and the
    # reader sniffed its head, then opened it again. One pass now, the same page as from the file.
    (tmp_path / "bert.jsonl").write_bytes(good_jsonl)
    assert main(["report", str(tmp_path / "bert.jsonl"), "--html", str(tmp_path / "file.html"), "--title", "t"]) == 0
    from_file = capsys.readouterr().err
    data = gzip.compress(good_jsonl) if form == "gzip'd pipe" else good_jsonl
    fifo = fifo_fed(tmp_path, "spans", data)
    assert main(["report", str(fifo), "--html", str(tmp_path / "pipe.html"), "--title", "t"]) == 0
    from_pipe = capsys.readouterr().err
    assert (tmp_path / "pipe.html").read_bytes() == (tmp_path / "file.html").read_bytes()
    assert from_pipe.replace("pipe.html", "file.html") == from_file
    # a Kineto trace through a pipe is still told apart by its first bytes
    fifo = fifo_fed(tmp_path, "trace", trace_path("h100/bert_small_inference.json.gz").read_bytes())
    assert main(["report", str(fifo)]) == 2
    assert "a Kineto trace, not a span file" in capsys.readouterr().err


def test_a_directory_reports_as_its_span_files(good_jsonl, tmp_path, capsys):
    # the ranks of a live run write traces.rank<R>.jsonl side by side: their directory is one argument
    run, other = tmp_path / "run", tmp_path / "other"
    run.mkdir()
    other.mkdir()
    lines = good_jsonl.splitlines(keepends=True)
    (run / "traces.rank0.jsonl").write_bytes(b"".join(lines[: len(lines) // 2]))
    (run / "traces.rank1.jsonl.gz").write_bytes(gzip.compress(b"".join(lines[len(lines) // 2:])))
    (run / "notes.txt").write_text("not spans")
    files = [str(run / "traces.rank0.jsonl"), str(run / "traces.rank1.jsonl.gz")]
    assert main(["report", *files, "--html", str(tmp_path / "files.html"), "--title", "t", "--quiet"]) == 0
    assert main(["report", str(run), "--html", str(tmp_path / "dir.html"), "--title", "t", "--quiet"]) == 0
    assert (tmp_path / "dir.html").read_bytes() == (tmp_path / "files.html").read_bytes()
    capsys.readouterr()
    assert main(["report", str(other)]) == 2
    assert capsys.readouterr().err.strip() == (f"plasmient report: error: {other}: a directory with no span file in it "
                                               "(no file ending in .jsonl or .jsonl.gz)")


@pytest.mark.parametrize("packed", [False, True])
def test_a_file_still_being_written_is_reported_up_to_its_last_whole_line(packed, tmp_path, capsys):
    # `plasmient report traces.jsonl` while the job still runs: the live writer appends each trace's line
    # in one write (a .gz one gzip member per line), so a reader can meet the last one half written. The
    # whole lines are reported, and a note says what was left out, instead of refusing the file.
    write_jsonl(ingested("mi250/minitoy_train.json.gz").batch, tmp_path / "two-steps.jsonl")
    lines = (tmp_path / "two-steps.jsonl").read_bytes().splitlines(keepends=True)
    assert len(lines) == 2
    whole, partial = b"".join(lines[:-1]), lines[-1][: len(lines[-1]) // 2]
    if packed:  # as the live sink writes a .gz: one member per line, the last one cut
        members = [gzip.compress(line, mtime=0) for line in lines]
        data, name = b"".join(members[:-1]) + members[-1][: len(members[-1]) // 2], "live.jsonl.gz"
    else:
        data, name = whole + partial, "live.jsonl"
    (tmp_path / name).write_bytes(data)
    (tmp_path / "whole.jsonl").write_bytes(whole)
    assert main(["report", str(tmp_path / "whole.jsonl"), "--html", str(tmp_path / "whole.html"), "--title", "t"]) == 0
    capsys.readouterr()
    assert main(["report", str(tmp_path / name), "--html", str(tmp_path / "live.html"), "--title", "t"]) == 0
    err = capsys.readouterr().err
    n = len(lines) - 1
    assert (f"plasmient report: {tmp_path / name}: the line after line {n} is incomplete (a run still writing the "
            f"file, or the file cut short): left out; the {n} line(s) before it are read") in err
    assert (tmp_path / "live.html").read_bytes() == (tmp_path / "whole.html").read_bytes()


def test_one_trace_ingested_twice_with_other_options_is_refused_not_counted_once(tmp_path, capsys):
    """Two ingests of one trace under one job id with another --gpu-model have the same span ids and times;
    the second file's numbers were dropped as "a delivery retried", so the MFU shown depended on the order
    of the files (1.8% one way, 2.4% the other)."""
    trace = str(trace_path("h100/vit_image_classification.json.gz"))
    sxm, pcie = tmp_path / "sxm.jsonl", tmp_path / "pcie.jsonl"
    assert main(["ingest", trace, "--job-id", "vit", "--out", str(sxm), "--quiet"]) == 0
    assert main(["ingest", trace, "--job-id", "vit", "--out", str(pcie), "--quiet", "--gpu-model", "H100 PCIe"]) == 0
    for files in ([sxm, pcie], [pcie, sxm]):
        assert main(["report", *map(str, files)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "appear again with the same ids and times but another plasmient.mfu: one trace " \
                                 "ingested twice with other options (job id 'vit')" in err[0], err


def _gzip_of_one_open_line(expanded_mb: int) -> bytes:
    """'{"resourceSpans": [' and then blanks, gzip'd: ~1 KB per MB, no newline, never valid JSON."""
    deflate = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    parts = [deflate.compress(b'{"resourceSpans": [')]
    parts += [deflate.compress(b" " * (1 << 20)) for _ in range(expanded_mb)]
    return b"".join(parts) + deflate.flush()


@pytest.mark.parametrize("case", ["gzip bomb", "over the size limit", "bytes that cannot start a line"])
def test_a_span_file_is_read_under_the_caps_a_trace_is(case, good_jsonl, tmp_path, monkeypatch, capsys):
    # Lines were read whole, however long: a 4 MB .jsonl.gz of one open line grew to 8.8 GB (41 s), one
    # of blank lines took minutes, /dev/zero grew until the machine ran out of memory.
    path = tmp_path / "spans.jsonl"
    if case == "gzip bomb":
        path = tmp_path / "spans.jsonl.gz"
        path.write_bytes(_gzip_of_one_open_line(300))
        expected = "a gzip bomb? (raise PLASMIENT_MAX_GZIP_RATIO to accept it)"
    elif case == "over the size limit":
        monkeypatch.setenv("PLASMIENT_MAX_TRACE_BYTES", "100000")
        path.write_bytes(good_jsonl)
        expected = "the size limit (raise PLASMIENT_MAX_TRACE_BYTES to accept it)"
    else:  # a file of NULs was called a line "a run is still writing"
        path.write_bytes(b"\0" * (1 << 20))
        expected = f"{path}:1: not valid JSON (a line of OTLP JSON starts with '{{')"
    page = tmp_path / "r.html"
    code = main(["report", str(path), "--html", str(page), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert str(path) in err and expected in err, err
    assert not page.exists()


def test_dev_zero_is_refused_at_once_in_a_small_address_space(tmp_path):
    # Reading line by line, /dev/zero was one endless line held in memory.
    script = ("import re, resource, sys; from plasmient_trace.cli import build_parser, main; build_parser();"
              "vm = int(re.search(r'VmSize:\\s+(\\d+)', open('/proc/self/status').read()).group(1)) * 1024;"
              "resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), vm + (1 << 30)));"
              "sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", script, "report", "/dev/zero", "--html", str(tmp_path / "r.html"), "--quiet"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip() == "plasmient report: error: /dev/zero:1: not valid JSON (a line of OTLP JSON starts with '{')"
    assert not (tmp_path / "r.html").exists()


def test_blank_lines_and_line_numbers_across_blocks(good_jsonl, tmp_path, capsys):
    # Lines are cut from 1 MiB blocks now: a line over several blocks, blank runs, and the line named in an error.
    path = tmp_path / "spans.jsonl"
    text = b"\n \r\n" * 300_000 + good_jsonl + b"\n\n" + good_jsonl + b"  \n{\"resourceSpans\": [}\n"
    path.write_bytes(text)
    bad_line = text[:text.index(b'{"resourceSpans": [}')].count(b"\n") + 1
    code = main(["report", str(path), "--html", str(tmp_path / "r.html"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and f"{path}:{bad_line}: not valid JSON" in err, err
    path.write_bytes(text[:text.index(b'{"resourceSpans": [}')])
    code = main(["report", str(path), "--html", str(tmp_path / "r.html"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 0 and (tmp_path / "r.html").exists(), err


def test_a_stream_given_to_diff_is_copied_only_up_to_the_size_cap(good_jsonl, tmp_path, monkeypatch, capsys):
    # diff copies a pipe to a private file before reading it: `plasmient diff /dev/zero B` wrote 37 GB to
    # /tmp before the disk was full. The copy stops at PLASMIENT_MAX_TRACE_BYTES, as reading a trace does.
    monkeypatch.setenv("PLASMIENT_MAX_TRACE_BYTES", str(1 << 20))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (tmp_path / "b.jsonl").write_bytes(good_jsonl)
    fifo = fifo_fed(tmp_path, "a.pipe", b"\0" * (8 << 20))  # the copy was whole, and then refused as no JSON
    code = main(["diff", str(fifo), str(tmp_path / "b.jsonl"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"plasmient diff: error: {fifo}: over ") and "PLASMIENT_MAX_TRACE_BYTES" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pipe", "b.jsonl"]  # the private copy is gone


def test_a_gzip_bomb_through_a_pipe_stops_at_the_ratio_cap(tmp_path, capsys):
    # A pipe has no size to hold the expansion against: the gzip'd bytes read so far are counted instead.
    fifo = fifo_fed(tmp_path, "spans", _gzip_of_one_open_line(300))
    code = main(["report", str(fifo), "--html", str(tmp_path / "r.html"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"plasmient report: error: {fifo}: expands more than 200x") and "a gzip bomb?" in err, err
