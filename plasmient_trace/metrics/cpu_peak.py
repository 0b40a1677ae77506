"""The CPU as a device: GEMM peaks per dtype and copy bandwidth, measured (best of several runs,
with the job's thread count), cached per CPU model and thread count, calibrated off the training
thread when live (:func:`start_cpu_calibration`), and raised when an op proves it wrong
(:func:`raise_cpu_peak`)."""

from __future__ import annotations

import dataclasses
import json
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
from typing import Any, Callable, Mapping

import numpy as np

from .hardware import GpuSpec

__all__ = ["cpu_spec", "raise_cpu_peak", "start_cpu_calibration", "CPU_PRICE_PER_THREAD_HOUR"]

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
_CACHE_FILE = "cpu_calibration.json"
# Entries a version before 2 raised may hold the rate of an op that did not do its own math (an autocast
# wrapper around a bf16 GEMM raised fp32 to 1.8x the real peak): those are measured again.
_CACHE_FORMAT = 2
_clock = time.perf_counter   # looked up at call time so tests can substitute a fake clock
_log = logging.getLogger(__name__)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def _threads() -> int:
    try:
        import torch

        return int(torch.get_num_threads())
    except ImportError:
        return os.cpu_count() or 1


def _cache_dir(cache_dir: str | os.PathLike[str] | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("PLASMIENT_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "plasmient-trace"


def _best_time(fn: Any, runs: int) -> float:
    fn()  # warm-up: first call pays allocation, thread-pool start and cache misses
    best = float("inf")
    for _ in range(runs):
        t0 = _clock()
        fn()
        best = min(best, _clock() - t0)
    return best


def _measure_gemm(dtype_name: str) -> float:
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
    dt_s = _best_time(fn, _GEMM_RUNS)
    return 2.0 * n * n * n / dt_s


def _measure_copy() -> float:
    import numpy as np

    n = _COPY_BYTES // 8
    src = np.ones(n, dtype=np.float64)
    dst = np.empty_like(src)
    dt_s = _best_time(lambda: np.copyto(dst, src), _COPY_RUNS)
    return 2.0 * n * 8 / dt_s  # every byte read once and written once


def _cpu_price(threads: int) -> tuple[float, str]:
    """USD an hour, and where it came from. A PLASMIENT_CPU_PRICE that is not a price (negative, NaN, inf, a
    typo) is not used, and the source says so: a negative price would make every cost negative."""
    from ..conventions import MAX_FLAG_VALUE

    env = os.environ.get("PLASMIENT_CPU_PRICE", "").strip()
    rejected = ""
    if env:
        try:
            price = float(env)
        except ValueError:
            price = float("nan")
        if 0 < price <= MAX_FLAG_VALUE:
            return price, "PLASMIENT_CPU_PRICE"
        rejected = f" (PLASMIENT_CPU_PRICE={env!r} ignored: not a price in (0, {MAX_FLAG_VALUE:g}])"
    return CPU_PRICE_PER_THREAD_HOUR * threads, (
        f"default ${CPU_PRICE_PER_THREAD_HOUR}/vCPU-hour x {threads} threads (AWS m7i on-demand, rounded){rejected}")


def user_cpu_spec(peak_tflops: float, threads: int | None = None) -> GpuSpec:
    """The CPU as the device when the user gave its peak (PLASMIENT_PEAK_TFLOPS): nothing is calibrated and
    the peak is theirs, but the price is still this machine's (PLASMIENT_CPU_PRICE, else the default per
    thread). Without it a run with a peak override had no cost on any span."""
    from .hardware import apply_overrides

    price, price_source = _cpu_price(threads or _threads())
    spec = apply_overrides(None, peak_tflops=peak_tflops)
    assert spec is not None  # a peak was given
    return dataclasses.replace(spec, price_per_hour=price, price_source=price_source)


def _cpu_has_bf16() -> bool:
    """bf16 GEMMs have their own CPU rate only with native bf16 math (x86 avx512_bf16 / AMX, Arm bf16)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith(("flags", "features")):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    except OSError:
        pass
    return False


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        cache = json.loads(path.read_text())
        return cache if isinstance(cache, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(path: Path, cache: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        tmp.replace(path)  # atomic, so concurrent ranks never read half a file
    except OSError:
        pass  # an unwritable cache only costs a re-measurement next time


def _measure_all(threads: int) -> dict[str, Any]:
    """Time every dtype with ``threads`` intra-op threads (restored afterwards)."""
    torch: Any = None
    try:
        import torch
    except ImportError:
        pass
    before = torch.get_num_threads() if torch is not None else None
    if torch is not None and before != threads:
        torch.set_num_threads(threads)
    try:
        entry: dict[str, Any] = {"fp32": _measure_gemm("float32"), "fp64": _measure_gemm("float64")}
        if torch is not None and _cpu_has_bf16():
            entry["bf16"] = _measure_gemm("bfloat16")
        entry["bandwidth"] = _measure_copy()
    finally:
        if torch is not None and before != threads:
            torch.set_num_threads(before)
    entry.update(gemm_n=_GEMM_N, copy_bytes=_COPY_BYTES, runs=_GEMM_RUNS, measured_at=time.time(), format=_CACHE_FORMAT)
    return entry


def _valid(entry: Any) -> bool:
    want = ("fp32", "fp64", "bandwidth") + (("bf16",) if _cpu_has_bf16() else ())
    return (isinstance(entry, dict) and all(isinstance(entry.get(k), (int, float)) and entry[k] > 0 for k in want)
            and not (entry.get("raised") and entry.get("format", 1) < _CACHE_FORMAT))


def cpu_spec(cache_dir: str | os.PathLike[str] | None = None, threads: int | None = None) -> GpuSpec:
    """The CPU as a device: per-dtype GEMM peaks (fp32, fp64, bf16 where the CPU has bf16 math) and
    copy bandwidth, each the best of several timed runs with ``threads`` intra-op threads (default:
    torch's current count), measured once and cached.

    The cache is a JSON file under ``cache_dir`` (default ``$PLASMIENT_CACHE_DIR`` or
    ``~/.cache/plasmient-trace``) keyed by CPU model and thread count. Measuring takes seconds and
    loads every core: in a live job call :func:`start_cpu_calibration` outside the steps instead.
    """
    model = _cpu_model()
    threads = threads or _threads()
    key = f"{model}|threads={threads}"
    path = _cache_dir(cache_dir) / _CACHE_FILE
    cache = _read_cache(path)
    entry = cache.get(key)
    if not _valid(entry):
        entry = _measure_all(threads)
        cache[key] = entry
        _write_cache(path, cache)
    return _spec_from_entry(model, threads, entry)


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
              + (f"; {raised}" if raised else ""),
    )


_RAISED_SAID: set[tuple[str, str]] = set()
OVER_PEAK_TOLERANCE = 1.05


def raise_cpu_peak(spec: GpuSpec, observed: Mapping[str, float], threads: int | None = None,
                   cache_dir: str | os.PathLike[str] | None = None,
                   say: Callable[[str], None] | None = None) -> GpuSpec:
    """A calibrated CPU peak is wrong if an op ran faster than 1.05x of it: ``observed`` (the highest
    FLOP/s of a recorded op, per canonical dtype) then becomes the peak, in the returned spec and in
    the cache, and a warning says so once per CPU, thread count and dtype."""
    if spec.device_type != "cpu":
        return spec
    threads = threads or _threads()
    model = _cpu_model()
    key = f"{model}|threads={threads}"
    new_peak = dict(spec.peak)
    raised = [d for d, rate in observed.items()
              if np.isfinite(rate) and rate > OVER_PEAK_TOLERANCE * spec.peak_flops(d)]
    if not raised:
        return spec
    path = _cache_dir(cache_dir) / _CACHE_FILE
    cache = _read_cache(path)
    entry = dict(cache.get(key) or {})
    for d in raised:
        if (key, d) not in _RAISED_SAID:
            _RAISED_SAID.add((key, d))
            text = (f"a {d} op ran at {observed[d]:.3g} FLOP/s, over 1.05x the calibrated CPU peak "
                    f"{spec.peak_flops(d):.3g}: the peak is raised to it (cached for {key})")
            # the caller decides where this goes: ingest prints it, live capture keeps the job's stderr clean
            say(text) if say is not None else _log.warning("plasmient: %s", text)
        new_peak[d] = float(observed[d])
        if entry:
            entry[d] = float(observed[d])
            entry["raised"] = sorted(set(entry.get("raised", [])) | {d})
            entry["format"] = _CACHE_FORMAT
    if entry:
        cache[key] = entry
        _write_cache(path, cache)
    return dataclasses.replace(spec, peak=MappingProxyType(new_peak),
                               notes=spec.notes + f"; {', '.join(raised)} raised to an observed op rate")


def start_cpu_calibration(threads: int | None = None,
                          cache_dir: str | os.PathLike[str] | None = None) -> Future[GpuSpec]:
    """Calibrate the CPU off the training thread: a child process (its own torch, its own thread
    pool, so the job's threads are neither borrowed nor reconfigured) measures with ``threads``
    threads and fills the cache; the Future resolves to :func:`cpu_spec` read from it. A cached
    machine resolves at once without starting anything. The caller picks when: before the first
    step or between steps, never inside one (the measurement loads every core for seconds)."""
    threads = threads or _threads()
    done: Future[GpuSpec] = Future()
    path = _cache_dir(cache_dir) / _CACHE_FILE
    if _valid(_read_cache(path).get(f"{_cpu_model()}|threads={threads}")):
        done.set_result(cpu_spec(cache_dir, threads))
        return done

    def run() -> None:
        try:
            cmd = [sys.executable, "-m", "plasmient_trace.metrics.cpu_peak", "--threads", str(threads)]
            if cache_dir is not None:
                cmd += ["--cache-dir", str(cache_dir)]
            # Detached (own session, no pipes): a job that exits first does not kill the measurement, so
            # the cache is filled for its next run.
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, start_new_session=True)
            code = proc.wait(timeout=600)
            if code != 0:
                raise RuntimeError(f"calibration process exited {code}")
            done.set_result(cpu_spec(cache_dir, threads))
        except Exception as err:  # the Future carries any failure to the caller
            done.set_exception(err)

    threading.Thread(target=run, name="plasmient-cpu-calibration", daemon=True).start()
    return done


def _main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Measure the CPU's peaks into plasmient's cache.")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--cache-dir")
    args = parser.parse_args(argv)
    cpu_spec(args.cache_dir, args.threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
