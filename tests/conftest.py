"""Shared fixtures: the real traces in ../shared/traces, ingested once per test session."""

from __future__ import annotations

import gzip
import json
import os
import re
import sys
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO.parent / "shared" / "traces"
sys.path.insert(0, str(Path(__file__).resolve().parent))

ALL_TRACES = sorted(str(p.relative_to(TRACES)) for p in TRACES.glob("*/*.json.gz")) if TRACES.is_dir() else []


RAW_KERNEL_CATS = {"kernel", "Kernel", "gpu_memcpy", "Memcpy", "gpu_memset", "Memset"}
RAW_RUNTIME_CATS = {"cuda_runtime", "Runtime", "cuda_driver"}
# A collective kernel, as the oracles read a raw name: NCCL's or RCCL's anywhere in it, or one of the peer-to-peer
# kernels that torch's symmetric-memory ops launch (torch/csrc/distributed/c10d/symm_mem/CUDASymmetricMemoryOps.cu)
# or vLLM's custom all-reduce launches (csrc/custom_all_reduce.cuh). HTA and TraceLens match NCCL/RCCL only
# (docs/hta-tracelens.md).
RAW_COLLECTIVE_KERNEL = re.compile(
    r"nccl|rccl|multimem_all_reduce_kernel|multimem_one_shot_all_reduce_kernel|multimem_all_gather_kernel"
    r"|one_shot_all_reduce_kernel|two_shot_all_reduce_kernel|cross_device_reduce_1stage|cross_device_reduce_2stage",
    re.IGNORECASE)


def ns_of_us(us: float) -> int:
    """Microseconds to ns without going through a float above 2**53 (epoch-µs traces such as v100's)."""
    whole = int(us)
    return whole * 1000 + round((us - whole) * 1000)


def raw_steps(doc: dict) -> list[tuple[int, int, int]]:
    """(start, end, step number) of each host ProfilerStep#N range of a raw Kineto document, ns after its epoch
    anchor."""
    base = doc.get("baseTimeNanoseconds") or 0
    steps = []
    for e in doc["traceEvents"]:
        if (e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")
                and e.get("cat") in ("cpu_op", "user_annotation", "Operator")):
            s = base + ns_of_us(float(e["ts"]))
            steps.append((s, s + ns_of_us(float(e["dur"])), int(e["name"][13:])))
    return steps


def raw_activities(doc: dict) -> list[dict]:
    """Every GPU activity of a raw Kineto document, read here independently of the parser: the event, its start
    and end (ns after Kineto's epoch anchor), its launch time (None without a launch record) and its step.
    An activity belongs to the ProfilerStep#N whose CPU range holds its launch (as every kernel belongs to the
    step of the op that launched it); one with no launch record, to the step holding its start, but no later
    than the step of the next launched activity on its stream (a stream runs in launch order), or where no step
    holds its start, to the one holding its end. A trace without
    ProfilerStep markers is one step, 0; an activity outside every step has step None."""
    base = doc.get("baseTimeNanoseconds") or 0
    launch, steps = {}, raw_steps(doc)
    for e in doc["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") in RAW_RUNTIME_CATS and "correlation" in e.get("args", {}):
            launch[e["args"]["correlation"]] = base + ns_of_us(float(e["ts"]))
    out = []
    for e in doc["traceEvents"]:
        if e.get("ph") != "X" or e.get("cat") not in RAW_KERNEL_CATS:
            continue
        s = base + ns_of_us(float(e["ts"]))
        at = launch.get(e.get("args", {}).get("correlation"))
        when = at if at is not None else s
        step = next((n for a, b, n in steps if a <= when < b), 0 if not steps else None)
        end = s + ns_of_us(float(e.get("dur", 0)))
        if step is None and at is None:  # started before a step and ran into it: that step's
            step = next((n for a, b, n in steps if a <= max(end - 1, s) < b), None)
        out.append({"event": e, "start_ns": s, "end_ns": s + ns_of_us(float(e.get("dur", 0))), "launch_ns": at,
                    "step": step})
    next_launched: dict = {}  # (device, stream) -> step of the latest-starting launched activity seen so far
    for a in sorted(out, key=lambda a: -a["start_ns"]):
        args = a["event"].get("args", {})
        where = (args.get("device", 0), args.get("stream"))
        later = next_launched.get(where)
        if a["launch_ns"] is None and a["step"] is not None and later is not None and a["step"] > later:
            a["step"] = later
        if a["launch_ns"] is not None and a["step"] is not None:
            next_launched[where] = a["step"]
    return out


