"""Entry point of the target service (`specwire serve target`)."""

from __future__ import annotations

from specwire import model_server
from specwire.config import ModelServiceConfig
from specwire.demo import demo_medusa_dir, demo_target_dir
from specwire.model_server import load_engine
from specwire.session import Backend
from specwire.startup import StartupClock


def build_backend(config: ModelServiceConfig, clock: StartupClock) -> Backend:
    heads = demo_medusa_dir()
    default_heads = str(heads) if heads.is_dir() else None
    return load_engine(config, clock, str(demo_target_dir()), "specwire-demo-target", default_heads)


def main(config: ModelServiceConfig) -> None:
    model_server.main(config, build_backend)
