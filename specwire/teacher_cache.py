"""The teacher's outputs over a corpus, computed once and kept on disk (`specwire teacher-cache`).

Distilling a draft or training Medusa heads against a real target is dominated by the target's
forward. This runs it once per window of text and stores what training needs: per position the
teacher's top-k log-probabilities and their ids, the logsumexp of its logits (so raw logits are
recoverable: logit = log p + lse), and optionally its final hidden state (the Medusa heads'
input). Sparse teacher targets are the usual way to make distillation affordable at large
vocabularies (Hinton et al. 2015; top-k teacher caching as in e.g. MiniLLM/DistiLLM pipelines).

Layout: `meta.json` (what was computed, from what) and per split safetensors shards of
`SHARD_WINDOWS` windows, each written to a temporary name and renamed when complete, so a run
stopped at any point resumes at the first missing shard and recomputes nothing. The windows and
their order are a pure function of the corpus, the tokenizer and the seed; a larger `--windows`
extends an existing cache.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from specwire.demo import train_pair
from specwire.tokenizer import tokenizer_fingerprint

META = "meta.json"
SHARD_WINDOWS = 16  # windows per shard: the unit of resumption
HEAD_CHUNK = 128  # positions per LM-head call: [128, vocab] logits at a time
DTYPES = ("auto", "float32", "bfloat16")
HELD_OUT_FRACTION = 0.05  # of `--data` files' tokens (the stdlib holds out every 50th file)


@dataclass(frozen=True)
class CacheSpec:
    """What a cache holds; a cache is only ever extended with the same spec."""

    teacher: str  # sha256 of the teacher's config, weights' sizes and tokenizer
    corpus: str  # sha256 of the two token streams
    seq_len: int  # scored positions per window (each window is BOS + seq_len tokens)
    top_k: int
    hidden_size: int  # 0: no hidden states stored
    seed: int  # the training windows' order
    dtype: str = "float32"  # the teacher's weights and arithmetic (`teacher_dtype`)


def teacher_digest(directory: Path, tokenizer: PreTrainedTokenizerFast) -> str:
    """Identifies a teacher by its config, the sizes of its weight files and its tokenizer."""
    digest = hashlib.sha256((directory / "config.json").read_bytes())
    for weights in sorted(directory.glob("*.safetensors")):
        digest.update(f"{weights.name}:{weights.stat().st_size}".encode())
    digest.update(tokenizer_fingerprint(tokenizer).encode())
    return digest.hexdigest()


def corpus_streams(tokenizer: PreTrainedTokenizerFast, data: Sequence[Path]) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) token streams: the stdlib split of the demo pair (every 50th file held
    out), or the given files with their last 5% of tokens held out."""
    if not data:
        corpus = train_pair.load_corpus()
        return (
            train_pair.encode_stream(tokenizer, [text for _, text in corpus.train]),
            train_pair.encode_stream(tokenizer, [text for _, text in corpus.val]),
        )
    stream = train_pair.encode_stream(tokenizer, [path.read_text(encoding="utf-8", errors="replace") for path in data])
    cut = int(len(stream) * (1.0 - HELD_OUT_FRACTION))
    return stream[:cut], stream[cut:]


def bos_windows(stream: np.ndarray, seq_len: int, bos: int) -> np.ndarray:
    """The stream cut into chunks of `seq_len` tokens, each after a BOS, as a served prompt
    starts: [n, seq_len + 1] int64. Position t's next token is window[t + 1]."""
    count = len(stream) // seq_len
    chunks = stream[: count * seq_len].reshape(count, seq_len).astype(np.int64)
    return np.concatenate([np.full((count, 1), bos, dtype=np.int64), chunks], axis=1)


