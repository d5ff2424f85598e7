"""The orchestrator service (`specwire serve orchestrator`): the public `Orchestrator` API."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2
from opentelemetry.trace import SpanKind
from specwire.orchestrator.context import BeamSequence
from specwire.orchestrator.generation import Decoder, Delta, Result
from specwire.orchestrator.health import HealthWatcher, ServiceStates
from specwire.orchestrator.models import RemoteModel
from specwire.orchestrator.stats import RunStats
from specwire.v1 import orchestrator_pb2, orchestrator_pb2_grpc

from specwire import serving, telemetry
from specwire.config import OrchestratorConfig
from specwire.engine import load_tokenizer
from specwire.errors import FailedPrecondition, StatusError, capped
from specwire.metrics import OrchestratorMetrics, serve_metrics
from specwire.model_service import SERVICE_NAME as MODEL_SERVICE

log = logging.getLogger("specwire")
SERVICE_NAME = orchestrator_pb2.DESCRIPTOR.services_by_name["Orchestrator"].full_name


def _sequences_pb(decoder: Decoder, sequences: list[BeamSequence]) -> list[orchestrator_pb2.Sequence]:
    return [
        orchestrator_pb2.Sequence(
            token_ids=s.token_ids, text=decoder.decode(s.token_ids), score=s.score
        )
        for s in sequences
    ]


def finish_reason_pb(name: str) -> orchestrator_pb2.FinishReason:
    """"eos" → FINISH_REASON_EOS, …; "" (not finished) → FINISH_REASON_UNSPECIFIED."""
    return orchestrator_pb2.FinishReason.Value(f"FINISH_REASON_{name.upper()}" if name else "FINISH_REASON_UNSPECIFIED")


def _decisions_pb(stats: RunStats) -> list[orchestrator_pb2.EntropixDecision]:
    """The entropix decision trace, one entry per generated token."""
    return [orchestrator_pb2.EntropixDecision(**vars(record)) for record in stats.decisions[: stats.new_tokens]]


def result_to_pb(decoder: Decoder, result: Result) -> orchestrator_pb2.GenerateResponse:
    return orchestrator_pb2.GenerateResponse(
        token_ids=result.token_ids,
        text=result.text,
        finish_reason=finish_reason_pb(result.finish_reason),
        sequences=_sequences_pb(decoder, result.sequences),
        stats=result.stats.to_pb(),
        decisions=_decisions_pb(result.stats),
    )


def delta_to_pb(decoder: Decoder, delta: Delta) -> orchestrator_pb2.GenerateDelta:
    message = orchestrator_pb2.GenerateDelta(
        token_ids=delta.token_ids,
        text=delta.text,
        finish_reason=finish_reason_pb(delta.finish_reason),
        sequences=_sequences_pb(decoder, delta.sequences),
    )
    if delta.stats is not None:
        message.stats.CopyFrom(delta.stats.to_pb())
        message.decisions.extend(_decisions_pb(delta.stats))
    return message


class OrchestratorServicer(orchestrator_pb2_grpc.OrchestratorServicer):
    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder

    async def Generate(
        self, request: orchestrator_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.GenerateResponse:
        try:
            caller = telemetry.carrier_from_metadata(context.invocation_metadata())
            result = await self.decoder.generate(request, caller)
        except StatusError as error:
            await context.abort(error.code, error.message)
        except Exception as error:  # a bug must not take the server down: report it as INTERNAL
            log.exception("Generate failed")
            await context.abort(grpc.StatusCode.INTERNAL, capped(f"{type(error).__name__}: {error}"))
        return result_to_pb(self.decoder, result)

    async def GenerateStream(
        self, request: orchestrator_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[orchestrator_pb2.GenerateDelta]:
        try:
            caller = telemetry.carrier_from_metadata(context.invocation_metadata())
            async for delta in self.decoder.stream(request, caller):
                yield delta_to_pb(self.decoder, delta)
        except StatusError as error:
            await context.abort(error.code, error.message)
        except Exception as error:
            log.exception("GenerateStream failed")
            await context.abort(grpc.StatusCode.INTERNAL, capped(f"{type(error).__name__}: {error}"))

    async def Info(
        self, request: orchestrator_pb2.OrchestratorInfoRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_pb2.OrchestratorInfo:
        decoder = self.decoder
        caller = telemetry.carrier_from_metadata(context.invocation_metadata()) if decoder.tracing else None
        if decoder.tracing is not None and caller is not None:
            decoder.tracing.start_span("Info", telemetry.extract(caller), SpanKind.SERVER).end()
        target, draft = decoder.target.info, decoder.draft.info if decoder.draft else None
        return orchestrator_pb2.OrchestratorInfo(
            target_model=target.model_name,
            draft_model=draft.model_name if draft else "",
            vocab_size=target.vocab_size,
            max_context=target.max_context,
            max_new_tokens_limit=decoder.limits.max_new_tokens,
            strategies=decoder.available_strategies(),
            draft_capabilities=draft.capabilities if draft else [],
            target_capabilities=target.capabilities,
        )


async def build_decoder(
    config: OrchestratorConfig,
    tracing: telemetry.Tracing | None = None,
    metrics: OrchestratorMetrics | None = None,
) -> Decoder:
    """Connect to the services, load the tokenizer, check they agree."""
    connecting = [RemoteModel.connect(config.target, "target", config.connect_timeout_s)]
    if config.draft:
        connecting.append(RemoteModel.connect(config.draft, "draft", config.connect_timeout_s))
    models = await asyncio.gather(*connecting)
    target, draft = models[0], models[1] if len(models) > 1 else None
    for model in models:
        model.tracing = tracing
    source = config.tokenizer or target.info.tokenizer_source
    tokenizer = load_tokenizer(source) if source else None
    if tokenizer is None:
        raise FailedPrecondition(f"no tokenizer could be loaded from {source!r}; pass --tokenizer DIR_OR_HUB_ID")
    return Decoder(
        target,
        draft,
        tokenizer,
        max_new_tokens_limit=config.max_new_tokens_limit,
        default_max_new_tokens=config.default_max_new_tokens,
        max_tokens_per_round=config.max_tokens_per_round,
        tracing=tracing,
        metrics=metrics,
    )


def watch_services(decoder: Decoder, running: serving.RunningServer) -> list[HealthWatcher]:
    """Follow the model services' health streams: the orchestrator is SERVING (for "" and
    `specwire.v1.Orchestrator`) while the target is, and offers the draft's strategies while the
    draft is. Returns the started watchers (stop them before closing the channels)."""
    loop = asyncio.get_running_loop()

    def follow(states: ServiceStates) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if states.target_up else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            loop.create_task(running.health.set(name, status))

    decoder.states.listeners.append(follow)
    watchers = []
    for model in (decoder.target, decoder.draft):
        if isinstance(model, RemoteModel):
            watcher = HealthWatcher(model.channel, model.label, MODEL_SERVICE, decoder.states)
            watcher.start()
            watchers.append(watcher)
    return watchers


async def run(config: OrchestratorConfig) -> None:
    observe = config.telemetry
    tracing = telemetry.setup_tracing(
        "orchestrator", observe.trace_exporter, observe.trace_file, observe.trace_sample_ratio, set_global=True
    )
    metrics = OrchestratorMetrics() if observe.metrics_port else None
    try:
        decoder = await build_decoder(config, tracing, metrics)
    except StatusError as error:
        print(f"orchestrator refuses to start: {error.message}", file=sys.stderr, flush=True)
        raise SystemExit(2) from error
    servicer = OrchestratorServicer(decoder)

    def register(server: grpc.aio.Server) -> None:
        orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(servicer, server)

    running = await serving.start_server(register, [SERVICE_NAME], config.host, config.port)

    metrics_server = serve_metrics(metrics.registry, config.host, observe.metrics_port) if metrics else None

    async def ready() -> None:
        return None

    watchers = watch_services(decoder, running)
    try:
        await serving.serve_until_signalled(running, [SERVICE_NAME], ready, "orchestrator", config.host, config.grace_s)
    finally:
        for watcher in watchers:
            await watcher.stop()
        if metrics_server is not None:
            metrics_server.shutdown()
        if tracing is not None:
            tracing.shutdown()


def main(config: OrchestratorConfig) -> None:
    asyncio.run(run(config))
