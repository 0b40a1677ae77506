"""Hostile but parseable traces: ingest either succeeds with every number in range, or says in one line
which file is wrong and exits 2. Impossible times are dropped or clamped and counted, never used."""

from __future__ import annotations

import copy
import gzip
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from conftest import raw_trace, trace_path
from ingest_checks import by_level, ingest, out_of_range, spans, write_trace

from plasmient_trace.sources import rawinput
from plasmient_trace.sources.kineto import read_kineto
from plasmient_trace.sources.validate import CLAMPED, DROPPED, INVALID

BERT = "h100/bert_small_inference.json.gz"


def bert() -> dict:
    return copy.deepcopy(raw_trace(BERT))


def raw_gpu_activities(doc: dict) -> list[dict]:
    """Kernels, memcpys and memsets: each becomes a kernel-level span."""
    return [e for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]


def test_kernels_without_any_launch_still_join_their_op_by_external_id(tmp_path, capsys):
    doc = bert()
    doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("cat") not in ("cuda_runtime", "cuda_driver")]
    code, err = ingest(write_trace(tmp_path / "nolaunch.json", doc), tmp_path / "o.jsonl", capsys)
    assert code == 0, err
    out = spans(tmp_path / "o.jsonl")
    kernels = by_level(out, "kernel")
    assert len(kernels) == len(raw_gpu_activities(doc)) == 61
    assert out_of_range(out) == []
    # Each kernel's External id names its op exactly, so none is left hanging off the step.
    step = by_level(out, "step")[0]
    assert int(step.get("plasmient.unjoined_kernels", 0)) == 0


@pytest.mark.parametrize("props", [5, "NVIDIA H100", {"name": "NVIDIA H100"}, [1, None, {"id": 0}], None])
def test_device_properties_that_are_not_a_list_of_objects_mean_an_unknown_device(props, tmp_path, capsys):
    doc = bert()
    doc["deviceProperties"] = props
    code, err = ingest(write_trace(tmp_path / "props.json", doc), tmp_path / "o.jsonl", capsys)
    assert code == 0, err
    out = spans(tmp_path / "o.jsonl")
    assert out_of_range(out) == []
    # No device name, no peak: MFU is absent, not 0.
    assert not any("plasmient.mfu" in s for s in out)


def _first_kernel(doc: dict) -> dict:
    return next(e for e in raw_gpu_activities(doc) if e["cat"] == "kernel")


@pytest.mark.parametrize("field,value,counter", [
    ("dur", -5.0, DROPPED),
    ("dur", 1e30, DROPPED),
    ("dur", -1e30, DROPPED),
    ("dur", -0.4, CLAMPED),     # clock rounding: kept as a zero-length kernel
    ("ts", -5.0, DROPPED),      # days before the rest of the trace
    ("ts", 1e30, DROPPED),
    ("ts", -1e30, DROPPED),
])
def test_impossible_kernel_times_are_dropped_or_clamped_and_counted(field, value, counter, tmp_path, capsys):
    doc = bert()
    _first_kernel(doc)[field] = value
    path = write_trace(tmp_path / "times.json", doc)
    records = read_kineto(path)
    other = CLAMPED if counter == DROPPED else DROPPED
    assert records.counters[counter] == 1 and records.counters[other] == 0
    assert records.kernels.num_rows == 61 - (counter == DROPPED)
    code, err = ingest(path, tmp_path / "o.jsonl", capsys)
    assert code == 0, err
    out = spans(tmp_path / "o.jsonl")
    assert out_of_range(out) == []
    assert len(by_level(out, "kernel")) == 61 - (counter == DROPPED)
    # and the step span says so
    step = by_level(out, "step")[0]
    assert int(step[f"plasmient.{counter}"]) == 1 and int(step[f"plasmient.{other}"]) == 0


def test_real_traces_drop_and_clamp_nothing():
    for name in (BERT, "a100/cuda_graphs_rank0_of16.json.gz", "v100/resnet50_training.json.gz"):
        assert read_kineto(trace_path(name)).counters == {DROPPED: 0, CLAMPED: 0, INVALID: 0}


def test_a_step_with_negative_duration_is_dropped_and_its_kernels_stay(tmp_path, capsys):
    doc = bert()
    for e in doc["traceEvents"]:
        if str(e.get("name", "")).startswith("ProfilerStep#"):
            e["dur"] = -e["dur"]
    path = write_trace(tmp_path / "negstep.json", doc)
    assert read_kineto(path).counters[DROPPED] == 1
    code, err = ingest(path, tmp_path / "o.jsonl", capsys)
    assert code == 0, err
    out = spans(tmp_path / "o.jsonl")
    # With its only step gone the whole capture is one step: every kernel is still there.
    assert len(by_level(out, "kernel")) == 61 and out_of_range(out) == []


