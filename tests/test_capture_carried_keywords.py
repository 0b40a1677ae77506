"""Carried FLOPs of models called with keywords, and of a second model. torch's global forward pre-hook never sees a call's keywords, so these steps once carried what a
full-depth step measured on other work (the audit of live capture: 0.34x-0.73x FlopCounterMode's count).
Each step's FLOPs are checked against FlopCounterMode on the same steps of identical models: a carried step
within [1, 1.05] of it (plasmient also counts bias adds and activations), else ``unknown``."""

from __future__ import annotations

from typing import Any, Callable

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from capture_helpers import flop_counter_per_step as _oracle, live_capture


def _live(make: Callable[[], Any], step: Callable[[Any, int], None], n: int, every: int,
          explicit: bool = True) -> list[dict]:
    with live_capture(every=every, peak_tflops=1.0, job_id="keywords") as (session, sink):
        state = make()
        for i in range(n):
            if explicit:
                with session.step():
                    step(state, i)
            else:
                step(state, i)  # its optimizer.step() ends the step
    assert not session.failed
    rows = sorted((r for r in sink.rows() if r["plasmient.level"] == "step"), key=lambda r: r["plasmient.step"])
    assert [r["plasmient.step"] for r in rows] == list(range(len(rows)))
    return rows


def _check(rows: list[dict], expected: list[float], skip: tuple[int, ...] = ()) -> list[str]:
    """Each step's source; a measured or carried step's FLOPs within [1, 1.05] of FlopCounterMode's, an unknown
    one without FLOPs (steps in ``skip``: measured from their first module call, their own count not checked)."""
    for r, want in zip(rows, expected):
        source = r["plasmient.flops.source"]
        if source == "unknown":
            assert r.get("plasmient.flops") is None and r.get("plasmient.mfu") is None
        elif r["plasmient.step"] not in skip or source == "carried":
            assert 1.0 <= r["plasmient.flops"] / want <= 1.05, (r["plasmient.step"], source, r["plasmient.flops"], want)
    return [r["plasmient.flops.source"] for r in rows]


class _EncDec(nn.Module):
    """Whisper-style, called with keywords only: the encoder's input is the same every step, the decoder's not."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(40, d), nn.GELU(), nn.Linear(d, d))
        self.embed = nn.Embedding(256, d)
        self.dec = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.head = nn.Linear(d, 256)

    def forward(self, *, input_features, decoder_input_ids):
        e = self.enc(input_features)
        x = self.dec(self.embed(decoder_input_ids))
        return self.head(x + e.mean(1, keepdim=True))


def _encdec():
    torch.manual_seed(0)
    return _EncDec()


def test_a_decoder_called_with_keywords_carries_nothing_measured_on_another_length():
    # The signature saw the encoder's layer only: steps 3-4 carried the 16-token steps' count (0.4x).
    def step(model, i):
        tokens = torch.randint(0, 256, (4, 64 if i >= 3 else 16))
        model(input_features=torch.randn(4, 32, 40), decoder_input_ids=tokens).pow(2).mean().backward()

    sources = _check(_live(_encdec, step, 8, every=5), _oracle(_encdec, step, 8))
    # steps 3-4's keywords were never measured: unknown until the sample at step 5 measures them
    assert sources == ["measured", "carried", "carried", "unknown", "unknown", "measured", "carried", "carried"]


class _Denoiser(nn.Module):
    """diffusers style: ``unet(sample=..., encoder_hidden_states=...)``."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.body = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, *, sample, encoder_hidden_states):
        return self.body(self.inp(sample) + encoder_hidden_states.mean(1, keepdim=True))


def _two_models():
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Embedding(256, 64), nn.Linear(64, 64)).requires_grad_(False)
    return encoder, _Denoiser()


def test_a_second_model_called_with_keywords_joins_the_signature():
    # Its pre-hook call had no arguments: steps 3-4 carried the 16-long steps' count (0.34x in the audit).
    def step(models, i):
        encoder, denoiser = models
        with torch.no_grad():
            hidden = encoder(torch.randint(0, 256, (4, 16)))
        sample = torch.randn(4, 48 if i >= 3 else 16, 64)
        denoiser(sample=sample, encoder_hidden_states=hidden).pow(2).mean().backward()

    sources = _check(_live(_two_models, step, 8, every=5), _oracle(_two_models, step, 8))
    assert sources == ["measured", "carried", "carried", "unknown", "unknown", "measured", "carried", "carried"]


def _probe():
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 256)).requires_grad_(False)
    net = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10))
    return encoder, net


def test_a_layer_unfrozen_in_a_second_model_is_measured_again():
    # Only the first model's requires_grad was hashed: steps 3-4 carried 0.73x their count.
    def step(models, i):
        encoder, net = models
        net[2].weight.requires_grad_(i >= 3)
        net[2].bias.requires_grad_(i >= 3)
        with torch.no_grad():
            z = encoder(torch.randn(64, 128))
        net(z).pow(2).mean().backward()

    sources = _check(_live(_probe, step, 8, every=5), _oracle(_probe, step, 8))
    assert sources == ["measured", "carried", "carried", "unknown", "unknown", "measured", "carried", "carried"]


class _Cache:
    """A KV cache object (Hugging Face's DynamicCache holds its tensors the same way)."""

    def __init__(self) -> None:
        self.keys: dict[int, Any] = {}

    def update(self, layer: int, k):
        self.keys[layer] = torch.cat([self.keys[layer], k], 1) if layer in self.keys else k
        return self.keys[layer]


class _Attn(nn.Module):
    def __init__(self, d: int, layer: int) -> None:
        super().__init__()
        self.layer, self.q, self.k = layer, nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x, cache=None):
        k = cache.update(self.layer, self.k(x))
        return torch.softmax(self.q(x) @ k.transpose(1, 2), -1) @ k


class _Decoder(nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, d)
        self.layers = nn.ModuleList(_Attn(d, i) for i in range(2))

    def forward(self, *, input_ids, past_key_values):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = x + layer(x, cache=past_key_values)
        return x


def _prefill():
    torch.manual_seed(0)
    return _Decoder().eval(), _Cache()


def test_a_cache_passed_as_a_keyword_is_part_of_the_signature():
    # Chunked prefill, 32 tokens a step into a growing cache object passed as `past_key_values`: every step
    # carried the first chunk's count (0.67x at worst in the audit). Now none carries another length's.
    def step(state, i):
        model, cache = state
        with torch.no_grad():
            model(input_ids=torch.randint(0, 256, (2, 32)), past_key_values=cache)

    sources = _check(_live(_prefill, step, 8, every=100), _oracle(_prefill, step, 8))
    assert "carried" not in sources and sources[0] == "measured"
