"""`specwire experiment`: speculative decoding across emulated network round trips and γ.

For each RTT a stack is started with `specwire.client.launcher.Stack` — delay proxies in front of both
model services when RTT > 0 (one-way delay RTT/2, `specwire.delay_proxy`), direct loopback at 0 —
and for each strategy and γ the prompts are generated greedily with `ignore_eos`. Written to
`--out DIR`:

  results.csv           one row per RTT × strategy × γ (greedy and auto have no γ: one row per RTT):
                        tokens/s, α, t_d, t_v, the per-round time breakdown, bytes, and the
                        latency model's prediction;
  best_gamma.csv        per RTT: the best measured γ, the γ* the latency model predicts, and
                        auto γ's tokens/s against the best fixed γ's (`auto_vs_best_fixed`);
  summary.json          the same, plus the settings and the fitted model inputs;
  tokens_per_s_vs_rtt.png, best_gamma.png, round_breakdown.png.

The latency model (`specwire.orchestrator.speedup`): time per token = (γ·t_d + t_v + R)·(1 − α)/(1 − α^(γ+1)),
with α the per-token acceptance probability pooled over every speculative run (a property of
the model pair and prompts, not of the network); t_d and t_v from the server-reported compute of
a round (draft + target) fitted per RTT as t_v + γ·t_d over the γ values run (the marginal cost
of a drafted token, and the per-round part: the verify forward and per-call costs); and R the
rest of a round: `gamma_star_model` takes R as measured (network — each round visits both services, so
about 2 × RTT — plus serialization, queueing and orchestrator time), `gamma_star_nominal` takes
R = the configured RTT alone, as in the textbook form.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specwire.bench.bench import Sample, default_models, load_prompts, specwire_sample
from specwire.client.launcher import Stack, StackConfig, free_base_port
from specwire.orchestrator.speedup import alpha_estimate, best_gamma, time_per_token_ms

from specwire.extras import require

# "speculative": each γ fixed, sequential rounds (what the latency model describes); "auto": the
# defaults (γ chosen each round by the latency model, target-only fallback, pipelined drafting).
STRATEGIES = ("speculative", "greedy", "auto")


@dataclass(frozen=True)
class ExperimentConfig:
    target_model: str
    draft_model: str
    prompts: list[str]
    out_dir: Path
    rtts_ms: tuple[float, ...] = (0.0, 2.0, 10.0, 50.0)
    gammas: tuple[int, ...] = (1, 2, 4, 8)
    strategies: tuple[str, ...] = STRATEGIES
    max_new_tokens: int = 64
    repeats: int = 1
    jitter_ms: float = 0.0
    bandwidth_mbps: float = 0.0
    device: str = "auto"
    dtype: str = "auto"
    drafter: str = "model"
    max_gamma: int = 32  # the γ* search range is [1, max_gamma]
    show_progress: bool = True


@dataclass
class Measurement:
    """One RTT × strategy × γ cell: every prompt × repeat, summed."""

    rtt_ms: float
    strategy: str
    gamma: int | None
    samples: list[Sample]
    matches_greedy: float | None = None

    def total(self, name: str) -> float:
        return float(sum(getattr(s, name) or 0 for s in self.samples))

    @property
    def tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples)

    @property
    def rounds(self) -> int:
        return int(self.total("rounds"))

    def per_round(self, name: str) -> float:
        return self.total(name) / self.rounds if self.rounds else 0.0


def _params(strategy: str, gamma: int | None) -> dict[str, Any]:
    if strategy == "greedy":
        return {"strategy": "greedy"}
    if strategy == "auto":
        return {"strategy": "speculative"}
    return {"strategy": "speculative", "num_speculative_tokens": gamma, "speculative_pipeline": False}


def measure(config: ExperimentConfig, prompt_ids: list[list[int]], bar: Any) -> list[Measurement]:
    """Every RTT's stack in turn; the cells of one RTT run on the same stack."""
    from specwire.client.sdk import Client

    cells: list[Measurement] = []
    log_root = Path(tempfile.mkdtemp(prefix="specwire-experiment-"))
    for rtt in config.rtts_ms:
        stack_config = StackConfig(
            port=free_base_port(),
            target_model=config.target_model,
            draft_model=config.draft_model if config.drafter == "model" else config.target_model,
            drafter=config.drafter,
            device=config.device,
            dtype=config.dtype,
            rtt_ms=rtt,
            jitter_ms=config.jitter_ms if rtt > 0 else 0.0,
            bandwidth_mbps=config.bandwidth_mbps,
        )
        log_dir = log_root / f"rtt-{rtt:g}"
        log_dir.mkdir()
        bar.set_postfix_str(f"starting stack, RTT {rtt:g} ms")
        with Stack(stack_config) as stack, Client(stack_config.address, timeout=600) as client:
            stack.start(timeout=300, log_dir=log_dir)
            plan: list[tuple[str, int | None]] = [("greedy", None)] if "greedy" in config.strategies else []
            if "speculative" in config.strategies:
                plan += [("speculative", gamma) for gamma in config.gammas]
            if "auto" in config.strategies:
                plan.append(("auto", None))
            specwire_sample(client, _params(*plan[0]), prompt_ids[0], min(8, config.max_new_tokens))  # warm-up
            # Interleaved: each prompt runs under every strategy and γ in turn, so load that drifts
            # while an RTT is measured spreads over all its cells instead of biasing one.
            samples: dict[tuple[str, int | None], list[Sample]] = {cell: [] for cell in plan}
            bar.set_postfix_str(f"RTT {rtt:g} ms")
            for _ in range(config.repeats):
                for ids in prompt_ids:
                    for strategy, gamma in plan:
                        samples[strategy, gamma].append(
                            specwire_sample(client, _params(strategy, gamma), ids, config.max_new_tokens)
                        )
                        bar.update()
            greedy = samples.get(("greedy", None))
            for (strategy, gamma), cell_samples in samples.items():
                cell = Measurement(rtt, strategy, gamma, cell_samples)
                if greedy is not None:
                    same = sum(a.token_ids == b.token_ids for a, b in zip(cell_samples, greedy, strict=True))
                    cell.matches_greedy = same / len(cell_samples)
                cells.append(cell)
    return cells