def union_ns(intervals: list[tuple[int, int]]) -> int:
    """Length of the union of [start, end) intervals: the oracle's own sweep, independent of the stitcher's."""
    total, cur_s, cur_e = 0, None, None
    for s, e in sorted(i for i in intervals if i[1] > i[0]):
        if cur_e is None or s > cur_e:
            total += (cur_e - cur_s) if cur_e is not None else 0
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + ((cur_e - cur_s) if cur_e is not None else 0)


def trace_path(name: str) -> Path:
    path = TRACES / name
    if not path.exists():
        if os.environ.get("CI"):
            raise FileNotFoundError(f"{path} missing: CI must have ../shared/traces beside the repo")
        pytest.skip(f"{path} not present")
    return path


@lru_cache(maxsize=None)
def raw_trace(name: str) -> dict:
    """The trace as plain json, read independently of the project's parser."""
    with gzip.open(trace_path(name), "rt") as f:
        doc = json.load(f)
    return doc if isinstance(doc, dict) else {"traceEvents": doc}


def fifo_fed(directory: Path, name: str, data: bytes) -> Path:
    """A named pipe that a thread fills with ``data``, as `<(zcat spans.jsonl.gz)` gives a command."""
    import threading

    fifo = directory / name
    os.mkfifo(fifo)

    def feed() -> None:
        with open(fifo, "wb") as w:  # blocks until the command opens it
            try:
                w.write(data)
            except BrokenPipeError:
                pass  # the reader stopped early: the test's assertions say whether that was right

    threading.Thread(target=feed, daemon=True).start()
    return fifo


@lru_cache(maxsize=None)
def ingested(name: str, max_spans: int | None = None):
    from plasmient_trace.pipeline import IngestOptions, ingest_paths

    options = IngestOptions(job_id="test-job")
    if max_spans is not None:
        options.max_spans = max_spans
    return ingest_paths([trace_path(name)], options)


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    if not TRACES.is_dir():
        pytest.fail(f"{TRACES} is missing: the tests read the shared real traces")
    return TRACES


def ingest_batch(paths: list[Path], job_id: str):
    """SpanBatch of real shared traces through the real pipeline (one file per rank)."""
    from plasmient_trace.pipeline import IngestOptions, ingest_paths

    for p in paths:
        assert p.is_file(), f"missing shared trace {p}"
    return ingest_paths([str(p) for p in paths], IngestOptions(job_id=job_id)).batch


@pytest.fixture(scope="session", autouse=True)
def native_observer():
    """The native op observer, built (or read from the cache) before any capture test runs, so every
    session and example subprocess under the default PLASMIENT_OP_HOOK=auto starts on it; the test
    machines have a C++ compiler, so a failed build is a failure, not a skip."""
    from plasmient_trace.capture import native

    observer = native.load()
    if observer is None:
        pytest.fail(f"the native op observer did not build: {native.failure()}")
    return observer


# The CPU's peaks are timed only on an otherwise idle machine, which a test worker beside others never is:
# they are measured before the workers start (pytest_configure runs in xdist's controller first), into a
# directory kept between runs as a user's cache is (a machine is calibrated once, not on every run).
CPU_CALIBRATION_DIR = "PLASMIENT_TEST_CPU_CALIBRATION"
STAND_IN_PEAK_FLOPS = 1e12


