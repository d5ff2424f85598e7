"""A Hugging Face causal LM served as sessions: one KV cache per generation, a lean forward loop.

A session holds each branch's tokens and a `DynamicCache` over a prefix of them. Tokens not yet
in the cache are *pending*; any request that needs scores forwards the pending tokens in one
call (cropping the cache first when the positions to score are already cached). That single
rule covers prefill, appending, roll-back, proposal and verification. Warping runs here, on the
device, with `specwire.processing`, so only what decides crosses the wire.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedTokenizerBase

from specwire import attention_probe
from specwire.entropy_metrics import PositionMetrics, token_entropy
from specwire.errors import InvalidArgument, check_token_ids
from specwire.processing import (
    ProcessingConfig,
    apply_penalties,
    beam_logprobs,
    greedy_scores,
    sampling_probs,
)
from specwire.session import (
    ModelInfo,
    OpenRequest,
    ScoreKind,
    Scores,
    Scoring,
    ServerTiming,
    StepRequest,
    StepResult,
)

MAX_BRANCHES = 64
MAX_PROPOSE = 64


def resolve_device(spec: str) -> torch.device:
    """`auto` picks CUDA when there is one."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 on CUDA that supports it, float32 on CPU (half matmuls are slow there)."""
    if spec == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if spec not in names:
        raise ValueError(f"--dtype must be one of auto, {', '.join(names)}; got {spec!r}")
    return names[spec]


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase | None) -> str:
    """sha256 of the id → string mapping: equal fingerprints mean interchangeable token ids."""
    if tokenizer is None:
        return ""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def load_tokenizer(source: str) -> PreTrainedTokenizerBase | None:
    """The tokenizer next to a model, or None when the directory has none."""
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError):
        return None


def eos_token_ids(*candidates: int | list[int] | None) -> list[int]:
    """The first eos setting given (an id or a list of ids, as configs hold it), as a list."""
    for candidate in candidates:
        if candidate is not None:
            return [int(candidate)] if isinstance(candidate, int) else [int(c) for c in candidate]
    return []


def _max_context(config: Any) -> int:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


@dataclass
class CausalLM:
    """A loaded model with what its sessions and `Info` need."""

    model: Any
    tokenizer: PreTrainedTokenizerBase | None
    name: str
    tokenizer_source: str
    device: torch.device
    vocab_size: int
    eos_token_ids: list[int]
    max_context: int
    accepts_logits_to_keep: bool

    @classmethod
    def load(cls, source: str, device: str = "auto", dtype: str = "auto", name: str | None = None) -> CausalLM:
        """Load from a local directory or a hub id."""
        torch_device = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, torch_device)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype)
        model = cast(Any, model).to(torch_device)
        return cls.from_model(model, load_tokenizer(source), name or source, source)

    @classmethod
    def from_model(
        cls, model: Any, tokenizer: PreTrainedTokenizerBase | None, name: str, tokenizer_source: str = ""
    ) -> CausalLM:
        model.eval()
        device = next(model.parameters()).device
        return cls(
            model=model,
            tokenizer=tokenizer,
            name=name,
            tokenizer_source=tokenizer_source,
            device=device,
            vocab_size=int(model.get_output_embeddings().weight.shape[0]),
            eos_token_ids=eos_token_ids(
                getattr(model.generation_config, "eos_token_id", None),
                getattr(model.config, "eos_token_id", None),
                tokenizer.eos_token_id if tokenizer is not None else None,
            ),
            max_context=_max_context(model.config),
            accepts_logits_to_keep="logits_to_keep" in inspect.signature(model.forward).parameters,
        )


