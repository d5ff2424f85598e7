"""Speculative decoding over gRPC: statistics add up, stops trim exactly, the n-gram drafter serves,
seeds reproduce, sessions are freed, and the CLI shows it all."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from specwire.client import Client, GenerationError
from specwire.client.cli import main as cli_main
from specwire.draft_service.ngram import NgramDrafter
from specwire.draft_service.server import build_backend

from specwire.config import ModelServiceConfig
from specwire.errors import InvalidArgument
from specwire.startup import StartupClock
from tests.conftest import hf_model, load_engine, make_stack
from tests.harness import LoopThread, Stack, start_model_server, start_orchestrator

pytest_plugins = ["tests.spec_fixtures"]  # its fixtures: stacks and the small-vocabulary pair


PROMPT = "for i in range(10):\n    print(i"


def check_stats_add_up(stats: Any, untrimmed: bool) -> None:
    """Every speculative round yields accepted + 1 tokens; a target-only round (auto γ) its own."""
    histogram = list(stats.accepted_length_histogram)
    speculative_rounds = stats.rounds - stats.speculation_off_rounds
    assert 0 <= stats.accepted_tokens <= stats.drafted_tokens
    assert sum(histogram) == speculative_rounds == stats.corrections + stats.bonus_tokens
    assert sum(k * count for k, count in enumerate(histogram)) == stats.accepted_tokens
    produced = stats.accepted_tokens + stats.corrections + stats.bonus_tokens + stats.target_only_tokens
    assert stats.new_tokens == produced if untrimmed else stats.new_tokens <= produced
    # One verification forward per speculative round, one forward per token of a target-only round.
    assert stats.target_forwards == speculative_rounds + stats.target_only_tokens
    if stats.drafted_tokens:
        assert stats.acceptance_rate == pytest.approx(stats.accepted_tokens / stats.drafted_tokens)
    assert stats.mean_accepted_length == pytest.approx(
        stats.accepted_tokens / stats.rounds if stats.drafted_tokens else 0.0
    )
    assert stats.tokens_per_target_forward == pytest.approx(stats.new_tokens / stats.target_forwards)
    assert stats.pipelined_rounds <= speculative_rounds
    assert stats.bytes_per_round > 0 and stats.target_bytes_received > 0
    if stats.draft_forwards:
        assert stats.draft_bytes_received > 0
    else:  # the n-gram drafter runs in the orchestrator: a round is one target message
        assert stats.draft_bytes_sent == stats.draft_bytes_received == 0


@pytest.mark.parametrize("stack_name", ["llama_stack", "llama_ngram_stack", "self_draft_stack"])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "top_p": 0.95, "seed": 3}], ids=["greedy", "sampled"])
def test_statistics_add_up(request: pytest.FixtureRequest, stack_name: str, sampling: dict[str, Any]) -> None:
    stack: Stack = request.getfixturevalue(stack_name)
    result = Client(stack.address).generate(
        PROMPT, strategy="speculative", num_speculative_tokens=4, max_new_tokens=30, ignore_eos=True, **sampling
    )
    assert len(result.token_ids) == 30 and result.finish_reason == "length"
    check_stats_add_up(result.stats, untrimmed=True)


# A prompt whose last tokens occurred before: the first round can copy what followed them.
REPEATING = "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(i"


@pytest.mark.parametrize(("stack_name", "prompt", "gamma"), [
    ("llama_stack", REPEATING, 4),
    # Auto γ: untimed services, whose first round speculates (the timed tiny pair decides every
    # round target-only, copied or not, rightly: its target's step costs next to nothing).
    ("small_untimed_stack", "abcabcabcab", None),
], ids=["gamma4", "auto"])
def test_rounds_copied_from_the_history_keep_greedy_output(
    request: pytest.FixtureRequest, stack_name: str, prompt: str, gamma: int | None
) -> None:
    client = Client(request.getfixturevalue(stack_name).address)
    params: dict[str, Any] = {"max_new_tokens": 40, "ignore_eos": True} | ({"num_speculative_tokens": gamma} if gamma else {})
    expected = client.generate(prompt, strategy="greedy", max_new_tokens=40, ignore_eos=True).token_ids
    copied = client.generate(prompt, strategy="speculative", **params)
    model = client.generate(prompt, strategy="speculative", lookup_min_ngram=0, **params)
    assert copied.token_ids == model.token_ids == expected
    assert copied.stats.lookup_rounds > 0 and model.stats.lookup_rounds == 0
    check_stats_add_up(copied.stats, untrimmed=True)
    if gamma:  # a copied round asks the draft nothing: the model's rounds alone send it messages
        assert copied.stats.draft_forwards < model.stats.draft_forwards


def test_copied_rounds_are_sampled_reproducibly_at_a_fixed_gamma(llama_stack: Stack) -> None:
    """At a fixed γ every match is copied, whatever the timings: a seed replays."""
    params = {"strategy": "speculative", "num_speculative_tokens": 3, "max_new_tokens": 24, "ignore_eos": True,
              "temperature": 0.8, "seed": 5}
    first, again = (Client(llama_stack.address).generate(REPEATING, **params) for _ in range(2))
    assert first.token_ids == again.token_ids and first.stats.lookup_rounds > 0
    check_stats_add_up(first.stats, untrimmed=True)


@pytest.mark.parametrize("value", [4, -1])
def test_a_bad_lookup_min_ngram_is_an_invalid_argument_naming_the_field(llama_stack: Stack, value: int) -> None:
    with pytest.raises(GenerationError) as error:
        Client(llama_stack.address).generate(PROMPT, strategy="speculative", lookup_min_ngram=value)
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT and "lookup_min_ngram" in error.value.message
    # The orchestrator goes on serving.
    assert len(Client(llama_stack.address).generate(PROMPT, strategy="speculative", max_new_tokens=4).token_ids) == 4


def test_a_target_drafting_for_itself_has_every_greedy_draft_accepted(self_draft_stack: Stack) -> None:
    stats = (
        Client(self_draft_stack.address)
        .generate(PROMPT, strategy="speculative", num_speculative_tokens=4, max_new_tokens=31, ignore_eos=True)
        .stats
    )
    assert stats.corrections == 0 and stats.acceptance_rate == 1.0
    # 6 full rounds of 4 + 1 tokens, then the 31st token: nothing left to draft, a target-only round
    assert list(stats.accepted_length_histogram) == [0, 0, 0, 0, 6] and stats.tokens_per_target_forward > 4
    assert stats.speculation_off_rounds == 1 and stats.target_only_tokens == 1


def test_a_draft_that_agrees_has_every_round_after_the_first_proposed_during_verification(
    self_draft_stack: Stack,
) -> None:
    """Pipelined drafting: the draft's guess at the bonus is the target's argmax, so every proposal
    made during a verification is used, until the rounds left are too few to pipeline."""
    result = Client(self_draft_stack.address).generate(
        PROMPT, strategy="speculative", num_speculative_tokens=4, max_new_tokens=31, ignore_eos=True
    )
    stats = result.stats
    assert stats.pipeline_misses == 0 and stats.pipelined_rounds >= stats.rounds - 2 > 0
    sequential = Client(self_draft_stack.address).generate(
        PROMPT, strategy="speculative", num_speculative_tokens=4, max_new_tokens=31, ignore_eos=True,
        speculative_pipeline=False,
    )
    assert sequential.token_ids == result.token_ids and sequential.stats.pipelined_rounds == 0
    check_stats_add_up(stats, untrimmed=True)


def test_an_orchestrator_started_without_pipelining_pipelines_only_requests_that_ask(
    loop: LoopThread, self_draft_stack: Stack, llama_target_dir: Path
) -> None:
    """`--speculative-pipeline off` (what `specwire up` passes where the services share the
    cores) is the default of requests that leave the field unset; the tokens do not change."""
    stack = self_draft_stack
    orchestrator = loop.run(start_orchestrator(
        stack.target.address, stack.draft.address, str(llama_target_dir), speculative_pipeline=False
    ))
    try:
        kwargs: dict[str, Any] = {"strategy": "speculative", "num_speculative_tokens": 4, "max_new_tokens": 31,
                                  "ignore_eos": True}
        unset = Client(orchestrator.address).generate(PROMPT, **kwargs)
        asked = Client(orchestrator.address).generate(PROMPT, speculative_pipeline=True, **kwargs)
    finally:
        loop.run(orchestrator.running.server.stop(0))
    assert unset.stats.pipelined_rounds == 0 and asked.stats.pipelined_rounds > 0
    assert unset.token_ids == asked.token_ids == Client(stack.address).generate(PROMPT, **kwargs).token_ids


@pytest.fixture(scope="module")
def short_round_stacks(loop: LoopThread, small_target_dir: Path, small_draft_dir: Path) -> Iterator[dict[str, Stack]]:
    """The small pair with target-only rounds of 4 tokens (16 rounds in 64, room for probes):
    services that timed their forwards at warm-up, and services that did not (costs unknown)."""
    stacks = {
        warm: make_stack(loop, small_target_dir, small_draft_dir, warm=warm == "timed",
                         max_new_tokens_limit=64, max_tokens_per_round=4)
        for warm in ("timed", "untimed")
    }
    yield stacks
    for stack in stacks.values():
        stack.stop()


def auto_gamma_against_greedy(stack: Stack) -> Any:
    """Auto γ's statistics for 64 tokens of the small pair, its tokens checked against greedy's."""
    client = Client(stack.address)
    expected = client.generate("abcab", strategy="greedy", max_new_tokens=64, ignore_eos=True).token_ids
    result = client.generate("abcab", strategy="speculative", max_new_tokens=64, ignore_eos=True)
    assert result.token_ids == expected
    check_stats_add_up(result.stats, untrimmed=True)
    return result.stats


def test_auto_gamma_planned_from_warm_up_timings_keeps_greedy_output(short_round_stacks: dict[str, Stack]) -> None:
    """The small pair's draft is another random model and costs about what the target does.
    With the services' warm-up timings the first round is planned, not guessed (which rounds
    speculate follows the timings); the output is greedy's and the statistics add up."""
    stats = auto_gamma_against_greedy(short_round_stacks["timed"])
    assert stats.speculation_off_rounds > 0 and stats.target_ms_per_token_estimate > 0


