"""Embedded default draft/target model pair for specwire.

The ``pair`` directory next to this module holds two small Llama-style causal
language models trained on the CPython standard library source code by
:mod:`specwire.demo.train_pair`:

* ``pair/target/`` -- the larger TARGET model (verifies drafted tokens),
* ``pair/draft/``  -- the smaller DRAFT model (proposes tokens cheaply).

Both share one byte-level BPE tokenizer; its files are saved inside each model
directory, so ``AutoTokenizer.from_pretrained(model_dir)`` works for either.
Weights are stored as float16 safetensors; load them with an explicit dtype,
e.g. ``AutoModelForCausalLM.from_pretrained(demo_target_dir(), dtype=torch.float32)``.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["DEMO_DIR", "demo_target_dir", "demo_draft_dir", "demo_medusa_dir", "demo_tokenizer_dir"]

DEMO_DIR: Path = Path(__file__).parent / "pair"


def demo_target_dir() -> Path:
    """Return the directory of the embedded TARGET model (HF format)."""
    return DEMO_DIR / "target"


def demo_draft_dir() -> Path:
    """Return the directory of the embedded DRAFT model (HF format)."""
    return DEMO_DIR / "draft"


def demo_medusa_dir() -> Path:
    """Return the directory of the demo target's Medusa heads (`specwire train-medusa`)."""
    return DEMO_DIR / "target-medusa"


def demo_tokenizer_dir() -> Path:
    """Return a directory holding the shared tokenizer files.

    The tokenizer is identical in both model directories; the target's copy
    is returned.
    """
    return demo_target_dir()
