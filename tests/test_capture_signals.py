"""The traced job ends as it would untraced, whatever signal ends it and whoever sends it: every step it
finished is in the file, its exit status and output are the plain run's, and `plasmient run` passes on what
is sent to it alone. Split from test_capture_never_breaks.py (whose helpers these are) so the two long
files run side by side under pytest-xdist."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from test_capture_never_breaks import (STEPS_JOB, TIMEOUT, _env, _plain, _same_run, _script, _steps, _traced,
                                       _warm_cache)

__all__ = ["_warm_cache"]  # the autouse fixture that fills the native build cache the jobs share


def _signal_a_traced_job_mid_run(tmp_path: Path, send: Callable[[int], None]) -> tuple[int, int, bytes]:
    """`plasmient run` of a 100,000-step job; once 30 steps printed, ``send(pid of plasmient run)``. Returns the
    exit status, the steps the job printed (finished) and its stderr."""
    script = _script(tmp_path, "steps.py", STEPS_JOB)
    # A terminal's job takes SIGINT. Run from a shell's background job (no job control), the tests would
    # inherit SIGINT ignored, and so would the job: it would never die of it. Exec it with the default.
    cmd = [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
           "os.execv(sys.argv[1], sys.argv[1:])", sys.executable, "-m", "plasmient_trace.cli", "run", "--out",
           str(tmp_path / "t.jsonl"), "--", sys.executable, str(script), "100000", "0.02"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    printed = []
    for line in proc.stdout:  # wait for the job to be well into its loop
        printed.append(line)
        if len(printed) == 30:
            break
    send(proc.pid)
    rest, err = proc.communicate(timeout=TIMEOUT)
    return proc.returncode, len(printed) + len(rest.splitlines()), err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_mid_run_flushes_every_finished_step_and_keeps_the_exit_status(tmp_path: Path, sig: int) -> None:
    # as a terminal or a scheduler does: the whole process group
    code, finished, err = _signal_a_traced_job_mid_run(tmp_path, lambda pid: os.killpg(pid, sig))
    # the child died of the signal and `plasmient run` reports it the way the plain job would
    assert code == -sig, err.decode()[-2000:]
    steps = _steps(tmp_path / "t.jsonl")
    assert steps[: finished] == list(range(finished))  # every step the job finished is in the file
    assert b"Traceback" not in err or sig == signal.SIGINT  # SIGINT: the job's own KeyboardInterrupt


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGUSR1, signal.SIGTERM])
def test_a_signal_sent_to_plasmient_run_alone_reaches_the_job_once(tmp_path: Path, sig: int) -> None:
    """A supervisor, an IDE's stop button or `timeout --foreground` signals the pid it started. SIGINT was
    not passed on (the job trained to the end and exited 0) and SIGUSR1 killed only the wrapper (the job
    trained on, orphaned). Each now ends the job as it ends the plain one, and SIGINT arrives once, so the
    flush at exit is not cut short by a second one."""
    code, finished, err = _signal_a_traced_job_mid_run(tmp_path, lambda pid: os.kill(pid, sig))  # not its group
    assert code == -sig, err.decode()[-2000:]
    assert finished < 100000  # the job stopped, as the plain one does
    if sig != signal.SIGUSR1:  # whose default action is to end the job without a flush, plain or traced
        steps = _steps(tmp_path / "t.jsonl")
        assert steps[: finished] == list(range(finished))


def test_plasmient_run_inside_plasmient_run_traces_once_and_the_job_s_own_sitecustomize_runs_once(tmp_path: Path) -> None:
    # the two shims on the path each chained to the other: "Error in sitecustomize ... RecursionError" in the
    # job's stderr, and the outer run said "nothing was traced" though the inner one's file held every step
    script = _script(tmp_path, "steps.py", STEPS_JOB)
    own = tmp_path / "own"
    own.mkdir()
    (own / "sitecustomize.py").write_text("import os, sys\nif sys.argv[0].endswith('steps.py'):\n"
                                         "    print('the job sitecustomize ran', file=sys.stderr)\n")
    env = _env(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(own), env["PYTHONPATH"]])
    plain = subprocess.run([sys.executable, str(script), "4", "0"], cwd=tmp_path, env=env, capture_output=True,
                           timeout=TIMEOUT)
    run = [sys.executable, "-m", "plasmient_trace.cli", "run", "--out"]
    nested = subprocess.run([*run, str(tmp_path / "outer.jsonl"), "--", *run, str(tmp_path / "inner.jsonl"), "--",
                             sys.executable, str(script), "4", "0"], cwd=tmp_path, env=env, capture_output=True,
                            timeout=TIMEOUT)
    assert plain.stderr.decode().count("the job sitecustomize ran") == 1
    _same_run(plain, nested)
    assert b"nothing was traced" not in nested.stderr and b"sitecustomize" not in nested.stderr.replace(b"the job sitecustomize ran", b"")
    assert _steps(tmp_path / "inner.jsonl") == [0, 1, 2, 3]


CHAINING_JOB = STEPS_JOB.replace("for i in range(steps):", """import os, signal
stop = []
replaced = signal.getsignal(signal.SIGTERM)
def notice(signum, frame):  # as Lightning's signal connector: note it, call the handler it replaced, carry on
    stop.append(signum)
    if callable(replaced):
        replaced(signum, frame)