def pytest_configure(config) -> None:
    if hasattr(config, "workerinput") or os.environ.get(CPU_CALIBRATION_DIR):
        return
    import subprocess
    import tempfile

    from plasmient_trace.metrics import cpu_peak

    cache = Path(tempfile.gettempdir()) / "plasmient-test-calibration"
    os.environ[CPU_CALIBRATION_DIR] = str(cache)   # inherited by the workers
    try:
        import torch

        threads = sorted({1, torch.get_num_threads()})
    except ImportError:
        threads = [1]
    for n in threads:
        entry = cpu_peak._read_cache(cache / cpu_peak._CACHE_FILE).get(cpu_peak._cache_key(n))
        if cpu_peak._valid(entry) and not entry.get("stand_in"):
            continue
        done = subprocess.run([sys.executable, "-m", "plasmient_trace.metrics.cpu_peak", "--threads", str(n),
                               "--cache-dir", str(cache), "--deadline", "60"], timeout=900)
        if done.returncode == 3:
            # Another workload kept this machine busy for a minute (CI's is idle here): the capture tests get a
            # stand-in peak, far above what the CPU reaches, in place of a user's earlier calibration, until
            # a later run finds the machine idle.
            _stand_in_calibration(cache, n)
            print(f"conftest: the CPU was never idle; {n}-thread capture tests use a stand-in peak of "
                  f"{STAND_IN_PEAK_FLOPS:.0e} FLOP/s", file=sys.stderr)
        elif done.returncode:
            raise RuntimeError(f"CPU calibration for the tests exited {done.returncode}")


def _stand_in_calibration(cache: Path, threads: int) -> None:
    from plasmient_trace.metrics import cpu_peak

    path = cache / cpu_peak._CACHE_FILE
    entries = cpu_peak._read_cache(path)
    entries[cpu_peak._cache_key(threads)] = {
        "fp32": STAND_IN_PEAK_FLOPS, "fp64": STAND_IN_PEAK_FLOPS, "bf16": STAND_IN_PEAK_FLOPS, "bandwidth": 1e11,
        "format": cpu_peak._CACHE_FORMAT, "idle_checked": False, "stand_in": True, "gemm_n": 0, "runs": 0}
    cpu_peak._write_cache(path, entries)


def calibrated_cpu(into: Path) -> Path:
    """Copy the suite's CPU calibration into the cache directory ``into`` (as a user's earlier run left it)."""
    import shutil

    into.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(os.environ[CPU_CALIBRATION_DIR]) / "cpu_calibration.json", into / "cpu_calibration.json")
    return into


@pytest.fixture(scope="session")
def warm_cache(tmp_path_factory, native_observer) -> Path:
    """A PLASMIENT_CACHE_DIR for the capture tests' subprocesses, as a user's machine has it after a first
    run: this session's build of the native op observer and the calibrated CPU peaks. Shared by the
    modules that run example jobs, so neither rebuilds the observer (15 s of CPU) nor recalibrates."""
    import shutil

    root = tmp_path_factory.mktemp("plasmient-cache")
    build = Path(native_observer.__file__).parent
    shutil.copytree(build, root / "native" / build.name)
    calibrated_cpu(root)
    return root


def cli_with_file_size_limit(limit_bytes: int, *args: str) -> list[str]:
    """A command running ``plasmient`` with files capped at ``limit_bytes`` (a full disk: writes past it fail with
    EFBIG), the limit set by the child itself. Not with ``preexec_fn``: Python code between fork and exec in a
    test worker that has gRPC loaded runs gRPC's fork handlers, whose poller then finds its epoll descriptor
    closed by the exec's fd cleanup and aborts the child (SIGABRT, seen once in three full runs)."""
    code = ("import resource, runpy, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit_bytes}, {limit_bytes})); "
            "sys.argv = ['plasmient', *sys.argv[1:]]; runpy.run_module('plasmient_trace.cli', run_name='__main__')")
    return [sys.executable, "-c", code, *args]


class NearlyFullDisk:
    """``os.write`` of the spill and file sinks on a disk with ``free`` bytes left: a write past them is cut
    short there, one with none left fails with ENOSPC; ``full = False`` is the disk with room again."""

    def __init__(self, free: int) -> None:
        self.free, self.full = free, True
        self._write = os.write

    def write(self, fd: int, data: bytes) -> int:
        import errno

        if not self.full:
            return self._write(fd, data)
        if self.free == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = self._write(fd, data[:self.free])
        self.free -= n
        return n


@pytest.fixture
def nearly_full_disk(monkeypatch):
    """Call with the bytes the disk has left; os.write is the disk's until the test ends."""
    import plasmient_trace.export.spill as spill

    def fill(free: int) -> NearlyFullDisk:
        disk = NearlyFullDisk(free)
        monkeypatch.setattr(spill.os, "write", disk.write)
        return disk

    return fill
