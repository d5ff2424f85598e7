"""`specwire` and `python -m specwire`: the command line, with the process set up first."""

import os
from collections.abc import MutableMapping

# libgomp's spins for an OpenMP worker between parallel loops, about 0.2 ms here. Sleeping at once
# (OMP_WAIT_POLICY=PASSIVE) costs a futex wake per loop: Gemma-3-270M int8 decode 20.6 → 34 ms a
# token on 2 cores. libgomp's default (300,000 spins, ~3 ms) keeps an idle service's workers on
# the cores its neighbour computes on: a demo forward under load 1.5–3 → 85–255 ms.
OPENMP_SPINS = "10000"


def short_openmp_waits(environ: MutableMapping[str, str]) -> None:
    """OpenMP workers spin OPENMP_SPINS times, then sleep, unless the environment chooses. Read
    once, when torch loads libgomp; the services this process starts inherit it."""
    if "OMP_WAIT_POLICY" not in environ and "GOMP_SPINCOUNT" not in environ:
        environ["GOMP_SPINCOUNT"] = OPENMP_SPINS


def run() -> int:
    short_openmp_waits(os.environ)
    # Before the imports that take seconds: a child of `specwire up` / `bench` whose parent is
    # already gone stops now, not once torch has loaded.
    from specwire.lifeline import watch_parent

    watch_parent()
    from specwire.client.cli import main

    return main()


if __name__ == "__main__":
    raise SystemExit(run())
