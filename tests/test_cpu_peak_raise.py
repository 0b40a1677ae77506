"""What recorded ops must show to raise a calibrated CPU peak, and how far they may raise it (metrics.cpu_peak_raise).

One op once raised, and cached, a 2-core CPU's fp32 peak from 9.4e10 to 5.8e12 FLOP/s: an aten::addmm that
checkpoint's early stop cut off before its GEMM was credited 537 MFLOPs in 0.1 ms. Every later MFU on that
machine read 60x too low."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from plasmient_trace.metrics import cpu_peak as C
from plasmient_trace.metrics import hardware as H

PEAK = 9.4e10
CUT_OFF = (537e6, 1e-4)   # the cut-off addmm: FLOPs credited, seconds recorded


def _calibrated(tmp_path: Path, **extra) -> H.GpuSpec:
    """A spec read from a cache entry as a calibration left it (nothing is timed here)."""
    entry = {"fp32": PEAK, "fp64": PEAK / 2, "bf16": PEAK, "bandwidth": 3e10, "format": C._CACHE_FORMAT,
             "gemm_n": 1024, "runs": 5, "idle_checked": True, **extra}
    (tmp_path / C._CACHE_FILE).write_text(json.dumps({C._cache_key(1): entry}))
    return C.cpu_spec(cache_dir=tmp_path, threads=1)


def _cached(tmp_path: Path) -> dict:
    return json.loads((tmp_path / C._CACHE_FILE).read_text())[C._cache_key(1)]


def test_an_op_shorter_than_a_millisecond_is_no_evidence_of_the_peak() -> None:
    flops, seconds = CUT_OFF
    assert C.evidence_rates([flops, flops, flops], [seconds, seconds, seconds], ["fp32"] * 3) == {}
    # the same rate held for milliseconds is
    assert C.evidence_rates([1.2e9, 1.2e9], [0.01, 0.01], ["fp32", "fp32"]) == {"fp32": pytest.approx(1.2e11)}


def test_one_fast_op_alone_is_no_evidence_the_second_fastest_sets_the_rate() -> None:
    assert C.evidence_rates([5e9], [0.01], ["fp32"]) == {}
    rates = C.evidence_rates([5e9, 1.1e9, 1.0e9, 0.9e9], [0.01] * 4, np.array(["fp32"] * 4))
    assert rates == {"fp32": pytest.approx(1.1e11)}
    # per dtype: two bf16 ops do not vouch for an fp32 one
    assert C.evidence_rates([5e9, 1e9], [0.01, 0.01], ["fp32", "bf16"]) == {}


def test_a_rate_over_twice_the_measured_peak_is_refused_and_said_once(tmp_path: Path) -> None:
    spec = _calibrated(tmp_path)
    said: list[str] = []
    rate = CUT_OFF[0] / CUT_OFF[1]   # 5.4e12: the rate that was cached
    for _ in range(2):
        assert C.raise_cpu_peak(spec, {"fp32": rate}, threads=1, cache_dir=tmp_path, say=said.append) is spec
    assert _cached(tmp_path)["fp32"] == PEAK and "raised" not in _cached(tmp_path)
    assert len(said) == 1 and "not taken as the peak" in said[0] and "5.37e+12" in said[0]


def test_raises_cannot_ratchet_past_twice_the_measured_peak(tmp_path: Path) -> None:
    spec = _calibrated(tmp_path)
    first = C.raise_cpu_peak(spec, {"fp32": 1.9 * PEAK}, threads=1, cache_dir=tmp_path, say=lambda _: None)
    assert first.peak_flops("fp32") == 1.9 * PEAK
    assert _cached(tmp_path)["fp32"] == 1.9 * PEAK and _cached(tmp_path)["measured"] == {"fp32": PEAK}
    # 3.5x is under twice the raised peak, but over twice the measured one
    again = C.raise_cpu_peak(first, {"fp32": 3.5 * PEAK}, threads=1, cache_dir=tmp_path, say=lambda _: None)
    assert again.peak_flops("fp32") == 1.9 * PEAK
    assert C.cpu_spec(cache_dir=tmp_path, threads=1).peak_flops("fp32") == 1.9 * PEAK


def test_an_entry_raised_before_raises_were_bounded_is_measured_again(tmp_path: Path) -> None:
    # what the bug left in caches: a raised fp32 peak with no record of the measured one
    _calibrated(tmp_path)
    path = tmp_path / C._CACHE_FILE
    cache = json.loads(path.read_text())
    cache[C._cache_key(1)].update(fp32=5.765e12, raised=["fp32"])
    path.write_text(json.dumps(cache))
    assert not C._valid(_cached(tmp_path))
    # one this version raised keeps its measured peak beside it, and stays
    assert C._valid({**_cached(tmp_path), "measured": {"fp32": PEAK}})
