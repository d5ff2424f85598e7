"""`specwire train-medusa --kind feature`: a feature drafter (`specwire.feature_drafter`) from a
teacher cache with hidden states, the target frozen.

Slot j reads the cached feature f_j (with Gaussian noise, 0.05 of the features' spread, so that it
learns to continue from its own imperfect predictions) and the text's token x_{j+1}; the loss is
smooth-L1 between its output and f_{j+1}, plus 0.1 × the coarsened KL (`sparse_distill.coarse_kl`)
between the teacher's cached top-k distribution at j+1 and its head's logits (EAGLE's loss and
weights, Li et al. 2024, §4). The head starts as the target's output embedding over the
`--vocab-top` most frequent ids and stays frozen there. Reported: each depth's greedy agreement
with the teacher's argmax on held-out windows, its deeper slots fed its own predicted features.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from specwire.target_service.train_medusa import cached_target, set_learning_rate
from tqdm import tqdm

from specwire.feature_drafter import FeatureDrafter, FeatureDrafterConfig
from specwire.medusa import CHOICES_NAME
from specwire.sparse_distill import coarse_kl, sparse_targets

FEATURE_NOISE = 0.05  # × the cached features' standard deviation
SCORE_WEIGHT = 0.1


def train_feature_drafter(args: argparse.Namespace) -> dict[str, Any]:
    cache, _, model, vocab = cached_target(args, args.vocab_top or 16384)
    assert vocab is not None
    ids = torch.tensor(vocab.ids)
    embedding = model.get_input_embeddings().weight.detach()  # [V, H]
    head = model.get_output_embeddings().weight.detach()[ids].clone()  # [K, H]
    shape = FeatureDrafterConfig.for_target(int(embedding.shape[1]), int(embedding.shape[0]), len(ids), args.heads)
    drafter = FeatureDrafter(shape, ids)
    del model
    drafter.bind(embedding)
    with torch.no_grad():
        drafter.head.weight.copy_(head)
    drafter.head.requires_grad_(False)
    table = ids.new_full((drafter.config.vocab_size,), -1)
    table[ids] = torch.arange(len(ids))
    cached, held_out = cache.load("train", args.windows), cache.load("held_out", args.held_out_windows)
    spread = float(cached["hidden"][:64].float().std())
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    rng = np.random.default_rng(args.seed)
    noise = torch.Generator().manual_seed(args.seed)
    started = time.perf_counter()
    history: list[list[float]] = []
    drafter.train()
    bar = tqdm(range(args.steps), desc="train-medusa (feature)", unit="step")
    for step in bar:
        set_learning_rate(optimizer, step, args)
        chosen = torch.from_numpy(np.sort(rng.choice(len(cached["tokens"]), args.batch_size, replace=False)))
        features = cached["hidden"][chosen].float()  # [B, T, H] at positions 0…T−1
        tokens = cached["tokens"][chosen].long()  # [B, T+1]
        steps_in = features.shape[1] - 1
        noisy = features[:, :-1] + torch.randn(features[:, :-1].shape, generator=noise) * FEATURE_NOISE * spread
        predicted, _ = drafter(noisy, tokens[:, 1:-1], torch.arange(steps_in))  # [B, T−1, H]: f_{j+1}
        regression = F.smooth_l1_loss(predicted, features[:, 1:])
        idx, inside = sparse_targets(cached["topk_ids"][chosen][:, 1:], table)  # teacher at j+1
        scored = coarse_kl(cached["topk_logp"][chosen][:, 1:], idx, inside, drafter.scores(predicted)).mean()
        loss = regression + SCORE_WEIGHT * scored
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        history.append([regression.item(), scored.item()])
        bar.set_postfix(regression=f"{history[-1][0]:.4f}", kl=f"{history[-1][1]:.3f}")
    drafter.eval()
    agreement = depth_agreement(drafter, held_out, table, args.heads)
    drafter.save(args.out)
    (Path(args.out) / CHOICES_NAME).write_text(f"{served_tree(args.heads)}\n")
    report = {
        "kind": "feature", "model": Path(args.model).name, "steps": args.steps, "batch_size": args.batch_size,
        "lr": args.lr, "seed": args.seed, "vocab_top": len(ids), "max_depth": args.heads,
        "train_seconds": round(time.perf_counter() - started, 1),
        "loss_first": np.mean(history[: max(1, len(history) // 10)], axis=0).tolist(),
        "loss_last": np.mean(history[-max(1, len(history) // 10) :], axis=0).tolist(),
        "held_out_depth_agreement": agreement,
        "teacher_cache": {"windows": len(cached["tokens"]), "held_out_windows": len(held_out["tokens"])},
    }
    (Path(args.out) / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


# The tree served by default: the chain to depth 3 and the runner-up beside its first two drafts.
# Gemma-3-270M's drafter on a 2-core Xeon, target on 2 threads, tok/s ÷ greedy in one run: chain
# to depth 4 1.28, with runners-up at depths 1–2 1.29, to depth 3 with them 1.33 (docs/medusa.md).
SERVED_DEPTH = 3
RUNNERS_UP = 2


def served_tree(depth: int) -> list[list[int]]:
    """`medusa_choices` for a drafter of `depth` levels: its chain to SERVED_DEPTH, each of the
    first RUNNERS_UP drafts with the head's second-best id beside it (a leaf, free to draft)."""
    chain = min(depth, SERVED_DEPTH)
    tree = [[0] * d for d in range(1, chain + 1)]
    tree += [[0] * d + [1] for d in range(min(RUNNERS_UP, chain))]
    return sorted(tree, key=lambda path: (len(path), path))


@torch.no_grad()
def depth_agreement(drafter: FeatureDrafter, held_out: dict[str, torch.Tensor], table: torch.Tensor,
                    depth: int, windows: int = 16) -> list[float]:
    """Per depth d, how often the chain's d-th draft equals the teacher's argmax at that position,
    given that the d − 1 before it did: the greedy acceptance rate of each depth along the text
    (the teacher's argmax stands in for the text wherever they differ, as greedy verification would)."""
    accepted, tried = torch.zeros(depth), torch.zeros(depth)
    for window in range(min(windows, len(held_out["tokens"]))):
        features = held_out["hidden"][window].float()  # [T, H]
        best = held_out["topk_ids"][window, :, 0].long()  # [T] the teacher's argmax after each position
        steps = features.shape[0]
        text = held_out["tokens"][window].long()
        predicted, slots = drafter(features[None, :-1], text[None, 1:-1], torch.arange(steps - 1))
        for start in range(0, steps - 1 - depth, 4):  # rounds whose root is text[start + 1]
            past = slots.before(start + 1)
            chain = predicted[:, start : start + 1]
            for level in range(depth):
                guess = drafter.vocab_ids[drafter.scores(chain[0, -1]).argmax()]
                tried[level] += 1
                if int(guess) != int(best[start + 1 + level]):
                    break
                accepted[level] += 1
                if level + 1 < depth:
                    chain, past = drafter(chain, guess[None, None], torch.tensor([start + 1 + level]), past)
    return (accepted / tried.clamp_min(1)).tolist()
