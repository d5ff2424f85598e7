"""A measuring command's JSON report: written to `--out`, printed with `--json`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(report: dict[str, Any], out: str | None, as_json: bool) -> bool:
    """Write `report` to `out` (if given) and print it when `as_json`; whether it was printed
    (else the command prints its own summary)."""
    document = json.dumps(report, indent=2)
    if out:
        Path(out).write_text(document + "\n")
    if as_json:
        print(document)
    return as_json
