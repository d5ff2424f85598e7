from specwire.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoreKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCORE_KIND_UNSPECIFIED: _ClassVar[ScoreKind]
    SCORE_KIND_ARGMAX: _ClassVar[ScoreKind]
    SCORE_KIND_PROBS: _ClassVar[ScoreKind]
    SCORE_KIND_LOGPROBS: _ClassVar[ScoreKind]
    SCORE_KIND_LOGITS: _ClassVar[ScoreKind]
SCORE_KIND_UNSPECIFIED: ScoreKind
SCORE_KIND_ARGMAX: ScoreKind
SCORE_KIND_PROBS: ScoreKind
SCORE_KIND_LOGPROBS: ScoreKind
SCORE_KIND_LOGITS: ScoreKind

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_name", "vocab_size", "tokenizer_fingerprint", "eos_token_ids", "max_context", "capabilities", "role", "tokenizer_source", "device", "dtype", "cache", "medusa_heads", "forward_costs", "decode_ms_per_token", "startup", "quantization", "compiled", "compiling", "medusa_choices")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_SOURCE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    MEDUSA_HEADS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_COSTS_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    STARTUP_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    COMPILED_FIELD_NUMBER: _ClassVar[int]
    COMPILING_FIELD_NUMBER: _ClassVar[int]
    MEDUSA_CHOICES_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    vocab_size: int
    tokenizer_fingerprint: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_context: int
    capabilities: _containers.RepeatedScalarFieldContainer[str]
    role: str
    tokenizer_source: str
    device: str
    dtype: str
    cache: CacheInfo
    medusa_heads: int
    forward_costs: _containers.RepeatedCompositeFieldContainer[_common_pb2.ForwardCost]
    decode_ms_per_token: float
    startup: _common_pb2.StartupTimes
    quantization: str
    compiled: bool
    compiling: bool
    medusa_choices: str
    def __init__(self, model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_context: _Optional[int] = ..., capabilities: _Optional[_Iterable[str]] = ..., role: _Optional[str] = ..., tokenizer_source: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., cache: _Optional[_Union[CacheInfo, _Mapping]] = ..., medusa_heads: _Optional[int] = ..., forward_costs: _Optional[_Iterable[_Union[_common_pb2.ForwardCost, _Mapping]]] = ..., decode_ms_per_token: _Optional[float] = ..., startup: _Optional[_Union[_common_pb2.StartupTimes, _Mapping]] = ..., quantization: _Optional[str] = ..., compiled: _Optional[bool] = ..., compiling: _Optional[bool] = ..., medusa_choices: _Optional[str] = ...) -> None: ...

class CacheInfo(_message.Message):
    __slots__ = ("rows", "rows_in_use", "max_len", "tokens_in_use", "bytes_in_use", "bytes_total", "sessions_waiting", "rows_kept", "prefix_reused_tokens")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    ROWS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    MAX_LEN_FIELD_NUMBER: _ClassVar[int]
    TOKENS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_USE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_WAITING_FIELD_NUMBER: _ClassVar[int]
    ROWS_KEPT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    rows: int
    rows_in_use: int
    max_len: int
    tokens_in_use: int
    bytes_in_use: int
    bytes_total: int
    sessions_waiting: int
    rows_kept: int
    prefix_reused_tokens: int
    def __init__(self, rows: _Optional[int] = ..., rows_in_use: _Optional[int] = ..., max_len: _Optional[int] = ..., tokens_in_use: _Optional[int] = ..., bytes_in_use: _Optional[int] = ..., bytes_total: _Optional[int] = ..., sessions_waiting: _Optional[int] = ..., rows_kept: _Optional[int] = ..., prefix_reused_tokens: _Optional[int] = ...) -> None: ...

class ProcessingConfig(_message.Message):
    __slots__ = ("repetition_penalty", "no_repeat_ngram_size", "temperature", "top_k", "top_p", "min_p", "min_tokens_to_keep")
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    NO_REPEAT_NGRAM_SIZE_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_TO_KEEP_FIELD_NUMBER: _ClassVar[int]
    repetition_penalty: float
    no_repeat_ngram_size: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    min_tokens_to_keep: int
    def __init__(self, repetition_penalty: _Optional[float] = ..., no_repeat_ngram_size: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., min_tokens_to_keep: _Optional[int] = ...) -> None: ...

