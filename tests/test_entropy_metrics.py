"""Entropix's metrics from the engine — the batched lean forward (cached keys in the slot cache)
and the transformers path (a probe on sdpa or eager attention) — equal a full eager forward's,
computed by hand."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from specwire.engine import CausalLM, Engine, EngineLimits
from specwire.entropy_metrics import attention_stats, token_entropy
from specwire.session import Extras, OpenRequest, ScoreKind, Scoring, StepRequest

EXTRAS = Extras(entropy=True, varentropy=True, attention_stats=True)
PROMPT = [5, 17, 42, 8, 99, 23, 61, 7, 150, 3, 77]
# Longer than one prefill chunk (`specwire.engine.scheduler.PREFILL_CHUNK`): the scores come from chunks.
LONG_PROMPT = [(13 * i + 5) % 300 for i in range(70)]


def eager_model(path: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()


def last_layer_scores(model: Any, ids: torch.Tensor, hidden: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Pre-softmax scores of the last layer, by hand from its input hidden states: [heads, q, k]."""
    h = hidden[-2]  # input of the last layer: [1, seq, hidden]
    if hasattr(model, "transformer"):  # GPT-2: no rotary, fused qkv
        block = model.transformer.h[-1]
        q, k, _ = block.attn.c_attn(block.ln_1(h)).split(block.attn.split_size, dim=2)
        heads, dim = block.attn.num_heads, block.attn.head_dim
        q = q.view(1, -1, heads, dim).transpose(1, 2)
        k = k.view(1, -1, heads, dim).transpose(1, 2)
    else:  # Llama: rotary, grouped key heads
        layer = model.model.layers[-1]
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        dim = attn.head_dim
        q = attn.q_proj(x).view(1, x.shape[1], -1, dim).transpose(1, 2)
        k = attn.k_proj(x).view(1, x.shape[1], -1, dim).transpose(1, 2)
        cos, sin = model.model.rotary_emb(h, torch.arange(ids.shape[1]).unsqueeze(0))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return (q @ k.transpose(-1, -2))[0] / math.sqrt(dim)  # [heads, seq, seq]


def reference_metrics(model: Any, ids: list[int]) -> dict[str, list[float]]:
    """Every metric at every position, from one eager forward, in float64 and plain loops."""
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        out = model(input_ids, output_attentions=True, output_hidden_states=True)
        scores = last_layer_scores(model, input_ids, out.hidden_states).double()
    eager_probs = out.attentions[-1][0].double()  # [heads, seq, seq]
    metrics: dict[str, list[float]] = {name: [] for name in ("entropy", "varentropy", "attn_entropy", "attn_varentropy", "agreement", "interaction")}
    for i in range(len(ids)):
        p = out.logits[0, i].double().softmax(-1)
        entropy = float(-(p * p.log2()).sum())
        metrics["entropy"].append(entropy)
        metrics["varentropy"].append(float((p * (p.log2() + entropy) ** 2).sum()))
        s = scores[:, i, : i + 1]  # causal context: keys 0..i
        a = s.softmax(-1)
        assert torch.allclose(a, eager_probs[:, i, : i + 1], atol=1e-5)  # the hand-made scores are the model's
        head_h = [float(-(a[h] * a[h].log2()).sum()) for h in range(a.shape[0])]
        mean_h = sum(head_h) / len(head_h)
        metrics["attn_entropy"].append(mean_h)
        metrics["attn_varentropy"].append(sum((x - mean_h) ** 2 for x in head_h) / len(head_h))
        metrics["agreement"].append(float((a - a.mean(0)).abs().mean()))
        metrics["interaction"].append(float(s.abs().mean()))
    return metrics


def as_lists(session_scores: Any) -> dict[str, list[float]]:
    m = session_scores.metrics
    a = m.attention
    return {
        "entropy": m.entropy.tolist(),
        "varentropy": m.varentropy.tolist(),
        "attn_entropy": a.entropy.tolist(),
        "attn_varentropy": a.varentropy.tolist(),
        "agreement": a.agreement.tolist(),
        "interaction": a.interaction_strength.tolist(),
    }


def assert_close(got: dict[str, list[float]], want: dict[str, list[float]], positions: slice) -> None:
    for name, values in got.items():
        expected = want[name][positions]
        assert len(values) == len(expected), name
        for g, w in zip(values, expected, strict=True):
            assert abs(g - w) <= 1e-4 * max(1.0, abs(w)), (name, g, w)


def engine_of(path: Path, engine: str, kernel: str = "sdpa") -> Engine:
    """"lean": the batched lean forward over a slot cache; "hf": transformers' forward with `kernel`."""
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation=kernel)
    lm = CausalLM.from_model(model, None, str(path))
    assert lm.model.config._attn_implementation == kernel
    limits = EngineLimits(max_batch_rows=2, max_cache_len=128) if engine == "lean" else EngineLimits(batching=False)
    served = Engine(lm, "target", limits)
    assert served.batches == (engine == "lean")
    return served