class Engine:
    """A `Backend` over one causal LM."""

    def __init__(self, lm: CausalLM, role: str) -> None:
        self.lm = lm
        self.role = role
        self._fingerprint = tokenizer_fingerprint(lm.tokenizer)

    def info(self) -> ModelInfo:
        return ModelInfo(
            model_name=self.lm.name,
            vocab_size=self.lm.vocab_size,
            tokenizer_fingerprint=self._fingerprint,
            eos_token_ids=self.lm.eos_token_ids,
            max_context=self.lm.max_context,
            capabilities=["session", "propose", "branches", "entropy", "attention_stats"],
            role=self.role,
            tokenizer_source=self.lm.tokenizer_source,
            device=str(self.lm.device),
            dtype=str(next(self.lm.model.parameters()).dtype).removeprefix("torch."),
        )

    def new_session(self) -> EngineSession:
        return EngineSession(self.lm)

    def warmup(self) -> None:
        """One short generation, so the first request doesn't pay for lazy initialisation."""
        session = self.new_session()
        prompt = [i % self.lm.vocab_size for i in range(1, 9)]
        session.open(OpenRequest(prompt_ids=prompt, scoring=Scoring(ScoreKind.ARGMAX)))
        session.step(StepRequest(append_ids=[1], propose=2, propose_greedy=True))
        session.close()


def encode_probs(probs: torch.Tensor, config: ProcessingConfig) -> Scores:
    """Sparse (ids + probabilities, descending) when truncation left ≤ half the vocabulary."""
    vocab = probs.shape[-1]
    if config.truncates:
        support = int((probs > 0).sum(dim=-1).max())
        if support <= vocab // 2:
            values, ids = torch.topk(probs, support, dim=-1)
            ids = ids.to(torch.int32).masked_fill(values <= 0, -1)
            return Scores(ScoreKind.PROBS, sparse_ids=ids, sparse_values=values)
    return Scores(ScoreKind.PROBS, dense=probs)


def _encode_top(kind: ScoreKind, scores: torch.Tensor, top_n: int, dtype: torch.dtype) -> Scores:
    if 0 < top_n < scores.shape[-1]:
        values, ids = torch.topk(scores, top_n, dim=-1)
        return Scores(kind, sparse_ids=ids.to(torch.int32), sparse_values=values.to(dtype))
    return Scores(kind, dense=scores.to(dtype))


_LOGITS_DTYPES = {"float32": torch.float32, "float16": torch.float16}


