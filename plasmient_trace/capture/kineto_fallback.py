"""Kineto fallback of live capture: one torch.profiler run per full-depth step, read back as records.

Used when the job is on a GPU but cupti-python cannot be (not installed, or CUPTI already has another
subscriber), or when PLASMIENT_CUPTI=kineto forces it. torch.profiler is started at the step's start
and stopped at its end (no schedule: the session owns the step boundaries), exported to a temporary
Chrome trace and parsed by the same reader as offline ingest, so the step's kernels, launches and ops
carry Kineto's own External ids and join exactly. The session keeps its own module records.

Clock: read_kineto anchors timestamps on baseTimeNanoseconds (epoch ns). Measured on CPU (torch
2.13), a Kineto op falls inside a perf_counter_ns + epoch_offset_ns window taken around it (its end
7-9 µs before the window's end, with the op's own ~40 µs inside), so both clocks share the epoch
anchoring to within microseconds and no shift is applied.

Runs on the training thread only at step boundaries (start, stop, export); parsing the exported file
happens on the session's worker thread (:func:`read_step`).

Kineto writes two lines to the process's stderr (fd 2) every time a profiler starts and stops ("USDT:...
SyncActivityProfilerHandler.cpp:52] profiler_start", torch 2.13, whatever KINETO_LOG_LEVEL says once torch
is loaded): a job traced this way would find two lines of ours in its stderr per full-depth step. So fd 2
is held on a pipe for the length of each start and stop, and what arrived is written back without Kineto's
lines (:mod:`.stderr_hold`): every line of the job's own arrives, each Python thread's in order.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Iterator
from typing import Any

from ..records import RecordSet
from .stderr_hold import stderr_held

# One line of Kineto's own logger: "LEVEL:YYYY-MM-DD HH:MM:SS pid:tid File.cpp:NN] text"
_KINETO_LINE = re.compile(rb"^(?:USDT|STAGE|INFO|WARNING|ERROR|VERBOSE):\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \S+:\d+\] ")


@contextlib.contextmanager
def _kineto_lines_withheld() -> Iterator[None]:
    """fd 2 held while the block runs (a profiler start or stop at a step boundary), then everything written
    to it but Kineto's own log lines goes on to the real stderr (:func:`stderr_hold.stderr_held`)."""
    with stderr_held(_KINETO_LINE):
        yield


# Marks the profile objects that are ours, so the session's torch.profiler start/stop patch (which
# tracks the *user's* profiler) can tell them apart.
OWN_ATTR = "_plasmient_own"


class KinetoCollector:
    """Starts/stops torch.profiler around one step and hands back the path of its exported trace."""

    def __init__(self, cuda: bool) -> None:
        from torch.profiler import ProfilerActivity

        self.cuda = cuda
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self._prof: Any = None

    @property
    def running(self) -> bool:
        return self._prof is not None

    def start_step(self) -> None:
        """Start profiling this step (raises if the profiler cannot start; the session reports it)."""
        from torch.profiler import profile

        prof = profile(activities=self.activities, record_shapes=True)
        setattr(prof, OWN_ATTR, True)
        with _kineto_lines_withheld():
            prof.start()
        self._prof = prof

    def end_step(self) -> str | None:
        """Stop profiling and export the step's trace to a temp file; its path (None if not running)."""
        prof, self._prof = self._prof, None
        if prof is None:
            return None
        with _kineto_lines_withheld():
            prof.stop()
        fd, path = tempfile.mkstemp(prefix="plasmient-kineto-", suffix=".json")
        os.close(fd)
        try:
            prof.export_chrome_trace(path)
        except BaseException:
            _unlink(path)
            raise
        finally:
            _release(prof)
        return path

    def abort(self) -> None:
        """Stop without exporting (the user's profiler is about to start, or the session closes)."""
        prof, self._prof = self._prof, None
        if prof is not None:
            try:
                with _kineto_lines_withheld():
                    prof.stop()
            except Exception:
                pass
            _release(prof)


def read_step(path: str) -> RecordSet:
    """The exported trace of one step -> its records (kernels, launches, ops); the file is removed."""
    from ..sources.kineto import read_kineto

    try:
        return read_kineto(path)
    finally:
        _unlink(path)


def _release(prof: Any) -> None:
    """Free the profiler's results now, on this thread. A profile object sits in a reference cycle
    (its action map holds its bound methods), so otherwise the cyclic GC frees the C++ results later,
    on whichever thread it runs, possibly while the next step's profiler is active: that segfaults
    (seen with torch 2.13 on CPU)."""
    inner = getattr(prof, "profiler", None)
    if inner is not None:
        for name in ("kineto_results", "_function_events", "_old_function_events"):
            if hasattr(inner, name):
                setattr(inner, name, None)
    for name in ("profiler", "action_map"):
        if hasattr(prof, name):
            setattr(prof, name, None)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