@dataclass(frozen=True)
class CorpusWindows:
    """A corpus cut into windows, and the order a cache takes them in."""

    train_stream: np.ndarray  # the training text's tokens (vocabulary counts come from it)
    windows: dict[str, np.ndarray]  # "train", "held_out": [n, seq_len + 1] (`bos_windows`)
    # Training windows in a seeded permutation (any prefix is a uniform sample of the corpus),
    # held-out windows in corpus order.
    order: dict[str, np.ndarray]
    digest: str  # sha256 of both token streams


def corpus_windows(tokenizer: PreTrainedTokenizerFast, data: Sequence[Path], seq_len: int, seed: int) -> CorpusWindows:
    train_stream, held_stream = corpus_streams(tokenizer, data)
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    assert bos is not None
    windows = {"train": bos_windows(train_stream, seq_len, bos), "held_out": bos_windows(held_stream, seq_len, bos)}
    order = {"train": np.random.default_rng(seed).permutation(len(windows["train"])),
             "held_out": np.arange(len(windows["held_out"]))}
    digest = hashlib.sha256(train_stream.astype(np.int64).tobytes() + held_stream.astype(np.int64).tobytes()).hexdigest()
    return CorpusWindows(train_stream, windows, order, digest)


@functools.cache
def bfloat16_pays() -> bool:
    """bfloat16 matrix products run faster than float32 ones here, timed (min of 5, interleaved,
    a 512 × 640 by 640 × 2,048 product, as a draft's or Gemma-3-270M's layers multiply). oneDNN
    having them natively is not enough: on an Intel Xeon with AVX-512 BF16 but no AMX, 2 cores,
    a draft's training step took 3.0 s under bfloat16 autocast against 1.74 in float32; on an AMD EPYC with AVX-512
    BF16, Gemma-3-270M's body 0.21 s against 0.60; without them, a reference loop (a draft's step
    113 s against 5)."""
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    generator = torch.Generator().manual_seed(0)
    left, right = torch.randn(512, 640, generator=generator), torch.randn(2048, 640, generator=generator)
    best = {torch.float32: float("inf"), torch.bfloat16: float("inf")}
    with torch.no_grad():
        for _ in range(5):
            for dtype in best:
                a, b = left.to(dtype), right.to(dtype)
                started = time.perf_counter()
                torch.nn.functional.linear(a, b)
                best[dtype] = min(best[dtype], time.perf_counter() - started)
    return best[torch.bfloat16] < 0.8 * best[torch.float32]


def teacher_dtype(flag: str, existing: CacheSpec | None) -> str:
    """`auto`: an existing cache's dtype, else bfloat16 where its products run faster here
    (`bfloat16_pays`), else float32. Gemma-3-270M over 512-token batches, 2 threads (AMD EPYC
    with AVX-512 BF16): the body 0.21 s bfloat16 against 0.60 float32, its LM head over 256
    positions 0.14 s against 0.60; the float32 teacher's distributions against the bfloat16's,
    KL 0.0016 nats a position (a distilled draft's is ~1), the same top token at 99.0% of
    positions (docs/speculative.md, "A draft for a real target")."""
    if flag != "auto":
        return flag
    if existing is not None:
        return existing.dtype
    return "bfloat16" if bfloat16_pays() else "float32"


@torch.no_grad()
def teacher_outputs(model: Any, windows: torch.Tensor, top_k: int, keep_hidden: bool) -> dict[str, torch.Tensor]:
    """One batch of windows [B, T+1] → per scored position (T = all but the last token):
    topk_logp, topk_ids [B, T, k], lse [B, T], and hidden [B, T, H] float16 when asked."""
    inputs = windows[:, :-1]
    hidden = model.base_model(input_ids=inputs, use_cache=False).last_hidden_state  # [B, T, H]
    head = model.get_output_embeddings()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    flat = hidden.flatten(0, 1)  # [B·T, H]
    logp, ids, lse = [], [], []
    for start in range(0, len(flat), HEAD_CHUNK):
        logits = head(flat[start : start + HEAD_CHUNK]).float()  # [chunk, V]
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        chunk_lse = logits.logsumexp(dim=-1)  # [chunk]
        values, indices = logits.topk(top_k, dim=-1)  # [chunk, k]
        logp.append(values - chunk_lse[:, None])
        ids.append(indices.to(torch.int32))
        lse.append(chunk_lse)
    shape = inputs.shape
    out = {
        "tokens": windows.to(torch.int32),
        "topk_logp": torch.cat(logp).view(*shape, top_k),
        "topk_ids": torch.cat(ids).view(*shape, top_k),
        "lse": torch.cat(lse).view(shape),
    }
    if keep_hidden:
        out["hidden"] = hidden.to(torch.float16)
    return out