@dataclass(frozen=True)
class ModelInputs:
    """What the latency model is fed for one RTT."""

    alpha: float
    draft_ms_per_token: float  # t_d: compute a round costs per drafted token
    verify_ms: float  # t_v: compute a round costs regardless of γ (the verify forward, per-call costs)
    fixed_ms_per_round: float  # R as measured: network + queue + orchestrator per round


def fit_compute(drafted_per_round: Sequence[float], compute_ms_per_round: Sequence[float]) -> tuple[float, float] | None:
    """Least-squares (slope, intercept) of a round's compute (draft + target) against γ.

    Per-call costs (the catch-up forward, framework overhead, the verify forward) do not grow
    with γ, so a ratio like draft ms / drafted tokens overstates t_d at small γ; the slope is the
    marginal cost of one more drafted token and the intercept the per-round part. None when
    fewer than two distinct γ were measured or the slope comes out negative (noise).
    """
    points = list(zip(drafted_per_round, compute_ms_per_round, strict=True))
    if len({round(g, 6) for g, _ in points}) < 2:
        return None
    mean_g = sum(g for g, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    slope = sum((g - mean_g) * (y - mean_y) for g, y in points) / sum((g - mean_g) ** 2 for g, _ in points)
    if slope < 0:
        return None
    return slope, mean_y - slope * mean_g


def fit_inputs(cells: list[Measurement], rtt: float, alpha: float) -> ModelInputs | None:
    """One RTT's speculative cells as the latency model's inputs: t_d and t_v from a linear fit of
    compute per round against γ (ratios when only one γ ran), R from the measured remainder."""
    spec = [c for c in cells if c.rtt_ms == rtt and c.strategy == "speculative" and c.rounds]
    drafted = sum(c.total("drafted") for c in spec)
    forwards = sum(c.total("target_forwards") for c in spec)
    rounds = sum(c.rounds for c in spec)
    if not spec or not drafted or not forwards:
        return None
    fixed = sum(c.total("network_ms") + c.total("queue_ms") + c.total("orchestrator_ms") for c in spec) / rounds
    fitted = fit_compute(
        [c.total("drafted") / c.rounds for c in spec],
        [c.per_round("draft_compute_ms") + c.per_round("target_compute_ms") for c in spec],
    )
    if fitted is not None:
        draft_ms_per_token, verify_ms = fitted
    else:
        draft_ms_per_token = sum(c.total("draft_compute_ms") for c in spec) / drafted
        verify_ms = sum(c.total("target_compute_ms") for c in spec) / forwards
    return ModelInputs(alpha, draft_ms_per_token, verify_ms, fixed)


def pooled_alpha(cells: list[Measurement]) -> float:
    spec = [c for c in cells if c.strategy == "speculative"]
    return alpha_estimate(int(sum(c.total("accepted") for c in spec)), int(sum(c.total("rejected") for c in spec)))


def result_rows(cells: list[Measurement], inputs: dict[float, ModelInputs | None]) -> list[dict[str, Any]]:
    greedy_tps = {c.rtt_ms: c.tokens / c.total("seconds") for c in cells if c.strategy == "greedy"}
    rows = []
    for c in cells:
        seconds = c.total("seconds")
        drafted, forwards = c.total("drafted"), c.total("target_forwards")
        tps = c.tokens / seconds if seconds else 0.0
        model = inputs.get(c.rtt_ms)
        predicted = None
        if model is not None and c.gamma is not None:
            per_token = time_per_token_ms(
                c.gamma, model.alpha, model.draft_ms_per_token, model.verify_ms, model.fixed_ms_per_round
            )
            predicted = 1e3 / per_token
        rows.append({
            "rtt_ms": c.rtt_ms,
            "strategy": c.strategy,
            "gamma": c.gamma,
            "generations": len(c.samples),
            "new_tokens": c.tokens,
            "seconds": seconds,
            "tokens_per_s": tps,
            "speedup_vs_greedy": tps / greedy_tps[c.rtt_ms] if greedy_tps.get(c.rtt_ms) else None,
            "predicted_tokens_per_s": predicted,
            "rounds": c.rounds,
            "tokens_per_round": c.tokens / c.rounds if c.rounds else None,
            "acceptance_rate": c.total("accepted") / drafted if drafted else None,
            "alpha": alpha_estimate(int(c.total("accepted")), int(c.total("rejected"))) if drafted else None,
            "t_d_ms": c.total("draft_compute_ms") / drafted if drafted else None,
            "t_v_ms": c.total("target_compute_ms") / forwards if forwards else None,
            "round_ms": c.per_round("server_wall_ms"),
            "draft_ms_per_round": c.per_round("draft_compute_ms"),
            "target_ms_per_round": c.per_round("target_compute_ms"),
            "network_ms_per_round": c.per_round("network_ms"),
            "queue_ms_per_round": c.per_round("queue_ms"),
            "orchestrator_ms_per_round": c.per_round("orchestrator_ms"),
            "bytes_per_round": c.per_round("bytes_total"),
            "matches_greedy": c.matches_greedy,
        })
    return rows


def best_gamma_rows(
    cells: list[Measurement], inputs: dict[float, ModelInputs | None], config: ExperimentConfig
) -> list[dict[str, Any]]:
    rows = []
    for rtt in config.rtts_ms:
        spec = [c for c in cells if c.rtt_ms == rtt and c.strategy == "speculative" and c.gamma is not None]
        if not spec:
            continue
        best = max(spec, key=lambda c: c.tokens / c.total("seconds"))
        model = inputs.get(rtt)
        row: dict[str, Any] = {"rtt_ms": rtt, "gamma_best_measured": best.gamma}
        row["tokens_per_s_best_measured"] = best.tokens / best.total("seconds")
        auto = next((c for c in cells if c.rtt_ms == rtt and c.strategy == "auto"), None)
        if auto is not None:
            row["tokens_per_s_auto"] = auto.tokens / auto.total("seconds")
            row["auto_vs_best_fixed"] = row["tokens_per_s_auto"] / row["tokens_per_s_best_measured"]
        if model is not None:
            args = (model.alpha, model.draft_ms_per_token, model.verify_ms)
            row["gamma_star_model"] = best_gamma(*args, model.fixed_ms_per_round, config.max_gamma)
            row["gamma_star_model_tested"] = min(
                config.gammas, key=lambda g: time_per_token_ms(g, *args, model.fixed_ms_per_round)
            )
            row["gamma_star_nominal"] = best_gamma(*args, rtt, config.max_gamma)
            row |= {f"model_{k}": v for k, v in asdict(model).items()}
        rows.append(row)
    return rows


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    if not rows:
        path.write_text("")
        return
    names = list(dict.fromkeys(name for row in rows for name in row))
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=names)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if v is None else v) for k, v in row.items()})


