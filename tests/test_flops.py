"""Op cost models (metrics/flops/) against real recorded op shapes from ../shared/traces.

The traces are read with gzip + json here (conftest.raw_trace), never through the project's parser,
and turned into records.OPS tables by a loader of this file. The h100 traces were recorded with
with_flops=1, but their JSON carries no 'flops' arg (neither torch 2.6 nor 2.13 exports it; the
profiler keeps it on FunctionEvent.flops only). So where the profiler counts FLOPs (mm, addmm, bmm,
conv2d), the recorded shapes and concrete inputs are replayed on meta tensors under
torch.profiler(with_flops=True) and our numbers are compared with what it computes.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pytest

from conftest import ingested, raw_trace
from plasmient_trace import records
from plasmient_trace.metrics import flops as F
from plasmient_trace.metrics.flops import api as flops_api
from plasmient_trace.metrics.flops import core as flops_core
from plasmient_trace.metrics.flops import model_ops, op_cost

OP_CATS = ("cpu_op", "Operator")
SHAPED_TRACES = [
    "h100/bert_small_inference.json.gz",
    "h100/qwen1.5_0.5b_chat_inference.json.gz",
    "h100/vit_image_classification.json.gz",
    "b200/eager_rank0_of8.json.gz",
    "a100/cuda_graphs_rank0_of16.json.gz",
    "a100_multirank/rank-0.json.gz",
    "mi250/minitoy_train.json.gz",
    "mi300x/resnet_act_checkpoint_rank0_of8.json.gz",
    "v100/resnet50_training.json.gz",
]

ES = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8}


def _json(v: Any) -> str | None:
    return orjson.dumps(v).decode() if v is not None else None


def op_events(name: str) -> list[dict]:
    evs = raw_trace(name)["traceEvents"]
    return [e for e in evs if e.get("ph") == "X" and e.get("cat") in OP_CATS]


def ops_table(name: str) -> pa.Table:
    """records.OPS rows for every op event of a trace, built straight from the JSON."""
    cols: dict[str, list[Any]] = {k: [] for k in ("pid", "tid", "start_ns", "end_ns", "name", "category",
                                                 "input_dims", "input_types", "concrete_inputs", "kineto_flops")}
    for e in op_events(name):
        a = e.get("args") or {}
        start = int(e["ts"] * 1000)
        cols["pid"].append(int(e["pid"]) if isinstance(e["pid"], int) else 0)
        cols["tid"].append(int(e["tid"]) if isinstance(e["tid"], int) else 0)
        cols["start_ns"].append(start)
        cols["end_ns"].append(start + int(e["dur"] * 1000))
        cols["name"].append(e["name"])
        cols["category"].append("cpu_op")
        cols["input_dims"].append(_json(a.get("Input Dims")))
        cols["input_types"].append(_json(a.get("Input type")))
        cols["concrete_inputs"].append(_json(a.get("Concrete Inputs")))
        cols["kineto_flops"].append(a.get("flops"))
    if "concrete_inputs" not in records.OPS.names:
        del cols["concrete_inputs"]
    return records.table_from_columns("ops", cols)


def cost(e: dict) -> tuple[float, float, str, str]:
    a = e["args"]
    return op_cost(e["name"], a.get("Input Dims"), a.get("Input type"), a.get("Concrete Inputs"))


def shaped(name: str, op: str) -> list[dict]:
    return [e for e in op_events(name) if e["name"] == op and "Input Dims" in (e.get("args") or {})]


# ----------------------------------------------------------------------------------- GEMM exact
@pytest.mark.parametrize("trace", ["h100/qwen1.5_0.5b_chat_inference.json.gz", "a100_multirank/rank-0.json.gz",
                                   "b200/eager_rank0_of8.json.gz", "mi300x/resnet_act_checkpoint_rank0_of8.json.gz",
                                   "v100/resnet50_training.json.gz", "mi250/minitoy_train.json.gz"])
def test_mm_is_exactly_2mnk_and_addmm_adds_the_bias(trace: str) -> None:
    mms, addmms = shaped(trace, "aten::mm"), shaped(trace, "aten::addmm")
    assert mms, f"{trace} has recorded aten::mm shapes"
    for e in mms:
        (m, k), (k2, n) = e["args"]["Input Dims"][:2]
        assert k == k2
        es = ES[e["args"]["Input type"][0]]
        f, b, _, model = cost(e)
        assert (f, model) == (2 * m * n * k, "gemm")
        assert b == (m * k + k * n + m * n) * es
    for e in addmms:
        bias, (m, k), (_, n) = e["args"]["Input Dims"][:3]
        f, b, _, model = cost(e)
        assert (f, model) == (2 * m * n * k + m * n, "gemm")
        es = ES[e["args"]["Input type"][1]]
        assert b == (int(np.prod(bias)) + m * k + k * n + m * n) * es


def test_linear_costs_what_its_addmm_costs_on_bert() -> None:
    # aten::linear([1,141,512], [512,512], [512]) calls aten::addmm([512], [141,512], [512,512]).
    evs = op_events("h100/bert_small_inference.json.gz")
    linears = [e for e in evs if e["name"] == "aten::linear"]
    addmms = [e for e in evs if e["name"] == "aten::addmm"]
    assert linears and len(linears) == len(addmms)
    by_start = sorted(addmms, key=lambda e: e["ts"])
    for lin in linears:
        inner = next(e for e in by_start if lin["ts"] <= e["ts"] <= lin["ts"] + lin["dur"] and e["tid"] == lin["tid"])
        assert cost(lin)[0] == cost(inner)[0] > 0


def _inner_dims_agree(name: str, dims: list) -> bool:
    """Whether a matmul's recorded operands can be multiplied: the contracted sizes are equal."""
    a, b = (dims[1], dims[2]) if name == "aten::addmm" else (dims[0], dims[1])
    if name == "aten::linear":
        return a[-1] == b[-1]
    return a[-1] == (b[0] if len(b) == 1 else b[-2])


