"""`specwire bench`: specwire against Hugging Face transformers, same prompts, models and settings.

One invocation measures, side by side and interleaved (each repeat runs every row on a prompt
before the next prompt, in a freshly shuffled order turned by one each prompt, so drifting
machine load falls on the rows a ratio pairs alike):

  (a) `hf_target`                  transformers `generate`, target only, in-process;
  (b) `hf_assisted_default`        assisted generation with `assistant_model` and the assistant's
                                   installed defaults (transformers 5.23: schedule "constant",
                                   20 tokens, assistant_confidence_threshold 0.4);
      `hf_assisted_heuristic`      num_assistant_tokens_schedule "heuristic" from γ (+2 after a fully
                                   accepted round, −1 otherwise), confidence threshold off; the
                                   schedule's state is reset before every call so calls are comparable;
      `hf_assisted_constant`       "constant" γ tokens, confidence threshold off (Leviathan et al.);
      `hf_prompt_lookup`           `prompt_lookup_num_tokens` = γ (n-gram matching, size ≤ 2);
      `llamacpp`                   llama.cpp greedy on the GGUF the target was prepared from, in-process
                                   (`specwire.bench.llamacpp`; where llama-cpp-python is installed);
  (c) `specwire_greedy`            target-only greedy through the orchestrator over gRPC;
  (d) `specwire_speculative`       speculative with the draft model over gRPC, the defaults: auto γ
                                   (with target-only rounds when speculation is predicted slower)
                                   and pipelined drafting;
      `specwire_speculative_sequential` the draft model at a fixed γ, no pipelining, no fallback;
      `specwire_speculative_tree`  the same, with the draft's `--draft-alternatives` runners-up at
                                   each position verified beside the chain as one token tree
                                   (`draft_alternatives`; its α counts a runner-up taken as accepted);
      `specwire_speculative_model` the defaults without rounds copied from the history
                                   (`lookup_min_ngram` 0): the draft model's rounds alone;
      `specwire_speculative_ngram` speculative with the n-gram drafter (a second stack), defaults
                                   (the orchestrator drafts: one target message per round);
      `specwire_speculative_sampled` auto γ, sampling at `specwire_sample`'s warpers and seeds:
                                   its speedup is over that row, the same distribution decoded
                                   without a draft (its tokens are not compared with greedy ones).
  (e) `specwire_sample`            target-only sampling at entropix's base warpers (T 0.666, top-p
                                   0.9, top-k 27), seeded, gRPC;
      `specwire_entropix`          entropy-adaptive sampling (reference defaults), seeded, gRPC;
      `specwire_entropix_speculative` the same policy verifying γ draft tokens per round (its
                                   speedup is measured over `specwire_entropix`).
      The (e) rows sample, so they are not compared with (a)'s tokens. `entropix_metrics_cost` in
      the metadata times (thread CPU time, one torch thread), in-process and interleaved, one
      cached target step scoring the top 100 logits with and without the entropix metrics
      (`Scoring.extras`): the metrics' cost as a share of the target's step.
  (f) `specwire_medusa`            Medusa with the target's heads (`--medusa`, default: the demo
                                   target's), the default tree, greedy, over gRPC;
      `specwire_medusa_lossless`   the same, sampled at T = 0.7 (seeded) with lossless tree acceptance;
      `specwire_medusa_typical`    the same, sampled at T = 0.7 (seeded) with typical acceptance (LOSSY).
      The sampled Medusa rows do not decode greedily: they are not compared with (a)'s tokens, and
      their speed-up is over the greedy row (c), which costs what target-only sampling costs.
  (g) `specwire_beam`              beam search, `--num-beams` k, length_penalty 0, over gRPC;
      `specwire_best_first_beam`   best-first beam search at the same k (the same result; fewer
                                   target rows). These two rows honour end-of-sequence, as beam search
                                   is used: best-first saves where a finished hypothesis is certain
                                   early, and with eos ignored every hypothesis ends at max_new_tokens.
                                   They are compared with each other, not with (a): `matches_beam`
                                   (tokens equal to `specwire_beam`'s, per (repeat, prompt)),
                                   `expansions_per_generation` (target rows scored),
                                   `expansions_ratio_vs_beam` (all rows scored ÷ beam's) and
                                   `wall_ratio_vs_beam` (median over repeats of the prompts' summed
                                   wall time ÷ beam's in the same repeat).

Every row but (g) decodes greedily and ignores end-of-sequence (transformers: `eos_token_id=None`;
specwire: `ignore_eos`), so every row generates exactly `max_new_tokens` tokens per prompt, and
`matches_hf_target` records the share of (repeat, prompt) pairs whose tokens equal row (a)'s.
With `--concurrency 1,2,4,8`, the report also has a top-level `concurrency` list: for each
strategy (greedy; speculative and speculative_ngram, with their rows' parameters, when those
rows run) and each stream count N, N threads run `Generate` calls at once, `--repeats` times; each
round covers every prompt (call i takes prompt i mod the prompts, N calls or as many as there are
prompts, thread j the calls j, j + N, ...), so one stream's rate is over the same prompts as the
rows'. Per entry:
`aggregate_tokens_per_s` (all streams' tokens over the wall time of the round of N, median over
repeats; each repeat runs every strategy's levels in one shuffled order), `ratio_vs_one_stream`
and `ratio_vs_greedy` (the median over repeats of the rate over one stream's of the same strategy,
and over greedy's at as many streams, in the same repeat), `p50_token_ms` / `p99_token_ms` (over
streams and repeats, of a stream's wall time per token), `matches_solo` (the share of streams
whose tokens equal the N = 1 run on the same prompt), and for speculative strategies
`tokens_per_target_forward` and `off_round_share` (the share of rounds auto γ ran target-only).
The specwire rows run against three real services started by `specwire.client.launcher.Stack` on
loopback (`--rtt-ms R`: through the delay proxy, R ms round trip to each service); time is
measured by the client around each `Generate` call.

Derived figures (null where they do not apply):
  ratio_vs_hf_target / ratio_vs_hf_assisted / ratio_vs_llamacpp: the median over repeats of this
    row's tokens/s over row (a)'s / the best (b) row's (best median tokens/s) / the `llamacpp`
    row's in the same repeat (paired ratios);
  acceptance_rate: accepted / drafted tokens; alpha: accepted / (accepted + rejections), the
    per-token acceptance probability of the i.i.d. model (`specwire.orchestrator.speedup.alpha_estimate`);
  cost_ratio_c: (draft compute per drafted token) / (target compute per target forward) — the
    services' own reported compute for specwire rows, forward hooks on the in-process models for
    transformers rows;
  predicted_speedup: Leviathan et al. (1 − α^(γ+1)) / ((1 − α)(γ·c + 1)) with γ = mean drafted
    tokens per round; efficiency: measured speedup (over (c) for specwire rows, over (a) for
    transformers rows) / predicted_speedup;
  bytes_per_round, overhead_ms_per_round (orchestrator time per round: wall − waiting on services)
    and the rest of the round breakdown come from the orchestrator's `GenerationStats`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from specwire.bench import llamacpp
from specwire.bench.report import render
from specwire.client.launcher import Stack, StackConfig, free_base_port
from specwire.client.pair import pair_heads
from specwire.orchestrator.speedup import alpha_estimate, predicted_speedup

from specwire.config import QUANTIZE_MODES
from specwire.demo import demo_draft_dir, demo_medusa_dir, demo_target_dir
from specwire.session import ModelInfo

SCHEMA = "specwire.bench/1"

# Code the demo pair was trained on (the Python standard library) would be memorised; these are
# ordinary openings of the kinds of code it saw.
DEFAULT_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    'class LRUCache:\n    """A least-recently-used cache."""\n\n    def __init__(self, capacity):\n',
    "    def __repr__(self):\n        return ",
]


# Named prompt sets (`--prompts NAME`). input_grounded: answers that copy from the prompt (edit
# this function, continue this list, answer from this passage), where prompt lookup drafts well.
PROMPT_SETS = Path(__file__).parent / "prompts"


@dataclass(frozen=True)
class RowSpec:
    name: str
    group: str  # "hf_target" (a), "hf_assisted" (b), "specwire" (c, d)
    description: str


ROWS = [
    RowSpec("hf_target", "hf_target", "transformers generate, target only (greedy)"),
    RowSpec("hf_assisted_default", "hf_assisted", "transformers assisted, installed defaults"),
    RowSpec("hf_assisted_heuristic", "hf_assisted", "transformers assisted, heuristic schedule from γ"),
    RowSpec("hf_assisted_constant", "hf_assisted", "transformers assisted, constant γ"),
    RowSpec("hf_prompt_lookup", "hf_assisted", "transformers prompt lookup, γ tokens"),
    RowSpec("llamacpp", "llamacpp", "llama.cpp greedy on the target's GGUF, the target's threads"),
    RowSpec("specwire_greedy", "specwire", "specwire greedy, target only, gRPC"),
    RowSpec("specwire_speculative", "specwire", "specwire speculative, draft model, auto γ, the stack's pipelining, gRPC"),
    RowSpec("specwire_speculative_sequential", "specwire", "specwire speculative, draft model, fixed γ, sequential"),
    RowSpec("specwire_speculative_model", "specwire", "specwire speculative, the draft model's rounds alone (no copies from the history), auto γ"),
    RowSpec("specwire_speculative_tree", "specwire", "specwire speculative, draft model, fixed γ, sequential, the draft's runners-up as a tree"),
    RowSpec("specwire_speculative_ngram", "specwire", "specwire speculative, n-gram drafter, auto γ, gRPC"),
    RowSpec("specwire_speculative_sampled", "specwire", "specwire speculative, draft model, auto γ, specwire_sample's warpers"),
    RowSpec("specwire_sample", "specwire_sampled", "specwire sampling at entropix's base warpers, seeded, gRPC"),
    RowSpec("specwire_entropix", "specwire_sampled", "specwire entropix (entropy-adaptive), seeded, gRPC"),
    RowSpec("specwire_entropix_speculative", "specwire_sampled", "specwire entropix verified from draft proposals, γ"),
    RowSpec("specwire_medusa", "specwire", "specwire Medusa, target's heads, greedy, gRPC"),
    RowSpec("specwire_medusa_lossless", "specwire_medusa_sampled", "specwire Medusa, T=0.7, lossless tree acceptance, gRPC"),
    RowSpec("specwire_medusa_typical", "specwire_medusa_sampled", "specwire Medusa, T=0.7, typical acceptance (lossy), gRPC"),
    RowSpec("specwire_beam", "specwire_beam", "specwire beam search, k beams, length_penalty 0, eos honoured, gRPC"),
    RowSpec("specwire_best_first_beam", "specwire_beam", "specwire best-first beam search, same k, eos honoured, gRPC"),
]
# Row groups that sample: their tokens are not compared with greedy ones.
SAMPLED_GROUPS = ("specwire_sampled", "specwire_medusa_sampled")
# A speculative row's non-speculative twin, where it is not its group's (`measured_speedup`).
TWINS = {"specwire_speculative_sampled": "specwire_sample"}
# Beam search rows: compared with `specwire_beam`, not with greedy transformers.
BEAM_GROUP = "specwire_beam"
# Entropix's base warpers (the reference's defaults), for a like-for-like sampling row.
BASE_WARPERS = {"temperature": 0.666, "top_p": 0.9, "top_k": 27}
# How each specwire row calls `Generate` beyond strategy, prompt and length; "gamma" = `--gamma`,
# "num_beams" = `--num-beams`, "draft_alternatives" = `--draft-alternatives`.
SPECWIRE_PARAMS: dict[str, dict[str, Any]] = {
    "specwire_greedy": {"strategy": "greedy"},
    "specwire_speculative": {"strategy": "speculative"},
    "specwire_speculative_sequential": {
        "strategy": "speculative", "num_speculative_tokens": "gamma", "speculative_pipeline": False
    },
    "specwire_speculative_tree": {
        "strategy": "speculative", "num_speculative_tokens": "gamma", "speculative_pipeline": False,
        "draft_alternatives": "draft_alternatives",
    },
    "specwire_speculative_model": {"strategy": "speculative", "lookup_min_ngram": 0},
    "specwire_speculative_ngram": {"strategy": "speculative"},
    "specwire_speculative_sampled": {"strategy": "speculative", **BASE_WARPERS},
    # Seeded by the prompt's length (`specwire_sample`), so every run draws the same tokens.
    "specwire_sample": {"strategy": "sample", **BASE_WARPERS},
    "specwire_entropix": {"strategy": "entropix", **BASE_WARPERS},
    "specwire_entropix_speculative": {"strategy": "entropix", "num_speculative_tokens": "gamma", **BASE_WARPERS},
    # Medusa (`--medusa` heads on the model stack's target; `--medusa-choices` sets their tree).
    "specwire_medusa": {"strategy": "medusa"},
    "specwire_medusa_lossless": {"strategy": "medusa", "temperature": 0.7, "medusa_acceptance": "lossless"},
    "specwire_medusa_typical": {"strategy": "medusa", "temperature": 0.7, "medusa_acceptance": "typical"},
    # Beam search as it is used, ending at eos; best-first's condition for beam's result is length_penalty 0.
    "specwire_beam": {"strategy": "beam", "num_beams": "num_beams", "length_penalty": 0.0, "ignore_eos": False},
    "specwire_best_first_beam": {"strategy": "best_first_beam", "num_beams": "num_beams", "ignore_eos": False},
}
ROW_NAMES = [row.name for row in ROWS]
# Rows measured at each `--concurrency` level besides greedy, where the run has them.
CONCURRENCY_ROWS = ("specwire_speculative", "specwire_speculative_model", "specwire_speculative_ngram", "specwire_medusa")
MEDUSA_ROWS = [name for name, params in SPECWIRE_PARAMS.items() if params["strategy"] == "medusa"]
# Rows whose proposals come from the draft model.
MODEL_DRAFTED_ROWS = {
    name for name, params in SPECWIRE_PARAMS.items()
    if params["strategy"] == "speculative" or "num_speculative_tokens" in params
} - {"specwire_speculative_ngram"}


@dataclass(frozen=True)
class BenchConfig:
    target_model: str
    draft_model: str
    prompts: list[str]
    quantize: str = "auto"  # the model services' --quantize
    target_quantize: str | None = None  # the target's, where it differs
    prefix_cache: bool = True  # the model services' --prefix-cache (repeated prompts reuse their keys)
    target_threads: int = 0  # the target service's torch threads, and llama.cpp's; 0: all cores
    draft_threads: int = 0  # the draft service's torch threads; 0: the cores the target leaves (at least 1)
    gguf: str | None = None  # the `llamacpp` row's model (default: the target's own GGUF)
    compile_wait_s: float = 3600.0  # longest wait for the target's compiled forwards before measuring
    start_timeout_s: float = 1200.0  # longest wait for a stack to be SERVING
    max_new_tokens: int = 64
    repeats: int = 3
    gamma: int = 4
    num_beams: int = 4  # k of the beam rows
    draft_alternatives: int = 1  # the tree row's runners-up per drafted position
    device: str = "auto"
    dtype: str = "auto"
    rows: tuple[str, ...] = tuple(ROW_NAMES)
    seed: int = 0
    warmup: bool = True
    port: int = 0  # base port of the stacks (orchestrator; services on +1, +2; proxies +3, +4); 0 = free ones
    rtt_ms: float = 0.0  # specwire rows: round trip through the delay proxy to each service
    show_progress: bool = True
    concurrency: tuple[int, ...] = ()  # stream counts of the concurrency measurement; () = none
    medusa: str | None = None  # the target's Medusa heads (the medusa rows)
    medusa_choices: str | None = None  # the medusa rows' tree (JSON); None = the strategy's default
    command: str | None = None  # the command line that asked for this run, recorded with the figures


@dataclass
class Sample:
    """One generation's outcome, whichever engine produced it."""

    token_ids: list[int]
    seconds: float  # wall time of the call, measured by the caller
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0  # rounds ended by a rejected draft token (a correction)
    off_rounds: int = 0  # target-only rounds auto γ chose
    pipelined_rounds: int = 0
    lookup_rounds: int = 0  # rounds whose drafts were copied from the history
    lookup_drafted: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    expansions: int = 0  # beam search: target rows scored
    target_compute_ms: float = 0.0
    draft_compute_ms: float = 0.0
    # specwire only (the orchestrator's GenerationStats):
    server_wall_ms: float | None = None
    network_ms: float | None = None
    queue_ms: float | None = None
    orchestrator_ms: float | None = None
    bytes_total: int | None = None


