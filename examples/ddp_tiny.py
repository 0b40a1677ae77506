"""The tiny transformer trained data-parallel (DDP over gloo) on a CPU for a few steps.

Nothing in it knows about plasmient-trace: run it as
``plasmient run -- torchrun --standalone --nproc_per_node=2 examples/ddp_tiny.py`` and every optimizer
step becomes one trace holding both ranks (fleet -> node -> rank -> step), each rank writing its own
traces.rank<R>.jsonl. Each rank trains on its own slice of the data; DDP all-reduces the gradients.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from train_tiny_transformer import TinyLM


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # same initial weights on every rank (DDP also broadcasts rank 0's)
    vocab = 256
    model = DistributedDataParallel(TinyLM(vocab, args.dim, heads=4, layers=args.layers, seq=args.seq))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1 + rank))
    for step in range(args.steps):
        logits = model(data[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), data[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        print(f"rank {rank} step {step} loss {float(loss.detach()):.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()
