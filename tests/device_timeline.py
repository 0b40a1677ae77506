"""A rank's device timeline two ways, for the timeline oracles (TraceLens's definitions, HTA): recomputed here
from the raw JSON over the whole trace (``raw_timeline``), and summed from plasmient's step spans
(``rank_timeline``)."""

from __future__ import annotations

from conftest import RAW_COLLECTIVE_KERNEL, ingested, raw_activities, raw_trace, union_ns

COPY_CATS = {"gpu_memcpy", "Memcpy", "gpu_memset", "Memset"}
# TraceLens's COMMUNICATION_KEYS (nccl, rccl, matched anywhere) and the symmetric-memory and vLLM all-reduce kernels
COMM_NAME = RAW_COLLECTIVE_KERNEL


def raw_timeline(name: str) -> dict:
    """TraceLens's breakdown from the raw JSON, per device and summed (seconds), plus the first activity's
    start (ns after Kineto's epoch anchor) per device."""
    by_device: dict[int, dict[str, list[tuple[int, int]]]] = {}
    for a in raw_activities(raw_trace(name)):
        e, span = a["event"], (a["start_ns"], a["end_ns"])
        kind = "copy" if e["cat"] in COPY_CATS else "comm" if COMM_NAME.search(str(e.get("name", ""))) else "compute"
        lists = by_device.setdefault(e.get("args", {}).get("device", 0), {"comm": [], "copy": [], "compute": []})
        lists[kind].append(span)
    out = dict.fromkeys(("busy", "comm", "comm_exposed", "copy", "copy_exposed", "span"), 0.0)
    out["first_ns"] = {}
    for dev, lists in by_device.items():
        every = lists["comm"] + lists["copy"] + lists["compute"]
        compute = union_ns(lists["compute"])
        out["busy"] += union_ns(every) / 1e9
        for kind in ("comm", "copy"):
            out[kind] += union_ns(lists[kind]) / 1e9
            out[kind + "_exposed"] += (union_ns(lists[kind] + lists["compute"]) - compute) / 1e9
        first = min(s for s, e in every if e > s)
        out["span"] += (max(e for _, e in every) - first) / 1e9
        out["first_ns"][dev] = first
    return out


def rank_timeline(name: str) -> dict:
    """plasmient's step spans of the trace's one rank, summed (seconds), and the lead gap: from the first step
    window's start to the first GPU activity (raw times moved onto the rank's clock)."""
    result = ingested(name)
    steps = sorted((r for r in result.batch.table.to_pylist() if r["plasmient.level"] == "step"),
                   key=lambda r: r["plasmient.device.start_ns"])
    offset = max(result.joined[0].stats.clock_offset_ns.values(), default=0)
    first = raw_timeline(name)["first_ns"]
    out = {key: sum(s[f"plasmient.{key}"] or 0.0 for s in steps)
           for key in ("busy_s", "idle_s", "comm.total_s", "comm.exposed_s", "memcpy.total_s", "memcpy.exposed_s")}
    out["lead_gap_s"] = sum(t + offset - steps[0]["plasmient.device.start_ns"] for t in first.values()) / 1e9
    return out
