from specwire.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Strategy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STRATEGY_UNSPECIFIED: _ClassVar[Strategy]
    STRATEGY_GREEDY: _ClassVar[Strategy]
    STRATEGY_SAMPLE: _ClassVar[Strategy]
    STRATEGY_BEAM: _ClassVar[Strategy]
    STRATEGY_SPECULATIVE: _ClassVar[Strategy]
    STRATEGY_CONTRASTIVE: _ClassVar[Strategy]
    STRATEGY_ENTROPIX: _ClassVar[Strategy]
    STRATEGY_MEDUSA: _ClassVar[Strategy]
    STRATEGY_BEST_FIRST_BEAM: _ClassVar[Strategy]

class MedusaAcceptance(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEDUSA_ACCEPTANCE_UNSPECIFIED: _ClassVar[MedusaAcceptance]
    MEDUSA_ACCEPTANCE_LOSSLESS: _ClassVar[MedusaAcceptance]
    MEDUSA_ACCEPTANCE_TYPICAL: _ClassVar[MedusaAcceptance]

class EarlyStopping(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EARLY_STOPPING_UNSPECIFIED: _ClassVar[EarlyStopping]
    EARLY_STOPPING_FALSE: _ClassVar[EarlyStopping]
    EARLY_STOPPING_TRUE: _ClassVar[EarlyStopping]
    EARLY_STOPPING_NEVER: _ClassVar[EarlyStopping]

class ContrastiveForm(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CONTRASTIVE_FORM_UNSPECIFIED: _ClassVar[ContrastiveForm]
    CONTRASTIVE_FORM_OBRIEN: _ClassVar[ContrastiveForm]
    CONTRASTIVE_FORM_LI: _ClassVar[ContrastiveForm]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
STRATEGY_UNSPECIFIED: Strategy
STRATEGY_GREEDY: Strategy
STRATEGY_SAMPLE: Strategy
STRATEGY_BEAM: Strategy
STRATEGY_SPECULATIVE: Strategy
STRATEGY_CONTRASTIVE: Strategy
STRATEGY_ENTROPIX: Strategy
STRATEGY_MEDUSA: Strategy
STRATEGY_BEST_FIRST_BEAM: Strategy
MEDUSA_ACCEPTANCE_UNSPECIFIED: MedusaAcceptance
MEDUSA_ACCEPTANCE_LOSSLESS: MedusaAcceptance
MEDUSA_ACCEPTANCE_TYPICAL: MedusaAcceptance
EARLY_STOPPING_UNSPECIFIED: EarlyStopping
EARLY_STOPPING_FALSE: EarlyStopping
EARLY_STOPPING_TRUE: EarlyStopping
EARLY_STOPPING_NEVER: EarlyStopping
CONTRASTIVE_FORM_UNSPECIFIED: ContrastiveForm
CONTRASTIVE_FORM_OBRIEN: ContrastiveForm
CONTRASTIVE_FORM_LI: ContrastiveForm
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "input_ids", "strategy", "max_new_tokens", "ignore_eos", "stop_strings", "seed", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "no_repeat_ngram_size", "num_beams", "length_penalty", "early_stopping", "num_return_sequences", "num_speculative_tokens", "draft_confidence_threshold", "speculative_pipeline", "draft_alternatives", "lookup_min_ngram", "cd_form", "cd_alpha", "cd_beta", "amateur_temperature", "entropix", "medusa_choices", "medusa_acceptance", "posterior_threshold", "posterior_alpha")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    NO_REPEAT_NGRAM_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BEAMS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_PENALTY_FIELD_NUMBER: _ClassVar[int]
    EARLY_STOPPING_FIELD_NUMBER: _ClassVar[int]
    NUM_RETURN_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CONFIDENCE_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_PIPELINE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ALTERNATIVES_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_MIN_NGRAM_FIELD_NUMBER: _ClassVar[int]
    CD_FORM_FIELD_NUMBER: _ClassVar[int]
    CD_ALPHA_FIELD_NUMBER: _ClassVar[int]
    CD_BETA_FIELD_NUMBER: _ClassVar[int]
    AMATEUR_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    ENTROPIX_FIELD_NUMBER: _ClassVar[int]
    MEDUSA_CHOICES_FIELD_NUMBER: _ClassVar[int]
    MEDUSA_ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    POSTERIOR_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    POSTERIOR_ALPHA_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    input_ids: TokenIds
    strategy: Strategy
    max_new_tokens: int
    ignore_eos: bool
    stop_strings: _containers.RepeatedScalarFieldContainer[str]
    seed: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    no_repeat_ngram_size: int
    num_beams: int
    length_penalty: float
    early_stopping: EarlyStopping
    num_return_sequences: int
    num_speculative_tokens: int
    draft_confidence_threshold: float
    speculative_pipeline: bool
    draft_alternatives: int
    lookup_min_ngram: int
    cd_form: ContrastiveForm
    cd_alpha: float
    cd_beta: float
    amateur_temperature: float
    entropix: EntropixParams
    medusa_choices: str
    medusa_acceptance: MedusaAcceptance
    posterior_threshold: float
    posterior_alpha: float
    def __init__(self, prompt: _Optional[str] = ..., input_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., strategy: _Optional[_Union[Strategy, str]] = ..., max_new_tokens: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., stop_strings: _Optional[_Iterable[str]] = ..., seed: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., no_repeat_ngram_size: _Optional[int] = ..., num_beams: _Optional[int] = ..., length_penalty: _Optional[float] = ..., early_stopping: _Optional[_Union[EarlyStopping, str]] = ..., num_return_sequences: _Optional[int] = ..., num_speculative_tokens: _Optional[int] = ..., draft_confidence_threshold: _Optional[float] = ..., speculative_pipeline: _Optional[bool] = ..., draft_alternatives: _Optional[int] = ..., lookup_min_ngram: _Optional[int] = ..., cd_form: _Optional[_Union[ContrastiveForm, str]] = ..., cd_alpha: _Optional[float] = ..., cd_beta: _Optional[float] = ..., amateur_temperature: _Optional[float] = ..., entropix: _Optional[_Union[EntropixParams, _Mapping]] = ..., medusa_choices: _Optional[str] = ..., medusa_acceptance: _Optional[_Union[MedusaAcceptance, str]] = ..., posterior_threshold: _Optional[float] = ..., posterior_alpha: _Optional[float] = ...) -> None: ...

class EntropixParams(_message.Message):
    __slots__ = ("argmax_entropy", "argmax_varentropy", "clarify_entropy", "clarify_varentropy", "branch_entropy", "branch_varentropy", "resample_entropy", "resample_varentropy", "clarifying_token", "clarify_temperature_offset", "clarify_temperature_coefficient", "clarify_max_temperature", "branch_temperature_offset", "branch_temperature_coefficient", "branch_max_temperature", "branch_top_k_coefficient", "branch_min_top_k", "resample_temperature_offset", "resample_temperature_coefficient", "resample_min_temperature", "resample_top_p_coefficient", "resample_min_top_p", "adaptive_samples", "adaptive_min_p", "adaptive_temperature_logits", "adaptive_temperature_attention", "adaptive_temperature_agreement", "adaptive_top_p_coefficient", "adaptive_top_k_interaction", "adaptive_top_k_agreement", "adaptive_max_top_k", "adaptive_min_p_coefficient", "score_entropy", "score_attention_entropy", "score_varentropy", "score_attention_varentropy", "score_agreement", "score_interaction_strength")
    ARGMAX_ENTROPY_FIELD_NUMBER: _ClassVar[int]
    ARGMAX_VARENTROPY_FIELD_NUMBER: _ClassVar[int]
    CLARIFY_ENTROPY_FIELD_NUMBER: _ClassVar[int]
    CLARIFY_VARENTROPY_FIELD_NUMBER: _ClassVar[int]
    BRANCH_ENTROPY_FIELD_NUMBER: _ClassVar[int]
    BRANCH_VARENTROPY_FIELD_NUMBER: _ClassVar[int]
    RESAMPLE_ENTROPY_FIELD_NUMBER: _ClassVar[int]
    RESAMPLE_VARENTROPY_FIELD_NUMBER: _ClassVar[int]
    CLARIFYING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CLARIFY_TEMPERATURE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    CLARIFY_TEMPERATURE_COEFFICIENT_FIELD_NUMBER: _ClassVar[int]
    CLARIFY_MAX_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    BRANCH_TEMPERATURE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    BRANCH_TEMPERATURE_COEFFICIENT_FIELD_NUMBER: _ClassVar[int]
    BRANCH_MAX_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    BRANCH_TOP_K_COEFFICIENT_FIELD_NUMBER: _ClassVar[int]
    BRANCH_MIN_TOP_K_FIELD_NUMBER: _ClassVar[int]
    RESAMPLE_TEMPERATURE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    RESAMPLE_TEMPERATURE_COEFFICIENT_FIELD_NUMBER: _ClassVar[int]
    RESAMPLE_MIN_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    RESAMPLE_TOP_P_COEFFICIENT_FIELD_NUMBER: _ClassVar[int]
    RESAMPLE_MIN_TOP_P_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_MIN_P_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_TEMPERATURE_LOGITS_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_TEMPERATURE_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_TEMPERATURE_AGREEMENT_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_TOP_P_COEFFICIENT_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_TOP_K_INTERACTION_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_TOP_K_AGREEMENT_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_MAX_TOP_K_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_MIN_P_COEFFICIENT_FIELD_NUMBER: _ClassVar[int]
    SCORE_ENTROPY_FIELD_NUMBER: _ClassVar[int]
    SCORE_ATTENTION_ENTROPY_FIELD_NUMBER: _ClassVar[int]
    SCORE_VARENTROPY_FIELD_NUMBER: _ClassVar[int]
    SCORE_ATTENTION_VARENTROPY_FIELD_NUMBER: _ClassVar[int]
    SCORE_AGREEMENT_FIELD_NUMBER: _ClassVar[int]
    SCORE_INTERACTION_STRENGTH_FIELD_NUMBER: _ClassVar[int]
    argmax_entropy: float
    argmax_varentropy: float
    clarify_entropy: float
    clarify_varentropy: float
    branch_entropy: float
    branch_varentropy: float
    resample_entropy: float
    resample_varentropy: float
    clarifying_token: int
    clarify_temperature_offset: float
    clarify_temperature_coefficient: float
    clarify_max_temperature: float
    branch_temperature_offset: float
    branch_temperature_coefficient: float
    branch_max_temperature: float
    branch_top_k_coefficient: float
    branch_min_top_k: int
    resample_temperature_offset: float
    resample_temperature_coefficient: float
    resample_min_temperature: float
    resample_top_p_coefficient: float
    resample_min_top_p: float
    adaptive_samples: int
    adaptive_min_p: float
    adaptive_temperature_logits: float
    adaptive_temperature_attention: float
    adaptive_temperature_agreement: float
    adaptive_top_p_coefficient: float
    adaptive_top_k_interaction: float
    adaptive_top_k_agreement: float
    adaptive_max_top_k: int
    adaptive_min_p_coefficient: float
    score_entropy: float
    score_attention_entropy: float
    score_varentropy: float
    score_attention_varentropy: float
    score_agreement: float
    score_interaction_strength: float
    def __init__(self, argmax_entropy: _Optional[float] = ..., argmax_varentropy: _Optional[float] = ..., clarify_entropy: _Optional[float] = ..., clarify_varentropy: _Optional[float] = ..., branch_entropy: _Optional[float] = ..., branch_varentropy: _Optional[float] = ..., resample_entropy: _Optional[float] = ..., resample_varentropy: _Optional[float] = ..., clarifying_token: _Optional[int] = ..., clarify_temperature_offset: _Optional[float] = ..., clarify_temperature_coefficient: _Optional[float] = ..., clarify_max_temperature: _Optional[float] = ..., branch_temperature_offset: _Optional[float] = ..., branch_temperature_coefficient: _Optional[float] = ..., branch_max_temperature: _Optional[float] = ..., branch_top_k_coefficient: _Optional[float] = ..., branch_min_top_k: _Optional[int] = ..., resample_temperature_offset: _Optional[float] = ..., resample_temperature_coefficient: _Optional[float] = ..., resample_min_temperature: _Optional[float] = ..., resample_top_p_coefficient: _Optional[float] = ..., resample_min_top_p: _Optional[float] = ..., adaptive_samples: _Optional[int] = ..., adaptive_min_p: _Optional[float] = ..., adaptive_temperature_logits: _Optional[float] = ..., adaptive_temperature_attention: _Optional[float] = ..., adaptive_temperature_agreement: _Optional[float] = ..., adaptive_top_p_coefficient: _Optional[float] = ..., adaptive_top_k_interaction: _Optional[float] = ..., adaptive_top_k_agreement: _Optional[float] = ..., adaptive_max_top_k: _Optional[int] = ..., adaptive_min_p_coefficient: _Optional[float] = ..., score_entropy: _Optional[float] = ..., score_attention_entropy: _Optional[float] = ..., score_varentropy: _Optional[float] = ..., score_attention_varentropy: _Optional[float] = ..., score_agreement: _Optional[float] = ..., score_interaction_strength: _Optional[float] = ...) -> None: ...

class Sequence(_message.Message):
    __slots__ = ("token_ids", "text", "score")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    score: float
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., score: _Optional[float] = ...) -> None: ...

class GenerationStats(_message.Message):
    __slots__ = ("prompt_tokens", "new_tokens", "rounds", "target_forwards", "draft_forwards", "wall_ms", "ttft_ms", "target_compute_ms", "target_queue_ms", "target_network_ms", "draft_compute_ms", "draft_queue_ms", "draft_network_ms", "orchestrator_ms", "target_bytes_sent", "target_bytes_received", "draft_bytes_sent", "draft_bytes_received", "drafted_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_length", "accepted_length_histogram", "tokens_per_target_forward", "corrections", "bonus_tokens", "bytes_per_round", "speculation_off_rounds", "target_only_tokens", "pipelined_rounds", "pipeline_misses", "lookup_rounds", "lookup_drafted_tokens", "mean_gamma", "alpha_estimate", "draft_ms_per_token_estimate", "verify_ms_estimate", "target_ms_per_token_estimate", "trip_ms_estimate", "expert_ms_per_step", "amateur_ms_per_step", "mean_valid_set_size", "differs_from_expert_rate", "sessions_rebuilt", "entropix_states", "expansions", "medusa_tree_size", "medusa_head_acceptance")
    class EntropixStatesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    WALL_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TARGET_COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    TARGET_QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    TARGET_NETWORK_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_NETWORK_MS_FIELD_NUMBER: _ClassVar[int]
    ORCHESTRATOR_MS_FIELD_NUMBER: _ClassVar[int]
    TARGET_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    TARGET_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_LENGTH_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_TARGET_FORWARD_FIELD_NUMBER: _ClassVar[int]
    CORRECTIONS_FIELD_NUMBER: _ClassVar[int]
    BONUS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_ROUND_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_OFF_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_ONLY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PIPELINED_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_MISSES_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEAN_GAMMA_FIELD_NUMBER: _ClassVar[int]
    ALPHA_ESTIMATE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MS_PER_TOKEN_ESTIMATE_FIELD_NUMBER: _ClassVar[int]
    VERIFY_MS_ESTIMATE_FIELD_NUMBER: _ClassVar[int]
    TARGET_MS_PER_TOKEN_ESTIMATE_FIELD_NUMBER: _ClassVar[int]
    TRIP_MS_ESTIMATE_FIELD_NUMBER: _ClassVar[int]
    EXPERT_MS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    AMATEUR_MS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    MEAN_VALID_SET_SIZE_FIELD_NUMBER: _ClassVar[int]
    DIFFERS_FROM_EXPERT_RATE_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_REBUILT_FIELD_NUMBER: _ClassVar[int]
    ENTROPIX_STATES_FIELD_NUMBER: _ClassVar[int]
    EXPANSIONS_FIELD_NUMBER: _ClassVar[int]
    MEDUSA_TREE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEDUSA_HEAD_ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    new_tokens: int
    rounds: int
    target_forwards: int
    draft_forwards: int
    wall_ms: float
    ttft_ms: float
    target_compute_ms: float
    target_queue_ms: float
    target_network_ms: float
    draft_compute_ms: float
    draft_queue_ms: float
    draft_network_ms: float
    orchestrator_ms: float
    target_bytes_sent: int
    target_bytes_received: int
    draft_bytes_sent: int
    draft_bytes_received: int
    drafted_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    mean_accepted_length: float
    accepted_length_histogram: _containers.RepeatedScalarFieldContainer[int]
    tokens_per_target_forward: float
    corrections: int
    bonus_tokens: int
    bytes_per_round: float
    speculation_off_rounds: int
    target_only_tokens: int
    pipelined_rounds: int
    pipeline_misses: int
    lookup_rounds: int
    lookup_drafted_tokens: int
    mean_gamma: float
    alpha_estimate: float
    draft_ms_per_token_estimate: float
    verify_ms_estimate: float
    target_ms_per_token_estimate: float
    trip_ms_estimate: float
    expert_ms_per_step: float
    amateur_ms_per_step: float
    mean_valid_set_size: float
    differs_from_expert_rate: float
    sessions_rebuilt: int
    entropix_states: _containers.ScalarMap[str, int]
    expansions: int
    medusa_tree_size: float
    medusa_head_acceptance: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, prompt_tokens: _Optional[int] = ..., new_tokens: _Optional[int] = ..., rounds: _Optional[int] = ..., target_forwards: _Optional[int] = ..., draft_forwards: _Optional[int] = ..., wall_ms: _Optional[float] = ..., ttft_ms: _Optional[float] = ..., target_compute_ms: _Optional[float] = ..., target_queue_ms: _Optional[float] = ..., target_network_ms: _Optional[float] = ..., draft_compute_ms: _Optional[float] = ..., draft_queue_ms: _Optional[float] = ..., draft_network_ms: _Optional[float] = ..., orchestrator_ms: _Optional[float] = ..., target_bytes_sent: _Optional[int] = ..., target_bytes_received: _Optional[int] = ..., draft_bytes_sent: _Optional[int] = ..., draft_bytes_received: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., mean_accepted_length: _Optional[float] = ..., accepted_length_histogram: _Optional[_Iterable[int]] = ..., tokens_per_target_forward: _Optional[float] = ..., corrections: _Optional[int] = ..., bonus_tokens: _Optional[int] = ..., bytes_per_round: _Optional[float] = ..., speculation_off_rounds: _Optional[int] = ..., target_only_tokens: _Optional[int] = ..., pipelined_rounds: _Optional[int] = ..., pipeline_misses: _Optional[int] = ..., lookup_rounds: _Optional[int] = ..., lookup_drafted_tokens: _Optional[int] = ..., mean_gamma: _Optional[float] = ..., alpha_estimate: _Optional[float] = ..., draft_ms_per_token_estimate: _Optional[float] = ..., verify_ms_estimate: _Optional[float] = ..., target_ms_per_token_estimate: _Optional[float] = ..., trip_ms_estimate: _Optional[float] = ..., expert_ms_per_step: _Optional[float] = ..., amateur_ms_per_step: _Optional[float] = ..., mean_valid_set_size: _Optional[float] = ..., differs_from_expert_rate: _Optional[float] = ..., sessions_rebuilt: _Optional[int] = ..., entropix_states: _Optional[_Mapping[str, int]] = ..., expansions: _Optional[int] = ..., medusa_tree_size: _Optional[float] = ..., medusa_head_acceptance: _Optional[_Iterable[float]] = ...) -> None: ...

