"""A `GenerateRequest` checked once and turned into typed parameters.

Every bound lives here, so every bad field gets INVALID_ARGUMENT with the field's name before
any session is opened.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field

from specwire.orchestrator.entropix import CONFIG_FIELDS, EntropixConfig, check_config
from specwire.v1 import orchestrator_pb2

from specwire.errors import InvalidArgument, check_token_ids
from specwire.medusa import build_tree
from specwire.processing import ProcessingConfig

STRATEGIES = ("greedy", "sample", "beam", "speculative", "contrastive", "entropix", "medusa", "best_first_beam")
# Beam search proper: num_beams defaults to 4, sampling warpers do not apply.
BEAM_STRATEGIES = ("beam", "best_first_beam")
# Enum values by lowercase name (the SDK's and CLI's spelling); UNSPECIFIED (0) means the first.
STRATEGY_VALUES = {name: orchestrator_pb2.Strategy.Value(f"STRATEGY_{name.upper()}") for name in STRATEGIES}
EARLY_STOPPING_VALUES = {
    name: orchestrator_pb2.EarlyStopping.Value(f"EARLY_STOPPING_{name.upper()}") for name in ("false", "true", "never")
}
MEDUSA_ACCEPTANCE_VALUES = {
    name: orchestrator_pb2.MedusaAcceptance.Value(f"MEDUSA_ACCEPTANCE_{name.upper()}") for name in ("lossless", "typical")
}
CD_FORM_VALUES = {name: orchestrator_pb2.ContrastiveForm.Value(f"CONTRASTIVE_FORM_{name.upper()}") for name in ("obrien", "li")}
MAX_BEAMS = 32
MAX_SPECULATIVE_TOKENS = 64
MAX_DRAFT_ALTERNATIVES = 8  # the draft service's `Step.propose_alternatives` limit
LOOKUP_MAX_NGRAM = 3  # history lookup matches the last 3 tokens, then 2, … down to `lookup_min_ngram`
DEFAULT_LOOKUP_MIN_NGRAM = 1
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # per stop string
# |length_penalty| bound: length^penalty stays far inside float64 for any context length.
MAX_LENGTH_PENALTY = 20.0
# Li et al.'s amateur temperature: below this the amateur's own scale swamps the contrast.
MIN_AMATEUR_TEMPERATURE = 0.01
# The request fields whose names the messages use (one place, for renames).
PROMPT_FIELD, PROMPT_IDS_FIELD, STOP_FIELD = "prompt", "input_ids", "stop_strings"
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p")


@dataclass(frozen=True)
class Limits:
    """What the orchestrator's deployment allows, and what the target model can hold."""

    max_new_tokens: int
    default_max_new_tokens: int
    max_context: int
    vocab_size: int
    speculative_pipeline: bool = True  # for requests that leave it unset


@dataclass(frozen=True)
class GenerationParams:
    strategy: str
    max_new_tokens: int
    ignore_eos: bool = False
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None
    processing: ProcessingConfig = field(default_factory=ProcessingConfig)
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int = 1
    num_speculative_tokens: int | None = None  # None = auto: chosen each round by the latency model
    speculative_pipeline: bool = True
    draft_confidence_threshold: float = 0.0
    draft_alternatives: int = 0  # greedy speculative rounds verify the draft's runners-up too
    # Rounds drafted by copying from the history, where its last n ≥ this tokens occurred before; 0 = off.
    lookup_min_ngram: int = DEFAULT_LOOKUP_MIN_NGRAM
    cd_form: str = "obrien"
    cd_alpha: float = 0.1
    cd_beta: float = 0.5
    amateur_temperature: float = 1.0
    entropix: EntropixConfig | None = None
    # Entropix verifying a draft's proposals (num_speculative_tokens given with strategy entropix).
    entropix_speculative: bool = False
    # Medusa: the tree's paths ([] = the strategy's default) and the sampled acceptance rule.
    medusa_choices: list[list[int]] = field(default_factory=list)
    medusa_acceptance: str = "lossless"  # or "typical": LOSSY
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3
    # Tokens are drawn at random (else argmax): strategy "sample", or speculative / contrastive
    # with a sampling warper set; temperature 0 always means argmax.
    do_sample: bool = False


def _as_float32(value: float) -> float:
    return float(struct.unpack("f", struct.pack("f", value))[0])


