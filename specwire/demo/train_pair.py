"""Train specwire's embedded default DRAFT/TARGET model pair.

This script builds, reproducibly and on CPU only, the small model pair that
ships in ``specwire/demo/pair``:

1. **Corpus** -- every ``.py`` file under the running interpreter's standard
   library directory (``sysconfig.get_paths()["stdlib"]``), read in sorted path
   order.  ``site-packages``, test directories, ``__pycache__`` and the
   machine-specific ``_sysconfigdata*`` module are skipped.  Every 50th file
   (a deterministic ~2 %) is held out as validation data.
2. **Tokenizer** -- a byte-level BPE tokenizer (vocabulary 4096) trained with
   the ``tokenizers`` library on the training files only, wrapped in a
   ``transformers.PreTrainedTokenizerFast`` whose bos/eos token is
   ``<|endoftext|>`` (``<pad>`` is the pad token).  The corpus is encoded once
   into a flat ``uint16`` numpy array (files joined by ``<|endoftext|>``),
   which is cached on disk for re-runs.
3. **Models** -- two ``LlamaForCausalLM`` models with tied embeddings sharing
   that tokenizer: a TARGET (4 layers x 256 wide) and a smaller DRAFT
   (2 layers x 128 wide).
4. **Training** -- AdamW, linear warmup then cosine decay, sequence length 256,
   batches of shuffled non-overlapping windows (reshuffled every epoch).
   Seeds are fixed (``torch.manual_seed``, a seeded numpy sampler) and the
   thread count is pinned, so the data order is deterministic.  Each model gets a wall-clock
   budget (``--target-minutes`` / ``--draft-minutes``); the cosine LR decay is
   driven by the elapsed fraction of that budget, so a run always completes
   its schedule within the budget even when the (shared) machine slows down
   part-way.  The number of steps therefore depends on machine speed; it is
   written to the report.  For a bit-exact, machine-independent run pass
   ``--target-steps`` / ``--draft-steps`` (with the same ``--seed`` and
   ``--threads``): the schedule is then laid out over exactly that many steps.
5. **Output** -- each model is converted to float16 and saved with
   ``save_pretrained(..., safe_serialization=True)`` together with the
   tokenizer files::

       OUT/target/      complete HF model dir (config, safetensors, tokenizer)
       OUT/draft/       same for the draft model
       OUT/train_report.json

   Validation loss is measured on a fixed set of held-out windows, both on the
   float32 weights at the end of training and on the shipped float16 weights
   reloaded in float32.

Usage::

    python -m specwire.demo.train_pair --out DIR --target-minutes 12 --draft-minutes 4

The shipped pair was built bit-exactly (on a busy 2-core machine) with::

    python -m specwire.demo.train_pair --out specwire/demo/pair --seed 0 --threads 1 \\
        --target-steps 1500 --draft-steps 1000
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
import time
import tokenize
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
import torch
import torch.nn.functional as F
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

EOS_TOKEN: str = "<|endoftext|>"
PAD_TOKEN: str = "<pad>"
VOCAB_SIZE: int = 4096
MAX_POSITIONS: int = 1024
SEQ_LEN: int = 256
VAL_EVERY_NTH_FILE: int = 50
MAX_VAL_WINDOWS: int = 256
EVAL_BATCH_SIZE: int = 16
SKIP_DIR_NAMES: frozenset[str] = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)


@dataclass(frozen=True)
class ModelSpec:
    """Architecture and optimisation settings of one model of the pair."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    batch_size: int
    lr: float
    warmup_steps: int
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0


TARGET_SPEC = ModelSpec(
    name="target",
    num_layers=4,
    hidden_size=256,
    intermediate_size=688,
    num_heads=4,
    batch_size=8,
    lr=2e-3,
    warmup_steps=100,
)
DRAFT_SPEC = ModelSpec(
    name="draft",
    num_layers=2,
    hidden_size=128,
    intermediate_size=344,
    num_heads=2,
    batch_size=8,
    lr=3e-3,
    warmup_steps=100,
)


# --------------------------------------------------------------------------- corpus


@dataclass(frozen=True)
class Corpus:
    """The stdlib source files, split into training and validation sets."""

    stdlib_dir: Path
    train: list[tuple[str, str]]  # (relative path, text)
    val: list[tuple[str, str]]

    @property
    def num_bytes(self) -> int:
        return sum(len(t.encode("utf-8")) for _, t in self.train + self.val)

    def digest(self) -> str:
        h = hashlib.sha256()
        for split, files in (("train", self.train), ("val", self.val)):
            for rel, text in files:
                h.update(f"{split}\0{rel}\0".encode())
                h.update(text.encode("utf-8"))
                h.update(b"\0")
        return h.hexdigest()


