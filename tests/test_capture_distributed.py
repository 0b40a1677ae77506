"""Live multi-rank tracing: every rank writes its own file, and together the files hold one trace per
step with exactly one fleet span and one node span per host, built from all ranks' numbers.

The exchange itself is tested in-process over a c10d HashStore with two real ranks' traces (the result
must equal the offline stitch of both); the whole path runs under ``torchrun`` as users run it:
``plasmient run -- torchrun --standalone --nproc_per_node=2 examples/ddp_tiny.py`` over gloo, once on
one host and once with a simulated second node (host.name from OTEL_RESOURCE_ATTRIBUTES per rank).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from test_export import free_port

from plasmient_trace import pipeline
from plasmient_trace.capture import distributed
from plasmient_trace.export.otlp_json import read_jsonl
from plasmient_trace.stitch import ids
from plasmient_trace.stitch.tree import StitchOptions

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces" / "a100_multirank"
BIN = Path(sys.executable).parent
OPTIONS = pipeline.IngestOptions(job_id="x", gpu_model="NVIDIA A100-SXM4-80GB")


def _levels(table: pa.Table, *levels: str) -> list[dict]:
    return table.filter(pc.is_in(table.column("plasmient.level"), value_set=pa.array(list(levels)))).to_pylist()


# ---------------------------------------------------------------------------------------------
# The exchange, in-process


@pytest.fixture(scope="module")
def a100():
    # each rank stitched alone and without fleet/node spans, as a live rank is (IngestOptions.top_spans)
    alone = [pipeline.ingest_paths([TRACES / f"rank-{r}.json.gz"], dataclasses.replace(OPTIONS, top_spans=False)).batch
             for r in (0, 1)]
    assert not any(_levels(b.table, "fleet", "node") for b in alone)
    joint = pipeline.ingest_paths([TRACES / "rank-0.json.gz", TRACES / "rank-1.json.gz"], OPTIONS).batch
    return alone, joint


def _run_ranks(batches, hosts=None, wait="5"):
    """Each batch coordinated by its own 'rank', concurrently, over one shared store."""
    import torch.distributed as dist

    store = dist.HashStore()
    said: list[tuple[str, str]] = []
    out: list = [None] * len(batches)

    def rank(r: int) -> None:
        batch = batches[r]
        if hosts:
            for res in batch.resources:
                if "plasmient.rank" in res:  # the rank's own resource
                    res["host.name"] = hosts[r]
            for summary in batch.summaries:  # and what the rank tells the others about itself
                summary.host = hosts[r]
        group = distributed.Group(store=store, rank=r, world_size=2, backend="gloo")
        out[r] = distributed.coordinate(batch, "x", StitchOptions(job_id="x"), say=lambda k, m: said.append((k, m)),
                                        environ={"PLASMIENT_FLEET_WAIT_S": wait}, group=group)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out, said, store


def test_ranks_exchange_summaries_into_the_offline_fleet_and_node_spans(a100):
    alone, joint = a100
    (b0, b1), said, store = _run_ranks(alone)
    assert said == []
    # rank 1 shares rank 0's host: it exports its own subtree only
    assert {r["plasmient.level"] for r in _levels(b1.table, "fleet", "node")} == set()
    mine = {r["span_id"]: r for r in _levels(b0.table, "fleet", "node")}
    ref = {r["span_id"]: r for r in _levels(joint.table, "fleet", "node")}
    assert set(mine) == set(ref)
    for span_id, row in mine.items():
        for name in ("parent_span_id", "trace_id", "start_ns", "end_ns", "plasmient.gpus", "plasmient.kernels",
                     "plasmient.culprit.rank"):
            assert row[name] == ref[span_id][name], name
        for name in ("plasmient.flops", "plasmient.busy_s", "plasmient.mfu", "plasmient.util.resident",
                     "plasmient.cost.usd", "plasmient.cost.wasted_usd"):
            assert row[name] == pytest.approx(ref[span_id][name], rel=1e-9), name
        assert b0.resources[row["resource_index"]] == joint.resources[ref[span_id]["resource_index"]]
    # every rank span still points at its node span, now exported once (by rank 0)
    for batch in (b0, b1):
        for rank_row in _levels(batch.table, "rank"):
            assert rank_row["parent_span_id"] in mine
    # summaries read by all their readers are deleted: the store does not grow with the job
    assert not any(store.check([f"plasmient/x/{step}/{r}"]) for step in (551, 552) for r in (0, 1))


def test_each_host_leader_emits_its_node_span(a100):
    alone, _ = a100
    (b0, b1), said, _ = _run_ranks([pa_copy(b) for b in alone], hosts=["host-a", "host-b"])
    assert said == []
    assert Counter(r["name"] for r in _levels(b0.table, "fleet", "node")) == \
        Counter({"fleet step 551": 1, "fleet step 552": 1, "node host-a": 2})
    node_b = _levels(b1.table, "fleet", "node")
    assert {r["name"] for r in node_b} == {"node host-b"} and all(r["plasmient.gpus"] == 1 for r in node_b)
    fleets = {r["plasmient.step"]: r["span_id"] for r in _levels(b0.table, "fleet")}
    assert all(r["parent_span_id"] == fleets[r["plasmient.step"]] for r in node_b)


def test_a_missing_rank_leaves_a_fleet_span_of_the_ranks_that_arrived(a100):
    alone, _ = a100
    (b0,), said, _ = _run_ranks([pa_copy(alone[0])], wait="0.2")
    fleets = _levels(b0.table, "fleet")
    assert len(fleets) == 2 and all(r["plasmient.gpus"] == 1 for r in fleets)
    assert all(r["plasmient.fleet.ranks_missing"] == 1 for r in fleets)  # one rank of two per step
    assert [k for k, _ in said] == ["fleet-missing"] and "2 rank summary" in said[0][1]


def test_ranks_without_a_job_id_take_rank_0s():
    import torch.distributed as dist

    store = dist.HashStore()
    got: list = [None]
    follower = threading.Thread(target=lambda: got.__setitem__(0, distributed.shared_job_id(
        "host-b-2-T", 30, distributed.Group(store=store, rank=1, world_size=2, backend="gloo"))))
    follower.start()  # waits: rank 0 has not published yet
    leader = distributed.shared_job_id("host-a-1-T", 30, distributed.Group(store=store, rank=0, world_size=2, backend="gloo"))
    follower.join(30)
    assert (leader, got[0]) == ("host-a-1-T", "host-a-1-T")


def test_a_restarted_attempt_never_reads_the_job_id_an_earlier_one_left_in_the_store():
    # torchrun's restarted workers share their agent's store with the attempt before: its key is still there
    import torch.distributed as dist

    store = dist.HashStore()
    lead = [distributed.Group(store=store, rank=r, world_size=2, backend="gloo") for r in (0, 1)]
    assert distributed.shared_job_id("run", 5, lead[0], attempt="0") == "run"
    assert distributed.shared_job_id("run", 5, lead[1], attempt="0") == "run"
    # attempt 1: rank 1 comes first and must wait for rank 0 of this attempt, not take attempt 0's
    assert distributed.shared_job_id("run-restart1", 0.1, lead[1], attempt="1") is None
    assert distributed.shared_job_id("run-restart1", 5, lead[0], attempt="1") == "run-restart1"
    assert distributed.shared_job_id("run-restart1", 5, lead[1], attempt="1") == "run-restart1"


def test_a_rank_whose_leader_never_publishes_keeps_its_own_id_and_says_so(monkeypatch):
    import torch.distributed as dist

    from plasmient_trace.capture import batches

    said: list[tuple[str, str]] = []
    monkeypatch.setattr(batches, "say_once", lambda key, msg: said.append((key, msg)))
    monkeypatch.setattr(distributed, "_group", distributed.Group(store=dist.HashStore(), rank=1, world_size=2, backend="gloo"))
    session = SimpleNamespace(job_id="host-b-2-T", job_id_shared=False, resource={"plasmient.job.id": "host-b-2-T"},
                              config=SimpleNamespace(environ={"PLASMIENT_FLEET_WAIT_S": "0.1"}))
    batches.agree_job_id(session)
    assert session.job_id == "host-b-2-T" and session.job_id_shared  # tried once, not at every batch
    assert [k for k, _ in said] == ["job-id-not-shared"] and "PLASMIENT_JOB_ID" in said[0][1]
    named = SimpleNamespace(job_id="4242.0", job_id_shared=True, resource={}, config=session.config)
    batches.agree_job_id(named)  # a job id the environment named is every rank's already: no wait
    assert named.job_id == "4242.0" and len(said) == 1


def pa_copy(batch):
    """A batch whose resources and rank summaries can be edited without touching the module fixture."""
    return type(batch)(table=batch.table, resources=[dict(r) for r in batch.resources],
                       summaries=[dataclasses.replace(s) for s in batch.summaries])


# ---------------------------------------------------------------------------------------------
# The whole path under torchrun


@pytest.fixture(scope="module")
def env(warm_cache) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PLASMIENT_", "TORCHELASTIC_"))}
    e["PLASMIENT_CACHE_DIR"] = str(warm_cache)  # the observer built and the CPU calibrated once
    e["PLASMIENT_EVERY"] = "1"  # every step at full depth: the flops sums are checked on each
    e["PLASMIENT_FLUSH_TIMEOUT_S"] = "60"  # let rank 0 wait for rank 1 at exit
    e["PYTHONUNBUFFERED"] = "1"
    return e


def _torchrun(worker: list[str], env: dict[str, str], cwd: Path, launch: tuple[str, ...] = ("--standalone",)) -> list[pa.Table]:
    cmd = [str(BIN / "plasmient"), "run", "--", str(BIN / "torchrun"), *launch, "--nproc_per_node=2", *worker]
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "could not" not in proc.stderr, proc.stderr[-3000:]
    files = sorted(cwd.glob("traces.rank*.jsonl"))
    assert [f.name for f in files] == ["traces.rank0.jsonl", "traces.rank1.jsonl"]
    return [read_jsonl(f) for f in files]


def _check_one_tree_per_step(batches, steps: int, hosts: int) -> tuple[list[dict], list[dict], list[dict]]:
    table = pa.concat_tables([b.table for b in batches])
    fleets, nodes, ranks = (_levels(table, lv) for lv in ("fleet", "node", "rank"))
    job = ranks[0]["plasmient.job.id"]
    assert {r["plasmient.job.id"] for r in ranks} == {job}  # TORCHELASTIC_RUN_ID, shared by the ranks
    for step in range(steps):
        in_step = [r for r in table.select(["trace_id", "plasmient.step"]).to_pylist() if r["plasmient.step"] == step]
        assert {r["trace_id"] for r in in_step} == {ids.trace_id(job, step)}
        fleet = [r for r in fleets if r["plasmient.step"] == step]
        node = [r for r in nodes if r["plasmient.step"] == step]
        rank = [r for r in ranks if r["plasmient.step"] == step]
        assert len(fleet) == 1 and len(node) == hosts and sorted(r["plasmient.rank"] for r in rank) == [0, 1]
        f = fleet[0]
        assert f["parent_span_id"] == 0 and f["span_id"] == ids.fleet_span_id(job, step)
        assert all(n["parent_span_id"] == f["span_id"] for n in node)
        node_ids = {n["span_id"] for n in node}
        assert all(r["parent_span_id"] in node_ids for r in rank)
        assert f["plasmient.gpus"] == 2 and sum(n["plasmient.gpus"] for n in node) == 2
        assert f["plasmient.flops"] == pytest.approx(sum(r["plasmient.flops"] for r in rank)) and f["plasmient.flops"] > 0
        assert f["plasmient.busy_s"] == pytest.approx(sum(r["plasmient.busy_s"] for r in rank))
        assert f["plasmient.culprit.rank"] in {0, 1}
        assert 0 < f["plasmient.mfu"] <= f["plasmient.util.resident"] <= 1
        assert f["start_ns"] == min(r["start_ns"] for r in rank) and f["end_ns"] == max(r["end_ns"] for r in rank)
    return fleets, nodes, ranks


def test_torchrun_two_ranks_one_node(env, tmp_path):
    batches = _torchrun([str(ROOT / "examples" / "ddp_tiny.py"), "--steps", "3"], env, tmp_path)
    _check_one_tree_per_step(batches, steps=3, hosts=1)
    # rank 0 exported the fleet and the node span; rank 1 only its own subtree
    assert {r["plasmient.level"] for r in _levels(batches[1].table, "fleet", "node")} == set()
    # gloo collectives are the CPU's communication, not memory-bound work
    collectives = [r for b in batches for r in _levels(b.table, "op")
                   if r["name"].startswith(("gloo:", "c10d::")) and r["plasmient.device.window_s"]]
    assert collectives and {r["plasmient.bound"] for r in collectives} == {"communication"}


def test_torchrun_simulated_second_node(env, tmp_path):
    # each worker names its own host, as a second machine would: rank 1 becomes node sim-1's leader
    worker = ["--no-python", "sh", "-c", f'OTEL_RESOURCE_ATTRIBUTES=host.name=sim-$RANK exec "{sys.executable}" '
                                         f'"{ROOT / "examples" / "ddp_tiny.py"}" --steps 2']
    batches = _torchrun(worker, env, tmp_path)
    _, nodes, _ = _check_one_tree_per_step(batches, steps=2, hosts=2)
    for r, batch in enumerate(batches):
        node_rows = _levels(batch.table, "node")
        assert {n["name"] for n in node_rows} == {f"node sim-{r}"}
        assert {batch.resources[n["resource_index"]]["host.name"] for n in node_rows} == {f"sim-{r}"}
    assert all(n["plasmient.gpus"] == 1 for n in nodes)


def test_torchrun_ranks_sharing_one_out_file_never_tear_a_line(env, tmp_path):
    out = tmp_path / "shared.jsonl"
    cmd = [str(BIN / "plasmient"), "run", "--out", str(out), "--", str(BIN / "torchrun"), "--standalone",
           "--nproc_per_node=2", str(ROOT / "examples" / "ddp_tiny.py"), "--steps", "3"]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = out.read_bytes().split(b"\n")
    assert lines[-1] == b"" and all(line.startswith(b'{"resourceSpans"') for line in lines[:-1])
    assert max(map(len, lines)) > 4096  # longer than PIPE_BUF: only one write per line keeps them whole
    batch = read_jsonl(out)  # every line parses
    _check_one_tree_per_step([batch], steps=3, hosts=1)  # both ranks' every step, in one file


def test_torchrun_without_a_rendezvous_id_still_gives_each_run_its_own_traces(env, tmp_path):
    # torchrun's static rendezvous (--master-port, as on several nodes) sets TORCHELASTIC_RUN_ID=none for
    # every job: taken as the job id, every such run would write its step N into the same trace
    port = free_port()
    batches = _torchrun([str(ROOT / "examples" / "ddp_tiny.py"), "--steps", "2"], env, tmp_path,
                        launch=("--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={port}"))
    _, _, ranks = _check_one_tree_per_step(batches, steps=2, hosts=1)  # the ranks agreed on one id
    rank0_pid = next(r["process.pid"] for r in batches[0].resources if r.get("plasmient.rank") == 0)
    assert f"-{rank0_pid}-" in ranks[0]["plasmient.job.id"]  # rank 0's own host-pid-time, not "none"



def test_live_ranks_publish_a_bounded_culprit_list_and_the_fleet_says_what_it_may_lack(a100, monkeypatch):
    """Live ranks hand rank 0 their step summaries through the c10d store; a step's whole culprit list (229
    rows on this job) from every rank would be megabytes a step, so each publishes its first
    PUBLISHED_CULPRITS rows and the most a left-out row may hold. The fleet rows that cut cannot have
    shortened equal the offline ones; the others say lower_bound and are never above them."""
    import json as json_mod

    alone, joint = a100
    published = []
    real = distributed._published

    def spy(summary):
        out = real(summary)
        published.append(json_mod.loads(json_mod.dumps(out.to_json())))  # as the store holds it
        return out

    monkeypatch.setattr(distributed, "_published", spy)
    (b0, _), said, _ = _run_ranks(alone)
    assert said == [] and published
    assert all(len(s["culprits"]) <= distributed.PUBLISHED_CULPRITS for s in published)
    assert any(s["culprits_left_out_s"] > 0 for s in published)  # this job's steps have more rows than that
    ref = {r["span_id"]: r for r in _levels(joint.table, "fleet")}
    for row in _levels(b0.table, "fleet"):
        offline = {(c["kernel"], c["op"], c["module"]): c["wasted_s"] for c in json_mod.loads(ref[row["span_id"]]["plasmient.culprits"])}
        live = json_mod.loads(row["plasmient.culprits"])
        assert row["plasmient.culprits.left_out_s"] > 0
        for c in live:
            truth = offline[(c["kernel"], c["op"], c["module"])]
            if c.get("lower_bound"):
                assert c["wasted_s"] <= truth * (1 + 1e-9)
            else:
                assert c["wasted_s"] == pytest.approx(truth, rel=1e-9)
        assert [c["wasted_s"] for c in live[:5]] == pytest.approx(sorted(offline.values(), reverse=True)[:5], rel=1e-9)


def test_every_full_depth_step_of_every_rank_holds_its_gloo_collective(env, tmp_path):
    """Gloo completes a collective's future, which wakes the training thread, before its own thread ends the
    op (gloo:all_reduce). A full-depth step sampled between step-depth ones could end, and the op observer
    stop, first: the op was never recorded, and about one rank-step in five had DDP's c10d::allreduce_
    without the gloo:all_reduce that did the work (the step's communication 0.1 ms instead of 4). A full
    step's end now waits briefly for the async ops it began."""
    batches = _torchrun([str(ROOT / "examples" / "ddp_tiny.py"), "--steps", "20"], {**env, "PLASMIENT_EVERY": "2"},
                        tmp_path)
    for batch in batches:
        rows = batch.table.select(["name", "plasmient.level", "plasmient.step", "plasmient.sampled_depth"]).to_pylist()
        full = {r["plasmient.step"] for r in rows if r["plasmient.level"] == "step" and r["plasmient.sampled_depth"] == "full"}
        assert len(full) >= 8  # about one full rank-step in five lost its op before: 20 rank-steps all but always show it
        issued = Counter(r["plasmient.step"] for r in rows if r["name"] == "c10d::allreduce_")
        done = Counter(r["plasmient.step"] for r in rows if r["name"] == "gloo:all_reduce")
        assert {s: done[s] for s in sorted(full)} == {s: issued[s] for s in sorted(full)} and all(issued[s] for s in full)
