"""The CPU as a device: GEMM peaks per dtype and copy bandwidth, measured (best of several runs,
with the job's thread count) only while nothing else uses the CPU, cached per CPU (not per model name
alone: ``cpu_identity``) and thread count, calibrated at idle priority in a child process when live
(:func:`start_cpu_calibration`), and raised when ops prove it wrong (:func:`raise_cpu_peak`, in
``cpu_peak_raise``)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import platform
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterator, Mapping

from .cpu_identity import cache_key as _cache_key
from .cpu_identity import cpu_model as _cpu_model
from .cpu_peak_cache import CACHE_FILE as _CACHE_FILE
from .cpu_peak_cache import CACHE_FORMAT as _CACHE_FORMAT
from .cpu_peak_cache import cache_dir as _cache_dir
from .cpu_peak_cache import cpu_has_bf16 as _cpu_has_bf16
from .cpu_peak_cache import read_cache as _read_cache
from .cpu_peak_cache import torch_threads as _threads
from .cpu_peak_cache import valid_entry as _valid
from .cpu_peak_cache import write_cache as _write_cache
from .cpu_peak_raise import (EVIDENCE_OPS, MAX_RAISE, MIN_EVIDENCE_S, OVER_PEAK_TOLERANCE,  # noqa: F401
                             evidence_rates, raise_cpu_peak)
from .hardware import GpuSpec

__all__ = ["cpu_spec", "cpu_price_per_hour", "cpu_price_from_env", "raise_cpu_peak", "evidence_rates",
           "start_cpu_calibration",
           "CalibrationNotQuiet", "CPU_PRICE_PER_THREAD_HOUR"]

# --------------------------------------------------------------------------------------------- CPU
# Default CPU price: USD per vCPU-hour times the threads torch uses. Basis: AWS m7i on-demand
# us-east-1 ($0.2016/h for 4 vCPU = $0.0504/vCPU-h), rounded. PLASMIENT_CPU_PRICE (USD per hour
# for the whole measured device) overrides it.
CPU_PRICE_PER_THREAD_HOUR = 0.05

# Calibration sizes (module constants so tests can shrink them).
_GEMM_N = 1024
_GEMM_RUNS = 5
_COPY_BYTES = 256 * 2**20   # well above any L3, so the copy streams from DRAM
_COPY_RUNS = 3
_clock = time.perf_counter   # looked up at call time so tests can substitute a fake clock
# A set of timed runs counts only if the rest of the machine stayed idle meanwhile: other processes' CPU
# time at most this share of the set's wall time (all cores), plus one of /proc/stat's ticks per core (its
# resolution). A set lasts at least _SET_S (more runs of a fast call) so that a tick is small beside it.
_OTHERS_SHARE = 0.05
_SET_S = 0.5
_MAX_RUNS = 200
_QUIET_DEADLINE_S = 300.0        # foreground (`python -m plasmient_trace.metrics.cpu_peak`)
_BACKGROUND_DEADLINE_S = 3600.0  # the idle-priority child of a live job, which may outlive it
_RETRY_S = 1.0
_log = logging.getLogger(__name__)


class CalibrationNotQuiet(RuntimeError):
    """The CPU never stayed idle long enough to time a peak: a peak timed beside other work is too low."""


def _usable_cpus() -> set[int] | None:
    """The CPUs this process may run on (a container's cpuset, taskset), or None where that is not known."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def _machine_busy_s(cpus: set[int] | None = None) -> float | None:
    """CPU seconds the CPUs ``cpus`` (default: all) spent busy since boot (/proc/stat's per-CPU lines;
    hypervisor steal counts as busy), or None where there is no /proc/stat. On a 64-core host a 2-CPU
    container's calibration must not count the 62 idle CPUs it cannot use as room to spare."""
    busy = 0
    try:
        with open("/proc/stat", encoding="ascii") as f:
            for line in f:
                name, _, rest = line.partition(" ")
                if not name.startswith("cpu"):
                    break
                if name == "cpu" or (cpus is not None and int(name[3:]) not in cpus):
                    continue
                fields = [int(v) for v in rest.split()[:8]]
                user, nice, system, idle, iowait, irq, softirq, steal = fields + [0] * (8 - len(fields))
                busy += user + nice + system + irq + softirq + steal
    except (OSError, ValueError):
        return None
    return busy / os.sysconf("SC_CLK_TCK")


def _best_time(fn: Any, runs: int, deadline: float) -> float:
    """Best wall time of ``runs`` timed calls, from a set during which no other process used the CPUs this
    one may run on. (That this process's threads ran all the time is not enough: a busy SMT sibling slows
    them without taking their CPU.) A set
    that shared the machine is timed again after a pause, until ``deadline`` (a ``_clock`` value); past it,
    :class:`CalibrationNotQuiet`. Where the machine's busy time cannot be read the set is taken as it is
    (the spec's notes say so)."""
    tick_s = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
    usable = _usable_cpus()
    cpus = len(usable) if usable else (os.cpu_count() or 1)
    while True:
        t0 = _clock()
        fn()  # warm-up: first call pays allocation, thread-pool start and cache misses
        first = max(_clock() - t0, 1e-9)
        busy0, own0, wall0 = _machine_busy_s(usable), time.process_time(), _clock()
        best = float("inf")
        for _ in range(max(runs, min(_MAX_RUNS, int(_SET_S / first) + 1))):
            t0 = _clock()
            fn()
            best = min(best, _clock() - t0)
        wall = _clock() - wall0
        busy1, own1 = _machine_busy_s(usable), time.process_time()
        if busy0 is None or busy1 is None:
            return best
        others = (busy1 - busy0) - (own1 - own0)
        if others <= _OTHERS_SHARE * wall * cpus + cpus * tick_s:
            return best
        if _clock() + _RETRY_S >= deadline:
            raise CalibrationNotQuiet(
                f"other processes used {others:.2f} CPU-s of a {wall:.2f} s timing, and the CPU was never idle "
                "long enough to time its peak")
        time.sleep(_RETRY_S)


def _measure_gemm(dtype_name: str, deadline: float) -> float:
    n = _GEMM_N
    try:
        import torch

        dt = getattr(torch, dtype_name)
        a = torch.randn(n, n, dtype=dt)
        b = torch.randn(n, n, dtype=dt)
        out = torch.empty(n, n, dtype=dt)
        fn = lambda: torch.mm(a, b, out=out)  # noqa: E731
    except ImportError:
        import numpy as np

        a = np.random.standard_normal((n, n)).astype(dtype_name)
        b = np.random.standard_normal((n, n)).astype(dtype_name)
        out = np.empty((n, n), dtype=dtype_name)
        fn = lambda: np.matmul(a, b, out=out)  # noqa: E731
    dt_s = _best_time(fn, _GEMM_RUNS, deadline)
    return 2.0 * n * n * n / dt_s


def _measure_copy(deadline: float) -> float:
    import numpy as np

    n = _COPY_BYTES // 8
    src = np.ones(n, dtype=np.float64)
    dst = np.empty_like(src)
    dt_s = _best_time(lambda: np.copyto(dst, src), _COPY_RUNS, deadline)
    return 2.0 * n * 8 / dt_s  # every byte read once and written once


def cpu_price_from_env() -> tuple[float | None, str]:
    """PLASMIENT_CPU_PRICE (USD an hour of a CPU-only job's cores) and where it came from; (None, why) when it
    is unset or not a price (negative, NaN, inf, a typo): a negative price would make every cost negative.
    An offline ingest prices a CPU trace with this alone (its threads, hence a default, are not in the trace)."""
    from ..conventions import MAX_FLAG_VALUE

    env = os.environ.get("PLASMIENT_CPU_PRICE", "").strip()
    if not env:
        return None, ""
    try:
        price = float(env)
    except ValueError:
        price = float("nan")
    if 0 < price <= MAX_FLAG_VALUE:
        return price, "PLASMIENT_CPU_PRICE"
    return None, f"PLASMIENT_CPU_PRICE={env!r} ignored: not a price in (0, {MAX_FLAG_VALUE:g}]"


def _cpu_price(threads: int) -> tuple[float, str]:
    """USD an hour, and where it came from: PLASMIENT_CPU_PRICE, else the default per thread (and the source
    says when PLASMIENT_CPU_PRICE was set but not a price)."""
    price, source = cpu_price_from_env()
    if price is not None:
        return price, source
    rejected = f" ({source})" if source else ""
    return CPU_PRICE_PER_THREAD_HOUR * threads, (
        f"default ${CPU_PRICE_PER_THREAD_HOUR}/vCPU-hour x {threads} threads (AWS m7i on-demand, rounded){rejected}")


def cpu_price_per_hour(threads: int | None = None) -> float:
    """USD an hour of this process's CPU threads (PLASMIENT_CPU_PRICE, else the default per thread): known
    before, and without, the peak's calibration."""
    return _cpu_price(threads or _threads())[0]


def user_cpu_spec(peak_tflops: float, threads: int | None = None) -> GpuSpec:
    """The CPU as the device when the user gave its peak (PLASMIENT_PEAK_TFLOPS): nothing is calibrated and
    the peak is theirs, but the price is still this machine's (PLASMIENT_CPU_PRICE, else the default per
    thread). Without it a run with a peak override had no cost on any span."""
    from .hardware import apply_overrides

    price, price_source = _cpu_price(threads or _threads())
    spec = apply_overrides(None, peak_tflops=peak_tflops)
    assert spec is not None  # a peak was given
    return dataclasses.replace(spec, price_per_hour=price, price_source=price_source)


def _measure_all(threads: int, deadline_s: float = _QUIET_DEADLINE_S) -> dict[str, Any]:
    """Time every dtype with ``threads`` intra-op threads (restored afterwards), each on an otherwise idle
    machine; :class:`CalibrationNotQuiet` when it is not idle for long enough within ``deadline_s``."""
    deadline = _clock() + deadline_s
    torch: Any = None
    try:
        import torch
    except ImportError:
        pass
    before = torch.get_num_threads() if torch is not None else None
    if torch is not None and before != threads:
        torch.set_num_threads(threads)
    try:
        entry: dict[str, Any] = {"fp32": _measure_gemm("float32", deadline),
                                 "fp64": _measure_gemm("float64", deadline)}
        if torch is not None and _cpu_has_bf16():
            entry["bf16"] = _measure_gemm("bfloat16", deadline)
        entry["bandwidth"] = _measure_copy(deadline)
    finally:
        if torch is not None and before != threads:
            torch.set_num_threads(before)
    entry.update(gemm_n=_GEMM_N, copy_bytes=_COPY_BYTES, runs=_GEMM_RUNS, measured_at=time.time(), format=_CACHE_FORMAT,
                 idle_checked=_machine_busy_s() is not None)
    return entry


def cpu_spec(cache_dir: str | os.PathLike[str] | None = None, threads: int | None = None,
             deadline_s: float = _QUIET_DEADLINE_S, wait_for_others: bool = True) -> GpuSpec:
    """The CPU as a device: per-dtype GEMM peaks (fp32, fp64, bf16 where the CPU has bf16 math) and
    copy bandwidth, each the best of several timed runs with ``threads`` intra-op threads (default:
    torch's current count), measured once and cached.

    The cache is a JSON file under ``cache_dir`` (default ``$PLASMIENT_CACHE_DIR`` or
    ``~/.cache/plasmient-trace``) keyed by the CPU (``cpu_identity.cache_key``) and thread count. Measuring takes seconds, loads
    every core and needs the machine otherwise idle (:class:`CalibrationNotQuiet` after ``deadline_s``);
    processes sharing a cache measure one at a time (``wait_for_others=False``: none waits for another,
    it gives up). In a live job call :func:`start_cpu_calibration`.
    """
    model = _cpu_model()
    threads = threads or _threads()
    key = _cache_key(threads)
    path = _cache_dir(cache_dir) / _CACHE_FILE
    entry = _read_cache(path).get(key)
    if not _valid(entry):
        deadline = _clock() + deadline_s
        with _measuring_alone(path, deadline if wait_for_others else _clock()):
            cache = _read_cache(path)   # another process may have measured it while this one waited
            entry = cache.get(key)
            if not _valid(entry):
                entry = _measure_all(threads, deadline - _clock())
                cache[key] = entry
                _write_cache(path, cache)
    return _spec_from_entry(model, threads, entry)


@contextlib.contextmanager
def _measuring_alone(path: Path, deadline: float) -> Iterator[None]:
    """Hold the cache's lock file: two calibrations at once (ranks of one node, test workers) would each
    time the other's load. Waits at most until ``deadline``; without fcntl (Windows) nothing is held."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "a")
    except OSError:
        yield   # an unwritable cache directory: measure without it, as the cache is not written either
        return
    with lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if _clock() >= deadline:
                    raise CalibrationNotQuiet("another process is calibrating this CPU") from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _spec_from_entry(model: str, threads: int, entry: Mapping[str, Any]) -> GpuSpec:
    price, price_source = _cpu_price(threads)
    peak = {d: float(entry[d]) for d in ("fp32", "fp64", "bf16") if d in entry}
    raised = ", ".join(f"{d} raised to an observed op rate" for d in entry.get("raised", []))
    return GpuSpec(
        model=f"{model} ({threads} threads)",
        peak=MappingProxyType(peak),
        memory_bandwidth=float(entry["bandwidth"]),
        price_per_hour=price,
        source="calibrated",
        price_source=price_source,
        vendor=platform.machine(),
        device_type="cpu",
        notes=f"best of {entry.get('runs', _GEMM_RUNS)} {entry.get('gemm_n', _GEMM_N)}^3 GEMMs per dtype; "
              f"copy of {entry.get('copy_bytes', _COPY_BYTES)} bytes; "
              + ("bf16 measured" if "bf16" in peak else "no native bf16: bf16 uses the fp32 peak")
              + ("; timed while the machine was otherwise idle" if entry.get("idle_checked")
                 else "; the machine's idleness could not be read (no /proc/stat): timed as it was")
              + (f"; {raised}" if raised else ""),
    )


def start_cpu_calibration(threads: int | None = None,
                          cache_dir: str | os.PathLike[str] | None = None) -> Future[GpuSpec]:
    """Calibrate the CPU off the training thread: a child process (its own torch, its own thread
    pool, so the job's threads are neither borrowed nor reconfigured) measures with ``threads``
    threads and fills the cache; the Future resolves to :func:`cpu_spec` read from it. A cached
    machine resolves at once without starting anything. The child runs at idle priority, so the job
    keeps its cores, and times only while the machine is otherwise idle: beside a busy job that is
    often after the job ends (it is detached and fills the cache for the next run), and the Future
    then fails with :class:`CalibrationNotQuiet`'s reason."""
    threads = threads or _threads()
    done: Future[GpuSpec] = Future()
    path = _cache_dir(cache_dir) / _CACHE_FILE
    if _valid(_read_cache(path).get(_cache_key(threads))):
        done.set_result(cpu_spec(cache_dir, threads))
        return done

    def run() -> None:
        try:
            cmd = [sys.executable, "-m", "plasmient_trace.metrics.cpu_peak", "--threads", str(threads), "--background"]
            if cache_dir is not None:
                cmd += ["--cache-dir", str(cache_dir)]
            # Detached (own session, no pipes): a job that exits first does not kill the measurement, so
            # the cache is filled for its next run.
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, start_new_session=True)
            code = proc.wait()
            if code == _NOT_QUIET_EXIT:
                raise CalibrationNotQuiet(f"the CPU was never idle for {_BACKGROUND_DEADLINE_S:.0f} s of trying")
            if code != 0:
                raise RuntimeError(f"calibration process exited {code}")
            done.set_result(cpu_spec(cache_dir, threads))
        except Exception as err:  # the Future carries any failure to the caller
            done.set_exception(err)

    threading.Thread(target=run, name="plasmient-cpu-calibration", daemon=True).start()
    return done


_NOT_QUIET_EXIT = 3


def _idle_priority() -> None:
    """This process (its threads, and those it starts later: torch's pool) runs only on cores nothing else
    wants."""
    try:
        for tid in os.listdir("/proc/self/task"):   # numpy's import has started BLAS threads already
            os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))   # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):
        try:
            os.nice(19)
        except (AttributeError, OSError):
            pass


def _main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Measure the CPU's peaks into plasmient's cache, on an otherwise "
                                                 "idle machine.")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--cache-dir")
    parser.add_argument("--background", action="store_true",
                        help=f"idle priority, and wait up to {_BACKGROUND_DEADLINE_S:.0f} s for the machine to be idle")
    parser.add_argument("--deadline", type=float, metavar="SECONDS",
                        help=f"give up (exit {_NOT_QUIET_EXIT}) when the machine was not idle for long enough within "
                             f"SECONDS (default {_QUIET_DEADLINE_S:.0f}, {_BACKGROUND_DEADLINE_S:.0f} with --background)")
    args = parser.parse_args(argv)
    if args.background:
        _idle_priority()
    deadline = args.deadline if args.deadline is not None else (
        _BACKGROUND_DEADLINE_S if args.background else _QUIET_DEADLINE_S)
    try:
        # a job's child leaves the measuring to one already at it (repeated short jobs would queue up children)
        cpu_spec(args.cache_dir, args.threads, deadline, wait_for_others=not args.background)
    except CalibrationNotQuiet as err:
        print(f"plasmient: CPU peak not calibrated: {err}", file=sys.stderr)
        return _NOT_QUIET_EXIT
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
