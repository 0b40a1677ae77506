"""A gzip'd trace read a block at a time (sources.event_chunks) gives exactly what reading the whole document
gives, on every shared trace and on fuzzed inputs, in memory bounded by the block, not the document."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest
import test_fuzz_input as fuzz
from conftest import TRACES
from ingest_checks import ingest

from plasmient_trace.sources import event_chunks, kineto
from plasmient_trace.sources.kineto_schema import EVENT
from plasmient_trace.sources.rawinput import read_file_bytes

GZ_TRACES = sorted(str(p.relative_to(TRACES)) for p in TRACES.rglob("*.json.gz"))
SMALL_BLOCK = 64 << 10


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks small enough that every shared trace but the tiniest is cut into many chunks."""
    monkeypatch.setattr(event_chunks, "BLOCK_BYTES", SMALL_BLOCK)


def _read_whole(path: Path, monkeypatch) -> kineto.RecordSet:
    with monkeypatch.context() as m:
        m.setattr(kineto, "is_gzip", lambda data: False)  # the whole-document reader
        return kineto.read_kineto(path)


@pytest.mark.parametrize("name", GZ_TRACES)
def test_every_shared_trace_reads_the_same_in_chunks(name, small_blocks, monkeypatch):
    path = TRACES / name
    chunks = event_chunks.EventChunks(read_file_bytes(path), path)
    if chunks.whole is not None:
        pytest.skip("inflates to less than one block")
    assert sum(1 for _ in chunks) >= 1  # read a block at a time, not whole
    streamed, whole = kineto.read_kineto(path), _read_whole(path, monkeypatch)
    for table in ("kernels", "launches", "ops", "modules", "steps", "external_correlation", "samples"):
        assert getattr(streamed, table).equals(getattr(whole, table)), table
    assert streamed.devices == whole.devices
    assert (streamed.resource, streamed.clock, streamed.counters) == (whole.resource, whole.clock, whole.counters)


def test_the_events_are_the_documents_own_events_each_once(small_blocks):
    """Cut into ~400 chunks, the events decoded are the document's, in order, none lost or doubled at a cut."""
    path = TRACES / "a100/cuda_graphs_rank0_of16.json.gz"
    chunks = event_chunks.EventChunks(read_file_bytes(path), path)
    per_chunk = list(chunks)
    streamed = [event for events in per_chunk for event in events]
    doc = json.loads(gzip.decompress(path.read_bytes()))  # an independent parser
    assert len(per_chunk) > 100
    assert len(streamed) == len(doc["traceEvents"])
    # each event of the independent parse, as the typed schema reads it (argument lists as JSON values)
    typed = [json.loads(msgspec.json.encode(EVENT.decode(json.dumps(event)))) for event in doc["traceEvents"]]
    assert [json.loads(msgspec.json.encode(event)) for event in streamed] == typed
    assert chunks.meta["deviceProperties"] == doc["deviceProperties"]
    assert chunks.meta["baseTimeNanoseconds"] == doc.get("baseTimeNanoseconds")


@pytest.mark.parametrize("case", range(0, fuzz.CASES, 3))
def test_a_fuzzed_gzip_trace_ends_the_same_in_chunks_as_whole(case, tmp_path, capsys, monkeypatch):
    """Each fuzz case (truncations, corrupt streams, type confusion, deletions, absurd values, nesting) gzip'd
    when it is not: same exit code, same error line or the same spans, streamed or whole."""
    path, what = fuzz._bytes_for(case, tmp_path)
    if not path.name.endswith(".gz"):
        path = path.rename(path.with_name("case.json.gz.src"))
        gz = path.with_name("case.json.gz")
        gz.write_bytes(gzip.compress(path.read_bytes(), compresslevel=1))
        path = gz
    outcomes = []
    for streamed in (True, False):
        out = tmp_path / f"out-{streamed}.jsonl"
        with monkeypatch.context() as m:
            m.setattr(event_chunks, "BLOCK_BYTES", 4 << 10)
            if not streamed:
                m.setattr(kineto, "is_gzip", lambda data: False)
            code, err = ingest(path, out, capsys)
        outcomes.append((code, err, out.read_bytes() if out.exists() else None))
    assert outcomes[0] == outcomes[1], what


