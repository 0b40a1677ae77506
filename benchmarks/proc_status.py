"""This process's memory as Linux reports it in /proc/self/status, for the benchmarks' own measures.

Standard library only, so a benchmark's child can read its resident set without importing anything that
would change it. VmHWM is this process's own peak: ru_maxrss is inherited by a child across fork + exec.
"""

from __future__ import annotations


def vm_kib(field: str) -> int | None:
    """A ``Vm*`` field (``VmRSS``, ``VmHWM``) in KiB; None where the file has no such line."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return None


def vm_mib(field: str) -> float:
    """The same field in MiB; NaN where the file has no such line."""
    kib = vm_kib(field)
    return float("nan") if kib is None else kib / 1024.0
