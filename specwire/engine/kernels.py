"""The project's C++ CPU kernels (`*.cpp` beside this file), built with torch's extension builder
on first use and cached per source and torch version. They need a C++ compiler and AVX2, as
compiled CPU forwards do; a caller goes on without a kernel that does not build."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("specwire")

_BUILT: dict[str, Any] = {}
_FAILED: dict[str, str] = {}
# torch's builder takes a lock file in the build directory for every load, built or not, and
# waits for it with no limit: a process killed holding it (SIGKILL mid-start) left every later
# start of any service waiting forever. A build takes about a minute here, so a lock this old is
# a dead process's.
STALE_LOCK_S = 600.0


def clear_stale_lock(build_directory: Path, now: float | None = None) -> bool:
    """Remove the builder's lock in `build_directory` if older than STALE_LOCK_S; True if removed."""
    lock = build_directory / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < STALE_LOCK_S:
        return False
    log.warning("removing %s, left %.0f s ago by a build that never finished", lock, age)
    lock.unlink(missing_ok=True)
    return True


def load(stem: str) -> Any:
    """The module built from `stem`.cpp; ValueError, with the reason, where it cannot be built."""
    if stem in _BUILT:
        return _BUILT[stem]
    if stem in _FAILED:
        raise ValueError(_FAILED[stem])
    capability = torch.backends.cpu.get_cpu_capability()
    if not capability.startswith("AVX"):
        _FAILED[stem] = f"{stem}.cpp needs a CPU with AVX2; this one offers {capability}"
        raise ValueError(_FAILED[stem])
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # torch's builder runs `ninja`; the pip one sits beside python
        os.environ["PATH"] = sysconfig.get_path("scripts") + os.pathsep + os.environ.get("PATH", "")
    try:
        clear_stale_lock(Path(cpp_extension._get_build_directory(f"specwire_{stem}", verbose=False)))
        module = cpp_extension.load(
            f"specwire_{stem}", [str(Path(__file__).with_name(f"{stem}.cpp"))],
            # -fopenmp: at::parallel_for's OpenMP loop is compiled here, from torch's headers.
            # -ffp-contract=off: the sums are the source's, not the compiler's choice of FMAs.
            extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp"], extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except (RuntimeError, OSError, subprocess.CalledProcessError) as error:
        _FAILED[stem] = f"{stem}.cpp did not build ({error})"
        raise ValueError(_FAILED[stem]) from error
    _BUILT[stem] = module
    return module


def init_threads() -> None:
    """Run, on this thread, each built kernel's copy of torch's once-a-thread set-up of the thread
    count. `at::parallel_for` inlines it into every library that calls it; at that library's first
    loop on a thread, it sets the thread to the count any thread set last (torch 2.13), which
    undid `compute_on(1)` on a session thread at its first Medusa head (Gemma-3-270M greedy
    afterwards: 19 ms a token instead of 9, the second OpenMP pool stopping every worker's spin)."""
    for module in _BUILT.values():
        module.init_threads()


def available(stem: str) -> bool:
    """Whether `stem`.cpp builds here; where it does not, the reason is logged once."""
    told = stem in _FAILED
    try:
        load(stem)
    except ValueError as error:
        if not told:
            log.warning("%s; going on without it", error)
        return False
    return True