@pytest.mark.parametrize("where", ["middle", "last"])
def test_a_type_error_in_a_streamed_event_is_named_as_the_whole_read_names_it(where, tmp_path, capsys, monkeypatch):
    """Chunks are decoded into typed events: one event whose "ts" is a boolean, in a chunk in the middle of
    the document or in the last one, gives the whole reader's one line naming that event (by its index),
    exit 2 and no output file, not a cut tried elsewhere or events skipped."""
    doc = json.loads(gzip.decompress((TRACES / "h100/bert_small_inference.json.gz").read_bytes()))
    events = doc["traceEvents"]
    bad = len(events) // 2 if where == "middle" else len(events) - 2
    events[bad] = {**events[bad], "ts": True}
    path = tmp_path / "bad.json.gz"
    path.write_bytes(gzip.compress(json.dumps(doc).encode(), compresslevel=1))
    outcomes = []
    for streamed in (True, False):
        out = tmp_path / f"out-{streamed}.jsonl"
        with monkeypatch.context() as m:
            m.setattr(event_chunks, "BLOCK_BYTES", SMALL_BLOCK)
            if not streamed:
                m.setattr(kineto, "is_gzip", lambda data: False)
            code, err = ingest(path, out, capsys)
        outcomes.append((code, err, out.exists()))
    assert outcomes[0] == outcomes[1]
    code, err, wrote = outcomes[0]
    assert (code, wrote) == (2, False)
    assert f"event #{bad}: malformed event (Expected `float | str | null`, got `bool` at ts)" in err
    assert len(err.splitlines()) == 1
    # the streaming reader names the event at its chunk: neither gathering the rest of the document into one
    # buffer in search of a cut that decodes, nor handing the file to the whole-document reader
    inflated = []
    original = event_chunks._inflate

    def counting(path, data):
        for block in original(path, data):
            inflated.append(len(block))
            yield block

    monkeypatch.setattr(event_chunks, "_inflate", counting)
    monkeypatch.setattr(event_chunks, "BLOCK_BYTES", SMALL_BLOCK)
    with pytest.raises(event_chunks.MalformedEvent) as raised:
        list(event_chunks.EventChunks(path.read_bytes(), path))
    assert (raised.value.index, raised.value.at) == (bad, "ts")
    size = len(gzip.decompress(path.read_bytes()))
    assert sum(inflated) < (0.6 if where == "middle" else 1.01) * size


def test_memory_is_bounded_by_the_block_not_the_document(tmp_path):
    """A 140 MB document (a real trace plus 1.5M flow events, which make no records), read with the default
    blocks: the reader's peak stays under a third of the document, which the whole-document reader holds
    at once."""
    doc = json.loads(gzip.decompress((TRACES / "h100/bert_small_inference.json.gz").read_bytes()))
    flow = b',{"ph": "s", "id": 1, "pid": 1, "tid": 1, "ts": 1.0, "cat": "ac2g", "name": "ac2g", "bp": "e"}' * 1000
    head, events = json.dumps({**doc, "traceEvents": []}).encode().split(b'"traceEvents": []')
    body = json.dumps(doc["traceEvents"]).encode()[:-1] + flow * 1500 + b"]"
    text = head + b'"traceEvents": ' + body + events
    path = tmp_path / "big.json.gz"
    path.write_bytes(gzip.compress(text, compresslevel=1))
    size = len(text)
    del text, body
    child = textwrap.dedent(f"""
        import json
        from pathlib import Path
        from plasmient_trace.sources import kineto
        def vm(field):
            for line in open("/proc/self/status"):
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        before = vm("VmRSS")
        records = kineto.read_kineto(Path({str(path)!r}))
        print(json.dumps({{"peak": vm("VmHWM") - before, "kernels": records.kernels.num_rows}}))
    """)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300, check=True)
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["kernels"] == kineto.read_kineto(TRACES / "h100/bert_small_inference.json.gz").kernels.num_rows
    assert size > 130e6
    assert got["peak"] < size / 3, f"peak {got['peak'] / 1e6:.0f} MB reading a {size / 1e6:.0f} MB document"


@pytest.mark.parametrize("split", range(len(event_chunks._KEY) + 2))
def test_the_events_key_is_found_wherever_a_block_boundary_cuts_it(split, monkeypatch):
    block = 64
    monkeypatch.setattr(event_chunks, "BLOCK_BYTES", block)
    events = [{"ph": "X", "name": f"op{i}", "ts": i, "dur": 1} for i in range(40)]
    head = '{"schemaVersion": 1, "pad": "'
    pad = "x" * (block - split - len(head) - 3)  # the key's quote starts `split` bytes before the boundary
    text = f'{head}{pad}", "traceEvents": {json.dumps(events)}, "baseTimeNanoseconds": 1234}}'
    assert text.index('"traceEvents"') == block - split
    chunks = event_chunks.EventChunks(gzip.compress(text.encode()), "t.json.gz")
    assert chunks.whole is None
    assert [event for part in chunks for event in part] == [EVENT.decode(json.dumps(e)) for e in events]  # no Raw fields
    assert chunks.meta["baseTimeNanoseconds"] == 1234


