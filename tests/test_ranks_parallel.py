"""Ranks ingested as map tasks (a process pool, or Ray) give the trace a single process gives, span for span
and id for id; the clocks they align are the clocks the simulation shifted; a bad rank file is one line.

Inputs: the two real ranks of one job (a100_multirank), and six ranks made from them by
benchmarks/simulated_ranks.py (own rank ids, host clocks shifted by known amounts, per-kernel jitter).
"""

from __future__ import annotations

import contextlib
import gc
import gzip
import importlib.util
import json
import logging
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from conftest import REPO, trace_path
from ingest_checks import assert_same_trace

from plasmient_trace.cli import main
from plasmient_trace.pipeline import IngestOptions, IngestResult, ingest_paths
from plasmient_trace.stitch import ids

sys.path.insert(0, str(REPO / "benchmarks"))
from simulated_ranks import SimulatedRanks, write_simulated_ranks

REAL = ("a100_multirank/rank-0.json.gz", "a100_multirank/rank-1.json.gz")
RANKS_PER_NODE = 2  # six simulated ranks -> three nodes, so node spans are reduced from several ranks
MAX_SPANS = 1500    # below what six ranks would export: each rank's share of the budget decides what it folds
SIM = {"job_id": "sim", "ranks_per_node": RANKS_PER_NODE, "max_spans": MAX_SPANS}
SIM_ARGS = ["--job-id", "sim", "--ranks-per-node", str(RANKS_PER_NODE), "--max-spans", str(MAX_SPANS)]


@pytest.fixture(scope="module")
def simulated(tmp_path_factory: pytest.TempPathFactory) -> SimulatedRanks:
    for name in REAL:
        trace_path(name)  # skips when the shared traces are absent
    return write_simulated_ranks(tmp_path_factory.mktemp("ranks"), 6, seed=7)


