"""What this machine allows each strategy at best: the engine's own costs, measured in process,
and the ratios to greedy that no network, orchestrator or scheduling work could improve on.

    specwire bounds [--target-model DIR] [--draft-model DIR] [--medusa DIR] [--threads N] [--quantize M] [--json]

Measured, median, the engine as the services run it (`--compile auto`):
- one session's cached forward at 1 … 65 new positions (`--positions`), all scored (`Engine.measure_costs`:
  the curve a service reports in `Info.forward_costs`), and a token of a 16-token greedy round
  (t_g: what `specwire_greedy` pays a token, before any message);
- one decode step of 1 and of 8 sessions together (`Scheduler.time_decode_step`);
- the draft's token in a greedy round (t_d);
- the Medusa heads' expected accepted tokens E(N) for the best N-node tree on greedy
  continuations of held-out text (`tune_medusa_tree`);
- one float32 matrix product (`nn.functional.linear`) at 1 … 16 rows, for the demo target's
  output layer and for a 64 MiB weight: does a larger model make extra rows cheap here?

Bounds, each a best case (no message, no token choice, no orchestrator):
- batching: 8 streams ÷ one ≤ 8·t(1 row) / t(8 rows); with 8 streams always in flight each
  stream's time per token is 8 / (the aggregate rate) (Little's law), so their per-token latency
  ÷ one stream's ≥ 8 / that ratio;
- speculative sampling at acceptance α: a round of γ drafts yields E = (1 − α^(γ+1))/(1 − α)
  tokens (Leviathan et al. 2023, Eq. 1) and costs γ·t_d + t_v(γ+1); the best ratio to greedy
  over γ ≤ 16 is max_γ t_g·E / (γ·t_d + t_v(γ+1)), and with a free draft max_γ t_g·E / t_v(γ+1);
- speculation at S streams (`--streams`), each session's round verified in one forward of all S
  rows (`Scheduler.time_verification`) and drafted in the draft's S-row steps: the best ratio to S
  greedy streams is max_γ t_g(S)·E / (γ·t_d(S) + t_v(S, γ+1)), t_g(S) and t_d(S) the fused
  S-row steps (each stream a token); the draft's steps add, since the services share the cores;
- Medusa: with K heads a round accepts at most K tokens, scoring at least d + 1 positions to
  accept d: perfect heads reach at most max_{d ≤ K} t_g·(d + 1) / t_v(d + 1); the shipped
  heads at most max_N t_g·(1 + E(N)) / t_v(N + 1).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from specwire.bench.bench import machine_info, model_label
from specwire.bench.report import emit
from specwire.bench.shapes import SHAPES, random_lm
from specwire.orchestrator.speedup import expected_tokens_per_round, forward_cost_at
from specwire.target_service.tune_medusa_tree import measure as tune

from specwire.config import QUANTIZE_MODES
from specwire.demo import demo_draft_dir, demo_medusa_dir, demo_target_dir
from specwire.engine import CausalLM, Engine, EngineLimits
from specwire.engine.model import resolve_device, resolve_dtype
from specwire.engine.scheduler import synchronize
from specwire.feature_drafter import is_feature_drafter
from specwire.medusa import MedusaHeads

SCHEMA = "specwire.bounds/1"
POSITIONS = (1, 2, 3, 4, 5, 6, 8, 9, 12, 13, 16, 17, 24, 25, 33, 49, 65)
GREEDY_ROUND = 16
# 0.6 and 0.65: what the Gemma-3-270M pair's draft is accepted at in sampled rounds.
ALPHAS = (0.6, 0.65, 0.7, 0.77, 0.8, 0.9, 0.95)
MAX_GAMMA = 16
STREAMS = 8
STREAM_GAMMAS = (1, 2, 3, 4, 5, 7)  # γ timed at S streams: a compiled shape each
MATMUL_SHAPES = ((256, 4096), (1024, 4096), (2048, 8192))  # (in, out) features
MATMUL_ROWS = (1, 2, 5, 8, 16)
CPU = torch.device("cpu")


def matmul_scaling(repeats: int, device: torch.device = CPU, dtype: torch.dtype = torch.float32) -> list[dict[str, Any]]:
    """Median µs of x[rows, in] @ W[out, in]ᵀ, and each as a multiple of one row's."""
    report = []
    for features_in, features_out in MATMUL_SHAPES:
        weight = torch.randn(features_out, features_in, device=device, dtype=dtype)
        times = {}
        for rows in MATMUL_ROWS:
            x = torch.randn(rows, features_in, device=device, dtype=dtype)
            samples = []
            for _ in range(repeats + 3):
                started = time.perf_counter()
                torch.nn.functional.linear(x, weight)
                synchronize(device)
                samples.append(time.perf_counter() - started)
            times[rows] = statistics.median(samples[3:]) * 1e6
        report.append({
            "shape": [features_in, features_out], "weight_mib": features_in * features_out * weight.element_size() / 2**20,
            "us_by_rows": times, "times_one_row": {rows: us / times[1] for rows, us in times.items()},
        })
    return report


