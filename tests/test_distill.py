"""`specwire distill`: the loss and α functions against direct computation, and a short run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from specwire.client.cli import main as cli_main
from specwire.draft_service.distill import acceptance, distillation_loss, greedy_agreement

from specwire.engine import CausalLM


def test_loss_is_kl_from_target_to_draft_and_alpha_is_one_minus_total_variation() -> None:
    generator = torch.Generator().manual_seed(0)
    target_logits, draft_logits = torch.randn(2, 3, 11, generator=generator), torch.randn(2, 3, 11, generator=generator)
    p, q = target_logits.softmax(-1), draft_logits.softmax(-1)
    assert distillation_loss(target_logits, draft_logits) == pytest.approx(float((p * (p / q).log()).sum(-1).mean()))
    assert distillation_loss(target_logits, target_logits) == pytest.approx(0.0, abs=1e-6)
    assert torch.allclose(acceptance(target_logits, draft_logits), 1 - 0.5 * (p - q).abs().sum(-1), atol=1e-6)
    assert torch.equal(greedy_agreement(target_logits, draft_logits), p.argmax(-1) == q.argmax(-1))


def test_distill_moves_the_draft_toward_the_target_and_is_deterministic(
    llama_target_dir: Path, llama_draft_dir: Path, tmp_path: Path
) -> None:
    text = tmp_path / "text.py"
    text.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(400)))
    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        argv = ["distill", "--target", str(llama_target_dir), "--draft", str(llama_draft_dir), "--out", str(out)]
        argv += ["--data", str(text), "--steps", "12", "--seq-len", "64", "--batch-size", "4", "--lr", "3e-3"]
        assert cli_main(argv) == 0
    report = json.loads((outs[0] / "distill_report.json").read_text())
    assert report["after"]["kl"] < report["before"]["kl"]
    assert report["after"]["alpha"] > report["before"]["alpha"]
    first, second = (load_file(str(out / "model.safetensors")) for out in outs)
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_distill_from_scratch_builds_a_trimmed_draft_that_learns_and_serves_target_ids(
    llama_target_dir: Path, tmp_path: Path
) -> None:
    """A new draft over the 256 most frequent of 320 ids, from a teacher cache built on the way: the same
    run twice gives the same weights; α rises and KL falls on held-out windows; loaded as a
    service loads it, it scores the target's whole vocabulary."""
    text = tmp_path / "text.py"
    text.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(300)))
    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        argv = ["distill", "--from-scratch", "--target", str(llama_target_dir), "--out", str(out), "--data", str(text),
                "--teacher-cache", str(tmp_path / "cache"), "--windows", "24", "--held-out-windows", "4",
                "--seq-len", "32", "--top-k", "16", "--layers", "1", "--hidden", "32", "--vocab-top", "256",
                "--text-windows", "8", "--text-weight", "0.1", "--steps", "40", "--batch-size", "4", "--lr", "5e-3", "--warmup", "4"]
        assert cli_main(argv) == 0
    report = json.loads((outs[0] / "distill_report.json").read_text())
    assert report["after"]["kl"] < report["before"]["kl"]
    assert report["after"]["alpha"] > report["before"]["alpha"]
    assert report["before"]["alpha"] <= report["before"]["alpha_upper"]
    first, second = (load_file(str(out / "model.safetensors")) for out in outs)
    assert all(torch.equal(first[name], second[name]) for name in first)
    lm = CausalLM.load(str(outs[0]), device="cpu", dtype="float32")
    assert lm.vocab_size == 320 and int(lm.model.get_input_embeddings().weight.shape[0]) == 256