def plot(out_dir: Path, rows: list[dict[str, Any]], gamma_rows: list[dict[str, Any]]) -> list[Path]:
    """The three figures; returns their paths."""
    matplotlib = require("matplotlib", "plots", "specwire experiment")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    rtts = sorted({r["rtt_ms"] for r in rows})
    positions = {rtt: i for i, rtt in enumerate(rtts)}  # RTTs are spread evenly: 0 has no log

    fig, ax = plt.subplots(figsize=(7, 4.5))
    gammas = sorted({r["gamma"] for r in rows if r["gamma"] is not None})
    for gamma in gammas:
        line = sorted((r for r in rows if r["gamma"] == gamma), key=lambda r: r["rtt_ms"])
        xs = [positions[r["rtt_ms"]] for r in line]
        drawn = ax.plot(xs, [r["tokens_per_s"] for r in line], marker="o", label=f"speculative γ={gamma}")
        predicted = [(x, r["predicted_tokens_per_s"]) for x, r in zip(xs, line, strict=True) if r["predicted_tokens_per_s"]]
        if predicted:
            ax.plot(*zip(*predicted, strict=True), linestyle=":", color=drawn[0].get_color())
    greedy = sorted((r for r in rows if r["strategy"] == "greedy"), key=lambda r: r["rtt_ms"])
    if greedy:
        ax.plot([positions[r["rtt_ms"]] for r in greedy], [r["tokens_per_s"] for r in greedy],
                marker="s", color="black", linestyle="--", label="greedy (target only)")
    auto = sorted((r for r in rows if r["strategy"] == "auto"), key=lambda r: r["rtt_ms"])
    if auto:
        ax.plot([positions[r["rtt_ms"]] for r in auto], [r["tokens_per_s"] for r in auto],
                marker="D", color="red", label="auto γ, pipelined (defaults)")
    ax.set_xticks(range(len(rtts)), [f"{rtt:g}" for rtt in rtts])
    ax.set_xlabel("emulated RTT to each service (ms)")
    ax.set_ylabel("tokens / s")
    ax.set_title("Throughput vs RTT (dotted: latency model)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "tokens_per_s_vs_rtt.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    if gamma_rows:
        fig, ax = plt.subplots(figsize=(7, 4))
        xs = list(range(len(gamma_rows)))
        width = 0.27
        series = [("gamma_best_measured", "best measured γ"), ("gamma_star_model", "γ* (model, measured overhead)"),
                  ("gamma_star_nominal", "γ* (model, nominal RTT)")]
        for offset, (key, label) in zip((-width, 0.0, width), series, strict=True):
            ax.bar([x + offset for x in xs], [row.get(key) or 0 for row in gamma_rows], width, label=label)
        ax.set_xticks(xs, [f"{row['rtt_ms']:g}" for row in gamma_rows])
        ax.set_xlabel("emulated RTT (ms)")
        ax.set_ylabel("γ")
        ax.set_title("Best γ per RTT: measured vs latency model")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        paths.append(out_dir / "best_gamma.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(7, 0.6 * len(rows)), 4.5))
    parts = [("draft_ms_per_round", "draft compute"), ("target_ms_per_round", "target compute"),
             ("network_ms_per_round", "network + serialization"), ("queue_ms_per_round", "queue"),
             ("orchestrator_ms_per_round", "orchestrator")]
    ordered = sorted(rows, key=lambda r: (r["rtt_ms"], r["gamma"] or 0))
    bottoms = [0.0] * len(ordered)
    for key, label in parts:
        values = [r[key] or 0.0 for r in ordered]
        ax.bar(range(len(ordered)), values, bottom=bottoms, label=label)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    ax.set_xticks(range(len(ordered)), [f"{r['rtt_ms']:g}/{'g' if r['gamma'] is None else r['gamma']}" for r in ordered],
                  rotation=45, fontsize=8)
    ax.set_xlabel("RTT ms / γ  (g = greedy)")
    ax.set_ylabel("ms per round")
    ax.set_title("Where a round's time goes")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "round_breakdown.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def run_experiment(config: ExperimentConfig) -> dict[str, Any]:
    from tqdm import tqdm
    from transformers import AutoTokenizer

    began = time.perf_counter()
    config.out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(config.target_model)
    prompt_ids = [tokenizer(prompt).input_ids for prompt in config.prompts]
    per_rtt = (len(config.gammas) if "speculative" in config.strategies else 0) + ("greedy" in config.strategies)
    per_rtt += "auto" in config.strategies
    total = len(config.rtts_ms) * per_rtt * config.repeats * len(prompt_ids)
    with tqdm(total=total, desc="experiment", unit="gen", disable=not config.show_progress, file=sys.stderr) as bar:
        cells = measure(config, prompt_ids, bar)
    alpha = pooled_alpha(cells)
    inputs = {rtt: fit_inputs(cells, rtt, alpha) for rtt in config.rtts_ms}
    rows = result_rows(cells, inputs)
    gamma_rows = best_gamma_rows(cells, inputs, config)
    write_csv(config.out_dir / "results.csv", rows)
    write_csv(config.out_dir / "best_gamma.csv", gamma_rows)
    figures = plot(config.out_dir, rows, gamma_rows)
    summary = {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items() if k != "prompts"},
        "prompts": len(config.prompts),
        "alpha_pooled": alpha,
        "best_gamma": gamma_rows,
        "results": rows,
        "figures": [str(p) for p in figures],
        "duration_s": time.perf_counter() - began,
    }
    (config.out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(part) for part in text.split(",") if part.strip())


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser("experiment")
    parser.add_argument("--rtt-ms", default="0,2,10,50", help="comma-separated round-trip times to each service")
    parser.add_argument("--gamma", default="1,2,4,8", help="comma-separated γ values")
    parser.add_argument("--strategies", default="speculative,greedy,auto", help="comma-separated: speculative (fixed γ, sequential), greedy, auto (the defaults)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompts", help="a JSON list of prompts, or one prompt per line (\\n escapes)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--jitter-ms", type=float, default=0.0)
    parser.add_argument("--bandwidth-mbps", type=float, default=0.0)
    parser.add_argument("--target-model", help="target model directory (default: the demo target)")
    parser.add_argument("--draft-model", help="draft model directory (default: the demo draft)")
    parser.add_argument("--drafter", default="model", choices=["model", "ngram"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", required=True, help="output directory")
    return parser


def config_from_args(args: argparse.Namespace) -> ExperimentConfig:
    target, draft = default_models(args.target_model, args.draft_model)
    try:
        rtts, gammas = _floats(args.rtt_ms), _ints(args.gamma)
    except ValueError:
        raise SystemExit("--rtt-ms and --gamma take comma-separated numbers") from None
    strategies = tuple(s.strip() for s in args.strategies.split(",") if s.strip())
    bad = set(strategies) - set(STRATEGIES)
    if bad or not strategies:
        raise SystemExit(f"--strategies: choose from {', '.join(STRATEGIES)}; got {args.strategies!r}")
    if not rtts or any(r < 0 for r in rtts) or not gammas or any(g < 1 for g in gammas):
        raise SystemExit("--rtt-ms must be ≥ 0 and --gamma ≥ 1, at least one of each")
    return ExperimentConfig(
        target_model=target,
        draft_model=draft,
        prompts=load_prompts(args.prompts),
        out_dir=Path(args.out),
        rtts_ms=rtts,
        gammas=gammas,
        strategies=strategies,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        jitter_ms=args.jitter_ms,
        bandwidth_mbps=args.bandwidth_mbps,
        device=args.device,
        dtype=args.dtype,
        drafter=args.drafter,
    )


def print_summary(summary: dict[str, Any]) -> None:
    print(f"α (pooled) = {summary['alpha_pooled']:.3f}; took {summary['duration_s']:.0f} s")
    print("| RTT ms | strategy | γ | tok/s | predicted tok/s | speedup vs greedy | α | t_d ms | t_v ms | round ms | network ms/round |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in summary["results"]:
        cells = [r["rtt_ms"], r["strategy"], r["gamma"], r["tokens_per_s"], r["predicted_tokens_per_s"],
                 r["speedup_vs_greedy"], r["alpha"], r["t_d_ms"], r["t_v_ms"], r["round_ms"], r["network_ms_per_round"]]
        print("| " + " | ".join("–" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v) for v in cells) + " |")
    for row in summary["best_gamma"]:
        print(f"RTT {row['rtt_ms']:g} ms: best measured γ = {row['gamma_best_measured']}, "
              f"γ* model = {row.get('gamma_star_model')} (within tested: {row.get('gamma_star_model_tested')}), "
              f"γ* nominal = {row.get('gamma_star_nominal')}")
    for path in summary["figures"]:
        print(f"wrote {path}")


def run(args: argparse.Namespace) -> int:
    require("matplotlib", "plots", "specwire experiment")  # before minutes of measuring, not after
    summary = run_experiment(config_from_args(args))
    print_summary(summary)
    return 0
