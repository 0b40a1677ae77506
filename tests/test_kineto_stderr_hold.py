"""fd 2 held around each torch.profiler start and stop (capture.kineto_fallback._kineto_lines_withheld): the
job's stderr keeps every line of its own, each thread's in order, and none of Kineto's, however busy its other
threads are with fd 2, however much they write while it is held, and whatever process it starts meanwhile.

No profiler runs here: a Kineto-like line written to fd 2 inside the window stands for Kineto's."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from plasmient_trace.capture.kineto_fallback import _KINETO_LINE, _kineto_lines_withheld

REPO = Path(__file__).resolve().parents[1]
KINETO = b"USDT:2025-06-01 12:00:00 4242:4242 SyncActivityProfilerHandler.cpp:52] profiler_start\n"
assert _KINETO_LINE.match(KINETO)


def _numbered(lines: list[str], prefix: str) -> list[int]:
    return [int(line[len(prefix):]) for line in lines if line.startswith(prefix)]


def test_lines_written_by_other_threads_during_hundreds_of_holds_all_arrive_once_and_in_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two threads write numbered lines to fd 2 as fast as they can, one with os.write, one through a
    sys.stderr like Python's own, while the main thread opens and closes the hold 300 times (a step boundary
    each), leaving no descriptor or thread behind. A write whose syscall is under way while fd 2 goes back must still arrive, and after the lines
    that thread wrote before it."""
    open_fds = set(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else set()
    out = os.open(tmp_path / "stderr", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    real_fd2 = os.dup(2)
    os.dup2(out, 2)
    # sys.stderr as Python makes it: line-buffered text over a buffered writer over fd 2 (pytest's own
    # sys.stderr writes to its capture file, not to fd 2).
    monkeypatch.setattr(sys, "stderr", open(2, "w", buffering=1, encoding="utf-8", closefd=False))
    stop = threading.Event()
    written = {}

    def raw_writer() -> None:
        i = 0
        while not stop.is_set():
            os.write(2, b"raw %d\n" % i)
            i += 1
        written["raw"] = i

    def text_writer() -> None:
        i = 0
        while not stop.is_set():
            sys.stderr.write(f"text {i}\n")
            i += 1
        written["text"] = i

    side = [threading.Thread(target=raw_writer), threading.Thread(target=text_writer)]
    try:
        for t in side:
            t.start()
        for window in range(300):
            with _kineto_lines_withheld():
                os.write(2, b"main %d\n" % window)
                os.write(2, KINETO)
                time.sleep(0.0001)  # the profiler's start lets other threads run
        stop.set()
        for t in side:
            t.join()
    finally:
        stop.set()
        os.dup2(real_fd2, 2)
        os.close(real_fd2)
        os.close(out)
    if open_fds:  # each hold closes what it opened, and its drainer is gone
        assert set(os.listdir("/proc/self/fd")) == open_fds
    assert not [t for t in threading.enumerate() if t.name == "plasmient-stderr-hold"]
    lines = (tmp_path / "stderr").read_text().splitlines()
    assert not [line for line in lines if _KINETO_LINE.match(line.encode())]
    assert _numbered(lines, "main ") == list(range(300))
    for prefix in ("raw", "text"):
        got = _numbered(lines, f"{prefix} ")
        assert len(got) == written[prefix], f"{prefix}: {written[prefix] - len(got)} line(s) lost or doubled"
        assert got == list(range(written[prefix])), f"{prefix}: out of order"
    assert len(lines) == 300 + written["raw"] + written["text"]  # nothing else, no line torn apart


def _job(code: str, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    prelude = ("import os, subprocess, sys, threading, time\n"
               "from plasmient_trace.capture.kineto_fallback import _kineto_lines_withheld\n"
               f"KINETO = {KINETO!r}\n")
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, env=env, timeout=timeout)


def test_more_than_a_pipe_holds_written_during_one_hold_neither_blocks_the_job_nor_is_lost() -> None:
    """A side thread writes 1.3 MiB to fd 2 inside one hold, and the main thread (standing for Kineto inside
    prof.start()) writes to fd 2 after it: neither may wait on a full pipe, and all of it arrives."""
    done = _job("""
blob = b"".join(b"big %06d %s\\n" % (i, b"x" * 100) for i in range(12000))
side = threading.Thread(target=lambda: os.write(2, blob))
with _kineto_lines_withheld():
    side.start()
    side.join()
    os.write(2, KINETO)
    os.write(2, b"main done\\n")
print("ok")
""", timeout=60)
    assert done.returncode == 0 and done.stdout == b"ok\n"
    blob = b"".join(b"big %06d %s\n" % (i, b"x" * 100) for i in range(12000))
    assert len(blob) > 1 << 20
    assert done.stderr == blob + b"main done\n"


def test_a_stderr_read_by_a_thread_of_the_job_itself_takes_a_holds_worth_of_more_than_a_pipe_holds() -> None:
    """Output-capturing tools make fd 2 a pipe that a thread of the job reads. Handing back 300 KiB must not
    wait on that pipe with the GIL held, which its reader needs."""
    done = _job("""
r, w = os.pipe()
os.dup2(w, 2)
os.close(w)
got = []
reader = threading.Thread(target=lambda: got.extend(iter(lambda: os.read(r, 1 << 16), b"")))
reader.start()
blob = b"".join(b"held %06d\\n" % i for i in range(25000))
side = threading.Thread(target=lambda: os.write(2, blob))
with _kineto_lines_withheld():
    side.start()
    side.join()
    os.write(2, KINETO)
os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # the pipe's last write end: its reader ends
reader.join()
print(b"".join(got) == blob, len(blob))
""", timeout=30)
    assert done.returncode == 0 and done.stdout == b"True 300000\n", done


def test_a_process_started_during_a_hold_keeps_its_stderr_and_does_not_keep_the_hold_open() -> None:
    """A child started inside the hold inherits fd 2 as it is then. The hold ends within its bound (about a
    second) although the child keeps that fd 2 open, and what the child writes later still reaches the job's
    stderr, also when the job exits right after the child."""
    done = _job("""
began = time.monotonic()
with _kineto_lines_withheld():
    os.write(2, KINETO)
    child = subprocess.Popen(["sh", "-c", "sleep 2; echo child >&2"])
print(round(time.monotonic() - began, 3))
os.write(2, b"after\\n")
child.wait()
""", timeout=60)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) < 1.8
    assert done.stderr == b"after\nchild\n"
