"""`specwire distill --from-scratch`: a small draft over a trimmed vocabulary, distilled from a
teacher cache (`specwire.teacher_cache`).

The draft is a fresh Llama of `--layers` × `--hidden` whose vocabulary is the target's `--vocab-top`
ids most frequent in the training text (`specwire.engine.trimmed_vocab`; FR-Spec, Zhao et al. 2025);
it reads and scores target ids once loaded. It learns the cached teacher's top-k distributions
through the coarsened KL of `specwire.sparse_distill` (DistillSpec, Zhou et al. 2023, with a fixed
dataset), optionally plus the text's own next tokens on windows the teacher did not see (cheap:
no teacher forward). Held-out α, greedy agreement and KL come from the cache's held-out windows.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from tqdm import tqdm
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from specwire import teacher_cache
from specwire.engine.trimmed_vocab import TrimmedVocab
from specwire.processing import ProcessingConfig
from specwire.sparse_distill import alpha_bounds, coarse_kl, draft_vocabulary, sparse_targets, warped_alpha

HEAD_DIM = 64
REPORT = "distill_report.json"


@dataclass(frozen=True)
class DraftShape:
    layers: int
    hidden: int
    vocab_top: int  # K: the target ids the draft's head covers
    kv_heads: int = 2

    @property
    def heads(self) -> int:
        return max(1, self.hidden // HEAD_DIM)

    @property
    def intermediate(self) -> int:
        return 64 * round(self.hidden * 8 / 3 / 64)  # Llama's ratio, rounded to 64



def optimizer_step(optimizer: torch.optim.Optimizer, loss: torch.Tensor, model: torch.nn.Module,
                   loss_ema: float | None) -> float:
    """One step with gradients clipped to norm 1; returns the loss's moving average (0.98)."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    value = loss.item()
    return value if loss_ema is None else 0.98 * loss_ema + 0.02 * value

def new_draft(shape: DraftShape, vocab: TrimmedVocab, target_config: Any, max_positions: int, seed: int) -> LlamaForCausalLM:
    """A freshly initialised Llama over the K draft ids, tied embedding and head."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(vocab.ids),
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=min(shape.kv_heads, shape.heads),
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=None,  # ids in the config are target ids; none may mark a draft embedding row
        bos_token_id=getattr(target_config, "bos_token_id", None),
        eos_token_id=getattr(target_config, "eos_token_id", None),
    )
    return LlamaForCausalLM(config)


def deepen(model: LlamaForCausalLM, layers: int) -> LlamaForCausalLM:
    """`model` at `layers` layers, a multiple of its own: each layer followed by copies whose output
    projections (attention's and the MLP's) are zero, so it computes what `model` does until
    trained (function-preserving growth: Net2Net, Chen et al. 2016; depth up-scaling by copied
    layers, SOLAR, Kim et al. 2023)."""
    config = copy.deepcopy(model.config)
    factor, rest = divmod(layers, config.num_hidden_layers)
    if rest or factor < 1:
        raise SystemExit(f"--grow-layers {layers}: must be a multiple of the draft's {config.num_hidden_layers} layers")
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = [kind for kind in config.layer_types for _ in range(factor)]
    grown = LlamaForCausalLM(config)
    state: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if not key.startswith("model.layers."):
            state[key] = value
            continue
        _, _, index, name = key.split(".", 3)
        for copy_index in range(factor):
            silent = copy_index > 0 and name in ("self_attn.o_proj.weight", "mlp.down_proj.weight")
            state[f"model.layers.{int(index) * factor + copy_index}.{name}"] = (
                torch.zeros_like(value) if silent else value.clone())
    grown.load_state_dict(state)
    grown.generation_config = model.generation_config
    return grown


def load_draft(directory: Path) -> tuple[LlamaForCausalLM, TrimmedVocab]:
    """A draft this command wrote, with its trimmed vocabulary, to train on."""
    vocab = TrimmedVocab.load(directory)
    if vocab is None:
        raise SystemExit(f"--init {directory}: no trimmed vocabulary there (a draft of distill --from-scratch)")
    model = LlamaForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    return model, vocab


def parse_warpers(text: str) -> ProcessingConfig:
    """`--accept-warpers T,K,P`: a sampled request's temperature, top-k and top-p."""
    try:
        temperature, top_k, top_p = text.split(",")
        warpers = ProcessingConfig(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p))
    except ValueError:
        raise SystemExit(f"--accept-warpers {text!r}: give T,K,P, e.g. 0.666,27,0.9") from None
    if warpers.temperature <= 0 or warpers.top_k < 0 or not 0 < warpers.top_p <= 1:
        raise SystemExit(f"--accept-warpers {text!r}: T must be > 0, K ≥ 0, P in (0, 1]")
    return warpers


