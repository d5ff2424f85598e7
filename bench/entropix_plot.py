"""A picture of an entropix generation: each token on the entropy × varentropy plane, by state."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

STATE_COLOURS = {
    "argmax": "tab:green",
    "branch": "tab:blue",
    "clarify": "tab:purple",
    "resample": "tab:red",
    "adaptive": "tab:orange",
}


def plot_decisions(decisions: Sequence[Any], path: str | Path, title: str = "") -> None:
    """Scatter of (entropy, varentropy) per generated token, coloured by the state that chose it.

    `decisions`: objects with `state`, `entropy` and `varentropy` (the SDK's `Decision`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.5, 5.0))
    for state, colour in STATE_COLOURS.items():
        points = [(d.entropy, d.varentropy) for d in decisions if d.state == state]
        if points:
            xs, ys = zip(*points, strict=True)
            axes.scatter(xs, ys, s=18, color=colour, label=f"{state} ({len(points)})", alpha=0.8)
    for index, d in enumerate(decisions):
        if index < 40:  # token order, for the first tokens
            axes.annotate(str(index), (d.entropy, d.varentropy), fontsize=6, alpha=0.6)
    axes.set_xlabel("entropy of the next token (bits)")
    axes.set_ylabel("varentropy (bits²)")
    axes.set_title(title or f"entropix: {len(decisions)} tokens by state")
    axes.legend(loc="upper left", fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
