"""`specwire self-text`: a corpus of the target's own continuations, to distil a draft on.

A draft is accepted where it predicts what the target writes, not what people wrote: training
on the target's outputs is how Medusa-2 and EAGLE self-distil, and DistillSpec (Zhou et al.
2023) finds data drawn from the target raises acceptance over a fixed human corpus. The prompts
are the openings of lines cut from the training text (the stdlib split's training files, so its
held-out files stay unseen); the target runs as it is served (its `--quantize`, batched on the
engine), so the draft learns the model it will be verified against. Each continuation ends at
an end id or after `--new-tokens`; the file is prompt + continuation, one document after another.
Continuations are greedy, or sampled at `--temperature` (with `--top-k`, `--top-p`): a draft that
sampled rounds verify is accepted at α = Σ min(p, q) over the target's sampled text, which greedy
text covers only along its argmax path.
"""

from __future__ import annotations

import argparse
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specwire.demo import train_pair
from specwire.engine import MAX_PROPOSE, CausalLM, Engine, EngineLimits
from specwire.processing import ProcessingConfig
from specwire.session import OpenRequest, StepRequest

SEPARATOR = "\n\n\n"  # between documents: blank lines, as between the stdlib's top-level definitions


def prompts(count: int, lines: int, seed: int) -> list[str]:
    """`count` openings of `lines` source lines each, at seeded places of the training files:
    a line that starts a statement (not blank, not a comment), as a user's code prompt would."""
    rng = random.Random(seed)
    files = [text.splitlines(keepends=True) for _, text in train_pair.load_corpus().train]
    chosen: list[str] = []
    while len(chosen) < count:
        source = rng.choice(files)
        if len(source) <= lines:
            continue
        start = rng.randrange(len(source) - lines)
        head = source[start]
        if not head.strip() or head.lstrip().startswith("#"):
            continue
        chosen.append("".join(source[start : start + lines]))
    return chosen


def continuation(
    engine: Engine, prompt_ids: list[int], new_tokens: int, ends: set[int], sampling: ProcessingConfig | None = None,
    seed: int = 0,
) -> list[int]:
    """The target's continuation of `prompt_ids`, greedy or drawn with `sampling` from `seed`,
    `MAX_PROPOSE` tokens a step, cut after the first end id."""
    session = engine.new_session()
    session.open(OpenRequest(prompt_ids=prompt_ids[:-1], processing=sampling or ProcessingConfig()))
    out: list[int] = []
    last = prompt_ids[-1]
    try:
        while len(out) < new_tokens:
            count = min(MAX_PROPOSE, new_tokens - len(out))
            result = session.step(StepRequest(append_ids=[last], propose=count, propose_greedy=sampling is None,
                                              propose_seed=seed + len(out), propose_ids_only=True))
            assert result.proposed_ids is not None
            for token in result.proposed_ids[0].tolist():
                out.append(token)
                if token in ends:
                    return out
            last = out[-1]
    finally:
        session.close()
    return out


def build(args: argparse.Namespace) -> Path:
    torch.set_num_threads(args.threads)
    lm = CausalLM.load(args.target, device="cpu", dtype="float32", quantization=args.quantize)
    assert lm.tokenizer is not None
    tokenizer = lm.tokenizer
    limits = EngineLimits(max_batch_rows=args.streams + 1, max_cache_len=args.max_len, compile=args.compile)
    engine = Engine(lm, "target", limits)
    ends = set(lm.eos_token_ids)
    texts = prompts(args.prompts, args.lines, args.seed)
    encoded = [tokenizer(text)["input_ids"][: args.max_len - args.new_tokens - 1] for text in texts]
    sampling = None
    if args.temperature > 0:
        sampling = ProcessingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)

    def write(index: int) -> list[int]:
        # Each continuation its own seeds, so a document does not depend on the streams' timing.
        return continuation(engine, encoded[index], args.new_tokens, ends, sampling, (args.seed << 32) + (index << 16))

    started = time.perf_counter()
    documents: list[str] = []
    generated = 0
    with ThreadPoolExecutor(args.streams) as pool, tqdm(total=len(encoded), desc="self-text", unit="doc") as bar:
        for text, ids in zip(texts, pool.map(write, range(len(encoded))),
                             strict=True):
            kept = [token for token in ids if token not in ends]
            documents.append(text + str(tokenizer.decode(kept, skip_special_tokens=True)))
            generated += len(ids)
            bar.update(1)
    seconds = time.perf_counter() - started
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(SEPARATOR.join(documents) + "\n", encoding="utf-8")
    print(f"wrote {out}: {len(documents)} continuations, {generated} tokens generated in {seconds:.0f} s "
          f"({generated / seconds:.0f} tokens/s, --quantize {lm.quantization}, "
          f"{'greedy' if sampling is None else f'sampled at temperature {args.temperature}'})")
    return out


def add_parser(commands: Any) -> None:
    parser = commands.add_parser("self-text")
    parser.add_argument("--target", required=True, help="target model directory (or hub id)")
    parser.add_argument("--out", required=True, help="the text file written")
    parser.add_argument("--prompts", type=int, default=256, help="continuations")
    parser.add_argument("--lines", type=int, default=4, help="source lines per prompt")
    parser.add_argument("--new-tokens", type=int, default=256, help="tokens per continuation, at most")
    parser.add_argument("--quantize", default="auto", help="the target's weights, as it is served (default auto)")
    # Gemma-3-270M, mixed, 2 threads, 64 prompts: 191 tokens/s at 8 streams, 327 at 32; 128 prompts: ~290 at 32 and 64.
    parser.add_argument("--streams", type=int, default=32, help="continuations batched together")
    parser.add_argument("--max-len", type=int, default=512, help="cache tokens per stream")
    parser.add_argument("--compile", default="off", choices=["auto", "on", "off"],
                        help="compile before generating (default off: minutes for a real target, longer than its run)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--seed", type=int, default=0, help="where the prompts are cut, and the draws")
    parser.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature (default 0: greedy)")
    parser.add_argument("--top-k", type=int, default=0, help="with --temperature: keep the k most likely ids (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="with --temperature: nucleus mass kept")


def run(args: argparse.Namespace) -> int:
    for name in ("prompts", "lines", "new_tokens", "streams", "threads"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(args, name)}")
    if args.temperature < 0 or args.top_k < 0 or not 0 < args.top_p <= 1:
        raise SystemExit("--temperature and --top-k must be ≥ 0 and --top-p in (0, 1]")
    if args.max_len <= args.new_tokens + 1:
        raise SystemExit(f"--max-len must exceed --new-tokens + 1, got {args.max_len} and {args.new_tokens}")
    build(args)
    return 0
