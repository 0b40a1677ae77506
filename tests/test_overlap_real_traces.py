"""Communication/compute overlap, the idle split and the launch queue on step spans, checked on the shared
multi-GPU traces against values recomputed here from the raw JSON. HTA's own get_comm_comp_overlap is the
oracle of tests/test_hta_compare.py.
"""

from __future__ import annotations

import json

import pytest
from conftest import RAW_COLLECTIVE_KERNEL, ingested, raw_activities, raw_trace, union_ns

MULTI_GPU = ["b200/eager_rank0_of8.json.gz", "mi300x/resnet_act_checkpoint_rank0_of8.json.gz",
             "a100/nccl_training_rank0_of2.json.gz", "a100/cuda_graphs_rank0_of16.json.gz"]



def _raw(name: str):
    """Per GPU activity from the raw JSON (conftest.raw_activities): (device, start ns, end ns, kind, launch ns or
    None, step number)."""
    out = []
    for a in raw_activities(raw_trace(name)):
        e = a["event"]
        name_l = str(e.get("name", "")).lower()
        kind = ("copy" if e["cat"] in ("gpu_memcpy", "Memcpy", "gpu_memset", "Memset")
                else "comm" if RAW_COLLECTIVE_KERNEL.search(name_l) else "compute")
        out.append((e.get("args", {}).get("device", 0), a["start_ns"], a["end_ns"], kind, a["launch_ns"], a["step"]))
    return out


def _steps(name: str) -> list[dict]:
    """Step spans in time order (their windows tile the rank's device timeline)."""
    rows = ingested(name).batch.table.to_pylist()
    return sorted((r for r in rows if r["plasmient.level"] == "step"),
                  key=lambda r: (r["plasmient.device.start_ns"] + round(r["plasmient.device.window_s"] * 1e9),
                                 r["plasmient.step"]))


def _setup(name: str):
    """The steps in time order, each with its device window (the step's tile of the rank's timeline), and the
    raw activities that belong to a step, on the rank's clock."""
    offset = max(ingested(name).joined[0].stats.clock_offset_ns.values(), default=0)
    steps = [(step, (step["plasmient.device.start_ns"],
                     step["plasmient.device.start_ns"] + round(step["plasmient.device.window_s"] * 1e9)))
             for step in _steps(name)]
    acts = [(d, s + offset, e + offset, k, None if la is None else la + offset, n) for d, s, e, k, la, n in _raw(name)
            if n is not None]
    return steps, acts


def _clip(intervals, lo, hi):
    return [(min(max(s, lo), hi), min(max(e, lo), hi)) for s, e in intervals]


@pytest.mark.parametrize("name", MULTI_GPU)
def test_exposed_communication_matches_the_raw_trace(name):
    """A step's collectives, whole (a pipelined step's may start in the previous step's window), are hidden where
    any compute kernel of the device ran, whichever step launched it."""
    steps, acts = _setup(name)
    for step, _ in steps:
        total = exposed = 0
        for dev in {a[0] for a in acts}:
            comm = [(s, e) for d, s, e, k, _, n in acts if d == dev and k == "comm" and n == step["plasmient.step"]]
            comp = [(s, e) for d, s, e, k, _, _ in acts if d == dev and k == "compute"]
            t = union_ns(comm)
            hidden = t + union_ns(comp) - union_ns(comm + comp)
            total += t
            exposed += t - hidden
        assert step["plasmient.comm.total_s"] == pytest.approx(total / 1e9, abs=2e-6), step["name"]
        assert step["plasmient.comm.exposed_s"] == pytest.approx(exposed / 1e9, abs=2e-6), step["name"]
        if total:
            assert step["plasmient.comm.overlap"] == pytest.approx(1 - exposed / total, abs=0.01)
        else:
            assert step["plasmient.comm.overlap"] is None