def test_a_matmul_whose_recorded_operands_cannot_be_multiplied_has_no_flop_model() -> None:
    """Ops a TorchScript graph ran record its interpreter's stack before their own arguments (a100_multirank:
    aten::linear([2048,160,606], [2048,3906], [2048,3906], [2048,512], [3906,512], [3906]), whose own arguments
    are the last three). Read from the front, the operands cannot be multiplied ([2048,160,606] by a [2048,3906]
    weight): a FLOP count from them is a guess (814 GFLOP for an 8.2 GFLOP product), so the op has no model
    and no op.model_flops, and its FLOPs are its aten::addmm's, as on every other linear. Operands that can be
    multiplied keep their count."""
    trace = "a100_multirank/rank-0.json.gz"
    garbled = kept = 0
    for e in op_events(trace):
        a = e.get("args") or {}
        if e["name"] not in ("aten::linear", "aten::matmul", "aten::mm", "aten::addmm") or "Input Dims" not in a:
            continue
        f, _, _, model = cost(e)
        if _inner_dims_agree(e["name"], a["Input Dims"]):
            assert model == "gemm" and f > 0, (e["name"], a["Input Dims"])
            kept += 1
        else:
            assert (f, model) == (0.0, "none"), (e["name"], a["Input Dims"], f)
            garbled += 1
    assert garbled == 29 and kept > 400
    step_flops = {r["plasmient.step"]: r["plasmient.flops"] for r in ingested(trace).batch.table.to_pylist()
                  if r["plasmient.level"] == "step"}
    assert step_flops == {551: 864133955687.0, 552: 788044792239.0}  # what the children's models add up to


# --------------------------------------------------------------------- Kineto's own FLOP counts
_TORCH_DTYPES = {"float": "float32", "c10::BFloat16": "bfloat16", "c10::Half": "float16", "double": "float64"}
KINETO_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::conv2d")


def _replay_args(torch: Any, e: dict) -> list[Any] | None:
    a = e["args"]
    dims, types, conc = a["Input Dims"], a["Input type"], a.get("Concrete Inputs")
    out: list[Any] = []
    for i, (d, t) in enumerate(zip(dims, types)):
        if t in _TORCH_DTYPES:
            out.append(torch.empty(d, dtype=getattr(torch, _TORCH_DTYPES[t]), device="meta"))
        elif t == "" and e["name"] == "aten::conv2d" and i == 2:
            out.append(None)  # no bias
        elif e["name"] != "aten::conv2d":
            break  # GEMMs: beta/alpha are keyword-only and do not change the count
        elif t in ("Scalar", "ScalarList"):
            if conc is None:
                return None  # stride/padding not recorded: nothing to replay
            out.append(orjson.loads(conc[i]))
        else:
            return None
    return out


def kineto_flops_by_replay(events: list[dict]) -> list[tuple[dict, float]]:
    """Each event's FLOPs as the PyTorch profiler (with_flops) computes them, from its recorded inputs."""
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile

    calls = []
    for e in events:
        args = _replay_args(torch, e)
        if args is not None:
            calls.append((e, args))
    # inference_mode: the meta kernels skip autograd bookkeeping (10x faster), FLOPs are unchanged
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                                         with_flops=True) as prof:
        for e, args in calls:
            getattr(torch.ops.aten, e["name"].split("::")[1])(*args)
    top = [ev for ev in prof.events() if ev.cpu_parent is None and ev.name in KINETO_OPS]
    assert [ev.name for ev in top] == [e["name"] for e, _ in calls]
    return [(e, float(ev.flops)) for (e, _), ev in zip(calls, top)]


# Traces whose GEMM/conv shapes are replayed. The V100 trace recorded no Concrete Inputs (its
# convs cannot be replayed) and its GEMMs, like the CUDA-graph A100 trace's five, are checked
# exactly by the 2*M*N*K test; leaving the two largest files out keeps this test fast.
KINETO_TRACES = [t for t in SHAPED_TRACES if not t.startswith(("v100/", "a100/"))]


def test_gemm_and_conv_flops_match_kineto_within_1_percent() -> None:
    events: list[dict] = []
    for trace in KINETO_TRACES:
        seen = set()
        for e in op_events(trace):
            a = e.get("args") or {}
            if e["name"] in KINETO_OPS and "Input Dims" in a:
                key = (e["name"], _json(a["Input Dims"]), _json(a["Input type"]), _json(a.get("Concrete Inputs")))
                if key not in seen:
                    seen.add(key)
                    events.append(e)
    compared = kineto_flops_by_replay(events)
    kinds = Counter(e["name"] for e, _ in compared)
    # Every GEMM kind and conv2d with recorded strides (h100 ViT, MI300X ResNet) took part.
    assert kinds["aten::mm"] > 100 and kinds["aten::addmm"] > 50 and kinds["aten::bmm"] > 10
    assert kinds["aten::conv2d"] >= 12
    over_1pct = 0
    for e, kineto in compared:
        ours = cost(e)[0]
        assert kineto > 0
        if e["name"] in ("aten::addmm", "aten::baddbmm"):
            # The profiler counts only the product; we add the bias add (one FLOP per output
            # element), which is more than 1% only when K < 50 (real case: K = 32 in a100_multirank).
            *batch, m, _ = e["args"]["Input Dims"][1]
            n = e["args"]["Input Dims"][2][-1]
            bias_add = int(np.prod(batch)) * m * n
            assert ours - bias_add == kineto, (e["name"], e["args"]["Input Dims"], ours, kineto)
            over_1pct += abs(ours - kineto) > 0.01 * kineto
        else:
            assert abs(ours - kineto) <= 0.01 * kineto, (e["name"], e["args"]["Input Dims"], ours, kineto)
    assert over_1pct <= 4


