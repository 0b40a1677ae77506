"""Keeping a large output's written pages out of the page cache (drop-behind), on Linux.

An ingest of a 10^6-kernel trace writes 9 GB of JSON lines. Written plainly, all of it passes into the
page cache and stays there until the kernel needs the memory: it evicts the user's other files (a
dataset, checkpoints) to keep pages that are only waiting to be written back, and on a virtual machine
whose memory the host backs lazily, every new page of cache is a fault as well. Here a plain loop
writing 4 GB took 2.6-9.2 s of system time; with drop-behind, 1.2 s.

So every ``window`` bytes, writeback of the window just written is started (``sync_file_range``,
which does not wait), and the window before it, whose writeback was started one window ago, is
waited for and dropped from the cache (``posix_fadvise(POSIX_FADV_DONTNEED)``). About two windows
stay cached. What is written, and when it is durable, does not change: an ingest still fsyncs before
it renames the file into place. Where this is not Linux, or the file is not a regular file (a pipe,
``/dev/null``), or the file system refuses, the writes go through as they are.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import stat
from typing import Any, BinaryIO

__all__ = ["WINDOW_BYTES", "DropBehind", "DropBehindFile"]

WINDOW_BYTES = 64 << 20

_SYNC_WAIT_BEFORE, _SYNC_WRITE, _SYNC_WAIT_AFTER = 1, 2, 4
_PAGE = mmap.PAGESIZE


def _load_sync_file_range() -> Any:
    if not hasattr(os, "posix_fadvise"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


def _sync_range(fd: int, offset: int, length: int, flags: int) -> None:
    if _sync_file_range(fd, offset, length, flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


class DropBehind:
    """The drop-behind state of one file: how far writeback was started and how far the cache was dropped.
    ``advance(fd, end)`` after writing up to byte ``end``: every ``window`` bytes, the window just written
    goes to writeback and the one before it leaves the cache. Failures of the file system make it a no-op."""

    def __init__(self, start: int = 0, window: int | None = None) -> None:
        self.window = max(int(WINDOW_BYTES if window is None else window), 1)
        self.queued = start    # writeback started up to here
        self.dropped = start - start % _PAGE   # dropped from the cache up to here (a page boundary)
        self.refused = _sync_file_range is None

    def advance(self, fd: int, end: int) -> None:
        if self.refused or end - self.queued < self.window:
            return
        try:
            # up to the last whole page: the kernel drops only pages wholly in the range, so the page the
            # window ends in is dropped with the next one
            upto = self.queued - self.queued % _PAGE
            if upto > self.dropped:
                _sync_range(fd, self.dropped, upto - self.dropped, _SYNC_WAIT_BEFORE | _SYNC_WRITE | _SYNC_WAIT_AFTER)
                os.posix_fadvise(fd, self.dropped, upto - self.dropped, os.POSIX_FADV_DONTNEED)
                self.dropped = upto
            _sync_range(fd, self.queued, end - self.queued, _SYNC_WRITE)
            self.queued = end
        except OSError:
            self.refused = True  # this file system refuses: plain writes from here on

    def follow(self, fd: int) -> None:
        """``advance`` to the file's end as it is now, whoever wrote it (processes appending to one file
        included); nothing for what is not a regular file."""
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode):
            self.advance(fd, st.st_size)


def _regular_fd(f: BinaryIO) -> int | None:
    """The file's descriptor if it is a regular file (not a pipe, a device or an in-memory file), else None."""
    try:
        fd = f.fileno()
        return fd if stat.S_ISREG(os.fstat(fd).st_mode) else None
    except (AttributeError, OSError, ValueError):
        return None


class DropBehindFile:
    """A binary file (written from one thread at a time) whose bytes leave the page cache once they are
    two windows behind the end. Everything but ``write`` is the wrapped file's. The window must be well
    above the file object's buffer, so that what is dropped has left the buffer: the byte ranges advanced
    over may still be partly in it, and pages not yet written are skipped, then written and dropped a
    window later."""

    def __init__(self, f: BinaryIO, window: int | None = None) -> None:
        self._f = f
        self._fd = _regular_fd(f)  # None: writes pass through (as they do where the state is refused)
        self._end = f.tell() if self._fd is not None else 0  # bytes handed to the file so far
        self._state = DropBehind(self._end, window)

    def write(self, data: bytes | memoryview) -> int:
        n = self._f.write(data)
        if self._fd is not None:
            self._end += len(data)
            self._state.advance(self._fd, self._end)
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)
