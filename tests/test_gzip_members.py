"""A live `.gz` span file is one gzip member per trace's line. A write a full disk cut short leaves part of
a member with the next trace's member after it; read as one gzip stream, the file was refused from the
cut on ("its first line is incomplete", every later trace lost). Read member by member, only the cut
member's trace is left out, with a note naming its byte offset."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
from conftest import ingested

from plasmient_trace.cli import main
from plasmient_trace.export.otlp_json import read_jsonl, write_jsonl

# real traces' lines: two steps of an MI250 job, an A100 AlexNet step, a CPU-only rank
TRACES = ("mi250/minitoy_train.json.gz", "a100/alexnet.json.gz", "cpu_only/rank-34.json.gz")


@pytest.fixture(scope="module")
def lines(tmp_path_factory: pytest.TempPathFactory) -> list[bytes]:
    out: list[bytes] = []
    for i, name in enumerate(TRACES):
        path = tmp_path_factory.mktemp("lines") / f"{i}.jsonl"
        write_jsonl(ingested(name).batch, path)
        out += path.read_bytes().splitlines(keepends=True)
    assert len(out) == 4
    return out


def _trace_ids(data: bytes, tmp_path: Path) -> set[str]:
    path = tmp_path / "plain.jsonl"
    path.write_bytes(data)
    return set(read_jsonl(path).table.column("trace_id").to_pylist())


def _members(lines: list[bytes]) -> list[bytes]:
    # as the live sink writes them (sinks.FileSink: gzip -5, no timestamp)
    return [gzip.compress(line, compresslevel=5, mtime=0) for line in lines]


@pytest.mark.parametrize("cut", ["header", "a third", "half", "all but its trailer", "all but one byte"])
@pytest.mark.parametrize("which", [0, 1, 2])
def test_a_member_cut_short_before_others_costs_only_its_own_trace(lines, tmp_path, which, cut) -> None:
    members = _members(lines)
    keep = {"header": 6, "a third": len(members[which]) // 3, "half": len(members[which]) // 2,
            "all but its trailer": len(members[which]) - 8, "all but one byte": len(members[which]) - 1}[cut]
    at = sum(map(len, members[:which]))
    path = tmp_path / "live.jsonl.gz"
    path.write_bytes(b"".join(members[:which]) + members[which][:keep] + b"".join(members[which + 1:]))
    notes: list[str] = []
    got = set(read_jsonl(path, notes=notes).table.column("trace_id").to_pylist())
    assert got == _trace_ids(b"".join(lines[:which] + lines[which + 1:]), tmp_path)
    assert notes == [f"{path}: bytes {at:,} to {at + keep - 1:,} hold a gzip member cut short (a write that "
                     "failed, e.g. on a full disk): left out"]
    with pytest.raises(ValueError, match=f"bytes {at:,} to {at + keep - 1:,} hold a gzip member cut short"):
        read_jsonl(path)  # without notes, a file with a trace missing is refused, as any bad line is


def test_two_members_cut_short_one_after_the_other_are_one_stretch_left_out(lines, tmp_path) -> None:
    members = _members(lines)
    path = tmp_path / "live.jsonl.gz"
    first, second = members[1][: len(members[1]) // 2], members[2][: len(members[2]) // 3]
    path.write_bytes(members[0] + first + second + members[3])
    notes: list[str] = []
    got = set(read_jsonl(path, notes=notes).table.column("trace_id").to_pylist())
    assert got == _trace_ids(lines[0] + lines[3], tmp_path)
    # no whole member between them: one stretch of broken bytes, from the first cut to the member after both
    start, end = len(members[0]), len(members[0]) + len(first) + len(second)
    assert notes == [f"{path}: bytes {start:,} to {end - 1:,} hold a gzip member cut short (a write that failed, "
                     "e.g. on a full disk): left out"]


def test_the_last_member_still_being_written_is_left_out_as_an_incomplete_line(lines, tmp_path) -> None:
    members = _members(lines)
    path = tmp_path / "live.jsonl.gz"
    path.write_bytes(b"".join(members[:3]) + members[3][: len(members[3]) // 2])
    notes: list[str] = []
    got = set(read_jsonl(path, notes=notes).table.column("trace_id").to_pylist())
    assert got == _trace_ids(b"".join(lines[:3]), tmp_path)
    assert notes == [f"{path}: the line after line 3 is incomplete (a run still writing the file, or the file cut "
                     "short): left out; the 3 line(s) before it are read"]


@pytest.mark.parametrize("padding", [1, 2, 4096, 70_000])
def test_zero_padding_after_the_last_member_is_read_as_gzip_reads_it_with_no_note(lines, tmp_path, padding) -> None:
    # A preallocated or block-padded file ends in zeros; Python's gzip (the oracle here) and gzip(1) skip them.
    data = b"".join(_members(lines)) + bytes(padding)
    assert gzip.decompress(data) == b"".join(lines)
    path = tmp_path / "padded.jsonl.gz"
    path.write_bytes(data)
    notes: list[str] = []
    got = set(read_jsonl(path, notes=notes).table.column("trace_id").to_pylist())
    assert got == _trace_ids(gzip.decompress(data), tmp_path)
    assert notes == []


def test_zeros_where_a_member_should_be_are_still_bytes_left_out(lines, tmp_path) -> None:
    # Zeros between whole members are not padding: a write that never reached the disk (a crash that left
    # the file's length and zero-filled blocks) sits there, and the note says where.
    members = _members(lines)
    gap = 512
    path = tmp_path / "holed.jsonl.gz"
    path.write_bytes(members[0] + bytes(gap) + b"".join(members[1:]) + bytes(100))
    notes: list[str] = []
    got = set(read_jsonl(path, notes=notes).table.column("trace_id").to_pylist())
    assert got == _trace_ids(b"".join(lines), tmp_path)
    at = len(members[0])
    assert notes == [f"{path}: bytes {at:,} to {at + gap - 1:,} hold a gzip member cut short (a write that failed, "
                     "e.g. on a full disk): left out"]


def test_a_live_gz_file_a_full_disk_cut_short_reports_every_other_trace(lines, tmp_path, nearly_full_disk,
                                                                        capsys) -> None:
    """The live sink itself on a disk that fills mid-line and has room again later: `plasmient report`
    reads every trace but the cut one, where it refused the whole file."""
    from plasmient_trace.export.sinks import FileSink, OutputError

    batches = []
    for i, line in enumerate(lines):
        (tmp_path / f"{i}.jsonl").write_bytes(line)
        batches.append(read_jsonl(tmp_path / f"{i}.jsonl"))
    path = tmp_path / "traces.jsonl.gz"
    sink = FileSink(path, append=True)
    sink.write(batches[0])
    at = path.stat().st_size  # where the second trace's member starts
    disk = nearly_full_disk(300)
    with pytest.raises(OutputError, match="short write"):
        sink.write(batches[1])  # 300 bytes of its member reach the disk
    disk.full = False
    sink.write(batches[2])
    sink.write(batches[3])
    notes: list[str] = []
    got = set(read_jsonl(path, notes=notes).table.column("trace_id").to_pylist())
    assert got == _trace_ids(lines[0] + lines[2] + lines[3], tmp_path)
    assert len(notes) == 1 and "cut short" in notes[0]
    assert main(["report", str(path)]) == 0
    assert (f"{path}: bytes {at:,} to {at + 299:,} hold a gzip member cut short (a write that failed, e.g. on a "
            "full disk): left out") in capsys.readouterr().err


def test_members_cut_at_random_points_leave_out_exactly_the_cut_traces(lines, tmp_path) -> None:
    """100 files with a fixed seed: each member kept whole or cut at a random byte (the last one may be cut
    too, a run still writing); what is read is exactly the whole members' traces, never a bad line."""
    import random

    rng = random.Random(20261207)
    members = _members(lines)
    ids = [_trace_ids(line, tmp_path) for line in lines]
    path = tmp_path / "live.jsonl.gz"
    for _ in range(100):
        cut = [rng.random() < 0.4 for _ in members]
        path.write_bytes(b"".join(m[: rng.randrange(1, len(m))] if c else m for m, c in zip(members, cut)))
        notes: list[str] = []
        got = set(read_jsonl(path, notes=notes).table.column("trace_id").to_pylist())
        assert got == set().union(*(i for i, c in zip(ids, cut) if not c)), cut
        assert bool(notes) == any(cut) and all("cut short" in n or "is incomplete" in n for n in notes)


def test_a_file_of_headers_inside_headers_is_refused_in_one_line_not_read_once_per_header(tmp_path) -> None:
    """Hostile input: each gzip header opens a stored block that holds the next header, and the file ends
    before any closes, so every header is a member the file ends inside, with another header after its
    start. Re-read from each of them, 5,000 nested headers fed the inflater 143 MB from a 75 KB file, growing
    with the square of the headers: about 2.3 GB for the 20,000 here."""
    import struct

    header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"
    stored = b"\x00" + struct.pack("<HH", 0xFFFF, 0)  # a stored block, not the last, of 65,535 bytes
    path = tmp_path / "nested.jsonl.gz"
    path.write_bytes((header + stored) * 20_000)
    with pytest.raises(ValueError) as err:
        read_jsonl(path, notes=[])
    assert str(err.value) == (f"{path}: gzip members broken past repair (re-read more than 4x the file looking "
                              "for whole ones)")
    assert main(["report", str(path)]) == 2
