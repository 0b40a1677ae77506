"""Fleet and node spans: the one builder, from per-rank step summaries, for ingest and live alike.

Each rank's stitch ends with one :class:`RankSummary` per step (the sums of its rank span, its device
window and its culprit rows). Offline, the summaries of all ranks are at hand; live, ranks exchange them
through the c10d store. Either way :func:`top_spans` builds the fleet span and one node span per host from
them, so the two paths produce the same spans by construction.

A node's (fleet's) window is the extent of its ranks' windows, its MFU and util over all their GPUs.
Additive quantities are the ranks' sums; the device-seconds of a rank inside the node's window but outside
every one of its step windows (before its first recorded step, after its last) are the node's own waste
(``wasted_s.self``), and those outside its node's window but inside the fleet's are the fleet's own, so
totals and .self values add up and no device-second is charged twice: time outside a step's own window
but inside the rank's neighbouring step's is that step's. Culprit rows are the ranks' rows summed by
(kernel, op, module): each rank's step hands on its rows uncut by the display (up to ``CULPRIT_CARRY``),
so a row is the whole of every rank's time, not only of the ranks that had it in their top ten; the span
shows the first ``NODE_CULPRIT_ROWS``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from operator import attrgetter
from typing import Any, Iterable, Mapping

import numpy as np
import pyarrow as pa

from .. import conventions as cv
from ..metrics import compute as mc
from . import ids
from .culprits import culprit_columns, merge_culprits
from .inputs import CULPRIT_CARRY, NODE_CULPRIT_ROWS, StitchOptions
from .step_facts import top_columns
from .summary_groups import SummaryGroups

_FLOATS = ("flops", "ideal_s", "recompute_flops", "recompute_ideal_s", "comm_total_s", "comm_exposed_s",
           "copy_total_s", "copy_exposed_s", "idle_device_s", "queue_mean", "queue_max", "busy_s", "union_s", "known_s", "bytes_known_s", "bytes", "kernel_s", "comm_s", "copy_s", "wasted_s",
           "charged_s", "idle_s", "price_per_hour", "bandwidth", "comm_bytes", "comm_busbw", "link_peak",
           "culprits_left_out_s")


@dataclass
class RankSummary:
    """One rank's contribution to a step's fleet and node spans (the sums of its rank span)."""

    job_id: str
    step: int
    rank: int
    host: str
    start_ns: int                # displayed interval of the rank span
    end_ns: int
    window_start_ns: int         # device window of the rank's step
    window_end_ns: int
    gpus: int
    flops: float
    ideal_s: float               # NaN: peak unknown
    busy_s: float
    union_s: float
    known_s: float
    bytes: float
    kernels: int
    kernel_s: float
    comm_s: float
    copy_s: float
    wasted_s: float
    charged_s: float
    idle_s: float
    price_per_hour: float        # USD per device-hour; NaN unknown
    bandwidth: float             # bytes/s of its device's memory; NaN unknown
    device_type: str = "gpu"
    recompute_flops: float = 0.0      # activation-checkpointing recompute: hardware FLOPs, not model FLOPs
    recompute_ideal_s: float = 0.0
    comm_total_s: float = 0.0         # union of collective time (comm_s above is the summed durations)
    comm_exposed_s: float = 0.0
    copy_total_s: float = 0.0
    copy_exposed_s: float = 0.0
    idle_device_s: float = 0.0        # idle with a kernel queued; idle_s - this is the host's share
    queue_mean: float = float("nan")  # launch queue over the window (NaN: no launch records)
    queue_max: float = float("nan")
    # the step's culprit rows, most waste first, up to CULPRIT_CARRY (not the step span's display cut), and the
    # most waste a row left out of them may hold: 0.0 none, NaN unknown (rows not ranked: a step-depth step)
    culprits: list[dict[str, Any]] = field(default_factory=list)
    culprits_left_out_s: float = float("nan")
    service_name: str | None = None
    # collective kernels of the step in time order: [name, start_ns, end_ns] (straggler analysis)
    collectives: list[list[Any]] = field(default_factory=list)
    # NCCL message sizes of the step (stitch.collectives): NaN where no collective carried one
    comm_bytes: float = float("nan")
    bytes_known_s: float = float("nan")  # busy seconds of kernels whose bytes are known (NaN: not sent)
    comm_rated_bytes: float = 0.0     # bytes of the collectives whose busbw is known (the weights of comm_busbw)
    comm_busbw: float = float("nan")  # bytes/s, bytes-weighted mean over the step's collectives
    link_peak: float = float("nan")   # bytes/s per direction of the rank's GPU fabric
    # live sampling (stitch.step_facts): where the FLOPs come from, the depth, whether device time was recorded
    flops_source: str = "measured"    # measured | carried | unknown
    full_depth: bool = True
    device_measured: bool = True
    flops_coverage: float | None = None  # a carried step's coverage (its busy time may be unknown)
    # what the span budget folded under the rank span (plasmient.kernels.folded*, spans.folded)
    kernels_folded: int = 0
    kernels_folded_s: float = 0.0
    kernels_folded_flops: float = 0.0  # NaN: some folded kernels' FLOPs unknown and none known
    spans_folded: int = 0
    # The stretch of the rank's device timeline its steps tile (stitch.windows), the whole input's offline;
    # None where it goes on past this batch (live): a node or fleet window reaching beyond a rank's own
    # step window lies in the rank's neighbouring steps there, whose own spans already charge it.
    tiled_start_ns: int | None = None
    tiled_end_ns: int | None = None

    def to_json(self) -> dict[str, Any]:
        # NaN is not JSON: None stands for it on the wire.
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> "RankSummary":
        return cls(**{k: (float("nan") if v is None and k in _FLOATS else v) for k, v in doc.items()})



def top_spans(summaries: Iterable[RankSummary], options: StitchOptions, local_hosts: Iterable[str] | None = None,
              include_fleet: bool = True, ranks_missing: Mapping[int, int] | None = None) -> cv.SpanBatch:
    """Fleet span (when include_fleet) and node spans (every host, or only local_hosts) of each step
    in the summaries, with the ids, metrics and resources the stitcher gives them. ``ranks_missing``: per
    step, the ranks whose summary did not arrive (live multi-rank), absent where not given."""
    by_step: dict[int, list[RankSummary]] = {}
    for s in summaries:
        by_step.setdefault(int(s.step), []).append(s)
    wanted_hosts = None if local_hosts is None else set(local_hosts)
    job = options.job_id
    groups: list[tuple[str, int, str | None, list[RankSummary]]] = []
    for step in sorted(by_step):
        members = sorted(by_step[step], key=lambda s: s.rank)
        if include_fleet:
            groups.append(("fleet", step, None, members))
        on_host: dict[str, list[RankSummary]] = {}
        for s in members:  # in rank order, as the members of each node group stay
            on_host.setdefault(s.host, []).append(s)
        for host in sorted(on_host):
            if wanted_hosts is None or host in wanted_hosts:
                groups.append(("node", step, host, on_host[host]))
    n = len(groups)
    if n == 0:
        return cv.SpanBatch(table=cv.empty_span_table(), resources=[])
    g = SummaryGroups(groups)
    total = g.total

    w_start, w_end = g.min("window_start_ns"), g.max("window_end_ns")
    window_s = np.maximum(w_end - w_start, 0) / 1e9
    gpus = total(g.values("gpus", np.int64)).astype(np.int64)
    device_s = window_s * gpus
    # What each rank's devices spent inside the group's window but outside every one of its step windows
    # (before its first step, after its last): the group's own waste. Time outside the step's own window but
    # inside the rank's next or previous step window is already charged there (counting it here charged
    # the shared a100 job's two steps 0.77 GPU-ms twice, more device time than the recording holds).
    gpus_of = g.values("gpus")
    tiled = _tiled_stretches(g)
    outside = _untiled_s(tiled, g.per_pair(w_start), g.per_pair(w_end)) * gpus_of
    price = g.values("price_per_hour")
    skew = total(outside)
    skew_usd = total(outside * price / 3600)
    # Whose waste it is: a node's own is its ranks' untiled time in its window; the fleet's own is only the
    # part outside their nodes' windows (the rest is in the node spans below it, and counting it twice broke
    # the sum of the .self values over a trace).
    node_start, node_end = _node_windows(g)
    beyond_node = np.where(g.per_pair(np.array([lvl == "fleet" for lvl, *_ in groups])),
                           outside - _untiled_s(tiled, node_start, node_end) * gpus_of, outside)
    beyond_node = np.where(beyond_node > 0.0, beyond_node, 0.0)
    own_skew, own_skew_usd = total(beyond_node), total(beyond_node * price / 3600)
    busy, known, ideal = total("busy_s"), total("known_s"), total("ideal_s")
    wasted = total("wasted_s") + skew
    cost = total(g.values("charged_s") * price / 3600) + skew_usd
    wasted_usd = total(g.values("wasted_s") * price / 3600) + skew_usd
    with np.errstate(divide="ignore", invalid="ignore"):
        util = np.where(device_s > 0, np.minimum(total("union_s") / device_s, 1.0), 0.0)
        coverage = np.where(busy > 0, np.clip(known / busy, 0, 1), np.nan)
        executed = total("flops") + total("recompute_flops")  # the roofline is about executed work
        measured = mc.flops_measured(executed, coverage)
        mfu = np.where(measured & (device_s > 0), np.minimum(ideal / device_s, util), np.nan)
        hfu = np.where(measured & (device_s > 0), np.minimum((ideal + total("recompute_ideal_s")) / device_s, util), np.nan)
        stall = np.where(measured & (busy > 0), np.clip(1 - ideal / busy, 0, 1), np.nan)
        intensity = np.where((total("bytes") > 0) & measured, executed / total("bytes"), np.nan)
        # each rank's bytes at its own device's bandwidth: unknown where a rank moved bytes at an unknown one
        moved = g.values("bytes")
        memory_s = total(np.where(moved > 0, moved / g.values("bandwidth"), 0.0))
    kernels = total("kernels")
    bound = mc.bound_codes(has_device=np.ones(n, bool), is_kernel=np.zeros(n, bool), util=util, kernels=kernels,
                           kernel_s=total("kernel_s"), comm_s=total("comm_s"), copy_s=total("copy_s"),
                           ideal_s=ideal + total("recompute_ideal_s"), memory_s=memory_s,
                           coverage=np.nan_to_num(coverage))

    service = options.service_name or next((s.service_name for g in groups for s in g[3] if s.service_name), None) \
        or "plasmient-trace"
    resources: list[dict[str, Any]] = []
    res_of: dict[str | None, int] = {}
    for _, _, host, _ in groups:
        if host not in res_of:
            res_of[host] = len(resources)
            res = {"service.name": service, "plasmient.job.id": job}
            if host is not None:
                res["host.name"] = host
            resources.append({**res, **options.extra_resource})

    span_id = np.array([ids.fleet_span_id(job, step) if lvl == "fleet" else ids.node_span_id(job, step, host)
                        for lvl, step, host, _ in groups], np.uint64)
    parent = np.array([0 if lvl == "fleet" else ids.fleet_span_id(job, step) for lvl, step, _, _ in groups], np.uint64)
    all_cpu = g.all(g.values("device_type", object) == "cpu").tolist()
    start, end = g.min("start_ns"), g.max("end_ns")
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
        "plasmient.wall_s": (end - start) / 1e9,
        "plasmient.device.window_s": window_s,
        "plasmient.device.start_ns": w_start,
        "plasmient.flops": total("flops"),
        "plasmient.flops.self": np.zeros(n),
        "plasmient.flops.coverage": coverage,
        "plasmient.ideal_s": ideal,
        "plasmient.busy_s": busy,
        "plasmient.busy_s.self": np.zeros(n),
        "plasmient.idle_s": total("idle_s"),
        "plasmient.util.resident": util,
        "plasmient.mfu": mfu,
        "plasmient.hfu": hfu,
        "plasmient.flops.recompute": cv.nan_to_null(np.where(total("recompute_flops") > 0, total("recompute_flops"), np.nan)),
        "plasmient.stall_fraction": stall,
        "plasmient.idle_fraction": 1.0 - util,
        "plasmient.bytes": total("bytes"),
        "plasmient.bytes.self": np.zeros(n),
        "plasmient.arithmetic_intensity": intensity,
        "plasmient.cost.usd": cv.nan_to_null(cost),
        "plasmient.cost.usd.self": cv.nan_to_null(own_skew_usd),
        "plasmient.cost.wasted_usd": wasted_usd,
        "plasmient.cost.wasted_usd.self": own_skew_usd,
        "plasmient.wasted_s": wasted,
        "plasmient.wasted_s.self": own_skew,
        "plasmient.kernels": kernels.astype(np.int64),
        "plasmient.kernel_s": total("kernel_s"),
        **_overlap_columns(g),
        **straggler_columns(groups),
        **bandwidth_columns(g),
    }
    # A rank whose step was not measured (a live step-level step: flops NaN) leaves the group's FLOP-derived
    # numbers, bound, waste and culprits absent: a partial sum would read as a measurement.
    # These float columns are still numpy here: NaN (unknown) becomes null once, with the blanking.
    unmeasured = np.isnan(total("flops"))
    # A known total of 0 beside busy time of unknown work is unknown (as on the ranks' spans); a group with a
    # member sampled at step depth has its FLOPs from step_facts.top_columns.
    deep = ~g.any(~g.values("full_depth", bool))
    flops_unknown = deep & mc.zero_says_nothing(total("flops"), busy, known)
    for name in ("plasmient.flops", "plasmient.ideal_s"):
        cols[name] = np.where(flops_unknown, np.nan, cols[name])
    bytes_unknown = deep & mc.zero_says_nothing(total("bytes"), busy, total("bytes_known_s"))
    cols["plasmient.bytes"] = cv.nan_to_null(np.where(bytes_unknown, np.nan, cols["plasmient.bytes"]))
    for name in ("plasmient.flops", "plasmient.ideal_s", "plasmient.mfu", "plasmient.hfu", "plasmient.stall_fraction", "plasmient.flops.coverage",
                 "plasmient.arithmetic_intensity", "plasmient.wasted_s", "plasmient.wasted_s.self",
                 "plasmient.cost.wasted_usd", "plasmient.cost.wasted_usd.self"):
        cols[name] = cv.nan_to_null(np.where(unmeasured, np.nan, np.asarray(cols[name], np.float64)))
    cols["plasmient.bound"] = pa.array([None if u or b < 0 else cv.BOUNDS[b] for u, b in zip(unmeasured.tolist(), bound.tolist())],
                                       pa.string())
    # A fleet group and the node group of a one-host job have the same members: their rows are merged once.
    merged: dict[tuple[int, ...], tuple[list[dict[str, Any]], float]] = {}
    lists: dict[int, list[dict[str, Any]]] = {}
    left_out: dict[int, float] = {}
    for i, ((_, _, _, members), u) in enumerate(zip(groups, unmeasured.tolist())):
        if u:
            continue
        key = tuple(map(id, members))
        done = merged.get(key)
        if done is None:
            done = merged[key] = merge_culprits([(s.rank, s.culprits, s.culprits_left_out_s) for s in members], CULPRIT_CARRY)
        if done[0]:
            lists[i], left_out[i] = done
    # node and fleet spans carry more merged rows than a step shows, so the report can sum steps (NODE_CULPRIT_ROWS)
    cols.update(culprit_columns(n, lists, left_out, NODE_CULPRIT_ROWS))
    cols.update(_folded_columns(g))
    top_columns(cols, g)
    if ranks_missing is not None:
        cols["plasmient.fleet.ranks_missing"] = pa.array([ranks_missing.get(step, 0) for _, step, _, _ in groups], pa.int64())
    return cv.SpanBatch(table=cv.span_table_from_columns(cols, n), resources=resources)


def _folded_columns(g: SummaryGroups) -> dict[str, Any]:
    """What the span budget folded under the ranks of a node or the fleet, summed as the rank spans carry it:
    the FLOPs unknown where the known ones add to 0 and some rank's were unknown."""
    flops = g.values("kernels_folded_flops")
    known = g.total(np.nan_to_num(flops, nan=0.0))
    unknown = g.any(np.isnan(flops))
    return {
        "plasmient.kernels.folded": g.total("kernels_folded").astype(np.int64),
        "plasmient.kernels.folded_s": g.total("kernels_folded_s"),
        "plasmient.kernels.folded_flops": cv.nan_to_null(np.where((known == 0) & unknown, np.nan, known)),
        "plasmient.spans.folded": g.total("spans_folded").astype(np.int64),
    }


