"""resource_from_env: where a live capture's job, node and rank come from."""

from __future__ import annotations

import os
import socket

from plasmient_trace.conventions import RESOURCE_ATTRIBUTES
from plasmient_trace.sources.resource import job_id_from_env, parse_otel_resource_attributes, resource_from_env


def test_bare_environment_gives_host_pid_and_default_service():
    res = resource_from_env({})
    assert res == {"host.name": socket.gethostname(), "process.pid": os.getpid(), "service.name": "plasmient-trace"}


def test_torchrun_variables_become_integer_ranks():
    res = resource_from_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "run-7"})
    assert res["plasmient.rank"] == 3 and res["plasmient.world_size"] == 8 and res["plasmient.local_rank"] == 1
    assert res["plasmient.job.id"] == "run-7"


def test_slurm_variables_fill_in_where_torchrun_is_absent():
    env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1"}
    res = resource_from_env(env)
    assert res["plasmient.job.id"] == "4242.0" and res["plasmient.slurm.job_id"] == "4242"
    assert res["plasmient.slurm.step_id"] == "0"
    assert (res["plasmient.rank"], res["plasmient.world_size"], res["plasmient.local_rank"]) == (5, 16, 1)


def test_torchrun_rank_wins_over_slurm_and_plasmient_job_id_wins_over_both():
    res = resource_from_env({"RANK": "2", "SLURM_PROCID": "9", "SLURM_JOB_ID": "1", "PLASMIENT_JOB_ID": "mine"})
    assert res["plasmient.rank"] == 2 and res["plasmient.job.id"] == "mine"


def test_kubernetes_downward_api():
    res = resource_from_env({"POD_NAME": "trainer-0", "POD_NAMESPACE": "ml", "NODE_NAME": "gpu-node-3"})
    assert (res["k8s.pod.name"], res["k8s.namespace.name"], res["k8s.node.name"]) == ("trainer-0", "ml", "gpu-node-3")
    alt = resource_from_env({"K8S_POD_NAME": "p", "K8S_NAMESPACE": "n", "K8S_NODE_NAME": "x"})
    assert (alt["k8s.pod.name"], alt["k8s.namespace.name"], alt["k8s.node.name"]) == ("p", "n", "x")


def test_otel_resource_attributes_are_percent_decoded_and_override_detection():
    res = resource_from_env({"OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod,team=ml%20infra,host.name=h1,bogus",
                             "RANK": "0"})
    assert res["deployment.environment"] == "prod" and res["team"] == "ml infra"
    assert res["host.name"] == "h1"
    assert "bogus" not in res


def test_service_name_precedence():
    assert resource_from_env({"OTEL_RESOURCE_ATTRIBUTES": "service.name=a"})["service.name"] == "a"
    assert resource_from_env({"OTEL_RESOURCE_ATTRIBUTES": "service.name=a", "OTEL_SERVICE_NAME": "b"})["service.name"] == "b"


def test_garbled_rank_is_dropped_not_raised():
    res = resource_from_env({"RANK": "zero", "SLURM_PROCID": "4"})
    assert res["plasmient.rank"] == 4
    assert "plasmient.rank" not in resource_from_env({"RANK": "zero"})


def test_every_detected_key_is_a_documented_resource_attribute():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "SLURM_JOB_ID": "9", "SLURM_STEP_ID": "3",
           "POD_NAME": "p", "POD_NAMESPACE": "n", "NODE_NAME": "x", "OTEL_SERVICE_NAME": "s"}
    assert set(resource_from_env(env)) <= set(RESOURCE_ATTRIBUTES)


def test_parse_handles_empty_and_spaces():
    assert parse_otel_resource_attributes("") == {}
    assert parse_otel_resource_attributes(" a = 1 , b=2") == {"a": "1", "b": "2"}


def test_bytes_of_the_environment_that_are_not_utf8_ingest_as_replacement_characters(tmp_path, monkeypatch):
    # OTEL_RESOURCE_ATTRIBUTES=$'team=\xff' failed the ingest with "cannot stitch (TypeError: str is not valid
    # UTF-8)", naming the trace; os.environ keeps such a byte as a lone surrogate
    from conftest import trace_path

    from plasmient_trace.cli import main
    from plasmient_trace.export.otlp_json import read_jsonl

    assert parse_otel_resource_attributes("team=\udcff,x=%FF") == {"team": "\ufffd", "x": "\ufffd"}
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "team=ml\udcff")
    out = tmp_path / "t.jsonl"
    assert main(["ingest", str(trace_path("h100/bert_small_inference.json.gz")), "--out", str(out), "--quiet"]) == 0
    assert {r.get("team") for r in read_jsonl(out).resources} == {"ml\ufffd"}


def test_two_runs_under_one_slurm_job_id_get_different_job_ids():
    # each srun of a batch script is a job step; a requeued job keeps its id and runs its steps again
    assert job_id_from_env({"SLURM_JOB_ID": "4242"}) == "4242"  # the batch script itself
    assert job_id_from_env({"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0"}) == "4242.0"
    assert job_id_from_env({"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "1"}) == "4242.1"
    assert job_id_from_env({"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_RESTART_COUNT": "0"}) == "4242.0"
    assert job_id_from_env({"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_RESTART_COUNT": "2"}) == "4242.0-restart2"
    assert job_id_from_env({"SLURM_JOB_ID": "4242", "TORCHELASTIC_RUN_ID": "r"}) == "4242"  # Slurm first


def test_torchruns_default_rendezvous_id_names_no_job():
    # `torchrun --master-port P` without --rdzv-id: every such job has TORCHELASTIC_RUN_ID=none
    assert job_id_from_env({"TORCHELASTIC_RUN_ID": "none"}) is None
    assert "plasmient.job.id" not in resource_from_env({"TORCHELASTIC_RUN_ID": "none", "RANK": "1"})
    assert job_id_from_env({"TORCHELASTIC_RUN_ID": "3f2a-uuid"}) == "3f2a-uuid"  # --standalone, --rdzv-id


def test_torchruns_restarted_workers_get_a_job_id_of_their_own():
    # they resume from a checkpoint and run the same step numbers again, under the same run id
    env = {"TORCHELASTIC_RUN_ID": "exp", "TORCHELASTIC_RESTART_COUNT": "0"}
    assert job_id_from_env(env) == "exp"
    assert job_id_from_env({**env, "TORCHELASTIC_RESTART_COUNT": "1"}) == "exp-restart1"
    assert job_id_from_env({**env, "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "1"}) is None


def test_plasmient_job_id_is_taken_as_given():
    env = {"PLASMIENT_JOB_ID": "exp-7", "SLURM_JOB_ID": "1", "SLURM_STEP_ID": "3", "SLURM_RESTART_COUNT": "1"}
    assert job_id_from_env(env) == "exp-7"
    assert job_id_from_env({"PLASMIENT_JOB_ID": "  ", "SLURM_JOB_ID": "9"}) == "9"
    assert job_id_from_env({}) is None
