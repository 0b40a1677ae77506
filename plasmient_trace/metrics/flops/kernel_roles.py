"""Which of a matmul's or convolution's kernels do its arithmetic, by kernel name.

A GEMM or convolution op often launches more than the kernel that multiplies. MIOpen wraps its
implicit-GEMM convolutions in layout transposes (``batched_transpose_*``, ``transpose_NCHW2CNHW``),
a fill of the output (``SubTensorOpWithScalar1d``) and a cast of the fp32 workspace
(``SubTensorOpWithCastTensor1d``); cuDNN converts layouts (``nchwToNhwcKernel``), scales the output
(``scalePackedTensor_kernel``), unrolls the input (``im2col4d_kernel``) and precomputes offsets
(``cask_cudnn::computeOffsetsKernel``); cuBLAS reduces split-K partials (``splitKreduce_kernel``) and
adds a bias in an epilogue; aten copies the bias into the output before a GEMM. Those kernels move,
fill or cast data. The op's FLOPs belong to the kernel that multiplies (``igemm_*``, ``Cijk_*``,
``*sgemm*``, ``volta_scudnn_*``, ``dgrad_engine``, CK's ``kernel_grouped_conv_fwd_*``, ...), and
``ownership.split_op_work`` gives them to it.

Each kernel gets a role: ``ROLE_MOVES`` (a data-movement helper, recognised by its function name:
template arguments and parameters are left out, since a GEMM's template names its layouts and a
helper's names cuDNN or cuBLAS types), ``ROLE_ARITHMETIC`` (a GEMM/convolution kernel, recognised
anywhere in its name: ``cutlass::Kernel2<cutlass_80_tensorop_..._s16816gemm_...>``), else
``ROLE_OTHER`` (a name neither list knows). Winograd and FFT transform kernels are arithmetic: they
compute the convolution in another basis.
"""

from __future__ import annotations

import functools
import re

import numpy as np
import pyarrow as pa

from ..grouping import dictionary_of

__all__ = ["ROLE_MOVES", "ROLE_OTHER", "ROLE_ARITHMETIC", "kernel_roles", "kernel_role", "function_name"]

ROLE_MOVES, ROLE_OTHER, ROLE_ARITHMETIC = 0, 1, 2

# Matched against the kernel's function name only.
_MOVES = re.compile(
    r"transpose|nchw_?(2|to)_?nhwc|nhwc_?(2|to)_?nchw|"        # layout conversions (MIOpen, cuDNN)
    r"SubTensorOp|OpTensor|SetTensor|ScaleTensor|CopyTensor|CastTensor|scalePackedTensor|"  # MIOpen/cuDNN tensor ops
    r"copy|fill|memset|memcpy|cast|"                           # aten copies and fills, casts
    r"im2col|col2im|vol2col|col2vol|Im\dd2Col|SubSample|UpSample|"  # unrolling or striding the input for a GEMM
    r"Offsets?Kernel|"                                         # cuDNN (cask) offset tables
    r"(?<![a-z])scal_kernel|splitKreduce|epilogue|"            # cuBLAS: beta scaling, split-K sum, bias epilogue
    r"elementwise|element_wise|reduce_kernel",                 # aten elementwise and reduction kernels
    re.I)
# Matched against the whole name.
_ARITHMETIC = re.compile(
    r"gemm|gemv|matmul|conv|Cijk_|(?<![a-z])dot_kernel|"       # any GEMM/GEMV/dot/convolution; Tensile/hipBLASLt
    r"_(add|b|baddb)?mm(_|$)|fused_moe_kernel|"                # Inductor's mm templates; vLLM's fused MoE GEMM
    r"dgrad|wgrad|fprop|scudnn|xmma|nvjet|wgmma|"              # cuDNN and cuBLAS (sm80_xmma_*, nvjet_*)
    r"winograd|fft|MIOpenCv",                                  # Winograd/FFT convolutions; MIOpen's direct ones
    re.I)

_MANGLED_PART = re.compile(r"(\d+)")


def _demangled_path(name: str) -> str | None:
    """The nested name of an Itanium-mangled symbol (``_ZN2ck16tensor_operation6device...I...``:
    ``ck::tensor_operation::device::...``), without its template arguments; None if it is not one."""
    if not name.startswith("_Z"):
        return None
    i = 3 if name.startswith("_ZN") else 2
    parts = []
    while i < len(name):
        m = _MANGLED_PART.match(name, i)
        if not m:
            break
        n = int(m.group(1))
        start = m.end()
        parts.append(name[start:start + n])
        i = start + n
    return "::".join(parts) if parts else None


def function_name(name: str) -> str:
    """A kernel's function name: its qualified name without template arguments, parameters or return type
    (``void cudnn::ops::scalePackedTensor_kernel<float, float>(cudnnTensor4dStruct, ...)`` ->
    ``cudnn::ops::scalePackedTensor_kernel``)."""
    mangled = _demangled_path(name)
    if mangled is not None:
        return mangled
    out = []
    depth = 0
    for ch in name:
        if ch in "<([":
            if ch == "(" and depth == 0:
                break
            depth += 1
        elif ch in ">)]":
            depth = max(depth - 1, 0)
        elif depth == 0:
            out.append(ch)
    words = "".join(out).split()
    return words[-1] if words else name


@functools.lru_cache(maxsize=1 << 14)
def kernel_role(name: str) -> int:
    """The role of one kernel name (see the module's doc)."""
    if _MOVES.search(function_name(name)):
        return ROLE_MOVES
    if _ARITHMETIC.search(name):
        return ROLE_ARITHMETIC
    return ROLE_OTHER


def kernel_roles(names: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Per kernel, its role (int8), classified once per distinct name. Null names are ``ROLE_OTHER``."""
    if len(names) == 0:
        return np.zeros(0, np.int8)
    enc = dictionary_of(names)
    role = np.array([kernel_role(n) for n in enc.dictionary.to_pylist()] + [ROLE_OTHER], np.int8)
    return role[enc.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)]