@dataclass
class RowResult:
    spec: RowSpec
    samples: list[list[Sample]] = field(default_factory=list)  # [repeat][prompt]
    error: str | None = None

    def tokens_per_s(self) -> list[float]:
        """One figure per repeat: all prompts' tokens over all prompts' seconds."""
        return [sum(len(s.token_ids) for s in run) / sum(s.seconds for s in run) for run in self.samples if run]


# -- transformers, in-process -------------------------------------------------------------------


class ForwardTimer:
    """Counts and times every forward call of a module with a pair of hooks."""

    def __init__(self, module: Any) -> None:
        self.durations_ms: list[float] = []
        self._started = 0.0
        module.register_forward_pre_hook(self._before)
        module.register_forward_hook(self._after)

    def _before(self, *args: Any) -> None:
        self._started = time.perf_counter()

    def _after(self, *args: Any) -> None:
        self.durations_ms.append((time.perf_counter() - self._started) * 1e3)

    def take(self) -> list[float]:
        taken, self.durations_ms = self.durations_ms, []
        return taken


@contextlib.contextmanager
def count_verifications(log: list[tuple[int, int]]) -> Iterator[None]:
    """Record (candidates, matches) of every assisted-generation round.

    transformers calls `update_candidate_strategy(input_ids, scores, num_matches)` once per round
    with scores for candidates + 1 positions; the assistant's override does not call the base
    one, so wrapping both counts each round once. Restored on exit.
    """
    from transformers.generation import candidate_generator

    classes: tuple[Any, ...] = (candidate_generator.CandidateGenerator, candidate_generator.AssistedCandidateGenerator)
    originals = [cls.__dict__["update_candidate_strategy"] for cls in classes]

    def wrap(original: Callable[..., None]) -> Callable[..., None]:
        def update_candidate_strategy(self: Any, input_ids: Any, scores: Any, num_matches: Any) -> None:
            log.append((int(scores.shape[1]) - 1, int(num_matches)))
            original(self, input_ids, scores, num_matches)

        return update_candidate_strategy

    for cls, original in zip(classes, originals, strict=True):
        cls.update_candidate_strategy = wrap(original)
    try:
        yield
    finally:
        for cls, original in zip(classes, originals, strict=True):
            cls.update_candidate_strategy = original


