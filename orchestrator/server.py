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
from specwire.orchestrator.health import ServiceStates
from specwire.orchestrator.replicas import ReplicaCollector, ReplicaSet
from specwire.orchestrator.stats import RunStats
from specwire.v1 import orchestrator_pb2, orchestrator_pb2_grpc

from specwire import security, serving, telemetry, wire
from specwire.config import OrchestratorConfig
from specwire.errors import FailedPrecondition, StatusError, capped
from specwire.metrics import OrchestratorMetrics, serve_metrics
from specwire.startup import StartupClock, StartupTimes
from specwire.tokenizer import load_tokenizer

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
        self.startup: StartupTimes | None = None  # set once SERVING

    def _replicas_pb(self) -> list[orchestrator_pb2.Replica]:
        handles = [self.decoder.target, self.decoder.draft]
        return [
            orchestrator_pb2.Replica(
                role=r.role, address=r.address, state=r.state, active_sessions=r.active_sessions,
                sessions_opened=r.sessions_opened, failures=r.failures,
            )
            for handle in handles if isinstance(handle, ReplicaSet)
            for r in handle.states()
        ]

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
            replicas=self._replicas_pb(),
            tokenizer_source=decoder.tokenizer.name_or_path,
            startup=wire.startup_to_pb(self.startup) if self.startup is not None else None,
        )


async def build_decoder(
    config: OrchestratorConfig,
    tracing: telemetry.Tracing | None = None,
    metrics: OrchestratorMetrics | None = None,
) -> Decoder:
    """Connect to every replica of the services, load the tokenizer, check they agree."""
    timeout, tls, failover = config.connect_timeout_s, config.services_tls, config.failover_timeout_s
    connecting = [ReplicaSet.connect(config.target, "target", timeout, tls, failover)]
    if config.draft:
        # Speculative decoding goes on target-only when no draft replica is left.
        connecting.append(ReplicaSet.connect(config.draft, "draft", timeout, tls, failover, optional=True))
    models = await asyncio.gather(*connecting)
    target, draft = models[0], models[1] if len(models) > 1 else None
    for model in models:
        model.tracing = tracing
    if metrics is not None:
        metrics.registry.register(ReplicaCollector(list(models)))
    source = config.tokenizer or target.info.tokenizer_source
    tokenizer = load_tokenizer(source) if source else None
    if tokenizer is None:
        raise FailedPrecondition(f"no tokenizer could be loaded from {source!r}; pass --tokenizer DIR_OR_HUB_ID")
    decoder = Decoder(
        target,
        draft,
        tokenizer,
        max_new_tokens_limit=config.max_new_tokens_limit,
        default_max_new_tokens=config.default_max_new_tokens,
        max_tokens_per_round=config.max_tokens_per_round,
        speculative_pipeline=config.speculative_pipeline,
        tracing=tracing,
        metrics=metrics,
    )
    # The replica sets' health watchers keep the decoder's view of the roles current.
    for model in models:
        model.follow(decoder.states)
    return decoder


def watch_services(decoder: Decoder, running: serving.RunningServer) -> None:
    """Make the orchestrator's health follow the services' (as its replica sets watch them):
    SERVING (for "" and `specwire.v1.Orchestrator`) while a target replica is, NOT_SERVING
    while none is. The draft's strategies follow the draft replicas in `Decoder` itself."""
    loop = asyncio.get_running_loop()

    def follow(states: ServiceStates) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if states.target_up else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            loop.create_task(running.health.set(name, status))

    decoder.states.listeners.append(follow)
    if not decoder.states.target_up:  # the last target replica went away before this
        follow(decoder.states)


async def run(config: OrchestratorConfig) -> None:
    observe = config.telemetry
    tracing = telemetry.setup_tracing(
        "orchestrator", observe.trace_exporter, observe.trace_file, observe.trace_sample_ratio, set_global=True
    )
    metrics = OrchestratorMetrics() if observe.metrics_port else None
    clock = StartupClock()
    clock.mark("boot")
    try:
        decoder = await build_decoder(config, tracing, metrics)
    except (StatusError, ValueError) as error:
        message = error.message if isinstance(error, StatusError) else str(error)
        print(f"orchestrator refuses to start: {message}", file=sys.stderr, flush=True)
        raise SystemExit(2) from error
    servicer = OrchestratorServicer(decoder)
    interceptors = [security.TokenAuth(security.TokenFile(config.auth_token_file))] if config.auth_token_file else []

    def register(server: grpc.aio.Server) -> None:
        orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(servicer, server)

    running = await serving.start_server(
        register, [SERVICE_NAME], config.host, config.port, interceptors=interceptors, tls=config.tls,
        health_port=config.health_port,
    )

    metrics_server = serve_metrics(metrics.registry, config.host, observe.metrics_port) if metrics else None

    clock.mark("connect")

    async def ready() -> None:
        servicer.startup = clock.times()
        log.warning("orchestrator: SERVING %s after its process started", servicer.startup.describe())

    try:
        await serving.serve_until_signalled(
            running, [SERVICE_NAME], ready, "orchestrator", config.host, config.grace_s,
            on_serving=lambda: watch_services(decoder, running),
        )
    finally:
        for model in (decoder.target, decoder.draft):
            if isinstance(model, ReplicaSet):
                await model.close()
        if metrics_server is not None:
            metrics_server.shutdown()
        if tracing is not None:
            tracing.shutdown()


def main(config: OrchestratorConfig) -> None:
    asyncio.run(run(config))
    serving.exit_now(0)  # drained and flushed: no interpreter teardown (see model_server.main)
