"""One-line suggestions for a culprit row: what the waste looks like and what usually fixes it.

Advice follows from evidence only: compute/memory advice needs a compute/memory bound (known FLOPs,
bytes and peak); collectives get communication advice; idle rows get host-side advice; an unknown bound
says what is missing. CPU runs get CPU words (no tensor cores, no CUDA graphs, no GPU-hours).
Called once per culprit row (a handful per step), so plain Python is fine here; the name matching is
cached per name, since every step repeats its culprits.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

from .flops.elementwise import JOIN_OPS
from .flops.moe import MOE_OPS

_ATTENTION = re.compile(r"attention|attn|fmha|flash|sdpa", re.I)
# A softmax is attention's only inside an attention module (an unfused one); a loss's log_softmax is not.
_SOFTMAX = re.compile(r"softmax", re.I)
# Kernels that only change a tensor's layout (cuDNN's nchwToNhwc, MIOpen's batched_transpose).
_LAYOUT = re.compile(r"nchwToNhwc|nhwcToNchw|batched_transpose", re.I)
_NORM = re.compile(r"batch_norm|layer_norm|group_norm|instance_norm|rms_?norm|cudnn::bn_", re.I)
_BACKWARD = re.compile(r"backward|bwd", re.I)  # "[backward]" module phases too
# Names that say the attention is a decode (one query token against a KV cache): split-KV, paged, decode kernels.
_DECODE = re.compile(r"splitkv|split_kv|paged|decode|unified_attention", re.I)
# Tensile and hipBLASLt name their GEMM kernels Cijk_<layout>_...: a replay's kernel with no op says GEMM by it
_GEMM = re.compile(r"gemm|matmul|\bmm\b|addmm|bmm|linear|cutlass|cublas|sm\d+_xmma|ampere_|hopper|wgmma|nvjet|\bCijk_", re.I)
_CONV = re.compile(r"conv|cudnn|implicit_convolve|winograd|igemm", re.I)
_ELEMENTWISE = re.compile(r"elementwise|vectorized|unrolled|reduce|norm|layer_norm|rms|batch_norm|add|mul|copy|fill|cat|softmax"
                          # aten's pointwise ops by name (on a CPU the op is the kernel: no kernel name says it)
                          r"|aten::(gelu|silu|relu|sigmoid|tanh|sqrt|rsqrt|exp|div|sub|neg|abs|pow|clamp|where|lerp|addc)",
                          re.I)


@functools.lru_cache(maxsize=1 << 14)
def _memory_family(text: str, module: str = "") -> str | None:
    """Which kind of memory-bound work the kernel and op names say it is (cached: templated kernel names run
    to hundreds of characters and every step's culprits repeat them); a softmax is attention only in an
    attention module."""
    if _SOFTMAX.search(text) and _ATTENTION.search(module) and not _GEMM.search(text):
        return "attention"
    if _NORM.search(text):  # cuDNN's batch norm kernels say "cudnn", which is not a convolution
        return "elementwise"
    # a convolution before a GEMM: implicit-GEMM convolutions (MIOpen's igemm_*, cuDNN's *_implicit_gemm) say both
    for family, pattern in (("attention", _ATTENTION), ("conv", _CONV), ("gemm", _GEMM), ("elementwise", _ELEMENTWISE)):
        if pattern.search(text):
            return family
    return None


# Precisions a GPU runs without its 16-bit tensor math, as the advice names them.
_WIDE = {"fp32": "fp32", "tf32": "TF32", "3xtf32": "fp32 (3xTF32)", "fp64": "fp64"}


def _compute_advice(precision: str | None, where: str, peak: Callable[[str], float] | None,
                    native: frozenset[str]) -> str:
    """A compute-bound kernel below baseline: the next precision down, where the device has one. A bf16 GEMM
    on an H100 is not told to use bf16, nor a V100 (fp16 tensor cores, no bf16) to use bf16."""
    if precision in _WIDE:
        half = "bf16" if "bf16" in native or not native else "fp16"
        gain = peak(half) / peak(precision) if peak is not None else float("nan")
        times = f" ({gain:.0f}x its peak)" if gain == gain and gain >= 1.5 else ""
        return (f"compute-bound{where} at {_WIDE[precision]}: run it in {half} (torch.autocast) so tensor cores do "
                f"its math{times}, or a better-tuned kernel")
    if precision in ("bf16", "fp16"):
        if "fp8" in native:
            return (f"compute-bound below baseline{where} at {precision}: fp8 matmuls (Transformer Engine, torchao) "
                    f"double its peak; else a better-tuned kernel")
        return f"compute-bound below baseline{where} at {precision}: a better-tuned kernel (tile shapes, no split-K) or a bigger batch"
    return f"compute-bound below baseline{where}: use bf16/fp8 tensor cores or a better-tuned kernel"


def suggestion(
    kernel: str | None,
    op: str | None,
    module: str | None,
    bound: str | None,
    kind: str | None,
    idle_fraction: float = 0.0,
    mean_kernel_s: float | None = None,
    device_type: str = "gpu",
    idle_row: bool = False,
    idle_host_share: float | None = None,
    missing: str | None = None,
    precision: str | None = None,
    peak: Callable[[str], float] | None = None,
    native: frozenset[str] = frozenset(),
) -> str:
    """A short, specific hint for one culprit row. ``missing``: for an unknown bound, the first evidence it
    lacks (``stitch.culprits.MISSING``), so the hint names what to record or supply, not a guess.
    ``precision``: what the kernel's math ran at; ``peak`` (precision -> FLOP/s) and ``native`` (the
    precisions the device has units for) say what a compute-bound kernel could move to."""
    text = f"{kernel or ''} {op or ''}"
    where = f" in {module}" if module else ""
    cpu = device_type == "cpu"
    if idle_row or bound == "idle":
        if cpu:
            return (f"CPU idle {idle_fraction:.0%} of the step between ops: the Python loop, data loading or I/O "
                    f"holds it; profile the host side and overlap data loading")
        if idle_host_share is not None and idle_host_share < 0.5:
            return (f"device idle {idle_fraction:.0%} of the step with kernels already queued: it waited on a "
                    f"dependency (a stream or event wait, a collective on a slower rank, a host sync); find the wait "
                    f"before adding work, CUDA graphs will not help")
        return (f"device idle {idle_fraction:.0%} of the step with nothing queued: the host did not feed it; capture "
                f"with CUDA graphs or torch.compile, raise the batch, and overlap data loading")
    if kind == "collective" or bound == "communication":
        return _communication_advice(text, module or "")
    if kind in ("memcpy", "memset"):
        return "host/device copies on the critical path: pin memory, use non_blocking copies, keep tensors on device"
    if not cpu and bound in ("compute", "memory", "latency") and _layout_in_conv(kernel or "", op or ""):
        # A convolution's own NCHW<->NHWC transposes carry none of its work and are memory-bound by nature
        # (metrics.flops.ownership.split_op_work): what the kernel's name says is the fix.
        return (f"layout transposes inside {op}{where}: use channels_last (model.to(memory_format="
                f"torch.channels_last)) so the convolution runs without them")
    if (bound in ("memory", "latency") and (module or "").startswith("Optimizer.step") and "fused" not in module.lower()
            and not (op or "").startswith(("aten::_foreach", "aten::_fused"))):
        # one op per parameter under the optimizer's step: the for-loop implementation of a torch.optim step
        return (f"the optimizer's per-parameter {op or 'work'} in {module}: foreach=True or fused=True runs it as a "
                f"few kernels over all parameters")
    if cpu and (module or "").startswith("enumerate(DataLoader)") and "SingleProcess" in (module or ""):
        # torch.compile or batching would not touch it: it is the batch being assembled between steps
        return (f"the DataLoader assembles each batch ({op or 'its ops'}) on the training thread, between steps: "
                f"num_workers > 0 prepares the next batches in worker processes while this one trains")
    if bound == "latency":
        mean = f" (mean {mean_kernel_s * 1e6:.1f} us)" if mean_kernel_s else ""
        if cpu:
            return f"many tiny ops{mean}{where}: per-op overhead dominates; fuse them (torch.compile) or batch the work"
        return f"launch/latency-bound tiny kernels{mean}{where}: fuse them (torch.compile) or replay with CUDA graphs"
    if bound in (None, "unknown"):
        return _unknown_bound(missing, op, where, cpu)
    if bound == "memory":
        family = _memory_family(text, module or "")
        if family == "attention":
            return _attention_advice(text, module or "", where, cpu)
        if family == "gemm":
            return f"GEMM with low arithmetic intensity{where}: raise batch x sequence so weights are reused, or fuse/group small GEMMs"
        if family == "conv":
            return f"memory-bound convolution{where}: use channels_last and bf16, raise the batch"
        if family == "elementwise":
            return f"memory-bound elementwise/norm work{where}: fuse it (torch.compile) to cut memory traffic"
    if bound == "memory":
        return f"memory-bound{where}: raise arithmetic intensity (bigger batch, fusion, lower precision)"
    if bound == "compute":
        if cpu:
            return f"compute-bound below baseline{where}: check the BLAS threads (torch.set_num_threads) and use bf16 where the CPU has it"
        return _compute_advice(precision, where, peak, native)
    return f"most wasted time{where}: inspect this kernel's launch configuration and input shapes"


# What an unknown bound lacks (stitch.culprits.MISSING), and what supplies it.
_UNKNOWN_ADVICE = {
    "launch": ("no launch record joins this kernel to an op{where}, so its FLOPs are unknown: its launch came before "
               "the profiler started recording, or was dropped; synchronizing the device before the recorded steps "
               "keeps earlier kernels out of them"),
    "op": "this kernel's launch is inside no op the profiler recorded{where}, so its FLOPs are unknown",
    "shapes": "{op} was recorded without input shapes, so its FLOPs are unknown{where}: profile with record_shapes=True",
    "formula": ("no FLOP formula for {op}{where}: its efficiency is unknown; register one "
                "(metrics.flops.register_flop_formula)"),
    "graph": ("replayed from a CUDA/HIP graph that {op} launched{where}; the graph's capture is not in this trace, so the "
              "ops it ran and their FLOPs are unknown: ingest with --graph-capture CAPTURE_TRACE, a profile of the capture"),
    "bytes": ("no byte count for {op}{where}, so its arithmetic intensity and bound are unknown; register a formula "
              "that returns bytes (metrics.flops.register_flop_formula)"),
    "peak": ("the device's peak FLOP/s or memory bandwidth is unknown, so the bound is too{where}: name the GPU "
             "(--gpu-model) or give its peaks (--peak-tflops, --bandwidth-gbs)"),
    None: ("no FLOP model for this work{where}: its efficiency is unknown; record shapes (record_shapes=True), or "
           "register a formula for its op (metrics.flops.register_flop_formula)"),
}


_DDP = re.compile(r"DistributedDataParallel", re.I)
_FSDP = re.compile(r"FullyShardedDataParallel|FSDP", re.I)
# tensor-parallel all-reduces of inference engines: vLLM's ops, torch's symmetric memory, custom all-reduce
_TENSOR_PARALLEL = re.compile(r"vllm::|symm_mem::|multimem|one_shot_all_reduce|two_shot_all_reduce|cross_device_reduce", re.I)


def _communication_advice(text: str, module: str) -> str:
    """What overlaps or shrinks this collective, by who issued it (its module or op names)."""
    if _FSDP.search(module):
        return ("communication-bound FSDP collectives: prefetch the next all-gather (forward_prefetch, "
                "backward_prefetch) so it overlaps compute, or shard over fewer ranks")
    if _DDP.search(module):
        if "[backward]" in module:
            return ("communication-bound DDP gradient all-reduce: size the buckets (bucket_cap_mb) so they overlap "
                    "the backward pass, or compress the gradients (a bf16 communication hook)")
        return ("communication-bound DDP collective outside the backward pass (its forward broadcasts buffers "
                "every step): broadcast_buffers=False where the buffers never diverge between ranks")
    if _TENSOR_PARALLEL.search(text):
        return ("communication-bound tensor-parallel all-reduce: use fewer tensor-parallel ranks for this batch, "
                "or fuse or overlap the all-reduce with its neighbours (e.g. all-reduce + RMSNorm fusion)")
    return "communication-bound: overlap collectives with compute (DDP buckets, FSDP prefetch) or shard less"


# A CPU has no model to name: its peaks are measured (live) or given.
_CPU_PEAK_ADVICE = ("the CPU's peak FLOP/s or memory bandwidth is unknown, so the bound is too{where}: give both "
                    "(--peak-tflops and --bandwidth-gbs); live, leave PLASMIENT_PEAK_TFLOPS unset and both are "
                    "measured on this CPU")


def _unknown_bound(missing: str | None, op: str | None, where: str, cpu: bool = False) -> str:
    if missing == "bytes" and op in JOIN_OPS:
        # no bytes to be had (a tensor list's element type is never recorded), and none needed to say what helps
        return (f"{op}{where} copies its inputs into a new tensor and computes nothing (its bytes are unknown: the "
                f"profiler records no element type for a tensor list): write into a preallocated buffer instead, "
                f"or fuse it into its producer and consumer (torch.compile)")
    if missing == "formula" and op in MOE_OPS:
        # the formula exists; what the trace lacks is the experts' size, which only the model's config holds
        return (f"{op}{where}: the experts' FLOPs need their size, which the trace does not record: give the "
                f"model's Hugging Face config.json (plasmient ingest --model-config config.json)")
    if missing == "peak" and cpu:
        return _CPU_PEAK_ADVICE.format(where=where)
    return _UNKNOWN_ADVICE.get(missing, _UNKNOWN_ADVICE[None]).format(op=op or "this kernel", where=where)


@functools.lru_cache(maxsize=1 << 14)
def _layout_in_conv(kernel: str, op: str) -> bool:
    """A layout kernel (NCHW<->NHWC) launched by a convolution (cached per name pair, as the families are)."""
    return bool(_LAYOUT.search(kernel)) and bool(_CONV.search(op))


def _attention_advice(text: str, module: str, where: str, cpu: bool) -> str:
    """Memory-bound attention: a decode only where the names say so; a backward pass is training's."""
    if cpu:
        return f"memory-bound attention{where}: raise the batch, or fuse it (scaled_dot_product_attention, torch.compile)"
    if _BACKWARD.search(text) or _BACKWARD.search(module):
        return f"memory-bound attention backward{where}: raise batch x sequence so each kernel reuses what it loads"
    if _DECODE.search(text):
        return f"memory-bound attention{where} (decode): raise the batch or use a flash-decoding/paged attention kernel"
    return (f"memory-bound attention{where}: raise batch x sequence, or use a fused (flash) attention kernel if "
            f"this one is not")