class EntropixDecision(_message.Message):
    __slots__ = ("state", "entropy", "varentropy", "attn_entropy", "attn_varentropy", "agreement", "interaction_strength", "temperature", "top_p", "top_k", "min_p", "clarified")
    STATE_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_FIELD_NUMBER: _ClassVar[int]
    VARENTROPY_FIELD_NUMBER: _ClassVar[int]
    ATTN_ENTROPY_FIELD_NUMBER: _ClassVar[int]
    ATTN_VARENTROPY_FIELD_NUMBER: _ClassVar[int]
    AGREEMENT_FIELD_NUMBER: _ClassVar[int]
    INTERACTION_STRENGTH_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    CLARIFIED_FIELD_NUMBER: _ClassVar[int]
    state: str
    entropy: float
    varentropy: float
    attn_entropy: float
    attn_varentropy: float
    agreement: float
    interaction_strength: float
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    clarified: bool
    def __init__(self, state: _Optional[str] = ..., entropy: _Optional[float] = ..., varentropy: _Optional[float] = ..., attn_entropy: _Optional[float] = ..., attn_varentropy: _Optional[float] = ..., agreement: _Optional[float] = ..., interaction_strength: _Optional[float] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., clarified: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "sequences", "stats", "decisions")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    sequences: _containers.RepeatedCompositeFieldContainer[Sequence]
    stats: GenerationStats
    decisions: _containers.RepeatedCompositeFieldContainer[EntropixDecision]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., sequences: _Optional[_Iterable[_Union[Sequence, _Mapping]]] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ..., decisions: _Optional[_Iterable[_Union[EntropixDecision, _Mapping]]] = ...) -> None: ...

