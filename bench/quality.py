"""`specwire quality`: what quantised weights buy in speed and cost in output, against float.

    specwire quality --model DIR [--quantize int8,int4] [--compile auto] [--threads N] [--json]

For each mode (float included), on the model's own engine as a service runs it (`--compile`):
- speed: one session's cached forward at 1, 2, 5, 8 and 16 new positions (ms, median, after 64
  tokens), and greedy tokens per second in a 16-token round (`Engine.measure_costs`);
- held-out perplexity: exp of the mean next-token negative log-likelihood over the held-out
  files of the Python standard library (`specwire.demo.train_pair`'s split: text no demo model
  was trained on), in windows of `--window` tokens, float's beside it;
- top-1 agreement: the share of those positions where the mode's argmax equals the float model's;
- greedy agreement: over the bench prompts, the share of `--new-tokens` greedy tokens equal to
  the float model's, and the share of prompts whose whole continuation is equal.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

import torch
from specwire.bench.bench import DEFAULT_PROMPTS

from specwire.demo import train_pair
from specwire.engine import CausalLM, Engine, EngineLimits
from specwire.session import OpenRequest, ScoreKind, Scoring, StepRequest


def held_out_windows(tokenizer: Any, windows: int, window: int) -> list[list[int]]:
    """`windows` token windows of `window` tokens from the held-out stdlib files, in file order."""
    out: list[list[int]] = []
    for _, text in train_pair.load_corpus().val:
        ids = tokenizer(text).input_ids
        for start in range(0, len(ids) - window + 1, window):
            out.append(ids[start : start + window])
            if len(out) == windows:
                return out
    return out


def last_logits(engine: Engine, ids: list[int], positions: int) -> torch.Tensor:
    """Teacher-forced logits of the last `positions` positions of `ids`, in a session of their
    own: [positions, vocab] float32."""
    session = engine.new_session()
    try:
        opened = session.open(OpenRequest(prompt_ids=ids, scoring=Scoring(ScoreKind.LOGITS, positions=positions)))
    finally:
        session.close()
    assert opened.scores is not None and opened.scores.dense is not None
    return opened.scores.dense.float().reshape(positions, -1)


def window_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """Teacher-forced logits of every position but the last: [len − 1, vocab] float32."""
    return last_logits(engine, ids, len(ids))[:-1]


def greedy(engine: Engine, ids: list[int], new_tokens: int) -> list[int]:
    session = engine.new_session()
    try:
        opened = session.open(OpenRequest(prompt_ids=ids, scoring=Scoring(ScoreKind.ARGMAX)))
        assert opened.scores is not None and opened.scores.argmax_ids is not None
        first = int(opened.scores.argmax_ids[0])
        step = session.step(StepRequest(append_ids=[first], propose=new_tokens - 1, propose_greedy=True,
                                        propose_ids_only=True))
        assert step.proposed_ids is not None
        return [first, *step.proposed_ids[0].tolist()]
    finally:
        session.close()


SPEED_POSITIONS = (1, 2, 5, 8, 16)


def speed(engine: Engine) -> dict[str, Any]:
    costs, decode_ms = engine.measure_costs(positions=SPEED_POSITIONS, decode_tokens=16)
    return {"forward_ms": {str(n): ms for n, ms in costs}, "greedy_tokens_per_s": 1e3 / decode_ms if decode_ms else None,
            "forward_ratio_8_vs_1": costs[SPEED_POSITIONS.index(8)][1] / costs[0][1] if costs else None}


def measure(model: str, modes: list[str], windows: int, window: int, new_tokens: int,
            compile_mode: str = "auto") -> dict[str, Any]:
    engines = {mode: Engine(CausalLM.load(model, device="cpu", dtype="float32", quantization=mode), "target",
                            EngineLimits(compile=compile_mode, max_batch_rows=2, max_cache_len=max(window, 512)))
               for mode in ["none", *modes]}
    tokenizer = engines["none"].lm.tokenizer
    assert tokenizer is not None, "the model directory has no tokenizer"
    texts = held_out_windows(tokenizer, windows, window)
    nll = dict.fromkeys(engines, 0.0)
    agree = dict.fromkeys(modes, 0)
    positions = 0
    for ids in texts:
        targets = torch.tensor(ids[1:])
        float_logits = None
        for mode, engine in engines.items():
            logits = window_logits(engine, ids)
            nll[mode] += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
            if mode == "none":
                float_logits = logits
            else:
                assert float_logits is not None
                agree[mode] += int((logits.argmax(-1) == float_logits.argmax(-1)).sum())
        positions += len(ids) - 1
    prompts = [tokenizer(p).input_ids for p in DEFAULT_PROMPTS]
    continuations = {mode: [greedy(engine, ids, new_tokens) for ids in prompts] for mode, engine in engines.items()}
    report: dict[str, Any] = {"model": model, "held_out_positions": positions, "new_tokens": new_tokens,
                              "compile": compile_mode, "threads": torch.get_num_threads(),
                              "float32_perplexity": math.exp(nll["none"] / max(1, positions)),
                              "float32_speed": speed(engines["none"]), "modes": {}}
    for mode in modes:
        same = [sum(a == b for a, b in zip(ours, theirs, strict=True))
                for ours, theirs in zip(continuations[mode], continuations["none"], strict=True)]
        report["modes"][mode] = {
            "perplexity": math.exp(nll[mode] / max(1, positions)),
            "top1_agreement": agree[mode] / max(1, positions),
            "greedy_token_agreement": sum(same) / (new_tokens * len(prompts)),
            "greedy_prompts_identical": sum(s == new_tokens for s in same) / len(prompts),
            "speed": speed(engines[mode]),
        }
    return report


def add_parser(commands: Any) -> None:
    parser = commands.add_parser("quality")
    parser.add_argument("--model", required=True, help="model directory (or FILE.gguf)")
    parser.add_argument("--quantize", default="int8,int4", help="comma-separated modes to compare with float")
    parser.add_argument("--windows", type=int, default=16, help="held-out windows scored")
    parser.add_argument("--window", type=int, default=256, help="tokens per window")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per bench prompt")
    parser.add_argument("--compile", default="auto", choices=["auto", "on", "off"], help="as a service's --compile")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default, every core)")
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    modes = [m.strip() for m in args.quantize.split(",") if m.strip() and m.strip() != "none"]
    if args.threads:
        torch.set_num_threads(args.threads)
    report = measure(args.model, modes, args.windows, args.window, args.new_tokens, args.compile)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{report['model']}: {report['held_out_positions']} held-out positions, "
          f"float32 perplexity {report['float32_perplexity']:.3f}, {_speed_line(report['float32_speed'])}")
    for mode, figures in report["modes"].items():
        print(f"{mode}: perplexity {figures['perplexity']:.3f}, top-1 agreement {figures['top1_agreement']:.1%}, "
              f"greedy tokens equal {figures['greedy_token_agreement']:.1%}, "
              f"prompts identical {figures['greedy_prompts_identical']:.0%}, {_speed_line(figures['speed'])}")
    return 0


def _speed_line(figures: dict[str, Any]) -> str:
    forwards = ", ".join(f"{n}: {ms:.1f}" for n, ms in figures["forward_ms"].items())
    return f"greedy {figures['greedy_tokens_per_s'] or 0:.1f} tok/s, forward ms at n positions {forwards}"
