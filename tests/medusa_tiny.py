"""Random Medusa heads for the tiny models, and stacks whose target serves them (plain helpers;
the fixtures are in `tests.medusa_fixtures`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from specwire.engine import CausalLM, Engine, EngineLimits
from specwire.medusa import MedusaConfig, MedusaHeads
from tests.harness import LoopThread, Stack, start_model_server, start_orchestrator


def save_random_heads(model_dir: Path, out: Path, heads: int = 3, seed: int = 0, plausible: bool = False) -> Path:
    """Heads with random (not zero) residual weights, so every part of the head is exercised.

    `plausible`: vocabulary maps copied from the model's output layer (as training starts), so
    the candidates are tokens the model finds likely and acceptance is exercised often.
    """
    config = AutoConfig.from_pretrained(str(model_dir))
    torch.manual_seed(seed)
    medusa = MedusaHeads(MedusaConfig(heads, 1, int(config.hidden_size), int(config.vocab_size)))
    with torch.no_grad():
        for parameter in medusa.parameters():
            parameter.normal_(0.0, 0.1 if plausible else 0.5)
        if plausible:
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
            medusa.init_from_lm_head(model.get_output_embeddings().weight)
    medusa.save(out)
    return out


def medusa_engine(model_dir: Path, heads_dir: Path, batching: bool = True, **limits: Any) -> Engine:
    """`batching=False`: the `--engine hf` path (transformers' forward, a DynamicCache); `limits`:
    more `EngineLimits`."""
    lm = CausalLM.load(str(model_dir), device="cpu", dtype="float32")
    lm.attach_medusa(str(heads_dir))
    return Engine(lm, "target", EngineLimits(batching=batching, **limits))


def medusa_stack(loop: LoopThread, model_dir: Path, heads_dir: Path, draft_dir: Path) -> Stack:
    """A target with heads (and a draft, unused by Medusa, so the stack is the usual one)."""
    target = loop.run(start_model_server(medusa_engine(model_dir, heads_dir)))
    draft = loop.run(start_model_server(Engine(CausalLM.load(str(draft_dir), device="cpu", dtype="float32"), "draft")))
    orchestrator = loop.run(start_orchestrator(target.address, draft.address, str(model_dir), max_new_tokens_limit=256))
    return Stack(loop, target, draft, orchestrator)