@pytest.fixture(scope="module")
def single(simulated: SimulatedRanks) -> IngestResult:
    return ingest_paths(simulated.paths, IngestOptions(**SIM))


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray", reason="Ray is the optional [ray] extra: pip install 'plasmient-trace[ray]'")
    ray.init(num_cpus=2, object_store_memory=150 * 1024**2, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR")
    yield ray
    ray.shutdown()


def test_two_real_ranks_in_a_pool_give_the_single_process_trace():
    paths = [trace_path(name) for name in REAL]
    want = ingest_paths(paths, IngestOptions(job_id="pair"))
    got = ingest_paths(paths, IngestOptions(job_id="pair", workers=2))
    assert_same_trace(got, want)
    assert got.records and all(r.kernels.num_rows for r in got.records)  # keep_records: Parquet still has them
    assert len(got.stats["worker_peak_rss_kib"]) >= 1  # the ranks were stitched in worker processes


def test_simulated_ranks_in_a_pool_give_the_single_process_trace(simulated, single):
    got = ingest_paths(simulated.paths, IngestOptions(**SIM, workers=2, keep_records=False))
    assert_same_trace(got, single)
    assert got.records == []
    # The budget bit (kernels were folded) and held in every trace: each rank kept to its share.
    assert got.stats["kernels_folded"] > 0
    per_trace = pa.table({"t": got.batch.table.column("trace_id")}).group_by("t").aggregate([("t", "count")])
    assert max(per_trace.column("t_count").to_pylist()) <= MAX_SPANS
    levels = got.batch.table.column("plasmient.level").to_pylist()
    steps = got.stats["traces"]
    assert levels.count("fleet") == steps and levels.count("node") == 3 * steps and levels.count("rank") == 6 * steps


def test_the_clock_offsets_found_undo_the_simulated_shifts(simulated, single):
    # Oracle: the shifts the simulation applied. Copies of the same real rank saw the same collectives, so
    # the offset against rank 0 is exactly minus the shift (collectives keep their end under the jitter).
    offsets = single.stats["clock_offsets_ns"]
    for i, (shift, source) in enumerate(zip(simulated.shift_us, simulated.source)):
        if source == simulated.source[0]:
            assert offsets[i] == -shift * 1000, i


def test_cli_workers_write_the_same_lines(simulated, tmp_path, capsys):
    outs = {}
    for workers in ("1", "2"):
        out = tmp_path / f"w{workers}.jsonl"
        # "test-job": a job id whose trace ids do not sort as its steps (551, 552)
        assert main(["ingest", *map(str, simulated.paths), *SIM_ARGS, "--job-id", "test-job", "--workers", workers,
                     "--quiet", "--out", str(out)]) == 0
        outs[workers] = out.read_bytes()
    # byte for byte: the same spans, and the same lines in the same (step) order
    assert outs["1"] == outs["2"] and len(outs["1"].splitlines()) >= 2
    steps = [int(m) for m in re.findall(rb'"name":"fleet step (\d+)"', outs["1"])]
    assert steps == sorted(steps)
    assert sorted(steps, key=lambda step: ids.trace_id("test-job", step)) != steps


def test_a_tmpdir_too_long_for_the_forkservers_socket_still_pools_the_ranks(simulated, tmp_path):
    # A Unix socket's path holds 107 bytes: under a longer $TMPDIR (a batch scheduler's per-job directory)
    # `--workers 2` ended in an "AF_UNIX path too long" traceback from the forkserver. Its workers are spawned.
    long_tmp = tmp_path / ("slurm-job-" + "7" * 90)
    long_tmp.mkdir()
    outs = {}
    for workers in ("1", "2"):
        out = tmp_path / f"w{workers}.jsonl"
        proc = subprocess.run([sys.executable, "-m", "plasmient_trace.cli", "ingest", *map(str, simulated.paths), *SIM_ARGS,
                               "--workers", workers, "--quiet", "--out", str(out)], capture_output=True, text=True,
                              cwd=REPO, timeout=300, env={**os.environ, "TMPDIR": str(long_tmp)})
        # only the warning every such ingest gives (the simulated ranks' device is not in the table)
        assert proc.returncode == 0 and all(line.startswith("plasmient: unknown device in 6 of 6 inputs")
                                            for line in proc.stderr.splitlines()), proc.stderr
        outs[workers] = out.read_bytes()
    assert outs["1"] == outs["2"] and len(outs["1"].splitlines()) >= 2
    assert list(long_tmp.iterdir()) == []  # the spill directory of the pool went with it


def test_a_directory_of_ranks_ingests_as_its_traces_in_rank_order(simulated, tmp_path, capsys, monkeypatch):
    # a thousand ranks are one argument (tensorboard_trace_handler writes one file per rank into a directory);
    # rank-10 after rank-9, not after rank-1, and the directory's name is the job id
    job = tmp_path / "sim"
    job.mkdir()
    names = {}
    for i, path in zip((0, 1, 2, 9, 10, 11), simulated.paths):
        names[path] = job / f"rank-{i}.json.gz"
        names[path].symlink_to(path)
    (job / "README.txt").write_text("not a trace")
    args = ["--ranks-per-node", str(RANKS_PER_NODE), "--max-spans", str(MAX_SPANS), "--quiet"]
    from_files, from_dir = tmp_path / "files.jsonl", tmp_path / "dir.jsonl"
    assert main(["ingest", *map(str, names.values()), "--job-id", "sim", *args, "--out", str(from_files)]) == 0
    assert main(["ingest", str(job), *args, "--out", str(from_dir)]) == 0
    assert from_dir.read_bytes() == from_files.read_bytes()
    # `.` is the directory it stands for, named as such (its name was "", the job id of every such run)
    from_dot = tmp_path / "dot.jsonl"
    monkeypatch.chdir(job)
    assert main(["ingest", ".", *args, "--out", str(from_dot)]) == 0
    assert b'{"key":"plasmient.job.id","value":{"stringValue":"sim"}}' in from_dot.read_bytes()

    from plasmient_trace.sources.rawinput import traces_in

    assert traces_in([str(job)]) == [str(p) for p in names.values()]


def test_one_process_and_a_pool_write_the_same_parquet_in_the_order_of_the_lines(simulated, tmp_path):
    import pyarrow.parquet as pq

    tables, lines = {}, {}
    for workers in ("1", "2"):
        out, parquet = tmp_path / f"w{workers}.jsonl", tmp_path / f"pq{workers}"
        assert main(["ingest", *map(str, simulated.paths), *SIM_ARGS, "--job-id", "test-job", "--workers", workers,
                     "--quiet", "--out", str(out), "--parquet", str(parquet)]) == 0
        tables[workers] = {f.name: pq.read_table(f) for f in sorted(parquet.glob("*.parquet"))}
        lines[workers] = out.read_bytes()
    assert tables["1"].keys() == tables["2"].keys() and "spans.parquet" in tables["1"]
    for name in tables["1"]:
        assert tables["1"][name].equals(tables["2"][name]), name  # row order included
    span_ids = [s["spanId"] for line in lines["1"].splitlines() for rs in json.loads(line)["resourceSpans"]
                for ss in rs["scopeSpans"] for s in ss["spans"]]
    assert tables["1"]["spans.parquet"].column("span_id").to_pylist() == span_ids


@pytest.mark.parametrize("workers", ["1", "2"])
def test_ranks_of_an_unknown_device_are_named_in_one_line(simulated, tmp_path, capsys, workers):
    # the a100_multirank traces carry no deviceProperties; 1,000 such ranks printed 1,000 lines
    out = tmp_path / "out.jsonl"
    assert main(["ingest", *map(str, simulated.paths), *SIM_ARGS, "--workers", workers, "--out", str(out)]) == 0
    note = [line for line in capsys.readouterr().err.splitlines() if "unknown device" in line]
    assert len(note) == 1, note
    assert f"in 6 of 6 inputs ({simulated.paths[0]}, {simulated.paths[1]}, {simulated.paths[2]} and 3 more)" in note[0]
    assert "no MFU on their spans" in note[0]


def test_several_ranks_go_to_a_process_pool_unless_workers_says_otherwise(monkeypatch):
    from plasmient_trace.cli import _workers_for, build_parser
    from plasmient_trace.sources import parallel

    monkeypatch.setattr(parallel.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)

    def workers(*argv: str) -> int:
        return _workers_for(build_parser().parse_args(["ingest", *argv]))

    assert workers("a.json") == 1                        # one rank: nothing to spread
    assert workers("a.json", "b.json") == 2              # one process per rank...
    assert workers(*(f"r{i}.json" for i in range(9))) == 4  # ...at most one per CPU
    assert workers("a.json", "b.json", "--workers", "1") == 1  # 1 stitches in this process


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (its pool's forkserver and workers), from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended while we looked
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc")
def test_sigterm_stops_a_pooled_ingest_with_nothing_left_behind(tmp_path):
    # SIGTERM's default action killed the parent alone: its pool's workers ran on, orphaned, holding its pipes,
    # and the spill directory of pickled ranks stayed in $TMPDIR
    job, spill = tmp_path / "job", tmp_path / "tmp"
    write_simulated_ranks(job, 24, seed=5)
    spill.mkdir()
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "plasmient_trace.cli", "ingest", str(job), "--workers", "2",
                             "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "TMPDIR": str(spill)}, cwd=REPO)
    deadline = time.monotonic() + 120
    while len(_descendants(proc.pid)) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, "the ingest ended before its pool was seen"
    pool = _descendants(proc.pid)
    proc.terminate()
    _, err = proc.communicate(timeout=60)  # orphaned workers holding its pipes made this wait forever
    assert proc.returncode == 143, err.decode()
    assert err.decode().strip().splitlines()[-1] == "plasmient: terminated"
    assert not out.exists() and list(spill.iterdir()) == []
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() for pid in pool) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in pool if Path(f"/proc/{pid}").exists()], "pool processes outlived the ingest"


