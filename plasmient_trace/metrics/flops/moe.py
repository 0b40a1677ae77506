"""Mixture-of-experts expert GEMMs, costed from the model's own config.

A trace records what ``vllm::moe_forward(hidden_states [T, H] 0, router_logits [T, E] 1, layer_name 2)``
was called with: the tokens, the (possibly padded) hidden size and the number of experts. It does not
record the experts' intermediate size, nor whether each expert is gated (SwiGLU: gate and up
projections) or not, so these ops stay unknown unless the user gives the model's Hugging Face
``config.json`` (``plasmient ingest --model-config``). With it, each routed token runs ``top_k``
experts of

    gated:     2·H·(2·I)  (gate + up)  +  2·I·H  (down)  =  6·H·I FLOPs
    not gated: 2·H·I      (up)         +  2·I·H  (down)  =  4·H·I FLOPs

with H the config's ``hidden_size`` (the useful width: vLLM pads H for its fp4 kernels, and padding
is not model work) and I its expert intermediate size. Bytes: the activations in and out, plus the
weights of ``min(E, T·top_k)`` experts (every expert a token can reach; exact once the batch routes a
token to each, the usual case at decode batch sizes) at the weights' stored width, when the config
says what that is; otherwise the weights are left out of the bytes and the docs say so.

The config must match the trace: the router's E must equal the config's expert count and the recorded
H must be at least the config's hidden size; otherwise the op stays unknown (the config is for a
different model). Which architectures gate their experts is a fact about each architecture, listed in
:data:`GATED_MOE_MODEL_TYPES`; a config may state it with ``"moe_gated": true|false``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .core import FlopResult, OpArgs

# Ops whose arguments are (hidden_states [T, H], router_logits [T, E], ...) and whose kernels run the
# routed experts only (shared experts, where a model has them, are separate linear ops).
MOE_OPS = ("vllm::moe_forward",)

# model_type of Hugging Face configs whose routed experts are gated MLPs (gate and up projections
# followed by a down projection): Mixtral (w1/w3/w2), Qwen2-MoE and Qwen3-MoE, DeepSeek-V2/V3, OLMoE
# (gate/up/down_proj), PhiMoE (w1/w3/w2), GraniteMoE (input_linear of width 2·I), gpt-oss
# (gate_up_proj, SwiGLU).
GATED_MOE_MODEL_TYPES = frozenset({"mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "olmoe",
                                   "phimoe", "granitemoe", "gpt_oss"})

# Bytes per stored weight element by quantization method (mxfp4: 4-bit values plus one 8-bit scale per
# block of 32) and by unquantized torch dtype.
_QUANT_WEIGHT_BYTES = {"mxfp4": 0.5 + 1 / 32, "fp8": 1.0}
_DTYPE_WEIGHT_BYTES = {"bfloat16": 2.0, "float16": 2.0, "float32": 4.0}


class ModelConfigError(ValueError):
    """A --model-config file that cannot be used; the message is one line naming the file."""


@dataclass(frozen=True)
class MoEConfig:
    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    gated: bool
    weight_bytes: float | None   # bytes per stored expert weight element; None = not stated
    source: str                  # the file it came from, for notes


def _first_int(cfg: dict[str, Any], *keys: str) -> int | None:
    for key in keys:
        v = cfg.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _weight_bytes(cfg: dict[str, Any]) -> float | None:
    quant = cfg.get("quantization_config")
    if isinstance(quant, dict):
        return _QUANT_WEIGHT_BYTES.get(str(quant.get("quant_method", "")).lower())
    return _DTYPE_WEIGHT_BYTES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or ""))


def moe_config_from_dict(cfg: dict[str, Any], source: str = "config") -> MoEConfig:
    """The expert shape of a Hugging Face config dict (``text_config`` of a multimodal one)."""
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg["text_config"], **{k: v for k, v in cfg.items() if k == "moe_gated"}}
    hidden = _first_int(cfg, "hidden_size")
    inter = _first_int(cfg, "moe_intermediate_size", "intermediate_size")
    experts = _first_int(cfg, "num_local_experts", "num_experts", "n_routed_experts")
    top_k = _first_int(cfg, "num_experts_per_tok", "experts_per_token")
    missing = [name for name, v in (("hidden_size", hidden), ("intermediate_size", inter),
                                    ("num_local_experts/num_experts", experts), ("num_experts_per_tok", top_k)) if v is None]
    if missing:
        raise ModelConfigError(f"{source}: not a mixture-of-experts config (no positive {', '.join(missing)})")
    gated = cfg.get("moe_gated")
    if not isinstance(gated, bool):
        model_type = str(cfg.get("model_type", ""))
        if model_type not in GATED_MOE_MODEL_TYPES:
            raise ModelConfigError(
                f"{source}: model_type {model_type!r} is not one whose expert MLPs plasmient knows to be gated or "
                f"not; add \"moe_gated\": true (gate+up+down projections) or false (up+down) to the file")
        gated = True
    return MoEConfig(hidden, inter, experts, top_k, gated, _weight_bytes(cfg), source)


_MAX_CONFIG_BYTES = 16 << 20


def load_model_config(path: str | Path) -> MoEConfig:
    """Read a Hugging Face ``config.json``; one-line :class:`ModelConfigError` when it cannot be used."""
    path = Path(path)
    try:
        with path.open("rb") as f:  # read up to a cap: /dev/zero or a pipe has no end to read to
            data = f.read(_MAX_CONFIG_BYTES + 1)
        if len(data) > _MAX_CONFIG_BYTES:
            raise ModelConfigError(f"{path}: over {_MAX_CONFIG_BYTES >> 20} MiB, not a model config (a config.json "
                                   "is a few KB)")
        cfg = json.loads(data.decode("utf-8"))
    except OSError as e:
        raise ModelConfigError(f"{path}: cannot read the model config ({e.strerror or e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelConfigError(f"{path}: the model config is not JSON ({e})") from None
    except RecursionError:
        raise ModelConfigError(f"{path}: the model config is not JSON (nested too deep)") from None
    if not isinstance(cfg, dict):
        raise ModelConfigError(f"{path}: the model config is not a JSON object")
    return moe_config_from_dict(cfg, str(path))


def moe_forward_cost(a: OpArgs, cfg: MoEConfig) -> FlopResult:
    """vllm::moe_forward(hidden_states [T, H] 0, router_logits [T, E] 1, layer_name 2) under ``cfg``."""
    X, R = a.shape(0), a.shape(1)
    if X is None or R is None or len(X) != 2 or len(R) != 2 or X[0] != R[0]:
        return None
    tokens, width, experts = X[0], X[1], R[1]
    if experts != cfg.num_experts or width < cfg.hidden_size:
        return None  # the config describes another model
    H, inter = cfg.hidden_size, cfg.intermediate_size
    projections = 3 if cfg.gated else 2
    flops = 2.0 * tokens * cfg.top_k * projections * H * inter
    activations = a.nbytes(0) * 2 + a.nbytes(1)  # hidden in, routed output out, router logits in
    weights = 0.0
    if cfg.weight_bytes is not None:
        weights = min(experts, tokens * cfg.top_k) * projections * H * inter * cfg.weight_bytes
    return flops, activations + weights, "gemm"