@torch.no_grad()
def measure(model: Any, split: dict[str, torch.Tensor], vocab: TrimmedVocab, batch_size: int,
            warpers: ProcessingConfig) -> dict[str, float]:
    """Held-out α (lower and upper bound), greedy agreement, KL_S and α under `warpers`, averaged
    over positions."""
    model.eval()
    table, inputs, target_ids = vocab.draft_ids(missing=-1), vocab.draft_ids(), torch.tensor(vocab.ids)
    sums = np.zeros(5)
    count = 0
    for start in range(0, len(split["tokens"]), batch_size):
        tokens = split["tokens"][start : start + batch_size]
        logits = model(input_ids=inputs[tokens[:, :-1].long()]).logits.float()  # [B, T, K]
        idx, inside = sparse_targets(split["topk_ids"][start : start + batch_size], table)
        teacher = split["topk_logp"][start : start + batch_size]
        lower, upper = alpha_bounds(teacher, idx, inside, logits)
        top1 = split["topk_ids"][start : start + batch_size, :, 0].long()  # [B, T]: the teacher's argmax
        agree = target_ids[logits.argmax(-1)] == top1
        sampled = warped_alpha(teacher, idx, inside, logits, warpers)
        sums += [float(lower.sum()), float(upper.sum()), float(agree.sum()), float(coarse_kl(teacher, idx, inside, logits).sum()),
                 float(sampled.sum())]
        count += lower.numel()
    model.train()
    alpha, alpha_upper, agreement, kl, sampled_alpha = sums / count
    return {"alpha": alpha, "alpha_upper": alpha_upper, "greedy_agreement": agreement, "kl": kl,
            "sampled_alpha": sampled_alpha}


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1.0 + float(np.cos(np.pi * progress))))


def target_embedding_init(model: Any, target_embedding: torch.Tensor, vocab: TrimmedVocab) -> None:
    """Start the draft's (tied) embedding from the target's rows for its K ids, projected onto
    their top principal directions (as many as the draft is wide) and scaled to the draft's
    initial spread: related tokens start close, as they are in the target."""
    rows = target_embedding[torch.tensor(vocab.ids)].double()  # [K, E]
    width = model.get_input_embeddings().weight.shape[1]
    if width > rows.shape[1]:
        raise SystemExit(f"--embedding-init target: the draft ({width}) is wider than the target's embedding ({rows.shape[1]})")
    _, _, directions = torch.linalg.svd(rows, full_matrices=False)  # directions: [E, E]
    projected = rows @ directions[:width].T  # [K, H]
    scale = float(model.config.initializer_range) / float(projected.std())
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_((projected * scale).float())


def text_loss(logits: torch.Tensor, next_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the text's next tokens (target ids [B, T]) under the draft ([B, T, K]);
    tokens outside the draft's vocabulary are skipped."""
    targets = table[next_ids.long()]  # [B, T], −1 outside
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1)


