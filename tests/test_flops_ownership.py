"""Who owns nested FLOPs (flops.yields_flops) and how a user models their own op
(flops.register_flop_formula), both on CPU runs recorded here with torch.profiler and read back
through the project's Kineto reader, the way a user's trace would arrive."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from plasmient_trace.metrics import flops as F
from plasmient_trace.metrics.flops import core as flops_core
from plasmient_trace.sources.kineto import read_kineto
from plasmient_trace.stitch.joins import join_rank

torch = pytest.importorskip("torch")
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

BATCH, SIZES = 4, (16, 32, 8)


def _record(tmp_path: Path, fn) -> tuple[np.ndarray, F.OpCosts, list[str], np.ndarray, np.ndarray]:
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    rs = read_kineto(path)
    costs = F.model_ops(rs.ops)
    return (join_rank(rs).op_parent, costs, rs.ops.column("name").to_pylist(),
            rs.ops.column("start_ns").to_numpy(), rs.ops.column("end_ns").to_numpy())


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(SIZES[0], SIZES[1]), torch.nn.ReLU(),
                               torch.nn.Linear(SIZES[1], SIZES[2]))


def test_adamw_weight_decay_multiply_keeps_its_flops(tmp_path: Path) -> None:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)
    x = torch.randn(BATCH, SIZES[0])
    model(x).sum().backward()
    opt.step()  # state exists, so the recorded step is a steady-state one

    def step() -> None:
        model(x).sum().backward()
        opt.step()

    parent, costs, names, start, end = _record(tmp_path, step)
    owns = (costs.model != "none") & ~F.yields_flops(parent, costs.model, costs.flops)
    o = names.index("Optimizer.step#AdamW.step")
    in_opt = (start >= start[o]) & (end <= end[o])

    # The scalar operand of param.mul_(1 - lr*wd) is converted by an aten::to -> copy_ child with 0
    # FLOPs; the multiply must not hand its FLOPs to it.
    muls = in_opt & np.isin(np.array(names), ["aten::mul_", "aten::div", "aten::add_"]) & (costs.flops > 0)
    assert muls.sum() >= 4 * len(list(model.parameters()))
    assert owns[muls].all()

    # Oracle from torch's documented AdamW algorithm, per parameter element: weight decay 1,
    # m = lerp(m, g, 1-b1) 2, v = b2*v 1 + (1-b2)*g*g 2, sqrt 1, divide by bias correction 1, + eps 1,
    # p -= lr * m / denom 2 -> 11; plus one FLOP per parameter for its step counter increment.
    params = list(model.parameters())
    expected_opt = sum(11 * p.numel() + 1 for p in params)
    assert costs.flops[in_opt & owns].sum() == expected_opt

    # Forward + backward GEMM work equals torch's FlopCounterMode (which leaves out addmm's bias add:
    # one FLOP per output element of each Linear in the forward).
    with FlopCounterMode(display=False) as fc:
        model(x).sum().backward()
    bias_adds = sum(BATCH * m.out_features for m in model if isinstance(m, torch.nn.Linear))
    gemm = np.isin(costs.model, F.GEMM_LIKE) & owns & ~in_opt
    assert costs.flops[gemm].sum() == fc.get_total_flops() + bias_adds


def test_outer_op_still_yields_to_a_same_class_op_with_flops(tmp_path: Path) -> None:
    model = _mlp()
    x = torch.randn(BATCH, SIZES[0])
    parent, costs, names, _, _ = _record(tmp_path, lambda: model(x))
    yields = F.yields_flops(parent, costs.model, costs.flops)
    linear = np.array(names) == "aten::linear"
    assert linear.sum() == 2 and yields[linear].all()  # linear over addmm: counted once, on addmm
    addmm = np.array(names) == "aten::addmm"
    assert not yields[addmm].any()


def test_a_user_registered_formula_models_a_custom_op(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A private copy of the registry so the test's formula does not leak into other tests.
    monkeypatch.setattr(flops_core, "_REGISTRY", dict(flops_core._REGISTRY))

    @torch.library.custom_op("plasmient_test::scaled_gemm", mutates_args=())
    def scaled_gemm(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
        return (a @ b) * scale

    a, b = torch.randn(6, 5), torch.randn(5, 7)
    parent, before, names, _, _ = _record(tmp_path, lambda: scaled_gemm(a, b, 0.5))
    row = names.index("plasmient_test::scaled_gemm")
    assert before.model[row] == "none" and before.flops[row] == 0  # unknown until a formula exists

    @F.register_flop_formula("plasmient_test::scaled_gemm")
    def _scaled_gemm_flops(args: F.OpArgs) -> F.FlopResult:
        # scaled_gemm(a[M,K] 0, b[K,N] 1, scale 2): a GEMM plus one multiply per output element
        (m, k), (_, n) = args.shape(0), args.shape(1)
        return 2.0 * m * n * k + m * n, args.nbytes(0) + args.nbytes(1) + m * n * args.es(0), "gemm"

    after = F.model_ops(read_kineto(tmp_path / "trace.json").ops)
    with FlopCounterMode(display=False) as fc:
        a @ b
    assert after.model[row] == "gemm"
    assert after.flops[row] == fc.get_total_flops() + 6 * 7
    assert after.bytes[row] == (6 * 5 + 5 * 7 + 6 * 7) * 4
    # The custom op wraps its own aten::mm: the GEMM is counted once, on the inner mm.
    assert F.yields_flops(parent, after.model, after.flops)[row]

    with pytest.raises(ValueError, match="already registered"):
        F.register_flop_formula("plasmient_test::scaled_gemm", replace=False)(_scaled_gemm_flops)



def _brute_force_yields(parent: np.ndarray, cls: np.ndarray, below: np.ndarray) -> np.ndarray:
    """Per op, by walking up from every marked op: is a marked op of its class strictly under it?"""
    out = np.zeros(len(parent), bool)
    for d in np.flatnonzero(below):
        a = parent[d]
        while a >= 0:
            if cls[a] == cls[d]:
                out[a] = True
            a = parent[a]
    return out


def test_the_class_bits_climb_gives_what_walking_up_from_every_marked_op_gives():
    """The ownership rule's search (each op's classes below it as bits of one integer) against a brute-force
    walk and against the (ancestor, class)-pair climb it replaced, on random forests of up to 64 classes."""
    from plasmient_trace.metrics.flops.ownership import _yields_to_bits, _yields_to_pairs

    rng = np.random.default_rng(12)
    for _ in range(200):
        n = int(rng.integers(1, 300))
        k = int(rng.choice([1, 2, 5, 64]))
        # a parent always comes earlier (a forest); some roots
        parent = np.array([-1 if i == 0 or rng.random() < 0.1 else int(rng.integers(max(0, i - 8), i)) for i in range(n)])
        cls = rng.integers(0, k, n)
        below = rng.random(n) < rng.random()
        expected = _brute_force_yields(parent, cls, below)
        assert np.array_equal(_yields_to_bits(parent, cls, below), expected)
        assert np.array_equal(_yields_to_pairs(parent, cls, k, below), expected)
