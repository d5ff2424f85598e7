"""Choose `medusa_choices` for a model and its heads from measured acceptance.

Greedy continuations of held-out text are scored once with the base model and its heads. For each
position t and each path (r₀, r₁, …) of top-k ranks, the path *matches* when head i's rank-r_i
token at t equals the greedy token at t+i+2 for every i. Siblings carry distinct tokens, so the
nodes of a tree that match form one root path, and a tree's expected accepted length is exactly
the sum over its nodes of P(node's path matches). A match implies its prefix matches, so the n
paths with the highest match rates form a valid tree: the best n-node tree for this data.

    python -m specwire.target_service.tune_medusa_tree --heads DIR [--model DIR] [--nodes 24] [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Sequence
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specwire.demo import demo_target_dir
from specwire.demo.train_pair import load_corpus
from specwire.feature_drafter import is_feature_drafter
from specwire.medusa import MedusaHeads


def path_match_rates(
    head_top_ids: torch.Tensor, continuation: torch.Tensor, max_rank: int, depth: int
) -> dict[tuple[int, ...], float]:
    """P(path matches) for every path of ranks < max_rank up to `depth` heads.

    head_top_ids: [T, K, ≥max_rank] each head's ranked ids at positions t; continuation: [T + K + 1]
    the tokens, so that head k at t is right when its id equals continuation[t + k + 2].
    """
    steps = head_top_ids.shape[0]
    truth = torch.stack([continuation[k + 2 : k + 2 + steps] for k in range(depth)], dim=1)  # [T, depth]
    hits = head_top_ids[:, :depth, :max_rank] == truth.unsqueeze(-1)  # [T, depth, max_rank]
    rates: dict[tuple[int, ...], float] = {}
    for length in range(1, depth + 1):
        for path in itertools.product(range(max_rank), repeat=length):
            matched = torch.ones(steps, dtype=torch.bool)
            for head, rank in enumerate(path):
                matched &= hits[:, head, rank]
            rates[path] = float(matched.float().mean())
    return rates


def best_tree(rates: dict[tuple[int, ...], float], nodes: int) -> list[list[int]]:
    """The `nodes` paths with the highest match rates (shorter first on ties: prefix-closed)."""
    ranked = sorted(rates, key=lambda path: (-rates[path], len(path), path))
    return [list(path) for path in ranked[:nodes]]


@torch.no_grad()
def measure(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    model: Any = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if is_feature_drafter(args.heads):
        raise SystemExit(f"--heads {args.heads}: a feature drafter drafts one chain; its tree is that chain (choices.json)")
    heads = MedusaHeads.load(args.heads)
    depth = heads.num_heads
    corpus = load_corpus()
    prompts = [text[: args.prompt_chars] for _, text in corpus.val[: args.prompts]]
    all_rates: list[dict[tuple[int, ...], float]] = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        sequence = out[0]  # [L]
        hidden = model.base_model(input_ids=sequence[None]).last_hidden_state[0]  # [L, H]
        start = ids.shape[1] - 1
        usable = sequence.shape[0] - start - depth - 1
        top = heads(hidden[start : start + usable]).topk(args.max_rank, dim=-1).indices  # [T, K, R]
        all_rates.append(path_match_rates(top, sequence[start:], args.max_rank, depth))
    rates = {path: sum(r[path] for r in all_rates) / len(all_rates) for path in all_rates[0]}
    sizes = {}
    for nodes in (4, 8, 12, 16, 24, 32, 48, 64):
        tree = best_tree(rates, nodes)
        sizes[nodes] = sum(rates[tuple(path)] for path in tree)  # expected accepted tokens per round
    return {"expected_accepted_by_nodes": sizes, "choices": best_tree(rates, args.nodes)}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(demo_target_dir()))
    parser.add_argument("--heads", required=True)
    parser.add_argument("--nodes", type=int, default=24, help="tree nodes besides the root")
    parser.add_argument("--prompts", type=int, default=16, help="held-out stdlib files whose openings prompt")
    parser.add_argument("--prompt-chars", type=int, default=300)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--max-rank", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", help="also write the choices here (a --medusa-choices file)")
    args = parser.parse_args(argv)
    result = measure(args)
    print(json.dumps(result["expected_accepted_by_nodes"], indent=2))
    print(json.dumps(result["choices"]))
    if args.out:
        with open(args.out, "w") as out:
            out.write(json.dumps(result["choices"]) + "\n")


if __name__ == "__main__":
    main()
