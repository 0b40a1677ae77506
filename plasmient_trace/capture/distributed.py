"""Live multi-rank traces: ranks exchange per-step summaries so one fleet span and one node span per host
are emitted for each step, instead of every rank emitting its own partial copies.

Each rank stitches only its own records, without fleet and node spans (``IngestOptions.top_spans``): those
would hold its numbers alone. Here (on the capture's background thread, after the stitch) this rank's
:class:`~plasmient_trace.stitch.fleet.RankSummary` of each step is published as JSON to the default
process group's c10d store (``plasmient/{job}/{step}/{rank}``), and:

* global rank 0 waits, bounded by PLASMIENT_FLEET_WAIT_S (default 10 s), for all world_size summaries of
  the step and emits the fleet span;
* the lowest rank of each host (LOCAL_RANK 0 under torchrun; by host.name, so a simulated second node
  through OTEL_RESOURCE_ATTRIBUTES works too) emits that host's node span from its host's summaries.

Each host stamps its summaries with its own wall clock; rank 0 puts every host on the clock of rank 0's
host by their collectives' ends (``stitch.align.align_summaries``, the offline alignment's vote) before
the fleet span names stragglers, so NTP error between hosts is not read as one rank waiting for another.

The store is a key-value service (TCPStore) reached over its own socket: it works the same under gloo
and NCCL and needs no collective, so nothing is put on the training stream and the training thread never
waits. The store handle is taken on the training thread at a step end (a dict lookup) because a script may
destroy the process group before the last batch is processed.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from ..conventions import SpanBatch
from .config import say_once

if TYPE_CHECKING:
    from ..stitch.tree import StitchOptions

DEFAULT_WAIT_S = 10.0
_POLL_S = 0.02
_PREFIX = "plasmient"


@dataclass
class Group:
    """This process's place in the job and the store the ranks exchange summaries through."""

    store: Any
    rank: int
    world_size: int
    backend: str | None
    hosts: dict[int, str] = field(default_factory=dict)   # rank -> host, as published
    published_host: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


_group: Group | None = None
_checked_off = False  # torch.distributed unavailable: stop looking


def remember() -> None:
    """Take the default group's store once torch.distributed is initialised (training thread, cheap)."""
    global _group, _checked_off
    if _group is not None or _checked_off:
        return
    try:
        _remember()
    except Exception:
        _checked_off = True  # tracing must never break the step; this process stays single-rank


def _remember() -> None:
    global _group, _checked_off
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
    except Exception:
        _checked_off = True
        return
    if not dist.is_available():
        _checked_off = True
        return
    if not dist.is_initialized():
        return
    world = dist.get_world_size()
    if world <= 1:
        _checked_off = True
        return
    try:
        backend = str(dist.get_backend())
    except Exception:
        backend = None
    _group = Group(store=c10d._get_default_store(), rank=dist.get_rank(), world_size=world, backend=backend)


def world_size() -> int:
    """Ranks of the job when a multi-rank process group was found (0 otherwise)."""
    return _group.world_size if _group is not None else 0


def active() -> bool:
    return _group is not None


def wait_s(environ: Any = os.environ) -> float:
    raw = environ.get("PLASMIENT_FLEET_WAIT_S", "").strip()
    if not raw:
        return DEFAULT_WAIT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if 0 <= value < float("inf"):  # NaN fails too: never wait forever
        return value
    say_once("bad-PLASMIENT_FLEET_WAIT_S", f"ignoring PLASMIENT_FLEET_WAIT_S={raw!r}: not a number of seconds in [0, inf)")
    return DEFAULT_WAIT_S


def job_id_key(attempt: str) -> str:
    """Where rank 0 publishes the job id for ranks whose environment named none. A new run has a store of
    its own, but torchrun's restarted workers share their agent's store with the attempts before them:
    the key names the attempt (TORCHELASTIC_RESTART_COUNT), so no rank reads a job id an earlier attempt
    left there."""
    return f"{_PREFIX}/job_id/attempt{attempt}"