def test_every_event_impossible_is_one_line_not_an_empty_trace(tmp_path, capsys):
    doc = bert()
    for e in doc["traceEvents"]:
        if e.get("ph") == "X":
            e["dur"] = -100.0
    path = write_trace(tmp_path / "allbad.json", doc)
    code, err = ingest(path, tmp_path / "o.jsonl", capsys)
    assert code == 2 and len(err.splitlines()) == 1
    assert str(path) in err and "impossible timestamps or durations" in err


def test_absurd_ids_and_anchor_are_unknown_not_overflow(tmp_path, capsys):
    doc = bert()
    doc["baseTimeNanoseconds"] = 1e30
    doc["distributedInfo"] = {"rank": -3, "world_size": 10**30}
    for e in doc["traceEvents"][:50]:
        e["pid"] = 1e300
    code, err = ingest(write_trace(tmp_path / "ids.json", doc), tmp_path / "o.jsonl", capsys)
    assert code == 0, err
    assert out_of_range(spans(tmp_path / "o.jsonl")) == []


def _nested_trace(n: int) -> dict:
    """n identical cpu_op ranges on one thread, plus one launched kernel inside them all."""
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 1, "ts": 1000.0, "dur": 500.0,
               "args": {"External id": i + 1}} for i in range(n)]
    events += [
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 1101.0, "dur": 2.0,
         "args": {"correlation": 7, "External id": n}},
        {"ph": "X", "cat": "kernel", "name": "vectorized_add", "pid": 0, "tid": 7, "ts": 1105.0, "dur": 3.0,
         "args": {"correlation": 7, "device": 0, "stream": 7}},
    ]
    return {"traceEvents": events, "deviceProperties": [{"id": 0, "name": "NVIDIA A100-SXM4-80GB"}]}


def test_32k_identical_nested_events_ingest(tmp_path, capsys):
    # Used to take 40 s in nesting.tree_depth alone (quadratic in the nesting depth).
    n = 32_000
    code, err = ingest(write_trace(tmp_path / "nested.json", _nested_trace(n)), tmp_path / "o.jsonl", capsys,
                       "--max-spans", "100000")
    assert code == 0, err
    out = spans(tmp_path / "o.jsonl")
    assert len(by_level(out, "op")) == n and len(by_level(out, "kernel")) == 1
    assert out_of_range(out) == []


def _gzip_bomb(expanded_mb: int) -> bytes:
    """Concatenated gzip members of zeros (legal gzip): about 1 KB per MB expanded."""
    member = gzip.compress(b"\0" * (1 << 20), compresslevel=9)
    return member * expanded_mb