def test_auto_gamma_falls_back_to_target_only_rounds_when_drafts_are_rejected(
    short_round_stacks: dict[str, Stack],
) -> None:
    """Without warm-up timings auto γ speculates to measure; drafts from another random model are
    rejected, so it switches to target-only rounds, and the output stays greedy's."""
    stats = auto_gamma_against_greedy(short_round_stacks["untimed"])
    assert stats.speculation_off_rounds > 0 and stats.target_only_tokens > 0
    assert stats.rounds > stats.speculation_off_rounds  # it speculated to measure
    assert 0 < stats.alpha_estimate < 0.5 and stats.verify_ms_estimate > 0 and stats.draft_ms_per_token_estimate > 0


def test_a_draft_that_claims_to_be_slow_is_measured_before_it_is_ruled_out(
    loop: LoopThread, llama_target_dir: Path
) -> None:
    """A service times itself at warm-up, perhaps while another one compiles on the same cores:
    a draft whose `Info` claims 1000 times its cost would never be asked by a plan that believed
    it. Auto γ measures it first (the target as its own draft: every draft accepted), keeps
    greedy's output, and starts the pair's next generation from what it measured."""
    target = load_engine(llama_target_dir, "target")
    draft = load_engine(llama_target_dir, "draft")
    claimed = draft.info().decode_ms_per_token * 1000
    measured_info = draft.info
    draft.info = lambda: replace(measured_info(), decode_ms_per_token=claimed)  # type: ignore[method-assign]
    target_server = loop.run(start_model_server(target))
    draft_server = loop.run(start_model_server(draft))
    orchestrator = loop.run(start_orchestrator(target_server.address, draft_server.address, str(llama_target_dir)))
    stack = Stack(loop, target_server, draft_server, orchestrator)
    try:
        client = Client(stack.address)
        expected = client.generate(PROMPT, strategy="greedy", max_new_tokens=40, ignore_eos=True).token_ids
        first, second = (
            client.generate(PROMPT, strategy="speculative", max_new_tokens=40, ignore_eos=True, lookup_min_ngram=0)
            for _ in range(2)
        )
    finally:
        stack.stop()
    assert first.token_ids == second.token_ids == expected
    assert first.stats.drafted_tokens > 0 and 0 < first.stats.draft_ms_per_token_estimate < claimed / 50
    check_stats_add_up(first.stats, untrimmed=True)
    # Seeded from the first generation's figure, the second need not probe to learn it.
    assert second.stats.draft_ms_per_token_estimate < claimed / 50


