"""Start the capture without touching the training script: PLASMIENT_TRACE=1, ``plasmient run``, the OTel launcher.

``install()`` arms a one-shot import hook: the capture starts right after the program imports torch
(a script that never imports torch pays nothing and gets no torch imported behind its back). It is
what all three entry points call:

* ``PLASMIENT_TRACE=1 python train.py`` runs it from ``plasmient_trace.pth`` in site-packages.
  A pip/setuptools install cannot place a .pth portably (data_files would hard-code the
  interpreter's site-packages path, and editable installs do not ship it), so the file is written
  once with ``python -m plasmient_trace.capture.autostart --install`` (or ``plasmient run
  --install-hook``); :func:`pth_line` is its content.
* ``plasmient run -- cmd`` needs no installed hook: it puts a ``sitecustomize`` shim on PYTHONPATH
  (chaining to any existing sitecustomize) for the child and every Python process it starts.
* ``opentelemetry-instrument python train.py`` finds PlasmientInstrumentor through its entry point.

A forked child (a DataLoader worker, a multiprocessing pool) never starts a capture of its own. A spawned
one does (``mp.spawn`` ranks are traced); a DataLoader worker among them closes it quietly at its first
module call (``session._in_data_loader_worker``).
"""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path
from typing import Any

from .import_hook import AfterImport

PTH_NAME = "plasmient_trace.pth"
# Set by `plasmient run` for its command: a process that starts tracing leaves a file there, so the
# command's end can say when none did (python -I, -E or -S skips every startup hook, silently).
RUN_DIR_VAR = "PLASMIENT_RUN_DIR"
_TRUTHY_OFF = ("", "0", "false", "no", "off")
_installed = False


def enabled(environ: Any = os.environ) -> bool:
    return environ.get("PLASMIENT_TRACE", "").strip().lower() not in _TRUTHY_OFF


def _is_child_process() -> bool:
    try:
        import multiprocessing

        return multiprocessing.parent_process() is not None
    except Exception:
        return False


# Said once by a job whose model ran but whose steps never ended. Under `plasmient run` the command's end says
# it, once, and only when no process of the command ended a step: an eval helper the job runs as a subprocess
# (`python -c "import torch; ..."`) said it into its own stderr, which the job reads or shows, though the job's
# steps were traced.
NO_STEP = ("no step ended, so nothing was traced: a step ends at optimizer.step(), at torch.profiler's "
           "prof.step(), or with `with plasmient_trace.step():` around it")


def note_started(what: str = "started") -> bool:
    """Leave this process's mark ``what`` (started, stepped, no-step) for `plasmient run` (see RUN_DIR_VAR);
    True where one was left. Never raises."""
    left = False
    for where in os.environ.get(RUN_DIR_VAR, "").split(os.pathsep):  # one per `plasmient run` around it
        if where:
            try:
                os.close(os.open(os.path.join(where, f"{what}.{os.getpid()}"), os.O_CREAT | os.O_WRONLY, 0o600))
                left = True
            except OSError:
                pass
    return left


def _start() -> None:
    try:
        from . import start

        start()
    except Exception as err:  # never into the job
        try:
            print(f"plasmient-trace: tracing not started: {err}", file=sys.stderr)
        except Exception:
            pass


class _TorchWatcher(AfterImport):
    """Starts the capture once torch's module has executed."""

    def __init__(self) -> None:
        super().__init__("torch", lambda _module: _start())


def install() -> None:
    """Arm the capture for this process (idempotent; a no-op in multiprocessing children)."""
    global _installed
    if _installed or _is_child_process():
        return
    _installed = True
    if "torch" in sys.modules:
        _start()
    else:
        _TorchWatcher().arm()


def uninstall() -> None:
    """Undo :func:`install`: disarm the import hook if torch has not been imported yet and stop a
    running capture (its hooks and patches removed), so a later ``install`` starts afresh."""
    global _installed
    _installed = False
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _TorchWatcher)]
    from . import stop

    stop()


def maybe_install() -> None:
    """The .pth / sitecustomize entry: arms the capture only when PLASMIENT_TRACE is set."""
    if enabled():
        install()


def pth_line() -> str:
    # .pth lines starting with "import" are executed by site.py at startup: keep it to one cheap check.
    return ("import os; os.environ.get('PLASMIENT_TRACE', '').strip().lower() not in ('', '0', 'false', 'no', 'off') "
            "and __import__('plasmient_trace.capture.autostart', fromlist=['_']).install()\n")


def install_pth(site_dir: str | os.PathLike[str] | None = None) -> Path:
    """Write plasmient_trace.pth into ``site_dir`` (default: this interpreter's site-packages)."""
    target = Path(site_dir or sysconfig.get_paths()["purelib"]) / PTH_NAME
    target.write_text(pth_line())
    return target


SHIM = '''"""plasmient run: start plasmient-trace in this interpreter, then run any other sitecustomize."""
import importlib.machinery, importlib.util, os, sys
try:
    import plasmient_trace.capture.autostart as _plasmient_autostart
    _plasmient_autostart.maybe_install()
except Exception as _err:
    print("plasmient-trace: tracing not started: %s" % (_err,), file=sys.stderr)
# every plasmient shim met so far is skipped (`plasmient run` inside `plasmient run` puts two on the path:
# each chaining to the other recursed until Python gave up), so the chain ends at the job's own, if any
_shims = sys.__dict__.setdefault("_plasmient_shim_dirs", set())
_shims.add(os.path.dirname(os.path.abspath(__file__)))
_rest = [p for p in sys.path if os.path.abspath(p or ".") not in _shims]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None:
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules["sitecustomize"] = _mod
    _spec.loader.exec_module(_mod)
'''


def write_shim(directory: str | os.PathLike[str]) -> Path:
    path = Path(directory) / "sitecustomize.py"
    path.write_text(SHIM)
    return path


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m plasmient_trace.capture.autostart",
                                description="install the PLASMIENT_TRACE=1 startup hook")
    p.add_argument("--install", action="store_true", help=f"write {PTH_NAME} into site-packages")
    p.add_argument("--site-dir", help="directory to write it to (default: this interpreter's site-packages)")
    args = p.parse_args(argv)
    if not args.install:
        p.print_help()
        return 2
    path = install_pth(args.site_dir)
    print(f"plasmient-trace: wrote {path}; PLASMIENT_TRACE=1 now traces any PyTorch program run by {sys.executable}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