class _Stop(BaseException):
    pass


def test_a_signal_inside_a_worker_fork_leaves_no_worker_the_pool_does_not_know(simulated, monkeypatch):
    # The pool forks its workers inside submit. SIGTERM raised between a worker's fork and the pool
    # recording it (1 run in 8 here, sent 0.5-0.65 s into an ingest) left that worker out of the
    # shutdown: it waited for work forever, holding the ingest's stderr, or printed a traceback once its
    # semaphores were gone. Here the signal arrives exactly there, just after the first fork.
    import signal

    from plasmient_trace.runners import PoolRunner

    runner = PoolRunner(2, len(simulated.paths))
    process_class = runner.pool._mp_context.Process
    fork = process_class.start
    forked: list = []

    def start_then_signal(process) -> None:
        fork(process)
        forked.append(process)
        if len(forked) == 1:
            signal.raise_signal(signal.SIGTERM)

    def stop(_signum, _frame):
        raise _Stop()

    monkeypatch.setattr(process_class, "start", start_then_signal)
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        with pytest.raises(_Stop):
            try:
                list(runner.parse(simulated.paths, IngestOptions(**SIM)))
            finally:
                runner.close()
        assert forked, "no worker was forked"
        deadline = time.monotonic() + 30
        while any(p.is_alive() for p in forked) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p.pid for p in forked if p.is_alive()], "a forked worker outlived the pool's shutdown"
        # told to stop by the pool, not dead of a traceback (its queues' semaphores removed under it)
        assert [p.exitcode for p in forked] == [0] * len(forked)
        assert not runner.spill.exists()
    finally:
        signal.signal(signal.SIGTERM, previous)
        for p in forked:
            with contextlib.suppress(OSError):
                os.kill(p.pid, signal.SIGKILL)


