"""Which CPU this is, for the calibration cache (``cpu_peak``): a measured peak may be reused only on a CPU
that reaches the same one.

A model name alone does not say that: in a VM it can be generic ("AMD EPYC", no model number, for a Zen 3
without AVX-512 and a Zen 4 with it), and two such machines used to share one cached peak. The key adds a
digest of what sets a GEMM's rate: the vendor, family, model and stepping (or Arm's implementer, part and
variant), the cache size, the SIMD and matrix extensions (AVX2/AVX-512/AMX, NEON/SVE/SME, bf16, FMA) and the
machine's size (logical CPUs, siblings and cores per package: whether N threads get N cores or share them).
Values that change with each boot or update and not with the silicon (clock speed, bogomips, microcode, the
kernel's other flags) are left out, so a reboot or a kernel upgrade does not throw a calibration away; a peak
that a microcode update made slower is still raised by the first op that beats it (``raise_cpu_peak``)."""

from __future__ import annotations

import hashlib
import os
import platform

CPUINFO = "/proc/cpuinfo"   # read at call time, so tests can point it at a fake file

_FIELDS = ("vendor_id", "cpu family", "model", "model name", "stepping", "cache size", "siblings", "cpu cores",
           "cpu implementer", "cpu architecture", "cpu variant", "cpu part", "cpu revision")
_SIMD_PREFIXES = ("sse", "ssse", "avx", "amx", "fma", "f16c", "vnni", "asimd", "neon", "sve", "sme", "bf16", "i8mm",
                  "fphp")


def _first_processor() -> tuple[dict[str, str], int] | None:
    """The first processor's fields (lower-case names) and the number of logical CPUs; None without cpuinfo."""
    fields: dict[str, str] = {}
    count = 0
    try:
        with open(CPUINFO, encoding="utf-8", errors="replace") as f:
            for line in f:
                name, sep, value = line.partition(":")
                if not sep:
                    continue
                name = name.strip().lower()
                if name == "processor":
                    count += 1
                if count <= 1:
                    fields.setdefault(name, value.strip())
    except OSError:
        return None
    return fields, count


def cpu_flags() -> set[str]:
    """The CPU's feature flags (x86 ``flags``, Arm ``Features``)."""
    info = _first_processor()
    if info is None:
        return set()
    return set((info[0].get("flags") or info[0].get("features") or "").split())


def cpu_model() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it (generic in some VMs), else what platform says."""
    info = _first_processor()
    if info is not None and info[0].get("model name"):
        return info[0]["model name"]
    return platform.processor() or platform.machine() or "unknown cpu"


def cache_key(threads: int) -> str:
    """The calibration cache's key: the model name (to read), a digest of the identity above, the thread count."""
    info = _first_processor()
    if info is None:
        identity = [platform.machine(), platform.processor(), str(os.cpu_count())]
    else:
        fields, count = info
        simd = sorted(f for f in cpu_flags() if f.startswith(_SIMD_PREFIXES))
        identity = [f"{k}={fields.get(k, '')}" for k in _FIELDS] + [f"cpus={count}", "simd=" + " ".join(simd)]
    digest = hashlib.sha256("\n".join(identity).encode()).hexdigest()[:12]
    return f"{cpu_model()}|cpu={digest}|threads={threads}"
