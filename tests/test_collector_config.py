"""collector-config/: every file parses, refers only to things that exist, and matches what the exporters emit.

promtool (Prometheus' own checker) runs on prometheus.yml, alerts.yml and the alert unit test when it
is installed (Debian: `apt-get install prometheus`); the Collector, Tempo and Grafana files have no
checker here and say so in their headers.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest

yaml = pytest.importorskip("yaml")

CONFIG = Path(__file__).resolve().parents[1] / "collector-config"
YAML_FILES = sorted(p for p in CONFIG.rglob("*") if p.suffix in (".yaml", ".yml"))


def _load(name: str) -> dict:
    return yaml.safe_load((CONFIG / name).read_text())


def test_the_expected_files_exist() -> None:
    names = {str(p.relative_to(CONFIG)) for p in YAML_FILES}
    assert {
        "otel-collector.yaml", "prometheus.yml", "alerts.yml", "alerts_test.yml", "tempo.yaml",
        "docker-compose.yaml", "grafana/provisioning/datasources/datasources.yaml",
    } <= names


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(CONFIG)))
def test_every_file_parses_and_states_how_it_was_validated(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    assert isinstance(doc, dict) and doc
    header = "\n".join(line for line in path.read_text().splitlines()[:25] if line.startswith("#"))
    assert "Validation:" in header, f"{path.name}: the header must say which tool validated it (or none)"


def test_collector_pipelines_reference_only_defined_components() -> None:
    cfg = _load("otel-collector.yaml")
    service = cfg["service"]
    for ext in service.get("extensions", []):
        assert ext in cfg["extensions"]
    pipelines = service["pipelines"]
    assert {"traces", "metrics"} <= set(pipelines)
    used = {"receivers": set(), "processors": set(), "exporters": set()}
    for name, p in pipelines.items():
        for kind in used:
            for component in p.get(kind, []):
                assert component in cfg[kind], f"pipeline {name}: {kind[:-1]} {component!r} is not defined"
                used[kind].add(component)
        # The memory limiter must see data before anything buffers it.
        assert p["processors"][0] == "memory_limiter", name
        assert "batch" in p["processors"], name
    for kind, names in used.items():
        assert set(cfg[kind]) == names, f"defined but unused {kind}: {set(cfg[kind]) - names}"
    protocols = cfg["receivers"]["otlp"]["protocols"]
    assert {"grpc", "http"} <= set(protocols)


def test_collector_sends_traces_to_jaeger_and_tempo_and_metrics_with_exemplars() -> None:
    cfg = _load("otel-collector.yaml")
    traces = cfg["service"]["pipelines"]["traces"]["exporters"]
    hosts = {urlsplit("//" + cfg["exporters"][e]["endpoint"]).hostname for e in traces}
    assert hosts == {"jaeger", "tempo"}
    prom = cfg["exporters"]["prometheus"]
    assert prom["enable_open_metrics"] is True
    assert prom["add_metric_suffixes"] is False  # alerts.yml uses the unsuffixed names


def test_compose_wires_every_service_and_mounts_existing_files() -> None:
    compose = _load("docker-compose.yaml")
    services = compose["services"]
    assert {"collector", "jaeger", "tempo", "prometheus", "grafana"} <= set(services)
    for name, svc in services.items():
        for dep in svc.get("depends_on", []):
            assert dep in services, f"{name} depends on unknown {dep}"
        for vol in svc.get("volumes", []):
            src = vol.split(":", 1)[0]
            if src.startswith("."):
                assert (CONFIG / src).exists(), f"{name} mounts missing {src}"
    # Prometheus must store exemplars, or the Grafana exemplar -> trace link has nothing to show.
    assert "--enable-feature=exemplar-storage" in services["prometheus"]["command"]
    # Endpoints in the other files point at compose services and their ports.
    collector = _load("otel-collector.yaml")
    prom_port = collector["exporters"]["prometheus"]["endpoint"].rsplit(":", 1)[1]
    (job,) = _load("prometheus.yml")["scrape_configs"]
    (target,) = job["static_configs"][0]["targets"]
    assert target == f"collector:{prom_port}"
    for exporter in ("otlp/jaeger", "otlp/tempo"):
        host = collector["exporters"][exporter]["endpoint"].split(":")[0]
        assert host in services
    for ds in _load("grafana/provisioning/datasources/datasources.yaml")["datasources"]:
        assert urlsplit(ds["url"]).hostname in services, ds["name"]
    tempo = _load("tempo.yaml")
    assert tempo["server"]["http_listen_port"] == 3200
    assert tempo["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(":4317")


def test_grafana_links_exemplars_to_tempo_and_traces_to_metrics() -> None:
    sources = _load("grafana/provisioning/datasources/datasources.yaml")["datasources"]
    uids = {ds["uid"]: ds for ds in sources}
    assert {"prometheus", "tempo", "jaeger"} <= set(uids)
    (dest,) = uids["prometheus"]["jsonData"]["exemplarTraceIdDestinations"]
    assert dest["name"] == "trace_id"  # the label the OTel -> Prometheus exemplar conversion writes
    assert dest["datasourceUid"] == "tempo"
    ttm = uids["tempo"]["jsonData"]["tracesToMetrics"]
    assert ttm["datasourceUid"] in uids
    assert any(t["key"] == "plasmient.job.id" and t["value"] == "plasmient_job_id" for t in ttm["tags"])
    for q in ttm["queries"]:
        assert "$$__tags" in q["query"]  # $$ escapes Grafana's env interpolation in provisioning


def _prometheus_name(otel_name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", otel_name)


def test_alert_rules_use_metrics_and_labels_the_exporter_emits() -> None:
    from plasmient_trace.export.metrics import GAUGES, TRACE_INFO

    emitted = {_prometheus_name(n) for n, *_ in GAUGES} | {_prometheus_name(TRACE_INFO[0])}
    labels = {_prometheus_name(k) for k in ("plasmient.level", "plasmient.job.id", "plasmient.rank")} | {"job", "instance", "trace_id"}
    rules = {r["alert"]: r for g in _load("alerts.yml")["groups"] for r in g["rules"]}
    assert set(rules) == {"PlasmientLowMFU", "PlasmientUtilMfuGap"}
    for name, rule in rules.items():
        text = rule["expr"] + " ".join(rule["annotations"].values())
        for metric in re.findall(r"\bplasmient_[a-z_]+\b(?=\s*[{\[])", text):
            assert metric in emitted, f"{name}: {metric} is not a metric the exporter writes"
        for label in re.findall(r"\b([a-z_]+)\s*=~?\s*\"", rule["expr"]):
            assert label in labels, f"{name}: label {label}"
        assert {"jaeger_trace", "tempo_trace"} <= set(rule["annotations"])


def test_alert_unit_test_expects_the_links_the_cli_prints() -> None:
    from plasmient_trace.export.links import jaeger_link, tempo_link
    from plasmient_trace.stitch import ids

    trace = ids.trace_id("J", 7).hex()
    doc = _load("alerts_test.yml")
    expected = [a["exp_annotations"] for t in doc["tests"] for case in t["alert_rule_test"] for a in case["exp_alerts"]]
    assert expected
    for ann in expected:
        assert ann["jaeger_trace"] == jaeger_link("http://localhost:16686", trace)
        assert ann["tempo_trace"] == tempo_link("http://localhost:3000", trace)


PROMTOOL = shutil.which("promtool")


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)")
@pytest.mark.parametrize("args", [["check", "config", "prometheus.yml"], ["check", "rules", "alerts.yml"],
                                  ["test", "rules", "alerts_test.yml"]], ids=" ".join)
def test_promtool_accepts_the_prometheus_files(args: list[str]) -> None:
    run = subprocess.run([PROMTOOL, *args], cwd=CONFIG, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr


OTELCOL = next((shutil.which(n) for n in ("otelcol-contrib", "otelcontribcol") if shutil.which(n)), None)


@pytest.mark.skipif(OTELCOL is None, reason="no otelcol-contrib on PATH")
def test_otelcol_validates_the_collector_config() -> None:
    run = subprocess.run([OTELCOL, "validate", "--config", "otel-collector.yaml"], cwd=CONFIG,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