def shared_job_id(own: str, wait: float, group: Group | None = None, attempt: str = "0") -> str | None:
    """The job id of the run as rank 0 names it: rank 0 publishes ``own``, the other ranks wait for it at
    most ``wait`` seconds. None without a multi-rank group, or when it did not arrive (or the store failed)."""
    g = group or _group
    if g is None:
        return None
    key = job_id_key(attempt)
    try:
        if g.rank == 0:
            g.store.set(key, own)
            return own
        if _wait_keys(g.store, [key], time.monotonic() + wait):
            return bytes(g.store.get(key)).decode("utf-8", "replace")
    except Exception:
        pass  # a store that went away: this rank keeps its own id (the caller says so)
    return None


# Culprit rows a live rank's step summary carries through the c10d store: rank 0 reads every rank's summaries
# of a batch, and a step's whole list (up to stitch.inputs.CULPRIT_CARRY, ~600 bytes a row) from 64 ranks is
# megabytes a step. Past it the summary says the most a row it leaves out may hold, so a fleet row summed
# from it is marked a lower bound where that cut may have shortened it.
PUBLISHED_CULPRITS = 32


def _published(summary: Any) -> Any:
    """The summary as rank 0 gets it: its culprit rows cut to PUBLISHED_CULPRITS, the cut said."""
    from ..stitch.culprits import cut_culprits

    if len(summary.culprits) <= PUBLISHED_CULPRITS:
        return summary
    rows, left = cut_culprits(summary.culprits, float(summary.culprits_left_out_s), PUBLISHED_CULPRITS)
    return replace(summary, culprits=rows, culprits_left_out_s=left)


def _key(job: str, *parts: Any) -> str:
    return "/".join([_PREFIX, job, *map(str, parts)])


def _wait_keys(store: Any, keys: list[str], deadline: float) -> list[str]:
    """Poll until every key exists or the deadline passes; the keys that exist."""
    pending = list(keys)
    while pending:
        pending = [k for k in pending if not store.check([k])]
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(_POLL_S)
    missing = set(pending)
    return [k for k in keys if k not in missing]


def _append(batch: SpanBatch, top: SpanBatch) -> SpanBatch:
    if top.table.num_rows == 0:
        return batch
    offset = len(batch.resources)
    idx = top.table.schema.get_field_index("resource_index")
    shifted = pc.add(top.table.column("resource_index"), pa.scalar(offset, pa.int32())).cast(pa.int32())
    table = top.table.set_column(idx, top.table.schema.field(idx), shifted)
    # Top rows first: the fleet span is the root of each trace.
    return SpanBatch(table=pa.concat_tables([table, batch.table]), resources=list(batch.resources) + list(top.resources))


def coordinate(batch: SpanBatch, job_id: str, options: "StitchOptions", say: Any = None,
               environ: Any = os.environ, group: "Group | None" = None) -> SpanBatch:
    """This rank's stitched batch -> the batch to export: its own rank subtree, plus the fleet span
    (global rank 0) and its host's node span (lowest rank of the host) built from every rank's summary.
    A no-op outside a multi-rank torch.distributed job. ``group`` defaults to the one :func:`remember`
    found (tests pass their own, over any c10d Store)."""
    group = group or _group
    if group is None:
        return batch
    with group.lock:
        return _coordinate(group, batch, job_id, options, say, wait_s(environ))


