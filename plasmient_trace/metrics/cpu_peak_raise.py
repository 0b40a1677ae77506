"""When ops prove a calibrated CPU peak wrong, and how far they may move it (:func:`raise_cpu_peak`)."""

from __future__ import annotations

import dataclasses
import logging
import os
from types import MappingProxyType
from typing import Callable, Mapping

import numpy as np

from . import cpu_peak_cache as cache_file
from .cpu_identity import cache_key
from .hardware import GpuSpec

_log = logging.getLogger(__name__)

_RAISED_SAID: set[tuple[str, str]] = set()
_REFUSED_SAID: set[tuple[str, str]] = set()
OVER_PEAK_TOLERANCE = 1.05
# What it takes for ops to move a calibrated peak. The peak is a careful measurement (the best of timed
# 1024^3 GEMMs, each tens of ms, on an idle machine); an op's rate is its modelled FLOPs over one recorded
# interval, and is wrong whenever the model credits work that did not run: an aten::addmm that checkpoint's
# early stop cut off before its GEMM was credited 537 MFLOPs in 0.1 ms, "5.8 TFLOP/s" on a 2-core CPU that
# does 94 GFLOP/s, and cached that peak, so every later MFU of the machine read 60x too low. So:
# - an op timed for less than MIN_EVIDENCE_S is no evidence: its interval is mostly dispatch and hooks,
#   and a credit error is a large rate there (the cut-off op's 0.1 ms); a GEMM that a faster BLAS path
#   really speeds up runs for milliseconds on a CPU;
# - EVIDENCE_OPS ops must reach the rate (it is the second fastest's): one mistimed op cannot do it, while
#   a training loop runs each of its GEMMs every step;
# - no raise goes past MAX_RAISE x the measured peak, however many raises were made before (bounded from the
#   measured value, not the latest raise, so raises cannot ratchet): a BLAS path beats a 1024^3 calibration
#   GEMM by tens of percent (larger tiles), not 2x, and a rate past that says the op's FLOPs are wrong. A
#   bound from /proc/cpuinfo (cores x SIMD lanes x 2 for FMA x clock) is not used: cpuinfo names neither the
#   FMA units per core nor the turbo clock, and either guess is off by 2x.
MIN_EVIDENCE_S = 1e-3
EVIDENCE_OPS = 2
MAX_RAISE = 2.0


def evidence_rates(flops: np.ndarray, seconds: np.ndarray, dtypes: np.ndarray) -> dict[str, float]:
    """Per dtype, the FLOP/s that recorded ops show a CPU reaches, for :func:`raise_cpu_peak`: the
    ``EVIDENCE_OPS``-th fastest rate among ops with FLOPs timed for at least ``MIN_EVIDENCE_S`` (one value
    per op: ``flops``, ``seconds`` and ``dtypes``, the canonical dtype names). A dtype with fewer such ops
    has none."""
    flops, seconds, dtypes = np.asarray(flops, np.float64), np.asarray(seconds, np.float64), np.asarray(dtypes)
    ok = (flops > 0) & (seconds >= MIN_EVIDENCE_S) & np.isfinite(flops)
    out: dict[str, float] = {}
    for d in np.unique(dtypes[ok]).tolist():
        rates = np.sort(flops[ok & (dtypes == d)] / seconds[ok & (dtypes == d)])
        if len(rates) >= EVIDENCE_OPS:
            out[str(d)] = float(rates[-EVIDENCE_OPS])
    return dict(sorted(out.items()))


def raise_cpu_peak(spec: GpuSpec, observed: Mapping[str, float], threads: int | None = None,
                   cache_dir: str | os.PathLike[str] | None = None,
                   say: Callable[[str], None] | None = None) -> GpuSpec:
    """A calibrated CPU peak is wrong if ops ran faster than 1.05x of it: ``observed`` (per canonical dtype,
    the rate :func:`evidence_rates` gives) then becomes the peak, in the returned spec and in the cache, and a
    warning says so once per CPU, thread count and dtype. A rate over ``MAX_RAISE`` x the measured peak
    (the cache keeps it beside a raised one) is refused and said once: such an op's FLOPs did not all run."""
    if spec.device_type != "cpu":
        return spec
    threads = threads or cache_file.torch_threads()
    key = cache_key(threads)
    new_peak = dict(spec.peak)
    over = [d for d, rate in observed.items()
            if np.isfinite(rate) and rate > OVER_PEAK_TOLERANCE * spec.peak_flops(d)]
    if not over:
        return spec
    path = cache_file.cache_dir(cache_dir) / cache_file.CACHE_FILE
    cache = cache_file.read_cache(path)
    entry = dict(cache[key]) if cache_file.valid_entry(cache.get(key)) else {}   # an entry due to be measured again stays so
    measured = dict(entry.get("measured", {}))
    # the caller decides where a line goes: ingest prints it, live capture keeps the job's stderr clean
    tell = say if say is not None else (lambda text: _log.warning("plasmient: %s", text))
    raised = []
    for d in over:
        # the measured peak the cache keeps beside a raised one, else the spec's (the peak this job reads: the
        # cache may have been measured again since, a little lower)
        base = float(measured.get(d, spec.peak_flops(d)))
        if observed[d] > MAX_RAISE * base:
            if (key, d) not in _REFUSED_SAID:
                _REFUSED_SAID.add((key, d))
                tell(f"a {d} op ran at {observed[d]:.3g} FLOP/s, over {MAX_RAISE:g}x the measured CPU peak "
                     f"{base:.3g}: not taken as the peak (its FLOPs cannot all have run in its time); "
                     f"delete {key!r} from {path} to measure the CPU again")
            continue
        raised.append(d)
        if (key, d) not in _RAISED_SAID:
            _RAISED_SAID.add((key, d))
            tell(f"a {d} op ran at {observed[d]:.3g} FLOP/s, over 1.05x the calibrated CPU peak "
                 f"{spec.peak_flops(d):.3g}: the peak is raised to it (cached for {key})")
        new_peak[d] = float(observed[d])
        if entry:
            measured.setdefault(d, float(entry[d]))
            entry[d] = float(observed[d])
            entry["measured"] = measured
            entry["raised"] = sorted(set(entry.get("raised", [])) | {d})
            entry["format"] = cache_file.CACHE_FORMAT
    if not raised:
        return spec
    if entry:
        cache[key] = entry
        cache_file.write_cache(path, cache)
    return dataclasses.replace(spec, peak=MappingProxyType(new_peak),
                               notes=spec.notes + f"; {', '.join(raised)} raised to an observed op rate")
