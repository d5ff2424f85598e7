"""The bench's `llamacpp` row: llama.cpp (llama-cpp-python) greedy on the GGUF the target came from.

It is what a CPU user would run instead of specwire: the same prompts as token ids, greedy
(top-k 1), end-of-sequence ignored (the bench stops at `max_new_tokens`), the threads given
(the target service's count). Time covers prompt evaluation and generation, as a `Generate`
call's does. llama.cpp keeps its own weights in the GGUF's quantisation (Q4_K_M for
Gemma-3-270M), so its tokens may differ from the float target's where logits nearly tie.

On CPUs with AMX, llama.cpp 0.3.36 built with its native flags dies evaluating its first prompt
(ggml-org/llama.cpp#20824: a segfault, or SIGILL); build it with AMX off: see docs/performance.md.
The bench decodes a short prompt in a child process first (`decode_failure`), so that such a build
fails its row, not the whole run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def find_gguf(target_model: str) -> Path | None:
    """The GGUF a target was prepared from (`specwire models fetch` keeps it in DIR/gguf/), or the
    target itself when it is a .gguf file."""
    path = Path(target_model)
    if path.suffix == ".gguf" and path.is_file():
        return path
    found = sorted((path / "gguf").glob("*.gguf")) if path.is_dir() else []
    return found[0] if found else None


PROBE_TIMEOUT_S = 300.0
# A prompt of this many tokens and two new ones, in a child process: a prompt's batched matrix
# products are where an AMX build dies (one token from BOS alone decodes).
PROBE_PROMPT_TOKENS = 32
_PROBE = ("from pathlib import Path; from specwire.bench.llamacpp import LlamaCppRunner; "
          "runner = LlamaCppRunner(Path({gguf!r}), {threads}); runner.generate([runner.llm.token_bos()] * {tokens}, 2)")


def decode_failure(gguf: Path, threads: int) -> str | None:
    """Why llama.cpp cannot decode `gguf` here, found in a child process (None if it can): a
    native crash in the bench's own process would end the whole run without a word."""
    return child_failure([sys.executable, "-c", _PROBE.format(gguf=str(gguf), threads=threads, tokens=PROBE_PROMPT_TOKENS)])


def child_failure(argv: list[str]) -> str | None:
    """What ended the probe `argv` other than success, as the row's error; None on exit status 0."""
    prompt = f"a {PROBE_PROMPT_TOKENS}-token prompt"
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"llama.cpp did not decode {prompt} in {PROBE_TIMEOUT_S:.0f} s (a child process)"
    if done.returncode == 0:
        return None
    failed = f"llama.cpp could not decode {prompt} in a child process"
    if done.returncode < 0:  # a native crash: the known one is AMX's
        return (f"{failed} (killed by {signal.Signals(-done.returncode).name}); where the CPU has AMX, "
                "build llama-cpp-python without it (docs/performance.md)")
    last = done.stderr.strip().splitlines()[-1:] or [""]
    return f"{failed} (exit status {done.returncode}: {last[0]})"


class LlamaCppRunner:
    def __init__(self, gguf: Path, threads: int, context: int = 2048) -> None:
        import llama_cpp

        with open(os.devnull, "w") as quiet, contextlib.redirect_stderr(quiet):
            self.llm: Any = llama_cpp.Llama(
                model_path=str(gguf), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                n_batch=512, verbose=False,
            )
        self.gguf = gguf
        self.threads = threads

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], float]:
        """(greedy tokens, seconds) for `max_new_tokens` tokens after `prompt_ids`."""
        tokens: list[int] = []
        started = time.perf_counter()
        for token in self.llm.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                       reset=True):
            tokens.append(int(token))
            if len(tokens) == max_new_tokens:
                break
        return tokens, time.perf_counter() - started