def train(args: argparse.Namespace) -> dict[str, Any]:
    target = Path(args.target)
    cache_dir = Path(args.teacher_cache) if args.teacher_cache else Path(f"{args.out}.teacher")
    cache, corpus = teacher_cache.build_from_args(args, target, cache_dir)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    tokenizer = cast(PreTrainedTokenizerFast, AutoTokenizer.from_pretrained(str(target)))
    target_config = AutoConfig.from_pretrained(str(target))
    generation = GenerationConfig.from_pretrained(str(target))
    target_config.eos_token_id = generation.eos_token_id or target_config.eos_token_id
    if args.init:  # a draft of this kind, trained further: its vocabulary stays, its shape unless grown
        model, vocab = load_draft(Path(args.init))
        if args.grow_layers:
            model = deepen(model, args.grow_layers)
        config: Any = model.config
        shape = DraftShape(config.num_hidden_layers, config.hidden_size, len(vocab.ids), config.num_key_value_heads)
    else:
        vocab = draft_vocabulary(corpus.train_stream, args.vocab_top, target_config, tokenizer)
        shape = DraftShape(args.layers, args.hidden, len(vocab.ids))
        max_positions = int(getattr(target_config, "max_position_embeddings", 4096))
        model = new_draft(shape, vocab, target_config, max_positions, args.seed)
    model.train()
    if args.embedding_init == "target" and not args.init:
        teacher: Any = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
        target_embedding_init(model, teacher.get_input_embeddings().weight.detach(), vocab)
        del teacher
    cached, held_out = cache.load("train", args.windows), cache.load("held_out", args.held_out_windows)
    used = len(cached["tokens"])
    text = torch.from_numpy(corpus.windows["train"][corpus.order["train"][used : used + args.text_windows]])
    table, inputs = vocab.draft_ids(missing=-1), vocab.draft_ids()
    print(f"{used} cached training windows, {len(text)} text windows, {len(held_out['tokens'])} held out; "
          f"draft {shape.layers} × {shape.hidden}, vocabulary {len(vocab.ids)} of {vocab.target_vocab_size}", flush=True)
    warpers = parse_warpers(args.accept_warpers)
    before = measure(model, held_out, vocab, args.batch_size, warpers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    bf16 = args.bf16 and teacher_cache.bfloat16_pays()
    if args.bf16 and not bf16:
        print("--bf16: bfloat16 products are no faster than float32 ones on this CPU; training in float32", flush=True)
    rng = np.random.default_rng(args.seed)
    started = time.perf_counter()
    loss_ema: float | None = None
    with tqdm(total=args.steps, desc="distill", unit="step", dynamic_ncols=True) as bar:
        for step in range(args.steps):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, args.steps, args.lr, args.warmup)
            chosen = torch.from_numpy(np.sort(rng.choice(used, min(args.batch_size, used), replace=False)))
            idx, inside = sparse_targets(cached["topk_ids"][chosen], table)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logits = model(input_ids=inputs[cached["tokens"][chosen, :-1].long()]).logits
            teacher = cached["topk_logp"][chosen]
            loss = coarse_kl(teacher, idx, inside, logits).mean()
            if args.accept_weight:
                accepted = warped_alpha(teacher, idx, inside, logits.float(), warpers)
                loss = loss + args.accept_weight * (1 - accepted.mean())
            if len(text):
                windows = text[np.sort(rng.choice(len(text), min(args.text_batch, len(text)), replace=False))]
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    text_logits = model(input_ids=inputs[windows[:, :-1]]).logits
                loss = loss + args.text_weight * text_loss(text_logits, windows[:, 1:], table)
            loss_ema = optimizer_step(optimizer, loss, model, loss_ema)
            bar.update(1)
            bar.set_postfix(loss=f"{loss_ema:.3f}")
    train_s = time.perf_counter() - started
    after = measure(model, held_out, vocab, args.batch_size, warpers)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(bos_token_id=target_config.bos_token_id, eos_token_id=target_config.eos_token_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    vocab.save(out)
    report = {
        "target": target.name,
        "teacher_cache": {"windows": used, "held_out_windows": len(held_out["tokens"]),
                          "seq_len": cache.spec.seq_len, "top_k": cache.spec.top_k},
        "init": str(args.init) if args.init else None, "text_windows": len(text), "text_weight": args.text_weight, "text_batch": args.text_batch, "embedding_init": args.embedding_init,
        "accept_weight": args.accept_weight, "accept_warpers": {"temperature": warpers.temperature, "top_k": warpers.top_k, "top_p": warpers.top_p},
        "shape": asdict(shape) | {"heads": shape.heads, "kv_heads": min(shape.kv_heads, shape.heads), "intermediate": shape.intermediate},
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_coverage": float(np.isin(corpus.train_stream, np.asarray(vocab.ids)).mean()),
        "steps": args.steps, "batch_size": args.batch_size, "lr": args.lr, "bf16": bf16,
        "seed": args.seed, "threads": args.threads,
        "train_seconds": round(train_s, 1),
        "before": {k: round(v, 4) for k, v in before.items()},
        "after": {k: round(v, 4) for k, v in after.items()},
    }
    (out / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    return report

