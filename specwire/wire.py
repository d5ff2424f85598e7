"""The protobuf boundary: tensors as raw little-endian bytes, messages ↔ dataclasses.

Every conversion between generated message classes and specwire's own types happens here, once,
at the edge of each process (STYLE.md). Tensors cost one copy each way: `tobytes()` out,
`torch.frombuffer` in — no per-element loops.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch

from specwire.entropy_metrics import AttentionStats, PositionMetrics
from specwire.errors import InvalidArgument
from specwire.processing import ProcessingConfig
from specwire.session import (
    CacheUsage,
    Extras,
    ModelInfo,
    OpenRequest,
    ScoreKind,
    Scores,
    Scoring,
    ServerTiming,
    StepRequest,
    StepResult,
    Verdict,
    Verification,
)
from specwire.startup import StartupTimes
from specwire.v1 import common_pb2, model_pb2

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_ITEM_SIZES = {name: torch.empty((), dtype=dtype).element_size() for name, dtype in _DTYPES.items()}


def tensor_to_pb(tensor: torch.Tensor) -> common_pb2.Tensor:
    """Encode a tensor (any device) as raw little-endian bytes with dtype and shape."""
    name = _DTYPE_NAMES.get(tensor.dtype)
    if name is None:
        raise ValueError(f"dtype {tensor.dtype} has no wire form")
    cpu = tensor.detach().to("cpu").contiguous()
    # bfloat16 has no numpy dtype: ship its bits as int16.
    raw = cpu.view(torch.int16) if cpu.dtype == torch.bfloat16 else cpu
    return common_pb2.Tensor(dtype=name, shape=list(cpu.shape), data=raw.numpy().tobytes())


def tensor_from_pb(message: common_pb2.Tensor) -> torch.Tensor:
    """Decode a wire tensor without copying element by element. Raises ValueError if malformed."""
    dtype = _DTYPES.get(message.dtype)
    if dtype is None:
        raise ValueError(f"unknown tensor dtype {message.dtype!r}")
    shape = tuple(int(d) for d in message.shape)
    count = 1
    for dim in shape:
        count *= dim
    item = _ITEM_SIZES[message.dtype]
    if len(message.data) != count * item:
        raise ValueError(f"tensor data has {len(message.data)} bytes, shape {shape} needs {count * item}")
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    # bytearray: frombuffer wants a writable buffer and the message's bytes are immutable.
    flat = torch.frombuffer(bytearray(message.data), dtype=dtype)
    return flat.reshape(shape)


def _optional_tensor(message: model_pb2.Scores, name: str) -> torch.Tensor | None:
    return tensor_from_pb(getattr(message, name)) if message.HasField(name) else None


def _metrics_tensors(metrics: PositionMetrics) -> dict[str, torch.Tensor]:
    """The `Scores` extras fields by name, each [rows] float32."""
    tensors = {"entropy": metrics.entropy, "varentropy": metrics.varentropy}
    if metrics.attention is not None:
        attention = metrics.attention
        tensors["attention_entropy"] = attention.entropy
        tensors["attention_varentropy"] = attention.varentropy
        tensors["agreement"] = attention.agreement
        tensors["interaction_strength"] = attention.interaction_strength
    return {name: tensor.float() for name, tensor in tensors.items()}


def _metrics_from_pb(message: model_pb2.Scores) -> PositionMetrics | None:
    if not message.HasField("entropy"):
        return None
    attention = None
    if message.HasField("attention_entropy"):
        attention = AttentionStats(
            entropy=tensor_from_pb(message.attention_entropy),
            varentropy=tensor_from_pb(message.attention_varentropy),
            agreement=tensor_from_pb(message.agreement),
            interaction_strength=tensor_from_pb(message.interaction_strength),
        )
    return PositionMetrics(tensor_from_pb(message.entropy), tensor_from_pb(message.varentropy), attention)


def scores_to_pb(scores: Scores) -> model_pb2.Scores:
    message = model_pb2.Scores(kind=cast(model_pb2.ScoreKind, int(scores.kind)))
    for name in ("argmax_ids", "dense", "sparse_ids", "sparse_values"):
        tensor = getattr(scores, name)
        if tensor is not None:
            getattr(message, name).CopyFrom(tensor_to_pb(tensor))
    if scores.metrics is not None:
        for name, tensor in _metrics_tensors(scores.metrics).items():
            getattr(message, name).CopyFrom(tensor_to_pb(tensor))
    return message


def scores_from_pb(message: model_pb2.Scores) -> Scores:
    return Scores(
        kind=ScoreKind(message.kind),
        argmax_ids=_optional_tensor(message, "argmax_ids"),
        dense=_optional_tensor(message, "dense"),
        sparse_ids=_optional_tensor(message, "sparse_ids"),
        sparse_values=_optional_tensor(message, "sparse_values"),
        metrics=_metrics_from_pb(message),
    )


def processing_to_pb(config: ProcessingConfig) -> model_pb2.ProcessingConfig:
    return model_pb2.ProcessingConfig(
        repetition_penalty=config.repetition_penalty,
        no_repeat_ngram_size=config.no_repeat_ngram_size,
        temperature=config.temperature,
        top_k=config.top_k,
        top_p=config.top_p,
        min_p=config.min_p,
        min_tokens_to_keep=config.min_tokens_to_keep,
    )


def processing_from_pb(message: model_pb2.ProcessingConfig) -> ProcessingConfig:
    return ProcessingConfig(
        repetition_penalty=message.repetition_penalty,
        no_repeat_ngram_size=message.no_repeat_ngram_size,
        temperature=message.temperature,
        top_k=message.top_k,
        top_p=message.top_p,
        min_p=message.min_p,
        min_tokens_to_keep=max(1, message.min_tokens_to_keep),
    )


def scoring_to_pb(scoring: Scoring) -> model_pb2.Scoring:
    return model_pb2.Scoring(
        kind=cast(model_pb2.ScoreKind, int(scoring.kind)),
        positions=scoring.positions,
        top_n=scoring.top_n,
        logits_dtype=scoring.logits_dtype,
        score_ids=scoring.score_ids,
        medusa_top_k=scoring.medusa_top_k,
        extras=model_pb2.ExtraOutputs(
            entropy=scoring.extras.entropy,
            varentropy=scoring.extras.varentropy,
            attention_stats=scoring.extras.attention_stats,
        ),
    )


def scoring_from_pb(message: model_pb2.Scoring) -> Scoring:
    return Scoring(
        kind=ScoreKind(message.kind),
        positions=message.positions or 1,
        top_n=message.top_n,
        logits_dtype=message.logits_dtype or "float32",
        score_ids=tuple(message.score_ids),
        medusa_top_k=message.medusa_top_k,
        extras=Extras(message.extras.entropy, message.extras.varentropy, message.extras.attention_stats),
    )


def _trace_to_pb(trace: dict[str, str] | None) -> common_pb2.TraceContext | None:
    if not trace:
        return None
    return common_pb2.TraceContext(
        traceparent=trace.get("traceparent", ""), tracestate=trace.get("tracestate", "")
    )


def _trace_from_pb(message: common_pb2.TraceContext) -> dict[str, str] | None:
    if not message.traceparent:
        return None
    carrier = {"traceparent": message.traceparent}
    if message.tracestate:
        carrier["tracestate"] = message.tracestate
    return carrier


def open_to_pb(request: OpenRequest) -> model_pb2.SessionRequest:
    message = model_pb2.Open(
        prompt_ids=request.prompt_ids,
        processing=processing_to_pb(request.processing),
        num_branches=request.num_branches,
        scoring=scoring_to_pb(request.scoring),
        trace=_trace_to_pb(request.trace),
    )
    return model_pb2.SessionRequest(open=message)


def step_to_pb(request: StepRequest) -> model_pb2.SessionRequest:
    message = model_pb2.Step(
        branch_order=request.branch_order,
        append_ids=request.append_ids,
        scoring=scoring_to_pb(request.scoring),
        propose=request.propose,
        propose_greedy=request.propose_greedy,
        propose_seed=request.propose_seed,
        propose_min_confidence=request.propose_min_confidence,
        tree_parents=request.tree_parents,
        tree_keep=request.tree_keep,
        tree_topk=request.tree_topk,
        propose_ids_only=request.propose_ids_only,
        propose_alternatives=request.propose_alternatives,
        tree_rounds=request.tree_rounds,
        tree_max_tokens=request.tree_max_tokens,
        trace=_trace_to_pb(request.trace),
    )
    if request.keep_tokens is not None:
        message.keep_tokens = request.keep_tokens
    if request.verify is not None:
        message.verify.draft_probs.CopyFrom(scores_to_pb(request.verify.draft_probs))
        message.verify.seed = request.verify.seed
    return model_pb2.SessionRequest(step=message)


def open_from_pb(message: model_pb2.Open) -> OpenRequest:
    return OpenRequest(
        prompt_ids=list(message.prompt_ids),
        processing=processing_from_pb(message.processing),
        num_branches=message.num_branches or 1,
        scoring=scoring_from_pb(message.scoring),
        trace=_trace_from_pb(message.trace),
    )


def step_from_pb(message: model_pb2.Step) -> StepRequest:
    return StepRequest(
        keep_tokens=message.keep_tokens if message.HasField("keep_tokens") else None,
        branch_order=list(message.branch_order),
        append_ids=list(message.append_ids),
        scoring=scoring_from_pb(message.scoring),
        propose=message.propose,
        propose_greedy=message.propose_greedy,
        propose_seed=message.propose_seed,
        propose_min_confidence=message.propose_min_confidence,
        tree_parents=list(message.tree_parents),
        tree_keep=list(message.tree_keep),
        tree_topk=list(message.tree_topk),
        verify=_verification_from_pb(message.verify) if message.HasField("verify") else None,
        propose_ids_only=message.propose_ids_only,
        propose_alternatives=message.propose_alternatives,
        tree_rounds=message.tree_rounds,
        tree_max_tokens=message.tree_max_tokens,
        trace=_trace_from_pb(message.trace),
    )


def _verification_from_pb(message: model_pb2.Verify) -> Verification:
    try:
        draft_probs = scores_from_pb(message.draft_probs)
    except ValueError as error:  # a malformed tensor or an unknown kind
        raise InvalidArgument("verify.draft_probs", str(error)) from None
    return Verification(draft_probs, message.seed)


def _costs_to_pb(costs: list[tuple[int, float]]) -> list[common_pb2.ForwardCost]:
    return [common_pb2.ForwardCost(positions=n, ms=ms) for n, ms in costs]


def _costs_from_pb(costs: Iterable[common_pb2.ForwardCost]) -> list[tuple[int, float]]:
    return [(cost.positions, cost.ms) for cost in costs]


def result_to_pb(result: StepResult) -> model_pb2.SessionReply:
    reply = model_pb2.SessionReply(
        num_tokens=result.num_tokens,
        timing=common_pb2.ServerTiming(
            queue_us=result.timing.queue_us,
            compute_us=result.timing.compute_us,
            forward_calls=result.timing.forward_calls,
            batch_rows=result.timing.batch_rows,
            batch_costs=_costs_to_pb(result.timing.batch_costs),
            one_row_costs=_costs_to_pb(result.timing.one_row_costs),
        ),
    )
    if result.scores is not None:
        reply.scores.CopyFrom(scores_to_pb(result.scores))
    if result.proposed_ids is not None:
        reply.proposed_ids.CopyFrom(tensor_to_pb(result.proposed_ids.to(torch.int32)))
    if result.proposal_scores is not None:
        reply.proposal_scores.CopyFrom(scores_to_pb(result.proposal_scores))
    if result.medusa_ids is not None:
        reply.medusa_ids.CopyFrom(tensor_to_pb(result.medusa_ids.to(torch.int32)))
    if result.tree_ids is not None:
        reply.tree_ids.CopyFrom(tensor_to_pb(result.tree_ids.to(torch.int32)))
    if result.alternative_ids is not None:
        reply.alternative_ids.CopyFrom(tensor_to_pb(result.alternative_ids.to(torch.int32)))
    if result.verdict is not None:
        reply.verdict.CopyFrom(_verdict_to_pb(result.verdict))
    reply.round_verdicts.extend(_verdict_to_pb(verdict) for verdict in result.round_verdicts)
    return reply


def _verdict_to_pb(verdict: Verdict) -> model_pb2.Verdict:
    return model_pb2.Verdict(
        accepted_length=verdict.accepted_len,
        next_token=verdict.next_token,
        tree_path=verdict.tree_path,
        tree_nodes=verdict.tree_nodes,
    )


def _verdict_from_pb(message: model_pb2.Verdict) -> Verdict:
    return Verdict(message.accepted_length, message.next_token, tuple(message.tree_path), message.tree_nodes)


def result_from_pb(reply: model_pb2.SessionReply) -> StepResult:
    return StepResult(
        scores=scores_from_pb(reply.scores) if reply.HasField("scores") else None,
        proposed_ids=tensor_from_pb(reply.proposed_ids) if reply.HasField("proposed_ids") else None,
        proposal_scores=scores_from_pb(reply.proposal_scores) if reply.HasField("proposal_scores") else None,
        num_tokens=reply.num_tokens,
        medusa_ids=tensor_from_pb(reply.medusa_ids) if reply.HasField("medusa_ids") else None,
        tree_ids=tensor_from_pb(reply.tree_ids) if reply.HasField("tree_ids") else None,
        alternative_ids=tensor_from_pb(reply.alternative_ids) if reply.HasField("alternative_ids") else None,
        verdict=_verdict_from_pb(reply.verdict) if reply.HasField("verdict") else None,
        round_verdicts=[_verdict_from_pb(verdict) for verdict in reply.round_verdicts],
        timing=ServerTiming(
            queue_us=reply.timing.queue_us,
            compute_us=reply.timing.compute_us,
            forward_calls=reply.timing.forward_calls,
            batch_rows=reply.timing.batch_rows,
            batch_costs=_costs_from_pb(reply.timing.batch_costs),
            one_row_costs=_costs_from_pb(reply.timing.one_row_costs),
        ),
    )


def info_to_pb(info: ModelInfo) -> model_pb2.ModelInfo:
    return model_pb2.ModelInfo(
        model_name=info.model_name,
        vocab_size=info.vocab_size,
        tokenizer_fingerprint=info.tokenizer_fingerprint,
        eos_token_ids=info.eos_token_ids,
        max_context=info.max_context,
        capabilities=info.capabilities,
        role=info.role,
        tokenizer_source=info.tokenizer_source,
        device=info.device,
        dtype=info.dtype,
        medusa_heads=info.medusa_heads,
        cache=cache_to_pb(info.cache) if info.cache is not None else None,
        forward_costs=_costs_to_pb(info.forward_costs),
        decode_ms_per_token=info.decode_ms_per_token,
        quantization=info.quantization,
        compiled=info.compiled,
        compiling=info.compiling,
        medusa_choices=info.medusa_choices,
    )


def startup_to_pb(times: StartupTimes) -> common_pb2.StartupTimes:
    phases = [common_pb2.StartupPhase(name=name, seconds=seconds) for name, seconds in times.phases]
    return common_pb2.StartupTimes(serving_s=times.serving_s, phases=phases)


def cache_to_pb(usage: CacheUsage) -> model_pb2.CacheInfo:
    return model_pb2.CacheInfo(
        rows=usage.rows,
        rows_in_use=usage.rows_in_use,
        max_len=usage.max_len,
        tokens_in_use=usage.tokens_in_use,
        bytes_in_use=usage.bytes_in_use,
        bytes_total=usage.bytes_total,
        sessions_waiting=usage.waiting,
        rows_kept=usage.rows_kept,
        prefix_reused_tokens=usage.reused_tokens,
    )


def info_from_pb(message: model_pb2.ModelInfo) -> ModelInfo:
    return ModelInfo(
        model_name=message.model_name,
        vocab_size=message.vocab_size,
        tokenizer_fingerprint=message.tokenizer_fingerprint,
        eos_token_ids=list(message.eos_token_ids),
        max_context=message.max_context,
        capabilities=list(message.capabilities),
        role=message.role,
        tokenizer_source=message.tokenizer_source,
        device=message.device,
        dtype=message.dtype,
        medusa_heads=message.medusa_heads,
        cache=cache_from_pb(message.cache) if message.HasField("cache") else None,
        forward_costs=_costs_from_pb(message.forward_costs),
        decode_ms_per_token=message.decode_ms_per_token,
        quantization=message.quantization or "none",
        compiled=message.compiled,
        compiling=message.compiling,
        medusa_choices=message.medusa_choices,
    )


def cache_from_pb(message: model_pb2.CacheInfo) -> CacheUsage:
    return CacheUsage(
        rows=message.rows,
        rows_in_use=message.rows_in_use,
        max_len=message.max_len,
        tokens_in_use=message.tokens_in_use,
        bytes_in_use=message.bytes_in_use,
        bytes_total=message.bytes_total,
        waiting=message.sessions_waiting,
        rows_kept=message.rows_kept,
        reused_tokens=message.prefix_reused_tokens,
    )
