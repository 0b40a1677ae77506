"""What the stitcher is given and what it returns: device specs, options, one rank's inputs, the result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .. import conventions as cv
from ..metrics.flops.labels import Labels
from ..records import RecordSet

LEVEL_CODE = {name: i for i, name in enumerate(cv.LEVELS)}
KINDS = ("kernel", "memcpy", "memset", "collective")
KIND_CODE = {name: i for i, name in enumerate(KINDS)}
DEFAULT_MAX_SPANS = 10_000
# Records a group of steps holds when a trace is stitched a group at a time (one step at least). By default
# a sixteenth of the input's, so a group's span table, the largest thing the stitch builds (about 1 KB a
# span), is a small part of the file's; never fewer than the floor, nor more than the cap (memory is bounded
# by a group, not the file). At 10^5 kernels, groups of ~22,000 records peak at 315 MiB where groups of
# 100,000 peaked at 470 MiB, at about the same stitch time.
# Each group also costs a fixed 2.5-3 ms (its fleet and node spans, two span tables, a pass per tree level):
# a group of 5,000 records spends ~40% of its rows' time on it. So a group is made up to CHUNK_ROWS_AMORTISED
# records where that is at most a quarter of the input (the memory bound then is a quarter of the input's
# spans, as the floor already allowed for inputs under 20,000 records): the 18,192-kernel replica (12 steps
# of 5,457 rows) is stitched in 6 groups, not 12, while the large shared traces, whose steps are 3,800-7,400
# rows and a sixth to a third of their input, keep a group per step.
CHUNK_ROWS_CAP = 100_000
CHUNK_ROWS_FLOOR = 5_000
CHUNK_ROWS_AMORTISED = 12_000
GROUPS_PER_INPUT = 16
# How many culprit rows a step and a rank span show in plasmient.culprits (the display cut).
CULPRIT_ROWS = 10
# How many culprit rows a rank's step hands on to its node and fleet spans (fleet.RankSummary.culprits), and
# a node or fleet span carries in plasmient.culprits: a row summed over ranks (or, in the report, over steps)
# is exact only when every list it is summed from was cut after it, so the cut comes after the sums, and the
# lists are long enough to hold a whole step (the real traces have 2 to 229 rows a step). Bounded, since the
# live ranks exchange the summaries through the c10d store and an ingest holds them all: 512 rows of ~600
# bytes of JSON is ~300 KB a rank-step on the wire, the bound the collectives of a summary already have
# (4096 of ~100 bytes). A list cut here says the most a row it leaves out may hold (plasmient.culprits.left_out_s),
# and a merged row that list may have left short is marked "lower_bound".
CULPRIT_CARRY = 512
# How many of those merged rows a node or fleet span shows in plasmient.culprits: enough for the report to sum
# the rows that matter over steps, and a span a backend takes. Whole, a step's 231 merged rows made the a100
# pair's fleet and node spans 131 KB each (38 KB at 64 rows), and the a100 cuda_graphs trace's spans, batched
# 1,536 a request largest first as the shipped Collector does, made a 4.55 MB request a 4 MiB receiver refused.
# Past it, plasmient.culprits.left_out_s says what a left-out row may hold, as below a step's cut.
NODE_CULPRIT_ROWS = 64


@dataclass
class DeviceSpec:
    """What the metrics need of a device; built from metrics.hardware lookups or overrides."""

    model: str | None
    device_type: str              # gpu | cpu
    peak_for: Callable[[str], float] | None   # dtype -> FLOP/s; None = unknown
    bandwidth: float | None       # bytes/s
    price_per_hour: float | None  # USD per device-hour
    source: str                   # table:<model> | override | calibrated | unknown
    native: frozenset[str] = frozenset()  # precisions with a peak of their own (not a fallback): fp8 on H100, not A100

    def peak(self, dtype: str) -> float:
        if self.peak_for is None:
            return float("nan")
        value = self.peak_for(dtype)
        return float(value) if value else float("nan")

    def headline_peak(self) -> float:
        """The peak quoted for a device as a whole: bf16 tensor math on a GPU, fp32 on a CPU."""
        return self.peak("bf16" if self.device_type == "gpu" else "fp32")


@dataclass
class StitchOptions:
    job_id: str = "default"
    max_spans: int = DEFAULT_MAX_SPANS
    baseline_mfu: float = cv.DEFAULT_BASELINE_MFU
    ranks_per_node: int = 8
    host: str | None = None
    service_name: str | None = None
    full_depth_steps: set[int] | None = None  # None: every step carries its whole subtree
    extra_resource: dict[str, Any] = field(default_factory=dict)
    # Ranks that share each trace (the span budget is split between them); 0 = the ranks stitched together.
    world_size: int = 0
    # Live capture's per-step facts (stitch.step_facts.StepFacts): signatures, carried FLOPs, dropped records.
    step_facts: Any = None
    # Records (modules + ops + kernels, all ranks) stitched at once: a trace is built a group of steps at a
    # time (stitch.chunks), so memory holds one group's spans, not the file's. None: default_chunk_rows.
    chunk_rows: int | None = None


def default_chunk_rows(input_rows: int) -> int:
    """Records per group of steps for an input of ``input_rows`` records (and step spans), all ranks."""
    amortised = min(CHUNK_ROWS_AMORTISED, input_rows // 4)
    return int(min(max(input_rows // GROUPS_PER_INPUT, CHUNK_ROWS_FLOOR, amortised), CHUNK_ROWS_CAP))


@dataclass
class RankInput:
    records: RecordSet
    spec: DeviceSpec
    op_flops: np.ndarray
    op_bytes: np.ndarray
    op_dtype: Labels       # dtype name per op
    op_model: Labels       # model name per op ("none" = no model)