# Assistant generation-config fields each (b) row sets; None = the installed default.
ASSISTANT_FIELDS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")


class HfRunner:
    """The target and draft as plain transformers models in this process."""

    def __init__(self, target_dir: str, draft_dir: str, device: str, dtype: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        from specwire.engine import resolve_device, resolve_dtype, trimmed_vocab

        hf_logging.set_verbosity_error()
        self.torch = torch
        self.device = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, self.device)
        target: Any = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch_dtype)
        draft: Any = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch_dtype)
        trimmed_vocab.expand(draft, draft_dir)  # a trimmed-vocabulary draft speaks the target's ids
        self.target = target.to(self.device).eval()
        self.draft = draft.to(self.device).eval()
        self.target_timer = ForwardTimer(self.target)
        self.draft_timer = ForwardTimer(self.draft)
        self._assistant_defaults = {name: getattr(self.draft.generation_config, name) for name in ASSISTANT_FIELDS}
        pad = self.target.generation_config.pad_token_id
        self.pad_token_id = pad if pad is not None else 0

    def parameters(self) -> dict[str, int]:
        return {
            "target": sum(p.numel() for p in self.target.parameters()),
            "draft": sum(p.numel() for p in self.draft.parameters()),
        }

    def single_forward_ms(self, context: int = 32, count: int = 40) -> dict[str, float]:
        """Median time of one cached single-token forward of each model: c measured directly."""
        from transformers import DynamicCache

        torch = self.torch
        medians = {}
        for label, model in (("target", self.target), ("draft", self.draft)):
            ids = torch.arange(1, context + 1, device=self.device).unsqueeze(0) % model.config.vocab_size
            times = []
            with torch.inference_mode():
                cache = DynamicCache()
                model(input_ids=ids, past_key_values=cache, use_cache=True)
                for _ in range(count):
                    started = time.perf_counter()
                    model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True, logits_to_keep=1)
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    times.append((time.perf_counter() - started) * 1e3)
                    cache.crop(-1)  # transformers ≥ 5: a negative count removes that many
            medians[f"{label}_forward_ms"] = statistics.median(times)
        self.target_timer.take(), self.draft_timer.take()
        medians["cost_ratio_c_direct"] = medians["draft_forward_ms"] / medians["target_forward_ms"]
        return medians

    def _assistant_settings(self, row: str, gamma: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """(assistant generation-config fields, extra `generate` keywords) of a (b) row."""
        if row == "hf_assisted_default":
            return dict(self._assistant_defaults), {"assistant_model": self.draft}
        if row == "hf_assisted_heuristic":
            fields = {"num_assistant_tokens": gamma, "num_assistant_tokens_schedule": "heuristic"}
            return fields | {"assistant_confidence_threshold": 0.0}, {"assistant_model": self.draft}
        if row == "hf_assisted_constant":
            fields = {"num_assistant_tokens": gamma, "num_assistant_tokens_schedule": "constant"}
            return fields | {"assistant_confidence_threshold": 0.0}, {"assistant_model": self.draft}
        if row == "hf_prompt_lookup":
            return dict(self._assistant_defaults), {"prompt_lookup_num_tokens": gamma}
        if row == "hf_target":
            return dict(self._assistant_defaults), {}
        raise ValueError(f"not a transformers row: {row!r}")

    def generate(self, row: str, prompt_ids: list[int], max_new_tokens: int, gamma: int) -> Sample:
        torch = self.torch
        assistant_fields, extra = self._assistant_settings(row, gamma)
        for name, value in assistant_fields.items():
            setattr(self.draft.generation_config, name, value)
        input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        rounds: list[tuple[int, int]] = []
        self.target_timer.take(), self.draft_timer.take()
        with count_verifications(rounds), torch.inference_mode():
            started = time.perf_counter()
            output = self.target.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,  # ignore end-of-sequence: every row makes max_new_tokens tokens
                pad_token_id=self.pad_token_id,
                **extra,
            )
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            seconds = time.perf_counter() - started
        target_ms, draft_ms = self.target_timer.take(), self.draft_timer.take()
        return Sample(
            token_ids=output[0, len(prompt_ids) :].tolist(),
            seconds=seconds,
            rounds=len(rounds) if rounds else len(target_ms),
            drafted=sum(candidates for candidates, _ in rounds),
            accepted=sum(matches for _, matches in rounds),
            rejected=sum(1 for candidates, matches in rounds if matches < candidates),
            target_forwards=len(target_ms),
            draft_forwards=len(draft_ms),
            target_compute_ms=sum(target_ms),
            draft_compute_ms=sum(draft_ms),
        )