def speculative_bound(
    alpha: float, greedy_ms: float, draft_ms: float, verify: list[tuple[int, float]],
    gammas: Sequence[int] = range(1, MAX_GAMMA + 1),
) -> dict[str, float]:
    """The best ratio to greedy over `gammas`, with the draft's cost and with a free draft. At S
    streams: `greedy_ms` and `draft_ms` S-row steps, `verify` the S-row verifications timed, and
    `gammas` those timed (`STREAM_GAMMAS`)."""

    def ratio(gamma: int, draft: float) -> float:
        cost = gamma * draft + forward_cost_at(verify, gamma + 1)
        return greedy_ms * expected_tokens_per_round(alpha, gamma) / cost

    best = max(gammas, key=lambda gamma: ratio(gamma, draft_ms))
    free = max(gammas, key=lambda gamma: ratio(gamma, 0.0))
    return {
        "alpha": alpha,
        "best_gamma": best,
        "ratio_vs_greedy": ratio(best, draft_ms),
        "free_draft_best_gamma": free,
        "free_draft_ratio_vs_greedy": ratio(free, 0.0),
    }


def medusa_bounds(
    greedy_ms: float, verify: list[tuple[int, float]], heads: int, expected: dict[int, float]
) -> dict[str, Any]:
    perfect = {d: greedy_ms * (d + 1) / forward_cost_at(verify, d + 1) for d in range(1, heads + 1)}
    shipped = {n: greedy_ms * (1 + e) / forward_cost_at(verify, n + 1) for n, e in expected.items()}
    return {
        "heads": heads,
        "perfect_heads_ratio_vs_greedy": max(perfect.values()),
        "perfect_heads_by_depth": perfect,
        "expected_accepted_by_nodes": expected,
        "shipped_heads_ratio_vs_greedy": max(shipped.values()) if shipped else None,
        "shipped_heads_by_nodes": shipped,
    }


