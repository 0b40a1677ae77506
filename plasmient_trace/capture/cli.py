"""``plasmient run [--out F] [--every N] [--job-id J] -- cmd ...``: trace a command's PyTorch processes.

Flags become the PLASMIENT_* variables (so torchrun workers and other Python children inherit them),
and a sitecustomize shim on PYTHONPATH starts the capture in each of them; the command's exit status
is returned unchanged.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..cli import _fraction, _positive_float, _positive_int
from .autostart import NO_STEP, RUN_DIR_VAR
from ..messages import say_error


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("run", help="run a command and trace its PyTorch steps live (one trace per step)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="OTLP/JSON lines file (default traces.jsonl when no OTLP endpoint is configured)")
    p.add_argument("--every", type=_positive_int, help="full depth (modules, ops, kernels) every N-th step (default 10)")
    p.add_argument("--job-id", help="job id the trace ids derive from (default $PLASMIENT_JOB_ID, $SLURM_JOB_ID.$SLURM_STEP_ID, ...; else rank 0's host-pid-time)")
    p.add_argument("--mfu-threshold", type=_fraction, help="also trace at full depth after a step whose MFU falls below this")
    p.add_argument("--peak-tflops", type=_positive_float, help="override the device peak, TFLOP/s")
    p.add_argument("--gpu-price", type=_positive_float, help="USD per device-hour")
    p.add_argument("--install-hook", action="store_true",
                   help="also install plasmient_trace.pth so PLASMIENT_TRACE=1 works without this command")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command to run, e.g. -- python train.py")
    p.set_defaults(func=run_command)


def child_env(args: argparse.Namespace, shim_dir: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if environ is None else environ)
    env["PLASMIENT_TRACE"] = "1"
    for flag, var in (("out", "PLASMIENT_OUT"), ("every", "PLASMIENT_EVERY"), ("job_id", "PLASMIENT_JOB_ID"),
                      ("mfu_threshold", "PLASMIENT_MFU_THRESHOLD"), ("peak_tflops", "PLASMIENT_PEAK_TFLOPS"),
                      ("gpu_price", "PLASMIENT_GPU_PRICE")):
        value = getattr(args, flag, None)
        if value is not None:
            env[var] = os.path.abspath(value) if flag == "out" else str(value)
    env["PYTHONPATH"] = os.pathsep.join([shim_dir] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env[RUN_DIR_VAR] = os.pathsep.join([shim_dir] + ([env[RUN_DIR_VAR]] if env.get(RUN_DIR_VAR) else []))
    return env


def run_command(args: argparse.Namespace) -> int:
    from .autostart import install_pth, write_shim

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        say_error("plasmient", "run needs a command after --, e.g. plasmient run -- python train.py")
        return 2
    if args.install_hook:
        print(f"plasmient: installed {install_pth()}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="plasmient-run-") as shim_dir:
        write_shim(shim_dir)
        try:
            # At a terminal the command stays in its foreground group: Ctrl-C and job control reach it as
            # they would without us. Elsewhere (a scheduler, a supervisor, CI) it gets a group of its own,
            # so a signal sent to this process's group reaches the command once, through us, with its workers.
            own_group = not _in_terminal_foreground()
            proc = subprocess.Popen(cmd, env=child_env(args, shim_dir), process_group=0 if own_group else None,
                                    preexec_fn=_terminated_with_us if own_group else None)
        except OSError as err:
            say_error("plasmient", f"cannot run {cmd[0]!r}: {err}")
            # as a shell, env or timeout says it: 127 not found, 126 found but not to be run (permissions)
            return 127 if isinstance(err, FileNotFoundError) else 126
        code = _wait_forwarding(proc, own_group)
        marks = {p.name.split(".")[0] for p in Path(shim_dir).iterdir()}
        if "started" not in marks:
            print("plasmient: nothing was traced: no process of the command imported torch with the startup hook "
                  "loaded (python -I, -E or -S skips it: drop the flag, or call plasmient_trace.capture.start() "
                  "in the script)", file=sys.stderr)
        elif "no-step" in marks and "stepped" not in marks and not os.environ.get(RUN_DIR_VAR):
            # a process ran a model and ended no step, nor did any other (an outer `plasmient run` says it)
            print(f"plasmient-trace: {NO_STEP}", file=sys.stderr)
    if code < 0:
        _die_like_child(-code)
    return code


# What `plasmient run` passes on to the command, as a process supervisor does: whatever is sent to this
# process alone would otherwise stop only the wrapper (USR1, QUIT) or nothing at all (INT), and leave the job
# running on its own.
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
# si_code of a signal the kernel sent: a terminal's Ctrl-C and Ctrl-\, which reach the whole foreground
# process group, the command included; passing them on would interrupt it twice.
_SI_KERNEL = 0x80
_FROM_THE_TERMINAL = (signal.SIGINT, signal.SIGQUIT)


def _terminated_with_us() -> None:
    """In the child before exec: a SIGTERM when `plasmient run` dies (SIGKILL from `timeout -k`, an OOM kill),
    which would otherwise leave it running in its own process group, which the kill of ours did not reach."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except Exception:
        pass  # not Linux: no such call


def _in_terminal_foreground() -> bool:
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError, AttributeError):  # no terminal, a closed or replaced stdin
        return False


def _wait_forwarding(proc: subprocess.Popen, own_group: bool = False) -> int:
    """Wait for the child, passing on every signal in FORWARDED that this process receives: to the child's
    own process group (the command and its workers) when it has one, else to the child, except the
    terminal's own Ctrl-C and Ctrl-\\ (the child got those already). The signals are blocked and taken with
    sigtimedwait, whose siginfo says who sent each; SIGCHLD ends the wait as soon as the child exits."""
    waited = {*FORWARDED, signal.SIGCHLD}
    try:
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, waited)
    except (ValueError, OSError):  # not the main thread, or no such mask here: plain waiting
        return proc.wait()
    try:
        while proc.poll() is None:
            info = signal.sigtimedwait(waited, 0.5)
            if info is None or info.si_signo == signal.SIGCHLD:
                continue
            if not own_group and info.si_signo in _FROM_THE_TERMINAL and info.si_code == _SI_KERNEL:
                continue
            try:
                if own_group:
                    os.killpg(proc.pid, info.si_signo)
                else:
                    proc.send_signal(info.si_signo)
            except OSError:
                pass
        return proc.returncode
    finally:
        # what came after the child's end is for no one: taken, not delivered to this process on unblocking
        while signal.sigtimedwait(waited, 0) is not None:
            pass
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _die_like_child(signum: int) -> None:
    """The child died of a signal: die of the same one, so a shell sees 128+N and a parent process
    sees -N, exactly as without ``plasmient run``. Falls back to exit 128+N if the signal is caught."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        signal.signal(signum, signal.SIG_DFL)
    except (OSError, ValueError):
        pass  # SIGKILL (the OOM killer's) has no handler to reset: it is the default already
    try:
        os.kill(os.getpid(), signum)
    except OSError:
        pass
    os._exit(128 + signum)