def test_conv_reads_stride_from_each_spellings_own_argument_order() -> None:
    # aten::conv2d(input, weight, bias, stride, padding, ...) wraps convolution -> _convolution ->
    # cudnn_convolution(self, weight, padding, stride, ...) on NVIDIA and miopen_convolution(self,
    # weight, bias, padding, stride, ...) on AMD: every layer of a real call chain costs the same.
    for trace, inner_name in (("h100/vit_image_classification.json.gz", "aten::cudnn_convolution"),
                              ("mi300x/resnet_act_checkpoint_rank0_of8.json.gz", "aten::miopen_convolution")):
        evs = op_events(trace)
        chain = ("aten::convolution", "aten::_convolution", inner_name)
        outer = [e for e in evs if e["name"] == "aten::conv2d"]
        assert outer
        strided = 0
        for c in outer:
            f = cost(c)[0]
            assert f > 0
            inside = [e for e in evs if e["name"] in chain and e["tid"] == c["tid"]
                      and c["ts"] <= e["ts"] and e["ts"] + e["dur"] <= c["ts"] + c["dur"]]
            assert sorted(e["name"] for e in inside) == sorted(chain)
            assert all(cost(e)[0] == f for e in inside)
            strided += orjson.loads(c["args"]["Concrete Inputs"][3]) != [1, 1]
        assert strided > 0  # the chains include stride > 1 convs, where the order matters


def test_vit_patch_embedding_conv_uses_recorded_stride_16() -> None:
    (e,) = {_json(x["args"]["Input Dims"]): x for x in shaped("h100/vit_image_classification.json.gz", "aten::conv2d")}.values()
    (n, cin, h, w), (cout, _, kh, kw) = e["args"]["Input Dims"][:2]
    out_hw = (h // 16) * (w // 16)
    f, b, dtype, model = cost(e)
    assert (f, dtype, model) == (2 * n * cout * out_hw * cin * kh * kw, "bf16", "conv")
    assert b == (n * cin * h * w + cout * cin * kh * kw + cout + n * cout * out_hw) * 2


def test_conv_without_recorded_stride_is_unknown_on_its_own() -> None:
    # The V100 trace (old Kineto) has no Concrete Inputs: the op alone cannot say its stride.
    e = shaped("v100/resnet50_training.json.gz", "aten::cudnn_convolution")[0]
    assert "Concrete Inputs" not in e["args"]
    assert cost(e) == (0.0, 0.0, "fp32", "none")


def test_conv_without_stride_takes_its_output_size_from_the_consumer_on_resnet50() -> None:
    fc = pytest.importorskip("torch.utils.flop_counter")
    torch = pytest.importorskip("torch")
    name = "v100/resnet50_training.json.gz"
    table = ops_table(name)
    costs = model_ops(table)
    names = np.array(table.column("name").to_pylist())
    dims = table.column("input_dims").to_pylist()
    # Independent record of each conv's output size: its backward op's grad_output (legacy
    # cudnn_convolution_backward(self, grad_output, weight, ...)), read from the raw JSON.
    out_of: dict[tuple, set] = {}
    for e in shaped(name, "aten::cudnn_convolution_backward"):
        x, g, w = e["args"]["Input Dims"][:3]
        out_of.setdefault((tuple(x), tuple(w)), set()).add(tuple(g))
    fwd = np.nonzero(names == "aten::cudnn_convolution")[0]
    assert len(fwd) == 6 * 53 and (costs.model[fwd] == "conv").all()
    for i in fwd:
        x, w = orjson.loads(dims[i])[:2]
        (out,) = out_of[(tuple(x), tuple(w))]
        assert costs.flops[i] == fc.conv_flop_count(x, w, list(out), transposed=False)
    # The 7x7/2 stem, against FlopCounterMode on the nn.Conv2d ResNet-50 defines (stride 2, padding 3).
    stem = fwd[0]
    with fc.FlopCounterMode(display=False) as counter:
        torch.nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False, device="meta")(
            torch.empty(32, 3, 224, 224, device="meta"))
    assert costs.flops[stem] == counter.get_total_flops() == 7_552_892_928
    # Conservation through the wrapper chain: conv2d, convolution, _convolution carry the same cost.
    for wrapper in ("aten::conv2d", "aten::convolution", "aten::_convolution"):
        assert costs.flops[names == wrapper].sum() == costs.flops[fwd].sum()


def test_conv_without_stride_or_consumer_stays_unknown() -> None:
    table = ops_table("v100/resnet50_training.json.gz")
    names = np.array(table.column("name").to_pylist())
    # The stem conv's wrapper chain and nothing after it: no op reads its output.
    stem_chain = np.nonzero(np.isin(names, ["aten::conv2d", "aten::convolution", "aten::cudnn_convolution"]))[0][:3]
    costs = model_ops(table.take(pa.array(stem_chain)))
    assert (costs.model == "none").all() and costs.flops.sum() == 0
    # Followed by an op reading a [N, C_out, ...] tensor of an impossible size (larger than the
    # input plus the kernel allows): still unknown, never a guess.
    bn = np.nonzero(names == "aten::batch_norm")[0][:1]
    bad = table.take(pa.array(np.concatenate([stem_chain, bn])))
    dims = bad.column("input_dims").to_pylist()
    dims[-1] = orjson.dumps([[32, 64, 512, 512]] + orjson.loads(dims[-1])[1:]).decode()
    bad = bad.set_column(bad.schema.get_field_index("input_dims"), "input_dims", pa.array(dims, pa.string()))
    costs = model_ops(bad)
    assert (costs.model[:3] == "none").all()


