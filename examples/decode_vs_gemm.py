"""Busy is not useful: a batch-1 decode loop and a large GEMM both keep the device ~100% utilised,
while their MFU differs by about 10x.

Each phase runs a few explicit steps (``with plasmient_trace.capture.step():``, the inference-loop
form; a no-op when nothing is tracing). Run it traced and compare the step spans:

    PLASMIENT_TRACE=1 PLASMIENT_EVERY=1 python examples/decode_vs_gemm.py
    plasmient report traces.jsonl

``--batch 8`` (16, 32, ...) decodes several sequences at once: the same weights are read once per
token for the whole batch, so the decode steps' MFU climbs with the batch while utilisation stays
where it was. Runs on a CPU in a few seconds.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import plasmient_trace


class Decoder(nn.Module):
    """A stack of square projections applied one token at a time: a decode step's weight-streaming
    matrix-vector products, without the small elementwise ops whose launch gaps would blur the point."""

    def __init__(self, dim: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class Gemm(nn.Module):
    """The large-GEMM phase, called as a module as real code calls its layers: the tensors it is given
    sign the step, so its later steps carry the FLOPs its first step measured."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.mm(a, b)


def decode(model: Decoder, batch: int, tokens: int, dim: int, device: str = "cpu") -> torch.Tensor:
    # A fresh input per token (its embedding), so activations never decay into slow denormals.
    inputs = torch.randn(tokens, batch, dim, device=device)
    for t in range(tokens):
        out = model(inputs[t])
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together (default 1)")
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--gemm", type=int, default=1024, help="size n of the n x n x n GEMM phase")
    p.add_argument("--steps", type=int, default=3, help="steps per phase")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where it runs (default: cuda when available, else cpu)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dev = args.device
    model = Decoder(args.dim, args.layers).eval().to(dev)
    a, b = torch.randn(args.gemm, args.gemm, device=dev), torch.randn(args.gemm, args.gemm, device=dev)
    gemm = Gemm()
    sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
    with torch.no_grad():
        decode(model, args.batch, 2, args.dim, dev)  # warm-up outside any step
        sync()
        for i in range(args.steps):
            t = time.perf_counter()
            with plasmient_trace.step():
                decode(model, args.batch, args.tokens, args.dim, dev)
                sync()  # the step's kernels end inside the step
            print(f"decode step {i}: batch {args.batch}, {time.perf_counter() - t:.3f}s", flush=True)
        for i in range(args.steps):
            t = time.perf_counter()
            with plasmient_trace.step():
                for _ in range(2):
                    gemm(a, b)
                sync()
            print(f"gemm step {i}: {args.gemm}^3, {time.perf_counter() - t:.3f}s", flush=True)


if __name__ == "__main__":
    main()
