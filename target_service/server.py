"""Entry point of the target service (`specwire serve target`)."""

from __future__ import annotations

import asyncio

from specwire.config import ModelServiceConfig
from specwire.demo import demo_medusa_dir, demo_target_dir
from specwire.model_server import load_engine, run
from specwire.session import Backend


def build_backend(config: ModelServiceConfig) -> Backend:
    heads = demo_medusa_dir()
    default_heads = str(heads) if heads.is_dir() else None
    return load_engine(config, str(demo_target_dir()), "specwire-demo-target", default_heads)


def main(config: ModelServiceConfig) -> None:
    asyncio.run(run(config, build_backend))