# -- specwire over gRPC -------------------------------------------------------------------------


def row_params(row: str, gamma: int, num_beams: int = 4, draft_alternatives: int = 1) -> dict[str, Any]:
    """The `Generate` keywords of a specwire row, beyond prompt and length."""
    flags = {"gamma": gamma, "num_beams": num_beams, "draft_alternatives": draft_alternatives}
    return {name: flags.get(value, value) if isinstance(value, str) else value for name, value in SPECWIRE_PARAMS[row].items()}


def specwire_sample(client: Any, params: dict[str, Any], prompt_ids: list[int], max_new_tokens: int) -> Sample:
    """One `Generate` through an orchestrator; `client` is a `client.sdk.Client`, `params` its keywords."""
    params = {"ignore_eos": True} | params | {"max_new_tokens": max_new_tokens}
    if "temperature" in params and "seed" not in params:  # seeded sampled rows: the same draws every repeat
        params["seed"] = len(prompt_ids)
    started = time.perf_counter()
    result = client.generate(input_ids=prompt_ids, **params)
    seconds = time.perf_counter() - started
    s = result.stats
    return Sample(
        token_ids=list(result.token_ids),
        seconds=seconds,
        rounds=s.rounds,
        drafted=s.drafted_tokens,
        accepted=s.accepted_tokens,
        rejected=s.corrections,
        off_rounds=s.speculation_off_rounds,
        pipelined_rounds=s.pipelined_rounds,
        lookup_rounds=s.lookup_rounds,
        lookup_drafted=s.lookup_drafted_tokens,
        target_forwards=s.target_forwards,
        draft_forwards=s.draft_forwards,
        expansions=s.expansions,
        target_compute_ms=s.target_compute_ms,
        draft_compute_ms=s.draft_compute_ms,
        server_wall_ms=s.wall_ms,
        network_ms=s.target_network_ms + s.draft_network_ms,
        queue_ms=s.target_queue_ms + s.draft_queue_ms,
        orchestrator_ms=s.orchestrator_ms,
        bytes_total=s.target_bytes_sent + s.target_bytes_received + s.draft_bytes_sent + s.draft_bytes_received,
    )


def concurrency_entries(
    runs: Sequence[tuple[str, Any, dict[str, Any]]], prompt_ids: list[list[int]], levels: Sequence[int],
    max_new_tokens: int, repeats: int, seed: int = 0,
) -> list[dict[str, Any]]:
    """N concurrent `Generate` calls per level for each of `runs` (label, client, keywords; see the
    module docstring for the fields). Each repeat runs every (strategy, level) once, in a freshly
    shuffled order, so that load drift spreads over all and ratios pair within a repeat."""
    solo = {label: {i: specwire_sample(client, params, ids, max_new_tokens).token_ids for i, ids in enumerate(prompt_ids)}
            for label, client, params in runs}
    rates: dict[tuple[str, int], list[float]] = {(label, n): [] for label, _, _ in runs for n in levels}
    matches: dict[tuple[str, int], list[bool]] = {key: [] for key in rates}
    done: dict[tuple[str, int], list[Sample]] = {key: [] for key in rates}
    rng = random.Random(seed)
    with ThreadPoolExecutor(max_workers=max(levels)) as pool:
        for _ in range(repeats):
            order = [(run, streams) for run in runs for streams in levels]
            rng.shuffle(order)
            for (label, client, params), streams in order:
                calls = [i % len(prompt_ids) for i in range(max(streams, len(prompt_ids)))]

                def stream(j: int, calls: list[int] = calls, streams: int = streams, client: Any = client,
                           params: dict[str, Any] = params) -> list[Sample]:
                    return [specwire_sample(client, params, prompt_ids[i], max_new_tokens) for i in calls[j::streams]]

                started = time.perf_counter()
                per_stream = list(pool.map(stream, range(streams)))
                wall = time.perf_counter() - started
                which = [i for j in range(streams) for i in calls[j::streams]]
                samples = [sample for done in per_stream for sample in done]
                key = (label, streams)
                rates[key].append(sum(len(s.token_ids) for s in samples) / wall)
                matches[key] += [s.token_ids == solo[label][i] for s, i in zip(samples, which, strict=True)]
                done[key] += samples
    entries: list[dict[str, Any]] = []
    greedy = next((label for label, _, params in runs if params.get("strategy") == "greedy"), None)
    for label, _, _ in runs:
        for streams in levels:
            key = (label, streams)
            latencies = sorted(1e3 * s.seconds / max(1, len(s.token_ids)) for s in done[key])
            entries.append({
                "strategy": label,
                "streams": streams,
                "aggregate_tokens_per_s": statistics.median(rates[key]),
                "p50_token_ms": statistics.median(latencies),
                "p99_token_ms": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
                "matches_solo": sum(matches[key]) / len(matches[key]),
                # Speculative rows: how far auto γ speculated at this load.
                "tokens_per_target_forward": _ratio(sum(len(s.token_ids) for s in done[key]),
                                                    sum(s.target_forwards for s in done[key])),
                "off_round_share": _ratio(sum(s.off_rounds for s in done[key]), sum(s.rounds for s in done[key])),
            })
    for entry in entries:
        label, streams = entry["strategy"], entry["streams"]
        one = next((e for e in entries if e["strategy"] == label and e["streams"] == 1), None)
        # Paired: over one stream's rate, and over greedy's at as many streams, in the same repeat;
        # the median over repeats.
        entry["ratio_vs_one_stream"] = _paired(rates[(label, streams)], rates[(label, 1)]) if one else None
        entry["ratio_vs_greedy"] = (_paired(rates[(label, streams)], rates[(greedy, streams)])
                                    if greedy is not None and label != greedy else None)
        entry["p50_ratio_vs_one_stream"] = _ratio(entry["p50_token_ms"], one["p50_token_ms"]) if one else None
    return entries


def entropix_metrics_cost(config: BenchConfig, context: int = 64, steps: int = 200) -> dict[str, Any]:
    """Median time of one cached target step (append a token, score the top 100 logits) with and
    without the entropix metrics, on the serving engine (the batched lean forward where the model
    has one), interleaved in-process on one torch thread, by the thread's CPU time on CPU (wall
    time on a shared machine measures the neighbours) and by wall time on CUDA (the engine
    synchronises before a step returns); cost = (with − without) / without."""
    import torch

    from specwire.engine import CausalLM, Engine, EngineLimits
    from specwire.session import Extras, OpenRequest, ScoreKind, Scoring, StepRequest

    lm = CausalLM.load(config.target_model, device=config.device, dtype=config.dtype)
    engine = Engine(lm, "target", EngineLimits(max_batch_rows=2, max_cache_len=context + steps + 1))
    plain = Scoring(ScoreKind.LOGITS, top_n=100)
    measured = Scoring(ScoreKind.LOGITS, top_n=100, extras=Extras(True, True, True))
    prompt = [(7 * i + 3) % lm.vocab_size for i in range(context)]
    sessions = {"plain": engine.new_session(), "measured": engine.new_session()}
    for session in sessions.values():
        session.open(OpenRequest(prompt, scoring=measured))
    times: dict[str, list[float]] = {"plain": [], "measured": []}
    clock = time.perf_counter if lm.device.type == "cuda" else time.thread_time
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for step in range(steps):
            for name in ("plain", "measured") if step % 2 else ("measured", "plain"):
                scoring = measured if name == "measured" else plain
                started = clock()
                sessions[name].step(StepRequest(append_ids=[(11 * step) % lm.vocab_size], scoring=scoring))
                times[name].append((clock() - started) * 1e3)
    finally:
        torch.set_num_threads(threads)
        for session in sessions.values():
            session.close()
    without, with_metrics = statistics.median(times["plain"]), statistics.median(times["measured"])
    return {
        "step_ms": without,
        "step_with_metrics_ms": with_metrics,
        "cost": (with_metrics - without) / without,
        "engine": "lean" if engine.batches else "hf",
    }


