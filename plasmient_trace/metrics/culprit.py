"""One-line suggestions for the culprit of a step: what the waste looks like and what usually fixes it.

Called once per step/rank/node/fleet span (not per kernel), so plain Python is fine here.
"""

from __future__ import annotations

import re

_ATTENTION = re.compile(r"attention|attn|fmha|flash|sdpa|softmax", re.I)
_GEMM = re.compile(r"gemm|matmul|\bmm\b|addmm|bmm|linear|cutlass|cublas|sm\d+_xmma|ampere_|hopper|wgmma|nvjet", re.I)
_CONV = re.compile(r"conv|cudnn|implicit_convolve|winograd|igemm", re.I)
_ELEMENTWISE = re.compile(r"elementwise|vectorized|unrolled|reduce|norm|layer_norm|rms|batch_norm|add|mul|copy|fill|cat", re.I)


def suggestion(
    kernel: str | None,
    op: str | None,
    module: str | None,
    bound: str | None,
    kind: str | None,
    idle_fraction: float,
    mean_kernel_s: float | None = None,
) -> str:
    """A short, specific hint. The step's idle fraction wins when the device mostly waited."""
    text = f"{kernel or ''} {op or ''}"
    where = f" in {module}" if module else ""
    if idle_fraction > 0.5:
        return (f"device idle {idle_fraction:.0%} of the step: the host cannot feed it; capture with CUDA graphs or "
                f"torch.compile, raise the batch, and overlap data loading")
    if kind == "collective" or bound == "communication":
        return "communication-bound: overlap collectives with compute (DDP buckets, FSDP prefetch) or shard less"
    if kind in ("memcpy", "memset"):
        return "host/device copies on the critical path: pin memory, use non_blocking copies, keep tensors on device"
    if bound == "latency":
        mean = f" (mean {mean_kernel_s * 1e6:.1f} us)" if mean_kernel_s else ""
        return f"launch/latency-bound tiny kernels{mean}{where}: fuse them (torch.compile) or replay with CUDA graphs"
    if _ATTENTION.search(text) and bound in ("memory", "idle"):
        return f"memory-bound attention{where} (decode-like): raise the batch or use a flash-decoding/paged attention kernel"
    if _GEMM.search(text) and bound == "memory":
        return f"GEMM with low arithmetic intensity{where}: raise batch x sequence so weights are reused, or fuse/group small GEMMs"
    if _CONV.search(text) and bound == "memory":
        return f"memory-bound convolution{where}: use channels_last and bf16, raise the batch"
    if bound == "memory" and _ELEMENTWISE.search(text):
        return f"memory-bound elementwise/norm kernels{where}: fuse them (torch.compile) to cut memory traffic"
    if bound == "memory":
        return f"memory-bound{where}: raise arithmetic intensity (bigger batch, fusion, lower precision)"
    if bound == "compute":
        return f"compute-bound below baseline{where}: use bf16/fp8 tensor cores or a better-tuned kernel"
    return f"most wasted device time{where}: inspect this kernel's launch configuration and input shapes"
