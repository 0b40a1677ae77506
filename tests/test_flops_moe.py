"""MoE expert GEMMs (metrics/flops/moe.py): unknown from the trace alone, known from the model's config.

Oracles: torch's FlopCounterMode on an explicit routed-experts computation, and AMD TraceLens's golden
per-op sheet for the vLLM gpt-oss decode pair in ../shared/traces/cc94_vllm_decode (TraceLens assumes
inter_dim == hidden_dim == 3072; a config saying so must give exactly its numbers)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from conftest import TRACES, trace_path
from plasmient_trace.metrics import flops as F
from plasmient_trace.metrics.flops.moe import moe_config_from_dict, moe_forward_cost
from plasmient_trace.pipeline import IngestOptions, ingest_paths

REPLAY = "cc94_vllm_decode/graph_execution.json.gz"
GOLDEN = TRACES / "cc94_vllm_decode" / "tracelens_golden"
# gpt-oss-20b's published config (the model in the shared vLLM trace): 24 layers of 32 experts, top 4.
GPT_OSS_20B = {"model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880, "num_local_experts": 32,
               "num_experts_per_tok": 4, "experts_per_token": 4, "torch_dtype": "bfloat16",
               "quantization_config": {"quant_method": "mxfp4"}}


def _rows(name: str) -> list[dict]:
    with open(GOLDEN / name, newline="") as f:
        return list(csv.DictReader(f))


def _args(tokens: int, width: int, experts: int) -> F.OpArgs:
    return F.OpArgs([[tokens, width], [tokens, experts], []], ["c10::BFloat16", "c10::BFloat16", ""], None)


@pytest.mark.parametrize("gated", [True, False])
def test_moe_flops_equal_flopcountermode_on_an_explicit_routed_computation(gated: bool) -> None:
    torch = pytest.importorskip("torch")
    from torch.utils.flop_counter import FlopCounterMode

    T, H, inter, E, k = 7, 48, 40, 8, 2
    cfg = moe_config_from_dict({"model_type": "mixtral", "hidden_size": H, "intermediate_size": inter,
                                "num_local_experts": E, "num_experts_per_tok": k, "moe_gated": gated})
    torch.manual_seed(0)
    x, logits = torch.randn(T, H), torch.randn(T, E)
    up = torch.randn(E, H, (2 if gated else 1) * inter)
    down = torch.randn(E, inter, H)
    with FlopCounterMode(display=False) as counter:
        top = logits.topk(k, dim=1).indices
        for e in range(E):
            tokens = (top == e).any(dim=1).nonzero().flatten()
            h = x[tokens] @ up[e]
            if gated:
                h = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
            else:
                h = torch.nn.functional.silu(h)
            _ = h @ down[e]
    flops, _, model = moe_forward_cost(_args(T, H, E), cfg)
    assert model == "gemm" and flops == counter.get_total_flops()


def test_config_for_the_traced_model_costs_each_moe_op_as_its_experts_do() -> None:
    cfg = moe_config_from_dict(GPT_OSS_20B)
    # vllm::moe_forward as the trace records it: 32 tokens padded to 3072 wide, 32 router logits.
    flops, nbytes, _ = moe_forward_cost(_args(32, 3072, 32), cfg)
    assert flops == 32 * 4 * (2 * 2880 * 2 * 2880 + 2 * 2880 * 2880)
    # Activations in and out plus the 32 experts' mxfp4 weights (4 bits + one 8-bit scale per 32).
    assert nbytes == 32 * 3072 * 2 * 2 + 32 * 32 * 2 + 32 * 3 * 2880 * 2880 * (0.5 + 1 / 32)
    # A config of another model (16 experts, or wider than the trace) leaves the op unknown.
    assert moe_forward_cost(_args(32, 3072, 16), cfg) is None
    assert moe_forward_cost(_args(32, 2048, 32), cfg) is None


def test_the_replay_matches_tracelens_when_the_config_states_its_assumption(tmp_path) -> None:
    """TraceLens costs each vllm::moe_forward as an unfused up (gated) and down GEMM with inter_dim ==
    hidden_dim == 3072; given a config that says so, plasmient's step FLOPs are TraceLens's whole total
    (plus RoPE, which TraceLens does not model)."""
    moe_rows = _rows("MoE_unfused_fwd.csv")
    per_op = sum(float(r["GFLOPS_first"]) * 1e9 for r in moe_rows)
    assert {int(r["name_count"]) for r in moe_rows} == {24}
    cfg = moe_config_from_dict({**GPT_OSS_20B, "hidden_size": 3072, "intermediate_size": 3072})
    assert moe_forward_cost(_args(32, 3072, 32), cfg)[0] == pytest.approx(per_op, rel=1e-12)

    golden = sum(float(r["GFLOPS"]) * 1e9 * int(r["operation_count"])
                 for r in _rows("unified_perf_summary.csv") if r["GFLOPS"])
    rope = 24 * 32 * (64 + 8) * 64 * 3
    result = ingest_paths([trace_path(REPLAY)], IngestOptions(job_id="moe", moe=cfg))
    step = next(r for r in result.batch.table.to_pylist() if r["plasmient.level"] == "step")
    assert step["plasmient.flops"] == pytest.approx(golden + rope, rel=1e-6)


def test_the_real_config_lifts_coverage_and_counts_the_unpadded_width(tmp_path) -> None:
    def step_of(options: IngestOptions) -> dict:
        rows = ingest_paths([trace_path(REPLAY)], options).batch.table.to_pylist()
        return next(r for r in rows if r["plasmient.level"] == "step")

    without = step_of(IngestOptions(job_id="moe"))
    with_cfg = step_of(IngestOptions(job_id="moe", moe=moe_config_from_dict(GPT_OSS_20B)))
    per_op = 32 * 4 * 6 * 2880 * 2880
    assert with_cfg["plasmient.flops"] == pytest.approx(without["plasmient.flops"] + 24 * per_op, rel=1e-9)
    # The MoE kernels were the unknown time; with them known, coverage is the rest's.
    assert without["plasmient.flops.coverage"] < 0.3
    assert with_cfg["plasmient.flops.coverage"] > 0.9
    assert with_cfg["plasmient.mfu"] > without["plasmient.mfu"]


def _ingest(*extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "plasmient_trace.cli", "ingest", str(trace_path(REPLAY)),
                           "--quiet", *extra], check=False, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("content, says", [
    ("{not json", "is not JSON"),
    (json.dumps([1, 2]), "is not a JSON object"),
    (json.dumps({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008}),
     "not a mixture-of-experts config (no positive num_local_experts/num_experts, num_experts_per_tok)"),
    (json.dumps({**GPT_OSS_20B, "model_type": "my_moe"}), "add \"moe_gated\""),
    # json.loads' RecursionError was a traceback
    ("[" * 100_000 + "]" * 100_000, "the model config is not JSON (nested too deep)"),
    # read whole, however large (--model-config /dev/zero never ended)
    (" " * (17 << 20) + json.dumps(GPT_OSS_20B), "over 16 MiB, not a model config"),
])
def test_a_config_that_cannot_be_used_is_one_line_and_exit_2(tmp_path, content: str, says: str) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(content)
    out = tmp_path / "out.jsonl"
    run = _ingest("--model-config", str(cfg), "--out", str(out))
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and str(cfg) in lines[0] and says in lines[0]
    assert not out.exists()


def test_missing_config_file_is_one_line(tmp_path) -> None:
    run = _ingest("--model-config", str(tmp_path / "nope.json"), "--out", str(tmp_path / "o.jsonl"))
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1 and "nope.json" in run.stderr