def test_no_draft_tokens_are_spent_past_max_new_tokens(self_draft_stack: Stack) -> None:
    stats = (
        Client(self_draft_stack.address)
        .generate(PROMPT, strategy="speculative", num_speculative_tokens=8, max_new_tokens=3, ignore_eos=True)
        .stats
    )
    assert (stats.drafted_tokens, stats.rounds, stats.new_tokens) == (2, 1, 3)


def test_eos_and_stop_strings_trim_a_round_like_target_greedy(self_draft_stack: Stack) -> None:
    """Accepted drafts make rounds of several tokens: an eos or a stop string inside one must cut
    the output exactly where target-only greedy decoding stops."""
    client = Client(self_draft_stack.address)
    trimmed = 0
    for prompt in ["def add(a, b):", "import os", PROMPT]:
        for stop in [None, ["("], ["\n"], ["o"]]:
            expected = client.generate(prompt, strategy="greedy", max_new_tokens=40, stop_strings=stop)
            result = client.generate(
                prompt, strategy="speculative", num_speculative_tokens=5, max_new_tokens=40, stop_strings=stop
            )
            assert (result.token_ids, result.text, result.finish_reason) == (
                expected.token_ids,
                expected.text,
                expected.finish_reason,
            )
            check_stats_add_up(result.stats, untrimmed=False)
            stats = result.stats
            trimmed += stats.new_tokens < stats.accepted_tokens + stats.corrections + stats.bonus_tokens
    assert trimmed > 0, "no round was cut short: the test lost its point"


