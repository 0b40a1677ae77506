"""fd 2 held on a pipe for the length of a block, then handed back less the lines a pattern drops.

What the pipe received goes on to the real stderr once the block is over, so a line another thread writes
meanwhile is delayed, never lost, and each Python thread's lines keep their order. Why a pipe: the kernel ends
a pipe only once every reference to its write end is gone, and a write syscall under way holds its own, so
reading the pipe to its end after fd 2 went back collects each write that was under way then (a file could
take such a write after its size was read; CI lost a line that way).

The order kept is each Python thread's, which needs the GIL between two writes; a native thread writing to
fd 2 meanwhile loses nothing, but its line written just as fd 2 goes back may overtake one held before.

A drainer thread reads the pipe while the block runs, so no writer ever waits on a full pipe (that writer
could be the block itself). A process started during the block inherits the pipe as its stderr: the
hand-back then waits for the pipe's end a second at most (GIL held, so the job's Python threads wait too),
and the drainer forwards the rest as it comes.

Where there is no libc to call with the GIL held, or no pipe, descriptor or thread to be had, the block runs
with fd 2 as it is.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import functools
import os
import re
import select
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

# How long the hand-back waits, GIL held, for the pipe's end. A write under way when fd 2 goes back takes
# microseconds; only a process started during the hold keeps the pipe open longer.
END_WAIT_S = 1.0
_CHUNK = 4096  # PIPE_BUF: a pipe that polls writable takes this much without waiting


class _PollFd(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("events", ctypes.c_short), ("revents", ctypes.c_short)]


@functools.lru_cache(maxsize=1)
def _libc_holding_the_gil() -> Any:
    """libc's dup2, read, write and poll called through ctypes.PyDLL, which keeps the GIL through each call
    (None where there is no such libc)."""
    try:
        libc = ctypes.PyDLL(None, use_errno=True)
        for name, args, res in (("dup2", [ctypes.c_int, ctypes.c_int], ctypes.c_int),
                                ("read", [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_ssize_t),
                                ("write", [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t], ctypes.c_ssize_t),
                                ("poll", [ctypes.POINTER(_PollFd), ctypes.c_ulong, ctypes.c_int], ctypes.c_int)):
            fn = getattr(libc, name)
            fn.argtypes, fn.restype = args, res
        return libc
    except (OSError, AttributeError, TypeError):
        return None


def _read_pipe(libc: Any, fd: int, until: float | None) -> tuple[bytes, bool]:
    """GIL held: what the non-blocking pipe has now (until None), or all it gets before its end or the
    time.monotonic() deadline `until`; and whether its end came (a read error counts as one)."""
    chunks, buf, readable = [], ctypes.create_string_buffer(1 << 16), _PollFd(fd, select.POLLIN, 0)
    while True:
        n = libc.read(fd, buf, len(buf))
        if n > 0:
            chunks.append(ctypes.string_at(buf, n))
            continue
        err = ctypes.get_errno() if n < 0 else 0
        if err == errno.EINTR:
            continue
        left_ms = -1 if until is None else int((until - time.monotonic()) * 1000)
        if err != errno.EAGAIN or left_ms < 0:
            return b"".join(chunks), err != errno.EAGAIN
        libc.poll(ctypes.byref(readable), 1, left_ms)


def _forward(libc: Any, fd: int, data: bytes, drop: re.Pattern[bytes]) -> None:
    """`data` less the lines `drop` matches, written to `fd` with the GIL held while `fd` takes it at once.
    Where it would wait (a full pipe), the GIL is let go for that write: the pipe's reader may be a thread of
    this process, and only then can a thread's line written at that moment overtake its earlier ones."""
    data = b"".join(line for line in data.splitlines(keepends=True) if not drop.match(line))
    writable, view = _PollFd(fd, select.POLLOUT, 0), memoryview(data)
    try:
        while view:
            chunk = view[:_CHUNK]
            ready = libc.poll(ctypes.byref(writable), 1, 0) == 1 and writable.revents & select.POLLOUT
            n = libc.write(fd, bytes(chunk), len(chunk)) if ready else os.write(fd, chunk)
            if n < 0 and ctypes.get_errno() == errno.EINTR:
                continue
            if n <= 0:
                return  # the real stderr refuses: nowhere better to put the bytes
            view = view[n:]
    except OSError:
        pass


