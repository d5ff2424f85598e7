"""Entry point of the draft service (`specwire serve draft`)."""

from __future__ import annotations

from specwire.draft_service.ngram import NgramDrafter

from specwire import model_server
from specwire.config import ModelServiceConfig
from specwire.demo import demo_draft_dir, demo_target_dir
from specwire.errors import InvalidArgument
from specwire.model_server import load_engine
from specwire.session import Backend
from specwire.startup import StartupClock


def build_backend(config: ModelServiceConfig, clock: StartupClock) -> Backend:
    if config.drafter == "model":
        return load_engine(config, clock, str(demo_draft_dir()), "specwire-demo-draft")
    if config.drafter == "ngram":
        # No weights: `--model` only names the tokenizer / config of the target it drafts for.
        drafter = NgramDrafter.load(config.model or str(demo_target_dir()), config.ngram_max, config.ngram_min)
        clock.mark("load")
        return drafter
    raise InvalidArgument("--drafter", f"must be 'model' or 'ngram', got {config.drafter!r}")


def main(config: ModelServiceConfig) -> None:
    model_server.main(config, build_backend)