def _finite(value: float, name: str) -> float:
    if not math.isfinite(value):
        raise InvalidArgument(name, f"must be a finite number, got {value}")
    return value


def _opt(request: orchestrator_pb2.GenerateRequest, name: str, default: float) -> float:
    return getattr(request, name) if request.HasField(name) else default  # type: ignore[no-any-return]


def name_of(number: int, values: dict[str, int]) -> str | None:
    """The lowercase name of an enum value; UNSPECIFIED (0) is the first name, the default.
    None for a number this build does not know (proto3 enums are open)."""
    if number == 0:
        return next(iter(values))
    return next((name for name, value in values.items() if value == number), None)


def enum_name(request: orchestrator_pb2.GenerateRequest, field_name: str, values: dict[str, int]) -> str:
    number = getattr(request, field_name)
    name = name_of(number, values)
    if name is None:
        raise InvalidArgument(field_name, f"unknown value {number}; expected one of {', '.join(values)}")
    return name


def prompt_ids_of(request: orchestrator_pb2.GenerateRequest) -> list[int]:
    return list(request.input_ids.ids)


def stop_strings_of(request: orchestrator_pb2.GenerateRequest) -> tuple[str, ...]:
    return tuple(request.stop_strings)


def check_prompt(request: orchestrator_pb2.GenerateRequest, limits: Limits) -> None:
    """One of text and ids (a oneof on the wire); ids in the vocabulary and no more than the context holds."""
    ids = prompt_ids_of(request)
    if not request.prompt and not ids:
        raise InvalidArgument(PROMPT_FIELD, f"must not be empty (give {PROMPT_FIELD} or {PROMPT_IDS_FIELD})")
    if len(ids) >= limits.max_context:
        raise InvalidArgument(
            PROMPT_IDS_FIELD, f"{len(ids)} tokens leave no room in the model context of {limits.max_context}"
        )
    check_token_ids(ids, limits.vocab_size, PROMPT_IDS_FIELD)


def check_prompt_text(prompt_len: int, limits: Limits) -> None:
    """The tokenized text prompt must hold a token and leave room for at least one new token."""
    if not prompt_len:
        raise InvalidArgument(PROMPT_FIELD, "tokenizes to no tokens")
    if prompt_len >= limits.max_context:
        raise InvalidArgument(
            PROMPT_FIELD, f"{prompt_len} tokens leave no room in the model context of {limits.max_context}"
        )