class TeacherCache:
    """A cache directory: its spec and its complete shards per split."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        meta = json.loads((directory / META).read_text())
        self.spec = CacheSpec(**meta["spec"])
        self.vocab_size = int(meta["vocab_size"])
        self.target = str(meta["target"])

    def shard_path(self, split: str, index: int) -> Path:
        return self.directory / f"{split}-{index:05d}.safetensors"

    def shards(self, split: str) -> list[Path]:
        """The complete shards of a split, in order, up to the first missing one."""
        found: list[Path] = []
        while self.shard_path(split, len(found)).is_file():
            found.append(self.shard_path(split, len(found)))
        return found

    def load(self, split: str, windows: int | None = None) -> dict[str, torch.Tensor]:
        """The split's arrays, shards concatenated (the first `windows` windows, when given)."""
        paths = self.shards(split)
        if windows is not None:
            paths = paths[: -(-windows // SHARD_WINDOWS)]
        if not paths:
            raise SystemExit(f"teacher cache {self.directory}: no {split} shards")
        parts = [load_file(str(path)) for path in paths]
        joined = {name: torch.cat([part[name] for part in parts]) for name in parts[0]}
        return {name: value[:windows] for name, value in joined.items()} if windows is not None else joined


def build(
    target: Path,
    out: Path,
    data: Sequence[Path] = (),
    train_windows: int = 512,
    held_out_windows: int = 48,
    seq_len: int = 256,
    top_k: int = 64,
    hidden: bool = False,
    batch_size: int = 2,
    threads: int = 1,
    seed: int = 0,
    dtype: str = "auto",
) -> tuple[TeacherCache, CorpusWindows]:
    """Run the teacher (`dtype`, `teacher_dtype`) over the chosen windows, writing the shards still
    missing. A cache that keeps hidden states serves requests without them (and goes on keeping
    them)."""
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    tokenizer = cast(PreTrainedTokenizerFast, AutoTokenizer.from_pretrained(str(target)))
    corpus = corpus_windows(tokenizer, data, seq_len, seed)
    config = AutoConfig.from_pretrained(str(target))
    text_config = config.get_text_config()
    meta_path = out / META
    existing = CacheSpec(**json.loads(meta_path.read_text())["spec"]) if meta_path.exists() else None
    hidden = hidden or (existing is not None and existing.hidden_size > 0)
    spec = CacheSpec(teacher_digest(target, tokenizer), corpus.digest, seq_len, top_k,
                     int(text_config.hidden_size) if hidden else 0, seed, teacher_dtype(dtype, existing))
    if existing is not None and existing != spec:
        changed = [name for name, value in asdict(spec).items() if asdict(existing)[name] != value]
        raise SystemExit(f"--out {out}: a cache of another {', '.join(changed)}; choose a new directory")
    if existing is None:
        out.mkdir(parents=True, exist_ok=True)
        meta = {"spec": asdict(spec), "target": target.name, "vocab_size": int(text_config.vocab_size),
                "data": [path.name for path in data] or ["stdlib"], "windows_available": {k: len(v) for k, v in corpus.windows.items()}}
        meta_path.write_text(json.dumps(meta, indent=1) + "\n")
    cache = TeacherCache(out)
    available = {split: len(windows) for split, windows in corpus.windows.items()}
    wanted = {"held_out": min(held_out_windows, available["held_out"]), "train": min(train_windows, available["train"])}
    model: Any = None
    for split, count in wanted.items():
        shards = -(-count // SHARD_WINDOWS)
        done = len(cache.shards(split))
        if done >= shards:
            continue
        if model is None:  # loaded only when something is missing: a complete cache costs seconds
            model = AutoModelForCausalLM.from_pretrained(str(target), dtype=getattr(torch, spec.dtype)).eval()
        with tqdm(total=shards * SHARD_WINDOWS, initial=done * SHARD_WINDOWS, desc=f"teacher {split}", unit="window",
                  dynamic_ncols=True) as bar:
            for index in range(done, shards):
                chosen = corpus.order[split][index * SHARD_WINDOWS : (index + 1) * SHARD_WINDOWS]
                batches = []
                for start in range(0, len(chosen), batch_size):
                    window = torch.from_numpy(corpus.windows[split][chosen[start : start + batch_size]])
                    batches.append(teacher_outputs(model, window, top_k, hidden))
                    bar.update(len(window))
                shard = {name: torch.cat([b[name] for b in batches]).contiguous() for name in batches[0]}
                partial = cache.shard_path(split, index).with_suffix(".partial")
                save_file(shard, str(partial))
                os.replace(partial, cache.shard_path(split, index))
    return cache, corpus


def add_parser(commands: Any) -> None:
    parser = commands.add_parser("teacher-cache")
    add_arguments(parser)
    parser.add_argument("--target", required=True, type=Path, help="the teacher: a model directory")
    parser.add_argument("--out", required=True, type=Path, help="the cache directory (resumed when it exists)")


def add_arguments(parser: Any, common: bool = True) -> None:
    """The cache's flags, shared by the commands that build one on the way; `common`: also
    --data, --seq-len, --threads and --seed (for a command without its own)."""
    if common:
        parser.add_argument("--data", nargs="*", default=[], type=Path, help="text files (default: the stdlib source)")
        parser.add_argument("--seq-len", type=int, default=256, help="tokens per window after its BOS")
        parser.add_argument("--threads", type=int, default=1, help="torch threads (results are bit-exact per count)")
        parser.add_argument("--seed", type=int, default=0, help="order of the training windows")
    parser.add_argument("--windows", type=int, default=512, help="training windows cached (a seeded sample)")
    parser.add_argument("--held-out-windows", type=int, default=48, help="held-out windows cached (for α)")
    parser.add_argument("--top-k", type=int, default=64, help="teacher log-probs kept per position")
    parser.add_argument("--keep-hidden", action="store_true", help="also keep the final hidden states (Medusa heads)")
    parser.add_argument("--teacher-batch", type=int, default=2, help="windows per teacher forward")
    parser.add_argument("--teacher-dtype", default="auto", choices=DTYPES,
                        help="the teacher's arithmetic (default auto: bfloat16 where its products run faster here, timed)")


def build_from_args(
    args: argparse.Namespace, target: Path, out: Path, hidden: bool = False
) -> tuple[TeacherCache, CorpusWindows]:
    for name in ("windows", "held_out_windows", "seq_len", "top_k", "teacher_batch", "threads"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(args, name)}")
    return build(target, out, [Path(path) for path in args.data or []], args.windows, args.held_out_windows, args.seq_len, args.top_k,
                 args.keep_hidden or hidden, args.teacher_batch, args.threads, args.seed, args.teacher_dtype)


def run(args: argparse.Namespace) -> int:
    cache, _ = build_from_args(args, args.target, args.out)
    counts = {split: len(cache.shards(split)) * SHARD_WINDOWS for split in ("train", "held_out")}
    print(f"{args.out}: {counts['train']} training and {counts['held_out']} held-out windows of {args.seq_len} tokens")
    return 0