def test_legacy_conv_gradients_each_cost_their_own_gradient_from_the_backward_op_they_run_under() -> None:
    # Before torch 1.11, cudnn_convolution_backward(self, grad_output, weight, ...) ran each gradient as a child
    # op whose arguments lack a size (grad_input's, the kernel's). Left to the parent, their FLOPs were split by
    # kernel time (every kernel of a backward at one MFU), and a backward with no input gradient (the stem)
    # counted two gradients. Each now costs its own, against FlopCounterMode's conv_backward_flop with that
    # gradient alone in the output mask; the parent is found here by time on its thread, from the raw JSON.
    fc = pytest.importorskip("torch.utils.flop_counter")
    name = "v100/resnet50_training.json.gz"
    events = op_events(name)
    table = ops_table(name)
    costs = model_ops(table)
    parents = [e for e in events if e["name"] == "aten::cudnn_convolution_backward"]
    mask_of = {"aten::cudnn_convolution_backward_input": [True, False, False],
               "aten::cudnn_convolution_backward_weight": [False, True, False]}
    checked = Counter()
    for row, e in enumerate(events):
        if e["name"] not in mask_of:
            continue
        (p,) = [q for q in parents if q["tid"] == e["tid"] and q["ts"] <= e["ts"] and e["ts"] + e["dur"] <= q["ts"] + q["dur"]]
        x, go, w = p["args"]["Input Dims"][:3]
        want = fc.conv_backward_flop(go, x, w, None, None, None, None, False, None, None, mask_of[e["name"]],
                                     out_val=[x, w, None])
        assert (costs.flops[row], costs.model[row]) == (want, "conv"), e["name"]
        es = ES[p["args"]["Input type"][0]]
        assert costs.bytes[row] == (np.prod(x) + np.prod(go) + np.prod(w)) * es  # reads two of them, writes the third
        checked[e["name"]] += 1
    # every gradient op of the trace: 318 backward convs, 6 of them (the stem, once a step) with no input gradient
    assert checked == {"aten::cudnn_convolution_backward_weight": 318, "aten::cudnn_convolution_backward_input": 312}
    # Stitched, each gradient's kernels carry its own work, and the backward op the sum of its two (the stem's one).
    spans = ingested(name).batch.table.to_pylist()
    children: dict[bytes, list[dict]] = {}
    for r in spans:
        children.setdefault(r["parent_span_id"], []).append(r)
    backward = [r for r in spans if r["name"] == "aten::cudnn_convolution_backward"]
    assert len(backward) == 318
    for r in backward:
        grads = [c for c in children[r["span_id"]] if c["name"] in mask_of]
        assert all(c["plasmient.flops"] == pytest.approx(c["plasmient.op.model_flops"], rel=1e-12) for c in grads)
        assert r["plasmient.flops"] == pytest.approx(sum(c["plasmient.flops"] for c in grads), rel=1e-12)


def test_conv_backward_matches_torch_flop_counter_and_output_mask() -> None:
    fc = pytest.importorskip("torch.utils.flop_counter")
    evs = shaped("mi300x/resnet_act_checkpoint_rank0_of8.json.gz", "aten::convolution_backward")
    assert evs
    masks = Counter()
    for e in evs:
        dims, conc = e["args"]["Input Dims"], e["args"]["Concrete Inputs"]
        mask = orjson.loads(conc[10].lower())
        masks[tuple(mask)] += 1
        go, x, w = dims[0], dims[1], dims[2]
        expected = fc.conv_backward_flop(go, x, w, None, None, None, None, False, None, None, mask, out_val=[x, w, None])
        assert cost(e)[0] == expected and cost(e)[3] == "conv"
        fwd = 2 * np.prod(go) * np.prod(w[1:])
        assert cost(e)[0] == fwd * (mask[0] + mask[1])
    assert masks[(True, True, False)] > 0 and masks[(False, True, False)] > 0  # first layer: no grad_input


def test_legacy_cudnn_conv_backward_is_twice_forward_and_owns_its_children() -> None:
    evs = op_events("v100/resnet50_training.json.gz")
    bwd = [e for e in evs if e["name"] == "aten::cudnn_convolution_backward"]
    assert bwd
    for e in bwd:
        x, go, w = e["args"]["Input Dims"][:3]
        assert cost(e)[0] == 2 * 2 * np.prod(go) * np.prod(w[1:])
    for child in ("aten::cudnn_convolution_backward_input", "aten::cudnn_convolution_backward_weight"):
        e = next(x for x in evs if x["name"] == child)
        assert cost(e) == (0.0, 0.0, "fp32", "none")


# ------------------------------------------------------------------------------------ attention
def test_sdpa_matches_torch_flop_counter_and_halves_only_when_causal() -> None:
    fc = pytest.importorskip("torch.utils.flop_counter")
    seen_causal = seen_full = 0
    for trace in ("h100/bert_small_inference.json.gz", "h100/qwen1.5_0.5b_chat_inference.json.gz",
                  "h100/vit_image_classification.json.gz"):
        for e in op_events(trace):
            if e["name"] not in ("aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention",
                                 "aten::_flash_attention_forward"):
                continue
            dims, conc = e["args"]["Input Dims"], e["args"]["Concrete Inputs"]
            q, k, v = dims[:3]
            if e["name"] == "aten::_flash_attention_forward":  # [B, L, H, D] layout
                q, k, v = ([s[0], s[2], s[1], s[3]] for s in (q, k, v))
                causal = conc[8] == "True"
            else:
                causal = conc[5 if e["name"] == "aten::scaled_dot_product_attention" else 4] == "True"
            full = fc.sdpa_flop_count(q, k, v)
            f, _, dtype, model = cost(e)
            assert (model, dtype) == ("attention", "bf16")
            assert f == (full / 2 if causal else full)
            seen_causal += causal
            seen_full += not causal
    assert seen_causal > 0 and seen_full > 0  # Qwen decodes causally, BERT and ViT do not


def test_attention_backward_is_2_5x_forward() -> None:
    q = [2, 8, 128, 64]
    types = ["c10::BFloat16"] * 6
    fwd = op_cost("aten::_scaled_dot_product_flash_attention", [q, q, q, [], [], [], []],
                  types[:3] + ["Scalar"] * 4, ["", "", "", "0.", "False", "False", ""])[0]
    bwd = op_cost("aten::_scaled_dot_product_flash_attention_backward", [q] * 6 + [[]] * 9, types + [""] * 9,
                  [""] * 11 + ["False"] + [""] * 3)[0]
    assert fwd == 4 * 2 * 8 * 128 * 128 * 64
    assert bwd == 2.5 * fwd