class _Hold:
    """fd 2 on a pipe from construction to hand_back(), and the thread draining that pipe."""

    def __init__(self, libc: Any) -> None:
        self.libc, self.drained, self.state = libc, [], "holding"  # then "done", or "forwarding" (a child's)
        self.drain_lock = threading.Lock()  # over each read of the pipe and the append of what it gave
        self.read_end, write_end = os.pipe()
        try:
            os.set_blocking(self.read_end, False)
            self.saved = os.dup(2)
        except OSError:
            os.close(self.read_end)
            os.close(write_end)
            raise
        self.drainer = threading.Thread(target=self._drain, name="plasmient-stderr-hold", daemon=True)
        try:
            self.drainer.start()
            os.dup2(write_end, 2)
        except (OSError, RuntimeError):
            self.state = "done"  # a started drainer leaves at the pipe's end, once write_end is closed below
            raise
        finally:
            os.close(write_end)  # from here fd 2 is our only write end
            if self.state == "done":
                self._close_after_drainer()

    def _drain(self) -> None:
        waiting = select.poll()
        waiting.register(self.read_end, select.POLLIN)
        try:
            at_end = False
            while not at_end:
                waiting.poll()  # GIL released
                with self.drain_lock:
                    if self.state != "holding":
                        break
                    chunk, at_end = _read_pipe(self.libc, self.read_end, None)
                    self.drained.append(chunk)
            if self.state == "forwarding":
                # A process started during the hold keeps the pipe: what it writes goes on to the real stderr as
                # it comes, until it is done (never blocked, never SIGPIPE'd). Only here can its lines and those
                # written to fd 2 meanwhile come out in another order than they were written.
                os.set_blocking(self.read_end, True)
                while chunk := os.read(self.read_end, 1 << 16):
                    while chunk:
                        chunk = chunk[os.write(self.saved, chunk):]
        except OSError:
            pass
        finally:
            if self.state == "forwarding":
                os.close(self.read_end)
                os.close(self.saved)
                _forwarders.discard(self.drainer)

    def hand_back(self, drop: re.Pattern[bytes]) -> None:
        """What the pipe received, less the lines `drop` matches, written to the real stderr; fd 2 restored.

        No other Python thread runs meanwhile (the GIL is held through libc calls, the switch interval pushed
        out), so none starts a write. What is held goes out before fd 2 goes back: a write that had let go of
        the GIL but not yet reached fd 2 lands on the real one, after its thread's earlier lines. A write under
        way into the pipe holds its own reference to it, so reading the pipe to its end collects it, and its
        thread needs the GIL to write again."""
        libc, locked, restored, reached_end = self.libc, False, False, False
        switch = sys.getswitchinterval()
        try:
            self.drain_lock.acquire()  # every byte the drainer read is in self.drained from here
            locked = True
            sys.setswitchinterval(60.0)
            now, _ = _read_pipe(libc, self.read_end, None)
            _forward(libc, self.saved, b"".join(self.drained) + now, drop)
            restored = libc.dup2(self.saved, 2) == 2
            rest, reached_end = _read_pipe(libc, self.read_end, time.monotonic() + END_WAIT_S)
            _forward(libc, self.saved, rest, drop)
        finally:
            if not restored:
                os.dup2(self.saved, 2)
            self.state = "done" if reached_end else "forwarding"
            if not reached_end:
                _forwarders.add(self.drainer)
            sys.setswitchinterval(switch)
            if locked:
                self.drain_lock.release()
        if reached_end:
            self._close_after_drainer()

    def _close_after_drainer(self) -> None:
        if self.drainer.ident is not None:  # started
            self.drainer.join(END_WAIT_S)  # quick: the pipe's end wakes it
        if not self.drainer.is_alive():
            os.close(self.read_end)
        os.close(self.saved)


# Drainers forwarding a child's stderr. The job's exit waits a little for them, so that a child's last line,
# written just before the job waits for it and exits, is not lost with the pipe.
_forwarders: set[threading.Thread] = set()


@atexit.register
def _let_forwarders_finish() -> None:
    until = time.monotonic() + END_WAIT_S
    for thread in list(_forwarders):
        thread.join(max(0.0, until - time.monotonic()))


@contextlib.contextmanager
def stderr_held(drop: re.Pattern[bytes]) -> Iterator[None]:
    """fd 2 goes to a pipe while the block runs; then everything written there but the lines `drop` matches
    (from their start) goes on to the real stderr. Where fd 2 cannot be held, the block runs as it is."""
    libc = _libc_holding_the_gil()
    try:
        hold = _Hold(libc) if libc is not None else None
    except (OSError, RuntimeError):
        hold = None  # fd 2 stays as it was
    if hold is None:
        yield
        return
    try:
        yield
    finally:
        hold.hand_back(drop)