@pytest.mark.parametrize("processors", [{"repetition_penalty": 1.3}, {"no_repeat_ngram_size": 2}])
def test_penalties_warp_both_sides_alike_so_greedy_output_is_unchanged(
    llama_stack: Stack, llama_ngram_stack: Stack, processors: dict[str, Any]
) -> None:
    expected = (
        Client(llama_stack.address)
        .generate(PROMPT, strategy="greedy", max_new_tokens=24, ignore_eos=True, **processors)
        .token_ids
    )
    for stack in (llama_stack, llama_ngram_stack):
        result = Client(stack.address).generate(
            PROMPT, strategy="speculative", num_speculative_tokens=3, max_new_tokens=24, ignore_eos=True, **processors
        )
        assert result.token_ids == expected


def test_truncated_sampling_never_leaves_the_target_support(small_stack: Stack, small_target_dir: Path) -> None:
    """top-k distributions travel sparse; every token out must be in the target's top k."""
    client = Client(small_stack.address)
    prompt_ids = [2, 3, 4, 2, 3]
    model: Any = hf_model(small_target_dir)
    accepted = 0
    for seed in range(10):  # α is ~0.07 for this pair at top-k 3: ~1 acceptance a generation
        result = client.generate(
            input_ids=prompt_ids, strategy="speculative", num_speculative_tokens=4, top_k=3, seed=seed,
            max_new_tokens=24, ignore_eos=True,
        )
        accepted += result.stats.accepted_tokens
        sequence = torch.tensor([prompt_ids + result.token_ids])
        with torch.no_grad():
            logits = model(sequence).logits[0, len(prompt_ids) - 1 : -1]  # [new, V]: the positions that chose them
        top = logits.topk(3, dim=-1).indices
        assert all(token in row for token, row in zip(result.token_ids, top.tolist(), strict=True))
    assert accepted > 0  # some tokens came through acceptance, not only corrections


# 0.99999: most proposals (pipelined ones too) are empty, which must read as a miss, not a fault.
@pytest.mark.parametrize("threshold", [0.9, 0.99999])
def test_a_confident_draft_may_stop_early_and_the_output_is_unchanged(
    self_draft_stack: Stack, llama_stack: Stack, threshold: float
) -> None:
    for stack in (self_draft_stack, llama_stack):
        client = Client(stack.address)
        expected = client.generate(PROMPT, strategy="greedy", max_new_tokens=24, ignore_eos=True).token_ids
        result = client.generate(
            PROMPT,
            strategy="speculative",
            num_speculative_tokens=6,
            draft_confidence_threshold=threshold,
            max_new_tokens=24,
            ignore_eos=True,
        )
        assert result.token_ids == expected
        check_stats_add_up(result.stats, untrimmed=True)
        assert result.stats.drafted_tokens < 6 * (result.stats.rounds - 1)  # some rounds drafted fewer than γ


