"""A draft over a trimmed vocabulary (`specwire.engine.trimmed_vocab`): it reads and scores target
ids, and speculative sampling with it keeps the target's distribution although the target puts
mass on ids the draft can never propose (Leviathan et al. 2023, Theorem 1).

- Mapping: the expanded draft's logits at its K target ids are its own, −inf elsewhere; an id
  outside the K reads as the fallback; services report the target's vocabulary.
- Exactness, pure: 200k γ = 2 rounds through `accept_drafts` fed the trimmed draft's q; the first
  token and the first two jointly follow the target (chi-square). A draft whose ids are not mapped
  back, and a residual confined to the draft's ids, fail the same test.
- Exactness, end to end: 1,000 seeded generations over gRPC; greedy equals target-only greedy.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch
from specwire.bench.draft_quality import pair_sums, warped_sums
from specwire.client import Client
from specwire.client.cli import main as cli_main
from specwire.draft_service.scratch import DraftShape, new_draft
from transformers import AutoConfig, AutoModelForCausalLM

from specwire.acceptance import accept_drafts
from specwire.engine import CausalLM, Engine, EngineLimits
from specwire.engine.forward import decode_steps
from specwire.engine.scheduler import ForwardJob
from specwire.engine.trimmed_vocab import VOCAB_FILE, TrimmedVocab, expand, most_frequent
from specwire.processing import ProcessingConfig
from specwire.session import OpenRequest, ScoreKind, Scoring, StepRequest
from tests.conftest import make_stack
from tests.goodness_of_fit import chi_square_pvalue
from tests.harness import LoopThread, Stack
from tests.test_losslessness import (
    ALPHA,
    E2E_SAMPLES,
    SAMPLES,
    TwoStepDistributions,
    _first_tokens,
    speculate_two_tokens,
)

pytest_plugins = ["tests.spec_fixtures"]

PROMPT = "abcab"
# Eight of the 20 target ids: <eos>, <unk> and six letters the small target rarely picks first.
KEPT_TEXT = "ghijkl" * 5 + "mnop"


def save_trimmed_draft(path: Path, target_dir: Path, tokenizer: Any, seed: int, sharpen: float = 3.0, hidden: int = 16) -> Path:
    """A fresh trimmed draft as `specwire distill --from-scratch` builds one (untrained)."""
    target_config = AutoConfig.from_pretrained(str(target_dir))
    stream = np.asarray(tokenizer(KEPT_TEXT).input_ids)
    ids = most_frequent(stream, 8, len(tokenizer), always=[0, 1])
    vocab = TrimmedVocab(len(tokenizer), tuple(ids), fallback=ids.index(1))
    model = new_draft(DraftShape(layers=1, hidden=hidden, vocab_top=8), vocab, target_config, 128, seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    vocab.save(path)
    return path


@pytest.fixture(scope="module")
def trimmed_draft_dir(models_dir: Path, small_target_dir: Path, char_tokenizer: Any) -> Path:
    return save_trimmed_draft(models_dir / "small-trimmed-draft", small_target_dir, char_tokenizer, seed=13)


@pytest.fixture(scope="module")
def trimmed_stack(loop: LoopThread, small_target_dir: Path, trimmed_draft_dir: Path) -> Iterator[Stack]:
    stack = make_stack(loop, small_target_dir, trimmed_draft_dir, max_new_tokens_limit=64)
    yield stack
    stack.stop()


def test_most_frequent_ranks_ids_by_count_and_keeps_the_forced_ones() -> None:
    stream = np.array([5, 5, 5, 3, 3, 7, 9, 9, 9, 9])
    assert most_frequent(stream, 3, 12) == [9, 5, 3]
    assert most_frequent(stream, 3, 12, always=[11]) == [9, 5, 11]  # the rarest kept one makes room
    assert most_frequent(stream, 3, 12, always=[5]) == [9, 3, 5]


def test_a_vocabulary_file_with_bad_ids_is_refused_naming_the_field(tmp_path: Path) -> None:
    (tmp_path / VOCAB_FILE).write_text(json.dumps({"target_vocab_size": 10, "fallback": 0, "ids": [1, 1]}))
    with pytest.raises(ValueError, match="ids must be distinct"):
        TrimmedVocab.load(tmp_path)
    (tmp_path / VOCAB_FILE).write_text(json.dumps({"target_vocab_size": 10, "fallback": 2, "ids": [1, 2]}))
    with pytest.raises(ValueError, match="fallback"):
        TrimmedVocab.load(tmp_path)


def test_the_expanded_draft_scores_its_target_ids_and_reads_others_as_the_fallback(
    trimmed_draft_dir: Path, char_tokenizer: Any
) -> None:
    vocab = TrimmedVocab.load(trimmed_draft_dir)
    assert vocab is not None
    raw: Any = AutoModelForCausalLM.from_pretrained(str(trimmed_draft_dir), dtype=torch.float32).eval()
    lm = CausalLM.load(str(trimmed_draft_dir), device="cpu", dtype="float32")
    assert lm.vocab_size == len(char_tokenizer) and lm.model.config.vocab_size == len(char_tokenizer)
    kept = torch.tensor(vocab.ids)
    table = {target: draft for draft, target in enumerate(vocab.ids)}
    inside = [vocab.ids[2], vocab.ids[5], vocab.ids[3]]
    with torch.no_grad():
        full = lm.model(input_ids=torch.tensor([inside])).logits[0]  # [3, V]
        own = raw(input_ids=torch.tensor([[table[i] for i in inside]])).logits[0]  # [3, K]
        assert torch.equal(full[:, kept], own)
        outside = torch.ones(full.shape[-1], dtype=torch.bool)
        outside[kept] = False
        assert bool(torch.isneginf(full[:, outside]).all())
        stranger = next(i for i in range(len(char_tokenizer)) if i not in table)
        as_fallback = lm.model(input_ids=torch.tensor([[stranger, inside[0]]])).logits
        assert torch.equal(as_fallback, lm.model(input_ids=torch.tensor([[vocab.ids[vocab.fallback], inside[0]]])).logits)


def test_a_model_without_a_vocabulary_file_is_left_as_it_is(small_target_dir: Path) -> None:
    model: Any = AutoModelForCausalLM.from_pretrained(str(small_target_dir), dtype=torch.float32)
    head = model.get_output_embeddings()
    assert expand(model, small_target_dir) is None and model.get_output_embeddings() is head


@pytest.fixture(scope="module")
def distributions(small_target_dir: Path, trimmed_draft_dir: Path, char_tokenizer: Any) -> tuple[TwoStepDistributions, TwoStepDistributions]:
    prompt_ids = char_tokenizer(PROMPT).input_ids
    target = TwoStepDistributions(small_target_dir, prompt_ids, ProcessingConfig())
    draft = TwoStepDistributions(trimmed_draft_dir, prompt_ids, ProcessingConfig())
    return target, draft


def _outside_mass(target: TwoStepDistributions, draft: TwoStepDistributions) -> float:
    return float(target.first[draft.first == 0].sum())


def test_speculative_sampling_with_a_trimmed_draft_follows_the_target(
    distributions: tuple[TwoStepDistributions, TwoStepDistributions],
) -> None:
    target, draft = distributions
    assert _outside_mass(target, draft) > 0.3, "the target must put mass where the draft cannot propose"
    vocab = target.first.shape[0]
    y1, y2 = speculate_two_tokens(target, draft, accept_drafts, SAMPLES, seed=0)
    p_first = chi_square_pvalue(np.bincount(y1, minlength=vocab), target.first.numpy())
    p_joint = chi_square_pvalue(np.bincount(y1 * vocab + y2, minlength=vocab * vocab), (target.first[:, None] * target.second).numpy())
    print(f"trimmed draft: first token p={p_first:.4f}, first two tokens p={p_joint:.4f}")
    assert p_first > ALPHA and p_joint > ALPHA


def ids_not_mapped_back(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                        generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Wrong on purpose: proposals judged under the neighbouring id's probabilities, as when a
    draft's ids reach the target unmapped (draft id ≠ target id)."""
    return accept_drafts(draft_tokens, draft_probs.roll(1, dims=-1), target_probs, generator)