def _load(role: str, args: argparse.Namespace) -> CausalLM:
    """The `role` model: a directory, or a published shape with random weights on `--device`."""
    shape = getattr(args, f"{role}_shape")
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if shape:
        return random_lm(shape, str(device), dtype, args.quantize)
    return CausalLM.load(getattr(args, f"{role}_model"), device=str(device), dtype=str(dtype).removeprefix("torch."),
                         quantization=args.quantize)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    streams = sorted({1, *args.streams})
    limits = EngineLimits(max_batch_rows=max(streams) + 1, max_cache_len=1024, compile=args.compile)
    # The target is timed before the draft's engine exists: timed after it was built, Gemma-3-270M's
    # target took 13.8 ms a forward at one position; before, 8.0, what its service serves (2 cores).
    # A second thread count set in the process is enough: after torch.set_num_threads(1) then (2)
    # on the main thread, the forward thread's 5-position forward took 21.4 ms, not 10.5 (more
    # OpenMP workers than cores, and libgomp stops their spinning; `scheduler` module docstring).
    target = Engine(_load("target", args), "target", limits)
    target.warmup()
    verify, greedy_ms = target.measure_costs(repeats=args.repeats, positions=args.positions, decode_tokens=GREEDY_ROUND)
    assert target.scheduler is not None
    steps = {rows: target.scheduler.time_decode_step(rows, start=96) for rows in streams}
    many = [rows for rows in streams if rows > 1]
    verify_at = {rows: {gamma + 1: target.scheduler.time_verification(rows, gamma + 1, start=96, repeats=args.repeats)
                        for gamma in STREAM_GAMMAS} for rows in many}
    draft = Engine(_load("draft", args), "draft", limits)
    draft.warmup()
    _, draft_ms = draft.measure_costs(repeats=args.repeats, positions=(1,), decode_tokens=GREEDY_ROUND)
    assert draft.scheduler is not None
    draft_steps = {rows: draft.scheduler.time_decode_step(rows, start=96) for rows in many}
    fused = all(step[1] is not None for step in steps.values())
    step_ms = {rows: step[1] if fused and step[1] is not None else step[0] for rows, step in steps.items()}
    draft_step_ms = {rows: step[1] if step[1] is not None else step[0] for rows, step in draft_steps.items()}
    batching = {rows: rows * step_ms[1] / ms for rows, ms in step_ms.items()}
    started_at = datetime.now(timezone.utc)
    report: dict[str, Any] = {
        "metadata": {
            "schema": SCHEMA,
            "date": started_at.isoformat(timespec="seconds"),
            "target_model": target.lm.name if args.target_shape else model_label(args.target_model, demo_target_dir()),
            "draft_model": draft.lm.name if args.draft_shape else model_label(args.draft_model, demo_draft_dir()),
            "machine": machine_info(),
        },
        "threads": args.threads,
        "device": str(target.lm.device),
        "dtype": str(target.lm.dtype).removeprefix("torch."),
        "compiled": target.scheduler.compiled,
        "quantization": {"target": target.lm.quantization, "draft": draft.lm.quantization},
        "target": {"forward_costs_ms": dict(verify), "greedy_ms_per_token": greedy_ms},
        "draft": {"greedy_ms_per_token": draft_ms},
        "batching": {
            "step_ms_by_rows": {rows: step[0] for rows, step in steps.items()},
            "fused_step_ms_by_rows": {rows: step[1] for rows, step in steps.items()} if fused else None,
            "streams_vs_1_at_most": batching,
            "p50_latency_vs_1_at_least": {rows: rows / ratio for rows, ratio in batching.items()},
        },
        "speculative": [speculative_bound(alpha, greedy_ms, draft_ms, verify) for alpha in ALPHAS],
        "streams": {
            rows: {
                "verify_ms_by_positions": verify_at[rows],
                "draft_step_ms": draft_step_ms[rows],
                "speculative": [speculative_bound(alpha, step_ms[rows], draft_step_ms[rows], list(verify_at[rows].items()),
                                                  STREAM_GAMMAS) for alpha in ALPHAS],
            } for rows in many
        },
        "matmul": matmul_scaling(args.repeats * 4, target.lm.device, target.lm.dtype),
    }
    if args.medusa and Path(args.medusa).is_dir() and not args.target_shape and not is_feature_drafter(args.medusa):
        tuned = tune(argparse.Namespace(
            model=args.target_model, heads=args.medusa, nodes=24, prompts=args.medusa_prompts, prompt_chars=300,
            new_tokens=64, max_rank=6, threads=args.threads,
        ))
        heads = MedusaHeads.load(args.medusa).num_heads
        report["medusa"] = medusa_bounds(greedy_ms, verify, heads, tuned["expected_accepted_by_nodes"])
    return report


