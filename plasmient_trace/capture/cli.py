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
from .autostart import RUN_DIR_VAR
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
    env[RUN_DIR_VAR] = shim_dir
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
            proc = subprocess.Popen(cmd, env=child_env(args, shim_dir))
        except OSError as err:
            say_error("plasmient", f"cannot run {cmd[0]!r}: {err}")
            return 127
        code = _wait_forwarding(proc)
        if not any(Path(shim_dir).glob("started.*")):
            print("plasmient: nothing was traced: no process of the command imported torch with the startup hook "
                  "loaded (python -I, -E or -S skips it: drop the flag, or call plasmient_trace.capture.start() "
                  "in the script)", file=sys.stderr)
    if code < 0:
        _die_like_child(-code)
    return code


def _wait_forwarding(proc: subprocess.Popen) -> int:
    """Wait for the child. SIGTERM/SIGHUP sent to this process alone (a scheduler, ``kill``) are
    passed on so the child can flush; SIGINT from a terminal already reached the whole group."""
    forwarded = (signal.SIGTERM, signal.SIGHUP)
    saved = {}

    def forward(signum: int, _frame: Any) -> None:
        try:
            proc.send_signal(signum)
        except OSError:
            pass

    for sig in forwarded:
        try:
            saved[sig] = signal.signal(sig, forward)
        except ValueError:  # not the main thread
            pass
    try:
        while True:
            try:
                return proc.wait()
            except KeyboardInterrupt:
                continue  # the child got the same SIGINT; wait for it to flush and exit
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _die_like_child(signum: int) -> None:
    """The child died of a signal: die of the same one, so a shell sees 128+N and a parent process
    sees -N, exactly as without ``plasmient run``. Falls back to exit 128+N if the signal is caught."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    except (OSError, ValueError):
        pass
    os._exit(128 + signum)
