"""OTel resource attributes of the running process, read from its environment.

Live capture has no trace file to read the job, node and rank from, so they come from what the
scheduler and launcher put into the environment: Slurm (SLURM_*), torchrun (RANK, WORLD_SIZE,
LOCAL_RANK, TORCHELASTIC_RUN_ID), the Kubernetes downward API (POD_NAME, POD_NAMESPACE, NODE_NAME)
and the standard OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES. Keys are the names listed in
``conventions.RESOURCE_ATTRIBUTES``; values the OTel spec types (ints stay ints).
"""

from __future__ import annotations

import os
import socket
from typing import Any, Mapping
from urllib.parse import unquote

DEFAULT_SERVICE_NAME = "plasmient-trace"

# torchrun's TORCHELASTIC_RUN_ID when --rdzv-id was not given (static rendezvous, e.g. --master-port on
# several nodes): every such job would share it, and with it the trace id of each step.
TORCHRUN_DEFAULT_RUN_ID = "none"

# (attribute, environment variables in order of preference, value type); plasmient.job.id: job_id_from_env
_FROM_ENV: tuple[tuple[str, tuple[str, ...], type], ...] = (
    ("plasmient.rank", ("RANK", "SLURM_PROCID"), int),
    ("plasmient.world_size", ("WORLD_SIZE", "SLURM_NTASKS"), int),
    ("plasmient.local_rank", ("LOCAL_RANK", "SLURM_LOCALID"), int),
    ("plasmient.slurm.job_id", ("SLURM_JOB_ID",), str),
    ("plasmient.slurm.step_id", ("SLURM_STEP_ID",), str),
    ("k8s.pod.name", ("POD_NAME", "K8S_POD_NAME"), str),
    ("k8s.namespace.name", ("POD_NAMESPACE", "K8S_NAMESPACE"), str),
    ("k8s.node.name", ("NODE_NAME", "K8S_NODE_NAME"), str),
)


def parse_otel_resource_attributes(text: str) -> dict[str, str]:
    """``key1=value1,key2=value2`` with percent-encoded values (OTel SDK environment spec).

    Malformed members (no '=') are skipped, as the spec tells SDKs to do, rather than failing the job.
    """
    out: dict[str, str] = {}
    for member in text.split(","):
        key, sep, value = member.partition("=")
        key = key.strip()
        if not sep or not key:
            continue
        out[_utf8(unquote(key))] = _utf8(unquote(value.strip()))
    return out


def _utf8(text: str) -> str:
    """Bytes of the environment that are not UTF-8 (Python keeps them as lone surrogates, which no encoder
    takes: the ingest failed with 'cannot stitch' naming the trace) as U+FFFD, as percent-decoding does."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _first(environ: Mapping[str, str], names: tuple[str, ...], kind: type) -> Any:
    """The first variable that is set and parses as ``kind``; a garbled one falls through to the next."""
    for name in names:
        value = environ.get(name)
        if value in (None, ""):
            continue
        try:
            return kind(value)
        except ValueError:
            continue  # a garbled launcher variable must not stop the job
    return None


def job_id_from_env(environ: Mapping[str, str] = os.environ) -> str | None:
    """The job id trace ids derive from, as the environment names one run of a job (None: it names none).

    PLASMIENT_JOB_ID as given. Else Slurm's job, qualified by what tells two runs under one job id apart
    and is the same on every task of a run: the job step (``12345.0``, each ``srun`` of a batch script its
    own) and the requeue count (``12345.0-restart1``, a requeued job keeps its id and starts its steps
    again). Else torchrun's rendezvous id, unless it is torchrun's default ``none``, with its restart count
    (``-restart1``: restarted workers resume from a checkpoint and run the same steps again). A trace id
    shared by two runs merges their steps into one trace, with duplicate span ids."""
    own = (environ.get("PLASMIENT_JOB_ID") or "").strip()
    if own:
        return own
    job = (environ.get("SLURM_JOB_ID") or "").strip()
    if job:
        step = (environ.get("SLURM_STEP_ID") or "").strip()
        return job + (f".{step}" if step else "") + _restarts(environ, "SLURM_RESTART_COUNT")
    run = (environ.get("TORCHELASTIC_RUN_ID") or "").strip()
    if not run or run == TORCHRUN_DEFAULT_RUN_ID:
        return None
    # torchrun restarts the workers under the same run id. Each node's agent counts its own restarts: a
    # node whose workers were only restarted to let another node join counts none, and its ranks' traces
    # then part from the others' (PLASMIENT_JOB_ID set per attempt avoids it)
    return run + _restarts(environ, "TORCHELASTIC_RESTART_COUNT")


def _restarts(environ: Mapping[str, str], variable: str) -> str:
    """"-restartN" when the launcher's restart counter is past 0, else ""."""
    count = (environ.get(variable) or "").strip()
    return f"-restart{count}" if count not in ("", "0") else ""


def resource_from_env(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """Resource attributes of this process: scheduler, launcher, Kubernetes and OTEL_* variables.

    Precedence follows the OTel SDK: OTEL_RESOURCE_ATTRIBUTES overrides what was detected, and
    OTEL_SERVICE_NAME overrides a service.name given there.
    """
    res: dict[str, Any] = {"host.name": socket.gethostname(), "process.pid": os.getpid()}
    job = job_id_from_env(environ)
    if job is not None:
        res["plasmient.job.id"] = job
    for attr, names, kind in _FROM_ENV:
        value = _first(environ, names, kind)
        if value is not None:
            res[attr] = value
    res.update(parse_otel_resource_attributes(environ.get("OTEL_RESOURCE_ATTRIBUTES", "")))
    service = environ.get("OTEL_SERVICE_NAME")
    if service:
        res["service.name"] = service
    res.setdefault("service.name", DEFAULT_SERVICE_NAME)
    return res