def _read_source(path: Path) -> str:
    """Read a Python source file honouring its coding cookie (newlines -> ``\\n``)."""
    try:
        with tokenize.open(path) as fh:
            return fh.read()
    except (SyntaxError, UnicodeDecodeError, LookupError):
        return path.read_bytes().decode("utf-8", errors="replace").replace("\r\n", "\n")


def load_corpus(stdlib_dir: Path | None = None) -> Corpus:
    """Collect the stdlib ``.py`` files in sorted order and split off every 50th."""
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"]).resolve()
    rels: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIR_NAMES)
        for fn in filenames:
            if fn.endswith(".py") and not fn.startswith("_sysconfigdata"):
                rels.append((Path(dirpath) / fn).relative_to(root).as_posix())
    rels.sort()
    train: list[tuple[str, str]] = []
    val: list[tuple[str, str]] = []
    for i, rel in enumerate(rels):
        text = _read_source(root / rel)
        if not text.strip():
            continue
        (val if i % VAL_EVERY_NTH_FILE == VAL_EVERY_NTH_FILE - 1 else train).append((rel, text))
    if not train or not val:
        raise SystemExit(f"stdlib corpus at {root} is too small ({len(rels)} files)")
    return Corpus(stdlib_dir=root, train=train, val=val)


# ------------------------------------------------------------------------ tokenizer


def train_tokenizer(texts: Sequence[str]) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer (vocab ``VOCAB_SIZE``) on ``texts``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer, length=len(texts))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,  # source code: decode must be lossless
    )


def encode_stream(tokenizer: PreTrainedTokenizerFast, texts: Sequence[str]) -> np.ndarray:
    """Encode files into one flat stream, each file preceded by the tokenizer's BOS (its EOS
    where it has none); ``uint16`` where the vocabulary fits, else ``uint32``."""
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    assert start is not None
    dtype = np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max else np.uint32
    encodings = tokenizer.backend_tokenizer.encode_batch(list(texts), add_special_tokens=False)
    parts: list[np.ndarray] = []
    for enc in encodings:
        parts.append(np.asarray([start], dtype=dtype))
        parts.append(np.asarray(enc.ids, dtype=dtype))
    return np.concatenate(parts)


def encode_corpus_cached(
    tokenizer: PreTrainedTokenizerFast, corpus: Corpus, cache_dir: Path | None
) -> tuple[np.ndarray, np.ndarray]:
    """Encode train/val once; reuse a cached ``.npz`` keyed by corpus + tokenizer."""
    key = hashlib.sha256(
        (corpus.digest() + tokenizer.backend_tokenizer.to_str()).encode()
    ).hexdigest()[:24]
    path = cache_dir / f"tokens-{key}.npz" if cache_dir is not None else None
    if path is not None and path.exists():
        with np.load(path) as data:
            return data["train"], data["val"]
    train = encode_stream(tokenizer, [t for _, t in corpus.train])
    val = encode_stream(tokenizer, [t for _, t in corpus.val])
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, train=train, val=val)
        tmp.replace(path)
    return train, val


