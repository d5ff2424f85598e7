"""Entry point of the draft service (`specwire serve draft`)."""

from __future__ import annotations

import asyncio

from specwire.draft_service.ngram import NgramDrafter

from specwire.config import ModelServiceConfig
from specwire.demo import demo_draft_dir, demo_target_dir
from specwire.errors import InvalidArgument
from specwire.model_server import load_engine, run
from specwire.session import Backend


def build_backend(config: ModelServiceConfig) -> Backend:
    if config.drafter == "model":
        return load_engine(config, str(demo_draft_dir()), "specwire-demo-draft")
    if config.drafter == "ngram":
        # No weights: `--model` only names the tokenizer / config of the target it drafts for.
        return NgramDrafter.load(config.model or str(demo_target_dir()), config.ngram_max, config.ngram_min)
    raise InvalidArgument("--drafter", f"must be 'model' or 'ngram', got {config.drafter!r}")


def main(config: ModelServiceConfig) -> None:
    asyncio.run(run(config, build_backend))
