"""Value checks on decoded event times: absurd timestamps and durations are dropped or clamped, and counted.

A trace that parses can still carry values no profiler writes: negative durations, durations of
centuries, timestamps of 1e30 µs or NaN. Left in, they become negative MFU, kernels that vanish from
their step, or int64 overflow in the nesting keys. The rules, all on float µs as Kineto writes them:

- a timestamp must be finite, within ``MAX_ABS_TS_US`` of zero (epoch µs up to 2096: int64 ns keeps
  headroom for offsets), and within ``MAX_SPAN_US`` (one day) of the trace's median timestamp;
- a duration must be finite and at most ``MAX_SPAN_US``; a negative one down to ``-ROUNDING_SLACK_US``
  is clock rounding and is clamped to zero, anything more negative is dropped.

Counts go to ``RecordSet.counters`` under ``input.dropped_events`` and ``input.clamped_events``;
``input.invalid_values`` counts numbers of kept events that were set to null (e.g. negative per-kernel
FLOPs; NCCL message sizes or group sizes that are negative, fractional or not numbers), as unknown values
are absent, never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_SPAN_US = 86_400.0e6
MAX_ABS_TS_US = 4.0e15
ROUNDING_SLACK_US = 1.0

DROPPED = "input.dropped_events"
CLAMPED = "input.clamped_events"
INVALID = "input.invalid_values"


@dataclass
class TimeChecker:
    """Checks (ts, dur) columns against one trace-wide time window and tallies what it changed."""

    center_us: float | None
    dropped: int = 0
    clamped: int = 0
    invalid: int = 0

    @classmethod
    def for_timestamps(cls, ts_columns: list[np.ndarray]) -> TimeChecker:
        """Window centred on the median of all plausible timestamps (robust to a few wild ones)."""
        parts = [ts[np.isfinite(ts) & (np.abs(ts) <= MAX_ABS_TS_US)] for ts in ts_columns if len(ts)]
        every = np.concatenate(parts) if parts else np.zeros(0)
        return cls(float(np.median(every)) if len(every) else None)

    def check(self, ts: np.ndarray, dur: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(keep mask, durations with rounding-level negatives clamped to 0)."""
        if self.center_us is None:
            keep = np.zeros(len(ts), bool)
        else:
            with np.errstate(invalid="ignore"):
                keep = (np.isfinite(ts) & (np.abs(ts) <= MAX_ABS_TS_US) & (np.abs(ts - self.center_us) <= MAX_SPAN_US)
                        & np.isfinite(dur) & (dur >= -ROUNDING_SLACK_US) & (dur <= MAX_SPAN_US))
        slightly_negative = keep & (dur < 0)
        if slightly_negative.any():
            dur = np.where(slightly_negative, 0.0, dur)
            self.clamped += int(slightly_negative.sum())
        self.dropped += int(len(ts) - keep.sum())
        return keep, dur

    def counters(self) -> dict[str, int]:
        """Every count, zeros included: a file source always checks, so zero is a known value."""
        return {DROPPED: self.dropped, CLAMPED: self.clamped, INVALID: self.invalid}
