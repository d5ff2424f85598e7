"""One generation from request to result: validate, run a strategy, apply stop conditions.

`Decoder` is what the gRPC servicer calls, and what tests and benchmarks call in-process with
`LocalModel`s. Strategies are async generators of decided tokens; closing one (a stop condition,
a cancelled call) ends its sessions, which frees the services' KV caches.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import cast

import torch
from opentelemetry.trace import Span, SpanKind
from specwire.orchestrator import params as request_params
from specwire.orchestrator.beam import beam_search
from specwire.orchestrator.best_first import best_first_beam
from specwire.orchestrator.context import BeamSequence, DecodeContext
from specwire.orchestrator.contrastive import contrastive
from specwire.orchestrator.entropix_strategy import entropix
from specwire.orchestrator.health import DRAFT_STRATEGIES, ServiceStates
from specwire.orchestrator.medusa import medusa
from specwire.orchestrator.models import ModelHandle
from specwire.orchestrator.output import Output
from specwire.orchestrator.params import GenerationParams, Limits
from specwire.orchestrator.speculative import speculative
from specwire.orchestrator.standard import standard
from specwire.orchestrator.stats import RunStats
from specwire.v1 import orchestrator_pb2
from transformers import PreTrainedTokenizerBase

from specwire import telemetry
from specwire.errors import FailedPrecondition, InvalidArgument, StatusError, Unavailable, echo
from specwire.metrics import OrchestratorMetrics
from specwire.session import ModelInfo
from specwire.tokenizer import tokenizer_fingerprint

Strategy = Callable[[DecodeContext], AsyncGenerator[list[int], None]]

STRATEGIES: dict[str, Strategy] = {
    "greedy": standard,
    "sample": standard,
    "beam": beam_search,
    "contrastive": contrastive,
    "speculative": speculative,
    "entropix": entropix,
    "medusa": medusa,
    "best_first_beam": best_first_beam,
}


def check_compatible(target: ModelInfo, draft: ModelInfo | None, tokenizer: PreTrainedTokenizerBase) -> None:
    """Refuse a draft/target/tokenizer combination whose token ids would not mean the same."""
    ours = tokenizer_fingerprint(tokenizer)
    if target.tokenizer_fingerprint and target.tokenizer_fingerprint != ours:
        raise FailedPrecondition(
            f"tokenizer fingerprint differs: orchestrator's tokenizer {ours[:12]} vs target {target.tokenizer_fingerprint[:12]}"
        )
    if draft is None:
        return
    if draft.vocab_size != target.vocab_size:
        raise FailedPrecondition(f"vocab size differs: draft {draft.vocab_size} vs target {target.vocab_size}")
    if draft.tokenizer_fingerprint and target.tokenizer_fingerprint and draft.tokenizer_fingerprint != target.tokenizer_fingerprint:
        raise FailedPrecondition(
            "tokenizer fingerprint differs: "
            f"draft {draft.tokenizer_fingerprint[:12]} vs target {target.tokenizer_fingerprint[:12]}"
        )


@dataclass
class Delta:
    token_ids: list[int]
    text: str
    finish_reason: str = ""
    sequences: list[BeamSequence] = field(default_factory=list)
    stats: RunStats | None = None


@dataclass
class Result:
    token_ids: list[int]
    text: str
    finish_reason: str
    sequences: list[BeamSequence]
    stats: RunStats


class Decoder:
    def __init__(
        self,
        target: ModelHandle,
        draft: ModelHandle | None,
        tokenizer: PreTrainedTokenizerBase,
        max_new_tokens_limit: int = 4096,
        default_max_new_tokens: int = 64,
        max_tokens_per_round: int = 16,
        speculative_pipeline: bool = True,
        tracing: telemetry.Tracing | None = None,
        metrics: OrchestratorMetrics | None = None,
    ) -> None:
        check_compatible(target.info, draft.info if draft else None, tokenizer)
        self.target = target
        self.draft = draft
        self.tokenizer = tokenizer
        self.tracing = tracing
        self.max_tokens_per_round = max_tokens_per_round
        self.metrics = metrics
        self.limits = Limits(
            max_new_tokens=max_new_tokens_limit,
            default_max_new_tokens=default_max_new_tokens,
            max_context=target.info.max_context,
            vocab_size=target.info.vocab_size,
            speculative_pipeline=speculative_pipeline,
        )
        self.eos_token_ids = frozenset(target.info.eos_token_ids)
        # Kept current by the replica sets' health watchers (`orchestrator.replicas`).
        self.states = ServiceStates()

    def available_strategies(self) -> list[str]:
        """The strategies a request may ask for now: none while the target is down; those that
        need the draft only while a (model) draft is up."""
        if not self.states.target_up:
            return []
        draft_ok = self.draft is not None and self.states.draft_up
        names = [name for name in STRATEGIES if draft_ok or name not in DRAFT_STRATEGIES]
        if self.draft is not None and "ngram" in self.draft.info.capabilities:
            names = [name for name in names if name != "contrastive"]
        if "medusa" not in self.target.info.capabilities:  # no heads on the target
            names = [name for name in names if name != "medusa"]
        return sorted(names)

    def _check_available(self, strategy: str, speculate: bool = False) -> None:
        """`speculate`: a strategy that takes the draft only when asked to (entropix) was."""
        if not self.states.target_up:
            raise Unavailable(f"target: the target service ({_where(self.target)}) is unreachable or not serving")
        needs_draft = strategy in DRAFT_STRATEGIES or speculate
        if needs_draft and self.draft is not None and not self.states.draft_up:
            others = ", ".join(name for name in sorted(STRATEGIES) if name not in DRAFT_STRATEGIES)
            raise Unavailable(
                f"draft: the draft service ({_where(self.draft)}) is unreachable or not serving; strategy "
                f"{strategy!r} needs it (available now: {others})"
            )

    def decode(self, token_ids: list[int]) -> str:
        return cast(str, self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def prepare(self, request: orchestrator_pb2.GenerateRequest) -> tuple[GenerationParams, list[int]]:
        request_params.check_prompt(request, self.limits)
        prompt_ids = request_params.prompt_ids_of(request)
        if not prompt_ids:
            prompt_ids = self.tokenizer(request.prompt).input_ids
            request_params.check_prompt_text(len(prompt_ids), self.limits)
        params = request_params.parse(request, len(prompt_ids), self.limits)
        if params.strategy not in STRATEGIES:
            raise InvalidArgument("strategy", f"strategy {echo(params.strategy)} is not available on this orchestrator")
        self._check_available(params.strategy, params.entropix_speculative)
        return params, prompt_ids

    async def stream(
        self, request: orchestrator_pb2.GenerateRequest, caller_trace: dict[str, str] | None = None
    ) -> AsyncIterator[Delta]:
        """The generation as deltas; the last one carries the finish reason and statistics.

        Traced as one root span — a child of the caller's span when `caller_trace` (W3C headers
        from the call's metadata) names one — and counted in the metrics, when those are on.
        """
        # A label, so only known names: the request's number is the caller's to choose.
        strategy = request_params.name_of(request.strategy, request_params.STRATEGY_VALUES) or "unknown"
        strategy = strategy if strategy in STRATEGIES else "unknown"
        span = None
        if self.tracing is not None:
            span = self.tracing.start_span(
                "generate", telemetry.extract(caller_trace), SpanKind.SERVER, {"specwire.strategy": strategy}
            )
        if self.metrics is not None:
            self.metrics.request_started()
        started = time.perf_counter()
        ttft_s = 0.0
        status = "error"
        finished = False

        def finish() -> None:
            if span is not None:
                span.set_attribute("specwire.status", status)
                span.end()
            if self.metrics is not None:
                self.metrics.request_finished(strategy, status, time.perf_counter() - started, ttft_s)

        try:
            async with aclosing(self._decode(request, span)) as deltas:
                async for delta in deltas:
                    if self.metrics is not None:
                        self.metrics.tokens_generated(strategy, len(delta.token_ids))
                    if delta.stats is not None:
                        # Finish before the last yield: `generate` never resumes the stream after it.
                        ttft_s = delta.stats.ttft_ms / 1e3
                        status, finished = "ok", True
                        if span is not None:
                            _annotate_root(span, delta)
                        finish()
                    yield delta
        except StatusError as error:
            status = error.code.name.lower()
            if span is not None:
                telemetry.record_error(span, error)
            raise
        except (GeneratorExit, asyncio.CancelledError):
            status = "cancelled"
            raise
        except Exception as error:
            status = "internal"
            if span is not None:
                telemetry.record_error(span, error)
            raise
        finally:
            if not finished:
                finish()

    async def _decode(
        self, request: orchestrator_pb2.GenerateRequest, root_span: Span | None
    ) -> AsyncGenerator[Delta, None]:
        params, prompt_ids = self.prepare(request)
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        ctx = DecodeContext(
            params=params,
            prompt_ids=prompt_ids,
            target=self.target,
            draft=self.draft,
            eos_token_ids=self.eos_token_ids,
            generator=torch.Generator().manual_seed(seed),
            max_tokens_per_round=self.max_tokens_per_round,
            tracing=self.tracing,
            root_span=root_span,
            metrics=self.metrics,
        )
        ctx.stats.prompt_tokens = len(prompt_ids)
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        output = Output(self.tokenizer, eos, params.max_new_tokens, params.stop_strings)
        started = time.perf_counter()
        decided = STRATEGIES[params.strategy](ctx)
        try:
            async for ids in decided:
                kept = output.extend(ids)
                if not ctx.stats.ttft_ms and kept:
                    ctx.stats.ttft_ms = (time.perf_counter() - started) * 1e3
                if kept and not output.done:
                    yield Delta(kept, output.text_delta())
                if output.done:
                    pending_ids = kept
                    break
            else:
                pending_ids = []
                output.finish_reason = output.finish_reason or "length"
        finally:
            await decided.aclose()
            await ctx.close()
        ctx.stats.wall_ms = (time.perf_counter() - started) * 1e3
        ctx.stats.new_tokens = len(output.token_ids)
        yield Delta(pending_ids, output.text_delta(), output.finish_reason or "length", ctx.sequences, ctx.stats)

    async def generate(
        self, request: orchestrator_pb2.GenerateRequest, caller_trace: dict[str, str] | None = None
    ) -> Result:
        token_ids: list[int] = []
        text: list[str] = []
        async for delta in self.stream(request, caller_trace):
            token_ids += delta.token_ids
            text.append(delta.text)
            if delta.stats is not None:
                return Result(token_ids, "".join(text), delta.finish_reason, delta.sequences, delta.stats)
        raise AssertionError("stream ended without a final delta")


def _where(model: ModelHandle) -> str:
    return str(getattr(model, "address", model.label))


def _annotate_root(span: Span, delta: Delta) -> None:
    """The generation's outcome and statistics on its root span."""
    assert delta.stats is not None
    span.set_attribute("specwire.finish_reason", delta.finish_reason)
    stats = delta.stats.to_pb()
    for descriptor, value in stats.ListFields():
        if not descriptor.is_repeated:
            span.set_attribute(f"specwire.stats.{descriptor.name}", value)