def _node_windows(g: SummaryGroups) -> tuple[np.ndarray, np.ndarray]:
    """Per (group, member) pair: the window (start, end ns) of the member's node within the group (the extent
    of the windows of the group's members on its host)."""
    _, host = np.unique(g.values("host", object).astype(str), return_inverse=True)
    _, node = np.unique(g.group * (int(host.max(initial=0)) + 1) + host, return_inverse=True)
    start = np.full(node.max(initial=-1) + 1, np.iinfo(np.int64).max)
    end = np.full(len(start), np.iinfo(np.int64).min)
    np.minimum.at(start, node, g.values("window_start_ns", np.int64))
    np.maximum.at(end, node, g.values("window_end_ns", np.int64))
    return start[node], end[node]


def _tiled_stretches(g: SummaryGroups) -> tuple[np.ndarray, np.ndarray]:
    """Per pair: the (start, end ns) of the member's tiled stretch (RankSummary.tiled_*: open where None),
    which holds the step's own window (a summary whose numbers disagree is read as that window)."""
    lo, hi = np.iinfo(np.int64).min, np.iinfo(np.int64).max
    tiled_start = np.array([lo if v is None else v for v in map(attrgetter("tiled_start_ns"), g.members)], np.int64)
    tiled_end = np.array([hi if v is None else v for v in map(attrgetter("tiled_end_ns"), g.members)], np.int64)
    return (np.minimum(tiled_start, g.values("window_start_ns", np.int64)),
            np.maximum(tiled_end, g.values("window_end_ns", np.int64)))