class GenerateDelta(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "sequences", "stats", "decisions")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    sequences: _containers.RepeatedCompositeFieldContainer[Sequence]
    stats: GenerationStats
    decisions: _containers.RepeatedCompositeFieldContainer[EntropixDecision]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., sequences: _Optional[_Iterable[_Union[Sequence, _Mapping]]] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ..., decisions: _Optional[_Iterable[_Union[EntropixDecision, _Mapping]]] = ...) -> None: ...

class OrchestratorInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class OrchestratorInfo(_message.Message):
    __slots__ = ("target_model", "draft_model", "vocab_size", "max_context", "max_new_tokens_limit", "strategies", "draft_capabilities", "target_capabilities", "replicas", "tokenizer_source", "startup")
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    STRATEGIES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    TARGET_CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_SOURCE_FIELD_NUMBER: _ClassVar[int]
    STARTUP_FIELD_NUMBER: _ClassVar[int]
    target_model: str
    draft_model: str
    vocab_size: int
    max_context: int
    max_new_tokens_limit: int
    strategies: _containers.RepeatedScalarFieldContainer[str]
    draft_capabilities: _containers.RepeatedScalarFieldContainer[str]
    target_capabilities: _containers.RepeatedScalarFieldContainer[str]
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    tokenizer_source: str
    startup: _common_pb2.StartupTimes
    def __init__(self, target_model: _Optional[str] = ..., draft_model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., max_new_tokens_limit: _Optional[int] = ..., strategies: _Optional[_Iterable[str]] = ..., draft_capabilities: _Optional[_Iterable[str]] = ..., target_capabilities: _Optional[_Iterable[str]] = ..., replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ..., tokenizer_source: _Optional[str] = ..., startup: _Optional[_Union[_common_pb2.StartupTimes, _Mapping]] = ...) -> None: ...

class Replica(_message.Message):
    __slots__ = ("role", "address", "state", "active_sessions", "sessions_opened", "failures")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_OPENED_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    role: str
    address: str
    state: str
    active_sessions: int
    sessions_opened: int
    failures: int
    def __init__(self, role: _Optional[str] = ..., address: _Optional[str] = ..., state: _Optional[str] = ..., active_sessions: _Optional[int] = ..., sessions_opened: _Optional[int] = ..., failures: _Optional[int] = ...) -> None: ...
