"""Entry point of the target service (`specwire serve target`)."""

from __future__ import annotations

import asyncio

from specwire.config import ModelServiceConfig
from specwire.demo import demo_target_dir
from specwire.model_server import load_engine, run
from specwire.session import Backend


def build_backend(config: ModelServiceConfig) -> Backend:
    return load_engine(config, str(demo_target_dir()), "specwire-demo-target")


def main(config: ModelServiceConfig) -> None:
    asyncio.run(run(config, build_backend))
