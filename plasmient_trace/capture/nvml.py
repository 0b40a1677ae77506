"""NVML sampler: utilization.gpu (the meter everyone watches) and GPM counters, on a background thread.

Samples go into a bounded deque as (timestamp_ns, device, metric, value); the session cuts them per
step window into the ``samples`` table and puts their means on the step span. Everything fails soft:
no pynvml, no driver, or a GPU without GPM simply yields fewer metrics, with one message.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import pyarrow as pa

from ..records import table_from_columns

UTIL_METRIC = "nvml.utilization.gpu"
# GPM metric ids (nvml.h NVML_GPM_METRIC_*) -> our sample metric names.
GPM_METRICS = {2: "gpm.sm_active", 5: "gpm.tensor_active", 10: "gpm.dram_bw_util"}  # SM_UTIL, ANY_TENSOR_UTIL, DRAM_BW_UTIL


class NvmlSampler:
    def __init__(self, devices: list[int], interval_s: float = 0.02, maxlen: int = 200_000) -> None:
        self.devices = devices
        self.interval_s = interval_s
        self.samples: collections.deque = collections.deque(maxlen=maxlen)
        self.reason = ""
        self._nvml: Any = None
        self._handles: list[Any] = []
        self._gpm: set[int] = set()   # devices with GPM (Hopper and later)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> bool:
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in self.devices]
        except Exception as err:
            self.reason = f"NVML unavailable ({err}): no plasmient.util.nvml on step spans"
            return False
        for dev, h in zip(self.devices, self._handles):
            try:
                if self._nvml.nvmlGpmQueryDeviceSupport(h).isSupportedDevice:
                    self._gpm.add(dev)
            except Exception:
                pass  # pre-Hopper GPUs and old drivers have no GPM: utilization only
        self._thread = threading.Thread(target=self._run, name="plasmient-nvml", daemon=True)
        self._thread.start()
        return True

    def _run(self) -> None:
        nvml = self._nvml
        previous: dict[int, Any] = {}
        while not self._stop.wait(self.interval_s):
            now = time.time_ns()
            for dev, h in zip(self.devices, self._handles):
                try:
                    util = nvml.nvmlDeviceGetUtilizationRates(h).gpu
                    self.samples.append((now, dev, UTIL_METRIC, float(util) / 100.0))
                except Exception:
                    continue
                if dev in self._gpm:
                    self._sample_gpm(dev, h, now, previous)

    def _sample_gpm(self, dev: int, handle: Any, now: int, previous: dict[int, Any]) -> None:
        nvml = self._nvml
        try:
            sample = nvml.nvmlGpmSampleAlloc()
            nvml.nvmlGpmSampleGet(handle, sample)
            if dev in previous:
                data = nvml.c_nvmlGpmMetricsGet_t()
                data.version = nvml.NVML_GPM_METRICS_GET_VERSION
                data.numMetrics = len(GPM_METRICS)
                data.sample1 = previous[dev]
                data.sample2 = sample
                for i, mid in enumerate(GPM_METRICS):
                    data.metrics[i].metricId = mid
                nvml.nvmlGpmMetricsGet(data)
                for i, name in enumerate(GPM_METRICS.values()):
                    self.samples.append((now, dev, name, float(data.metrics[i].value) / 100.0))
                nvml.nvmlGpmSampleFree(previous[dev])
            previous[dev] = sample
        except Exception:
            self._gpm.discard(dev)  # stop trying on this device, keep utilization

    def take(self, start_ns: int, end_ns: int) -> pa.Table:
        """Samples in [start, end] (older ones are discarded: steps end in order)."""
        rows = []
        while self.samples and self.samples[0][0] < start_ns:
            self.samples.popleft()
        for s in list(self.samples):
            if s[0] > end_ns:
                break
            rows.append(s)
        if not rows:
            return table_from_columns("samples", {})
        ts, dev, metric, value = zip(*rows)
        return table_from_columns("samples", {"timestamp_ns": list(ts), "device": list(dev),
                                              "metric": list(metric), "value": list(value)})

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        try:
            if self._nvml is not None:
                self._nvml.nvmlShutdown()
        except Exception:
            pass
