"""A tiny transformer language model trained for a few steps: the example every capture test runs.

Nothing in it knows about plasmient-trace: run it as
``PLASMIENT_TRACE=1 python examples/train_tiny_transformer.py`` or
``opentelemetry-instrument python examples/train_tiny_transformer.py`` and every optimizer step
becomes one trace. Runs on a CPU in a few seconds.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, seq, dim))
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[:, : tokens.shape[1]]
        for layer in self.layers:
            x = layer(x, self.mask)
        return self.head(self.norm(x))


def build(dim: int = 128, layers: int = 2, heads: int = 4, vocab: int = 512, seq: int = 64,
          batch: int = 8, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(seed)
    model = TinyLM(vocab, dim, heads, layers, seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, vocab, (batch, seq + 1))
    return model, opt, data


def train_step(model: nn.Module, opt: torch.optim.Optimizer, data: torch.Tensor) -> float:
    logits = model(data[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), data[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return float(loss.detach())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the model trains (default: cuda when available, else cpu)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model, opt, data = build(dim=args.dim, layers=args.layers, batch=args.batch)
    model, data = model.to(args.device), data.to(args.device)  # in place: the optimizer keeps its parameters
    for step in range(args.steps):
        loss = train_step(model, opt, data)
        print(f"step {step} loss {loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
