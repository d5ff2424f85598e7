"""Contrastive decoding (Li et al. 2022; O'Brien & Lewis 2023): the rule on constructed logits, and
greedy / beam output over gRPC equal to transformers' `generate` driven by an independent
in-process computation of the same formulas (full forwards of both models, no cache)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from specwire.client import Client, GenerationError
from specwire.client.sdk import build_request
from specwire.orchestrator.context import DecodeContext
from specwire.orchestrator.contrastive import (
    WirePlan,
    _expert_columns,
    contrastive,
    greedy_column,
    li_scores,
    log_partition,
    obrien_scores,
    plausible,
    sample_column,
)
from transformers import LogitsProcessor, NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor

from specwire import wire
from specwire.engine import CausalLM, Engine
from specwire.errors import InvalidArgument
from specwire.processing import ProcessingConfig
from specwire.session import OpenRequest, ScoreKind, Scores, Scoring, StepRequest
from tests.conftest import hf_model
from tests.harness import Stack

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["def add(a, b):", "the quick brown", "import os"]
NEG_INF = float("-inf")


# --- the rule on constructed logits --------------------------------------------------------


def test_token_both_prefer_but_the_amateur_much_more_loses_to_the_experts_relative_favourite() -> None:
    # Token 0: both models' favourite, the amateur's by far. Token 1: a close second for the expert.
    expert = torch.tensor([[5.0, 4.8, 1.0, 0.0]])
    amateur = torch.tensor([[5.0, 1.0, 0.5, 0.0]])
    ids = torch.arange(4)
    assert int(expert.argmax()) == 0 and int(amateur.argmax()) == 0
    obrien = obrien_scores(expert, amateur, alpha=0.1, beta=0.5)[0]
    li = li_scores(expert, amateur, 0.1, 1.0, log_partition(expert), log_partition(amateur))[0]
    assert greedy_column(obrien, ids) == 1
    assert greedy_column(li, ids) == 1


def test_plausibility_removes_an_implausible_token_the_raw_difference_would_pick() -> None:
    # Token 2 is implausible for the expert, but the amateur finds it even less likely.
    expert = torch.tensor([[5.0, 4.0, -3.0]])
    amateur = torch.tensor([[5.0, 4.0, -20.0]])
    ids = torch.arange(3)
    assert int(((1.5 * expert - 0.5 * amateur)[0]).argmax()) == 2  # the unconstrained contrast
    assert int((expert.log_softmax(-1) - amateur.log_softmax(-1))[0].argmax()) == 2
    assert plausible(expert, 0.1).tolist() == [[True, True, False]]
    for scores in (
        obrien_scores(expert, amateur, 0.1, 0.5)[0],
        li_scores(expert, amateur, 0.1, 1.0, log_partition(expert), log_partition(amateur))[0],
    ):
        assert scores[2] == NEG_INF
        assert greedy_column(scores, ids) == 0
    # α = 1 keeps the expert's argmax only; a tiny α lets the implausible token back in.
    assert torch.isfinite(obrien_scores(expert, amateur, 1.0, 0.5)).tolist() == [[True, False, False]]
    assert greedy_column(obrien_scores(expert, amateur, 1e-6, 0.5)[0], ids) == 2


def test_li_scores_on_a_column_subset_match_the_full_vocabulary_given_the_normalisers() -> None:
    torch.manual_seed(0)
    expert, amateur = torch.randn(3, 50) * 3, torch.randn(3, 50) * 3
    full = li_scores(expert, amateur, 0.2, 0.5, log_partition(expert), log_partition(amateur, 0.5))
    by_hand = expert.log_softmax(-1) - (amateur / 0.5).log_softmax(-1)
    valid = expert.softmax(-1) >= 0.2 * expert.softmax(-1).amax(-1, keepdim=True)
    assert torch.allclose(full[valid], by_hand[valid]) and bool((full[~valid] == NEG_INF).all())
    columns = torch.topk(expert, 20).indices
    subset = li_scores(
        expert.gather(1, columns), amateur.gather(1, columns), 0.2, 0.5, log_partition(expert), log_partition(amateur, 0.5)
    )
    assert torch.allclose(subset, full.gather(1, columns))


def test_greedy_ties_go_to_the_lowest_id_and_sampling_stays_in_the_plausible_top_k() -> None:
    assert greedy_column(torch.tensor([1.0, 3.0, 3.0]), torch.tensor([9, 7, 4])) == 2
    scores = obrien_scores(torch.tensor([[3.0, 2.9, 2.8, 2.7, -5.0]]), torch.zeros(1, 5), 0.1, 0.5)[0]
    generator = torch.Generator().manual_seed(0)
    drawn = {sample_column(scores, ProcessingConfig(top_k=3), generator) for _ in range(200)}
    assert drawn == {0, 1, 2}


def test_a_plausible_set_reaching_past_the_sparse_top_n_asks_for_dense() -> None:
    values = torch.tensor([[3.0, 2.5, 2.0]])
    ids = torch.tensor([[4, 1, 2]], dtype=torch.int32)
    sparse = Scores(ScoreKind.LOGITS, sparse_ids=ids, sparse_values=values)
    assert _expert_columns(sparse, 0.1, vocab=10) is None  # 2.0 ≥ 3 + log 0.1: token 5, 6… may qualify too
    found = _expert_columns(sparse, 0.5, vocab=10)
    assert found is not None and found[0].tolist() == [[4, 1, 2]]


# --- score_ids: the amateur's restricted answer ---------------------------------------------


def test_score_ids_return_exactly_those_columns_and_reject_bad_use(llama_draft_dir: Path) -> None:
    engine = Engine(CausalLM.load(str(llama_draft_dir), device="cpu", dtype="float32"), "draft")
    session = engine.new_session()
    processing = ProcessingConfig(repetition_penalty=1.3)
    dense = session.open(OpenRequest([5, 6, 7], processing, 2, Scoring(ScoreKind.LOGITS))).scores
    wanted = (9, 3, 250)
    some = session.step(StepRequest(scoring=Scoring(ScoreKind.LOGITS, score_ids=wanted))).scores
    assert dense is not None and dense.dense is not None and some is not None and some.sparse_values is not None
    assert some.sparse_ids is not None and some.sparse_ids.tolist() == [list(wanted)] * 2
    assert torch.allclose(some.sparse_values, dense.dense[:, list(wanted)], atol=1e-5)
    assert wire.scoring_from_pb(wire.scoring_to_pb(Scoring(ScoreKind.LOGITS, score_ids=wanted))).score_ids == wanted
    for bad, field in (
        (Scoring(ScoreKind.LOGITS, score_ids=(1, 10_000)), "scoring.score_ids"),
        (Scoring(ScoreKind.LOGITS, top_n=4, score_ids=(1,)), "scoring.score_ids"),
        (Scoring(ScoreKind.PROBS, score_ids=(1,)), "scoring.score_ids"),
    ):
        with pytest.raises(InvalidArgument) as error:
            session.step(StepRequest(scoring=bad))
        assert error.value.field == field


# --- the reference: transformers' generate, scores from full forwards of both models ------


class ContrastiveReference(LogitsProcessor):
    """Replaces each row's scores by the contrastive score of its whole sequence."""

    def __init__(self, expert: Any, amateur: Any, form: str, alpha: float, beta: float, tau: float,
                 beams: bool, repetition_penalty: float = 1.0, no_repeat_ngram_size: int = 0) -> None:
        self.models = (expert, amateur)
        self.form, self.alpha, self.beta, self.tau, self.beams = form, alpha, beta, tau, beams
        self.penalties: list[LogitsProcessor] = []
        if repetition_penalty != 1.0:
            self.penalties.append(RepetitionPenaltyLogitsProcessor(repetition_penalty))
        if no_repeat_ngram_size:
            self.penalties.append(NoRepeatNGramLogitsProcessor(no_repeat_ngram_size))
        self.valid_sizes: list[int] = []
        self.differs: list[bool] = []

    def logits(self, model: Any, input_ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            logits = model(input_ids=input_ids, use_cache=False).logits[:, -1, :].float()
        for processor in self.penalties:
            logits = processor(input_ids, logits)
        return logits  # type: ignore[no-any-return]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        expert, amateur = (self.logits(model, input_ids) for model in self.models)
        if self.form == "obrien":
            valid = expert >= expert.max(dim=-1, keepdim=True).values + math.log(self.alpha)
            out = (1 + self.beta) * expert - self.beta * amateur
        else:
            p_expert = torch.softmax(expert, dim=-1)
            valid = p_expert >= self.alpha * p_expert.max(dim=-1, keepdim=True).values
            out = torch.log_softmax(expert, dim=-1) - torch.log_softmax(amateur / self.tau, dim=-1)
        out = torch.where(valid, out, torch.full_like(out, NEG_INF))
        if self.form == "obrien" and self.beams:
            out = torch.log_softmax(out, dim=-1)
        self.valid_sizes.append(int(valid.sum()))
        self.differs.append(int(out[0].argmax()) != int(expert[0].argmax()))
        return out  # type: ignore[return-value]


@pytest.fixture(scope="module")
def experts(llama_target_dir: Path, llama_draft_dir: Path) -> tuple[Any, Any]:
    return hf_model(llama_target_dir), hf_model(llama_draft_dir)


def reference_generate(experts: tuple[Any, Any], prompt_ids: list[int], cd: dict[str, Any], **kwargs: Any) -> tuple[Any, ContrastiveReference]:
    processor = ContrastiveReference(
        *experts,
        form=cd.get("cd_form", "obrien"),
        alpha=cd.get("cd_alpha", 0.1),
        beta=cd.get("cd_beta", 0.5),
        tau=cd.get("amateur_temperature", 1.0),
        beams=kwargs.get("num_beams", 1) > 1,
        repetition_penalty=cd.get("repetition_penalty", 1.0),
        no_repeat_ngram_size=cd.get("no_repeat_ngram_size", 0),
    )
    with torch.no_grad():
        out = experts[0].generate(
            torch.tensor([prompt_ids]), do_sample=False, pad_token_id=0, logits_processor=[processor], **kwargs
        )
    return out, processor


GREEDY_CASES = [
    {},
    {"cd_beta": 1.5, "cd_alpha": 0.3},
    {"cd_form": "li"},
    {"cd_form": "li", "amateur_temperature": 0.5, "cd_alpha": 0.05},
    {"cd_beta": 1.0, "repetition_penalty": 1.3, "no_repeat_ngram_size": 2},
    {"cd_form": "li", "repetition_penalty": 0.8, "no_repeat_ngram_size": 3},
]


@pytest.mark.parametrize("cd", GREEDY_CASES, ids=lambda cd: ",".join(f"{k}={v}" for k, v in cd.items()) or "default")
def test_greedy_over_grpc_equals_the_in_process_formula(llama_stack: Stack, experts: tuple[Any, Any], tokenizer: Any, cd: dict[str, Any]) -> None:
    client = Client(llama_stack.address)
    differs = 0
    for prompt in PROMPTS:
        prompt_ids = tokenizer(prompt).input_ids
        result = client.generate(input_ids=prompt_ids, strategy="contrastive", max_new_tokens=20, ignore_eos=True, **cd)
        expected, reference = reference_generate(experts, prompt_ids, cd, max_new_tokens=20, eos_token_id=None)
        assert result.token_ids == expected[0, len(prompt_ids):].tolist()
        stats = result.stats
        assert stats.mean_valid_set_size == pytest.approx(sum(reference.valid_sizes) / 20)
        assert stats.differs_from_expert_rate == pytest.approx(sum(reference.differs) / 20)
        assert stats.expert_ms_per_step > 0 and stats.amateur_ms_per_step > 0
        differs += sum(reference.differs)
    assert differs > 0  # the contrast changed some choice: the comparison is not the expert's greedy twice


def test_greedy_stops_at_eos_like_the_reference(llama_stack: Stack, experts: tuple[Any, Any], tokenizer: Any) -> None:
    client = Client(llama_stack.address)
    for prompt in PROMPTS:
        prompt_ids = tokenizer(prompt).input_ids
        result = client.generate(input_ids=prompt_ids, strategy="contrastive", max_new_tokens=30, cd_beta=1.0)
        expected, _ = reference_generate(experts, prompt_ids, {"cd_beta": 1.0}, max_new_tokens=30, eos_token_id=0)
        assert result.token_ids == expected[0, len(prompt_ids):].tolist()
        assert result.finish_reason == ("eos" if result.token_ids[-1] == 0 else "length")


BEAM_CASES = [
    {"num_beams": 3, "num_return_sequences": 2},
    {"num_beams": 5, "cd_form": "li", "num_return_sequences": 3},  # Li et al.'s 5 beams
    {"num_beams": 4, "cd_beta": 1.0, "cd_alpha": 0.05, "length_penalty": 0.5, "early_stopping": True},
    {"num_beams": 3, "cd_form": "li", "amateur_temperature": 0.5, "repetition_penalty": 1.3, "no_repeat_ngram_size": 2},
]


@pytest.mark.parametrize("beam", BEAM_CASES, ids=lambda cd: ",".join(f"{k}={v}" for k, v in cd.items()))
def test_beam_over_grpc_equals_transformers_beam_search_over_the_formula(
    llama_stack: Stack, experts: tuple[Any, Any], tokenizer: Any, beam: dict[str, Any]
) -> None:
    client = Client(llama_stack.address)
    cd = {k: v for k, v in beam.items() if k.startswith("cd_") or k in ("amateur_temperature", "repetition_penalty", "no_repeat_ngram_size")}
    search = {k: v for k, v in beam.items() if k not in cd}
    for prompt, ignore_eos in ((PROMPTS[0], True), (PROMPTS[1], False)):
        prompt_ids = tokenizer(prompt).input_ids
        result = client.generate(
            input_ids=prompt_ids, strategy="contrastive", max_new_tokens=12, ignore_eos=ignore_eos, **beam
        )
        expected, _ = reference_generate(
            experts, prompt_ids, cd, max_new_tokens=12, eos_token_id=None if ignore_eos else 0,
            output_scores=True, return_dict_in_generate=True, **search,
        )
        assert len(result.sequences) == beam.get("num_return_sequences", 1)
        for ours, theirs, score in zip(result.sequences, expected.sequences, expected.sequences_scores, strict=True):
            theirs_new = theirs[len(prompt_ids):].tolist()
            assert ours.token_ids == theirs_new[: len(ours.token_ids)]
            assert all(t == 0 for t in theirs_new[len(ours.token_ids):])  # transformers pads with id 0
            assert ours.score == pytest.approx(float(score), rel=1e-4, abs=1e-4)
        assert result.token_ids == result.sequences[0].token_ids


# --- wire plans, sampling, bad input, CLI ---------------------------------------------------


def run_plan(stack: Stack, plan: WirePlan, **fields: Any) -> tuple[list[int], DecodeContext]:
    """The strategy straight on the stack's services with a given wire plan: (tokens, context)."""
    decoder = stack.orchestrator.decoder
    request = build_request(strategy="contrastive", **fields)
    params, prompt_ids = decoder.prepare(request)
    ctx = DecodeContext(params, prompt_ids, decoder.target, decoder.draft, decoder.eos_token_ids, torch.Generator().manual_seed(0))

    async def run() -> list[int]:
        tokens: list[int] = []
        decided = contrastive(ctx, plan)
        try:
            async for ids in decided:
                tokens += ids
                if len(tokens) >= params.max_new_tokens:
                    break
        finally:
            await decided.aclose()
            await ctx.close()
        return tokens[: params.max_new_tokens]

    return stack.loop.run(run()), ctx


@pytest.mark.parametrize("cd_form", ["obrien", "li"])
def test_every_wire_plan_decides_the_same_tokens(llama_stack: Stack, cd_form: str) -> None:
    fields: dict[str, Any] = {
        "prompt": "def add(a, b):", "max_new_tokens": 16, "cd_form": cd_form, "cd_beta": 1.0, "cd_alpha": 0.3
    }
    same, same_ctx = run_plan(llama_stack, WirePlan(), **fields)
    second, ctx = run_plan(llama_stack, WirePlan(amateur_round="second"), **fields)
    assert second == same
    # The amateur answered for the plausible ids only, not with dense rows.
    assert ctx.stats.draft.bytes_received < same_ctx.stats.draft.bytes_received / 2
    # An expert top_n far below the plausible sets forces dense re-scoring, with the same result.
    narrow, ctx = run_plan(llama_stack, WirePlan(expert_top_n=2), **fields)
    assert narrow == same and ctx.stats.target.calls > ctx.stats.contrastive_steps
    beams, _ = run_plan(llama_stack, WirePlan(), num_beams=3, **fields)
    beams_second, _ = run_plan(llama_stack, WirePlan(amateur_round="second", expert_top_n=2), num_beams=3, **fields)
    assert beams_second == beams


def test_seeded_contrastive_sampling_reproduces_and_stays_plausible(llama_stack: Stack, experts: tuple[Any, Any], tokenizer: Any) -> None:
    client = Client(llama_stack.address)
    prompt_ids = tokenizer("import os").input_ids
    kwargs: dict[str, Any] = {"strategy": "contrastive", "max_new_tokens": 16, "ignore_eos": True, "top_k": 3, "cd_alpha": 0.2}
    first = client.generate(input_ids=prompt_ids, seed=3, **kwargs)
    assert client.generate(input_ids=prompt_ids, seed=3, **kwargs).token_ids == first.token_ids
    others = {tuple(client.generate(input_ids=prompt_ids, seed=s, **kwargs).token_ids) for s in (4, 5, 6)}
    assert others != {tuple(first.token_ids)}
    reference = ContrastiveReference(*experts, form="obrien", alpha=0.2, beta=0.5, tau=1.0, beams=False)
    sequence = torch.tensor([prompt_ids])
    for token in first.token_ids:
        scores = reference(sequence, torch.zeros(1))[0]  # type: ignore[arg-type]
        assert token in torch.topk(scores, 3).indices.tolist() and scores[token] > NEG_INF
        sequence = torch.cat([sequence, torch.tensor([[token]])], dim=1)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"cd_alpha": 0.0}, "cd_alpha"),
        ({"cd_alpha": 1.5}, "cd_alpha"),
        ({"cd_alpha": -0.1}, "cd_alpha"),
        ({"cd_beta": -0.5}, "cd_beta"),
        ({"amateur_temperature": 0.0}, "amateur_temperature"),
        ({"amateur_temperature": -1.0}, "amateur_temperature"),
        ({"cd_form": "nope"}, "cd_form"),
        ({"num_beams": 3, "temperature": 0.7}, "temperature"),
    ],
)
def test_bad_contrastive_fields_are_invalid_argument_naming_the_field(llama_stack: Stack, kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(GenerationError) as error:
        Client(llama_stack.address).generate(prompt="def", strategy="contrastive", max_new_tokens=4, **kwargs)
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.message.startswith(f"{field}:")


def test_cli_generates_contrastively_with_every_flag(llama_stack: Stack) -> None:
    args = ["generate", "--address", llama_stack.address, "--prompt", "def add(a, b):", "--strategy", "contrastive",
            "--cd-form", "li", "--cd-alpha", "0.2", "--cd-beta", "0.7", "--amateur-temperature", "0.5",
            "--max-new-tokens", "8", "--ignore-eos", "--json"]
    run = subprocess.run([sys.executable, "-m", "specwire", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    sdk = Client(llama_stack.address).generate(
        prompt="def add(a, b):", strategy="contrastive", cd_form="li", cd_alpha=0.2, cd_beta=0.7,
        amateur_temperature=0.5, max_new_tokens=8, ignore_eos=True,
    )
    assert out["token_ids"] == sdk.token_ids and out["stats"]["mean_valid_set_size"] > 0


@pytest.mark.parametrize("num_beams", [1, 3])
def test_contrastive_stream_yields_the_same_tokens_as_unary(llama_stack: Stack, num_beams: int) -> None:
    client = Client(llama_stack.address)
    kwargs: dict[str, Any] = {"prompt": "class Point:", "strategy": "contrastive", "max_new_tokens": 12, "num_beams": num_beams}
    unary = client.generate(**kwargs)
    deltas = list(client.stream(**kwargs))
    assert [t for d in deltas for t in d.token_ids] == unary.token_ids
    assert deltas[-1].finish_reason == unary.finish_reason and deltas[-1].stats.mean_valid_set_size > 0