def positions_list(text: str) -> tuple[int, ...]:
    """`--positions`: ascending, with 1 (the decode step every ratio divides by)."""
    values = {int(n) for n in text.split(",")}
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"--positions must be ≥ 1, got {text}")
    return tuple(sorted(values | {1}))


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser("bounds")
    parser.add_argument("--target-model", default=str(demo_target_dir()))
    parser.add_argument("--draft-model", default=str(demo_draft_dir()))
    parser.add_argument("--medusa", default=str(demo_medusa_dir()), help="heads directory ('' to skip)")
    parser.add_argument("--medusa-prompts", type=int, default=16, help="held-out prompts for the heads' E(N)")
    parser.add_argument("--target-shape", choices=sorted(SHAPES), help="random weights of this published shape instead of --target-model")
    parser.add_argument("--draft-shape", choices=sorted(SHAPES), help="random weights of this published shape instead of --draft-model")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    parser.add_argument("--dtype", default="float32", help="auto, float32, bfloat16 or float16")
    parser.add_argument("--compile", default="auto", choices=("auto", "on", "off"), help="the engines' --compile")
    parser.add_argument("--streams", type=lambda text: [int(n) for n in text.split(",")], default=[STREAMS],
                        help="decode steps of this many rows are timed, comma-separated (1 always)")
    # On CUDA each width is a graph of its own to capture: fewer widths, a shorter start.
    parser.add_argument("--positions", type=positions_list, default=POSITIONS,
                        help="the target's forward is timed at these new positions, comma-separated (1 always)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a service's share of the cores)")
    parser.add_argument("--quantize", default="auto", help=f"both models' --quantize ({', '.join(QUANTIZE_MODES)})")
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", help="also write the JSON report here")
    parser.set_defaults(command_line=None)  # the `specwire` command line sets it, for the report's metadata
    return parser


def run(args: argparse.Namespace) -> int:
    report = measure(args)
    report["metadata"]["command"] = args.command_line
    if emit(report, args.out, args.json):
        return 0
    target, batching = report["target"], report["batching"]
    print(f"greedy: {target['greedy_ms_per_token']:.3f} ms a token; draft {report['draft']['greedy_ms_per_token']:.3f}")
    print("forward at n positions, ms: " + ", ".join(f"{n}: {ms:.2f}" for n, ms in target["forward_costs_ms"].items()))
    for rows, ratio in batching["streams_vs_1_at_most"].items():
        print(f"{rows} streams ÷ 1 ≤ {ratio:.2f}; their p50 latency ÷ one stream's ≥ "
              f"{batching['p50_latency_vs_1_at_least'][rows]:.2f}")
    for row in report["speculative"]:
        print(f"speculative at α = {row['alpha']}: ≤ {row['ratio_vs_greedy']:.2f}× greedy (γ = {row['best_gamma']}), "
              f"free draft ≤ {row['free_draft_ratio_vs_greedy']:.2f}× (γ = {row['free_draft_best_gamma']})")
    for rows, bound in report["streams"].items():
        for row in bound["speculative"]:
            print(f"{rows} speculative streams at α = {row['alpha']}: ≤ {row['ratio_vs_greedy']:.2f}× {rows} greedy ones "
                  f"(γ = {row['best_gamma']}), free draft ≤ {row['free_draft_ratio_vs_greedy']:.2f}×")
    for product in report["matmul"]:
        ratios = ", ".join(f"{rows}: {ratio:.2f}" for rows, ratio in product["times_one_row"].items())
        print(f"matrix product {product['shape']} ({product['weight_mib']:.0f} MiB), × one row's time: {ratios}")
    if "medusa" in report:
        medusa = report["medusa"]
        print(f"medusa: perfect {medusa['heads']} heads ≤ {medusa['perfect_heads_ratio_vs_greedy']:.2f}× greedy, "
              f"the shipped heads ≤ {medusa['shipped_heads_ratio_vs_greedy']:.2f}×")
    return 0
