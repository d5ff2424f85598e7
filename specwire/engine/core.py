"""The engine a model service runs: one slot cache, one batching scheduler, sessions over them.

`Engine` sizes the cache from the flags and free memory, compiles the forward where that pays,
times its own forwards at warm-up (`Info.forward_costs`) and hands out sessions
(`specwire.engine.session`).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from specwire.config import compile_default
from specwire.engine import quantize
from specwire.engine.batch_costs import CURVE_POSITIONS
from specwire.engine.cache import SLACK, SlotCache
from specwire.engine.forward import LeanModel, lean_model
from specwire.engine.model import CausalLM
from specwire.engine.scheduler import Scheduler, compute_on
from specwire.engine.session import DynamicKV, EngineSession, SessionKV, SlotKV
from specwire.feature_drafter import FeatureDrafter
from specwire.session import ModelInfo, OpenRequest, ScoreKind, Scoring, StepRequest
from specwire.tokenizer import tokenizer_fingerprint

log = logging.getLogger("specwire")

# Device types where `--compile auto` compiles: where a measurement showed it pays. CPU: the
# demo target's server-side decode round took 23% less time compiled (docs/engine.md, "Compiled steps").
COMPILE_PAYS_ON: frozenset[str] = frozenset({"cpu"})
# Warm-up timing (`Engine.measure_costs`, `Info.forward_costs`): forwards of this many new
# positions, and greedy rounds of this many tokens.
COST_POSITIONS = CURVE_POSITIONS
# Fused decode steps and the C++ kernel wrapper (`Scheduler.compile`) cut a compiled call's fixed
# cost (~0.1 ms) and take longer to compile, the longer the more layers: Gemma-3-270M (18) on 2
# cores, 4 shapes, one of them fused, took 35 minutes with the C++ wrapper (one shape compiles in
# under a minute without); its 4-layer draft's shapes took 132 s against 63, for draft rounds of
# 4 in 3.2–3.6 ms against 7.6 (docs/engine.md). Gated on layers, not on an eager step's time: the
# draft's eager step takes ~8 ms here, most of it Python, and about 1 ms compiled.
FUSE_MAX_LAYERS = 8
DECODE_TOKENS = 8
@dataclass(frozen=True)
class EngineLimits:
    """The serving engine's sizes (`--max-batch-rows`, `--max-cache-len`, ...); 0 = derived."""

    max_batch_rows: int = 0  # cache rows = branches of all open sessions together
    max_cache_len: int = 0  # tokens per row; at most the model's context
    max_queued_sessions: int = 64  # sessions waiting for free rows before RESOURCE_EXHAUSTED
    queue_timeout_s: float = 30.0  # longest wait for free rows
    # Released rows keep their keys for later prompts (`SlotCache`), where the forward is
    # row-invariant (activation-quantised weights).
    prefix_cache: bool = True
    batching: bool = True  # False: transformers' forward, one DynamicCache per session, no batching
    # torch.compile of the batched forward: "on", "off", or "auto" = where it was measured to
    # pay (COMPILE_PAYS_ON). Default: $SPECWIRE_COMPILE, else "auto".
    compile: str = field(default_factory=compile_default)
    # Compile on a thread of its own while serving eagerly (services: SERVING in seconds).
    compile_in_background: bool = False


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):
        return 1 << 30