# -- aggregation --------------------------------------------------------------------------------


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _paired_ratio(row: RowResult, base: RowResult | None) -> float | None:
    """Median over repeats of row tokens/s ÷ base tokens/s in the same repeat."""
    if base is None or base.error or row.error:
        return None
    return _paired(row.tokens_per_s(), base.tokens_per_s())


def _paired(ours: Sequence[float], theirs: Sequence[float]) -> float | None:
    """Median over repeats of a rate ÷ a baseline's in the same repeat."""
    return _median([a / b for a, b in zip(ours, theirs, strict=False) if b > 0])


def _matches(row: RowResult, reference: RowResult | None) -> float | None:
    if reference is None or reference.error or row.error or row.spec.group in (*SAMPLED_GROUPS, BEAM_GROUP):
        return None
    pairs = [
        (ours.token_ids, theirs.token_ids)
        for run, ref_run in zip(row.samples, reference.samples, strict=False)
        for ours, theirs in zip(run, ref_run, strict=True)
    ]
    return sum(a == b for a, b in pairs) / len(pairs) if pairs else None


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None


def summarize(results: dict[str, RowResult]) -> list[dict[str, Any]]:
    """The report's rows: every figure named in the module docstring, null where not applicable."""
    hf_target = results.get("hf_target")
    specwire_greedy = results.get("specwire_greedy")
    specwire_beam = results.get("specwire_beam")
    assisted = [r for r in results.values() if r.spec.group == "hf_assisted" and not r.error and r.samples]
    best_assisted = max(assisted, key=lambda r: _median(r.tokens_per_s()) or 0.0, default=None)
    rows = []
    for result in results.values():
        spec = result.spec
        tps = result.tokens_per_s()
        samples = [s for run in result.samples for s in run]
        row: dict[str, Any] = {
            "name": spec.name,
            "group": spec.group,
            "description": spec.description,
            "error": result.error,
            "tokens_per_s": _median(tps),
            "tokens_per_s_min": min(tps) if tps else None,
            "tokens_per_s_max": max(tps) if tps else None,
            "tokens_per_s_per_repeat": tps,
            # Beam rows end at eos: their tokens per second are not comparable with greedy rows'.
            "ratio_vs_hf_target": None if spec.group == BEAM_GROUP else _paired_ratio(result, hf_target),
            "ratio_vs_hf_assisted": None if spec.group == BEAM_GROUP else _paired_ratio(result, best_assisted),
            "ratio_vs_llamacpp": None if spec.group == BEAM_GROUP else _paired_ratio(result, results.get("llamacpp")),
            "best_hf_assisted_row": best_assisted.spec.name if best_assisted else None,
            "matches_hf_target": _matches(result, hf_target),
            "new_tokens_per_repeat": sum(len(s.token_ids) for s in samples) // max(1, len(result.samples)),
        }
        baseline = results.get(TWINS[spec.name]) if spec.name in TWINS else {
            "specwire": specwire_greedy,
            "specwire_sampled": results.get("specwire_entropix"),
            "specwire_medusa_sampled": specwire_greedy,
        }.get(
            spec.group, hf_target
        )
        row |= _speculation_figures(result, samples, baseline)
        row |= _round_breakdown(samples)
        row |= _beam_figures(result, samples, specwire_beam)
        rows.append(row)
    return rows


def _speculation_figures(result: RowResult, samples: list[Sample], baseline: RowResult | None) -> dict[str, Any]:
    """Speculation's figures; the measured speedup is over `baseline` (the row's non-speculative twin)."""
    empty = dict.fromkeys(
        ["acceptance_rate", "alpha", "gamma", "cost_ratio_c", "predicted_speedup", "measured_speedup", "efficiency",
         "speculation_off_rounds_per_generation", "pipelined_round_share", "lookup_round_share"]
    )
    tokens = sum(len(s.token_ids) for s in samples)
    target_forwards = sum(s.target_forwards for s in samples)
    figures: dict[str, Any] = {"tokens_per_target_forward": _ratio(tokens, target_forwards) if samples else None}
    drafted = sum(s.drafted for s in samples)
    if not samples or result.spec.name in ("hf_target", "specwire_greedy") or drafted == 0:
        return figures | empty
    if result.spec.name in MEDUSA_ROWS:  # a tree, not a chain: the chain model's α, γ, c do not apply
        accepted = sum(s.accepted for s in samples)
        return figures | empty | {
            "acceptance_rate": accepted / drafted,
            "measured_speedup": _paired_ratio(result, baseline),
        }
    rounds = sum(s.rounds - s.off_rounds for s in samples)  # speculative rounds
    accepted = sum(s.accepted for s in samples)
    alpha = alpha_estimate(accepted, sum(s.rejected for s in samples))
    gamma = drafted / rounds
    # c is the draft model's: copied drafts cost it nothing.
    modelled = drafted - sum(s.lookup_drafted for s in samples)
    draft_ms_per_token = sum(s.draft_compute_ms for s in samples) / modelled if modelled else 0.0
    target_ms_per_forward = sum(s.target_compute_ms for s in samples) / target_forwards if target_forwards else 0.0
    cost = draft_ms_per_token / target_ms_per_forward if target_ms_per_forward > 0 else None
    predicted = predicted_speedup(alpha, gamma, cost) if cost is not None else None
    measured = _paired_ratio(result, baseline)
    return figures | {
        "acceptance_rate": accepted / drafted,
        "alpha": alpha,
        "gamma": gamma,
        "cost_ratio_c": cost,
        "predicted_speedup": predicted,
        "measured_speedup": measured,
        "efficiency": measured / predicted if measured is not None and predicted else None,
        "speculation_off_rounds_per_generation": sum(s.off_rounds for s in samples) / len(samples),
        "pipelined_round_share": _ratio(sum(s.pipelined_rounds for s in samples), rounds),
        "lookup_round_share": _ratio(sum(s.lookup_rounds for s in samples), rounds),
    }


