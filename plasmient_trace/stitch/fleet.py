"""Fleet and node spans from per-rank summaries: what live multi-rank capture emits above the ranks.

Offline, the stitcher sees every rank and builds fleet -> node -> rank itself. Live, each rank stitches
only its own records, so its fleet/node rows would carry its numbers alone. Instead each rank reduces its
rank span to a :class:`RankSummary` (a few sums), the summaries of a step are gathered, and
:func:`top_spans` builds the fleet span and one node span per host from them with the stitcher's own
formulas (``metrics.compute.derive`` on a ``SpanSums``) and ids (``stitch.ids``), so the live tree reads
exactly like an offline one.

What a summary cannot carry exactly, and how it is approximated (said where it is done):
* ``kernel_s`` / ``comm_s`` (summed kernel and collective seconds, used for the latency/communication
  bound) are not span attributes: they are re-summed from the exported kernel spans plus the folded
  seconds on op/step spans; collectives folded by the span budget are missed.
* the fleet/node culprit kernel is the culprit of the rank with the most kernel waste, not the kernel
  label with the most waste summed over every rank's kernels.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Iterable

import numpy as np
import pyarrow as pa

from .. import conventions as cv
from ..metrics import compute as mc
from . import ids
from .tree import StitchOptions


@dataclass
class RankSummary:
    """One rank's contribution to a step's fleet and node spans (the sums of its rank span)."""

    job_id: str
    step: int
    rank: int
    host: str
    start_ns: int
    end_ns: int
    flops: float                 # NaN: not measured (a step-level step)
    ideal_s: float               # NaN: peak unknown (or not measured)
    busy_s: float
    gpus: int
    devices: int                 # distinct devices with kernels (0: the rank ran nothing)
    price_per_hour_sum: float    # USD/h over its devices; NaN unknown
    kernels: int | None          # None: not measured (a step-level step on a CPU)
    kernel_s: float
    comm_s: float
    bytes: float
    ridge: float                 # flop/byte of its device; NaN unknown
    kernel_waste_s: float        # device-seconds its kernels spent below the baseline MFU
    device_type: str = "gpu"
    culprit_kernel: str | None = None
    culprit_op: str | None = None
    culprit_module: str | None = None
    culprit_wasted_s: float | None = None
    culprit_bound: str | None = None
    culprit_suggestion: str | None = None
    service_name: str | None = None

    def to_json(self) -> dict[str, Any]:
        # NaN is not JSON: None stands for it on the wire.
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> "RankSummary":
        floats = {"flops", "ideal_s", "busy_s", "price_per_hour_sum", "kernel_s", "comm_s", "bytes", "ridge",
                  "kernel_waste_s"}
        return cls(**{k: (float("nan") if v is None and k in floats else v) for k, v in doc.items()})


def _col(table: pa.Table, name: str, fill: float = np.nan) -> np.ndarray:
    col = table.column(name)
    if pa.types.is_floating(col.type) or pa.types.is_integer(col.type):
        return col.cast(pa.float64()).fill_null(fill).to_numpy()
    return np.asarray(col.to_pylist(), dtype=object)


def summaries_from_batch(batch: cv.SpanBatch, baseline_mfu: float = cv.DEFAULT_BASELINE_MFU) -> list[RankSummary]:
    """One summary per rank span of the batch (per step and rank)."""
    t = batch.table
    level = np.asarray(t.column("plasmient.level").to_pylist(), dtype=object)
    rows = np.nonzero(level == "rank")[0]
    if not len(rows):
        return []
    step = t.column("plasmient.step").to_numpy()
    rank = t.column("plasmient.rank").fill_null(-1).to_numpy()
    start = t.column("start_ns").to_numpy()
    end = t.column("end_ns").to_numpy()
    dur = np.maximum(end - start, 0) / 1e9

    # Map every span below a rank span to that rank span's (step, rank) slot.
    width = int(rank.max()) + 2
    key = step.astype(np.int64) * width + (rank.astype(np.int64) + 1)
    slot_key = key[rows]
    order = np.argsort(slot_key)
    pos = np.searchsorted(slot_key[order], key)
    pos = np.minimum(pos, len(rows) - 1)
    belongs = (slot_key[order][pos] == key) & (rank >= 0)
    slot = np.where(belongs, order[pos], -1)

    # kernel_s: exported kernel spans + kernels folded into op/step spans; on a CPU the leaf ops are
    # the kernels (the stitcher does not export those synthetic kernels).
    kind = np.asarray(t.column("plasmient.kernel.kind").to_pylist(), dtype=object)
    folded_s = _col(t, "plasmient.kernels.folded_s", 0.0)
    is_kernel = (level == "kernel") & (slot >= 0)
    is_op = (level == "op") & (slot >= 0)
    op_parents = t.column("parent_span_id").to_numpy()[is_op | is_kernel]
    leaf_op = is_op & ~np.isin(t.column("span_id").to_numpy(), op_parents)
    n = len(rows)

    def per_slot(mask: np.ndarray, weights: np.ndarray) -> np.ndarray:
        # float even when nothing matches (np.bincount of nothing is int)
        return np.bincount(slot[mask], weights=weights[mask], minlength=n).astype(np.float64)

    kernel_s = per_slot(is_kernel, dur)
    has_fold = ((level == "op") | (level == "step")) & (slot >= 0)
    kernel_s += per_slot(has_fold, folded_s)
    seen = np.bincount(slot[is_kernel], minlength=n) > 0
    comm = is_kernel & (kind == "collective")
    comm_s = per_slot(comm, dur)
    device_type = np.asarray(t.column("plasmient.device.type").to_pylist(), dtype=object)
    cpu_leaf = leaf_op & (device_type == "cpu")
    kernel_s += per_slot(cpu_leaf, dur)
    seen |= np.bincount(slot[cpu_leaf], minlength=n) > 0

    get = {name: _col(t, name)[rows] for name in (
        "plasmient.flops", "plasmient.ideal_s", "plasmient.busy_s", "plasmient.gpus", "plasmient.cost.usd",
        "plasmient.wall_s", "plasmient.kernels", "plasmient.bytes", "plasmient.peak_flops",
        "plasmient.peak_bandwidth", "plasmient.culprit.wasted_s")}
    text = {name: np.asarray(t.column(name).to_pylist(), dtype=object)[rows] for name in (
        "plasmient.bound", "plasmient.culprit.kernel", "plasmient.culprit.op", "plasmient.culprit.module",
        "plasmient.culprit.bound", "plasmient.culprit.suggestion", "plasmient.job.id")}
    res_idx = t.column("resource_index").to_numpy()[rows]
    out: list[RankSummary] = []
    for i, r in enumerate(rows.tolist()):
        res = batch.resources[res_idx[i]] if res_idx[i] < len(batch.resources) else {}
        kernels = get["plasmient.kernels"][i]
        busy = get["plasmient.busy_s"][i]
        ks = float(kernel_s[i])
        if not seen[i] and not kernels == 0:
            ks = float(busy)  # nothing below the rank was exported (a step-level step): the union stands in
        cs = float(comm_s[i])
        if not seen[i]:
            cs = ks if text["plasmient.bound"][i] == "communication" else 0.0
        gpus = int(get["plasmient.gpus"][i])
        # kernels unknown (NaN: a step-level step on a CPU): the devices it is charged for still count
        devices = gpus if not kernels == 0 else 0
        wall = get["plasmient.wall_s"][i]
        cost = get["plasmient.cost.usd"][i]
        price = cost * 3600.0 / wall if wall > 0 else np.nan
        peak, bw = get["plasmient.peak_flops"][i], get["plasmient.peak_bandwidth"][i]
        ideal = get["plasmient.ideal_s"][i]
        # Kernel waste as mc.kernel_waste_s sums it, from the rank's totals (exact unless a kernel
        # ran faster than its ideal, which the per-kernel cap prevents).
        waste = max(0.0, ks - (0.0 if np.isnan(ideal) else ideal) / baseline_mfu)
        cw = get["plasmient.culprit.wasted_s"][i]
        out.append(RankSummary(
            job_id=str(text["plasmient.job.id"][i]), step=int(step[r]), rank=int(rank[r]),
            host=str(res.get("host.name", "")), start_ns=int(start[r]), end_ns=int(end[r]),
            flops=float(get["plasmient.flops"][i]), ideal_s=float(ideal), busy_s=float(busy), gpus=gpus,
            devices=devices, price_per_hour_sum=float(price), kernels=None if np.isnan(kernels) else int(kernels), kernel_s=ks,
            comm_s=cs, bytes=float(get["plasmient.bytes"][i]),
            ridge=float(peak / bw) if bw > 0 else float("nan"), kernel_waste_s=float(waste),
            device_type=str(device_type[r]),
            culprit_kernel=text["plasmient.culprit.kernel"][i], culprit_op=text["plasmient.culprit.op"][i],
            culprit_module=text["plasmient.culprit.module"][i],
            culprit_wasted_s=None if np.isnan(cw) else float(cw), culprit_bound=text["plasmient.culprit.bound"][i],
            culprit_suggestion=text["plasmient.culprit.suggestion"][i], service_name=res.get("service.name"),
        ))
    return out


def _nan_to_null(values: np.ndarray) -> pa.Array:
    values = np.asarray(values, np.float64)
    return pa.array(values, mask=~np.isfinite(values))


def top_spans(summaries: Iterable[RankSummary], options: StitchOptions, local_hosts: Iterable[str] | None = None,
              include_fleet: bool = True) -> cv.SpanBatch:
    """Fleet span (when include_fleet) and node spans (every host, or only local_hosts) of each step
    in the summaries, with the ids, metrics and resources the stitcher gives them."""
    by_step: dict[int, list[RankSummary]] = {}
    for s in summaries:
        by_step.setdefault(int(s.step), []).append(s)
    wanted_hosts = None if local_hosts is None else set(local_hosts)
    job = options.job_id
    # (level, step, host or None, members)
    groups: list[tuple[str, int, str | None, list[RankSummary]]] = []
    for step in sorted(by_step):
        members = sorted(by_step[step], key=lambda s: s.rank)
        if include_fleet:
            groups.append(("fleet", step, None, members))
        for host in sorted({s.host for s in members}):
            if wanted_hosts is None or host in wanted_hosts:
                groups.append(("node", step, host, [s for s in members if s.host == host]))
    n = len(groups)
    if n == 0:
        return cv.SpanBatch(table=cv.empty_span_table(), resources=[])

    def total(field: str) -> np.ndarray:
        return np.array([sum(getattr(s, field) for s in g[3]) for g in groups], np.float64)

    devices = total("devices").astype(np.int64)
    kernels_known = np.array([all(s.kernels is not None for s in g[3]) for g in groups])
    kernels = np.array([sum(s.kernels or 0 for s in g[3]) for g in groups], np.int64)
    sums = mc.SpanSums(flops=total("flops"), bytes=total("bytes"), ideal_s=total("ideal_s"), busy_s=total("busy_s"),
                       kernels=kernels, kernel_s=total("kernel_s"), comm_s=total("comm_s"),
                       devices=devices, device_price=np.zeros(n))
    start = np.array([min(s.start_ns for s in g[3]) for g in groups], np.int64)
    end = np.array([max(s.end_ns for s in g[3]) for g in groups], np.int64)
    gpus = np.maximum(devices, 1)
    price = np.empty(n)
    ridge = np.empty(n)
    for i, (_, step, _, members) in enumerate(groups):
        with_dev = [s for s in members if s.devices > 0]
        if with_dev:
            price[i] = sum(s.price_per_hour_sum for s in with_dev)
        else:
            # As the stitcher: a group with no kernels is charged one device at the ranks' common price.
            per_dev = [s.price_per_hour_sum / max(s.devices, 1) for s in members]
            price[i] = per_dev[0] if all(p == per_dev[0] for p in per_dev) else np.nan
        # The stitcher gives every top span the mean ridge of all ranks it stitched: the step's ranks.
        r = np.array([s.ridge for s in by_step[step]], np.float64)
        ridge[i] = np.nanmean(r) if np.isfinite(r).any() else np.nan
    met = mc.derive(sums, start, end, gpus, ridge, price, np.zeros(n, bool), options.baseline_mfu)
    unmeasured = np.isnan(sums.flops)  # a step-level step somewhere below: no bound/waste, as on its ranks

    # culprit: the rank with the most kernel waste, and its culprit kernel/op/module
    culprit: dict[str, list[Any]] = {k: [None] * n for k in ("kernel", "op", "module", "rank", "wasted_s", "bound", "suggestion")}
    for i, (_, _, _, members) in enumerate(groups):
        if unmeasured[i]:
            continue
        candidates = [s for s in members if s.culprit_kernel is not None]
        if not candidates:
            continue
        worst = max(candidates, key=lambda s: (s.kernel_waste_s, -s.rank))
        culprit["rank"][i] = worst.rank
        culprit["kernel"][i] = worst.culprit_kernel
        culprit["op"][i] = worst.culprit_op
        culprit["module"][i] = worst.culprit_module
        culprit["bound"][i] = worst.culprit_bound
        culprit["suggestion"][i] = worst.culprit_suggestion
        # the same kernel wastes time on the other ranks too: sum it where it is their culprit as well
        culprit["wasted_s"][i] = float(sum(s.culprit_wasted_s or 0.0 for s in candidates
                                           if s.culprit_kernel == worst.culprit_kernel))

    service = options.service_name or next((s.service_name for g in groups for s in g[3] if s.service_name), None) \
        or "plasmient-trace"
    resources: list[dict[str, Any]] = []
    res_of: dict[str | None, int] = {}
    for lvl, _, host, _ in groups:
        if host not in res_of:
            res_of[host] = len(resources)
            res = {"service.name": service, "plasmient.job.id": job}
            if host is not None:
                res["host.name"] = host
            resources.append({**res, **options.extra_resource})

    span_id = np.array([ids.fleet_span_id(job, step) if lvl == "fleet" else ids.node_span_id(job, step, host)
                        for lvl, step, host, _ in groups], np.uint64)
    parent = np.array([0 if lvl == "fleet" else ids.fleet_span_id(job, step) for lvl, step, _, _ in groups], np.uint64)
    all_cpu = [all(s.device_type == "cpu" for s in g[3]) for g in groups]
    bound = np.array(cv.BOUNDS, dtype=object)[met.bound.astype(np.int64)]
    cols: dict[str, Any] = {
        "trace_id": pa.array([ids.trace_id(job, step) for _, step, _, _ in groups], pa.binary(16)),
        "span_id": span_id,
        "parent_span_id": parent,
        "resource_index": np.array([res_of[host] for _, _, host, _ in groups], np.int32),
        "name": [f"fleet step {step}" if lvl == "fleet" else f"node {host}" for lvl, step, host, _ in groups],
        "start_ns": start,
        "end_ns": end,
        "plasmient.level": [g[0] for g in groups],
        "plasmient.job.id": [job] * n,
        "plasmient.step": np.array([g[1] for g in groups], np.int64),
        "plasmient.device.type": ["cpu" if c else "gpu" for c in all_cpu],
        "plasmient.gpus": gpus,
        "plasmient.wall_s": met.wall_s,
        "plasmient.flops": _nan_to_null(sums.flops),
        "plasmient.ideal_s": _nan_to_null(met.ideal_s),
        "plasmient.busy_s": _nan_to_null(sums.busy_s),
        "plasmient.util.resident": _nan_to_null(met.util),
        "plasmient.mfu": _nan_to_null(met.mfu),
        "plasmient.stall_fraction": _nan_to_null(np.where(unmeasured, np.nan, met.stall)),
        "plasmient.idle_fraction": _nan_to_null(met.idle),
        "plasmient.bytes": _nan_to_null(sums.bytes),
        "plasmient.arithmetic_intensity": _nan_to_null(np.where(unmeasured, np.nan, met.intensity)),
        "plasmient.bound": pa.array(np.where(unmeasured, None, bound).tolist(), pa.string()),
        "plasmient.cost.usd": _nan_to_null(met.cost),
        "plasmient.cost.wasted_usd": _nan_to_null(np.where(unmeasured, np.nan, met.wasted_usd)),
        "plasmient.wasted_s": _nan_to_null(np.where(unmeasured, np.nan, met.wasted_s)),
        "plasmient.kernels": pa.array(sums.kernels, mask=~kernels_known),
    }
    for key, values in culprit.items():
        name = f"plasmient.culprit.{key}"
        cols[name] = pa.array(values, cv.ATTRIBUTE_BY_NAME[name].type)
    return cv.SpanBatch(table=cv.span_table_from_columns(cols, n), resources=resources)
