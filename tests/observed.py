"""An in-process stack with tracing and/or metrics on, for the observability tests.

All three services share the test process, so each gets its own `Tracing` (its own provider
and `service.name` resource) writing to the exporters the test hands in; spans then say which
service made them even though one exporter sees them all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from opentelemetry.sdk.trace.export import SpanExporter

from specwire import telemetry
from specwire.config import OrchestratorConfig
from specwire.metrics import ModelServiceMetrics, OrchestratorMetrics
from tests.conftest import load_engine
from tests.harness import LoopThread, Stack, start_model_server, start_observed_orchestrator

SERVICES = ("orchestrator", "draft", "target")


@dataclass
class Observed:
    stack: Stack
    tracings: dict[str, telemetry.Tracing] = field(default_factory=dict)
    metrics: dict[str, OrchestratorMetrics | ModelServiceMetrics] = field(default_factory=dict)

    def flush(self) -> None:
        for tracing in self.tracings.values():
            tracing.provider.force_flush()

    def stop(self) -> None:
        self.stack.stop()
        for tracing in self.tracings.values():
            tracing.shutdown()


def start_observed_stack(
    loop: LoopThread,
    target_dir: Path,
    draft_dir: Path,
    span_exporter: SpanExporter | None = None,
    trace_dir: Path | None = None,
    metrics: bool = False,
    medusa_dir: Path | None = None,
) -> Observed:
    """Target, draft and orchestrator on loopback; spans to `span_exporter` and/or to
    `trace_dir/<service>.jsonl`; per-service metric registries when `metrics`."""
    tracings: dict[str, telemetry.Tracing] = {}
    for service in SERVICES:
        tracing = telemetry.setup_tracing(
            service,
            "file" if trace_dir else "none",
            trace_dir / f"{service}.jsonl" if trace_dir else None,
            span_exporter=span_exporter,
        )
        if tracing is not None:
            tracings[service] = tracing
    orchestrator_metrics = OrchestratorMetrics(process_metrics=False) if metrics else None
    target_metrics = ModelServiceMetrics("target", process_metrics=False) if metrics else None
    draft_metrics = ModelServiceMetrics("draft", process_metrics=False) if metrics else None
    target_engine = load_engine(target_dir, "target")
    if medusa_dir is not None:  # heads, so the medusa strategy runs too
        target_engine.lm.attach_medusa(str(medusa_dir))
    target = loop.run(start_model_server(target_engine, tracings.get("target"), target_metrics))
    draft = loop.run(start_model_server(load_engine(draft_dir, "draft"), tracings.get("draft"), draft_metrics))
    config = OrchestratorConfig(
        target=target.address, draft=draft.address, tokenizer=str(target_dir), connect_timeout_s=10.0,
        max_new_tokens_limit=256,
    )
    orchestrator = loop.run(start_observed_orchestrator(config, tracings.get("orchestrator"), orchestrator_metrics))
    registries: dict[str, OrchestratorMetrics | ModelServiceMetrics] = {}
    if orchestrator_metrics and target_metrics and draft_metrics:
        registries = {"orchestrator": orchestrator_metrics, "target": target_metrics, "draft": draft_metrics}
    return Observed(Stack(loop, target, draft, orchestrator), tracings, registries)
