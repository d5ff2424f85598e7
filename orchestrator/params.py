"""A `GenerateRequest` checked once and turned into typed parameters.

Every bound lives here, so every bad field gets INVALID_ARGUMENT with the field's name before
any session is opened.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specwire.orchestrator.entropix import CONFIG_FIELDS, EntropixConfig, check_config
from specwire.v1 import orchestrator_pb2

from specwire.errors import InvalidArgument, check_token_ids
from specwire.processing import ProcessingConfig

STRATEGIES = ("greedy", "sample", "beam", "speculative", "contrastive", "entropix")
MAX_BEAMS = 32
MAX_SPECULATIVE_TOKENS = 64
MAX_STOP_STRINGS = 16


@dataclass(frozen=True)
class Limits:
    """What the orchestrator's deployment allows, and what the target model can hold."""

    max_new_tokens: int
    default_max_new_tokens: int
    max_context: int
    vocab_size: int


@dataclass(frozen=True)
class GenerationParams:
    strategy: str
    max_new_tokens: int
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    seed: int | None = None
    processing: ProcessingConfig = field(default_factory=ProcessingConfig)
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int = 1
    num_speculative_tokens: int = 4
    draft_confidence_threshold: float = 0.0
    cd_form: str = "obrien"
    cd_alpha: float = 0.1
    cd_beta: float = 0.5
    amateur_temperature: float = 1.0
    entropix: EntropixConfig | None = None
    # Entropix verifying a draft's proposals (num_speculative_tokens given with strategy entropix).
    entropix_speculative: bool = False
    # Tokens are drawn at random (else argmax): strategy "sample", or speculative / contrastive
    # with a sampling warper set; temperature 0 always means argmax.
    do_sample: bool = False


def _finite(value: float, name: str) -> float:
    if not math.isfinite(value):
        raise InvalidArgument(name, f"must be a finite number, got {value}")
    return value


def _opt(request: orchestrator_pb2.GenerateRequest, name: str, default: float) -> float:
    return getattr(request, name) if request.HasField(name) else default  # type: ignore[no-any-return]


def check_prompt(request: orchestrator_pb2.GenerateRequest, vocab_size: int) -> None:
    has_text, has_ids = bool(request.prompt), bool(request.prompt_ids)
    if has_text and has_ids:
        raise InvalidArgument("prompt", "give either prompt or prompt_ids, not both")
    if not has_text and not has_ids:
        raise InvalidArgument("prompt", "must not be empty (give prompt or prompt_ids)")
    check_token_ids(list(request.prompt_ids), vocab_size, "prompt_ids")


