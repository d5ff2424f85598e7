"""A model-free drafter: prompt-lookup / n-gram proposals copied from the generation's own history.

References: Saxena 2023, "Prompt Lookup Decoding" (github.com/apoorvumang/prompt-lookup-decoding);
Yang et al. 2023, "Inference with Reference: Lossless Acceleration of Large Language Models"
(arXiv:2304.04487), which copies spans of a reference text that the output repeats.

To propose, match the history's last n tokens, n from `ngram_max` down to `ngram_min`, against
an earlier place in the history (prompt + generated); at the most recent such place, copy the
tokens that followed it. The copy may run into the tokens it is producing (like an LZ77 match),
so a repeating pattern is continued for as long as asked. No match: zero tokens are proposed and
the orchestrator's round degenerates to a plain target step.

The proposals are a deterministic function of the history, so no probabilities are returned
(`proposal_scores` is empty): the orchestrator treats q as one-hot on the proposed token, which
keeps speculative sampling exact (accept x with probability p(x); the residual is p without x).
For the same reason `propose_greedy`, `propose_seed` and `propose_min_confidence` do not apply.

`Info` needs the vocabulary size, eos ids and tokenizer fingerprint of the model it drafts for;
they come from a tokenizer / model directory (`--model`, by default the demo target's), reading
only `generation_config.json`, `config.json` and the tokenizer files — never weights. Eos ids are
taken in the order a model service takes them: generation config, then config, then tokenizer.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, GenerationConfig

from specwire.errors import InvalidArgument, check_token_ids
from specwire.session import (
    ModelInfo,
    OpenRequest,
    ScoreKind,
    Scoring,
    StepRequest,
    StepResult,
)
from specwire.tokenizer import eos_token_ids, load_tokenizer, tokenizer_fingerprint

MAX_PROPOSE = 64
# No model, no position embeddings: the only bound is memory, and the target's context is smaller.
MAX_CONTEXT = 1 << 20


def ngram_proposal(history: torch.Tensor, count: int, ngram_max: int, ngram_min: int) -> list[int]:
    """The continuation of the latest earlier occurrence of the longest matching suffix n-gram
    (`ngram_match`); [] if no n matches."""
    return ngram_match(history, count, ngram_max, ngram_min)[1]


def ngram_match(history: torch.Tensor, count: int, ngram_max: int, ngram_min: int) -> tuple[int, list[int]]:
    """(n, proposal): for n = ngram_max … ngram_min, the largest s < L − n with
    history[s : s+n] = history[L−n : L], and y_i = history[s + n + (i mod (L − s − n))],
    i = 0 … count−1: the copy of what followed, continued periodically once it runs into its own
    output. (0, []) if no n matches. history: [L] int64."""
    length = int(history.shape[0])
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        windows = history.unfold(0, n, 1)[:-1]  # [L−n, n]: every n-gram but the suffix itself
        hits = (windows == history[length - n :]).all(dim=-1).nonzero()  # [hits, 1]
        if hits.numel() > 0:
            source = history[int(hits[-1]) + n :].tolist()  # what followed the latest match
            return n, [source[i % len(source)] for i in range(count)]
    return 0, []


class NgramDrafter:
    """A `Backend` proposing n-gram continuations; it has no model and scores nothing."""

    def __init__(
        self,
        vocab_size: int,
        eos_token_ids: list[int],
        fingerprint: str,
        ngram_max: int = 3,
        ngram_min: int = 1,
        name: str = "ngram",
        tokenizer_source: str = "",
    ) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise InvalidArgument("--ngram-min", f"need 1 ≤ ngram_min ≤ ngram_max, got {ngram_min} and {ngram_max}")
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.fingerprint = fingerprint
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min
        self.name = name
        self.tokenizer_source = tokenizer_source

    @classmethod
    def load(cls, source: str, ngram_max: int = 3, ngram_min: int = 1) -> NgramDrafter:
        """Vocabulary, eos and fingerprint from a model or tokenizer directory (or hub id)."""
        tokenizer = load_tokenizer(source)
        try:
            config = AutoConfig.from_pretrained(source)
        except (OSError, ValueError):
            config = None  # a tokenizer-only directory
        try:
            # Where generation stops: it may list more ids than config.json (Gemma-3: [1, 106] vs 1).
            generation: GenerationConfig | None = GenerationConfig.from_pretrained(source)
        except (OSError, ValueError):
            generation = None
        vocab_size = getattr(config.get_text_config(), "vocab_size", None) if config is not None else None
        if vocab_size is None:
            if tokenizer is None:
                raise InvalidArgument("--model", f"{source!r} has neither a config.json nor a tokenizer")
            vocab_size = len(tokenizer)
        return cls(
            vocab_size=int(vocab_size),
            eos_token_ids=eos_token_ids(
                getattr(generation, "eos_token_id", None),
                getattr(config, "eos_token_id", None),
                tokenizer.eos_token_id if tokenizer is not None else None,
            ),
            fingerprint=tokenizer_fingerprint(tokenizer),
            ngram_max=ngram_max,
            ngram_min=ngram_min,
            name=f"ngram[{ngram_min}..{ngram_max}]:{source}",
            tokenizer_source=source if tokenizer is not None else "",
        )

    def info(self) -> ModelInfo:
        return ModelInfo(
            model_name=self.name,
            vocab_size=self.vocab_size,
            tokenizer_fingerprint=self.fingerprint,
            eos_token_ids=self.eos_token_ids,
            max_context=MAX_CONTEXT,
            # The orchestrator drafts with the same settings from its own copy of the history.
            capabilities=["session", "propose", "ngram", f"ngram_max={self.ngram_max}", f"ngram_min={self.ngram_min}"],
            role="draft",
            tokenizer_source=self.tokenizer_source,
            device="cpu",
            dtype="none",
        )

    def new_session(self) -> NgramSession:
        return NgramSession(self)


class NgramSession:
    """One generation's history. Proposals join the history, as a model session's would."""

    def __init__(self, drafter: NgramDrafter) -> None:
        self.drafter = drafter
        self.tokens: list[int] = []

    def open(self, request: OpenRequest) -> StepResult:
        if not request.prompt_ids:
            raise InvalidArgument("prompt_ids", "must not be empty")
        if request.num_branches != 1:
            raise InvalidArgument("num_branches", f"the n-gram drafter serves one branch, got {request.num_branches}")
        self._check_scoring(request.scoring)
        check_token_ids(request.prompt_ids, self.drafter.vocab_size, "prompt_ids")
        self.tokens = list(request.prompt_ids)
        return StepResult(num_tokens=len(self.tokens))

    def step(self, request: StepRequest) -> StepResult:
        if request.tree_parents:
            raise InvalidArgument("tree_parents", "the n-gram drafter does not verify trees")
        if request.branch_order not in ([], [0]):
            raise InvalidArgument("branch_order", "the n-gram drafter serves one branch")
        self._check_scoring(request.scoring)
        if not 0 <= request.propose <= MAX_PROPOSE:
            raise InvalidArgument("propose", f"must be in [0, {MAX_PROPOSE}], got {request.propose}")
        if request.propose_alternatives:
            raise InvalidArgument("propose_alternatives", "the n-gram drafter proposes one id per position")
        if request.keep_tokens is not None:
            if not 1 <= request.keep_tokens <= len(self.tokens):
                raise InvalidArgument("keep_tokens", f"must be in [1, {len(self.tokens)}], got {request.keep_tokens}")
            del self.tokens[request.keep_tokens :]
        check_token_ids(request.append_ids, self.drafter.vocab_size, "append_ids")
        self.tokens += request.append_ids
        if len(self.tokens) + request.propose > MAX_CONTEXT:
            raise InvalidArgument("propose", f"sequence would exceed {MAX_CONTEXT} tokens")
        proposed = None
        if request.propose > 0:
            history = torch.tensor(self.tokens, dtype=torch.long)
            drafted = ngram_proposal(history, request.propose, self.drafter.ngram_max, self.drafter.ngram_min)
            self.tokens += drafted
            proposed = torch.tensor([drafted], dtype=torch.int32).reshape(1, len(drafted))  # [1, n]
        return StepResult(proposed_ids=proposed, num_tokens=len(self.tokens))

    def close(self) -> None:
        self.tokens = []

    def _check_scoring(self, scoring: Scoring) -> None:
        if scoring.kind != ScoreKind.NONE:
            raise InvalidArgument(
                "scoring.kind", f"the n-gram drafter has no distributions, cannot score {scoring.kind.name}"
            )

