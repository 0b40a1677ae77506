"""Build, cache and load the native op observer (``op_observer.cpp``), failing soft.

Why native: a TorchDispatchMode costs tens of microseconds of Python per aten op, which puts a
full-depth step far above the +15% budget; a C++ ``at::RecordFunction`` callback (what Kineto
itself uses) records the same facts for about a microsecond. It is compiled once per
(source, torch, Python) with the system C++ compiler against the headers torch ships, and cached
under ``$PLASMIENT_CACHE_DIR`` (default ``~/.cache/plasmient-trace``). No ninja, no setup.py.

Where there is no compiler or the build fails, :func:`load` returns None with the reason in
:func:`failure`, and live capture keeps the dispatch-mode recorder. :func:`build_async` runs the
first build in a background thread so a job never waits for g++; the compiler runs detached and
renames its output into the cache itself, so a job that exits mid-build still leaves a finished
build (no stray temporary file) for the next run, and concurrent processes share one build:

    python -m plasmient_trace.capture.native      # build now (e.g. in a container image), print where
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import sys
import sysconfig
import threading
from pathlib import Path
from types import ModuleType

from ..native_build import cache_dir, compile_cached, find_compiler

MODULE_NAME = "_plasmient_op_observer"
SOURCE = Path(__file__).with_name("op_observer.cpp")
BUILD_TIMEOUT_S = 600

_lock = threading.Lock()
_module: ModuleType | None = None
_failure: str | None = None
_thread: threading.Thread | None = None


def _torch_paths() -> tuple[list[str], str, int]:
    import torch
    from torch.utils import cpp_extension

    return cpp_extension.include_paths(), os.path.join(os.path.dirname(torch.__file__), "lib"), \
        int(torch._C._GLIBCXX_USE_CXX11_ABI)


def _compiler() -> str | None:
    return find_compiler("CXX", ("c++", "g++", "clang++"))


def _command(cxx: str, out: str) -> list[str]:
    # NDEBUG as torch's release build has it: RecordFunction's debug-only checks assume it.
    includes, lib_dir, abi = _torch_paths()
    py_include = sysconfig.get_paths()["include"]
    return [cxx, "-O2", "-DNDEBUG", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{p}" for p in includes), f"-I{py_include}",
            str(SOURCE), "-o", out, f"-L{lib_dir}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib_dir}"]


def artifact_path() -> Path:
    """Where the build for this source, torch and Python lives (the key changes with any of them)."""
    import torch

    flags = " ".join(_command("c++", "out"))
    key = hashlib.sha256(SOURCE.read_bytes() + f"|{torch.__version__}|{sys.version}|{flags}".encode())
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    return cache_dir() / key.hexdigest()[:16] / f"{MODULE_NAME}{suffix}"


def _import(path: Path) -> ModuleType:
    import torch  # noqa: F401 - its libraries must be loaded before the extension resolves against them

    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build(timeout_s: float = BUILD_TIMEOUT_S) -> Path:
    """Compile into the cache and return the path; one build per cache entry however many
    processes (ranks, short jobs) ask, and it completes even if the asking process exits. Raises
    RuntimeError with the compiler's message on failure."""
    target = artifact_path()
    if target.exists():
        return target
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (set CXX, or install g++)")
    return compile_cached(target, _without_output(_command(cxx, "out")), "native op observer", timeout_s)


def _without_output(command: list[str]) -> list[str]:
    i = command.index("-o")
    return command[:i] + command[i + 2:]


def load(build_if_missing: bool = True) -> ModuleType | None:
    """The loaded extension, or None (reason in :func:`failure`). Never raises."""
    global _module, _failure
    with _lock:
        if _module is not None or (_failure is not None and build_if_missing):
            return _module
        try:
            path = artifact_path()
            if not path.exists():
                if not build_if_missing:
                    return None
                path = build()
            mod = _import(path)
            from .torch_hooks import SHAPE_ONLY_OPS

            mod.set_unbracketed(sorted(SHAPE_ONLY_OPS))  # before anything is recorded
            _module = mod
        except Exception as err:  # a compiler, header or ABI problem: the dispatch recorder stays
            _failure = f"{type(err).__name__}: {err}"
        return _module


def loaded() -> ModuleType | None:
    return _module


def failure() -> str | None:
    return _failure


def build_async() -> threading.Thread:
    """Build (if needed) and load in a daemon thread; callers poll :func:`loaded`."""
    global _thread
    with _lock:
        if _thread is None:
            _thread = threading.Thread(target=load, name="plasmient-native-build", daemon=True)
            _thread.start()
        return _thread


def main(argv: list[str] | None = None) -> int:
    mod = load()
    if mod is None:
        print(f"plasmient-trace: native op observer unavailable: {failure()}", file=sys.stderr)
        return 1
    print(f"plasmient-trace: native op observer ready: {artifact_path()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
