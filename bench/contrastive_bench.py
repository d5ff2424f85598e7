"""Which wire plan should contrastive decoding use? Time steps of each over real services.

`python -m specwire.bench.contrastive_bench [--json]` builds a random Llama expert/amateur pair with
a realistic vocabulary (32k by default; the numbers are about the wire, not the text), starts each
as its own `specwire serve target|draft` process on loopback (one torch thread each, so the two
forwards can overlap), and runs `orchestrator.contrastive.contrastive` with each `WirePlan`,
interleaved, reporting the median and p90 milliseconds per decoding step (prefill excluded) and
the bytes each service sent per step:

- same / float32: the amateur's dense logits in the expert's round (the default);
- same / float16: the same, half the bytes, not exact;
- second: the expert first, then the amateur for the plausible ids only (`Scoring.score_ids`).

Contrastive decoding: Li et al. 2022 (arXiv:2210.15097); O'Brien & Lewis 2023 (arXiv:2309.09117).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from specwire.orchestrator.context import DecodeContext
from specwire.orchestrator.contrastive import WirePlan, contrastive
from specwire.orchestrator.models import RemoteModel
from specwire.orchestrator.params import GenerationParams
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parent.parent
PLANS: dict[str, WirePlan] = {
    "same/float32": WirePlan(amateur_round="same", amateur_dtype="float32"),
    "same/float16": WirePlan(amateur_round="same", amateur_dtype="float16"),
    "second": WirePlan(amateur_round="second"),
}


@dataclass
class PlanResult:
    plan: str
    median_ms_per_step: float
    p90_ms_per_step: float
    expert_ms_per_step: float
    amateur_ms_per_step: float
    expert_bytes_received_per_step: float
    amateur_bytes_received_per_step: float
    mean_valid_set_size: float
    steps: int


def save_model(path: Path, vocab: int, hidden: int, layers: int, seed: int) -> Path:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=2048,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked enough that plausible sets stay small
    model.save_pretrained(path)
    return path


def start_service(role: str, model: Path) -> tuple[subprocess.Popen[str], str]:
    """`specwire serve ROLE` on a free port; returns the process and its address once READY."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "specwire", "serve", role, "--model", str(model), "--port", "0",
               "--device", "cpu", "--dtype", "float32"]
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("READY"):
            return process, line.split()[-1]
    raise RuntimeError(f"{role} service exited before READY (code {process.wait()})")


async def time_plan(
    target: RemoteModel, draft: RemoteModel, params: GenerationParams, prompt_ids: list[int], plan: WirePlan
) -> tuple[list[float], DecodeContext]:
    """Milliseconds per decoding step (the first, prefill, left out) and the run's context."""
    ctx = DecodeContext(
        params=params,
        prompt_ids=prompt_ids,
        target=target,
        draft=draft,
        eos_token_ids=frozenset(),
        generator=torch.Generator().manual_seed(0),
    )
    step_ms: list[float] = []
    decided = contrastive(ctx, plan)
    started = time.perf_counter()
    try:
        async for _ in decided:
            now = time.perf_counter()
            step_ms.append((now - started) * 1e3)
            started = now
            if len(step_ms) > params.max_new_tokens:
                break
    finally:
        await decided.aclose()
        await ctx.close()
    return step_ms[1:], ctx


async def bench(args: argparse.Namespace, target_address: str, draft_address: str) -> list[PlanResult]:
    target = await RemoteModel.connect(target_address, "target", 60.0)
    draft = await RemoteModel.connect(draft_address, "draft", 60.0)
    params = GenerationParams(strategy="contrastive", max_new_tokens=args.steps, cd_form=args.form)
    prompt_ids = torch.randint(1, args.vocab, (args.prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    samples: dict[str, list[float]] = {name: [] for name in PLANS}
    totals: dict[str, list[DecodeContext]] = {name: [] for name in PLANS}
    await time_plan(target, draft, params, prompt_ids, PLANS["same/float32"])  # warm-up
    for _ in range(args.repeats):
        for name, plan in PLANS.items():
            step_ms, ctx = await time_plan(target, draft, params, prompt_ids, plan)
            samples[name] += step_ms
            totals[name].append(ctx)
    await target.close()
    await draft.close()
    results = []
    for name, step_ms in samples.items():
        contexts = totals[name]
        steps = sum(ctx.stats.contrastive_steps for ctx in contexts)
        results.append(
            PlanResult(
                plan=name,
                median_ms_per_step=statistics.median(step_ms),
                p90_ms_per_step=statistics.quantiles(step_ms, n=10)[-1],
                expert_ms_per_step=sum(c.stats.target.client_ms for c in contexts) / steps,
                amateur_ms_per_step=sum(c.stats.draft.client_ms for c in contexts) / steps,
                expert_bytes_received_per_step=sum(c.stats.target.bytes_received for c in contexts) / steps,
                amateur_bytes_received_per_step=sum(c.stats.draft.bytes_received for c in contexts) / steps,
                mean_valid_set_size=sum(c.stats.valid_set_sizes for c in contexts) / steps,
                steps=len(step_ms),
            )
        )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--expert-hidden", type=int, default=512)
    parser.add_argument("--expert-layers", type=int, default=6)
    parser.add_argument("--amateur-hidden", type=int, default=128)
    parser.add_argument("--amateur-layers", type=int, default=2)
    parser.add_argument("--form", choices=["obrien", "li"], default="obrien")
    parser.add_argument("--steps", type=int, default=48, help="decoding steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per plan, interleaved")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        expert = save_model(Path(tmp) / "expert", args.vocab, args.expert_hidden, args.expert_layers, seed=1)
        amateur = save_model(Path(tmp) / "amateur", args.vocab, args.amateur_hidden, args.amateur_layers, seed=2)
        processes: list[subprocess.Popen[str]] = []
        try:
            target_process, target_address = start_service("target", expert)
            processes.append(target_process)
            draft_process, draft_address = start_service("draft", amateur)
            processes.append(draft_process)
            results = asyncio.run(bench(args, target_address, draft_address))
        finally:
            for process in processes:
                process.terminate()
                process.wait(30)
    setup: dict[str, Any] = {k: v for k, v in vars(args).items() if k != "json"}
    if args.json:
        print(json.dumps({"setup": setup, "results": [asdict(r) for r in results]}, indent=2))
        return 0
    print(f"setup: {setup}")
    print(f"{'plan':<14}{'median ms/step':>16}{'p90':>8}{'expert ms':>11}{'amateur ms':>12}{'amateur B/step':>16}{'|V|':>7}")
    for r in results:
        print(
            f"{r.plan:<14}{r.median_ms_per_step:>16.2f}{r.p90_ms_per_step:>8.2f}{r.expert_ms_per_step:>11.2f}"
            f"{r.amateur_ms_per_step:>12.2f}{r.amateur_bytes_received_per_step:>16.0f}{r.mean_valid_set_size:>7.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