def cache_size(lean: LeanModel, lm: CausalLM, limits: EngineLimits) -> tuple[int, int]:
    """(rows, max_len): the flags where given; else the model's context (at most 4096 tokens)
    and as many rows as fit in half the free GPU memory (at most 256), or a tenth of the free
    RAM (at most 32: a CPU gains little from wider batches)."""
    max_len = limits.max_cache_len or min(lm.max_context, 4096)
    max_len = min(max_len, lm.max_context)
    if limits.max_batch_rows:
        return limits.max_batch_rows, max_len
    share, most = (2, 256) if lm.device.type == "cuda" else (10, 32)
    per_row = lean.cache_shape(1, max_len).bytes_per_row
    return max(1, min(most, _available_memory(lm.device) // share // per_row - 1)), max_len  # − the scratch row


class Engine:
    """A `Backend` over one causal LM: a slot cache and a batching scheduler where the lean
    forward supports the model, else one transformers `DynamicCache` per session."""

    def __init__(self, lm: CausalLM, role: str, limits: EngineLimits | None = None) -> None:
        self.lm = lm
        self.role = role
        self.limits = limits or EngineLimits()
        self._fingerprint = tokenizer_fingerprint(lm.tokenizer)
        self.cache: SlotCache | None = None
        self.scheduler: Scheduler | None = None
        self._forward_costs: list[tuple[int, float]] = []  # measured by `warmup`
        self._compile_later = False
        self._decode_ms_per_token = 0.0
        lean = lean_model(lm.model) if self.limits.batching else None
        if lean is not None:
            rows, max_len = cache_size(lean, lm, self.limits)
            row_invariant = lm.quantization in quantize.ACTIVATION_QUANTISED
            # Only a row-invariant forward gives a token the bits it would get computed with any
            # other tokens, so only there does a kept key equal what a prefill would write.
            self.cache = SlotCache(lean.cache_shape(rows, max_len), lm.device, self.limits.max_queued_sessions,
                                   prefix_cache=self.limits.prefix_cache and row_invariant)
            self.scheduler = Scheduler(lean, self.cache, lm.device, row_invariant=row_invariant)
            log.info(
                "%s: slot cache of %d rows × %d tokens (%.1f MiB)", role, rows, max_len, self.cache.shape.bytes / 2**20
            )
            if self.limits.compile not in ("auto", "on", "off"):
                raise ValueError(f"--compile must be auto, on or off; got {self.limits.compile!r}")
            compiling = self.limits.compile == "on" or (self.limits.compile == "auto" and lm.device.type in COMPILE_PAYS_ON)
            if compiling and not self.limits.compile_in_background:
                self.scheduler.compile(on_ready=self._remeasure, short_steps=self._short_steps())
            # In the background, compilation starts after `warmup`: warm-up's eager forwards
            # would otherwise share the cores with the compiler and keep the service from SERVING.
            self._compile_later = compiling and self.limits.compile_in_background

    @property
    def batches(self) -> bool:
        """Sessions may run on threads of their own: their forwards meet in the scheduler."""
        return self.scheduler is not None

    def info(self) -> ModelInfo:
        usage = self.cache.usage() if self.cache is not None else None
        return ModelInfo(
            model_name=self.lm.name,
            vocab_size=self.lm.vocab_size,
            tokenizer_fingerprint=self._fingerprint,
            eos_token_ids=self.lm.eos_token_ids,
            max_context=self.max_tokens,
            capabilities=["session", "propose", "branches", "tree", "verify", "verify_tree", "tree_rounds", "entropy", "attention_stats"]
            + (["batching"] if self.batches else [])
            + (["medusa"] if self.lm.medusa is not None else []),
            role=self.role,
            tokenizer_source=self.lm.tokenizer_source,
            device=str(self.lm.device),
            dtype=str(self.lm.dtype).removeprefix("torch."),
            cache=usage,
            medusa_heads=self.lm.medusa.num_heads if self.lm.medusa is not None else 0,
            forward_costs=list(self._forward_costs),
            decode_ms_per_token=self._decode_ms_per_token,
            quantization=self.lm.quantization,
            compiled=self.scheduler is not None and self.scheduler.compiled,
            compiling=self.scheduler is not None and self.scheduler.compiling,
            medusa_choices=self.lm.medusa_choices,
        )

    @property
    def max_tokens(self) -> int:
        """The longest sequence a session may hold."""
        if self.cache is not None:
            return min(self.lm.max_context, self.cache.shape.max_len)
        return self.lm.max_context

    def new_session(self) -> EngineSession:
        kv: SessionKV
        if self.cache is not None and self.scheduler is not None:
            kv = SlotKV(self.cache, self.scheduler, self.limits.queue_timeout_s)
            slots = self.cache.shape.max_len + SLACK  # a tree's nodes occupy a slot each
        else:
            kv = DynamicKV(self.lm)
            slots = 1 << 30  # a DynamicCache grows
        return EngineSession(self.lm, kv, self.max_tokens, slots)

    def warmup(self) -> None:
        """One short generation, so the first request doesn't pay for lazy initialisation; then
        the forward costs `info` reports."""
        session = self.new_session()
        prompt = [i % self.lm.vocab_size for i in range(1, 9)]
        session.open(OpenRequest(prompt_ids=prompt, scoring=Scoring(ScoreKind.ARGMAX)))
        session.step(StepRequest(append_ids=[1], propose=2, propose_greedy=True))
        session.close()
        self._forward_costs, self._decode_ms_per_token = self.measure_costs()
        if self._compile_later and self.scheduler is not None:
            self._compile_later = False
            self.scheduler.compile(background=True, on_ready=self._remeasure, short_steps=self._short_steps())

    def _short_steps(self) -> bool:
        """Fused steps and the C++ wrapper (`FUSE_MAX_LAYERS`)."""
        return self.cache is not None and self.cache.shape.layers <= FUSE_MAX_LAYERS

    def _remeasure(self) -> None:
        """Compiled forwards cost less than the eager ones `warmup` timed: `Info` reports these,
        and the batches' costs are learnt again."""
        if self.scheduler is not None:
            self.scheduler.costs.clear()
        if isinstance(self.lm.medusa, FeatureDrafter) and self.scheduler is not None:
            # It drafts on the forward thread (`Scheduler.call`), and dynamo guards on the count.
            threads = torch.get_num_threads()
            compute_on(self.scheduler.threads)
            choices = json.loads(self.lm.medusa_choices) if self.lm.medusa_choices else []  # its tree, else a chain
            self.lm.medusa.compile_steps([(max(map(len, choices)), max(map(max, choices)) + 1)] if choices else [(3, 1)])
            compute_on(threads)
        if self._forward_costs:
            self._forward_costs, self._decode_ms_per_token = self.measure_costs()

    def measure_costs(
        self, repeats: int = 7, positions: Sequence[int] = COST_POSITIONS, decode_tokens: int = DECODE_TOKENS
    ) -> tuple[list[tuple[int, float]], float]:
        """Median ms of one session's cached forward at each of `positions` new positions, all
        scored (a verification), and ms a token of a `decode_tokens`-token greedy round, after a
        64-token prompt (shorter where the context is); ([], 0.0) when the context is too short.
        Each round times every width once, so a disturbance that lasts a while (another process
        on the cores) falls on every width alike, not on the widths timed during it."""
        held = min(64, self.max_tokens - max(positions) - decode_tokens - 1)
        if held < 1:
            return [], 0.0
        session = self.new_session()
        session.open(OpenRequest(prompt_ids=[i % self.lm.vocab_size for i in range(held)]))
        filler = 1 % self.lm.vocab_size
        steps = [StepRequest(append_ids=[filler] * n, scoring=Scoring(ScoreKind.ARGMAX, positions=n)) for n in positions]
        steps.append(StepRequest(append_ids=[filler], propose=decode_tokens, propose_greedy=True, propose_ids_only=True))
        times: list[list[float]] = [[] for _ in steps]
        try:
            for round_ in range(repeats + 1):  # the first round, each shape's first call, is not counted
                for step, samples in zip(steps, times, strict=True):
                    started = time.perf_counter()
                    session.step(replace(step, keep_tokens=held))
                    if round_:
                        samples.append(time.perf_counter() - started)
        finally:
            session.close()
        medians = [statistics.median(samples) * 1e3 for samples in times]
        costs, decode = list(zip(positions, medians[:-1], strict=True)), medians[-1]
        return costs, decode / decode_tokens