def test_gzip_bomb_stops_at_the_expansion_cap_in_a_small_address_space(tmp_path):
    # 1 GB of zeros in ~1 MB. With 1 GiB of address space beyond what the imports take, the old reader
    # died with MemoryError (or a segfault inside the JSON parser); now it stops at the cap with one line.
    bomb = tmp_path / "bomb.json.gz"
    bomb.write_bytes(_gzip_bomb(1024))
    script = ("import re, resource, sys; from plasmient_trace.cli import build_parser, main; build_parser();"
              "vm = int(re.search(r'VmSize:\\s+(\\d+)', open('/proc/self/status').read()).group(1)) * 1024;"
              "resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), vm + (1 << 30)));"
              "sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", script, "ingest", str(bomb), "--quiet", "--out", str(tmp_path / "o.jsonl")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PLASMIENT_MAX_TRACE_BYTES": str(8 << 30)})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert str(bomb) in proc.stderr and "gzip bomb" in proc.stderr
    assert not (tmp_path / "o.jsonl").exists()


def test_size_limit_applies_to_plain_and_gzip_files(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PLASMIENT_MAX_TRACE_BYTES", "100000")
    plain = tmp_path / "big.json"
    plain.write_bytes(gzip.decompress(trace_path(BERT).read_bytes()))
    code, err = ingest(plain, tmp_path / "o.jsonl", capsys)
    assert code == 2 and str(plain) in err and "PLASMIENT_MAX_TRACE_BYTES" in err
    code, err = ingest(trace_path(BERT), tmp_path / "o.jsonl", capsys)
    assert code == 2 and "decompresses to over" in err and len(err.splitlines()) == 1
    monkeypatch.setenv("PLASMIENT_MAX_TRACE_BYTES", "lots")
    code, err = ingest(trace_path(BERT), tmp_path / "o.jsonl", capsys)
    assert code == 2 and "PLASMIENT_MAX_TRACE_BYTES='lots'" in err


def test_gunzip_reads_concatenated_members_and_rejects_trailing_garbage(tmp_path):
    def whole(path: Path) -> bytes:
        return rawinput.inflate_whole(path, rawinput.read_file_bytes(path))

    def in_blocks(path: Path) -> bytes:
        return b"".join(rawinput.inflate_blocks(path, rawinput.read_file_bytes(path), 1 << 16))

    text = gzip.decompress(trace_path(BERT).read_bytes())
    half = len(text) // 2
    two = tmp_path / "two.json.gz"
    two.write_bytes(gzip.compress(text[:half]) + gzip.compress(text[half:]))
    junk = tmp_path / "junk.json.gz"
    junk.write_bytes(gzip.compress(text) + b"not gzip at all")
    for read in (whole, in_blocks):
        assert bytes(read(two)) == text
        with pytest.raises(rawinput.InputError, match="corrupt gzip"):
            read(junk)
        assert zlib.crc32(bytes(read(trace_path(BERT)))) == zlib.crc32(text)


def test_a_stitcher_failure_on_parsed_input_is_one_line_naming_the_inputs(tmp_path, monkeypatch, capsys):
    import plasmient_trace.pipeline as pipeline

    def broken(*args, **kwargs):
        raise IndexError("index 0 is out of bounds for axis 0 with size 0")

    monkeypatch.setattr(pipeline, "stitch_stream", broken)
    path = trace_path(BERT)
    code, err = ingest(path, tmp_path / "o.jsonl", capsys)
    assert code == 2 and len(err.splitlines()) == 1
    assert str(path) in err and "cannot stitch (IndexError: index 0 is out of bounds" in err
    monkeypatch.setenv("PLASMIENT_DEBUG", "1")
    with pytest.raises(IndexError):
        ingest(path, tmp_path / "o.jsonl", capsys)


def test_an_endless_device_stops_at_the_size_cap(tmp_path, monkeypatch, capsys):
    # /dev/zero has no size and no end: it is read in chunks up to the cap, not until memory runs out.
    monkeypatch.setenv("PLASMIENT_MAX_TRACE_BYTES", str(64 << 20))
    code, err = ingest(Path("/dev/zero"), tmp_path / "o.jsonl", capsys)
    assert code == 2 and len(err.splitlines()) == 1
    assert "/dev/zero: file is over 67 MB" in err


class _FedBytes:
    """zlib.decompressobj that counts the compressed bytes fed to it, and the bytes sliced off the file."""

    fed = 0

    def __init__(self, real):
        self._real = real

    def decompress(self, piece, max_length=0):
        _FedBytes.fed += len(piece)
        return self._real.decompress(piece, max_length)

    def __getattr__(self, name):
        return getattr(self._real, name)


class _SlicedBytes(bytes):
    sliced = 0

    def __getitem__(self, key):
        part = super().__getitem__(key)
        if isinstance(key, slice):
            _SlicedBytes.sliced += len(part)
        return part


def test_many_empty_gzip_members_are_read_in_linear_work(tmp_path, monkeypatch, capsys):
    # 20-byte empty members after a real trace: each one used to be fed a whole megabyte (zlib copies the
    # rest of it out as unused_data) and the rest of the file was copied to look for padding after it.
    # A 4 MB file of them held `ingest` for many minutes; every member now costs its own size.
    text = gzip.decompress(trace_path(BERT).read_bytes())
    empty = gzip.compress(b"")
    members = 20_000
    data = _SlicedBytes(gzip.compress(text) + empty * members)
    real = zlib.decompressobj
    monkeypatch.setattr(zlib, "decompressobj", lambda *a, **k: _FedBytes(real(*a, **k)))
    _FedBytes.fed = _SlicedBytes.sliced = 0
    assert b"".join(rawinput.inflate_blocks(Path("x.json.gz"), data, 1 << 16)) == text
    assert _FedBytes.fed <= 2 * len(data) + members * 8192, _FedBytes.fed
    assert _SlicedBytes.sliced <= 4 * len(data), _SlicedBytes.sliced
    monkeypatch.setattr(zlib, "decompressobj", real)
    path = tmp_path / "members.json.gz"
    path.write_bytes(bytes(data))
    code, err = ingest(path, tmp_path / "o.jsonl", capsys)
    assert code == 0, err
    assert len(by_level(spans(tmp_path / "o.jsonl"), "kernel")) == 61
