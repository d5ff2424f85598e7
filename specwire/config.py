"""Typed configuration for the three services: defaults stated once, filled from one CLI."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from specwire.security import ClientTLS, ServerTLS

QUANTIZE_MODES = ("none", "int8", "int4", "w4a8", "mixed", "w8a8", "auto")  # --quantize (`engine.quantize`)


def compile_default() -> str:
    """`--compile` / `EngineLimits.compile` unless given: $SPECWIRE_COMPILE, else "auto". (The
    test suite sets "off": a compile per test service would cost it minutes.)"""
    return os.environ.get("SPECWIRE_COMPILE", "auto")


@dataclass(frozen=True)
class TelemetryConfig:
    """Tracing and metrics of one service (`--trace-*`, `--metrics-port`); all off by default."""

    trace_exporter: str = "none"  # "none", "otlp" (OTEL_EXPORTER_OTLP_* variables), "console" or "file"
    trace_file: str | None = None  # JSON lines, one span per line (`trace_exporter="file"`)
    trace_sample_ratio: float = 1.0  # of new traces; a service follows its caller's decision
    metrics_port: int = 0  # Prometheus /metrics port; 0 = off


@dataclass(frozen=True)
class ModelServiceConfig:
    """`specwire serve draft|target`."""

    role: str  # "draft" or "target"
    model: str | None = None  # directory or hub id; None = the embedded demo model for the role
    device: str = "auto"
    dtype: str = "auto"
    host: str = "127.0.0.1"
    port: int = 50052
    max_sessions: int = 256
    # The serving engine (specwire.engine.EngineLimits): 0 = derived from the model and free memory.
    max_batch_rows: int = 0
    max_cache_len: int = 0
    max_queued_sessions: int = 64
    prefix_cache: bool = True  # released rows keep their keys for later prompts that share a prefix
    engine: str = "batched"  # "batched" (slot cache, batching scheduler) or "hf" (transformers' forward)
    # torch.compile of the batched forward: auto (where it pays), on, off; see compile_default
    compile: str = field(default_factory=compile_default)
    quantize: str = "auto"  # linear weights: one of QUANTIZE_MODES (specwire.engine.quantize)
    gguf_file: str | None = None  # with a directory `model`: the GGUF file in it
    threads: int = 0  # torch's intra-op threads; 0 = torch's default (every core)
    drafter: str = "model"  # draft only: "model" or "ngram"
    ngram_max: int = 3  # n-gram drafter: longest n-gram matched
    ngram_min: int = 1
    medusa: str | None = None  # target only: Medusa heads directory (`--medusa`)
    grace_s: float = 10.0
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    tls: ServerTLS | None = None  # None: plaintext
    health_port: int = 0  # a plaintext health-only port for probes (0: none)


@dataclass(frozen=True)
class OrchestratorConfig:
    """`specwire serve orchestrator`."""

    # Comma-separated host:port lists; a DNS name stands for all its addresses (headless Service).
    target: str = "127.0.0.1:50053"
    draft: str | None = "127.0.0.1:50052"
    tokenizer: str | None = None  # directory or hub id; None = the target's `tokenizer_source`
    host: str = "127.0.0.1"
    port: int = 50051
    max_new_tokens_limit: int = 4096
    default_max_new_tokens: int = 64
    # Target-only greedy/sampling: tokens the target may decide in one message (1 = one per trip).
    max_tokens_per_round: int = 16
    # Pipelined drafting for requests that leave `speculative_pipeline` unset (--speculative-pipeline).
    speculative_pipeline: bool = True
    connect_timeout_s: float = 60.0
    # How long a session lost with its replica may take to be rebuilt on another before UNAVAILABLE.
    failover_timeout_s: float = 5.0
    grace_s: float = 10.0
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    tls: ServerTLS | None = None  # the public API; None: plaintext
    services_tls: ClientTLS | None = None  # the hops to the model services; None: plaintext
    auth_token_file: str | None = None  # bearer tokens the public API accepts; None: open
    health_port: int = 0  # a plaintext health-only port for probes (0: none)


@dataclass(frozen=True)
class HttpFrontConfig:
    """`specwire serve http`: the OpenAI-compatible HTTP front over one orchestrator."""

    orchestrator: str = "127.0.0.1:50051"
    host: str = "127.0.0.1"
    port: int = 8000
    tokenizer: str | None = None  # directory or hub id for chat templates; None = the orchestrator's
    chat_template: str | None = None  # a Jinja file used instead of the tokenizer's own template
    model_name: str | None = None  # the model id listed and accepted; None = the orchestrator's target
    auth_token_file: str | None = None  # bearer tokens HTTP callers must send; None: open
    orchestrator_token: str | None = None  # the bearer token this front sends to the orchestrator
    orchestrator_tls: ClientTLS | None = None  # None: plaintext to the orchestrator
    connect_timeout_s: float = 60.0  # how long to wait for the orchestrator at start
    grace_s: float = 10.0  # open streams' time to finish after SIGTERM