def _untiled_s(tiled: tuple[np.ndarray, np.ndarray], start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Per pair: the seconds of [start, end] outside the member's tiled stretch (:func:`_tiled_stretches`). Its
    own step window lies inside that stretch, so this is never more than the window minus the step's own."""
    # clipped into [start, end] first: an open stretch (live) is int64's extremes, and end - INT64_MIN wraps
    before = np.clip(tiled[0], start, end) - start
    after = end - np.clip(tiled[1], start, end)
    return (before + after) / 1e9


def bandwidth_columns(g: SummaryGroups) -> dict[str, Any]:
    """Collective message bytes and bus bandwidth of a node or the fleet from its ranks' steps: bytes add up,
    bus bandwidth is weighted by the bytes it was measured on (as on a step), and the fraction of the link
    peak is given only when every rank with sized collectives has the same known peak."""
    comm_bytes, busbw, rated = g.values("comm_bytes"), g.values("comm_busbw"), g.values("comm_rated_bytes")
    sized = np.isfinite(comm_bytes)
    timed = sized & np.isfinite(busbw) & (rated > 0)
    any_sized = g.any(sized)
    total = np.where(any_sized, g.total(comm_bytes, sized), np.nan)
    rated_sum, weighted = g.total(rated, timed), g.total(busbw * rated, timed)
    link = g.values("link_peak")
    lowest, highest = np.full(g.n, np.inf), np.full(g.n, -np.inf)
    with np.errstate(invalid="ignore"):  # an unknown (NaN) peak rules the group's out below
        np.minimum.at(lowest, g.group[sized], link[sized])
        np.maximum.at(highest, g.group[sized], link[sized])
    one_peak = any_sized & g.all(~sized | np.isfinite(link)) & (lowest == highest)
    peak = np.where(one_peak, lowest, np.nan)
    with np.errstate(divide="ignore", invalid="ignore"):
        bw = np.where(rated_sum > 0, weighted / rated_sum, np.nan)
    return {
        "plasmient.comm.bytes": cv.nan_to_null(total),
        "plasmient.comm.busbw_gbs": cv.nan_to_null(bw / 1e9),
        "plasmient.comm.busbw_fraction": cv.nan_to_null(bw / peak),
        "plasmient.comm.link_peak_gbs": cv.nan_to_null(np.where(np.isfinite(total), peak / 1e9, np.nan)),
    }


def _overlap_columns(g: SummaryGroups) -> dict[str, Any]:
    """Communication/copy overlap, idle split and launch queue of a node or the fleet, from its ranks."""
    total = g.total
    with np.errstate(divide="ignore", invalid="ignore"):
        comm, copy = total("comm_total_s"), total("copy_total_s")
        out = {
            "plasmient.comm.total_s": comm, "plasmient.comm.exposed_s": total("comm_exposed_s"),
            "plasmient.comm.overlap": cv.nan_to_null(np.where(comm > 0, 1 - total("comm_exposed_s") / comm, np.nan)),
            "plasmient.memcpy.total_s": copy, "plasmient.memcpy.exposed_s": total("copy_exposed_s"),
            "plasmient.memcpy.overlap": cv.nan_to_null(np.where(copy > 0, 1 - total("copy_exposed_s") / copy, np.nan)),
            # a member whose split is unknown (NaN) leaves the group's unknown: null, not a partial sum
            "plasmient.idle.device_s": cv.nan_to_null(total("idle_device_s")),
            "plasmient.idle.host_s": cv.nan_to_null(total("idle_s") - total("idle_device_s")),
        }
    # the queue: the deepest any rank's got, and the ranks' means weighted by their device-seconds
    qmax = np.fmax.reduceat(g.values("queue_max"), g.first)
    out["plasmient.launch_queue.max"] = pa.array(np.nan_to_num(qmax).astype(np.int64), mask=np.isnan(qmax))
    qmean = g.values("queue_mean")
    queued = np.isfinite(qmean)
    device_ns = ((g.values("window_end_ns", np.int64) - g.values("window_start_ns", np.int64)) * g.values("gpus", np.int64)).astype(np.float64)
    weight = g.total(device_ns, queued)
    with np.errstate(divide="ignore", invalid="ignore"):
        mean = np.where(weight > 0, g.total(qmean * device_ns, queued) / weight, np.nan)
    out["plasmient.launch_queue.mean"] = cv.nan_to_null(mean)
    return out


# One collective seen on several ranks ends at about the same instant on each (ring all-reduce and
# send/recv kernels of the shared a100 job end 0-332 µs apart; kernels of other collectives, 14 ms or more).
END_MATCH_NS = 1_000_000


def straggler_columns(groups: list) -> dict[str, Any]:
    """Who made the others wait at the collectives of a node or the fleet.

    A collective's kernel starts when its rank arrives and cannot finish before the last rank does, and all
    ranks leave it together: kernels of one name on several ranks whose ends lie within END_MATCH_NS of each
    other, and that all started before any of them ended, are one collective (:func:`_collective_instances`).
    The skew is the spread of their starts, the last to arrive is the straggler, and every other rank waited
    (last start - its start) for it. A kernel with no such partner (a send/recv with a rank outside the
    group, a step one rank did not record) is no evidence and is left out. Pairing the k-th kernel of a
    name on each rank instead paired different collectives of one job's send/recv ring (one kernel name for
    all of them): a rank "waited" 0.31 s in a step where its collectives took 0.20 s. Offline, clocks are
    aligned on the collectives first.
    """
    n = len(groups)
    count = np.zeros(n, np.int64)
    skew_max = np.full(n, np.nan)
    skew_mean = np.full(n, np.nan)
    straggler = np.full(n, -1, np.int64)
    cost = np.full(n, np.nan)
    for i, g in enumerate(groups):
        members = [s for s in g[3] if s.collectives]
        if len(members) < 2:
            continue
        skews, imposed = [], {}
        for arrivals in _collective_instances(members):
            starts = np.array([a[1] for a in arrivals], np.int64)
            last = int(np.argmax(starts))
            skews.append((starts.max() - starts.min()) / 1e9)
            rank = arrivals[last][0]
            imposed[rank] = imposed.get(rank, 0.0) + float((starts.max() - starts).sum()) / 1e9
        if skews:
            count[i] = len(skews)
            skew_max[i], skew_mean[i] = max(skews), float(np.mean(skews))
            straggler[i], cost[i] = max(imposed.items(), key=lambda kv: (kv[1], -kv[0]))
    return {
        "plasmient.collectives.matched": pa.array(count, mask=count == 0),
        "plasmient.collectives.skew_max_s": cv.nan_to_null(skew_max),
        "plasmient.collectives.skew_mean_s": cv.nan_to_null(skew_mean),
        "plasmient.straggler.rank": pa.array(np.maximum(straggler, 0), mask=straggler < 0),
        "plasmient.straggler.wait_s": cv.nan_to_null(cost),
    }


def _collective_instances(members: list[RankSummary]) -> list[list[tuple[int, int]]]:
    """The collectives seen on two or more of the members, each as [(rank, start_ns), ...].

    Per kernel name, every member's kernels sorted by end are cut where two ends are more than END_MATCH_NS
    apart. A cluster holding one kernel per rank is one collective; back-to-back small collectives (DDP's
    buckets) make a cluster with k kernels on every rank, read as k collectives in order; a cluster with
    unequal counts cannot be told apart and is left out."""
    by_name: dict[str, list[tuple[int, int, int]]] = {}
    for m in members:
        for name, start, end in m.collectives:
            by_name.setdefault(name, []).append((int(end), int(m.rank), int(start)))
    out: list[list[tuple[int, int]]] = []
    for kernels in by_name.values():
        kernels.sort()
        cluster = kernels[:1]
        for k in kernels[1:]:
            if k[0] - cluster[-1][0] > END_MATCH_NS:
                out.extend(_cluster_instances(cluster))
                cluster = []
            cluster.append(k)
        out.extend(_cluster_instances(cluster))
    return out


def _cluster_instances(cluster: list[tuple[int, int, int]]) -> list[list[tuple[int, int]]]:
    per_rank: dict[int, list[tuple[int, int]]] = {}
    for end, rank, start in cluster:  # sorted by end
        per_rank.setdefault(rank, []).append((start, end))
    counts = {len(v) for v in per_rank.values()}
    if len(per_rank) < 2 or len(counts) != 1:
        return []
    out = []
    for k in range(counts.pop()):
        kernels = [(rank, v[k][0], v[k][1]) for rank, v in per_rank.items()]
        # no rank leaves a collective before the last one arrives
        if max(start for _, start, _ in kernels) <= min(end for _, _, end in kernels):
            out.append([(rank, start) for rank, start, _ in kernels])
    return out


def ranks_missing(summaries: Iterable[RankSummary], ranks: int) -> dict[int, int]:
    """Per step, how many of the job's ``ranks`` have no summary of it (an input that did not record it)."""
    have: dict[int, set[int]] = {}
    for s in summaries:
        have.setdefault(int(s.step), set()).add(int(s.rank))
    return {step: ranks - len(got) for step, got in have.items()}


def missing_steps_warning(steps_of: list[set[int]], labels: list[str]) -> str | None:
    """A line naming the steps some inputs did not record (a rank cut short, one started late), or None. Their
    fleet and node spans are over the ranks that recorded them, which nothing else would say."""
    if len(steps_of) < 2:
        return None
    every = sorted(set().union(*steps_of))
    lacking = {step: [label for label, steps in zip(labels, steps_of) if step not in steps] for step in every}
    lacking = {step: who for step, who in lacking.items() if who}
    if not lacking:
        return None
    shown = "; ".join(f"step {step}: {', '.join(who[:3])}{f' and {len(who) - 3} more' if len(who) > 3 else ''}"
                      for step, who in list(lacking.items())[:3])
    more = f"; {len(lacking) - 3} more steps" if len(lacking) > 3 else ""
    return (f"{len(lacking)} of {len(every)} steps are missing from some inputs ({shown}{more}): their fleet and node "
            "spans are over the ranks that recorded them (plasmient.fleet.ranks_missing counts the others)")


def merge_span_batches(batches: list[cv.SpanBatch]) -> cv.SpanBatch:
    """Concatenate batches, re-basing each batch's resource indices onto the merged resource list, where
    equal resources (one rank's, from each chunk of its steps) are one entry."""
    tables, resources = [], []
    index: dict[str, int] = {}
    for b in batches:
        if b.table.num_rows == 0 and not b.resources:
            continue
        t = b.table
        merged = np.array([_index_of(resources, index, r) for r in b.resources] or [0], np.int32)
        idx = merged[t.column("resource_index").to_numpy().astype(np.int32)]
        i = t.schema.get_field_index("resource_index")
        tables.append(t.set_column(i, t.schema.field(i), pa.array(idx, pa.int32())))
    summaries = [x for b in batches for x in b.summaries]
    if not tables:
        return cv.SpanBatch(table=cv.empty_span_table(), resources=[], summaries=summaries)
    return cv.SpanBatch(table=pa.concat_tables(tables), resources=resources, summaries=summaries)


def _index_of(resources: list[dict[str, Any]], index: dict[str, int], resource: dict[str, Any]) -> int:
    """The resource's position in ``resources``, appended when new (``index``: by content, so a thousand
    ranks' resources are not compared pairwise)."""
    key = json.dumps(resource, sort_keys=True, default=str)
    if key not in index:
        index[key] = len(resources)
        resources.append(resource)
    return index[key]