def test_a_document_without_trace_events_is_given_up_after_the_head_limit(monkeypatch):
    # 64 MiB of whitespace: the head search stops at the limit instead of reading (and rescanning) it all,
    # and the whole-document reader then names the problem.
    inflated = []

    def counting(path, data):
        for b in original(path, data):
            inflated.append(len(b))
            yield b

    original = event_chunks._inflate
    monkeypatch.setattr(event_chunks, "_inflate", counting)
    data = gzip.compress(b"{" + b" " * (64 << 20) + b'"x": 1}', compresslevel=1)
    with pytest.raises(event_chunks.Unstreamable):
        list(event_chunks.EventChunks(data, "t.json.gz"))
    assert sum(inflated) <= event_chunks._MAX_HEAD + 2 * event_chunks.BLOCK_BYTES


def test_megabytes_of_whitespace_between_events_read_the_same_in_linear_time(tmp_path):
    """Whitespace is legal anywhere between tokens. 48 MiB of it, after the array's '[', before a ',' and after
    one, read with 64 KiB blocks: the same events as the unpadded document. The reader used to rescan (in a
    Python loop per byte) and recopy the growing buffer at every block: 97 s with half this padding, past
    the subprocess's 120 s bound with this one; now it takes seconds."""
    original = TRACES / "h100/bert_small_inference.json.gz"
    text = gzip.decompress(original.read_bytes())
    pad = b" \n\t\r" * (4 << 20)  # 16 MiB
    opened = text.index(b"[", text.index(b'"traceEvents"')) + 1
    middle = text.index(b"},", len(text) // 2) + 1  # the end of an event, just before its ','
    later = text.index(b"},", len(text) * 3 // 4) + 2  # just after a ','
    padded = text[:opened] + pad + text[opened:middle] + pad + text[middle:later] + pad + text[later:]
    path = tmp_path / "padded.json.gz"
    path.write_bytes(gzip.compress(padded, compresslevel=6))
    child = textwrap.dedent(f"""
        import json, sys
        from pathlib import Path
        import msgspec
        from plasmient_trace.sources import event_chunks, rawinput
        event_chunks.BLOCK_BYTES = 64 << 10
        path = Path({str(path)!r})
        chunks = event_chunks.EventChunks(rawinput.read_file_bytes(path), path)
        assert chunks.whole is None
        events = [json.loads(msgspec.json.encode(event)) for part in chunks for event in part]
        json.dump({{"events": events, "base": chunks.meta["baseTimeNanoseconds"]}}, sys.stdout)
    """)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout)
    doc = json.loads(text)  # an independent parser, on the unpadded document
    # each event as the typed schema reads it (its argument lists as their JSON values)
    assert got["events"] == [json.loads(msgspec.json.encode(EVENT.decode(json.dumps(e)))) for e in doc["traceEvents"]]
    assert got["base"] == doc.get("baseTimeNanoseconds")


def test_a_whitespace_gzip_bomb_inside_the_events_stops_at_the_cap_in_bounded_memory(tmp_path):
    """'{"traceEvents": [' then 1 GB of spaces in ~1 MB of gzip: one line naming the cap, exit 2, and the
    streaming reader keeps none of the whitespace (it used to hold 256 MiB of it, then copies)."""
    member = gzip.compress(b" " * (1 << 20), compresslevel=9)
    path = tmp_path / "spaces.json.gz"
    path.write_bytes(gzip.compress(b'{"traceEvents": [') + member * 1024)
    child = textwrap.dedent(f"""
        import sys
        from plasmient_trace.cli import main
        code = main(["ingest", {str(path)!r}, "--quiet", "--out", {str(tmp_path / 'o.jsonl')!r}])
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                print(int(line.split()[1]) * 1024, code)
    """)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    hwm, code = proc.stdout.split()
    assert code == "2", proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and "gzip bomb" in proc.stderr and str(path) in proc.stderr
    assert int(hwm) < 400 << 20, f"peak RSS {int(hwm) >> 20} MiB"
    assert not (tmp_path / "o.jsonl").exists()
