"""`specwire pair NAME`: a real target with a distilled draft and Medusa heads, built locally.

One command runs every step, each skipped when its output is already there, so a second run
takes seconds:

1. the target (`specwire models fetch NAME`) into DIR;
2. the teacher cache (`specwire teacher-cache`, with hidden states) into DIR/teacher-cache;
3. a first draft (`specwire distill --from-scratch`) into DIR/draft-base: a small Llama over
   the target's most frequent ids, from the cache plus the text's own next tokens;
4. the target's own greedy continuations of prompts cut from the text (`specwire self-text`,
   the target quantised as it is served) into DIR/self-text.txt;
5. the draft (`specwire distill --from-scratch --init DIR/draft-base`) into DIR/draft: the first
   one trained further on those continuations, from a teacher cache of them (DIR/teacher-cache-self);
6. Medusa heads (`specwire train-medusa --teacher-cache`) into DIR/medusa;
7. their tree (`tune_medusa_tree`, the recipe's node count) into DIR/medusa/choices.json:
   the target service's default tree for Medusa requests;
8. a feature drafter (`specwire train-medusa --kind feature`, EAGLE-style, from the same cache)
   into DIR/feature-drafter: what `specwire bench` and `specwire demo --pair` serve as the
   target's heads where it is there.

The training text is the Python standard library's source (the demo pair's split), which every
machine with Python has; the recipe per model is sized for a 2-core CPU (52 minutes for the
target and draft there, 19 more for the Medusa heads: docs/models.md).
Nothing built here is part of specwire: it derives from the target's weights and their terms.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specwire import model_zoo

log = logging.getLogger("specwire")

RECORD = "specwire-pair.json"  # what was built, with each step's seconds
FEATURE_DRAFTER = "feature-drafter"  # beside the target


@dataclass(frozen=True)
class Recipe:
    """The flags each step runs with (shared: the cache's)."""

    cache: tuple[str, ...]  # teacher-cache flags, repeated to the steps that read the cache
    draft: tuple[str, ...]  # distill --from-scratch flags
    self_text: tuple[str, ...]  # self-text flags
    self_draft: tuple[str, ...]  # distill --init flags, its teacher cache's among them
    medusa: tuple[str, ...]  # train-medusa flags
    tree: tuple[str, ...]  # tune_medusa_tree flags
    feature: tuple[str, ...]  # train-medusa --kind feature flags


RECIPES: dict[str, Recipe] = {
    "gemma-3-270m": Recipe(
        cache=("--windows", "512", "--held-out-windows", "48", "--seq-len", "256", "--top-k", "64"),
        draft=("--layers", "4", "--hidden", "384", "--vocab-top", "16384", "--text-windows", "20000",
               "--steps", "1500", "--batch-size", "8", "--text-batch", "8", "--lr", "2e-3", "--warmup", "100", "--bf16"),
        # 960 continuations: α on the bench's continuations 0.624 against 0.583 from 320 (whose
        # ~330 windows 500 steps overfit, so they had 150).
        self_text=("--prompts", "960", "--lines", "4", "--new-tokens", "256"),
        # --accept-weight 4: on the bench's sampled continuations α 0.634 against 0.624 without it
        # (0.6825 at 12 on its held-out windows, as at 4).
        self_draft=("--windows", "384", "--held-out-windows", "16", "--seq-len", "256", "--top-k", "64",
                    "--text-windows", "1200", "--text-batch", "8", "--batch-size", "4", "--steps", "450",
                    "--lr", "5e-4", "--warmup", "45", "--bf16", "--accept-weight", "4"),
        medusa=("--heads", "3", "--layers", "1", "--vocab-top", "16384", "--steps", "600", "--batch-size", "4",
                "--lr", "1e-3"),
        # 6 nodes: a 7-position verification of the int8 target costs little more than one
        # position on a 2-core CPU (docs/medusa.md, "Heads for Gemma-3-270M").
        tree=("--nodes", "6", "--prompts", "6", "--new-tokens", "48", "--max-rank", "4"),
        feature=("--kind", "feature", "--heads", "4", "--vocab-top", "16384", "--steps", "1500", "--batch-size", "8",
                 "--lr", "1e-3"),
    ),
}


def parse_command(add_parser: Callable[[Any], None], argv: list[str]) -> argparse.Namespace:
    """`argv` parsed as the command `add_parser` defines would parse it on the command line."""
    parser = argparse.ArgumentParser(prog="specwire")
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def build(name: str, out: Path, threads: int, medusa: bool = True) -> dict[str, Any]:
    """Every missing part of NAME's pair under `out`; returns the record of what each step took."""
    # Here, not above: `specwire demo --pair` reads RECIPES without loading the trainers.
    from specwire.draft_service import distill, scratch, self_text
    from specwire.target_service import train_medusa, tune_medusa_tree

    from specwire.medusa import CHOICES_NAME

    recipe = RECIPES[name]
    record_path = out / RECORD
    record: dict[str, Any] = json.loads(record_path.read_text()) if record_path.exists() else {"name": name}
    steps: list[tuple[str, Path, Callable[[], object]]] = []
    common = ["--teacher-cache", str(out / "teacher-cache"), "--threads", str(threads), *recipe.cache]
    steps.append(("target", out / model_zoo.DONE_MARK, lambda: model_zoo.fetch(name, out)))
    _keep_first_draft(out)
    base, text = out / "draft-base", out / "self-text.txt"
    base_argv = ["distill", "--from-scratch", "--target", str(out), "--out", str(base), *common, *recipe.draft]
    # The cache keeps hidden states from the start when Medusa heads will read it.
    base_argv += ["--keep-hidden"] if medusa else []
    steps.append(("draft_base", base / scratch.REPORT, lambda: distill.run(parse_command(distill.add_parser, base_argv))))
    text_argv = ["self-text", "--target", str(out), "--out", str(text), "--threads", str(threads), *recipe.self_text]
    steps.append(("self_text", text, lambda: self_text.run(parse_command(self_text.add_parser, text_argv))))
    draft_argv = ["distill", "--from-scratch", "--init", str(base), "--target", str(out), "--out", str(out / "draft"),
                  "--data", str(text), "--teacher-cache", str(out / "teacher-cache-self"), "--threads", str(threads),
                  *recipe.self_draft]
    steps.append(("draft", out / "draft" / scratch.REPORT, lambda: distill.run(parse_command(distill.add_parser, draft_argv))))
    if medusa:
        medusa_argv = ["train-medusa", "--model", str(out), "--out", str(out / "medusa"), *common, *recipe.medusa]
        steps.append(("medusa", out / "medusa" / "train_report.json",
                      lambda: train_medusa.main(parse_command(train_medusa.add_parser, medusa_argv))))
        tree = out / "medusa" / CHOICES_NAME
        tree_argv = ["--model", str(out), "--heads", str(out / "medusa"), "--threads", str(threads), *recipe.tree,
                     "--out", str(tree)]
        steps.append(("medusa_tree", tree, lambda: tune_medusa_tree.main(tree_argv)))
        feature_argv = ["train-medusa", "--model", str(out), "--out", str(out / FEATURE_DRAFTER), *common, *recipe.feature]
        steps.append(("feature_drafter", out / FEATURE_DRAFTER / "train_report.json",
                      lambda: train_medusa.main(parse_command(train_medusa.add_parser, feature_argv))))
    for step, done, run in steps:
        if done.exists():
            continue
        log.info("pair %s: building the %s", name, step)
        started = time.perf_counter()
        run()
        record[f"{step}_seconds"] = round(time.perf_counter() - started, 1)
        out.mkdir(parents=True, exist_ok=True)
        record_path.write_text(json.dumps(record, indent=1) + "\n")
    return record


def _keep_first_draft(out: Path) -> None:
    """A pair built before drafts were trained on the target's own text has its first draft in
    DIR/draft: it becomes DIR/draft-base rather than being trained again."""
    from specwire.draft_service import scratch

    report, record = out / "draft" / scratch.REPORT, out / RECORD
    if report.exists() and not json.loads(report.read_text()).get("init") and not (out / "draft-base").exists():
        (out / "draft").rename(out / "draft-base")
        if record.exists():
            steps = json.loads(record.read_text())
            steps["draft_base_seconds"] = steps.pop("draft_seconds", None)
            record.write_text(json.dumps(steps, indent=1) + "\n")


def add_parser(commands: Any) -> None:
    parser = commands.add_parser("pair")
    parser.add_argument("name", choices=sorted(RECIPES))
    parser.add_argument("--out", type=Path, help="directory (default: ~/.cache/specwire/models/NAME)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of every step")
    parser.add_argument("--no-medusa", action="store_true", help="skip the Medusa heads and the feature drafter")


def run(args: argparse.Namespace) -> int:
    out = args.out or model_zoo.default_dir(args.name)
    record = build(args.name, out, args.threads, medusa=not args.no_medusa)
    seconds = sum(value for key, value in record.items() if key.endswith("_seconds"))
    print(f"{out}: target; {out / 'draft'}: draft" + (
        "" if args.no_medusa else f"; {out / 'medusa'}: Medusa heads; {out / FEATURE_DRAFTER}: feature drafter"))
    print(f"built in {seconds / 60:.1f} min in all (per step: {RECORD})")
    return 0


def pair_heads(out: Path) -> str | None:
    """The heads a pair's target serves: its feature drafter where it has one (2.37 tokens a
    target forward on Gemma-3-270M, against 1.74 for its Medusa heads), else its Medusa heads."""
    from specwire.feature_drafter import is_feature_drafter
    from specwire.medusa import CONFIG_NAME

    if is_feature_drafter(out / FEATURE_DRAFTER):
        return str(out / FEATURE_DRAFTER)
    return str(out / "medusa") if (out / "medusa" / CONFIG_NAME).is_file() else None
