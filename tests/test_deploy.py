"""Deployment files: Kubernetes manifests validate against the API schema, and the three
services' addresses, ports and probes agree with each other and with the CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from specwire.client.cli import build_parser

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
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
        assert container["readinessProbe"]["grpc"]["port"] == args.port == container["ports"][0]["containerPort"]
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


def test_compose_wires_the_same_three_services() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    parser = build_parser()
    parsed = {name: parser.parse_args(service["command"]) for name, service in compose["services"].items()}
    assert {args.role for args in parsed.values()} == {"draft", "target", "orchestrator"}
    orchestrator = parsed["orchestrator"]
    assert orchestrator.target == f"target:{parsed['target'].port}"
    assert orchestrator.draft == f"draft:{parsed['draft'].port}"


def test_dockerfile_pins_torch_before_the_project() -> None:
    lines = (DEPLOY / "Dockerfile").read_text().splitlines()
    torch_line = next(i for i, line in enumerate(lines) if "pip install torch==" in line)
    project_line = next(i for i, line in enumerate(lines) if line.strip() == 'RUN pip install ".[otlp]"')
    assert torch_line < project_line


def test_dockerfile_copies_every_package_folder() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python ≥ 3.11
    pyproject = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())
    folders = {"specwire", *(path.split("/")[0] for path in pyproject["tool"]["setuptools"]["package-dir"].values())}
    copied = {line.split()[1] for line in (DEPLOY / "Dockerfile").read_text().splitlines() if line.startswith("COPY ")}
    assert folders <= copied, f"not copied into the image: {sorted(folders - copied)}"