def _beam_figures(result: RowResult, samples: list[Sample], beam: RowResult | None) -> dict[str, Any]:
    """The beam rows' figures (module docstring, (g)); the ratios and matches are over `beam`."""
    figures: dict[str, Any] = dict.fromkeys(
        ["expansions_per_generation", "target_forwards_per_generation", "expansions_ratio_vs_beam",
         "wall_ratio_vs_beam", "matches_beam"]
    )
    if result.spec.group != BEAM_GROUP or not samples:
        return figures
    figures["expansions_per_generation"] = statistics.fmean(s.expansions for s in samples)
    figures["target_forwards_per_generation"] = statistics.fmean(s.target_forwards for s in samples)
    if beam is None or beam.error or beam is result or not beam.samples:
        return figures
    pairs = [
        (ours, theirs)
        for run, beam_run in zip(result.samples, beam.samples, strict=False)
        for ours, theirs in zip(run, beam_run, strict=True)
    ]
    walls = [
        sum(s.seconds for s in run) / sum(s.seconds for s in beam_run)
        for run, beam_run in zip(result.samples, beam.samples, strict=False)
    ]
    return figures | {
        "expansions_ratio_vs_beam": _ratio(sum(a.expansions for a, _ in pairs), sum(b.expansions for _, b in pairs)),
        "wall_ratio_vs_beam": _median(walls),
        "matches_beam": sum(a.token_ids == b.token_ids for a, b in pairs) / len(pairs) if pairs else None,
    }


def _round_breakdown(samples: list[Sample]) -> dict[str, Any]:
    """Per-round means from the orchestrator's statistics (specwire rows only)."""
    keys = ["bytes_per_round", "overhead_ms_per_round", "round_ms", "draft_ms_per_round", "target_ms_per_round",
            "network_ms_per_round", "queue_ms_per_round", "client_overhead_ms_per_request"]
    if not samples or samples[0].server_wall_ms is None:
        return dict.fromkeys(keys)
    rounds = sum(s.rounds for s in samples)

    def per_round(values: Sequence[float | int | None]) -> float | None:
        return sum(v or 0 for v in values) / rounds if rounds else None

    return {
        "bytes_per_round": per_round([s.bytes_total for s in samples]),
        "overhead_ms_per_round": per_round([s.orchestrator_ms for s in samples]),
        "round_ms": per_round([s.server_wall_ms for s in samples]),
        "draft_ms_per_round": per_round([s.draft_compute_ms for s in samples]),
        "target_ms_per_round": per_round([s.target_compute_ms for s in samples]),
        "network_ms_per_round": per_round([s.network_ms for s in samples]),
        "queue_ms_per_round": per_round([s.queue_ms for s in samples]),
        # Client ↔ orchestrator hop and the SDK: what the client saw beyond the server's wall time.
        "client_overhead_ms_per_request": statistics.fmean(s.seconds * 1e3 - (s.server_wall_ms or 0.0) for s in samples),
    }


# -- the run ------------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    import grpc
    import torch
    import transformers

    cpu_model = _cpu_model()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "description": f"{os.cpu_count()} CPUs ({cpu_model}), " + (gpu or "no GPU"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),  # the services inherit it
        "cuda": gpu,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "grpcio": grpc.__version__,
        "loadavg_start": list(os.getloadavg()),
    }


def _cpu_model() -> str:
    """The CPU's marketing name (Linux's /proc/cpuinfo), else what `platform` knows."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    name = next((line.partition(":")[2] for line in lines if line.startswith("model name")), "")
    name = name.replace("(R)", "").replace("(TM)", "")
    return " ".join(name.split()) or platform.processor() or platform.machine()


def model_label(path: str, demo_dir: Path) -> str:
    """The demo's own models by name, others as given: a report names no directory of the machine that ran it."""
    return "the demo pair's " + demo_dir.name if Path(path).resolve() == demo_dir.resolve() else home_as_tilde(path)


def home_as_tilde(text: str) -> str:
    """`text` with the home directory written as ~, as a report names no directory of its machine."""
    return text.replace(str(Path.home()) + os.sep, "~" + os.sep)


def stack_configs(config: BenchConfig, needed: set[str]) -> dict[str, StackConfig]:
    """The stacks `needed` rows run on: "model" (drafting with the draft model, or n-grams where no
    row drafts with it) and "ngram" (where "model" drafts with the model: `row_stack`)."""
    stack_configs: dict[str, StackConfig] = {}
    threads = config.target_threads or os.cpu_count() or 1
    cache_args = () if config.prefix_cache else ("--prefix-cache", "off")
    common = StackConfig(target_model=config.target_model, device=config.device, dtype=config.dtype,
                         quantize=config.quantize, target_quantize=config.target_quantize, target_threads=threads,
                         draft_threads=config.draft_threads, extra_target_args=cache_args,
                         extra_draft_args=cache_args)
    common = replace(common, rtt_ms=config.rtt_ms)
    if needed & (set(SPECWIRE_PARAMS) - {"specwire_speculative_ngram"}):
        port = config.port or free_base_port()
        # Without a model-drafted row the draft service drafts n-grams: it holds no weights, and
        # speaks the target's tokenizer where no draft of the target's exists.
        drafted = bool(needed & MODEL_DRAFTED_ROWS)
        stack_configs["model"] = replace(
            common, port=port, draft_model=config.draft_model if drafted else config.target_model,
            drafter="model" if drafted else "ngram", medusa=config.medusa
        )
    if "specwire_speculative_ngram" in needed and stack_configs.get("model", common).drafter != "ngram":
        port = config.port + 10 if config.port else free_base_port()
        # The n-gram drafter has no weights: --model names the tokenizer it drafts in.
        stack_configs["ngram"] = replace(common, port=port, draft_model=config.target_model, drafter="ngram")
    return stack_configs


def row_stack(row: str, stacks: set[str]) -> str:
    """The stack a specwire row runs on, of the `stack_configs` started."""
    return "ngram" if row == "specwire_speculative_ngram" and "ngram" in stacks else "model"


def _start_stacks(config: BenchConfig, needed: set[str], log_dir: Path) -> tuple[dict[str, Stack], dict[str, str]]:
    """The stacks of `stack_configs`, one after another, each once its services compile no more;
    errors by stack name. Two targets compiling at once take a core each, for minutes, and a
    target's forward curve measured then is too slow (Gemma-3-270M on 2 cores: 22 and 164 ms at
    one position, 7-8 ms alone)."""
    configs = stack_configs(config, needed)
    stacks: dict[str, Stack] = {}
    errors: dict[str, str] = {}

    def start(name: str) -> None:
        stack = Stack(configs[name])
        stack_dir = log_dir / name
        stack_dir.mkdir(parents=True, exist_ok=True)
        try:
            stack.start(timeout=config.start_timeout_s, log_dir=stack_dir)
            stacks[name] = stack
        except (RuntimeError, TimeoutError) as error:
            errors[name] = f"{error} (logs in {stack_dir})"
            return
        wait_compiled(stack, config.compile_wait_s)

    for name in configs:
        start(name)
    return stacks, errors


def wait_compiled(stack: Stack, timeout_s: float) -> ModelInfo:
    """The target's Info once its forwards run compiled and its background compiler is idle (a
    service compiles after it is SERVING, and serves slower meanwhile), or as it is at the
    timeout; rows measured before would time eager code, or code sharing the cores with a
    compiler. The draft's compiler, if it runs one, is waited for first: on a machine the two
    services share, it would slow the target's timings, the forward curve in its Info included."""
    deadline = time.monotonic() + timeout_s
    _compiled_info(stack.config.host, stack.config.draft_port, deadline, started=True)
    return _compiled_info(stack.config.host, stack.config.target_port, deadline)


def _compiled_info(host: str, port: int, deadline: float, started: bool = False) -> ModelInfo:
    """The service's Info once it runs compiled code and compiles no more; `started`: once it
    compiles no more (a service that compiles has begun by the time it is SERVING)."""
    import grpc
    from specwire.v1 import model_pb2, model_pb2_grpc

    from specwire.wire import info_from_pb

    with grpc.insecure_channel(f"{host}:{port}") as channel:
        stub = model_pb2_grpc.ModelServiceStub(channel)
        while True:
            info = info_from_pb(stub.Info(model_pb2.InfoRequest(), timeout=10))
            if ((info.compiled or started) and not info.compiling) or os.environ.get("SPECWIRE_COMPILE") == "off" \
                    or time.monotonic() > deadline:
                return info
            time.sleep(1.0)