class ExtraOutputs(_message.Message):
    __slots__ = ("entropy", "varentropy", "attention_stats")
    ENTROPY_FIELD_NUMBER: _ClassVar[int]
    VARENTROPY_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_STATS_FIELD_NUMBER: _ClassVar[int]
    entropy: bool
    varentropy: bool
    attention_stats: bool
    def __init__(self, entropy: _Optional[bool] = ..., varentropy: _Optional[bool] = ..., attention_stats: _Optional[bool] = ...) -> None: ...

class Open(_message.Message):
    __slots__ = ("prompt_ids", "processing", "num_branches", "scoring", "trace")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PROCESSING_FIELD_NUMBER: _ClassVar[int]
    NUM_BRANCHES_FIELD_NUMBER: _ClassVar[int]
    SCORING_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    processing: ProcessingConfig
    num_branches: int
    scoring: Scoring
    trace: _common_pb2.TraceContext
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., processing: _Optional[_Union[ProcessingConfig, _Mapping]] = ..., num_branches: _Optional[int] = ..., scoring: _Optional[_Union[Scoring, _Mapping]] = ..., trace: _Optional[_Union[_common_pb2.TraceContext, _Mapping]] = ...) -> None: ...

class Scoring(_message.Message):
    __slots__ = ("kind", "positions", "top_n", "logits_dtype", "extras", "score_ids", "medusa_top_k")
    KIND_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    TOP_N_FIELD_NUMBER: _ClassVar[int]
    LOGITS_DTYPE_FIELD_NUMBER: _ClassVar[int]
    EXTRAS_FIELD_NUMBER: _ClassVar[int]
    SCORE_IDS_FIELD_NUMBER: _ClassVar[int]
    MEDUSA_TOP_K_FIELD_NUMBER: _ClassVar[int]
    kind: ScoreKind
    positions: int
    top_n: int
    logits_dtype: str
    extras: ExtraOutputs
    score_ids: _containers.RepeatedScalarFieldContainer[int]
    medusa_top_k: int
    def __init__(self, kind: _Optional[_Union[ScoreKind, str]] = ..., positions: _Optional[int] = ..., top_n: _Optional[int] = ..., logits_dtype: _Optional[str] = ..., extras: _Optional[_Union[ExtraOutputs, _Mapping]] = ..., score_ids: _Optional[_Iterable[int]] = ..., medusa_top_k: _Optional[int] = ...) -> None: ...

class Step(_message.Message):
    __slots__ = ("keep_tokens", "branch_order", "append_ids", "scoring", "propose", "propose_greedy", "propose_seed", "propose_min_confidence", "tree_parents", "tree_keep", "tree_topk", "verify", "propose_ids_only", "propose_alternatives", "tree_rounds", "tree_max_tokens", "trace")
    KEEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BRANCH_ORDER_FIELD_NUMBER: _ClassVar[int]
    APPEND_IDS_FIELD_NUMBER: _ClassVar[int]
    SCORING_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_GREEDY_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_SEED_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_MIN_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    TREE_PARENTS_FIELD_NUMBER: _ClassVar[int]
    TREE_KEEP_FIELD_NUMBER: _ClassVar[int]
    TREE_TOPK_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_IDS_ONLY_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_ALTERNATIVES_FIELD_NUMBER: _ClassVar[int]
    TREE_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    TREE_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    keep_tokens: int
    branch_order: _containers.RepeatedScalarFieldContainer[int]
    append_ids: _containers.RepeatedScalarFieldContainer[int]
    scoring: Scoring
    propose: int
    propose_greedy: bool
    propose_seed: int
    propose_min_confidence: float
    tree_parents: _containers.RepeatedScalarFieldContainer[int]
    tree_keep: _containers.RepeatedScalarFieldContainer[int]
    tree_topk: _containers.RepeatedScalarFieldContainer[int]
    verify: Verify
    propose_ids_only: bool
    propose_alternatives: int
    tree_rounds: int
    tree_max_tokens: int
    trace: _common_pb2.TraceContext
    def __init__(self, keep_tokens: _Optional[int] = ..., branch_order: _Optional[_Iterable[int]] = ..., append_ids: _Optional[_Iterable[int]] = ..., scoring: _Optional[_Union[Scoring, _Mapping]] = ..., propose: _Optional[int] = ..., propose_greedy: _Optional[bool] = ..., propose_seed: _Optional[int] = ..., propose_min_confidence: _Optional[float] = ..., tree_parents: _Optional[_Iterable[int]] = ..., tree_keep: _Optional[_Iterable[int]] = ..., tree_topk: _Optional[_Iterable[int]] = ..., verify: _Optional[_Union[Verify, _Mapping]] = ..., propose_ids_only: _Optional[bool] = ..., propose_alternatives: _Optional[int] = ..., tree_rounds: _Optional[int] = ..., tree_max_tokens: _Optional[int] = ..., trace: _Optional[_Union[_common_pb2.TraceContext, _Mapping]] = ...) -> None: ...

