"""Deployment files: Kubernetes manifests validate against the API schema, and the three
services' addresses, ports and probes agree with each other and with the CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from specwire.client.cli import build_parser

from specwire.config import OrchestratorConfig

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
OPERATIONS = DEPLOY.parent / "docs" / "operations.md"
# The start-up a startupProbe allows, over the slowest start measured (another machine, another load).
START_MARGIN = 1.5
KUBERNETES_VERSION = "1.30.0"


def manifests() -> list[dict[str, Any]]:
    docs = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for doc in manifests() if doc["kind"] == kind}


@pytest.mark.parametrize("doc", manifests(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_manifest_validates_against_the_kubernetes_schema(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_kustomization_lists_every_manifest() -> None:
    listed = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in (DEPLOY / "k8s").glob("*.yaml") if p.name != "kustomization.yaml")


def test_each_deployment_is_probed_on_its_own_grpc_port_and_parses_as_cli_args() -> None:
    parser = build_parser()
    services = by_kind("Service")
    for name, deployment in by_kind("Deployment").items():
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        args = parser.parse_args(container["args"])
        assert args.command == "serve" and args.host == "0.0.0.0"
        assert args.port == container["ports"][0]["containerPort"]
        # kubelet's gRPC probe speaks no TLS: it asks the plaintext health-only port.
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == (args.health_port or args.port)
        assert services[name]["spec"]["ports"][0]["port"] == args.port
        selector = services[name]["spec"]["selector"]
        assert all(deployment["spec"]["template"]["metadata"]["labels"][k] == v for k, v in selector.items())


def test_orchestrator_points_at_the_model_services() -> None:
    parser = build_parser()
    deployments, services = by_kind("Deployment"), by_kind("Service")
    container = deployments["specwire-orchestrator"]["spec"]["template"]["spec"]["containers"][0]
    args = parser.parse_args(container["args"])
    for address in (args.target, args.draft):
        host, port = address.split(":")
        assert services[host]["spec"]["ports"][0]["port"] == int(port)
        # Headless: the name resolves to every ready replica, each watched and used.
        assert services[host]["spec"]["clusterIP"] == "None"


def test_two_target_replicas_and_a_disruption_budget_that_keeps_one() -> None:
    target = by_kind("Deployment")["specwire-target"]
    assert target["spec"]["replicas"] == 2
    labels = target["spec"]["template"]["metadata"]["labels"]
    budget = by_kind("PodDisruptionBudget")["specwire-target"]["spec"]
    assert budget["selector"]["matchLabels"].items() <= labels.items()
    assert 1 <= budget["minAvailable"] < target["spec"]["replicas"]


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In"
        if labels.get(expression["key"]) not in expression["values"]:
            return False
    return True


def test_only_the_orchestrator_may_reach_the_model_services_grpc_ports() -> None:
    policy = by_kind("NetworkPolicy")["specwire-model-services"]["spec"]
    pods = {name: d["spec"]["template"]["metadata"]["labels"] for name, d in by_kind("Deployment").items()}
    selected = {name for name, labels in pods.items() if _selects(policy["podSelector"], labels)}
    assert selected == {"specwire-draft", "specwire-target"}
    assert policy["policyTypes"] == ["Ingress"]
    for rule in policy["ingress"]:
        ports = {port["port"] for port in rule["ports"]}
        if "grpc" in ports:
            senders = {name for name, labels in pods.items() for peer in rule["from"] if _selects(peer["podSelector"], labels)}
            assert senders == {"specwire-orchestrator"} and all(set(peer) == {"podSelector"} for peer in rule["from"])
        else:
            assert ports <= {"health", "metrics"}  # probes and scraping carry no session


def test_every_container_requests_and_limits_cpu_and_memory_and_model_services_get_a_gpu() -> None:
    for name, deployment in by_kind("Deployment").items():
        pod = deployment["spec"]["template"]["spec"]
        for container in pod["containers"]:
            resources = container["resources"]
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources[bound]), (name, bound)
        if name != "specwire-orchestrator":
            assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == 1
            assert pod["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])


def test_tls_material_and_tokens_come_from_secrets_mounted_where_the_args_look() -> None:
    parser = build_parser()
    for name, deployment in by_kind("Deployment").items():
        pod = deployment["spec"]["template"]["spec"]
        container = pod["containers"][0]
        args = parser.parse_args(container["args"])
        volumes = {v["name"]: v["secret"] for v in pod["volumes"] if "secret" in v}
        mounted: set[str] = set()
        for mount in container["volumeMounts"]:
            if mount["name"] not in volumes:
                continue  # the compile cache
            secret = volumes[mount["name"]]
            mounted |= {f"{mount['mountPath']}/{item['path']}" for item in secret["items"]}
        if args.role == "orchestrator":
            files = [args.services_tls_ca, args.services_tls_cert, args.services_tls_key, args.auth_token_file]
            assert {v["secretName"] for v in volumes.values()} == {"specwire-tls", "specwire-auth"}
        else:
            files = [args.tls_cert, args.tls_key, args.tls_client_ca]  # mutual TLS: client certificates required
            assert {v["secretName"] for v in volumes.values()} == {"specwire-tls"}
        assert all(files) and set(files) <= mounted, (name, files, mounted)


def test_compose_wires_the_same_three_services() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    parser = build_parser()
    parsed = {name: parser.parse_args(service["command"]) for name, service in compose["services"].items()}
    assert {args.role for args in parsed.values()} == {"draft", "target", "orchestrator"}
    orchestrator = parsed["orchestrator"]
    targets = sorted(name for name, args in parsed.items() if args.role == "target")
    assert len(targets) == 2
    assert orchestrator.target == ",".join(f"{name}:{parsed[name].port}" for name in targets)
    assert orchestrator.draft == f"draft:{parsed['draft'].port}"


def test_dockerfile_pins_torch_before_the_project() -> None:
    lines = (DEPLOY / "Dockerfile").read_text().splitlines()
    torch_line = next(i for i, line in enumerate(lines) if "pip install torch==" in line)
    project_line = next(i for i, line in enumerate(lines) if line.strip().startswith('RUN pip install ".['))
    assert torch_line < project_line


def test_dockerfile_copies_every_package_folder() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python ≥ 3.11
    pyproject = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())
    folders = {"specwire", *(path.split("/")[0] for path in pyproject["tool"]["setuptools"]["package-dir"].values())}
    copied = {line.split()[1] for line in (DEPLOY / "Dockerfile").read_text().splitlines() if line.startswith("COPY ")}
    assert folders <= copied, f"not copied into the image: {sorted(folders - copied)}"


def test_compose_tls_overlay_gives_every_hop_mutual_tls_from_mounted_files() -> None:
    base = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
    overlay = yaml.safe_load((DEPLOY / "compose.tls.yaml").read_text())["services"]
    assert set(overlay) == set(base)
    parser = build_parser()
    for name, service in overlay.items():
        args = parser.parse_args(service["command"])
        assert args == parser.parse_args(base[name]["command"] + service["command"][len(base[name]["command"]):])
        mounts = [volume.split(":")[1] for volume in service["volumes"]]
        if args.role == "orchestrator":
            files = [args.services_tls_ca, args.services_tls_cert, args.services_tls_key, args.auth_token_file]
        else:
            files = [args.tls_cert, args.tls_key, args.tls_client_ca]
        assert all(files) and all(any(f == m or f.startswith(m + "/") for m in mounts) for f in files), (name, files)


def measured_figures(column: int = 0) -> dict[str, float]:
    """The figures docs/operations.md states, by name, from its table rows
    "| `name` | compiled | eager | …" (column 0: compiled, the default; 1: eager)."""
    rows = re.findall(r"^\| `(\w+)` \| ([0-9.]+) \| ([0-9.]+) \|", OPERATIONS.read_text(), flags=re.MULTILINE)
    return {row[0]: float(row[1 + column]) for row in rows}


@pytest.mark.parametrize(("column", "report"), [(0, "startup-demo-cpu.json"), (1, "startup-demo-cpu-eager.json")])
def test_the_operations_figures_are_the_measurements(column: int, report: str) -> None:
    """The table is `specwire startup-time`'s JSON report, rounded: it cannot drift from it."""
    medians = json.loads((OPERATIONS.parent / "measurements" / report).read_text())["median"]
    figures = measured_figures(column)
    assert len(figures) >= 10
    assert figures == {name: round(medians[name], 1) for name in figures}


def probe_budget_s(probe: dict[str, Any]) -> float:
    """How long a failing startup probe is tolerated before the container is restarted."""
    return float(probe["periodSeconds"] * probe["failureThreshold"])


def test_probes_and_grace_periods_follow_the_measured_start_and_drain_times() -> None:
    figures = measured_figures()
    parser = build_parser()
    for name, deployment in by_kind("Deployment").items():
        pod = deployment["spec"]["template"]["spec"]
        container = pod["containers"][0]
        args = parser.parse_args(container["args"])
        # kubelet's SIGKILL comes after the drain (--grace) and the exit that follows it.
        assert pod["terminationGracePeriodSeconds"] >= args.grace + figures["drain_beyond_grace_s"], name
        if args.role == "orchestrator":
            # It binds its ports once it has reached the services, or exits after connect_timeout_s.
            slowest = figures["cold_orchestrator_serving_s"] + OrchestratorConfig.connect_timeout_s
        else:
            slowest = max(figures["cold_target_serving_s"], figures["cold_draft_serving_s"])
        assert probe_budget_s(container["startupProbe"]) >= START_MARGIN * slowest, name
        assert "initialDelaySeconds" not in container["livenessProbe"]  # the startup probe holds it back