signal.signal(signal.SIGTERM, notice)
for i in range(steps):
    if i == 3:
        os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's preemption notice
    if stop and i == 6:
        print("stopping at a step boundary, checkpoint saved", flush=True)
        if sys.argv[3] == "_exit":
            os._exit(0)  # no atexit: what the capture queued before this point is all there is
        break""")


EXIT_CHAINING_JOB = STEPS_JOB.replace("for i in range(steps):", """import os, signal
replaced = signal.getsignal(signal.SIGTERM)
print("handler found:", replaced, flush=True)
def on_term(signum, frame):  # the usual idiom: call the handler it replaced, else end as the default would
    if callable(replaced):
        replaced(signum, frame)
    else:
        sys.exit(143)
signal.signal(signal.SIGTERM, on_term)
for i in range(steps):
    if i == 4:
        os.kill(os.getpid(), signal.SIGTERM)""")


def test_a_job_that_ends_on_sigterm_unless_a_handler_was_there_before_still_ends(tmp_path: Path) -> None:
    """signal.getsignal found our handler, callable: the job called it and trained on to the end, exit 0,
    where the plain job exits 143 at the notice, a preemption swallowed. The job now sees what it would see
    without us, and every step up to the notice is in the file."""
    script = _script(tmp_path, "exit_chaining.py", EXIT_CHAINING_JOB)
    plain = _plain(tmp_path, script, "20", "0")
    assert plain.returncode == 143  # and what it printed of the handler it found is the traced run's too
    traced = _traced(tmp_path, script, "20", "0", PLASMIENT_EVERY="2")
    _same_run(plain, traced)
    assert _steps(tmp_path / "t.jsonl") == list(range(4))


@pytest.mark.parametrize("end", ["break", "_exit"])
def test_a_job_that_chains_our_sigterm_handler_into_its_own_decides_whether_it_ends(tmp_path: Path, end: str) -> None:
    """Lightning composes the SIGTERM handler it finds into its own and trains on to a step boundary (or
    past the notice, for SLURM's requeue). Our handler, called from theirs, killed the job on the spot; now
    it writes what is queued and returns, and tracing goes on."""
    script = _script(tmp_path, "chaining.py", CHAINING_JOB)
    plain = _plain(tmp_path, script, "20", "0", end)
    assert plain.returncode == 0 and plain.stdout.splitlines()[-1].startswith(b"stopping at a step boundary")
    traced = _traced(tmp_path, script, "20", "0", end, PLASMIENT_EVERY="2")
    _same_run(plain, traced)
    steps = _steps(tmp_path / "t.jsonl")
    if end == "break":
        assert steps == list(range(6))  # atexit flushed the steps after the notice as well
    else:
        assert steps[:3] == [0, 1, 2]  # the steps finished before the notice were written by the handler


INTERRUPTING_SIGTERM_JOB = STEPS_JOB.replace("import sys, time, torch", """import os, signal, sys, time, torch
signal.signal(signal.SIGTERM, signal.default_int_handler)  # a SIGTERM is a Ctrl-C to this job""") + '''
os.kill(os.getpid(), signal.SIGTERM)
'''


def test_a_job_whose_sigterm_handler_raises_keeps_its_own_traceback(tmp_path: Path) -> None:
    """A job that makes SIGTERM raise KeyboardInterrupt (signal.default_int_handler) printed a line of
    plasmient_trace/capture/ending_signals.py in its traceback: the wrapper that flushes before the job's
    handler runs was a frame between the job's line and the handler."""
    script = _script(tmp_path, "interrupting.py", INTERRUPTING_SIGTERM_JOB)
    plain = _plain(tmp_path, script, "4", "0")
    assert plain.returncode == -signal.SIGINT and plain.stderr.endswith(b"KeyboardInterrupt\n")
    traced = _traced(tmp_path, script, "4", "0")
    _same_run(plain, traced)
    assert _steps(tmp_path / "t.jsonl") == list(range(4))


@pytest.mark.parametrize("sig", [signal.SIGKILL])
def test_a_job_killed_by_a_signal_no_handler_can_catch_makes_plasmient_run_die_of_it_too(tmp_path: Path, sig: int) -> None:
    """A command the OOM killer ends (SIGKILL) made `plasmient run` exit 137 instead of dying of SIGKILL: resetting
    SIGKILL's handler, which cannot be done, raised before the kill, so a parent process saw 137 where the plain
    job gives -9 (a shell sees 137 both ways)."""
    script = _script(tmp_path, "killed.py", STEPS_JOB + f"\nimport os\nos.kill(os.getpid(), {int(sig)})\n")
    plain = _plain(tmp_path, script, "3", "0")
    assert plain.returncode == -sig
    traced = _traced(tmp_path, script, "3", "0")
    _same_run(plain, traced)


@pytest.mark.parametrize(("command", "status"), [("missing", 127), ("not executable", 126)])
def test_a_command_that_cannot_be_run_gets_the_status_a_shell_gives_it(tmp_path: Path, command: str, status: int) -> None:
    # a script without its executable bit exited 127 ("not found") where sh, env and timeout give 126
    script = tmp_path / "train.sh"
    if command == "not executable":
        script.write_text("#!/bin/sh\necho trained\n")
    shell = subprocess.run(["sh", "-c", str(script)], capture_output=True, timeout=TIMEOUT)
    assert shell.returncode == status
    traced = subprocess.run([sys.executable, "-m", "plasmient_trace.cli", "run", "--", str(script)], cwd=tmp_path,
                            env=_env(tmp_path), capture_output=True, timeout=TIMEOUT)
    said = traced.stderr.decode().splitlines()
    assert traced.returncode == status and traced.stdout == b""
    assert len(said) == 1 and said[0].startswith(f"plasmient: error: cannot run {str(script)!r}: ")
