"""Optional dependency groups: `specwire[plots]` (matplotlib) and `specwire[otlp]` (the OTLP
span exporter). A feature that needs one imports it through `require`, so a missing extra is a
one-line error naming the install command, never an ImportError traceback."""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtra(RuntimeError):
    """A feature needs an optional dependency group that is not installed."""


def require(module: str, extra: str, feature: str) -> ModuleType:
    """`module`, imported; MissingExtra naming `pip install 'specwire[extra]'` if it cannot be."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise MissingExtra(
            f"{feature} needs the optional {extra!r} dependencies: pip install 'specwire[{extra}]' ({error})"
        ) from None
