"""The bench's `llamacpp` row: llama.cpp (llama-cpp-python) greedy on the GGUF the target came from.

It is what a CPU user would run instead of specwire: the same prompts as token ids, greedy
(top-k 1), end-of-sequence ignored (the bench stops at `max_new_tokens`), the threads given
(the target service's count). Time covers prompt evaluation and generation, as a `Generate`
call's does. llama.cpp keeps its own weights in the GGUF's quantisation (Q4_K_M for
Gemma-3-270M), so its tokens may differ from the float target's where logits nearly tie.

On CPUs with AMX, llama.cpp 0.3.36 built with its native flags segfaults in its first decode
(ggml-org/llama.cpp#20824); build it with AMX off: see docs/performance.md.
"""

from __future__ import annotations

import contextlib
import os
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