def parse(request: orchestrator_pb2.GenerateRequest, prompt_len: int, limits: Limits) -> GenerationParams:
    """Validate every field against its bound; `prompt_len` is the tokenized prompt's length."""
    strategy = enum_name(request, "strategy", STRATEGY_VALUES)

    max_new = request.max_new_tokens if request.HasField("max_new_tokens") else limits.default_max_new_tokens
    if not 1 <= max_new <= limits.max_new_tokens:
        raise InvalidArgument("max_new_tokens", f"must be in [1, {limits.max_new_tokens}], got {max_new}")
    if prompt_len + max_new > limits.max_context:  # the prompt alone fits (check_prompt*)
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
    repetition_penalty = _finite(_opt(request, "repetition_penalty", 1.0), "repetition_penalty")  # > 0, any size
    if repetition_penalty <= 0:
        raise InvalidArgument("repetition_penalty", f"must be > 0, got {repetition_penalty}")
    ngram = int(_opt(request, "no_repeat_ngram_size", 0))
    if ngram < 0:
        raise InvalidArgument("no_repeat_ngram_size", f"must be ≥ 0 (0 = off), got {ngram}")

    num_beams = int(_opt(request, "num_beams", 4 if strategy in BEAM_STRATEGIES else 1))
    if not 1 <= num_beams <= MAX_BEAMS:
        raise InvalidArgument("num_beams", f"must be in [1, {MAX_BEAMS}], got {num_beams}")
    if num_beams > 1 and strategy not in (*BEAM_STRATEGIES, "contrastive"):
        raise InvalidArgument("num_beams", f"beams need strategy 'beam', 'best_first_beam' or 'contrastive', got {strategy!r}")
    num_return = int(_opt(request, "num_return_sequences", 1))
    if not 1 <= num_return <= num_beams:
        raise InvalidArgument("num_return_sequences", f"must be in [1, num_beams={num_beams}], got {num_return}")
    default_penalty = 0.0 if strategy == "best_first_beam" else 1.0
    length_penalty = _finite(_opt(request, "length_penalty", default_penalty), "length_penalty")
    if not -MAX_LENGTH_PENALTY <= length_penalty <= MAX_LENGTH_PENALTY:
        raise InvalidArgument(
            "length_penalty", f"must be in [{-MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}], got {length_penalty}"
        )
    early: dict[str, bool | str] = {"false": False, "true": True, "never": "never"}
    early_stopping = early[enum_name(request, "early_stopping", EARLY_STOPPING_VALUES)]
    if strategy == "best_first_beam":
        check_best_first(length_penalty, early_stopping)

    gamma = int(_opt(request, "num_speculative_tokens", 0))
    if not 0 <= gamma <= MAX_SPECULATIVE_TOKENS:
        raise InvalidArgument(
            "num_speculative_tokens", f"must be in [1, {MAX_SPECULATIVE_TOKENS}], or 0 for auto; got {gamma}"
        )
    threshold = _finite(_opt(request, "draft_confidence_threshold", 0.0), "draft_confidence_threshold")
    if not 0 <= threshold < 1:
        raise InvalidArgument("draft_confidence_threshold", f"must be in [0, 1), got {threshold}")
    alternatives = int(_opt(request, "draft_alternatives", 0))
    if not 0 <= alternatives <= MAX_DRAFT_ALTERNATIVES:
        raise InvalidArgument("draft_alternatives", f"must be in [0, {MAX_DRAFT_ALTERNATIVES}], got {alternatives}")
    lookup = int(_opt(request, "lookup_min_ngram", DEFAULT_LOOKUP_MIN_NGRAM))
    if not 0 <= lookup <= LOOKUP_MAX_NGRAM:
        raise InvalidArgument("lookup_min_ngram", f"must be in [0, {LOOKUP_MAX_NGRAM}] (0 = off), got {lookup}")

    cd_form = enum_name(request, "cd_form", CD_FORM_VALUES)
    cd_alpha = _finite(_opt(request, "cd_alpha", 0.1), "cd_alpha")
    if not 0 < cd_alpha <= 1:
        raise InvalidArgument("cd_alpha", f"must be in (0, 1], got {cd_alpha}")
    cd_beta = _finite(_opt(request, "cd_beta", 0.5), "cd_beta")
    if cd_beta < 0:
        raise InvalidArgument("cd_beta", f"must be ≥ 0, got {cd_beta}")
    amateur_t = _finite(_opt(request, "amateur_temperature", 1.0), "amateur_temperature")
    if amateur_t < _as_float32(MIN_AMATEUR_TEMPERATURE):  # the field is a float: 0.01 arrives rounded
        raise InvalidArgument("amateur_temperature", f"must be ≥ {MIN_AMATEUR_TEMPERATURE}, got {amateur_t}")

    medusa_choices = parse_medusa_choices(request.medusa_choices) if request.medusa_choices else []
    acceptance = enum_name(request, "medusa_acceptance", MEDUSA_ACCEPTANCE_VALUES)
    posterior_threshold = _finite(_opt(request, "posterior_threshold", 0.09), "posterior_threshold")
    if not 0 < posterior_threshold <= 1:
        raise InvalidArgument("posterior_threshold", f"must be in (0, 1], got {posterior_threshold}")
    posterior_alpha = _finite(_opt(request, "posterior_alpha", 0.3), "posterior_alpha")
    if not 0 < posterior_alpha <= 1:
        raise InvalidArgument("posterior_alpha", f"must be in (0, 1], got {posterior_alpha}")

    stop = stop_strings_of(request)
    if len(stop) > MAX_STOP_STRINGS or any(not 1 <= len(s) <= MAX_STOP_CHARS for s in stop):
        raise InvalidArgument(
            STOP_FIELD, f"at most {MAX_STOP_STRINGS} strings of 1 to {MAX_STOP_CHARS} characters each"
        )
    if stop and num_beams > 1:
        raise InvalidArgument(STOP_FIELD, "stop strings are not supported with beam search (num_beams > 1)")

    warpers_set = [name for name in SAMPLING_FIELDS if request.HasField(name)]
    sampling_asked = strategy == "sample" or (strategy in ("speculative", "contrastive", "medusa") and bool(warpers_set))
    entropix = entropix_config(request, temperature, top_k, top_p, min_p, limits.vocab_size) if base else None
    if strategy in BEAM_STRATEGIES and warpers_set:
        raise InvalidArgument(warpers_set[0], "beam search here is deterministic; sampling warpers do not apply")
    if strategy == "contrastive" and num_beams > 1 and sampling_asked and temperature > 0:
        raise InvalidArgument(warpers_set[0], "contrastive beam search is deterministic; sampling warpers do not apply")
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
        stop_strings=stop,
        seed=request.seed if request.HasField("seed") else None,
        processing=processing,
        num_beams=num_beams,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        num_return_sequences=num_return,
        num_speculative_tokens=gamma or None,
        speculative_pipeline=(
            request.speculative_pipeline if request.HasField("speculative_pipeline") else limits.speculative_pipeline
        ),
        draft_confidence_threshold=threshold,
        draft_alternatives=alternatives,
        lookup_min_ngram=lookup,
        cd_form=cd_form,
        cd_alpha=cd_alpha,
        cd_beta=cd_beta,
        amateur_temperature=amateur_t,
        entropix=entropix,
        entropix_speculative=entropix is not None and gamma > 0,  # a fixed γ; auto (0) is plain entropix
        medusa_choices=medusa_choices,
        medusa_acceptance=acceptance,
        posterior_threshold=posterior_threshold,
        posterior_alpha=posterior_alpha,
        do_sample=sampling_asked and temperature > 0,
    )