def test_an_aborted_pool_stops_its_workers_instead_of_waiting_for_their_ranks(simulated):
    # A SIGTERM'd ingest of four 150,000-kernel ranks kept running 5-8 s: closing the pool waited for the
    # parse or stitch each worker was in. Aborted (an error, Ctrl-C, SIGTERM), it stops them there.
    from plasmient_trace.runners import PoolRunner

    runner = PoolRunner(2, 2)
    busy = [runner.pool.submit(time.sleep, 60) for _ in range(2)]
    deadline = time.monotonic() + 60
    while not all(f.running() for f in busy) and time.monotonic() < deadline:
        time.sleep(0.02)
    workers = list(runner.pool._processes.values())
    started = time.monotonic()
    runner.close(abort=True)
    assert time.monotonic() - started < 30, "close waited for the workers' tasks"
    assert workers and not [p.pid for p in workers if p.is_alive()]
    assert not runner.spill.exists()


def _cmdlines(pids: set[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            pass
    return out


def test_a_signal_raised_inside_c_code_still_ends_as_terminated(monkeypatch, capsys):
    # SIGTERM while Ray fetched an object: the handler's exception came out wrapped by CPython ("returned a
    # result with an exception set"), a traceback and exit 1 in about 1 run of the test below in 6
    import plasmient_trace.cli as cli

    def fetching(args):
        try:
            raise cli._Terminated()
        except cli._Terminated as err:
            raise SystemError("<built-in method __new__> returned a result with an exception set") from err

    monkeypatch.setattr(cli, "_cmd_ingest", fetching)
    assert cli.main(["ingest", "x.json"]) == cli.EXIT_TERMINATED
    assert capsys.readouterr().err == "plasmient: terminated\n"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc")
def test_sigterm_stops_an_ingest_on_its_own_local_ray_through_the_same_cleanup(tmp_path):
    # ray.init put in its own SIGTERM handler: a native stack dump on stderr and exit 15
    pytest.importorskip("ray", reason="Ray is the optional [ray] extra: pip install 'plasmient-trace[ray]'")
    job = tmp_path / "job"
    write_simulated_ranks(job, 24, seed=6)
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "plasmient_trace.cli", "ingest", "--ray", str(job), "--workers", "2",
                             "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    deadline = time.monotonic() + 180
    while proc.poll() is None and time.monotonic() < deadline and \
            not any("ray::_ray_parse" in c or "ray::stitch_part" in c for c in _cmdlines(_descendants(proc.pid))):
        time.sleep(0.05)  # until a task runs: Ray is up and its init is over
    assert proc.poll() is None, "the ingest ended before its Ray tasks were seen"
    proc.terminate()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err.decode()[-2000:]
    assert err.decode().strip().splitlines()[-1] == "plasmient: terminated"
    assert not out.exists()


def test_a_spill_that_cannot_be_written_is_one_line_and_leaves_nothing(simulated, tmp_path):
    # a full $TMPDIR: the worker's OSError came back as two tracebacks and exit 1. A file size limit stands in
    # for the full disk here (root writes to a read-only directory regardless): EFBIG instead of ENOSPC.
    from conftest import cli_with_file_size_limit

    spill = tmp_path / "tmp"
    spill.mkdir()
    out = tmp_path / "out.jsonl"
    proc = subprocess.run(cli_with_file_size_limit(64 << 10, "ingest", *map(str, simulated.paths), "--workers", "2",
                                                   "--out", str(out)),
                          capture_output=True, text=True, cwd=REPO, timeout=300, env={**os.environ, "TMPDIR": str(spill)})
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr
    assert err[0].startswith(f"plasmient: error: {simulated.paths[0]}: cannot keep its parsed records in {spill}")
    assert "File too large" in err[0] and "--workers 1" in err[0]
    assert not out.exists() and list(spill.iterdir()) == []


def test_a_bad_rank_among_many_is_one_line_naming_it(simulated, tmp_path, capsys):
    bad = tmp_path / "rank-9.json.gz"
    bad.write_bytes(simulated.paths[1].read_bytes()[:4000])
    out = tmp_path / "out.jsonl"
    code = main(["ingest", str(simulated.paths[0]), str(bad), *map(str, simulated.paths[2:]), "--workers", "2",
                 "--quiet", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "rank-9.json.gz" in err[0] and "Traceback" not in err[0], err
    assert not out.exists()


def test_cli_ray_starts_its_own_local_ray(simulated, tmp_path, capsys):
    pytest.importorskip("ray", reason="Ray is the optional [ray] extra: pip install 'plasmient-trace[ray]'")
    want = tmp_path / "single.jsonl"
    assert main(["ingest", *map(str, simulated.paths), *SIM_ARGS, "--quiet", "--out", str(want)]) == 0
    out = tmp_path / "ray.jsonl"
    # A fresh process, no Ray running in it: `--ray` starts a local Ray of --workers CPUs and stops it.
    proc = subprocess.run([sys.executable, "-m", "plasmient_trace.cli", "ingest", *map(str, simulated.paths), *SIM_ARGS,
                           "--workers", "2", "--ray", "--quiet", "--out", str(out)],
                          check=False, capture_output=True, text=True, timeout=240, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(out.read_text().splitlines()) == sorted(want.read_text().splitlines())


def test_ray_gives_the_single_process_trace(simulated, single, local_ray):
    got = ingest_paths(simulated.paths, IngestOptions(**SIM, ray=""))
    assert_same_trace(got, single)
    assert local_ray.is_initialized()  # a Ray this ingest did not start is left running


def test_cli_ray_takes_files_after_the_flag(simulated, single, local_ray, tmp_path, capsys):
    out = tmp_path / "ray.jsonl"
    # `--ray FILE ...`: argparse gives the first file to --ray; the CLI puts it back among the inputs.
    assert main(["ingest", "--ray", *map(str, simulated.paths), *SIM_ARGS, "--quiet", "--out", str(out)]) == 0
    want = tmp_path / "single.jsonl"
    assert main(["ingest", *map(str, simulated.paths), *SIM_ARGS, "--quiet", "--out", str(want)]) == 0
    assert sorted(out.read_text().splitlines()) == sorted(want.read_text().splitlines())
    # `--ray DIR`: the same for a directory of ranks (the files' paths are on the spans: the same paths)
    job = tmp_path / "job"
    job.mkdir()
    links = [job / path.name for path in simulated.paths]
    for link, path in zip(links, simulated.paths):
        link.symlink_to(path)
    from_dir, from_links = tmp_path / "dir.jsonl", tmp_path / "links.jsonl"
    assert main(["ingest", "--ray", str(job), *SIM_ARGS, "--quiet", "--out", str(from_dir)]) == 0
    assert main(["ingest", *map(str, links), *SIM_ARGS, "--quiet", "--out", str(from_links)]) == 0
    assert sorted(from_dir.read_text().splitlines()) == sorted(from_links.read_text().splitlines())


def test_ray_bad_rank_is_one_line_naming_it(simulated, local_ray, tmp_path, capfd):
    bad = tmp_path / "rank-8.json.gz"
    bad.write_text("this is not a trace\n")
    out = tmp_path / "out.jsonl"
    ray_log = _Collect()
    logging.getLogger("ray").addHandler(ray_log)
    try:
        code = main(["ingest", str(simulated.paths[0]), str(bad), *map(str, simulated.paths[2:]), "--ray", "--quiet",
                     "--out", str(out)])
        # Ray logs (to the stderr it found at start) a traceback for each failed or cancelled task result
        # dropped unread: give it that chance.
        gc.collect()
        time.sleep(2)
    finally:
        logging.getLogger("ray").removeHandler(ray_log)
    err = capfd.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "rank-8.json.gz" in err[0] and "Traceback" not in err[0], err
    assert not [m for m in ray_log.messages if "Unhandled error" in m], ray_log.messages
    assert not out.exists()


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _ingest_ray(address: str, tmp_path) -> subprocess.CompletedProcess:
    out = tmp_path / "out.jsonl"
    proc = subprocess.run([sys.executable, "-m", "plasmient_trace.cli", "ingest", *map(str, map(trace_path, REAL)),
                           "--ray", address, "--quiet", "--out", str(out)],
                          check=False, capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])})
    assert not out.exists()
    return proc


def test_ray_at_an_address_where_no_head_answers_is_one_line(tmp_path):
    # ray.init alone retries such an address for some 12 minutes, printing its own log lines all along
    pytest.importorskip("ray", reason="Ray is the optional [ray] extra: pip install 'plasmient-trace[ray]'")
    import http.server
    import threading

    from test_export import free_port

    closed = free_port()
    proc = _ingest_ray(f"127.0.0.1:{closed}", tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr[-2000:]
    assert f"--ray 127.0.0.1:{closed}: nothing answers at " in proc.stderr and "Connection refused" in proc.stderr
    # the dashboard's HTTP port, a likely mix-up (Ray's job CLI takes http://head:8265): it answers, not as Ray
    web = http.server.ThreadingHTTPServer(("0.0.0.0", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        for address in (f"127.0.0.1:{web.server_port}", f"http://127.0.0.1:{web.server_port}"):
            proc = _ingest_ray(address, tmp_path)
            assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr[-2000:]
            assert f"--ray {address}: " in proc.stderr and "not the dashboard's URL (8265)" in proc.stderr
    finally:
        web.shutdown()


def test_the_ray_head_check_knows_a_head_from_a_silent_port(local_ray):
    from plasmient_trace.runners import _unreachable

    assert _unreachable(local_ray.get_runtime_context().gcs_address) is None  # a real GCS greets in gRPC
    with socket_listening() as port:  # accepts, never says a word
        assert _unreachable(f"127.0.0.1:{port}", timeout=0.5).startswith("no answer from ")
    assert _unreachable("auto") is None and _unreachable("local") is None  # Ray finds those itself


@contextlib.contextmanager
def socket_listening() -> Iterator[int]:
    """A port that accepts connections and never says a word."""
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen(4)
        yield s.getsockname()[1]


def test_ray_flag_without_ray_says_how_to_install(monkeypatch, tmp_path, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    out = tmp_path / "out.jsonl"
    code = main(["ingest", str(trace_path(REAL[0])), str(trace_path(REAL[1])), "--ray", "--quiet",
                 "--out", str(out)])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "plasmient: error: --ray needs Ray: pip install 'plasmient-trace[ray]'"]
    assert not out.exists()


def test_the_parquet_export_still_gets_every_rank_records(simulated, tmp_path, capsys):
    pq = pytest.importorskip("pyarrow.parquet")
    out_dir = tmp_path / "pq"
    paths = simulated.paths[:2]
    assert main(["ingest", *map(str, paths), "--workers", "2", "--quiet", "--out", str(tmp_path / "o.jsonl"),
                 "--parquet", str(out_dir)]) == 0
    kernels = pq.read_table(out_dir / "kernels.parquet")
    # Oracle: the GPU activities in the raw JSON of each file (kernels, memcpys, memsets), counted per rank.
    for rank, path in enumerate(paths):
        with gzip.open(path, "rt") as f:
            events = json.load(f)["traceEvents"]
        want = sum(1 for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
        assert kernels.filter(pc.equal(kernels.column("rank"), rank)).num_rows == want, rank
