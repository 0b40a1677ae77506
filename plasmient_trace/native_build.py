"""Compiling a native helper once into the user's cache, shared by every process that asks.

Used by the live op observer (``capture/native.py``, C++ against torch) and the JSON span assembler
(``export/json_native.py``, plain C). The cache entry's name is a hash of the source and the command,
so a new source or compiler flag is a new entry. One process compiles (an ``O_EXCL`` lock file), the
others wait for its result; the compiler runs in its own session and renames its output into place
itself, so a job that exits mid-build neither leaves a half-written file nor wastes the build.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["cache_dir", "compile_cached", "find_compiler"]


def cache_dir() -> Path:
    root = os.environ.get("PLASMIENT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "plasmient-trace")
    return Path(root).expanduser() / "native"


def find_compiler(variable: str, names: tuple[str, ...]) -> str | None:
    """The compiler the environment ``variable`` names (CC, CXX), else the first of ``names`` on PATH."""
    chosen = os.environ.get(variable)
    if chosen:
        return shutil.which(chosen) or (chosen if os.path.isfile(chosen) else None)
    return next((found for found in map(shutil.which, names) if found), None)


# $1 temporary output, $2 target, $3 log, $4 lock; the compiler command follows.
_BUILD_SCRIPT = 'tmp=$1 target=$2 log=$3 lock=$4; shift 4; "$@" -o "$tmp" >"$log" 2>&1 && mv -f "$tmp" "$target"; ' \
                'status=$?; rm -f "$tmp" "$lock"; exit $status'


def compile_cached(target: Path, command: list[str], what: str, timeout_s: float) -> Path:
    """Run ``command`` (a compiler line without ``-o``) to produce ``target`` unless it exists; returns
    ``target``. Raises RuntimeError with the compiler's message on failure."""
    if target.exists():
        return target
    if sys.platform != "linux":
        raise RuntimeError(f"the {what} is built for Linux only (this is {sys.platform})")
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = target.with_name(target.name + ".building")
    log = target.with_name(target.name + ".log")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            break  # ours to build
        except FileExistsError:
            if time.time() - _mtime(lock) > timeout_s:
                lock.unlink(missing_ok=True)  # a build that died without cleaning up
                continue
            if _wait_for(target, lock, deadline):
                return target
            if target.exists():
                return target
            if not lock.exists():
                raise RuntimeError(f"the build of another process failed: {_log_tail(log)}") from None
            raise RuntimeError(f"waited {timeout_s:.0f} s for another process's build") from None
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    proc = subprocess.Popen(["sh", "-c", _BUILD_SCRIPT, "build", str(tmp), str(target), str(log), str(lock), *command],
                            start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        code = proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
    except subprocess.TimeoutExpired as err:
        raise RuntimeError(f"compiling took over {timeout_s:.0f} s") from err
    if code != 0 or not target.exists():
        raise RuntimeError(f"{os.path.basename(command[0])} failed (exit {code}): {_log_tail(log)}")
    return target


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return time.time()


def _wait_for(target: Path, lock: Path, deadline: float) -> bool:
    while time.monotonic() < deadline:
        if target.exists():
            return True
        if not lock.exists():
            return target.exists()
        time.sleep(0.2)
    return False


def _log_tail(log: Path) -> str:
    try:
        return " | ".join(log.read_text(errors="replace").strip().splitlines()[-5:])
    except OSError:
        return "(no compiler output)"