class Verify(_message.Message):
    __slots__ = ("draft_probs", "seed")
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    draft_probs: Scores
    seed: int
    def __init__(self, draft_probs: _Optional[_Union[Scores, _Mapping]] = ..., seed: _Optional[int] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("accepted_length", "next_token", "tree_path", "tree_nodes")
    ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TREE_PATH_FIELD_NUMBER: _ClassVar[int]
    TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    accepted_length: int
    next_token: int
    tree_path: _containers.RepeatedScalarFieldContainer[int]
    tree_nodes: int
    def __init__(self, accepted_length: _Optional[int] = ..., next_token: _Optional[int] = ..., tree_path: _Optional[_Iterable[int]] = ..., tree_nodes: _Optional[int] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("open", "step")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    open: Open
    step: Step
    def __init__(self, open: _Optional[_Union[Open, _Mapping]] = ..., step: _Optional[_Union[Step, _Mapping]] = ...) -> None: ...

class Scores(_message.Message):
    __slots__ = ("kind", "argmax_ids", "dense", "sparse_ids", "sparse_values", "entropy", "varentropy", "attention_entropy", "attention_varentropy", "agreement", "interaction_strength")
    KIND_FIELD_NUMBER: _ClassVar[int]
    ARGMAX_IDS_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    SPARSE_IDS_FIELD_NUMBER: _ClassVar[int]
    SPARSE_VALUES_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_FIELD_NUMBER: _ClassVar[int]
    VARENTROPY_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_ENTROPY_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_VARENTROPY_FIELD_NUMBER: _ClassVar[int]
    AGREEMENT_FIELD_NUMBER: _ClassVar[int]
    INTERACTION_STRENGTH_FIELD_NUMBER: _ClassVar[int]
    kind: ScoreKind
    argmax_ids: _common_pb2.Tensor
    dense: _common_pb2.Tensor
    sparse_ids: _common_pb2.Tensor
    sparse_values: _common_pb2.Tensor
    entropy: _common_pb2.Tensor
    varentropy: _common_pb2.Tensor
    attention_entropy: _common_pb2.Tensor
    attention_varentropy: _common_pb2.Tensor
    agreement: _common_pb2.Tensor
    interaction_strength: _common_pb2.Tensor
    def __init__(self, kind: _Optional[_Union[ScoreKind, str]] = ..., argmax_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., dense: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., sparse_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., sparse_values: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., entropy: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., varentropy: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., attention_entropy: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., attention_varentropy: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., agreement: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., interaction_strength: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class SessionReply(_message.Message):
    __slots__ = ("scores", "proposed_ids", "proposal_scores", "num_tokens", "timing", "medusa_ids", "tree_ids", "verdict", "round_verdicts", "alternative_ids")
    SCORES_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_IDS_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_SCORES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    MEDUSA_IDS_FIELD_NUMBER: _ClassVar[int]
    TREE_IDS_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    ROUND_VERDICTS_FIELD_NUMBER: _ClassVar[int]
    ALTERNATIVE_IDS_FIELD_NUMBER: _ClassVar[int]
    scores: Scores
    proposed_ids: _common_pb2.Tensor
    proposal_scores: Scores
    num_tokens: int
    timing: _common_pb2.ServerTiming
    medusa_ids: _common_pb2.Tensor
    tree_ids: _common_pb2.Tensor
    verdict: Verdict
    round_verdicts: _containers.RepeatedCompositeFieldContainer[Verdict]
    alternative_ids: _common_pb2.Tensor
    def __init__(self, scores: _Optional[_Union[Scores, _Mapping]] = ..., proposed_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., proposal_scores: _Optional[_Union[Scores, _Mapping]] = ..., num_tokens: _Optional[int] = ..., timing: _Optional[_Union[_common_pb2.ServerTiming, _Mapping]] = ..., medusa_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., tree_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., verdict: _Optional[_Union[Verdict, _Mapping]] = ..., round_verdicts: _Optional[_Iterable[_Union[Verdict, _Mapping]]] = ..., alternative_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...
