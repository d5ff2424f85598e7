"""Gemma-3-270M with a trimmed-vocabulary draft keeps its own distribution when sampled
(Leviathan et al. 2023, Theorem 1), where much of its mass lies on ids the draft cannot propose.

Runs where Gemma has been prepared (`specwire models fetch gemma-3-270m`; SPECWIRE_GEMMA_DIR),
skips elsewhere. The draft is the one `specwire pair gemma-3-270m` built beside the target when
there is one, else a fresh (untrained) draft over the ids most frequent in a few standard-library
files: exactness holds for any q. 800 seeded generations at top-k 20, γ = 2: the first token and
the second token's marginal pass the chi-square test against Gemma's own distributions; with an
acceptance rule that keeps every draft token, the same test fails.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from specwire.draft_service.scratch import DraftShape, new_draft
from transformers import AutoConfig, AutoTokenizer

from specwire.acceptance import accept_draft
from specwire.demo import train_pair
from specwire.engine import EngineLimits
from specwire.engine import session as engine_session
from specwire.engine.trimmed_vocab import TrimmedVocab
from specwire.processing import ProcessingConfig, sampling_probs
from specwire.sparse_distill import draft_vocabulary
from tests.conftest import gemma_dir, hf_model, make_stack
from tests.goodness_of_fit import chi_square_pvalue
from tests.harness import LoopThread, Stack
from tests.test_losslessness import ALPHA, _first_tokens

pytestmark = [
    pytest.mark.skipif(gemma_dir() is None, reason="Gemma-3-270M not prepared (specwire models fetch gemma-3-270m)"),
    pytest.mark.timeout(1800),
]

PROMPT = "The capital of Japan is"  # " Tokyo" and many likely words lie outside a code-trained draft's ids
TOP_K = 20
SAMPLES = 800


@pytest.fixture(scope="module")
def gemma() -> Path:
    path = gemma_dir()
    assert path is not None
    return path


@pytest.fixture(scope="module")
def trimmed_draft(gemma: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if (gemma / "draft" / "draft_vocab.json").exists():
        return gemma / "draft"
    out = tmp_path_factory.mktemp("gemma-draft")
    tokenizer: Any = AutoTokenizer.from_pretrained(str(gemma))
    config = AutoConfig.from_pretrained(str(gemma))
    texts = [text for _, text in train_pair.load_corpus().train[:40]]
    vocab = draft_vocabulary(train_pair.encode_stream(tokenizer, texts), 4096, config, tokenizer)
    model = new_draft(DraftShape(layers=1, hidden=128, vocab_top=len(vocab.ids)), vocab, config, 1024, seed=0)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    vocab.save(out)
    return out


@pytest.fixture(scope="module")
def gemma_stack(loop: LoopThread, gemma: Path, trimmed_draft: Path) -> Iterator[Stack]:
    rows = EngineLimits(max_batch_rows=32, max_cache_len=64)  # every concurrent generation at once
    stack = make_stack(loop, gemma, trimmed_draft, warm=False, engine_limits=rows, max_new_tokens_limit=16)
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def gemma_marginals(gemma: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma's warped p(x1) and Σ_x1 p(x1) p(x2 | x1) after the prompt: [V] each."""
    model: Any = hf_model(gemma)
    config = ProcessingConfig(top_k=TOP_K)
    prompt = torch.tensor(AutoTokenizer.from_pretrained(str(gemma))(PROMPT).input_ids)
    with torch.no_grad():
        first = sampling_probs(model(prompt[None]).logits[:, -1], prompt[None], config)[0]  # [V]
        support = first.nonzero().squeeze(-1)  # [≤ TOP_K]
        seqs = torch.cat([prompt.expand(len(support), -1), support[:, None]], dim=1)
        second = sampling_probs(model(seqs).logits[:, -1], seqs, config)  # [≤ TOP_K, V]
    return first, first[support] @ second


def _histogram_pvalues(stack: Stack, marginals: tuple[torch.Tensor, torch.Tensor]) -> list[float]:
    params = {"temperature": 1.0, "top_k": TOP_K, "num_speculative_tokens": 2, "max_new_tokens": 3}
    tokens, _ = asyncio.run(_first_tokens(stack.address, PROMPT, SAMPLES, 2, **params))
    outputs = np.array(tokens)
    vocab = marginals[0].shape[0]
    return [chi_square_pvalue(np.bincount(outputs[:, i], minlength=vocab), marginals[i].numpy()) for i in range(2)]


def test_gemma_with_a_trimmed_draft_samples_its_own_distribution(
    gemma_stack: Stack, gemma_marginals: tuple[torch.Tensor, torch.Tensor], trimmed_draft: Path
) -> None:
    vocab = TrimmedVocab.load(trimmed_draft)
    assert vocab is not None
    outside = torch.ones(vocab.target_vocab_size, dtype=torch.bool)
    outside[list(vocab.ids)] = False
    assert float(gemma_marginals[0][outside].sum()) > 0.2, "Gemma must put mass where the draft cannot propose"
    pvalues = _histogram_pvalues(gemma_stack, gemma_marginals)
    print(f"Gemma + trimmed draft: first token p={pvalues[0]:.4f}, second token p={pvalues[1]:.4f}")
    assert min(pvalues) > ALPHA


def test_gemma_with_a_rule_that_keeps_every_draft_token_fails_the_same_test(
    gemma_stack: Stack, gemma_marginals: tuple[torch.Tensor, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The negative control: the target service (in this process) accepts every draft token."""

    calls = []

    def keep_all(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                 generator: torch.Generator | None) -> tuple[int, int]:
        calls.append("dense")
        gamma = len(draft_tokens)
        _, bonus = accept_draft(draft_tokens[:0], draft_probs[:0], target_probs[gamma:], generator)
        return gamma, bonus

    def keep_all_sparse(draft_tokens: torch.Tensor, draft_ids: torch.Tensor, draft_values: torch.Tensor,
                        target_ids: torch.Tensor, target_values: torch.Tensor,
                        generator: torch.Generator | None) -> tuple[int, int]:
        calls.append("sparse")
        gamma = len(draft_tokens)
        ids, values = target_ids[gamma], target_values[gamma]  # the bonus row: [n]
        bonus = ids[values.float().clamp_min(0).multinomial(1, generator=generator)]
        return gamma, int(bonus)

    monkeypatch.setattr(engine_session, "accept_draft", keep_all)
    monkeypatch.setattr(engine_session, "accept_draft_sparse", keep_all_sparse)
    pvalues = _histogram_pvalues(gemma_stack, gemma_marginals)
    print(f"keep-all rule: first token p={pvalues[0]:.3g}")
    assert calls, "the verification must decide through one of the patched rules"
    assert pvalues[0] < ALPHA
