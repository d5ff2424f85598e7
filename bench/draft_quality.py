"""`specwire draft-quality`: how well a draft matches its target, on the full vocabulary.

    specwire draft-quality --target DIR --draft DIR [--quantize none,int8] [--prompts NAME] [--json]

For the target as served with each `--quantize` mode (on its own engine, eager), and the draft as
a draft service loads it (a trimmed-vocabulary draft scores all ids, zero outside its own):
- on held-out stdlib windows (each after a BOS, as a served prompt starts), and on the target's
  own greedy continuations of the bench prompts (what a speculative round drafts against):
  α = Σ_x min(p(x), q(x)) (Leviathan et al. 2023, Def. 3.1; the expected acceptance of one
  sampled draft token), greedy agreement (argmax q = argmax p), top-2 agreement (argmax p among
  q's two best: what a second candidate per drafted position could catch), the target's mass outside the
  draft's ids, and KL(p‖q) on the draft's ids (p renormalised there; over all ids it is infinite
  for a trimmed draft). Exact, unlike the teacher cache's bounds (`specwire.sparse_distill`);
- on the target's sampled continuations of the bench prompts (`--samples` seeds each), p and q
  both warped as a sampled request warps them (`--temperature`, `--top-k`, `--top-p`; the
  bench's sampling row by default): what a sampled round accepts, α = Σ_x min(p_w(x), q_w(x)),
  and what one deterministic candidate would, p_w(argmax q_w) (no KL: warped q is zero on most ids);
- with `--blocks G`, at each position of those continuations a chain of G drafts drawn from q_w and
  scored by the target: the tokens a round of γ ≤ G emits in expectation (kept drafts and the next
  token) under token-by-token acceptance (Leviathan et al. 2023) and block verification (Sun et al.
  2024, what `specwire.acceptance` decides by), each exact given the chain.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from specwire.bench.bench import BASE_WARPERS, load_prompts
from specwire.bench.quality import greedy, held_out_windows, last_logits, window_logits
from specwire.draft_service.self_text import continuation

from specwire.acceptance import block_ends
from specwire.config import QUANTIZE_MODES
from specwire.engine import CausalLM, Engine, EngineLimits
from specwire.processing import ProcessingConfig, sampling_probs


def pair_sums(target_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """Per-position figures summed over positions: [α, agreement, mass outside, KL on the draft's
    ids, top-2 agreement].
    target_logits, draft_logits: [N, V] (−inf where the draft has no id)."""
    p, q = target_logits.float().softmax(-1), draft_logits.float().softmax(-1)  # [N, V]
    inside = torch.isfinite(draft_logits)  # [N, V]
    alpha = torch.minimum(p, q).sum(-1)
    best = p.argmax(-1, keepdim=True)  # [N, 1]
    top2 = q.topk(2, dim=-1).indices  # [N, 2]
    agree = (top2[:, 0:1] == best).float().squeeze(-1)
    agree_top2 = (top2 == best).any(-1).float()
    p_in = torch.where(inside, p, 0.0)
    mass_in = p_in.sum(-1, keepdim=True)  # [N, 1]
    renormed = p_in / mass_in
    kl = torch.where(inside & (renormed > 0), renormed * (renormed.log() - q.log()), 0.0).sum(-1)
    return torch.stack([alpha.sum(), agree.sum(), (1 - mass_in).sum(), kl.sum(), agree_top2.sum()])


def warped_sums(target_logits: torch.Tensor, draft_logits: torch.Tensor, warpers: ProcessingConfig) -> torch.Tensor:
    """Per-position figures summed over positions, p and q warped: [α, agreement, p_w(argmax q_w)]."""
    none = torch.zeros((len(target_logits), 1), dtype=torch.long)  # no penalties: no history read
    p, q = sampling_probs(target_logits, none, warpers), sampling_probs(draft_logits, none, warpers)  # [N, V]
    best = q.argmax(-1, keepdim=True)  # [N, 1]
    agree = (best == p.argmax(-1, keepdim=True)).float()
    return torch.stack([torch.minimum(p, q).sum(), agree.sum(), p.gather(-1, best).sum()])


def round_tokens(draft_tokens: torch.Tensor, q: torch.Tensor, p: torch.Tensor) -> tuple[float, float]:
    """Expected tokens a round emits given its drafts [γ] (q [γ, V], p [γ+1, V]): token-by-token,
    1 + Σ_t Π_{i≤t} min(1, p_i(x_i)/q_i(x_i)); by block, 1 + Σ_t t·h_t·Π_{i>t}(1 − h_i)."""
    index = draft_tokens.unsqueeze(-1)
    kept = (p[:-1].gather(-1, index) / q.gather(-1, index)).squeeze(-1).clamp_max(1.0).double().cumprod(0)
    h = block_ends(draft_tokens.unsqueeze(0), q.unsqueeze(0), p.unsqueeze(0))[0][0]  # [γ+1]
    later = torch.cat([torch.flip(torch.cumprod(torch.flip(1 - h[1:], [0]), 0), [0])[1:], h.new_ones(1)])  # Π_{i>t}(1 − h_i)
    ends = torch.arange(1, len(draft_tokens) + 1, dtype=torch.float64)
    return 1.0 + float(kept.sum()), 1.0 + float((ends * h[1:] * later).sum())


def block_sums(target: Engine, drafter: Engine, sequence: list[int], start: int, gamma: int, warpers: ProcessingConfig,
               generator: torch.Generator) -> torch.Tensor:
    """[2, γ]: `round_tokens` at γ' = 1…γ, token-by-token then block, summed over the positions
    from `start` on, each with a chain of γ drafts drawn from the warped draft."""
    none = torch.zeros((gamma + 1, 1), dtype=torch.long)
    sums = torch.zeros(2, gamma, dtype=torch.float64)
    for end in range(start, len(sequence)):
        drafts: list[int] = []
        rows = []
        for _ in range(gamma):
            q = sampling_probs(last_logits(drafter, sequence[:end] + drafts, 1), none[:1], warpers)[0]
            drafts.append(int(torch.multinomial(q, 1, generator=generator)))
            rows.append(q)
        p = sampling_probs(last_logits(target, sequence[:end] + drafts, gamma + 1), none, warpers)
        chain, q = torch.tensor(drafts), torch.stack(rows)
        for length in range(1, gamma + 1):
            sums[:, length - 1] += torch.tensor(round_tokens(chain[:length], q[:length], p[: length + 1]), dtype=torch.float64)
    return sums


def figures(sums: torch.Tensor, count: int) -> dict[str, float]:
    alpha, agree, outside, kl, agree_top2 = (sums / max(1, count)).tolist()
    return {"alpha": alpha, "greedy_agreement": agree, "top2_agreement": agree_top2,
            "target_mass_outside_draft": outside, "kl_on_draft_ids": kl}


def measure(target: str, draft: str, modes: list[str], windows: int, window: int, prompts: list[str], new_tokens: int,
            warpers: ProcessingConfig | None = None, samples: int = 3, blocks: int = 0) -> dict[str, Any]:
    limits = EngineLimits(compile="off", max_batch_rows=2, max_cache_len=max(window + 1, 512))
    drafter = Engine(CausalLM.load(draft, device="cpu", dtype="float32"), "draft", limits)
    tokenizer = drafter.lm.tokenizer
    assert tokenizer is not None, "the draft directory has no tokenizer"
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    texts = [bos + ids[len(bos) if ids[: len(bos)] == bos else 0 :][: window - len(bos)]
             for ids in held_out_windows(tokenizer, windows, window)]
    prompt_ids = [tokenizer(prompt).input_ids for prompt in prompts]
    report: dict[str, Any] = {"target": target, "draft": draft, "held_out_windows": len(texts), "window": window,
                              "prompts": len(prompts), "new_tokens": new_tokens, "modes": {}}
    for mode in modes:
        engine = Engine(CausalLM.load(target, device="cpu", dtype="float32", quantization=mode), "target", limits)
        held, held_count = torch.zeros(5), 0
        for ids in texts:
            held += pair_sums(window_logits(engine, ids), window_logits(drafter, ids))
            held_count += len(ids) - 1
        cont, cont_count = torch.zeros(5), 0
        for ids in prompt_ids:
            sequence = ids + greedy(engine, ids, new_tokens)
            scored = slice(len(ids) - 1, None)  # the positions whose next token is the continuation's
            cont += pair_sums(window_logits(engine, sequence)[scored], window_logits(drafter, sequence)[scored])
            cont_count += new_tokens
        report["modes"][mode] = {"held_out": figures(held, held_count), "continuations": figures(cont, cont_count)}
        if warpers is not None and samples:
            drawn, drawn_count = torch.zeros(3), 0
            rounds, generator = torch.zeros(2, blocks, dtype=torch.float64), torch.Generator().manual_seed(0)
            for index, ids in enumerate(prompt_ids):
                for seed in range(samples):
                    sequence = ids + continuation(engine, ids, new_tokens, set(), warpers, seed=1000 * index + seed)
                    scored = slice(len(ids) - 1, None)
                    drawn += warped_sums(window_logits(engine, sequence)[scored], window_logits(drafter, sequence)[scored],
                                         warpers)
                    drawn_count += new_tokens
                    if blocks:
                        rounds += block_sums(engine, drafter, sequence, len(ids), blocks, warpers, generator)
            alpha, agree, first = (drawn / max(1, drawn_count)).tolist()
            report["modes"][mode]["sampled"] = {"alpha": alpha, "greedy_agreement": agree, "candidate_acceptance": first}
            if blocks:
                token, block = (rounds / max(1, drawn_count)).tolist()
                report["modes"][mode]["sampled"]["round_tokens"] = {"token": token, "block": block}
    if warpers is not None:
        report["warpers"] = {"temperature": warpers.temperature, "top_k": warpers.top_k, "top_p": warpers.top_p,
                             "samples": samples}
    return report


def add_parser(commands: Any) -> None:
    parser = commands.add_parser("draft-quality")
    parser.add_argument("--target", required=True, help="target model directory")
    parser.add_argument("--draft", required=True, help="draft model directory (a trimmed-vocabulary one too)")
    parser.add_argument("--quantize", default="none", help=f"comma-separated target modes: {', '.join(QUANTIZE_MODES)}")
    parser.add_argument("--windows", type=int, default=16, help="held-out windows scored")
    parser.add_argument("--window", type=int, default=256, help="tokens per window, its BOS included")
    parser.add_argument("--prompts", help="the bench's --prompts (default: the bench's own)")
    parser.add_argument("--new-tokens", type=int, default=64, help="greedy target tokens per prompt")
    parser.add_argument("--samples", type=int, default=3, help="sampled continuations per prompt (0: none)")
    parser.add_argument("--temperature", type=float, default=BASE_WARPERS["temperature"], help="their warpers")
    parser.add_argument("--top-k", type=int, default=BASE_WARPERS["top_k"])
    parser.add_argument("--top-p", type=float, default=BASE_WARPERS["top_p"])
    parser.add_argument("--blocks", type=int, default=0,
                        help="γ: tokens a sampled round of 1…γ drafts emits, token-by-token and by block (0: skip)")
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    modes = [m.strip() for m in args.quantize.split(",") if m.strip()]
    if args.samples < 0 or args.blocks < 0 or args.temperature <= 0 or args.top_k < 0 or not 0 < args.top_p <= 1:
        raise SystemExit("--samples, --blocks and --top-k must be ≥ 0, --temperature > 0 and --top-p in (0, 1]")
    warpers = ProcessingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    report = measure(args.target, args.draft, modes, args.windows, args.window, load_prompts(args.prompts), args.new_tokens,
                     warpers, args.samples, args.blocks)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for mode, parts in report["modes"].items():
        for part in ("held_out", "continuations"):
            values = parts[part]
            print(f"target {mode}, {part}: α {values['alpha']:.3f}, greedy agreement {values['greedy_agreement']:.3f}, "
                  f"top-2 agreement {values['top2_agreement']:.3f}, "
                  f"target mass outside the draft's ids {values['target_mass_outside_draft']:.3f}, "
                  f"KL on the draft's ids {values['kl_on_draft_ids']:.3f}")
        if "sampled" in parts:
            drawn = parts["sampled"]
            print(f"target {mode}, sampled continuations, warped: α {drawn['alpha']:.3f}, greedy agreement "
                  f"{drawn['greedy_agreement']:.3f}, p(the draft's argmax) {drawn['candidate_acceptance']:.3f}")
            if "round_tokens" in drawn:
                rounds = zip(drawn["round_tokens"]["token"], drawn["round_tokens"]["block"], strict=True)
                for gamma, (token, block) in enumerate(rounds, 1):
                    print(f"target {mode}, sampled rounds of γ {gamma}: {token:.3f} tokens token-by-token, {block:.3f} by block")
    return 0