class EngineSession:
    """One generation's branches, tokens and KV cache. Used from one thread at a time."""

    def __init__(self, lm: CausalLM) -> None:
        self.lm = lm
        self.tokens = torch.empty((1, 0), dtype=torch.long)  # [branches, length], on CPU
        self.cache: DynamicCache | None = None
        self.cached = 0  # leading positions held in the KV cache
        self.processing = ProcessingConfig()
        self.forward_calls = 0
        self.metrics: PositionMetrics | None = None  # the extras of the last scored step

    @property
    def num_branches(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def length(self) -> int:
        return int(self.tokens.shape[1])

    def open(self, request: OpenRequest) -> StepResult:
        if not request.prompt_ids:
            raise InvalidArgument("prompt_ids", "must not be empty")
        if not 1 <= request.num_branches <= MAX_BRANCHES:
            raise InvalidArgument("num_branches", f"must be in [1, {MAX_BRANCHES}], got {request.num_branches}")
        check_token_ids(request.prompt_ids, self.lm.vocab_size, "prompt_ids")
        self._check_length(len(request.prompt_ids), "prompt_ids")
        self.processing = request.processing
        prompt = torch.tensor(request.prompt_ids, dtype=torch.long).unsqueeze(0)
        self.tokens = prompt.expand(request.num_branches, -1).clone()
        self.cache, self.cached = None, 0
        return self._finish(request.scoring, 0, False, 0, 0.0)

    def step(self, request: StepRequest) -> StepResult:
        if request.tree_parents:
            raise InvalidArgument("tree_parents", "tree verification is not supported by this service")
        if request.keep_tokens is not None:
            self._truncate(request.keep_tokens)
        if request.branch_order:
            self._reorder(request.branch_order)
        if request.append_ids:
            self._append(request.append_ids)
        if not 0 <= request.propose <= MAX_PROPOSE:
            raise InvalidArgument("propose", f"must be in [0, {MAX_PROPOSE}], got {request.propose}")
        return self._finish(
            request.scoring,
            request.propose,
            request.propose_greedy,
            request.propose_seed,
            request.propose_min_confidence,
        )

    def close(self) -> None:
        self.cache = None
        self.tokens = torch.empty((1, 0), dtype=torch.long)
        self.cached = 0

    # -- state changes -------------------------------------------------------------------

    def _check_length(self, length: int, field: str) -> None:
        if length > self.lm.max_context:
            raise InvalidArgument(field, f"sequence of {length} tokens exceeds the model's context of {self.lm.max_context}")

    def _truncate(self, keep: int) -> None:
        if not 1 <= keep <= self.length:
            raise InvalidArgument("keep_tokens", f"must be in [1, {self.length}], got {keep}")
        self.tokens = self.tokens[:, :keep]
        if self.cached > keep:
            self._crop_cache(keep)

    def _reorder(self, order: list[int]) -> None:
        if not 1 <= len(order) <= MAX_BRANCHES or any(not 0 <= i < self.num_branches for i in order):
            raise InvalidArgument("branch_order", f"indices must be in [0, {self.num_branches}), at most {MAX_BRANCHES}")
        index = torch.tensor(order, dtype=torch.long)
        self.tokens = self.tokens.index_select(0, index)
        if self.cache is not None and self.cached > 0:
            self.cache.reorder_cache(cast(torch.LongTensor, index.to(self.lm.device)))

    def _append(self, ids: list[int]) -> None:
        if len(ids) % self.num_branches:
            raise InvalidArgument("append_ids", f"{len(ids)} ids do not split evenly over {self.num_branches} branches")
        check_token_ids(ids, self.lm.vocab_size, "append_ids")
        per_branch = len(ids) // self.num_branches
        self._check_length(self.length + per_branch, "append_ids")
        new = torch.tensor(ids, dtype=torch.long).view(self.num_branches, per_branch)
        self.tokens = torch.cat([self.tokens, new], dim=1)

    def _crop_cache(self, keep: int) -> None:
        if keep == 0 or self.cache is None:
            self.cache = None
        else:
            self.cache.crop(keep - self.cached)  # transformers ≥ 5: a negative count to remove
        self.cached = keep

    # -- forward passes ------------------------------------------------------------------

    @torch.inference_mode()
    def _forward(self, positions: int) -> torch.Tensor:
        """Logits for each branch's last `positions` tokens: [branches, positions, vocab] float32."""
        start = min(self.cached, self.length - positions)
        if start < self.cached:
            self._crop_cache(start)
        if self.cache is None:
            self.cache = DynamicCache()
        device = self.lm.device
        kwargs: dict[str, Any] = {}
        if self.lm.accepts_logits_to_keep:
            kwargs["logits_to_keep"] = positions
        out = self.lm.model(
            input_ids=self.tokens[:, start:].to(device),
            attention_mask=torch.ones(self.tokens.shape, dtype=torch.long, device=device),
            past_key_values=self.cache,
            use_cache=True,
            **kwargs,
        )
        self.cached = self.length
        self.forward_calls += 1
        return out.logits[:, -positions:, :].float()

    def _score(self, scoring: Scoring) -> Scores | None:
        if scoring.kind == ScoreKind.NONE:
            return None
        positions = scoring.positions
        if not 1 <= positions <= self.length:
            raise InvalidArgument("scoring.positions", f"must be in [1, {self.length}], got {positions}")
        score_ids = self._score_ids(scoring)  # checked before paying for a forward pass
        logits = self._forward_measured(positions, scoring)  # [branches, positions, vocab]
        per_position = []
        for j in range(positions):
            history = self.tokens[:, : self.length - positions + j + 1].to(logits.device)
            per_position.append(self._process(scoring, logits[:, j], history))
        processed = torch.stack(per_position, dim=1).flatten(0, 1)  # [branches·positions, vocab]
        config = self.processing
        if scoring.kind == ScoreKind.ARGMAX:
            return Scores(ScoreKind.ARGMAX, argmax_ids=processed.argmax(dim=-1).to(torch.int32))
        if scoring.kind == ScoreKind.PROBS:
            return encode_probs(processed, config)
        dtype = _LOGITS_DTYPES.get(scoring.logits_dtype)
        if dtype is None:
            raise InvalidArgument("scoring.logits_dtype", f"must be float32 or float16, got {scoring.logits_dtype!r}")
        if score_ids is not None:
            values = processed.index_select(1, score_ids.to(processed.device))  # [rows, len(score_ids)]
            ids = score_ids.to(torch.int32).expand(values.shape[0], -1)
            return Scores(scoring.kind, sparse_ids=ids, sparse_values=values.to(dtype))
        return _encode_top(scoring.kind, processed, scoring.top_n, dtype)

    def _forward_measured(self, positions: int, scoring: Scoring) -> torch.Tensor:
        """`_forward`, and the extras `scoring` asks for from the same pass into `self.metrics`."""
        extras = scoring.extras
        with attention_probe.capture(self.lm.model, positions if extras.attention_stats else 0) as probe:
            logits = self._forward(positions)
        if extras.wanted:
            entropy, varentropy = token_entropy(logits.flatten(0, 1))  # raw logits, [branches·positions]
            self.metrics = PositionMetrics(entropy, varentropy, probe.stats if probe is not None else None)
        return logits

    def _score_ids(self, scoring: Scoring) -> torch.Tensor | None:
        """`scoring.score_ids` as an index, or None when every id (or the top_n) is wanted."""
        if not scoring.score_ids:
            return None
        if scoring.kind not in (ScoreKind.LOGITS, ScoreKind.LOGPROBS):
            raise InvalidArgument("scoring.score_ids", f"applies to LOGITS and LOGPROBS only, not {scoring.kind.name}")
        if scoring.top_n:
            raise InvalidArgument("scoring.score_ids", "give score_ids or top_n, not both")
        check_token_ids(list(scoring.score_ids), self.lm.vocab_size, "scoring.score_ids")
        return torch.tensor(scoring.score_ids, dtype=torch.long)

    def _process(self, scoring: Scoring, logits: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        config = self.processing
        if scoring.kind == ScoreKind.ARGMAX:
            return greedy_scores(logits, history, config)
        if scoring.kind == ScoreKind.PROBS:
            return sampling_probs(logits, history, config)
        if scoring.kind == ScoreKind.LOGPROBS:
            return beam_logprobs(logits, history, config)
        return apply_penalties(logits, history, config)

    def _propose(self, count: int, greedy: bool, seed: int, min_confidence: float) -> tuple[torch.Tensor, Scores | None]:
        """Draw up to `count` tokens per branch; the last drawn token stays pending."""
        generator = None
        if not greedy:
            generator = torch.Generator(device=self.lm.device)
            generator.manual_seed(seed)
        drawn: list[torch.Tensor] = []
        dists: list[torch.Tensor] = []
        for index in range(count):
            logits = self._forward(1)[:, 0]  # [branches, vocab]
            history = self.tokens.to(logits.device)
            if greedy:
                scores = greedy_scores(logits, history, self.processing)
                token = scores.argmax(dim=-1, keepdim=True)
                confidence = scores.softmax(dim=-1).amax(dim=-1).min()
            else:
                probs = sampling_probs(logits, history, self.processing)
                token = torch.multinomial(probs, 1, generator=generator)
                confidence = probs.amax(dim=-1).min()
                dists.append(probs)
            if index > 0 and float(confidence) < min_confidence:
                if dists:
                    dists.pop()
                break
            drawn.append(token.cpu())
            self.tokens = torch.cat([self.tokens, drawn[-1]], dim=1)
        proposed = torch.cat(drawn, dim=1).to(torch.int32)
        if greedy:
            return proposed, None
        probs = torch.stack(dists, dim=1).flatten(0, 1)  # [branches·n, vocab]
        return proposed, encode_probs(probs, self.processing)

    def _finish(self, scoring: Scoring, propose: int, greedy: bool, seed: int, min_confidence: float) -> StepResult:
        calls_before = self.forward_calls
        self.metrics = None
        scores = self._score(scoring)
        if scores is not None:
            scores.metrics = self.metrics
        proposed, proposal_scores = None, None
        if propose > 0:
            self._check_length(self.length + propose, "propose")
            proposed, proposal_scores = self._propose(propose, greedy, seed, min_confidence)
        if self.lm.device.type == "cuda":
            # Whoever times this call (the servicer, a LocalSession) must see the GPU work in it.
            torch.cuda.synchronize(self.lm.device)
        return StepResult(
            scores=scores,
            proposed_ids=proposed,
            proposal_scores=proposal_scores,
            num_tokens=self.length,
            timing=ServerTiming(forward_calls=self.forward_calls - calls_before),
        )
