"""Drop-behind output: a large file written by an ingest leaves the page cache as it is written, and it is
the same file, byte for byte. Residency is read from the kernel (mincore over a mapping never touched)."""

from __future__ import annotations

import ctypes
import io
import mmap
import os
from pathlib import Path

import pytest
from conftest import trace_path

from plasmient_trace import cli
from plasmient_trace.export import page_cache
from plasmient_trace.export.page_cache import DropBehindFile

pytestmark = pytest.mark.skipif(page_cache._sync_file_range is None, reason="drop-behind needs Linux's sync_file_range")

MiB = 1 << 20


def _resident_pages(path: Path) -> list[bool]:
    """Per page of the file: is it in the page cache? Mapping a file does not read it; mincore says."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = path.stat().st_size
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            vec = (ctypes.c_ubyte * pages)()
            assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
            return [bool(v & 1) for v in vec]
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def _sync_file_range_works(tmp: Path) -> bool:
    """Whether this file system takes sync_file_range (where it refuses, drop-behind writes plainly)."""
    probe = tmp / "sfr.bin"
    probe.write_bytes(b"x" * 8192)
    fd = os.open(probe, os.O_RDWR)
    try:
        return page_cache._sync_file_range(fd, 0, 8192, 2) == 0
    finally:
        os.close(fd)


def _cache_drops_pages(tmp: Path) -> bool:
    """Whether this file system lets a written, synced file leave the cache (tmpfs, for one, does not) and
    takes the writeback requests drop-behind makes."""
    if not _sync_file_range_works(tmp):
        return False
    probe = tmp / "probe.bin"
    probe.write_bytes(os.urandom(4 * MiB))
    fd = os.open(probe, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return sum(_resident_pages(probe)) < len(_resident_pages(probe)) // 2


def test_a_file_of_sixteen_windows_keeps_about_its_last_window_cached(tmp_path):
    if not _cache_drops_pages(tmp_path):
        pytest.skip("this file system keeps written pages in the cache whatever they are advised")
    window = 2 * MiB
    path = tmp_path / "out.bin"
    data = os.urandom(16 * window)
    with open(path, "wb", buffering=MiB) as raw:
        f = DropBehindFile(raw, window=window)
        for at in range(0, len(data), 64 << 10):
            f.write(data[at:at + (64 << 10)])
        f.flush()
        resident = _resident_pages(path)
    assert path.read_bytes() == data
    per_page = window // mmap.PAGESIZE
    # dropped: everything two windows behind the end; the last window's writeback was only started
    assert not any(resident[:14 * per_page])
    assert sum(resident) <= 2 * per_page


def test_without_drop_behind_the_same_file_stays_cached(tmp_path):
    """The control: the same writes through the plain file leave it in the cache, so the test above
    measures drop-behind, not the machine."""
    if not _cache_drops_pages(tmp_path):
        pytest.skip("this file system keeps written pages in the cache whatever they are advised")
    path = tmp_path / "out.bin"
    data = os.urandom(32 * MiB)
    with open(path, "wb", buffering=MiB) as f:
        for at in range(0, len(data), 64 << 10):
            f.write(data[at:at + (64 << 10)])
    assert sum(_resident_pages(path)) > len(data) // mmap.PAGESIZE // 2


def test_an_ingest_writes_the_same_bytes_with_and_without_drop_behind(tmp_path, monkeypatch):
    trace = trace_path("a100/cuda_graphs_rank0_of16.json.gz")
    takes_requests = _sync_file_range_works(tmp_path)
    with monkeypatch.context() as plain_writes:
        plain_writes.setattr(page_cache, "_sync_file_range", None)  # as where there is no sync_file_range
        assert cli.main(["ingest", str(trace), "--job-id", "dropbehind", "--out", str(tmp_path / "plain.jsonl")]) == 0
    monkeypatch.setattr(page_cache, "WINDOW_BYTES", 3 * MiB)  # many windows in the 80 MB of lines
    calls = []
    real = page_cache._sync_file_range

    def counted(fd, offset, length, flags):
        calls.append((offset, length, flags))
        return real(fd, offset, length, flags)

    monkeypatch.setattr(page_cache, "_sync_file_range", counted)
    assert cli.main(["ingest", str(trace), "--job-id", "dropbehind", "--out", str(tmp_path / "dropped.jsonl")]) == 0
    plain, dropped = (tmp_path / "plain.jsonl").read_bytes(), (tmp_path / "dropped.jsonl").read_bytes()
    assert len(plain) > 20 * 3 * MiB
    assert dropped == plain
    if not takes_requests:
        return  # this file system refuses: one refused request, then plain writes (the bytes are what matter)
    # the file handed to writeback window after window, from its first byte to its last window, each range
    # started once and waited for (then dropped) one window later
    started = [(o, n) for o, n, fl in calls if fl == 2]
    waited = [(o, n) for o, n, fl in calls if fl == 7]
    ends = [o + n for o, n in started]
    assert started[0][0] == 0 and [o for o, _ in started[1:]] == ends[:-1]
    assert all(n >= 3 * MiB for _, n in started) and len(plain) - ends[-1] < 3 * MiB
    # waited for and dropped one window later, up to the last whole page of each window: every byte but the
    # last window's, once
    page = mmap.PAGESIZE
    assert [o for o, _ in waited] == [0] + [e - e % page for e in ends[:len(waited) - 1]]
    assert [o + n for o, n in waited] == [e - e % page for e in ends[:-1]]


def test_a_file_system_that_refuses_gets_plain_writes(tmp_path, monkeypatch):
    def refuse(fd, offset, length, flags):
        ctypes.set_errno(22)  # EINVAL
        return -1

    monkeypatch.setattr(page_cache, "_sync_file_range", refuse)
    path = tmp_path / "out.bin"
    data = os.urandom(8 * MiB)
    with open(path, "wb", buffering=MiB) as raw:
        f = DropBehindFile(raw, window=2 * MiB)
        for at in range(0, len(data), MiB):
            f.write(data[at:at + MiB])
        assert f._state.refused  # given up after the first refusal
    assert path.read_bytes() == data


def test_what_is_not_a_regular_file_passes_through():
    buf = io.BytesIO()
    f = DropBehindFile(buf, window=4)
    f.write(b"0123456789")
    assert f._fd is None and buf.getvalue() == b"0123456789"
    r, w = os.pipe()
    try:
        with os.fdopen(w, "wb", buffering=0) as pipe:
            p = DropBehindFile(pipe, window=4)
            assert p._fd is None
            p.write(b"abcdefgh")
        assert os.read(r, 16) == b"abcdefgh"
    finally:
        os.close(r)


def test_the_live_file_leaves_the_cache_behind_its_end_as_steps_are_appended(tmp_path, monkeypatch):
    if not _cache_drops_pages(tmp_path):
        pytest.skip("this file system keeps written pages in the cache whatever they are advised")
    from plasmient_trace.export.otlp_json import write_jsonl
    from plasmient_trace.export.sinks import FileSink
    from plasmient_trace.pipeline import IngestOptions, stream_records
    from plasmient_trace.sources.kineto import read_kineto

    monkeypatch.setattr(page_cache, "WINDOW_BYTES", 2 * MiB)
    records = read_kineto(trace_path("a100/cuda_graphs_rank0_of16.json.gz"))
    live = FileSink(tmp_path / "live.jsonl", append=True)
    expected = tmp_path / "expected.jsonl"
    with open(expected, "wb") as f:
        for part in stream_records([records], IngestOptions(job_id="live-append", chunk_rows=1)).parts:
            live.write(part)  # one batch per step, each line one O_APPEND write
            write_jsonl(part, f)
    resident = _resident_pages(tmp_path / "live.jsonl")  # before reading it back, which caches it again
    size = (tmp_path / "live.jsonl").stat().st_size
    assert size > 20 * 2 * MiB
    # a batch is a whole step here (about 15 MB), so the file advances a batch at a time: all but the last
    # two batches (at most 2 x 17 MB) are dropped
    behind = (size - 34 * MiB) // mmap.PAGESIZE
    assert behind > 0 and not any(resident[:behind])
    assert (tmp_path / "live.jsonl").read_bytes() == expected.read_bytes()
