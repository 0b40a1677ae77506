"""Many simulated ranks of one job, made from real traces: for the multi-rank benchmark and its tests.

Rank i is a copy of ``sources[i % len(sources)]`` (real Kineto traces of one job) with
* its own rank id and the job's world size in ``distributedInfo``,
* its own host clock: every timestamp shifted by ``shift_us[i]`` (a seeded uniform draw in +-max_shift_us;
  rank 0 unshifted), which the stitcher must undo from the collectives,
* per-kernel jitter: every GPU activity starts 0..jitter_us later, and lasts 0.95-1.05x as long, so the
  ranks do not do byte-identical work; a collective (NCCL/RCCL kernel, as the Kineto reader names them)
  keeps its end, because the ranks of a collective leave it together.
"""

from __future__ import annotations

import copy
import gzip
import json
import random
from dataclasses import dataclass
from pathlib import Path

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
DEFAULT_SOURCES = ("a100_multirank/rank-0.json.gz", "a100_multirank/rank-1.json.gz")
_GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset", "Kernel", "Memcpy", "Memset"}


@dataclass
class SimulatedRanks:
    paths: list[Path]
    shift_us: list[int]     # added to every timestamp of rank i
    source: list[int]       # index into sources


def write_simulated_ranks(out_dir: str | Path, n: int, sources: tuple[str, ...] = DEFAULT_SOURCES, seed: int = 0,
                          max_shift_us: int = 5_000, jitter_us: int = 2) -> SimulatedRanks:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    docs = []
    for name in sources:
        with gzip.open(TRACES / name, "rt") as f:
            docs.append(json.load(f))
    rng = random.Random(seed)
    shifts = [0] + [rng.randint(-max_shift_us, max_shift_us) for _ in range(n - 1)]
    paths, which = [], []
    for i in range(n):
        s = i % len(docs)
        doc = copy.deepcopy(docs[s])
        doc["distributedInfo"] = {**(doc.get("distributedInfo") or {}), "rank": i, "world_size": n}
        for ev in doc["traceEvents"]:
            if not isinstance(ev.get("ts"), (int, float)):
                continue
            ev["ts"] = ev["ts"] + shifts[i]
            if ev.get("cat") in _GPU_CATS and ev.get("ph") == "X" and isinstance(ev.get("dur"), (int, float)):
                late = rng.randint(0, jitter_us)
                if _is_collective(str(ev.get("name", ""))):
                    # Ranks reach a collective at different times but leave it together: only the start moves.
                    late = min(late, int(ev["dur"]))
                    ev["ts"] += late
                    ev["dur"] -= late
                else:
                    ev["ts"] += late
                    ev["dur"] = round(ev["dur"] * rng.uniform(0.95, 1.05), 3)
        path = out_dir / f"rank-{i}.json.gz"
        with gzip.open(path, "wt", compresslevel=1) as f:
            json.dump(doc, f)
        paths.append(path)
        which.append(s)
    return SimulatedRanks(paths=paths, shift_us=shifts, source=which)


def _is_collective(name: str) -> bool:
    return "nccl" in name or "rccl" in name or "Nccl" in name
