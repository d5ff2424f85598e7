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
    __slots__ = ("prompt", "input_ids", "strategy", "max_new_tokens", "ignore_eos", "stop_strings", "seed", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "no_repeat_ngram_size", "num_beams", "length_penalty", "early_stopping", "num_return_sequences", "num_speculative_tokens", "draft_confidence_threshold", "cd_form", "cd_alpha", "cd_beta", "amateur_temperature")
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
    CD_FORM_FIELD_NUMBER: _ClassVar[int]
    CD_ALPHA_FIELD_NUMBER: _ClassVar[int]
    CD_BETA_FIELD_NUMBER: _ClassVar[int]
    AMATEUR_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
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
    cd_form: ContrastiveForm
    cd_alpha: float
    cd_beta: float
    amateur_temperature: float
    def __init__(self, prompt: _Optional[str] = ..., input_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., strategy: _Optional[_Union[Strategy, str]] = ..., max_new_tokens: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., stop_strings: _Optional[_Iterable[str]] = ..., seed: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., no_repeat_ngram_size: _Optional[int] = ..., num_beams: _Optional[int] = ..., length_penalty: _Optional[float] = ..., early_stopping: _Optional[_Union[EarlyStopping, str]] = ..., num_return_sequences: _Optional[int] = ..., num_speculative_tokens: _Optional[int] = ..., draft_confidence_threshold: _Optional[float] = ..., cd_form: _Optional[_Union[ContrastiveForm, str]] = ..., cd_alpha: _Optional[float] = ..., cd_beta: _Optional[float] = ..., amateur_temperature: _Optional[float] = ...) -> None: ...

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
    __slots__ = ("prompt_tokens", "new_tokens", "rounds", "target_forwards", "draft_forwards", "wall_ms", "ttft_ms", "target_compute_ms", "target_queue_ms", "target_network_ms", "draft_compute_ms", "draft_queue_ms", "draft_network_ms", "orchestrator_ms", "target_bytes_sent", "target_bytes_received", "draft_bytes_sent", "draft_bytes_received", "drafted_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_length", "accepted_length_histogram", "tokens_per_target_forward", "corrections", "bonus_tokens", "bytes_per_round", "expert_ms_per_step", "amateur_ms_per_step", "mean_valid_set_size", "differs_from_expert_rate", "sessions_rebuilt")
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
    EXPERT_MS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    AMATEUR_MS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    MEAN_VALID_SET_SIZE_FIELD_NUMBER: _ClassVar[int]
    DIFFERS_FROM_EXPERT_RATE_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_REBUILT_FIELD_NUMBER: _ClassVar[int]
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
    expert_ms_per_step: float
    amateur_ms_per_step: float
    mean_valid_set_size: float
    differs_from_expert_rate: float
    sessions_rebuilt: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., new_tokens: _Optional[int] = ..., rounds: _Optional[int] = ..., target_forwards: _Optional[int] = ..., draft_forwards: _Optional[int] = ..., wall_ms: _Optional[float] = ..., ttft_ms: _Optional[float] = ..., target_compute_ms: _Optional[float] = ..., target_queue_ms: _Optional[float] = ..., target_network_ms: _Optional[float] = ..., draft_compute_ms: _Optional[float] = ..., draft_queue_ms: _Optional[float] = ..., draft_network_ms: _Optional[float] = ..., orchestrator_ms: _Optional[float] = ..., target_bytes_sent: _Optional[int] = ..., target_bytes_received: _Optional[int] = ..., draft_bytes_sent: _Optional[int] = ..., draft_bytes_received: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., mean_accepted_length: _Optional[float] = ..., accepted_length_histogram: _Optional[_Iterable[int]] = ..., tokens_per_target_forward: _Optional[float] = ..., corrections: _Optional[int] = ..., bonus_tokens: _Optional[int] = ..., bytes_per_round: _Optional[float] = ..., expert_ms_per_step: _Optional[float] = ..., amateur_ms_per_step: _Optional[float] = ..., mean_valid_set_size: _Optional[float] = ..., differs_from_expert_rate: _Optional[float] = ..., sessions_rebuilt: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "sequences", "stats")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    sequences: _containers.RepeatedCompositeFieldContainer[Sequence]
    stats: GenerationStats
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., sequences: _Optional[_Iterable[_Union[Sequence, _Mapping]]] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ...) -> None: ...

class GenerateDelta(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "sequences", "stats")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    sequences: _containers.RepeatedCompositeFieldContainer[Sequence]
    stats: GenerationStats
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., sequences: _Optional[_Iterable[_Union[Sequence, _Mapping]]] = ..., stats: _Optional[_Union[GenerationStats, _Mapping]] = ...) -> None: ...

class OrchestratorInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class OrchestratorInfo(_message.Message):
    __slots__ = ("target_model", "draft_model", "vocab_size", "max_context", "max_new_tokens_limit", "strategies", "draft_capabilities", "target_capabilities", "replicas")
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    STRATEGIES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    TARGET_CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    target_model: str
    draft_model: str
    vocab_size: int
    max_context: int
    max_new_tokens_limit: int
    strategies: _containers.RepeatedScalarFieldContainer[str]
    draft_capabilities: _containers.RepeatedScalarFieldContainer[str]
    target_capabilities: _containers.RepeatedScalarFieldContainer[str]
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    def __init__(self, target_model: _Optional[str] = ..., draft_model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., max_new_tokens_limit: _Optional[int] = ..., strategies: _Optional[_Iterable[str]] = ..., draft_capabilities: _Optional[_Iterable[str]] = ..., target_capabilities: _Optional[_Iterable[str]] = ..., replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ...) -> None: ...

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