def windows(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """Cut ``stream`` into ``(n, seq_len + 1)`` windows overlapping by one token."""
    n = (len(stream) - 1) // seq_len
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return stream[idx].astype(np.int64)


# --------------------------------------------------------------------------- models


def build_model(spec: ModelSpec, tokenizer: PreTrainedTokenizerFast, seed: int) -> LlamaForCausalLM:
    """Instantiate a freshly initialised float32 Llama model for ``spec``."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attention_dropout=0.0,
        use_cache=True,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def count_params(model: torch.nn.Module) -> int:
    """Number of unique parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


def lr_at(step: int, progress: float, warmup_end_progress: float, spec: ModelSpec) -> float:
    """Linear warmup over ``spec.warmup_steps`` steps, then cosine decay to ``min_lr``.

    ``progress`` in [0, 1] is the fraction of the run done (of the step count, or
    of the wall-clock budget); the cosine spans ``warmup_end_progress`` .. 1.
    """
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    frac = (progress - warmup_end_progress) / max(1e-9, 1.0 - warmup_end_progress)
    frac = min(1.0, max(0.0, frac))
    min_lr = spec.lr * spec.min_lr_ratio
    return min_lr + 0.5 * (spec.lr - min_lr) * (1.0 + math.cos(math.pi * frac))


def batches(train_windows: np.ndarray, batch_size: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless deterministic stream of shuffled batches (reshuffled every epoch)."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(train_windows))
        for i in range(0, len(order) - batch_size + 1, batch_size):
            yield torch.from_numpy(train_windows[np.sort(order[i : i + batch_size])])


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, val_windows: np.ndarray) -> float:
    """Mean next-token cross-entropy (nats) over the fixed validation windows."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(val_windows), EVAL_BATCH_SIZE):
        batch = torch.from_numpy(val_windows[i : i + EVAL_BATCH_SIZE])
        logits = model(input_ids=batch[:, :-1]).logits.float()
        loss = F.cross_entropy(
            logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1), reduction="sum"
        )
        total += loss.item()
        count += batch[:, 1:].numel()
    model.train()
    return total / count


def train_model(
    spec: ModelSpec,
    tokenizer: PreTrainedTokenizerFast,
    train_windows: np.ndarray,
    val_windows: np.ndarray,
    seed: int,
    minutes: float,
    fixed_steps: int | None,
) -> tuple[LlamaForCausalLM, dict[str, Any]]:
    """Train one model within a wall-clock budget (or for ``fixed_steps``)."""
    model = build_model(spec, tokenizer, seed)
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": spec.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=spec.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    budget_s = minutes * 60.0
    tokens_per_step = spec.batch_size * SEQ_LEN
    data = batches(train_windows, spec.batch_size, seed + 1000)
    if fixed_steps is not None:
        bar = tqdm(total=fixed_steps, desc=f"{spec.name:>6}", unit="step", dynamic_ncols=True)
    else:  # the bar counts wall-clock seconds of the budget
        bar = tqdm(
            total=round(budget_s),
            desc=f"{spec.name:>6}",
            unit="s",
            dynamic_ncols=True,
            bar_format="{l_bar}{bar}| {n:.0f}/{total_fmt}s [{elapsed}<{remaining}{postfix}]",
        )
    loss_ema: float | None = None
    warmup_end_progress: float | None = None
    t0 = time.perf_counter()
    step = 0
    progress = 0.0
    while progress < 1.0:
        if step == spec.warmup_steps:
            warmup_end_progress = progress
        lr = lr_at(step, progress, warmup_end_progress or 0.0, spec)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = next(data)
        logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        opt.step()
        step += 1
        loss_val = loss.item()
        loss_ema = loss_val if loss_ema is None else 0.98 * loss_ema + 0.02 * loss_val
        elapsed = time.perf_counter() - t0
        if fixed_steps is not None:
            progress = step / fixed_steps
            bar.update(1)
        else:
            progress = elapsed / budget_s
            bar.update(min(elapsed, budget_s) - bar.n)
        bar.set_postfix(step=step, loss=f"{loss_ema:.3f}", lr=f"{lr:.2e}")
    train_s = time.perf_counter() - t0
    bar.close()
    val_fp32 = evaluate(model, val_windows)
    tokens_seen = step * tokens_per_step
    info: dict[str, Any] = {
        "spec": asdict(spec),
        "params": count_params(model),
        "steps": step,
        "lr_schedule": "step-based" if fixed_steps is not None else "wall-clock",
        "seq_len": SEQ_LEN,
        "tokens_seen": tokens_seen,
        "epochs": tokens_seen / max(1, len(train_windows) * SEQ_LEN),
        "train_seconds": round(train_s, 1),
        "train_minutes": round(train_s / 60.0, 2),
        "budget_minutes": minutes if fixed_steps is None else None,
        "tokens_per_s": round(tokens_seen / train_s, 1),
        "final_train_loss_ema": round(loss_ema or float("nan"), 4),
        "val_loss_fp32": round(val_fp32, 4),
    }
    return model, info


def save_model(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out_dir: Path
) -> None:
    """Save ``model`` as float16 safetensors plus the tokenizer files into ``out_dir``."""
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    model = model.half()
    model.config.dtype = torch.float16
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    for f in out_dir.iterdir():
        f.chmod(0o644)  # safetensors writes 0600 files; ship them world-readable


def dir_size(path: Path) -> int:
    """Total size in bytes of the files below ``path``."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# ----------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m specwire.demo.train_pair",
        description="Train specwire's default draft/target pair on the Python stdlib source.",
    )
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--target-minutes", type=float, default=12.0, help="target wall-clock budget")
    p.add_argument("--draft-minutes", type=float, default=4.0, help="draft wall-clock budget")
    fixed = "fixed step count (overrides the minutes; bit-exact reproducible)"
    p.add_argument("--target-steps", type=int, default=None, help=fixed)
    p.add_argument("--draft-steps", type=int, default=None, help=fixed)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch intra-op threads (use 1 on a busy machine: 2 OpenMP threads competing "
        "with other processes for 2 cores slow down ~10x; results are bit-exact per thread count)",
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "specwire_train_pair_cache",
        help="where the encoded corpus is cached",
    )
    p.add_argument("--stdlib-dir", type=Path, default=None, help="override the stdlib directory")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    t_start = time.perf_counter()
    corpus = load_corpus(args.stdlib_dir)
    print(
        f"corpus: {len(corpus.train)} train + {len(corpus.val)} val files, "
        f"{corpus.num_bytes / 1e6:.2f} MB from {corpus.stdlib_dir}",
        flush=True,
    )
    tokenizer = train_tokenizer([t for _, t in corpus.train])
    train_stream, val_stream = encode_corpus_cached(tokenizer, corpus, args.cache_dir)
    train_w = windows(train_stream, SEQ_LEN)
    val_w = windows(val_stream, SEQ_LEN)
    if len(val_w) > MAX_VAL_WINDOWS:  # fixed, evenly spaced subset
        val_w = val_w[np.linspace(0, len(val_w) - 1, MAX_VAL_WINDOWS).round().astype(np.int64)]
    print(
        f"tokens: {len(train_stream):,} train / {len(val_stream):,} val "
        f"({corpus.num_bytes / (len(train_stream) + len(val_stream)):.2f} bytes/token), "
        f"{len(val_w)} val windows; prep {time.perf_counter() - t_start:.0f}s",
        flush=True,
    )

    results: dict[str, dict[str, Any]] = {}
    for spec, minutes, steps, seed in (
        (TARGET_SPEC, args.target_minutes, args.target_steps, args.seed),
        (DRAFT_SPEC, args.draft_minutes, args.draft_steps, args.seed + 1),
    ):
        model, info = train_model(spec, tokenizer, train_w, val_w, seed, minutes, steps)
        model_dir = out / spec.name
        save_model(model, tokenizer, model_dir)
        del model
        shipped = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        info["val_loss"] = round(evaluate(shipped, val_w), 4)  # float16 weights as shipped
        info["dir_bytes"] = dir_size(model_dir)
        results[spec.name] = info
        print(
            f"{spec.name}: val_loss {info['val_loss']:.4f} (fp32 {info['val_loss_fp32']:.4f}), "
            f"{info['params']:,} params, {info['tokens_per_s']:.0f} tok/s, "
            f"{info['tokens_seen']:,} tokens in {info['train_minutes']:.1f} min",
            flush=True,
        )
        del shipped

    report: dict[str, Any] = {
        "python_version": sys.version,
        "platform": platform.platform(),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "numpy": np.__version__,
        },
        "seed": args.seed,
        "threads": args.threads,
        "corpus": {
            # The folder's name, not its path: the report ships in the package; the digest names the text.
            "stdlib": corpus.stdlib_dir.name,
            "train_files": len(corpus.train),
            "val_files": len(corpus.val),
            "bytes": corpus.num_bytes,
            "sha256": corpus.digest(),
            "train_tokens": int(len(train_stream)),
            "val_tokens": int(len(val_stream)),
            "val_windows": int(len(val_w)),
        },
        "tokenizer": {
            "type": "byte-level BPE",
            "vocab_size": len(tokenizer),
            "eos_bos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
        },
        "target": results["target"],
        "draft": results["draft"],
        "reproduce": (
            f"python -m specwire.demo.train_pair --out {out} --seed {args.seed} "
            f"--threads {args.threads} --target-steps {results['target']['steps']} "
            f"--draft-steps {results['draft']['steps']}"
        ),
        "total_seconds": round(time.perf_counter() - t_start, 1),
    }
    (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("corpus", "target", "draft")}, indent=2))
    print(f"python {platform.python_version()}; wrote {out}/target, {out}/draft, train_report.json")
    return report


if __name__ == "__main__":
    main()
