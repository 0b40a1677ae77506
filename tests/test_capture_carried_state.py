"""Carried FLOPs follow the state that decides a step's work beyond its input shapes: which parameters are
trained, whether the step ran its backward, a decode position passed as a number, and, where the state is
out of sight (a KV cache whose position lives in the model), the disagreement of two measurements. Each
step's FLOPs are checked against torch's FlopCounterMode on the same steps of an identical model; a step
whose work cannot be known is ``unknown``, never carried from other work. (plasmient also counts the bias
adds, softmax and activations FlopCounterMode leaves out: within [1, 1.05] of it.)"""

from __future__ import annotations

from typing import Callable

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from capture_helpers import flop_counter_per_step as _oracle, live_capture

from plasmient_trace.capture.torch_hooks import input_signature


def _live(make: Callable[[], nn.Module], step: Callable[[nn.Module, int], None], n: int, every: int) -> list[dict]:
    with live_capture(every=every, peak_tflops=1.0, job_id="state") as (session, sink):
        model = make()
        for i in range(n):
            with session.step():
                step(model, i)
    rows = sorted((r for r in sink.rows() if r["plasmient.level"] == "step"), key=lambda r: r["plasmient.step"])
    assert [r["plasmient.step"] for r in rows] == list(range(n))
    return rows


def _check(rows: list[dict], expected: list[float]) -> list[str]:
    """Each step's source; its FLOPs within [1, 1.05] of FlopCounterMode's, unless unknown (then none)."""
    for r, want in zip(rows, expected):
        source = r["plasmient.flops.source"]
        if source == "unknown":
            assert r.get("plasmient.flops") is None and r.get("plasmient.mfu") is None
        else:
            assert 1.0 <= r["plasmient.flops"] / want <= 1.05, (r["plasmient.step"], source, r["plasmient.flops"], want)
    return [r["plasmient.flops.source"] for r in rows]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))


X = torch.randn(64, 256)


def test_a_layer_unfrozen_mid_run_is_measured_again():
    # The old signature saw only shapes: after the unfreeze, steps carried the frozen steps' 101 MFLOP
    # where FlopCounterMode counts 168 (0.60x), until the next periodic sample.
    def step(model, i):
        model[0].weight.requires_grad_(i >= 3)
        model(X).pow(2).mean().backward()

    sources = _check(_live(_mlp, step, 6, every=100), _oracle(_mlp, step, 6))
    assert sources == ["measured", "carried", "carried", "measured", "carried", "carried"]


def test_a_step_that_skips_its_backward_carries_nothing_measured_with_one():
    # The old code carried a step with backward onto steps without one: 2.5x FlopCounterMode's count.
    def step(model, i):
        loss = model(X).pow(2).mean()
        if i % 2 == 0:
            loss.backward()

    sources = _check(_live(_mlp, step, 6, every=100), _oracle(_mlp, step, 6))
    assert sources[0] == "measured" and sources[2] == sources[4] == "carried"


class _Decoder(nn.Module):
    """Llama-reference style decoding: the KV cache is in buffers and ``forward(tokens, start_pos)`` says how
    much of it the attention reads, or (``hidden=True``) the model keeps the position itself."""

    def __init__(self, hidden: bool = False, d: int = 64) -> None:
        super().__init__()
        self.hidden, self.pos = hidden, 0
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.register_buffer("k", torch.zeros(2, 512, d))
        self.register_buffer("v", torch.zeros(2, 512, d))

    def forward(self, x, start_pos: int = 0):
        pos = self.pos if self.hidden else start_pos
        q, k, v = self.qkv(x).chunk(3, -1)
        n = x.shape[1]
        self.k[:, pos:pos + n], self.v[:, pos:pos + n] = k, v
        att = torch.softmax(q @ self.k[:, :pos + n].transpose(1, 2) / 8.0, -1) @ self.v[:, :pos + n]
        self.pos = pos + n
        return self.out(att)


def _decode(model, i):
    with torch.no_grad():
        model(torch.randn(2, 32, 64), 32 * i)


def _decode_hidden(model, i):
    with torch.no_grad():
        model(torch.randn(2, 32, 64))


def test_a_decode_position_passed_as_a_number_is_part_of_the_signature():
    # The old signature saw one tensor shape on every step: step 9 carried step 0's FLOPs, 0.41x the count.
    make = _Decoder
    sources = _check(_live(make, _decode, 16, every=3), _oracle(make, _decode, 16))
    # one signature a position for 8 positions; then a signature without it, never carried as its
    # measurements (the samples every 3rd step) disagree
    assert sources[:9] == ["measured"] * 9 and "carried" not in sources
    x = torch.zeros(2, 3)
    assert input_signature((x, 32)) != input_signature((x, 64))