def run_bench(config: BenchConfig) -> dict[str, Any]:
    """Run every row of `config.rows` and return the report (metadata + rows)."""
    from specwire.client.sdk import Client, GenerationError
    from tqdm import tqdm
    from transformers import AutoTokenizer

    unknown = set(config.rows) - set(ROW_NAMES)
    if unknown:
        raise ValueError(f"unknown row(s) {sorted(unknown)}; rows are {', '.join(ROW_NAMES)}")
    began = time.perf_counter()
    started_at = datetime.now(timezone.utc)
    info = machine_info()
    specs = [row for row in ROWS if row.name in config.rows]
    results = {spec.name: RowResult(spec) for spec in specs}
    tokenizer = AutoTokenizer.from_pretrained(config.target_model)
    prompt_ids = [tokenizer(prompt).input_ids for prompt in config.prompts]
    log_dir = Path(tempfile.mkdtemp(prefix="specwire-bench-"))
    print(f"bench: service logs in {log_dir}", file=sys.stderr)

    stacks: dict[str, Stack] = {}
    clients: dict[str, Any] = {}
    try:
        # Not `with`: Ctrl-C / SIGTERM while the stacks start must not wait for them to be up.
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            starting = pool.submit(_start_stacks, config, set(config.rows), log_dir)
            hf = HfRunner(config.target_model, config.draft_model, config.device, config.dtype)
            stacks, stack_errors = starting.result()
        finally:
            pool.shutdown(wait=False)
        for name, stack in stacks.items():
            clients[name] = Client(stack.config.address, timeout=600)
        # Every stack's compiler, not only the model stack's: another stack's target compiling
        # beside the rows measured shares their cores (Gemma-3-270M greedy beside the n-gram
        # stack: 85.2 tok/s waiting for the model stack alone, 102.5 waiting for both, 2026-11-28).
        deadline = time.monotonic() + config.compile_wait_s
        infos = {name: wait_compiled(stack, max(0.0, deadline - time.monotonic())) for name, stack in stacks.items()}
        target_info = infos.get("model")

        llama = None
        if "llamacpp" in config.rows:
            gguf = config.gguf or llamacpp.find_gguf(config.target_model)
            if gguf is None or not llamacpp.available():
                results["llamacpp"].error = "needs llama-cpp-python and the target's GGUF (--gguf)"
            else:
                threads = config.target_threads or os.cpu_count() or 1
                failure = llamacpp.decode_failure(Path(gguf), threads)
                if failure is not None:
                    results["llamacpp"].error = failure
                else:
                    llama = llamacpp.LlamaCppRunner(Path(gguf), threads)

        def call(row: str, ids: list[int], max_new_tokens: int) -> Sample:
            if row.startswith("hf_"):
                return hf.generate(row, ids, max_new_tokens, config.gamma)
            if row == "llamacpp":
                assert llama is not None
                tokens, seconds = llama.generate(ids, max_new_tokens)
                return Sample(token_ids=tokens, seconds=seconds, target_forwards=len(tokens))
            stack = row_stack(row, set(stacks) | set(stack_errors))
            if stack in stack_errors:
                raise RuntimeError(f"the {stack} stack did not start: {stack_errors[stack]}")
            params = row_params(row, config.gamma, config.num_beams, config.draft_alternatives)
            if row in MEDUSA_ROWS and config.medusa_choices:
                params["medusa_choices"] = config.medusa_choices
            return specwire_sample(clients[stack], params, ids, max_new_tokens)

        def attempt(result: RowResult, ids: list[int], max_new_tokens: int) -> Sample | None:
            try:
                return call(result.spec.name, ids, max_new_tokens)
            except Exception as error:  # a row that fails is reported, the others still run
                result.error = str(error) if isinstance(error, GenerationError) else f"{type(error).__name__}: {error}"
                return None

        forwards = hf.single_forward_ms()
        metrics_cost = entropix_metrics_cost(config) if "specwire_entropix" in config.rows else None
        order_log: list[list[str]] = []
        total = len(specs) * (config.repeats * len(prompt_ids) + (1 if config.warmup else 0))
        with tqdm(total=total, desc="bench", unit="gen", disable=not config.show_progress, file=sys.stderr) as bar:
            if config.warmup:
                for result in results.values():
                    attempt(result, prompt_ids[0], min(16, config.max_new_tokens))
                    bar.update()
            rng = random.Random(config.seed)
            for _ in range(config.repeats):
                order = [spec.name for spec in specs]
                rng.shuffle(order)
                order_log.append(order)
                runs: dict[str, list[Sample]] = {name: [] for name in order}
                # Prompt by prompt, every row, the order turned by one a prompt: a row's paired
                # figures are seconds apart, not a whole row's run (a noisy host moved by half in minutes).
                for index, ids in enumerate(prompt_ids):
                    turn = index % len(order)
                    for name in order[turn:] + order[:turn]:
                        result = results[name]
                        sample = None if result.error else attempt(result, ids, config.max_new_tokens)
                        if sample is not None:
                            runs[name].append(sample)
                        bar.update()
                for name, run in runs.items():
                    if not results[name].error:
                        results[name].samples.append(run)
        for result in results.values():
            if result.error:
                result.samples = []
        concurrency: list[dict[str, Any]] = []
        if config.concurrency and "model" in clients:
            levels = sorted(set(config.concurrency) | {1})
            measured = ["specwire_greedy"] + [row for row in CONCURRENCY_ROWS if row in config.rows]
            strategies = [(row.removeprefix("specwire_"), clients[row_stack(row, set(clients))], row_params(row, config.gamma))
                          for row in measured if row_stack(row, set(clients)) in clients]
            concurrency = concurrency_entries(strategies, prompt_ids, levels, config.max_new_tokens, config.repeats, config.seed)
        metadata: dict[str, Any] = {
            "schema": SCHEMA,
            "command": home_as_tilde(config.command) if config.command else config.command,
            "date": started_at.isoformat(timespec="seconds"),
            "target_model": model_label(config.target_model, demo_target_dir()),
            "draft_model": model_label(config.draft_model, demo_draft_dir()),
            "parameters": hf.parameters(),
            "single_forward": forwards,
            "entropix_metrics_cost": metrics_cost,
            "prompts": len(config.prompts),
            "prompt_tokens": [len(ids) for ids in prompt_ids],
            "max_new_tokens": config.max_new_tokens,
            "repeats": config.repeats,
            "gamma": config.gamma,
            "num_beams": config.num_beams,
            "draft_alternatives": config.draft_alternatives,
            "rtt_ms": config.rtt_ms,
            "device": str(hf.device),
            "dtype": str(next(hf.target.parameters()).dtype).removeprefix("torch."),
            # The served target as its Info states it: ms of one cached forward by new positions.
            "target_forward_costs": {str(n): ms for n, ms in target_info.forward_costs} if target_info else None,
            "target_quantization": target_info.quantization if target_info else None,
            "prefix_cache": config.prefix_cache,
            "target_compiled": target_info.compiled if target_info else None,
            "target_threads": config.target_threads or os.cpu_count(),
            "draft_threads": config.draft_threads or None,
            "llamacpp_gguf": home_as_tilde(str(llama.gguf)) if llama is not None else None,
            # The heads the Medusa rows ran with: Medusa heads or a feature drafter move them.
            "medusa": (model_label(config.medusa, demo_medusa_dir())
                       if config.medusa and set(MEDUSA_ROWS) & set(config.rows) else None),
            "seed": config.seed,
            "row_order_per_repeat": order_log,
            "timing": "wall time around each call, summed over the prompts of a repeat; medians and min/max over repeats",
            "cost_ratio_c_method": (
                "(draft compute per drafted token) / (target compute per target forward): server-reported "
                "compute (GenerationStats) for specwire rows, forward hooks on the in-process models for "
                "transformers rows; single_forward.cost_ratio_c_direct times one cached single-token forward "
                "of each model in-process (median of 40)"
            ),
            "machine": info | {"loadavg_end": list(os.getloadavg())},
        }
    finally:
        for client in clients.values():
            client.close()
        for stack in stacks.values():
            stack.stop()
    metadata["duration_s"] = time.perf_counter() - began
    report: dict[str, Any] = {"metadata": metadata, "rows": summarize(results)}
    if config.concurrency:
        report["concurrency"] = concurrency
    return report