def test_drafts_never_overrun_the_context(small_stack: Stack) -> None:
    prompt = "abcdefghijklmnopqr" * 6 + "abcd"  # 112 of the 128 positions
    result = Client(small_stack.address).generate(
        prompt,
        strategy="speculative",
        num_speculative_tokens=8,
        max_new_tokens=16,
        ignore_eos=True,
        temperature=1.0,
        seed=1,
    )
    assert len(result.token_ids) == 16
    check_stats_add_up(result.stats, untrimmed=True)


def test_a_seed_reproduces_a_sampled_generation_at_a_fixed_gamma(small_stack: Stack) -> None:
    """Auto γ follows measured timings, so bit-exact replays fix γ (pipelining stays on)."""
    client = Client(small_stack.address)

    def run(seed: int) -> list[int]:
        return client.generate(
            "abcab", strategy="speculative", num_speculative_tokens=3, temperature=1.0, seed=seed,
            max_new_tokens=20, ignore_eos=True,
        ).token_ids

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_sessions_are_freed_after_each_generation(llama_stack: Stack) -> None:
    Client(llama_stack.address).generate(PROMPT, strategy="speculative", max_new_tokens=5, stop_strings=["("])
    servicers = (llama_stack.target.servicer, llama_stack.draft.servicer)
    llama_stack.loop.run(_until(lambda: all(s.active_sessions == 0 for s in servicers)))


async def _until(condition: Any, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "sessions still open"
        await asyncio.sleep(0.01)


def test_speculative_without_a_draft_service_is_a_failed_precondition(
    loop: LoopThread, llama_stack: Stack, llama_target_dir: Path
) -> None:
    orchestrator = loop.run(start_orchestrator(llama_stack.target.address, None, str(llama_target_dir)))
    try:
        with pytest.raises(GenerationError) as error:
            Client(orchestrator.address).generate(PROMPT, strategy="speculative", max_new_tokens=4)
        assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION and "draft" in error.value.message
    finally:
        loop.run(orchestrator.running.server.stop(0))


def test_ngram_drafter_accepts_text_that_repeats_the_prompt(llama_ngram_stack: Stack) -> None:
    info = Client(llama_ngram_stack.address).info()
    assert "ngram" in info.draft_capabilities
    result = Client(llama_ngram_stack.address).generate(
        PROMPT, strategy="speculative", num_speculative_tokens=6, max_new_tokens=48, ignore_eos=True
    )
    assert result.stats.accepted_tokens > 0 and result.stats.draft_forwards == 0
    check_stats_add_up(result.stats, untrimmed=True)


def test_draft_service_builds_the_ngram_drafter_from_the_target_dir(llama_target_dir: Path) -> None:
    config = ModelServiceConfig(role="draft", model=str(llama_target_dir), drafter="ngram", ngram_max=4, ngram_min=2)
    clock = StartupClock()
    backend = build_backend(config, clock)
    assert isinstance(backend, NgramDrafter) and (backend.ngram_max, backend.ngram_min) == (4, 2)
    assert [name for name, _ in clock.phases] == ["load"]
    with pytest.raises(InvalidArgument):
        build_backend(ModelServiceConfig(role="draft", model=str(llama_target_dir), drafter="ngram", ngram_min=0), clock)


def test_cli_json_shows_the_speculative_statistics(
    llama_ngram_stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", "--address", llama_ngram_stack.address, "--prompt", PROMPT, "--strategy", "speculative"]
    argv += ["--num-speculative-tokens", "3", "--max-new-tokens", "12", "--ignore-eos", "--json"]
    assert cli_main(argv) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    for name in ("drafted_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_length", "corrections"):
        assert name in stats
    decided = stats["accepted_tokens"] + stats["corrections"] + stats["bonus_tokens"] + stats["target_only_tokens"]
    assert stats["new_tokens"] == 12 == decided  # rounds with no n-gram match are target-only
    assert sum(stats["accepted_length_histogram"]) == stats["rounds"] - stats["speculation_off_rounds"]