def test_a_signature_whose_measurements_disagree_carries_nothing_after():
    # The position is the model's own: no signature can see it. Once a second measurement of the signature
    # (the periodic sample at step 3) disagrees with the first, its steps are unknown, not carried.
    make = lambda: _Decoder(hidden=True)  # noqa: E731
    rows = _live(make, _decode_hidden, 10, every=3)
    expected = _oracle(make, _decode_hidden, 10)
    sources = [r["plasmient.flops.source"] for r in rows]
    assert sources == ["measured", "carried", "carried", "measured", "unknown", "unknown",
                       "measured", "unknown", "unknown", "measured"]
    for s in (0, 3, 6, 9):
        assert 1.0 <= rows[s]["plasmient.flops"] / expected[s] <= 1.05


def test_a_freed_models_id_stops_being_a_root():
    # CPython reuses a freed object's id: a submodule built later at that address would have had its calls
    # counted as another model's in every step's signature.
    import gc

    from plasmient_trace.capture.torch_hooks import ModuleRecorder

    recorder = ModuleRecorder()
    model = nn.Linear(2, 2)
    recorder.path_of(model, None)
    address = id(model)
    assert address in recorder._roots
    del model
    gc.collect()
    assert address not in recorder._roots


def test_a_compiled_function_that_calls_autograd_grad_runs_as_it_does_untraced(tmp_path):
    # Counting backward passes by patching torch.autograd.grad crashed this job ("Trying to backward through
    # the graph a second time") when dynamo was loaded before the capture started: dynamo traced into the
    # patch instead of breaking the graph at torch.autograd.grad. The count is now a hook on the root model's
    # output node, and the gradients are the untraced run's. (A fresh process: dynamo's tables are per process.)
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "job.py"
    script.write_text("""
import sys
import torch
sys.path.insert(0, sys.argv[1])
from capture_helpers import flop_counter_per_step as _oracle, live_capture

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
def train(x):
    loss = model(x).pow(2).mean()
    return loss, torch.autograd.grad(loss, list(model.parameters()))
compiled = torch.compile(train, backend="aot_eager")   # dynamo is loaded; it compiles at the first call
inputs = [torch.randn(4, 8) for _ in range(3)]
with live_capture(every=10, peak_tflops=1.0, job_id="compiled-grad") as (session, sink):
    for x in inputs:
        loss, grads = compiled(x)
        expected = torch.autograd.grad(model(x).pow(2).mean(), list(model.parameters()))
        assert all(torch.allclose(a, b) for a, b in zip(grads, expected))
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        opt.step()
assert not session.failed and session.stats["steps"] == 3, session.stats
print("same gradients")
""")

    tests = Path(__file__).parent
    proc = subprocess.run([sys.executable, str(script), str(tests)], capture_output=True, text=True, timeout=600,
                          cwd=tests.parent)
    assert proc.returncode == 0 and proc.stdout.strip() == "same gradients", proc.stderr[-2000:]


class _KeywordOnly(nn.Module):
    """Called with keywords only (as Hugging Face models are): its first call with a tensor is a layer's."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _mlp()

    def forward(self, *, x):
        return self.body(x)


def test_which_parameters_train_is_the_whole_models_when_it_is_called_with_keywords():
    # The signature's first call with a tensor is the first layer's: hashing only that layer's parameters, a
    # later layer unfrozen at step 3 carried 0.8x FlopCounterMode's count on steps 3-5.
    def step(model, i):
        model.body[2].weight.requires_grad_(i >= 3)
        model(x=X).pow(2).mean().backward()

    sources = _check(_live(_KeywordOnly, step, 6, every=100), _oracle(_KeywordOnly, step, 6))
    assert sources == ["measured", "carried", "carried", "measured", "carried", "carried"]


def test_a_number_that_changes_every_step_leaves_the_signature_after_8_values():
    # A step counter passed to forward: every step a new signature, so full depth for the first 64 steps
    # and `unknown` ever after. Past 8 values at its position it no longer counts: steps carry again.
    class Counted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = _mlp()

        def forward(self, x, step: int):
            return self.body(x)

    def step(model, i):
        model(X, i).pow(2).mean().backward()

    sources = _check(_live(Counted, step, 20, every=3), _oracle(Counted, step, 20))
    # steps 0-7: a value each, measured; 8: the first without it, measured; 9 carries nothing until a second
    # measurement (the sample at 9) agrees; from then on the steps carry
    assert sources[:10] == ["measured"] * 10 and set(sources[10:]) == {"measured", "carried"}
    assert sources.count("carried") >= 6
