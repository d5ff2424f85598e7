"""Start a model service: bind (health NOT_SERVING), load and warm up off the loop, serve."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc
import torch
from transformers.utils import logging as hf_logging

from specwire import serving, telemetry
from specwire.config import ModelServiceConfig
from specwire.engine import CausalLM, Engine, EngineLimits
from specwire.metrics import ModelServiceMetrics, serve_metrics
from specwire.model_service import SERVICE_NAME, ModelServicer
from specwire.session import Backend
from specwire.startup import StartupClock
from specwire.v1 import model_pb2_grpc

log = logging.getLogger("specwire")

BackendFactory = Callable[[ModelServiceConfig, StartupClock], Backend]


def load_engine(
    config: ModelServiceConfig,
    clock: StartupClock,
    default_model: str,
    default_name: str,
    default_medusa: str | None = None,
) -> Engine:
    """The model named by `--model`, or the role's embedded demo model (with its Medusa heads,
    when it has them and no `--medusa` says otherwise), warmed up; each phase marked on `clock`."""
    hf_logging.disable_progress_bar()  # a service's log is no place for progress bars
    if config.threads:
        torch.set_num_threads(config.threads)
    lm = CausalLM.load(
        config.model or default_model,
        device=config.device,
        dtype=config.dtype,
        name=config.model or default_name,
        quantization=config.quantize,
        gguf_file=config.gguf_file,
    )
    medusa = config.medusa or (default_medusa if not config.model else None)
    if medusa:
        lm.attach_medusa(medusa)
    clock.mark("load")
    limits = EngineLimits(
        max_batch_rows=config.max_batch_rows,
        max_cache_len=config.max_cache_len,
        max_queued_sessions=config.max_queued_sessions,
        prefix_cache=config.prefix_cache,
        batching=config.engine == "batched",
        compile=config.compile,
        compile_in_background=True,
    )
    engine = Engine(lm, role=config.role, limits=limits)
    clock.mark("engine")
    engine.warmup()
    clock.mark("warmup")
    return engine


async def run(config: ModelServiceConfig, build_backend: BackendFactory) -> None:
    clock = StartupClock()
    observe = config.telemetry
    tracing = telemetry.setup_tracing(
        config.role, observe.trace_exporter, observe.trace_file, observe.trace_sample_ratio, set_global=True
    )
    metrics = ModelServiceMetrics(config.role) if observe.metrics_port else None
    servicer = ModelServicer(None, config.max_sessions, config.role, tracing, metrics)

    def register(server: grpc.aio.Server) -> None:
        model_pb2_grpc.add_ModelServiceServicer_to_server(servicer, server)

    running = await serving.start_server(
        register, [SERVICE_NAME], config.host, config.port, tls=config.tls, health_port=config.health_port
    )
    clock.mark("boot")

    async def ready() -> None:
        backend = await serving.in_thread(lambda: build_backend(config, clock))
        servicer.backend = backend
        servicer.startup = clock.times()
        info = backend.info()
        log.info("%s: %s on %s (%s), vocab %d", config.role, info.model_name, info.device, info.dtype, info.vocab_size)
        # At WARNING, so that it is in every log: how long a restart of this service takes.
        log.warning("%s: SERVING %s after its process started", config.role, servicer.startup.describe())
        if metrics is not None:
            metrics.describe(config.role, info.model_name, info.device, info.dtype)
            cache = getattr(backend, "cache", None)
            if cache is not None:
                metrics.watch_cache(cache.usage)
            scheduler = getattr(backend, "scheduler", None)
            if scheduler is not None:
                metrics.watch_batches(lambda: scheduler.stats)

    metrics_server = serve_metrics(metrics.registry, config.host, observe.metrics_port) if metrics else None
    try:
        await serving.serve_until_signalled(
            running, [SERVICE_NAME], ready, config.role, config.host, config.grace_s
        )
    finally:
        if metrics_server is not None:
            metrics_server.shutdown()
        if tracing is not None:
            tracing.shutdown()


def main(config: ModelServiceConfig, build_backend: BackendFactory) -> None:
    """`specwire serve draft|target`: serve, then exit."""
    asyncio.run(run(config, build_backend))
    # Drained, and every file, span and log of ours flushed: exit without the interpreter's
    # teardown of torch (0.6 s on a quiet machine, 5 s on a loaded one, all of it after the drain
    # and inside kubelet's grace period), and without waiting for a start-up thread still
    # loading or compiling, which cannot be interrupted.
    serving.exit_now(0)
