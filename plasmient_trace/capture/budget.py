"""How often sampled full-depth steps may run: a token bucket over the background work they cost.

A full-depth step costs the training loop little on the training thread and a lot on the background
thread that stitches and encodes its op spans (about 30 ms of CPU for the 1,400 op spans of a 34 ms
step of the example transformer). ``PLASMIENT_EVERY`` alone cannot bound that: one full step in ten
is 1% on a model with one-second steps and 10% on a model with 30 ms steps. So the periodic samples
(and the ones an MFU drop asks for) also wait for budget: the bucket fills at ``fraction`` of the wall
time that passes, a sample takes its measured cost out, and until it holds one sample's cost the
steps stay at step depth. Steps with a never-seen input signature are not held back (they are what
carried FLOPs come from, and ``PLASMIENT_MAX_SIGNATURES`` bounds them).

The cost of a sample is measured by the background thread: its CPU time per batch over the full-depth
steps in the batch (the step-depth steps' share included, so the estimate errs high). Before the first
measurement, samples run, so a run shorter than the first batch still shows its periodic full steps.
From then on the bucket alone decides: a sample let through regardless of it would be background work
beyond the share the user set.
"""

from __future__ import annotations

import threading

DEFAULT_FRACTION = 0.02  # PLASMIENT_OVERHEAD's default: full-depth samples' background work, as a share of wall time
_SMOOTHING = 0.3          # weight of the newest measurement in the running cost estimate


class FullDepthBudget:
    """Token bucket of background seconds for sampled full-depth steps (``fraction`` None: no limit)."""

    def __init__(self, fraction: float | None) -> None:
        self.fraction = fraction if fraction and fraction > 0 else None
        self.cost_s: float | None = None   # running estimate of one full-depth step's background CPU
        self._tokens = 0.0
        self._last_ns: int | None = None
        self._lock = threading.Lock()

    def allow(self, now_ns: int) -> bool:
        """Whether a sample due now may run at full depth; when it may, its cost is taken out."""
        if self.fraction is None:
            return True
        with self._lock:
            if self._last_ns is not None:
                self._tokens += self.fraction * max(now_ns - self._last_ns, 0) / 1e9
            self._last_ns = now_ns
            cost = self.cost_s
            if cost is None:
                return True
            # the bucket holds at most a few samples' worth: budget saved in a quiet hour is not spent at once
            self._tokens = min(self._tokens, 3 * cost)
            if self._tokens >= cost:
                self._tokens -= cost
                return True
            return False

    def measured(self, cpu_s: float, full_steps: int) -> None:
        """The background thread's CPU time for a batch holding ``full_steps`` full-depth steps."""
        if full_steps <= 0 or cpu_s < 0:
            return
        per_step = cpu_s / full_steps
        with self._lock:
            self.cost_s = per_step if self.cost_s is None else (1 - _SMOOTHING) * self.cost_s + _SMOOTHING * per_step