def _coordinate(group: Group, batch: SpanBatch, job_id: str, options: "StitchOptions", say: Any, wait: float) -> SpanBatch:
    from ..stitch import fleet  # the stitcher is loaded by the worker anyway; keep `import torch` light
    from ..stitch.align import align_summaries

    store = group.store
    # the stitcher's own per-step reductions of this rank (they carry the step's collectives, for stragglers)
    mine = list(batch.summaries)
    own = batch  # this rank's subtree: stitched without fleet and node spans (IngestOptions.top_spans)
    if not mine:
        return own
    host = mine[0].host
    try:
        if not group.published_host:
            store.set(_key(job_id, "host", group.rank), host)
            group.published_host = True
        for s in mine:
            store.set(_key(job_id, s.step, s.rank), json.dumps(_published(s).to_json()))
    except Exception as err:
        if say:
            say("fleet-publish", f"could not publish step summaries to the c10d store ({type(err).__name__}: {err}); "
                                 "this rank's spans are exported without the fleet/node spans")
        return own

    deadline = time.monotonic() + wait
    group.hosts[group.rank] = host
    # Leader of a host = its lowest rank: decided from the hosts of the ranks below this one. Until
    # they are all known, stay quiet: a missing node span is better than two with the same id.
    unknown = [r for r in range(group.rank) if r not in group.hosts]
    for k in _wait_keys(store, [_key(job_id, "host", r) for r in unknown], deadline):
        group.hosts[int(k.rsplit("/", 1)[1])] = store.get(k).decode()
    is_root = group.rank == 0
    still_unknown = [r for r in range(group.rank) if r not in group.hosts]
    is_leader = not still_unknown and not any(group.hosts[r] == host for r in range(group.rank))
    if still_unknown and say:
        say("fleet-hosts", f"the hosts of rank(s) {still_unknown} were not published within {wait:g} s: "
                           f"rank {group.rank} emits no node span for {host!r} until they are")
    if not (is_leader or is_root):
        return own

    if not is_root:
        # the ranks above this one that share its host (once: hosts do not change)
        upper = [r for r in range(group.rank + 1, group.world_size) if r not in group.hosts]
        for k in _wait_keys(store, [_key(job_id, "host", r) for r in upper], deadline):
            group.hosts[int(k.rsplit("/", 1)[1])] = store.get(k).decode()
    # rank 0 reads every summary; a node leader those of its host (and of ranks whose host it does not know)
    wanted = [r for r in range(group.world_size) if is_root or group.hosts.get(r, host) == host]
    gathered: list[fleet.RankSummary] = []
    missing_by_step: dict[int, int] = {}
    for step in sorted({s.step for s in mine}):
        keys = [_key(job_id, step, r) for r in wanted]
        present = _wait_keys(store, keys, deadline)
        missing_by_step[step] = len(keys) - len(present)
        for k in present:
            summary = fleet.RankSummary.from_json(json.loads(store.get(k)))
            if is_root or summary.host == host:
                gathered.append(summary)
                _release(store, k, readers=1 if summary.host == host and is_root else 2)
    missing_total = sum(missing_by_step.values())
    if missing_total and say:
        say("fleet-missing", f"{missing_total} rank summary(ies) had not arrived after {wait:g} s "
                             "(PLASMIENT_FLEET_WAIT_S): fleet/node spans were built from the ranks that did")
    if is_root:
        # Hosts keep their own wall clocks: put them on one before the fleet span compares collectives.
        gathered, clocks = align_summaries(gathered)
        unaligned = sorted(h for h, how in clocks.items() if how == "none")
        if unaligned and say:
            say("fleet-clocks", f"the clocks of host(s) {unaligned} could not be aligned on shared collectives: "
                                "their ranks are left out of the fleet's straggler and skew numbers")
    top = fleet.top_spans(gathered, options, local_hosts={host} if is_leader else set(), include_fleet=is_root,
                          ranks_missing=missing_by_step)
    return _append(own, top)


def _release(store: Any, key: str, readers: int) -> None:
    """Delete a summary once everyone who reads it has (rank 0 and its host's leader: one reader when
    they are the same process), so the store does not grow with the length of the job."""
    try:
        if store.add(key + "/reads", 1) >= readers:
            store.delete_key(key)
            store.delete_key(key + "/reads")
    except Exception:
        pass  # a store without delete_key keeps the (small) key