# A causal mask as PyTorch itself defines it: sdpa's is_causal is the upper-left triangle, flash-attn's the
# lower-right one (torch.nn.attention.bias). (op, q index, causal index, layout, value, alignment)
_CAUSAL_OPS = [
    ("aten::scaled_dot_product_attention", 0, 5, "bhld", "True", "upper_left"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", 0, 4, "bhld", "True", "upper_left"),
    ("aten::_scaled_dot_product_efficient_attention", 0, 6, "bhld", "True", "upper_left"),
    ("aten::_efficient_attention_forward", 0, 9, "blhd", "1", "upper_left"),   # xformers CausalFromTopLeft
    ("aten::_efficient_attention_forward", 0, 9, "blhd", "2", "lower_right"),  # CausalFromBottomRight
    ("aten::_flash_attention_forward", 0, 8, "blhd", "True", "lower_right"),
    ("flash_attn::_flash_attn_forward", 0, 5, "blhd", "True", "lower_right"),
    ("aten::_flash_attention_backward", 1, 11, "blhd", "True", "lower_right"),
]


@pytest.mark.parametrize(("lq", "lk"), [(8, 32), (1, 512), (32, 8), (64, 64)], ids=["chunk", "decode", "longer q", "square"])
@pytest.mark.parametrize(("op", "qi", "ci", "layout", "value", "align"), _CAUSAL_OPS,
                         ids=[f"{o[0]}-{o[5]}" for o in _CAUSAL_OPS])
def test_causal_attention_counts_the_score_entries_its_mask_keeps(op, qi, ci, layout, value, align, lq, lk) -> None:
    pytest.importorskip("torch")
    import warnings

    from torch.nn.attention import bias

    B, H, D = 2, 4, 64
    shape = (lambda L: [B, H, L, D]) if layout == "bhld" else (lambda L: [B, L, H, D])
    dims = [[]] * qi + [shape(lq), shape(lk), shape(lk)]
    n = max(ci, len(dims)) + 4
    dims += [[]] * (n - len(dims))
    concrete = [""] * n
    concrete[ci] = value
    full = 2 * B * H * lq * lk * (D + D) * (2.5 if op.endswith("backward") else 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # lower-right with lq > lk: rows that see no key (PyTorch warns of NaNs)
        mask = getattr(bias, f"causal_{align}")(lq, lk)._materialize()
    kept = int(mask.sum()) / (lq * lk)
    expected = full * (0.5 if lq == lk else kept)  # square: half, the usual convention
    got = op_cost(op, dims, ["c10::BFloat16"] * n, concrete)[0]
    assert got == pytest.approx(expected, rel=1e-12)


# ------------------------------------------------------------------ memory-bound and other models
def test_broadcast_add_counts_output_elements_and_bytes() -> None:
    # Qwen's rotary embedding: q [16, 16, 559, 64] * cos [1, 1, 559, 64] in bf16.
    e = next(x for x in shaped("h100/qwen1.5_0.5b_chat_inference.json.gz", "aten::mul")
             if x["args"]["Input Dims"][:2] == [[16, 16, 559, 64], [1, 1, 559, 64]])
    a, b = e["args"]["Input Dims"][:2]
    n = int(np.prod(a))
    f, nbytes, dtype, model = cost(e)
    assert (f, model, dtype) == (n, "elementwise", "bf16")
    assert nbytes == (n + int(np.prod(b)) + n) * 2


def test_inplace_elementwise_writes_self() -> None:
    e = shaped("mi300x/resnet_act_checkpoint_rank0_of8.json.gz", "aten::relu_")[0]
    n = int(np.prod(e["args"]["Input Dims"][0]))
    assert cost(e) == (n, 2.0 * n * 2, "bf16", "elementwise")


def test_embedding_has_no_flops_and_moves_the_gathered_rows() -> None:
    e = shaped("h100/bert_small_inference.json.gz", "aten::embedding")[0]
    (vocab, d), idx = e["args"]["Input Dims"][:2]
    rows = int(np.prod(idx))
    assert cost(e) == (0.0, float(2 * rows * d * 2 + rows * 8), "bf16", "embedding")


def test_norm_and_softmax_per_element_counts() -> None:
    ln = shaped("h100/bert_small_inference.json.gz", "aten::native_layer_norm")[0]
    n = int(np.prod(ln["args"]["Input Dims"][0]))
    assert cost(ln)[0] == 7 * n and cost(ln)[3] == "norm"  # 5 + weight + bias
    bn = shaped("mi300x/resnet_act_checkpoint_rank0_of8.json.gz", "aten::native_batch_norm")[0]
    assert bn["args"]["Concrete Inputs"][5] == "True"
    assert cost(bn)[0] == 7 * int(np.prod(bn["args"]["Input Dims"][0]))
    bwd = shaped("mi300x/resnet_act_checkpoint_rank0_of8.json.gz", "aten::native_batch_norm_backward")[0]
    assert cost(bwd)[0] == 14 * int(np.prod(bwd["args"]["Input Dims"][0]))
    sm = shaped("v100/resnet50_training.json.gz", "aten::_log_softmax")[0]
    assert cost(sm)[:2] == (5 * 32 * 1000, 2 * 32 * 1000 * 4) and cost(sm)[3] == "softmax"
    eval_bn = op_cost("aten::native_batch_norm", [[8, 4, 2, 2], [4], [4], [4], [4], [], [], []],
                      ["float"] * 5 + ["Scalar"] * 3, ["", "", "", "", "", "False", "0.1", "1e-05"])
    assert eval_bn[0] == 2 * 8 * 4 * 2 * 2


def test_reduction_reads_dims_from_concrete_inputs() -> None:
    e = next(x for x in shaped("mi300x/resnet_act_checkpoint_rank0_of8.json.gz", "aten::mean"))
    x = e["args"]["Input Dims"][0]  # [10, 512, 7, 7] averaged over [-1, -2] with keepdim
    assert e["args"]["Concrete Inputs"][1] == "[-1, -2]"
    out = x[0] * x[1]
    assert cost(e) == (float(np.prod(x)), float((np.prod(x) + out) * 2), "bf16", "reduction")


def test_dtype_is_the_first_tensor_inputs() -> None:
    assert op_cost("aten::mm", [[2, 2], [2, 2]], ["c10::Half", "c10::Half"])[2] == "fp16"
    assert op_cost("aten::sum", [[], [300, 2048], [], []], ["", "int", "", "Scalar"])[2] == "other"
    fp8 = shaped("b200/eager_rank0_of8.json.gz", "_C::static_scaled_fp8_quant")[0]
    assert cost(fp8)[2] == "fp8"
    for kineto, canonical in [("float", "fp32"), ("double", "fp64"), ("c10::BFloat16", "bf16"),
                              ("c10::Float8_e5m2", "fp8"), ("signed char", "int8"), ("long int", "other"),
                              ("bool", "other"), ("Scalar", "other")]:
        assert F.canonical_dtype(kineto) == canonical


def test_unknown_ops_and_missing_shapes_cost_nothing() -> None:
    assert op_cost("aten::empty", [[], [], [], [], [], []], ["", "Scalar"] * 3)[::3] == (0.0, "none")
    assert op_cost("aten::mm", None, None) == (0.0, 0.0, "other", "none")
    assert op_cost("aten::mm", [[4096, 64]], ["float"]) == (0.0, 0.0, "fp32", "none")
    assert op_cost("aten::mm", "not json", "[]")[3] == "none"
    assert op_cost("aten::conv2d", [[1, 2], "x"], ["float", "float"])[3] == "none"
    # autograd nodes only carry grad_output; their aten children carry the shapes
    e = shaped("a100_multirank/rank-0.json.gz", "AddmmBackward0")[0]
    assert cost(e)[3] == "none"
    vllm = shaped("b200/eager_rank0_of8.json.gz", "vllm::unified_attention_with_output")[0]
    assert cost(vllm)[:2] == (0.0, 0.0)


# ------------------------------------------------------------------------------- vectorised path
def test_model_ops_matches_op_cost_row_for_row_on_real_traces() -> None:
    for trace in SHAPED_TRACES:
        table = ops_table(trace)
        costs = model_ops(table)
        assert len(costs) == table.num_rows
        rows = table.to_pylist()
        for i in range(0, len(rows), max(1, len(rows) // 400)):
            r = rows[i]
            expect = op_cost(r["name"], r["input_dims"], r["input_types"], r.get("concrete_inputs"))
            if expect[3] == "none" and costs.model[i] != "none":
                # Only the table pass knows more than the op alone: a conv's consumer, a vLLM step.
                assert costs.model[i] in ("conv", "attention")
                continue
            assert (costs.flops[i], costs.bytes[i], costs.dtype[i], costs.model[i]) == expect
        assert np.all(costs.flops >= 0) and np.all(np.isfinite(costs.bytes))
        assert set(np.unique(costs.model)) <= set(F.MODELS)
        assert costs.flops[costs.model == "none"].sum() == 0


def test_model_ops_calls_op_cost_once_per_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    table = ops_table("h100/qwen1.5_0.5b_chat_inference.json.gz")
    repeated = pa.concat_tables([table] * 20)
    calls: list[tuple] = []
    real = F.op_cost

    def counting(*args: Any) -> tuple[float, float, str, str]:
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(flops_api, "op_cost", counting)
    monkeypatch.setattr(flops_api, "_COSTS", {})  # nothing remembered from earlier tests
    costs = model_ops(repeated)
    signatures = {(r["name"], r["input_dims"], r["input_types"], r["concrete_inputs"])
                  for r in table.select(["name", "input_dims", "input_types", "concrete_inputs"]).to_pylist()}
    assert len(calls) == len(signatures) < table.num_rows
    # a later table with the same signatures (live capture's next step) calls no formula at all
    single = model_ops(table)
    assert len(calls) == len(signatures)
    assert np.array_equal(costs.flops, np.tile(single.flops, 20))
    assert np.array_equal(costs.model, np.tile(single.model, 20))


def test_a_formula_registered_after_a_signature_was_costed_takes_effect(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flops_core, "_REGISTRY", dict(flops_core._REGISTRY))
    rows = {"pid": [1], "tid": [1], "start_ns": [0], "end_ns": [1], "name": ["plasmient_test::late_op"],
            "input_dims": ["[[4,8],[8,2]]"], "input_types": ['["float","float"]']}
    table = records.table_from_columns("ops", rows)
    assert model_ops(table).model.tolist() == ["none"]
    F.register_flop_formula("plasmient_test::late_op")(lambda a: (2.0 * 4 * 8 * 2, 0.0, "gemm"))
    assert model_ops(table).flops.tolist() == [128.0]  # not the remembered "unknown"


def test_model_ops_handles_empty_nulls_and_chunked_dictionary_columns() -> None:
    empty = model_ops(records.empty_table("ops"))
    assert len(empty) == 0 and empty.to_table().num_rows == 0
    rows = {"pid": [1, 1, 1], "tid": [1, 1, 1], "start_ns": [0, 1, 2], "end_ns": [1, 2, 3],
            "name": ["aten::mm", "aten::mm", "aten::relu"], "category": ["cpu_op"] * 3,
            "input_dims": ["[[2, 3], [3, 4]]", None, "[[5]]"], "input_types": ['["float", "float"]', None, '["float"]']}
    t = records.table_from_columns("ops", rows)
    chunked = pa.concat_tables([t.slice(0, 1), t.slice(1)])
    costs = model_ops(chunked)
    assert costs.flops.tolist() == [2 * 2 * 3 * 4, 0.0, 5.0]
    assert costs.model.tolist() == ["gemm", "none", "elementwise"]
    table = costs.to_table()
    assert table.column("flops").to_pylist() == costs.flops.tolist()


# ------------------------------------------------------- shapes the shared traces do not contain
def test_matmul_broadcasts_batch_dims_and_handles_1d_operands() -> None:
    f32 = ["float", "float"]
    assert op_cost("aten::matmul", [[7], [7]], f32)[0] == 2 * 7
    assert op_cost("aten::matmul", [[5, 7], [7]], f32)[0] == 2 * 5 * 7
    assert op_cost("aten::matmul", [[7], [3, 7, 4]], f32)[0] == 2 * 3 * 7 * 4
    assert op_cost("aten::matmul", [[2, 1, 5, 7], [3, 7, 4]], f32)[0] == 2 * (2 * 3) * 5 * 4 * 7
    # the real Qwen decode matmul [1, 32, 1] x [1, 1, 559] is a batched outer product
    assert op_cost("aten::matmul", [[1, 32, 1], [1, 1, 559]], f32)[0] == 2 * 32 * 559


def test_linear_flattens_leading_dims_and_counts_the_bias() -> None:
    bf16 = ["c10::BFloat16"] * 3
    assert op_cost("aten::linear", [[4, 197, 768], [3072, 768], [3072]], bf16)[0] == 2 * 788 * 3072 * 768 + 788 * 3072
    assert op_cost("aten::linear", [[4, 197, 768], [3072, 768], []], bf16[:2] + [""])[0] == 2 * 788 * 3072 * 768


def test_transposed_conv_needs_no_stride() -> None:
    # conv_transpose2d(x [2, 16, 8, 8], w [16, 8, 4, 4], stride 2): every input pixel meets the
    # whole [8, 4, 4] filter, whatever the stride.
    dims = [[2, 16, 8, 8], [16, 8, 4, 4], [], [], [], [], [], []]
    types = ["float", "float", "", "ScalarList", "ScalarList", "ScalarList", "Scalar", "ScalarList"]
    f = op_cost("aten::conv_transpose2d", dims, types, ["", "", "", "[2, 2]", "[1, 1]", "[0, 0]", "1", "[1, 1]"])
    assert f[0] == 2 * 2 * 16 * 8 * 8 * 8 * 4 * 4 and f[3] == "conv"
    # aten::convolution with transposed=True in its concrete inputs is the same op
    conv = op_cost("aten::convolution", dims[:2] + [[]] * 7, types[:2] + [""] * 7,
                   ["", "", "", "[2, 2]", "[1, 1]", "[1, 1]", "True", "[0, 0]", "1"])
    assert conv[0] == f[0]


def test_varlen_attention_uses_packed_tokens_and_max_seqlen() -> None:
    # _flash_attention_forward on packed q/k/v [total=100, H=4, D=64], max_k = 50, causal
    dims = [[100, 4, 64]] * 3 + [[3], [3]] + [[]] * 4
    types = ["c10::Half"] * 3 + ["int", "int"] + ["Scalar"] * 4
    conc = ["", "", "", "", "", "50", "50", "0.", "True"]
    assert op_cost("aten::_flash_attention_forward", dims, types, conc)[0] == 2 * 4 * 100 * 50 * 128 / 2


def test_a_registered_formula_s_model_name_is_never_cut_short():
    """model_ops used to store model names in an 11-character array, so a formula answering with a longer
    name (outside MODELS) came back truncated; the stitch and model_ops now give the name whole."""
    F.register_flop_formula("plasmient_test::long_model_op")(lambda a: (8.0, 0.0, "custom_tensor_core"))
    table = pa.table({"name": ["plasmient_test::long_model_op", "aten::mm"],
                      "input_dims": ["[[2, 2]]", "[[2, 4], [4, 8]]"], "input_types": ['["float"]', '["float", "float"]']})
    costs = model_ops(table)
    assert costs.model.tolist() == ["custom_tensor_core", "gemm"]
    assert costs.flops.tolist() == [8.0, 2.0 * 2 * 4 * 8]
    costs.model[1] = "elementwise"  # callers relabel in place: a built-in name still fits
    assert costs.model[1] == "elementwise"


@pytest.mark.parametrize("name", ["h100/qwen1.5_0.5b_chat_inference.json.gz", "a100_multirank/rank-0.json.gz",
                                  "h100/vit_image_classification.json.gz"])
def test_joining_tensors_is_a_known_zero_of_flops_whatever_was_recorded(name: str) -> None:
    """aten::cat on the real traces: a TensorList with shapes and no element type (qwen, vit) or with neither
    (a100_multirank records '[[], []]'). Zero FLOPs is known from the name; FlopCounterMode counts none for
    torch.cat on each recorded shape; the bytes stay unknown (0), not a guessed dtype."""
    import torch
    from torch.utils import flop_counter as fc

    table = ops_table(name)
    cats = np.nonzero(np.array(table.column("name").to_pylist()) == "aten::cat")[0]
    types = [orjson.loads(t) for t in table.column("input_types").take(pa.array(cats)).to_pylist()]
    assert len(cats) and all("TensorList" in t for t in types)
    costs = model_ops(table)
    assert (costs.model[cats] == "elementwise").all()
    assert (costs.flops[cats] == 0).all() and (costs.bytes[cats] == 0).all()
    for dims, conc in zip(table.column("input_dims").take(pa.array(cats)).to_pylist(),
                          table.column("concrete_inputs").take(pa.array(cats)).to_pylist()):
        shapes = orjson.loads(dims)[0]
        if not shapes:
            continue  # a100_multirank: no shapes, the zero still holds
        dim = int(orjson.loads(conc)[1]) if conc else 0
        with fc.FlopCounterMode(display=False) as counter:
            torch.cat([torch.empty(s, device="meta") for s in shapes], dim=dim)
        assert counter.get_total_flops() == 0


def test_in_place_shape_changes_are_a_known_zero_on_the_resnet_trace() -> None:
    # aten::detach_ (the DataLoader's collate on v100's ResNet-50: 6 calls, on int64 labels) changes the
    # tensor's own metadata and launches no kernel: zero FLOPs known from the name, as aten::detach is.
    doc = raw_trace("v100/resnet50_training.json.gz")
    calls = [e["args"] for e in doc["traceEvents"] if e.get("name") == "aten::detach_" and e.get("ph") == "X"]
    assert len(calls) == 6
    for args in calls:
        assert F.op_cost("aten::detach_", args.get("Input Dims"), args.get("Input type")) == (0.0, 0.0, "other", "view")
    for name in ("aten::t_", "aten::transpose_", "aten::squeeze_", "aten::unsqueeze_", "aten::as_strided_"):
        assert F.op_cost(name, [[4, 8]], ["float"])[3] == "view", name


def test_the_functional_arity_table_is_torchs():
    """FUNCTIONAL_ARITY (how an out= call is told from a functional one by its argument count) is the most
    arguments any non-out overload of each elementwise op takes in torch's own schemas."""
    torch = pytest.importorskip("torch")
    from plasmient_trace.metrics.flops.elementwise import FUNCTIONAL_ARITY

    for name, arity in FUNCTIONAL_ARITY.items():
        schemas = torch._C._jit_get_schemas_for_operator(f"aten::{name}")
        functional = [len(s.arguments) for s in schemas if not any(a.is_out for a in s.arguments)]
        assert max(functional) == arity, name


def test_an_out_call_reads_its_inputs_once_and_writes_its_output_once(tmp_path) -> None:
    """An elementwise op moves its inputs once and its output once, whether it returns a new tensor or writes an
    ``out=`` one (ResNet's relu_ is clamp_min.out(self, 0, out=self)): the out tensor is written, not read."""
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile

    n = 1 << 16
    a, b, c = torch.randn(n), torch.randn(n), torch.empty(n)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        torch.neg(a, out=c)
        torch.clamp_min(a, 0.0, out=c)
        torch.mul(a, b, out=c)
        torch.logical_and(a, b, out=torch.empty(n, dtype=torch.bool))
        torch.neg(a)
        torch.mul(a, b)
    path = tmp_path / "out.json"
    prof.export_chrome_trace(str(path))
    events = [e for e in orjson.loads(path.read_bytes())["traceEvents"] if e.get("cat") == "cpu_op"]
    expected = {  # bytes read + written, float32 unless bool: from the shapes above, not from the trace
        ("aten::neg", 2): 2 * 4 * n, ("aten::clamp_min", 3): 2 * 4 * n, ("aten::mul", 3): 3 * 4 * n,
        ("aten::logical_and", 3): 2 * 4 * n + n, ("aten::neg", 1): 2 * 4 * n, ("aten::mul", 2): 3 * 4 * n}
    seen = Counter()
    for e in events:
        dims = e["args"].get("Input Dims")
        key = (e["name"], len(dims or []))
        if key in expected:
            flops, nbytes, _, _ = op_cost(e["name"], dims, e["args"].get("Input type"), e["args"].get("Concrete Inputs"))
            assert nbytes == expected[key], (key, nbytes)
            assert flops == n
            seen[key] += 1
    assert set(seen) == set(expected)


def test_a_broadcast_input_is_read_once_however_far_it_is_expanded(tmp_path) -> None:
    """``expand`` makes a stride-0 view: its elements are read once, not once per position of the broadcast.
    Kineto records the strides ('Input Strides'); the ops table keeps them where an input is broadcast."""
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile

    from plasmient_trace.sources.kineto import read_kineto

    n, m = 512, 256
    column, full = torch.randn(n, 1), torch.randn(n, m)
    index = torch.randint(0, m, (n, 1))
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        torch.mul(column.expand(n, m), full)
        torch.gather(full, 1, index.expand(n, m))
        torch.mul(full, full)
    path = tmp_path / "expand.json"
    prof.export_chrome_trace(str(path))
    # From the shapes above, not from the trace: a float32 column read once, the full matrix, the output.
    expected = {"aten::mul": [n * 4 + n * m * 4 + n * m * 4, 3 * n * m * 4]}
    rs = read_kineto(path)
    costs = model_ops(rs.ops)
    names = rs.ops.column("name").to_pylist()
    assert sorted(b for nm, b in zip(names, costs.bytes) if nm == "aten::mul") == sorted(expected["aten::mul"])
    gather = [(b, s) for nm, b, s in zip(names, costs.bytes, rs.ops.column("input_strides").to_pylist())
              if nm == "aten::gather"]
    assert len(gather) == 1 and gather[0][1] is not None
    # gather reads the int64 index column once, and as many source elements as it writes
    assert gather[0][0] == n * 8 + 2 * n * m * 4


def test_the_b200_embeddings_gather_reads_its_expanded_index_once() -> None:
    # Its aten::gather index is a [888, 1] int64 column expanded to [888, 2880] (strides [1, 0]); the 888
    # rows of 2880 bf16 it gathers and writes were 30.7 MB before, 3x the 10.2 MB the embedding moves.
    events = op_events("b200/eager_rank0_of8.json.gz")
    gather = [e for e in events if e["name"] == "aten::gather"]
    assert len(gather) == 1
    (rows, width), index_strides = gather[0]["args"]["Input Dims"][2], gather[0]["args"]["Input Strides"][2]
    assert index_strides == [1, 0]
    oracle = 2 * rows * width * 2 + rows * 8   # bf16 rows read and written, the index column once
    spans = [r for r in ingested("b200/eager_rank0_of8.json.gz").batch.table.to_pylist()
             if r["name"] in ("aten::gather", "aten::embedding")]
    assert {r["name"] for r in spans} == {"aten::gather", "aten::embedding"}
    assert all(r["plasmient.bytes"] == oracle for r in spans)


@pytest.mark.parametrize("name, dims, extra", [
    ("aten::softmax", [[512, 256], []], ["", "-1", "False"]),
    ("aten::_softmax", [[512, 256], []], ["", "-1", "False"]),
    ("aten::cumsum", [[512, 256], []], ["", "1", ""]),
    ("aten::layer_norm", [[512, 256], [], [256], [256]], ["", "[256]", "", "", "1e-05", "True"]),
])
def test_a_broadcast_input_is_read_once_and_its_dense_output_written_whole(name, dims, extra) -> None:
    # A [512, 256] float32 input broadcast from a [512, 1] column (strides [1, 0]): 2 KB read, but the output
    # is a dense [512, 256]: 512 KB written (the output was counted at the input's 2 KB, 4 KB in all).
    types = ["float" if d and i in (0, 2, 3) else "" for i, d in enumerate(dims)]
    strides = [[1, 0]] + [[] for _ in dims[1:]]
    _, dense, _, _ = op_cost(name, dims, types, extra)
    _, broadcast, _, model = op_cost(name, dims, types, extra, strides)
    assert model != "none"
    assert dense - broadcast == 512 * 255 * 4   # the input's repeated elements, not read; the output unchanged