@pytest.mark.parametrize("name", MULTI_GPU)
def test_idle_splits_into_host_and_device_waits(name):
    """Idle is the step's window less the time any kernel ran in it; the device's share of it is where some
    kernel (of any step) was launched and waiting. The launch queue is the count of launched, unfinished
    kernels over the window."""
    steps, acts = _setup(name)
    for step, (w_lo, w_hi) in steps:
        host, device = step["plasmient.idle.host_s"], step["plasmient.idle.device_s"]
        assert host >= -1e-12 and device >= -1e-12
        assert host + device == pytest.approx(step["plasmient.idle_s"], abs=1e-9)
        if step["plasmient.gpus"] != 1:
            continue
        ks = _clip([(s, e) for _, s, e, _, _, _ in acts], w_lo, w_hi)
        queued = _clip([(la, s) for _, s, _, _, la, _ in acts if la is not None and la < s], w_lo, w_hi)
        assert step["plasmient.idle_s"] == pytest.approx((w_hi - w_lo - union_ns(ks)) / 1e9, abs=2e-6), step["name"]
        assert device == pytest.approx((union_ns(ks + queued) - union_ns(ks)) / 1e9, abs=2e-6), step["name"]
        launched = [(la, max(e, la)) for _, _, e, _, la, _ in acts if la is not None]
        area = sum(max(0, min(e, w_hi) - max(la, w_lo)) for la, e in launched)
        assert step["plasmient.launch_queue.mean"] == pytest.approx(area / max(w_hi - w_lo, 1), rel=1e-6), step["name"]
        deepest = max((sum(1 for la, e in launched if la <= t < e) for t in [w_lo] + [la for la, _ in launched if w_lo < la < w_hi]),
                      default=0)
        assert step["plasmient.launch_queue.max"] == deepest, step["name"]


def test_a_step_whose_kernels_have_no_launch_record_has_an_unknown_idle_split(tmp_path):
    """Live step-depth steps record kernels without their launches (as do traces with no runtime events): the
    idle time is still known from the kernels alone, but who made the device wait is not, so the split and
    the launch queue are absent rather than "all host"."""
    import gzip

    from plasmient_trace.pipeline import IngestOptions, ingest_paths

    name = "h100/vit_image_classification.json.gz"
    doc = {**raw_trace(name)}  # a copy: raw_trace's document is shared by every test
    doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("cat") not in ("cuda_runtime", "cuda_driver")]
    path = tmp_path / "no-launches.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(doc, f)
    rows = ingest_paths([path], IngestOptions(job_id="test-job")).batch.table.to_pylist()
    steps = {r["plasmient.step"]: r for r in rows if r["plasmient.level"] == "step"}
    with_launches = {r["plasmient.step"]: r for r in _steps(name)}
    assert steps.keys() == with_launches.keys()
    for n, step in steps.items():
        assert step["plasmient.kernels"] > 0 and step["plasmient.idle_s"] > 0
        assert step["plasmient.idle.device_s"] is None and step["plasmient.idle.host_s"] is None, step["name"]
        assert step["plasmient.launch_queue.mean"] is None and step["plasmient.launch_queue.max"] is None
        assert with_launches[n]["plasmient.idle.host_s"] > 0  # the original trace's split, for contrast
    for row in rows:
        if row["plasmient.level"] in ("rank", "node", "fleet"):
            assert row["plasmient.idle.device_s"] is None and row["plasmient.idle.host_s"] is None, row["plasmient.level"]


def test_idle_advice_follows_the_split():
    # a100/cuda_graphs rank 0 of 16 waits with kernels queued (collectives behind slower ranks): no CUDA-graph advice
    for step in _steps("a100/cuda_graphs_rank0_of16.json.gz"):
        rows = json.loads(step["plasmient.culprits"])
        idle = [r for r in rows if r["kernel"] == "[device idle]"]
        if idle and step["plasmient.idle.device_s"] > step["plasmient.idle.host_s"]:
            assert "queued" in idle[0]["suggestion"] and "CUDA graphs will not help" in idle[0]["suggestion"]
    for step in _steps("h100/vit_image_classification.json.gz"):
        rows = json.loads(step["plasmient.culprits"])
        idle = [r for r in rows if r["kernel"] == "[device idle]"]
        assert step["plasmient.idle.host_s"] > step["plasmient.idle.device_s"]
        assert idle and "nothing queued" in idle[0]["suggestion"]