def residual_on_draft_ids(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                          generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Wrong on purpose: corrections drawn only among the draft's ids (its vocabulary taken as
    the target's), so ids outside the K never come out."""
    support = (draft_probs.sum(dim=1, keepdim=True) > 0).float()  # [B, 1, V]
    return accept_drafts(draft_tokens, draft_probs, target_probs * support + 1e-30 * support, generator)


@pytest.mark.parametrize("rule", [ids_not_mapped_back, residual_on_draft_ids])
def test_a_trimmed_draft_with_a_wrong_rule_fails_the_same_test(
    distributions: tuple[TwoStepDistributions, TwoStepDistributions], rule: Any
) -> None:
    target, draft = distributions
    y1, _ = speculate_two_tokens(target, draft, rule, SAMPLES, seed=0)
    p_first = chi_square_pvalue(np.bincount(y1, minlength=target.first.shape[0]), target.first.numpy())
    print(f"{rule.__name__}: first token p={p_first:.3g}")
    assert p_first < ALPHA


def test_speculative_generation_with_a_trimmed_draft_follows_the_target_over_grpc(
    trimmed_stack: Stack, small_target_dir: Path, char_tokenizer: Any
) -> None:
    params = {"temperature": 1.0, "num_speculative_tokens": 2, "max_new_tokens": 4}
    tokens, _ = asyncio.run(_first_tokens(trimmed_stack.address, PROMPT, E2E_SAMPLES, 2, **params))
    outputs = np.array(tokens)
    target = TwoStepDistributions(small_target_dir, char_tokenizer(PROMPT).input_ids, ProcessingConfig())
    vocab = target.first.shape[0]
    p_first = chi_square_pvalue(np.bincount(outputs[:, 0], minlength=vocab), target.first.numpy())
    p_second = chi_square_pvalue(np.bincount(outputs[:, 1], minlength=vocab), (target.first @ target.second).numpy())
    print(f"trimmed draft over gRPC: first token p={p_first:.4f}, second token p={p_second:.4f}")
    assert p_first > ALPHA and p_second > ALPHA


def test_greedy_speculation_with_a_trimmed_draft_equals_target_greedy(trimmed_stack: Stack) -> None:
    client = Client(trimmed_stack.address)
    for prompt in (PROMPT, "ghij", "rrq"):
        expected = client.generate(prompt, strategy="greedy", max_new_tokens=30, ignore_eos=True).token_ids
        got = client.generate(prompt, strategy="speculative", num_speculative_tokens=3, max_new_tokens=30, ignore_eos=True)
        assert got.token_ids == expected, prompt


def test_pair_sums_are_alpha_agreements_outside_mass_and_kl_on_the_draft_ids() -> None:
    target = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    draft = torch.tensor([[1.0, float("-inf"), 2.0, float("-inf")]])  # the draft has ids 0 and 2
    p, q = target.softmax(-1)[0], draft.softmax(-1)[0]
    alpha, agree, outside, kl, agree_top2 = pair_sums(target, draft).tolist()
    assert alpha == pytest.approx(float(torch.minimum(p, q).sum()))
    assert agree == 0.0 and agree_top2 == 1.0  # the target's id 0 is the draft's second best
    assert outside == pytest.approx(float(p[1] + p[3]))
    kept = p[[0, 2]] / p[[0, 2]].sum()
    assert kl == pytest.approx(float((kept * (kept / q[[0, 2]]).log()).sum()))


def test_warped_figures_compare_the_distributions_a_sampled_round_draws_from() -> None:
    """p and q warped alike (T 0.5, top-k 2): α = Σ min over the survivors, the draft's argmax
    against the target's, and the target's warped mass on the draft's argmax."""
    from specwire.processing import ProcessingConfig

    target = torch.tensor([[2.0, 1.5, 0.0, -1.0]])
    draft = torch.tensor([[1.0, float("-inf"), 1.2, 0.0]])  # a trimmed draft: id 1 is not its
    p = torch.tensor([0.0, 0.0, 0.0, 0.0]).index_put_((torch.tensor([0, 1]),), (torch.tensor([2.0, 1.5]) / 0.5).softmax(-1))
    q = torch.tensor([0.0, 0.0, 0.0, 0.0]).index_put_((torch.tensor([0, 2]),), (torch.tensor([1.0, 1.2]) / 0.5).softmax(-1))
    alpha, agree, first = warped_sums(target, draft, ProcessingConfig(temperature=0.5, top_k=2)).tolist()
    assert alpha == pytest.approx(float(torch.minimum(p, q).sum()))
    assert agree == 0.0  # the draft's argmax is id 2, the target's id 0
    assert first == pytest.approx(0.0)  # the warped target gives id 2 nothing


def test_draft_quality_reports_exact_figures_for_a_trimmed_draft(
    small_target_dir: Path, trimmed_draft_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["draft-quality", "--target", str(small_target_dir), "--draft", str(trimmed_draft_dir), "--windows", "2",
            "--window", "16", "--new-tokens", "4", "--blocks", "2", "--json"]
    assert cli_main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    for part in ("held_out", "continuations"):
        values = report["modes"]["none"][part]
        assert 0.0 < values["alpha"] < 1.0 and values["target_mass_outside_draft"] > 0.0
    drawn = report["modes"]["none"]["sampled"]
    assert 0.0 < drawn["alpha"] <= 1.0 and 0.0 <= drawn["candidate_acceptance"] <= 1.0
    token, block = drawn["round_tokens"]["token"], drawn["round_tokens"]["block"]
    assert token[0] == pytest.approx(block[0]) and 1.0 <= token[0] <= 2.0  # one draft: the rules are one
    assert 1.0 <= block[1] <= 3.0
    assert report["warpers"] == {"temperature": 0.666, "top_k": 27, "top_p": 0.9, "samples": 3}


def test_a_trimmed_draft_proposes_from_its_own_ids_alike_fused_or_step_by_step_and_scores_over_all(
    trimmed_draft_dir: Path, char_tokenizer: Any
) -> None:
    """The scheduler computes a trimmed draft's K logits alone: its proposals pick among them, in
    fused steps (`decode_steps`, run eagerly here in place of the compiled ones) and step by step
    alike, with the same tokens and runners-up, and sampled, the same tokens and q; a scored
    prompt still gets logits over every target id, −inf outside the K, equal to the model's own."""
    prompt = char_tokenizer(PROMPT).input_ids
    vocab = TrimmedVocab.load(trimmed_draft_dir)
    assert vocab is not None

    warped = ProcessingConfig(temperature=0.8, top_k=12, top_p=0.9)
    sampled_fused: set[bool] = set()  # fused calls of greedy rounds, of sampled ones

    def proposals(fused: bool) -> tuple[list[list[int]], set[int], torch.Tensor, list[torch.Tensor]]:
        engine = Engine(CausalLM.load(str(trimmed_draft_dir), device="cpu", dtype="float32"), "draft",
                        EngineLimits(max_batch_rows=2, max_cache_len=64, compile="off"))
        scheduler = engine.scheduler
        assert scheduler is not None
        widths: set[int] = set()
        sampled_fused.clear()
        run_steps, run_one = scheduler._forward_steps, scheduler._forward

        def steps_recorded(jobs: list[ForwardJob], *args: Any) -> torch.Tensor:
            fed = run_steps(jobs, *args)
            sampled_fused.add(any(job.sampling is not None for job in jobs))
            widths.update(int(cast(torch.Tensor, job.logits).shape[-1]) for job in jobs if job.pick)
            return fed

        def one_recorded(jobs: list[ForwardJob], *args: Any, **kwargs: Any) -> int:
            width = run_one(jobs, *args, **kwargs)
            widths.update(int(cast(torch.Tensor, job.logits).shape[-1]) for job in jobs if job.pick)
            return width

        scheduler._forward_steps, scheduler._forward = steps_recorded, one_recorded  # type: ignore[method-assign]
        if fused:
            scheduler._compiled_steps = decode_steps
            scheduler._warm_steps |= {(True, count, sampled) for count in (2, 3, 4) for sampled in (True, False)}
        session = engine.new_session()
        opened = session.open(OpenRequest(prompt, scoring=Scoring(ScoreKind.LOGITS, positions=2)))
        assert opened.scores is not None and opened.scores.dense is not None
        out: list[list[int]] = []
        for count in (5, 1, 9):
            step = session.step(StepRequest(propose=count, propose_greedy=True, propose_ids_only=True,
                                            propose_alternatives=2))
            assert step.proposed_ids is not None and step.alternative_ids is not None
            out += [step.proposed_ids.reshape(-1).tolist(), step.alternative_ids.reshape(-1).tolist()]
        session.close()
        session = engine.new_session()
        session.open(OpenRequest(prompt, warped))
        qs: list[torch.Tensor] = []
        for count, seed in ((6, 1), (3, 2), (9, 3)):
            step = session.step(StepRequest(propose=count, propose_seed=seed))
            assert step.proposed_ids is not None and step.proposal_scores is not None
            out.append(step.proposed_ids.reshape(-1).tolist())
            qs.append(step.proposal_scores.to_dense(len(char_tokenizer), 0.0))
        session.close()
        return out, widths, opened.scores.dense, qs

    fused, fused_widths, scored, fused_q = proposals(True)
    assert sampled_fused == {False, True}
    single, single_widths, _, single_q = proposals(False)
    assert fused == single
    for q, alone in zip(fused_q, single_q, strict=True):
        torch.testing.assert_close(q, alone, atol=1e-6, rtol=1e-6)
    assert fused_widths == single_widths == {len(vocab.ids)}  # the draft's K ids, not the target's
    assert {token for run in fused for token in run} <= set(vocab.ids)
    lm = CausalLM.load(str(trimmed_draft_dir), device="cpu", dtype="float32")
    with torch.no_grad():
        own = lm.model(input_ids=torch.tensor([prompt])).logits[0, -2:]  # [2, V]
    assert scored.shape == own.shape == (2, len(char_tokenizer))
    torch.testing.assert_close(scored, own, atol=1e-5, rtol=1e-5)


def test_mixed_quantisation_puts_a_trimmed_drafts_own_head_at_4_bits(
    models_dir: Path, small_target_dir: Path, char_tokenizer: Any
) -> None:
    """`mixed`: the output layer w4a8, the others int8; a trimmed draft's output layer is the
    linear inside its `TargetVocabHead`, and the draft still scores every target id."""
    from specwire.engine.quantize import W4A8Linear, W8A8Linear, w4a8_builds

    if not w4a8_builds():
        pytest.skip("the w4a8 kernel does not build here")
    path = save_trimmed_draft(models_dir / "small-trimmed-draft-64", small_target_dir, char_tokenizer, seed=13, hidden=64)
    lm = CausalLM.load(str(path), device="cpu", dtype="float32", quantization="mixed")
    head = lm.model.get_output_embeddings()
    assert isinstance(head.head, W4A8Linear)
    down = [module for name, module in lm.model.named_modules() if name.endswith("down_proj")]
    assert down and all(isinstance(module, W8A8Linear) for module in down)
    assert lm.proposable_ids is not None and lm.vocab_size == head.out_features