@pytest.mark.parametrize(
    ("model_dir", "engine", "kernel"),
    [
        ("llama_target_dir", "lean", "sdpa"),
        ("gpt2_target_dir", "lean", "sdpa"),
        ("llama_target_dir", "hf", "sdpa"),
        ("llama_target_dir", "hf", "eager"),
        ("gpt2_target_dir", "hf", "sdpa"),
    ],
)
def test_engine_metrics_equal_an_eager_forward(model_dir: str, engine: str, kernel: str,
                                               request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(model_dir)
    appended = [12, 200, 31]
    want = reference_metrics(eager_model(path), PROMPT + appended)
    session = engine_of(path, engine, kernel).new_session()
    scoring = Scoring(ScoreKind.LOGITS, positions=4, top_n=8, extras=EXTRAS)
    opened = session.open(OpenRequest(PROMPT, scoring=scoring))  # prefill: the prompt's last 4 positions
    assert_close(as_lists(opened.scores), want, slice(len(PROMPT) - 4, len(PROMPT)))
    # Decode steps against cached keys, one position and then several.
    one = session.step(StepRequest(append_ids=appended[:1], scoring=Scoring(ScoreKind.ARGMAX, extras=EXTRAS)))
    assert_close(as_lists(one.scores), want, slice(len(PROMPT), len(PROMPT) + 1))
    two = session.step(StepRequest(append_ids=appended[1:], scoring=Scoring(ScoreKind.PROBS, positions=2, extras=EXTRAS)))
    assert_close(as_lists(two.scores), want, slice(len(PROMPT) + 1, len(PROMPT) + 3))
    # A roll-back re-scores cached positions.
    back = session.step(StepRequest(keep_tokens=len(PROMPT) + 1, scoring=Scoring(ScoreKind.ARGMAX, extras=EXTRAS)))
    assert_close(as_lists(back.scores), want, slice(len(PROMPT), len(PROMPT) + 1))
    session.close()


def test_lean_metrics_of_a_chunked_prefill_and_of_each_branch(llama_target_dir: Path) -> None:
    """A prompt longer than a prefill chunk, scored at positions spanning two chunks; then two
    branches decoding different tokens: every row's metrics are its own sequence's."""
    eager = eager_model(llama_target_dir)
    lean = engine_of(llama_target_dir, "lean")
    session = lean.new_session()
    opened = session.open(OpenRequest(LONG_PROMPT, scoring=Scoring(ScoreKind.ARGMAX, positions=8, extras=EXTRAS)))
    want = reference_metrics(eager, LONG_PROMPT)
    assert_close(as_lists(opened.scores), want, slice(len(LONG_PROMPT) - 8, len(LONG_PROMPT)))
    session.close()
    branches = lean.new_session()
    branches.open(OpenRequest(PROMPT, num_branches=2, scoring=Scoring(ScoreKind.NONE)))
    stepped = branches.step(StepRequest(append_ids=[12, 31], scoring=Scoring(ScoreKind.ARGMAX, extras=EXTRAS)))
    got = as_lists(stepped.scores)
    for row, token in enumerate([12, 31]):
        expected = reference_metrics(eager, PROMPT + [token])
        assert_close({name: values[row : row + 1] for name, values in got.items()}, expected, slice(-1, None))
    branches.close()


def test_no_extras_no_metrics(llama_target_dir: Path) -> None:
    session = engine_of(llama_target_dir, "lean").new_session()
    result = session.open(OpenRequest(PROMPT, scoring=Scoring(ScoreKind.ARGMAX)))
    assert result.scores is not None and result.scores.metrics is None
    only_entropy = session.step(StepRequest(append_ids=[4], scoring=Scoring(ScoreKind.ARGMAX, extras=Extras(entropy=True))))
    assert only_entropy.scores is not None and only_entropy.scores.metrics is not None
    assert only_entropy.scores.metrics.attention is None


def test_token_entropy_known_values() -> None:
    uniform = torch.zeros(1, 8)
    entropy, varentropy = token_entropy(uniform)
    assert entropy.item() == pytest.approx(3.0) and varentropy.item() == pytest.approx(0.0, abs=1e-6)
    # p = (1/2, 1/4, 1/4): H = 1.5 bits; V = ½(−1+1.5)² + ½(−2+1.5)² = 0.25.
    entropy, varentropy = token_entropy(torch.tensor([[2.0, 1.0, 1.0]]).log() + 3.0)
    assert entropy.item() == pytest.approx(1.5, abs=1e-6) and varentropy.item() == pytest.approx(0.25, abs=1e-6)
    # A masked id (−inf) contributes nothing.
    entropy, _ = token_entropy(torch.tensor([[0.0, 0.0, float("-inf")]]))
    assert entropy.item() == pytest.approx(1.0)


def test_attention_stats_ignore_invalid_keys() -> None:
    scores = torch.tensor([[[1.0, 1.0, 50.0], [1.0, 1.0, -50.0]]])  # [1 row, 2 heads, 3 keys]
    stats = attention_stats(scores, torch.tensor([[True, True, False]]))
    assert stats.entropy.item() == pytest.approx(1.0)  # both heads uniform over the 2 real keys
    assert stats.varentropy.item() == pytest.approx(0.0) and stats.agreement.item() == pytest.approx(0.0)
    assert stats.interaction_strength.item() == pytest.approx(1.0)
