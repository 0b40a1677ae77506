"""Cost models of single torch ops: useful FLOPs and ideal device-memory bytes from recorded shapes.

One job: turn an op record (name, Kineto ``Input Dims``, ``Input type`` and, where recorded,
``Concrete Inputs``) into ``(flops, bytes, dtype, model)`` for that op *alone*, plus the rule that
decides which of two nested modelled ops counts (:func:`yields_flops`). Formulas live in one small
module per op family (gemm, conv, attention, norm, elementwise, embedding, reduction, rnn, vendor, moe) and
register themselves with :func:`register_flop_formula`; a user registers a formula for their own
op the same way, without editing plasmient. docs/flops.md lists what is and is not modelled.

Definitions used throughout
---------------------------
* **flops** are useful math of the op as written, counted the way the PyTorch profiler
  (``with_flops``) and ``torch.utils.flop_counter`` count it: a multiply-add is 2 FLOPs, nothing
  is added for data movement, padding, recomputation or the kernel's choice of algorithm.
* **bytes** are what an ideal implementation moves to and from device memory: every tensor input
  read once plus every output written once (in-place ops write ``self``).
* **dtype** is the canonical dtype (fp32 | tf32 | bf16 | fp16 | fp8 | int8 | fp64 | other) of the
  first tensor input. ``tf32`` is never produced from op shapes: Kineto records ``float`` whether or
  not TF32 was allowed; :func:`plasmient_trace.metrics.hardware.kernel_precision` decides per kernel.
* **model** names the formula family: gemm | conv | attention | norm | softmax | elementwise |
  embedding | reduction | none. Unknown ops, and known ops whose shapes are missing, malformed or
  insufficient, get 0 flops, 0 bytes and ``none``: "none" means *unknown*, never "zero work".

Autograd nodes (``XBackward0``, ``autograd::engine::evaluate_function: ...``) carry only the
grad_output shape, so they are ``none``; the aten ops inside them carry full shapes.
"""

from __future__ import annotations

# Family modules register their formulas on import; the order only matters for names registered twice.
from . import attention, conv, elementwise, embedding, gemm, norm, reduction, rnn, vendor  # noqa: F401
from .api import CodedOpCosts, OpCosts, coded_model_ops, model_ops, op_cost
from .core import (CANONICAL_DTYPES, MODELS, FlopFormula, FlopResult, OpArgs, canonical_dtype, element_size,
                   formula_for, register_flop_formula, registered_ops)
from .labels import Labels
from .moe import ModelConfigError, MoEConfig, load_model_config
from .ownership import ARITHMETIC_MODELS, GEMM_LIKE, flop_owners, split_op_work, yields_flops

__all__ = ["MODELS", "CANONICAL_DTYPES", "GEMM_LIKE", "Labels", "OpCosts", "OpArgs", "FlopFormula", "FlopResult", "op_cost",
           "model_ops", "coded_model_ops", "CodedOpCosts", "canonical_dtype", "element_size", "register_flop_formula", "registered_ops",
           "formula_for", "flop_owners", "split_op_work", "yields_flops", "ARITHMETIC_MODELS", "MoEConfig", "ModelConfigError", "load_model_config"]