def check_best_first(length_penalty: float, early_stopping: bool | str) -> None:
    """Best-first beam search returns beam's result only where popping best first is sound: a
    score that never rises as a hypothesis grows (length_penalty 0), and beam's stop that waits
    until no running beam can do better (early_stopping false or never)."""
    if length_penalty != 0.0:
        raise InvalidArgument(
            "length_penalty",
            f"best_first_beam needs 0 (a score that only falls as a hypothesis grows), got {length_penalty}",
        )
    if early_stopping is True:
        raise InvalidArgument(
            "early_stopping",
            "best_first_beam stops when no hypothesis can do better (false or never); true would stop "
            "at the first num_beams hypotheses, which best-first order does not find",
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


MAX_MEDUSA_NODES = 256
# A path is a list inside a list: anything nested deeper is refused before the JSON parser,
# whose recursion a text of a thousand '[' would exhaust.
MEDUSA_CHOICES_DEPTH = 2
# 255 paths of a dozen 4-digit indices fit in well under this.
MAX_MEDUSA_CHOICES_CHARS = 65536


def json_depth(text: str) -> int:
    """The deepest nesting of '[' / '{' in `text` (brackets inside strings counted too: a
    string is no valid path, so an overestimate only refuses what is refused anyway)."""
    depth = deepest = 0
    for char in text:
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def parse_medusa_choices(text: str) -> list[list[int]]:
    """`medusa_choices`: a JSON list of paths of top-k indices whose prefixes are paths too."""
    if len(text) > MAX_MEDUSA_CHOICES_CHARS:
        raise InvalidArgument("medusa_choices", f"must be at most {MAX_MEDUSA_CHOICES_CHARS} characters, got {len(text)}")
    if json_depth(text) > MEDUSA_CHOICES_DEPTH:
        raise InvalidArgument("medusa_choices", f"must be a JSON list of lists, nested {MEDUSA_CHOICES_DEPTH} deep at most")
    try:
        choices = json.loads(text)
    except ValueError as error:  # also a number of more digits than Python converts
        raise InvalidArgument("medusa_choices", f"must be JSON: {error}") from None
    # JSON's true / false are no indices, though Python's bool is an int.
    if not isinstance(choices, list) or not all(
        isinstance(c, list) and c and all(type(i) is int and 0 <= i < 1024 for i in c) for c in choices
    ):
        raise InvalidArgument("medusa_choices", "must be a JSON list of non-empty lists of top-k indices in [0, 1024)")
    if not 1 <= len(choices) < MAX_MEDUSA_NODES:
        raise InvalidArgument("medusa_choices", f"must name between 1 and {MAX_MEDUSA_NODES - 1} paths")
    try:
        build_tree(choices)
    except ValueError as error:  # build_tree's message names the field already
        raise InvalidArgument("medusa_choices", str(error).removeprefix("medusa_choices: ")) from None
    return [list(c) for c in choices]