# -- output -------------------------------------------------------------------------------------


def load_prompts(path: str | None) -> list[str]:
    """A JSON list of strings, or one prompt per non-empty line with `\\n` escapes, or the name of
    a set shipped in `PROMPT_SETS`; None = defaults."""
    if path is None:
        return list(DEFAULT_PROMPTS)
    if not Path(path).exists() and (PROMPT_SETS / f"{path}.json").is_file():
        path = str(PROMPT_SETS / f"{path}.json")
    text = Path(path).read_text()
    if path.endswith(".json"):
        prompts = json.loads(text)
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise SystemExit(f"--prompts {path}: expected a JSON list of strings")
    else:
        prompts = [line.replace("\\n", "\n") for line in text.splitlines() if line.strip()]
    if not prompts:
        raise SystemExit(f"--prompts {path}: no prompts")
    return prompts


def default_models(target: str | None, draft: str | None) -> tuple[str, str]:
    """(target, draft); without --draft-model, a target's own `specwire pair` draft (DIR/draft) if
    it has one, else the demo draft."""
    if draft is None and target is not None and (Path(target) / "draft" / "config.json").is_file():
        draft = str(Path(target) / "draft")
    return target or str(demo_target_dir()), draft or str(demo_draft_dir())


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser("bench")
    parser.add_argument("--json", action="store_true", help="write the report as JSON (to --out, else stdout)")
    parser.add_argument("--out", help="write the report here (JSON with --json, else Markdown)")
    parser.add_argument(
        "--prompts", help="a JSON list of prompts, one prompt per line (\\n escapes), or a shipped set: input_grounded"
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gamma", type=int, default=4, help="γ of the speculative and constant-schedule rows")
    parser.add_argument("--num-beams", type=int, default=4, help="k of the beam rows (specwire_beam, specwire_best_first_beam)")
    parser.add_argument("--draft-alternatives", type=int, default=1,
                        help="the draft's runners-up per position in specwire_speculative_tree")
    parser.add_argument("--target-model", help="target model directory (default: the demo target)")
    parser.add_argument("--draft-model", help="draft model directory (default: TARGET/draft if there, else the demo draft)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantize", default="auto", help=f"the model services' --quantize ({', '.join(QUANTIZE_MODES)})")
    parser.add_argument("--target-quantize", help="the target service's --quantize where it differs from --quantize")
    parser.add_argument(
        "--prefix-cache", default="on", choices=["on", "off"],
        help="the model services' --prefix-cache: on, a prompt sent again (repeats, the solo runs) reuses its keys",
    )
    parser.add_argument("--target-threads", type=int, default=0, help="the target's torch threads and llama.cpp's (0: all cores)")
    parser.add_argument("--draft-threads", type=int, default=0, help="the draft's torch threads (0: the launcher's share of the cores)")
    parser.add_argument("--gguf", help="the llamacpp row's GGUF (default: DIR/gguf/*.gguf of the target)")
    parser.add_argument("--compile-wait", type=float, default=3600.0,
                        help="seconds to wait for the target's compiled forwards before measuring")
    parser.add_argument("--rows", help=f"comma-separated subset of: {', '.join(ROW_NAMES)}")
    parser.add_argument("--seed", type=int, default=0, help="seed of the row order shuffle")
    parser.add_argument("--port", type=int, default=0, help="base port of the stacks (0 = free ports)")
    parser.add_argument("--no-warmup", action="store_true", help="skip the unmeasured warm-up generation per row")
    parser.add_argument(
        "--concurrency", help="comma-separated stream counts (e.g. 1,2,4,8): concurrent generations per strategy"
    )
    parser.add_argument("--medusa", help="the target's Medusa heads (default: the demo target's with the demo target, "
                        "else DIR/medusa where `specwire pair` built them)")
    parser.add_argument("--medusa-choices", help="the medusa rows' tree: a JSON file of top-k paths (default: built in)")
    parser.add_argument(
        "--rtt-ms", type=float, default=0.0, help="route the specwire rows through the delay proxy: round trip in ms"
    )
    parser.set_defaults(command_line=None)  # the `specwire` command line sets it, for the report's metadata
    return parser


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    target, draft = default_models(args.target_model, args.draft_model)
    if min(args.max_new_tokens, args.repeats, args.gamma, args.num_beams, args.draft_alternatives) < 1:
        raise SystemExit("--max-new-tokens, --repeats, --gamma, --num-beams and --draft-alternatives must be ≥ 1")
    if args.rtt_ms < 0:
        raise SystemExit(f"--rtt-ms must be ≥ 0, got {args.rtt_ms}")
    runnable = llamacpp.available() and (args.gguf or llamacpp.find_gguf(target))  # llamacpp only where it can run
    rows = tuple(r.strip() for r in args.rows.split(",")) if args.rows else tuple(
        name for name in ROW_NAMES if name != "llamacpp" or runnable)
    try:
        concurrency = tuple(int(n) for n in args.concurrency.split(",")) if args.concurrency else ()
    except ValueError:
        raise SystemExit(f"--concurrency must be comma-separated integers, got {args.concurrency!r}") from None
    if any(n < 1 for n in concurrency):
        raise SystemExit("--concurrency: stream counts must be ≥ 1")
    return BenchConfig(
        target_model=target,
        draft_model=draft,
        prompts=load_prompts(args.prompts),
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        gamma=args.gamma,
        num_beams=args.num_beams,
        draft_alternatives=args.draft_alternatives,
        device=args.device,
        dtype=args.dtype,
        rows=rows,
        seed=args.seed,
        warmup=not args.no_warmup,
        port=args.port,
        concurrency=concurrency,
        medusa=args.medusa or _default_medusa(target),
        medusa_choices=Path(args.medusa_choices).read_text() if args.medusa_choices else None,
        rtt_ms=args.rtt_ms,
        quantize=args.quantize,
        target_quantize=args.target_quantize,
        prefix_cache=args.prefix_cache == "on",
        target_threads=args.target_threads,
        draft_threads=args.draft_threads,
        gguf=args.gguf,
        command=args.command_line,
    )


def _default_medusa(target: str) -> str | None:
    """The demo target's shipped heads with the demo target; else a target's own `specwire pair`
    heads if it has them (`pair_heads`)."""
    if Path(target).resolve() == demo_target_dir().resolve():
        return str(demo_medusa_dir())
    return pair_heads(Path(target))


def run(args: argparse.Namespace) -> int:
    report = run_bench(config_from_args(args))
    table = render(report)
    document = json.dumps(report, indent=2) if args.json else table
    if args.out:
        Path(args.out).write_text(document + "\n")
        print(table)
    else:
        print(document)
    for row in report["rows"]:
        if row["error"]:
            print(f"bench: row {row['name']} failed: {row['error']}", file=sys.stderr)
    return 0