def parse(request: orchestrator_pb2.GenerateRequest, prompt_len: int, limits: Limits) -> GenerationParams:
    """Validate every field against its bound; `prompt_len` is the tokenized prompt's length."""
    strategy = request.strategy or "greedy"
    if strategy not in STRATEGIES:
        raise InvalidArgument("strategy", f"unknown strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}")

    max_new = request.max_new_tokens if request.HasField("max_new_tokens") else limits.default_max_new_tokens
    if not 1 <= max_new <= limits.max_new_tokens:
        raise InvalidArgument("max_new_tokens", f"must be in [1, {limits.max_new_tokens}], got {max_new}")
    if prompt_len + max_new > limits.max_context:
        raise InvalidArgument(
            "max_new_tokens",
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new}) exceeds the model context of {limits.max_context}",
        )

    # Entropix's base warpers default to the reference's values.
    base = EntropixConfig() if strategy == "entropix" else None
    temperature = _finite(_opt(request, "temperature", base.temperature if base else 1.0), "temperature")
    if temperature < 0:
        raise InvalidArgument("temperature", f"must be ≥ 0, got {temperature}")
    top_k = int(_opt(request, "top_k", base.top_k if base else 0))
    if top_k < 0:
        raise InvalidArgument("top_k", f"must be ≥ 0 (0 = off), got {top_k}")
    top_p = _finite(_opt(request, "top_p", base.top_p if base else 1.0), "top_p")
    if not 0 < top_p <= 1:
        raise InvalidArgument("top_p", f"must be in (0, 1], got {top_p}")
    min_p = _finite(_opt(request, "min_p", 0.0), "min_p")
    if not 0 <= min_p <= 1:
        raise InvalidArgument("min_p", f"must be in [0, 1], got {min_p}")
    repetition_penalty = _finite(_opt(request, "repetition_penalty", 1.0), "repetition_penalty")
    if repetition_penalty <= 0:
        raise InvalidArgument("repetition_penalty", f"must be > 0, got {repetition_penalty}")
    ngram = int(_opt(request, "no_repeat_ngram_size", 0))
    if ngram < 0:
        raise InvalidArgument("no_repeat_ngram_size", f"must be ≥ 0 (0 = off), got {ngram}")

    num_beams = int(_opt(request, "num_beams", 4 if strategy == "beam" else 1))
    if not 1 <= num_beams <= MAX_BEAMS:
        raise InvalidArgument("num_beams", f"must be in [1, {MAX_BEAMS}], got {num_beams}")
    if num_beams > 1 and strategy not in ("beam", "contrastive"):
        raise InvalidArgument("num_beams", f"beams need strategy 'beam' or 'contrastive', got {strategy!r}")
    num_return = int(_opt(request, "num_return_sequences", 1))
    if not 1 <= num_return <= num_beams:
        raise InvalidArgument("num_return_sequences", f"must be in [1, num_beams={num_beams}], got {num_return}")
    length_penalty = _finite(_opt(request, "length_penalty", 1.0), "length_penalty")
    early: dict[str, bool | str] = {"": False, "false": False, "true": True, "never": "never"}
    if request.early_stopping.lower() not in early:
        raise InvalidArgument("early_stopping", f"must be 'false', 'true' or 'never', got {request.early_stopping!r}")

    gamma = int(_opt(request, "num_speculative_tokens", 4))
    if not 1 <= gamma <= MAX_SPECULATIVE_TOKENS:
        raise InvalidArgument("num_speculative_tokens", f"must be in [1, {MAX_SPECULATIVE_TOKENS}], got {gamma}")
    threshold = _finite(_opt(request, "draft_confidence_threshold", 0.0), "draft_confidence_threshold")
    if not 0 <= threshold < 1:
        raise InvalidArgument("draft_confidence_threshold", f"must be in [0, 1), got {threshold}")

    cd_form = request.cd_form or "obrien"
    if cd_form not in ("obrien", "li"):
        raise InvalidArgument("cd_form", f"must be 'obrien' or 'li', got {cd_form!r}")
    cd_alpha = _finite(_opt(request, "cd_alpha", 0.1), "cd_alpha")
    if not 0 < cd_alpha <= 1:
        raise InvalidArgument("cd_alpha", f"must be in (0, 1], got {cd_alpha}")
    cd_beta = _finite(_opt(request, "cd_beta", 0.5), "cd_beta")
    if cd_beta < 0:
        raise InvalidArgument("cd_beta", f"must be ≥ 0, got {cd_beta}")
    amateur_t = _finite(_opt(request, "amateur_temperature", 1.0), "amateur_temperature")
    if amateur_t <= 0:
        raise InvalidArgument("amateur_temperature", f"must be > 0, got {amateur_t}")

    if len(request.stop) > MAX_STOP_STRINGS or any(not s for s in request.stop):
        raise InvalidArgument("stop", f"at most {MAX_STOP_STRINGS} non-empty strings")
    if request.stop and num_beams > 1:
        raise InvalidArgument("stop", "stop strings are not supported with beam search (num_beams > 1)")

    sampling_fields = ("temperature", "top_k", "top_p", "min_p")
    sampling_asked = strategy == "sample" or (
        strategy in ("speculative", "contrastive") and any(request.HasField(name) for name in sampling_fields)
    )
    entropix = entropix_config(request, temperature, top_k, top_p, min_p, limits.vocab_size) if base else None
    if strategy == "beam" and any(request.HasField(name) for name in sampling_fields):
        raise InvalidArgument("temperature", "beam search here is deterministic; sampling warpers do not apply")
    processing = ProcessingConfig(
        repetition_penalty=repetition_penalty,
        no_repeat_ngram_size=ngram,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
    )
    if entropix is not None:  # the policy warps on the orchestrator; the target only applies penalties
        processing = ProcessingConfig(repetition_penalty=repetition_penalty, no_repeat_ngram_size=ngram)
    return GenerationParams(
        strategy=strategy,
        max_new_tokens=max_new,
        ignore_eos=request.ignore_eos,
        stop=tuple(request.stop),
        seed=request.seed if request.HasField("seed") else None,
        processing=processing,
        num_beams=num_beams,
        length_penalty=length_penalty,
        early_stopping=early[request.early_stopping.lower()],
        num_return_sequences=num_return,
        num_speculative_tokens=gamma,
        draft_confidence_threshold=threshold,
        cd_form=cd_form,
        cd_alpha=cd_alpha,
        cd_beta=cd_beta,
        amateur_temperature=amateur_t,
        entropix=entropix,
        entropix_speculative=entropix is not None and request.HasField("num_speculative_tokens"),
        do_sample=sampling_asked and temperature > 0,
    )


def entropix_config(
    request: orchestrator_pb2.GenerateRequest, temperature: float, top_k: int, top_p: float, min_p: float, vocab_size: int
) -> EntropixConfig:
    """The request's `entropix` fields over the reference's defaults, every one checked."""
    message = request.entropix
    values: dict[str, float] = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p}
    for name in CONFIG_FIELDS:
        if name not in values and message.HasField(name):
            values[name] = getattr(message, name)
    config = EntropixConfig(**values)  # type: ignore[arg-type]
    for name, problem in check_config(config, vocab_size):
        base_field = name in ("temperature", "top_k", "top_p", "min_p")
        raise InvalidArgument(name if base_field else f"entropix.{name}", problem)
    return config
