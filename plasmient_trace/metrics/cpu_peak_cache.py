"""The CPU calibration cache: where it lives, its file format, and which entries are still good.

Shared by the calibration (``cpu_peak``) and the raise rule (``cpu_peak_raise``), which both read and
write the same entries; entries are keyed by ``cpu_identity.cache_key``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .cpu_identity import cpu_flags

CACHE_FILE = "cpu_calibration.json"
# Entries a version before 2 raised may hold the rate of an op that did not do its own math (an autocast
# wrapper around a bf16 GEMM raised fp32 to 1.8x the real peak); entries before 3 were timed whatever
# else ran (a training job beside the calibration made its 2-thread fp32 peak 5x too low, every MFU of
# that machine 5x too high): both are measured again.
CACHE_FORMAT = 3


def torch_threads() -> int:
    """The intra-op threads torch runs with (the CPUs' count without torch): a peak is per thread count."""
    try:
        import torch

        return int(torch.get_num_threads())
    except ImportError:
        return os.cpu_count() or 1


def cache_dir(explicit: str | os.PathLike[str] | None) -> Path:
    """``explicit``, else ``PLASMIENT_CACHE_DIR``, else ``~/.cache/plasmient-trace``."""
    if explicit is not None:
        return Path(explicit)
    env = os.environ.get("PLASMIENT_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "plasmient-trace"


def cpu_has_bf16() -> bool:
    """bf16 GEMMs have their own CPU rate only with native bf16 math (x86 avx512_bf16 / AMX, Arm bf16)."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16", "bf16"})


def read_cache(path: Path) -> dict[str, Any]:
    """The cache's entries; an unreadable or foreign file reads as empty (it costs a re-measurement)."""
    try:
        cache = json.loads(path.read_text())
        return cache if isinstance(cache, dict) else {}
    except (OSError, ValueError):
        return {}


def write_cache(path: Path, cache: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        tmp.replace(path)  # atomic, so concurrent ranks never read half a file
    except OSError:
        pass  # an unwritable cache only costs a re-measurement next time


def valid_entry(entry: Any) -> bool:
    """Whether a cached entry can be used as it is, or must be measured again."""
    want = ("fp32", "fp64", "bandwidth") + (("bf16",) if cpu_has_bf16() else ())
    # A raised entry without its measured peaks was raised before raises were bounded: one op could set it
    # to any rate (an op cut off by checkpoint's early stop cached 5.8e12 on a 9.4e10 CPU): measured again.
    return (isinstance(entry, dict) and all(isinstance(entry.get(k), (int, float)) and entry[k] > 0 for k in want)
            and entry.get("format", 1) >= CACHE_FORMAT
            and (not entry.get("raised") or isinstance(entry.get("measured"), dict)))
