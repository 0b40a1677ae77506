"""Align the clocks of several ranks of one job on their collective kernels, before stitching.

Why: each rank's timestamps are on the wall clock of its own host. Hosts disagree by micro- to
milliseconds (NTP) or worse, so a fleet trace stitched from raw timestamps shows rank 1 waiting
in an all-reduce that rank 0 has already left. A collective (NCCL/RCCL kernel) cannot complete on
one rank before its peers reach it, and all participants leave it within a few microseconds of
each other, so the *end* times of matching collective kernels are the same instant seen through
different clocks. That is the anchor used here.

Method (``estimate_alignment``):

1. Collective ends per rank: kernels of kind ``collective``, end times mapped onto the process's
   CPU clock the same way :mod:`.joins` will map them (per device, the smallest shift such that no
   kernel starts before its launch), so the alignment holds in the trace that is finally built.
2. Offset of rank *b* against a reference rank *a*: every pair of same-name collectives whose end
   times lie within ``max_offset_ns`` of each other votes for the offset ``end_a - end_b``. The
   offset is the densest window of votes ``tolerance_ns`` wide (ties: the one nearest zero),
   refined to the median of the votes in it. Matching the k-th collective of each name is the
   special case where both ranks saw the same sequence; voting also survives captures that start
   or stop at different collectives, point-to-point send/recv (pipeline parallelism) where only
   some kernels have a partner, and periodic collectives (the true offset collects one vote per
   collective, a shift by one period one vote fewer). Cost per pair: at most 256 anchor
   collectives of *b* vote, at most 2·10^6 votes (the search window shrinks when collectives are
   denser), a histogram pass then a sort of the few votes near the peak; 128 ranks x 5,000
   collectives align in about 8 s on one core.
3. Rank 0 of the inputs (index 0) is the reference. Every other input is first aligned against it;
   an input with fewer than ``min_matches`` votes in its best window (e.g. a pipeline stage that
   never talks to stage 0) is aligned against whichever already aligned input it shares most
   collectives with, and offsets chain. An input that still cannot be aligned inherits the offset
   of an aligned input on the same ``host.name`` (one host, one wall clock), else keeps 0; the
   report says which method gave each offset.

``offset[i]`` is the number of nanoseconds to *add* to every timestamp of input *i* to put it on
the reference's clock; ``apply_offsets`` does that for every ``*_ns`` column of every record table.
Accuracy is bounded by the timestamp resolution (Kineto files: 1 µs) and by how tightly the
collectives complete together (ring all-reduce: a few µs; send/recv pairs: the same instant).
``collective_skew`` measures the result: the median distance from each collective end to the
nearest same-name collective end of the reference. Collectives without a partner on the reference
(send/recv to other ranks) keep a large distance whatever the offset, so the skew falls to a floor
set by them, not to zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..metrics.grouping import unique_inverse
from ..records import TABLE_SCHEMAS, RecordSet

__all__ = [
    "DEFAULT_TOLERANCE_NS",
    "DEFAULT_MAX_OFFSET_NS",
    "AlignmentReport",
    "align_ranks",
    "align_summaries",
    "alignment_from_ends",
    "alignment_lines",
    "apply_offsets",
    "collective_ends",
    "collective_skew",
    "estimate_alignment",
    "pair_offset",
]

DEFAULT_TOLERANCE_NS = 100_000       # collectives of one sequence end within this of each other
DEFAULT_MAX_OFFSET_NS = 10_000_000_000  # clocks further apart than 10 s are not searched
# Fewer agreeing collectives than this are no evidence of an offset: a rank missing a step can leave only
# chance coincidences (two of them put the a100 job's rank 1 373 ms off, from a true 0), so such a rank keeps
# its own clock and the ingest says so.
DEFAULT_MIN_MATCHES = 3
# Votes are O(anchors x collectives in the search window): bound the work per pair of ranks. The
# true offset gets one vote per anchor that has a partner, a wrong one only chance coincidences, so
# a few hundred anchors decide it as well as all of them would.
_MAX_QUERY_KERNELS = 256
_MAX_VOTES = 2_000_000


@dataclass
class CollectiveEnds:
    """End times (ns, CPU clock of the process) of one rank's collective kernels, sorted per name."""

    names: dict[str, np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(sum(len(v) for v in self.names.values()))


@dataclass
class PairOffset:
    offset_ns: int
    matches: int


@dataclass
class AlignmentReport:
    offsets: dict[int, int]
    reference: dict[int, int | None]   # input -> input it was aligned against (None: reference/fallback)
    matches: dict[int, int]            # votes in the chosen window
    method: dict[int, str]             # reference | collectives | same-host | none


def _col(table: pa.Table, name: str, fill: int = -1) -> np.ndarray:
    col = table.column(name)
    if col.null_count:
        col = pc.fill_null(col, fill)
    return col.to_numpy().astype(np.int64, copy=False)


def _launch_shift(records: RecordSet, k_dev: np.ndarray, k_start: np.ndarray) -> np.ndarray:
    """Per-kernel shift onto the CPU clock: joins.py's rule (no kernel starts before its launch)."""
    shift = np.zeros(len(k_start), np.int64)
    launches = records.launches
    if not launches.num_rows or not len(k_start):
        return shift
    l_corr, l_start = _col(launches, "correlation_id"), _col(launches, "start_ns")
    k_corr = _col(records.kernels, "correlation_id")
    order = np.argsort(l_corr, kind="stable")
    keys = l_corr[order]
    pos = np.minimum(np.searchsorted(keys, k_corr), len(keys) - 1)
    hit = (keys[pos] == k_corr) & (k_corr >= 0)
    if not hit.any():
        return shift
    lag = np.full(len(k_start), np.iinfo(np.int64).min)
    lag[hit] = l_start[order[pos[hit]]] - k_start[hit]
    devs, inverse = unique_inverse(k_dev)
    per_dev = np.full(len(devs), np.iinfo(np.int64).min)
    np.maximum.at(per_dev, inverse, lag)
    per_dev = np.maximum(per_dev, 0)
    return per_dev[inverse]


def collective_ends(records: RecordSet) -> CollectiveEnds:
    """Sorted end times of the collective kernels of one rank, by kernel name, on its CPU clock."""
    kernels = records.kernels
    out = CollectiveEnds()
    if not kernels.num_rows:
        return out
    k_dev, k_start, k_end = _col(kernels, "device"), _col(kernels, "start_ns"), _col(kernels, "end_ns")
    shift = _launch_shift(records, k_dev, k_start)
    is_coll = pc.equal(kernels.column("kind"), "collective").to_numpy(zero_copy_only=False)
    rows = np.nonzero(is_coll)[0]
    if not len(rows):
        return out
    names = kernels.column("name").take(pa.array(rows)).combine_chunks().dictionary_encode()
    codes = names.indices.to_numpy()
    ends = (k_end + shift)[rows]
    for code, name in enumerate(names.dictionary.to_pylist()):
        out.names[name] = np.sort(ends[codes == code])
    return out


def _votes(ref: np.ndarray, other: np.ndarray, max_offset_ns: int) -> np.ndarray:
    """All differences ref[i] - other[j] with |difference| <= max_offset_ns (vectorised window join)."""
    if not len(ref) or not len(other):
        return np.empty(0, np.int64)
    if len(other) > _MAX_QUERY_KERNELS:  # evenly spaced subset: the offset needs few anchors
        other = other[np.linspace(0, len(other) - 1, _MAX_QUERY_KERNELS).astype(np.int64)]
    lo = np.searchsorted(ref, other - max_offset_ns, side="left")
    hi = np.searchsorted(ref, other + max_offset_ns, side="right")
    counts = hi - lo
    total = int(counts.sum())
    if total > _MAX_VOTES:
        # Dense collectives over a wide window: shrink the window rather than the anchors.
        scale = _MAX_VOTES / total
        return _votes(ref, other, max(1, int(max_offset_ns * scale)))
    if total == 0:
        return np.empty(0, np.int64)
    owner = np.repeat(np.arange(len(other)), counts)
    first = np.repeat(lo - np.concatenate(([0], np.cumsum(counts)[:-1])), counts)
    ref_idx = first + np.arange(total)
    return ref[ref_idx] - other[owner]


def pair_offset(
    ref: CollectiveEnds,
    other: CollectiveEnds,
    tolerance_ns: int = DEFAULT_TOLERANCE_NS,
    max_offset_ns: int = DEFAULT_MAX_OFFSET_NS,
) -> PairOffset:
    """Offset to add to ``other``'s clock to match ``ref``'s: the densest window of end-time votes."""
    parts = [_votes(ref.names[n], ends, max_offset_ns) for n, ends in other.names.items() if n in ref.names]
    votes = np.concatenate(parts) if parts else np.empty(0, np.int64)
    if not len(votes):
        return PairOffset(0, 0)
    # Coarse pass, O(votes): histogram with bins one tolerance wide; the densest pair of adjacent
    # bins contains the densest tolerance-wide window.
    lo = int(votes.min())
    bins = np.bincount((votes - lo) // tolerance_ns)
    pairs = bins[:-1] + bins[1:] if len(bins) > 1 else bins
    best_pairs = np.nonzero(pairs == pairs.max())[0]
    centres = lo + (best_pairs + 1) * tolerance_ns
    k = int(best_pairs[np.argmin(np.abs(centres))])
    near = np.sort(votes[(votes >= lo + k * tolerance_ns) & (votes < lo + (k + 2) * tolerance_ns)])
    # Fine pass on the few votes there: the densest window of one tolerance, nearest zero on ties.
    upper = np.searchsorted(near, near + tolerance_ns, side="right")
    counts = upper - np.arange(len(near))
    best = counts.max()
    candidates = np.nonzero(counts == best)[0]
    j = int(candidates[np.argmin(np.abs(near[candidates] + tolerance_ns // 2))])
    return PairOffset(int(np.median(near[j : upper[j]])), int(best))


def estimate_alignment(
    record_sets: list[RecordSet],
    tolerance_ns: int = DEFAULT_TOLERANCE_NS,
    max_offset_ns: int = DEFAULT_MAX_OFFSET_NS,
    min_matches: int = DEFAULT_MIN_MATCHES,
) -> AlignmentReport:
    """Clock offset of every input against input 0, with how each was found (see module docstring)."""
    return alignment_from_ends([collective_ends(r) for r in record_sets],
                               [r.resource.get("host.name") for r in record_sets], tolerance_ns, max_offset_ns, min_matches)


def alignment_from_ends(
    ends: list[CollectiveEnds],
    hosts: list[str | None],
    tolerance_ns: int = DEFAULT_TOLERANCE_NS,
    max_offset_ns: int = DEFAULT_MAX_OFFSET_NS,
    min_matches: int = DEFAULT_MIN_MATCHES,
) -> AlignmentReport:
    """``estimate_alignment`` from each input's collective ends and host name alone: the digest a rank
    parsed in another process sends, so its record tables need not travel."""
    n = len(ends)
    report = AlignmentReport(offsets={}, reference={}, matches={}, method={})
    if n == 0:
        return report
    report.offsets[0], report.reference[0], report.matches[0], report.method[0] = 0, None, 0, "reference"
    pending: dict[int, PairOffset] = {}
    for b in range(1, n):
        pending[b] = pair_offset(ends[0], ends[b], tolerance_ns, max_offset_ns)
    best_ref = {b: 0 for b in pending}
    # Greedy spanning tree: settle the input with the strongest evidence, then let the rest try it.
    while pending:
        b = max(pending, key=lambda i: (pending[i].matches, -i))
        found = pending.pop(b)
        if found.matches < min_matches:
            pending[b] = found
            break
        a = best_ref[b]
        report.offsets[b] = report.offsets[a] + found.offset_ns
        report.reference[b], report.matches[b], report.method[b] = a, found.matches, "collectives"
        for c in pending:
            if pending[c].matches >= min_matches and best_ref[c] == 0:
                continue  # already well anchored on the reference
            trial = pair_offset(ends[b], ends[c], tolerance_ns, max_offset_ns)
            if trial.matches > pending[c].matches:
                pending[c], best_ref[c] = trial, b
    for b in sorted(pending):
        same = [a for a in report.offsets if hosts[b] is not None and hosts[a] == hosts[b]]
        if same:
            report.offsets[b], report.reference[b], report.method[b] = report.offsets[same[0]], same[0], "same-host"
        else:
            report.offsets[b], report.reference[b], report.method[b] = 0, None, "none"
        report.matches[b] = pending[b].matches
    report.offsets = dict(sorted(report.offsets.items()))
    return report


def alignment_lines(report: AlignmentReport, labels: list[str]) -> tuple[list[str], list[str]]:
    """What the alignment did, in words: (informational lines, warnings), ``labels`` naming each input.
    The offsets go to the user because every cross-rank number (fleet windows, skew, stragglers) rests on
    them; an input left on its own clock or aligned on a few collectives is a warning."""
    if len(labels) < 2:
        return [], []
    moved, warnings = [], []
    for i in sorted(report.offsets):
        if i == 0:
            continue
        method, offset, matches = report.method.get(i), report.offsets[i], report.matches.get(i, 0)
        if method == "collectives":
            moved.append(f"{labels[i]} {offset / 1e3:+,.0f} µs ({matches} collectives)")
        elif method == "same-host":
            moved.append(f"{labels[i]} {offset / 1e3:+,.0f} µs (as {labels[report.reference[i] or 0]}, same host)")
        else:
            why = (f"only {matches} collective kernels agree on an offset, {DEFAULT_MIN_MATCHES} are needed" if matches else
                   f"no collective kernels end together within {DEFAULT_MAX_OFFSET_NS / 1e9:g} s")
            warnings.append(f"{labels[i]}: its clock could not be aligned with the others' ({why}): it stays on its own "
                            "clock, and the fleet's windows, skew and stragglers across it may be wrong")
    info = []
    if moved:
        shown = moved if len(moved) <= 4 else [*moved[:3], f"and {len(moved) - 3} more"]
        info.append(f"clocks aligned on collective kernel ends against {labels[0]}: {', '.join(shown)}")
    return info, warnings


def align_ranks(record_sets: list[RecordSet], tolerance_ns: int = DEFAULT_TOLERANCE_NS) -> dict[int, int]:
    """Per-input clock offset (ns to add) that aligns every input's collectives with input 0's."""
    return estimate_alignment(record_sets, tolerance_ns=tolerance_ns).offsets


def _shift_table(table: pa.Table, offset: int) -> pa.Table:
    for i, f in enumerate(table.schema):
        if f.name.endswith("_ns") and pa.types.is_integer(f.type):
            shifted = pc.add(table.column(i), pa.scalar(offset, f.type))
            table = table.set_column(i, f, shifted)
    return table


def apply_offsets(record_sets: list[RecordSet], offsets: dict[int, int]) -> list[RecordSet]:
    """Copies of the inputs with ``offsets[i]`` added to every timestamp column of every table."""
    out = []
    for i, records in enumerate(record_sets):
        offset = int(offsets.get(i, 0))
        if offset == 0:
            out.append(records)
            continue
        tables = {name: _shift_table(getattr(records, name), offset) for name in TABLE_SCHEMAS}
        out.append(replace(records, **tables, resource=dict(records.resource), counters=dict(records.counters)))
    return out


def collective_skew(record_sets: list[RecordSet], offsets: dict[int, int] | None = None) -> float:
    """Median distance (ns) from each non-reference collective end to the nearest same-name end of input 0.

    NaN when no input but the reference has a collective that input 0 also ran.
    """
    offsets = offsets or {}
    if len(record_sets) < 2:
        return float("nan")
    ref = collective_ends(record_sets[0])
    ref_off = int(offsets.get(0, 0))
    dists = []
    for b in range(1, len(record_sets)):
        other = collective_ends(record_sets[b])
        shift = int(offsets.get(b, 0)) - ref_off
        for name, ends in other.names.items():
            r = ref.names.get(name)
            if r is None or not len(r):
                continue
            q = ends + shift
            k = np.clip(np.searchsorted(r, q), 1, len(r)) if len(r) > 1 else np.zeros(len(q), np.int64)
            left = r[np.maximum(k - 1, 0)]
            right = r[np.minimum(k, len(r) - 1)]
            dists.append(np.minimum(np.abs(q - left), np.abs(q - right)))
    if not dists:
        return float("nan")
    return float(np.median(np.concatenate(dists)))


def align_summaries(summaries: list, tolerance_ns: int = DEFAULT_TOLERANCE_NS,
                    max_offset_ns: int = DEFAULT_MAX_OFFSET_NS,
                    min_matches: int = DEFAULT_MIN_MATCHES) -> tuple[list, dict[str, str]]:
    """Live ranks on several hosts: every host's per-step summaries (``stitch.fleet.RankSummary``) on the
    clock of the host of the lowest rank, before the fleet span compares their collectives.

    Offline the record tables are aligned before stitching (``estimate_alignment``); live, each rank has
    stitched on its own host's wall clock, so the fleet gets the same correction from what the summaries
    carry: the collectives of every step (name, start, end). One host is one clock, so the offset is per
    host, from its lowest rank's collective ends against the reference host's, by the same vote
    (:func:`alignment_from_ends`). A host that cannot be aligned (too few shared collectives) keeps its
    times but not its collectives, so no straggler or skew is claimed from clocks that disagree.
    Returns the summaries (shifted copies where needed) and, per host, how its clock was set: reference,
    collectives, none (it has collectives, but too few shared with the reference) or no-collectives.
    """
    hosts: dict[str, int] = {}
    for s in summaries:
        hosts[s.host] = min(hosts.get(s.host, s.rank), s.rank)
    if len(hosts) < 2:
        return summaries, dict.fromkeys(hosts, "reference")
    order = sorted(hosts, key=hosts.get)
    ends: list[CollectiveEnds] = []
    for host in order:
        by_name: dict[str, list[int]] = {}
        for s in summaries:
            if s.host == host and s.rank == hosts[host]:
                for name, _start, end in s.collectives:
                    by_name.setdefault(name, []).append(int(end))
        ends.append(CollectiveEnds({n: np.sort(np.array(v, np.int64)) for n, v in by_name.items()}))
    report = alignment_from_ends(ends, order, tolerance_ns, max_offset_ns, min_matches)
    method = {host: report.method.get(i, "none") if (i == 0 or len(ends[i])) else "no-collectives"
              for i, host in enumerate(order)}
    offset = {host: report.offsets.get(i, 0) for i, host in enumerate(order)}
    out = []
    for s in summaries:
        if method[s.host] not in ("reference", "collectives"):
            out.append(replace(s, collectives=[]))
            continue
        d = offset[s.host]
        if d == 0:
            out.append(s)
            continue
        out.append(replace(s, start_ns=s.start_ns + d, end_ns=s.end_ns + d, window_start_ns=s.window_start_ns + d,
                           window_end_ns=s.window_end_ns + d,
                           tiled_start_ns=None if s.tiled_start_ns is None else s.tiled_start_ns + d,
                           tiled_end_ns=None if s.tiled_end_ns is None else s.tiled_end_ns + d,
                           collectives=[[name, int(start) + d, int(end) + d] for name, start, end in s.collectives]))
    return out, method
