"""`specwire train-medusa` on a tiny model: deterministic, the loss falls, heads load back."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from specwire.client.cli import main

from specwire.medusa import MedusaHeads
from tests.tiny import CORPUS

pytest_plugins = ["tests.medusa_fixtures"]  # random heads on the tiny target


def _train(model_dir: Path, data: list[str], out: Path) -> dict[str, object]:
    argv = ["train-medusa", "--model", str(model_dir), "--out", str(out), "--data", *data, "--steps", "40",
            "--heads", "2", "--seq-len", "16", "--batch-size", "4", "--eval-windows", "4", "--lr", "3e-3"]
    assert main(argv) == 0
    return json.loads((out / "train_report.json").read_text())  # type: ignore[no-any-return]


def test_train_medusa_is_deterministic_and_learns(llama_target_dir: Path, tmp_path: Path) -> None:
    data = []
    for index, text in enumerate(CORPUS * 2):
        path = tmp_path / f"text{index}.txt"
        path.write_text(text * 6)
        data.append(str(path))
    first = _train(llama_target_dir, data, tmp_path / "a")
    second = _train(llama_target_dir, data, tmp_path / "b")
    weights_a = load_file(str(tmp_path / "a" / "medusa_heads.safetensors"))
    weights_b = load_file(str(tmp_path / "b" / "medusa_heads.safetensors"))
    assert all(torch.equal(weights_a[name], weights_b[name]) for name in weights_a)
    assert first["held_out_accuracy"] == second["held_out_accuracy"]
    accuracy = first["held_out_accuracy"]
    assert isinstance(accuracy, list) and len(accuracy) == 2
    assert all(0.0 <= head["top1"] <= head["top5"] <= 1.0 for head in accuracy)
    loss_first, loss_last = first["loss_first"], first["loss_last"]
    assert isinstance(loss_first, list) and isinstance(loss_last, list)
    assert all(last < start for start, last in zip(loss_first, loss_last, strict=True))
    heads = MedusaHeads.load(tmp_path / "a")
    assert heads.num_heads == 2 and heads.config.vocab_size == 320


def test_train_medusa_from_a_teacher_cache_learns_trimmed_heads_that_load_back(llama_target_dir: Path, tmp_path: Path) -> None:
    """--teacher-cache: the base runs once per window (the cache, with hidden states); the heads
    cover the 64 most frequent ids and score −inf elsewhere; the same cache gives the same heads."""
    text = tmp_path / "text.txt"
    text.write_text("".join(CORPUS) * 40)
    reports = []
    for name in ("a", "b"):
        argv = ["train-medusa", "--model", str(llama_target_dir), "--out", str(tmp_path / name), "--data", str(text),
                "--teacher-cache", str(tmp_path / "cache"), "--windows", "16", "--held-out-windows", "16", "--seq-len", "32",
                "--top-k", "16", "--vocab-top", "64", "--steps", "30", "--heads", "2", "--batch-size", "4", "--lr", "3e-3"]
        assert main(argv) == 0
        reports.append(json.loads((tmp_path / name / "train_report.json").read_text()))
    assert reports[0]["held_out_accuracy"] == reports[1]["held_out_accuracy"]
    assert all(last < start for start, last in zip(reports[0]["loss_first"], reports[0]["loss_last"], strict=True))
    heads = MedusaHeads.load(tmp_path / "a")
    assert heads.config.head_vocab == 64 and heads.config.vocab_size == 320
    logits = heads(torch.randn(3, heads.config.hidden_size))  # [3, heads, 320]
    outside = torch.ones(320, dtype=torch.bool)
    outside[heads.vocab_ids] = False
    assert bool(torch.isneginf(logits[..., outside]).all()) and bool(torch.isfinite(logits[..., heads.vocab_ids]).all())
    hidden = torch.randn(3, heads.config.hidden_size)
    assert torch.equal(heads.top_ids(hidden, 5), heads(hidden).topk(5, dim=-1).indices)  # no 320-wide rows
    assert torch.equal(heads.top_ids(hidden, 80), heads(hidden).topk(80, dim=-1).indices)  # beyond the 64 ids
    # --init on other text, whose ids rank otherwise: the heads go on with their own 64 ids.
    other = tmp_path / "other.txt"
    other.write_text("".join(reversed(CORPUS)).upper() * 40)
    argv = ["train-medusa", "--model", str(llama_target_dir), "--out", str(tmp_path / "c"), "--data", str(other),
            "--teacher-cache", str(tmp_path / "cache-other"), "--windows", "16", "--held-out-windows", "16",
            "--seq-len", "32", "--top-k", "16", "--vocab-top", "64", "--steps", "10", "--heads", "2", "--batch-size",
            "4", "--lr", "3e-3", "--init", str(tmp_path / "a")]
    assert main(argv) == 0
    continued = MedusaHeads.load(tmp_path / "c")
    assert torch.equal(continued.vocab_ids, heads.vocab_ids)
    assert json.loads((tmp_path / "c" / "train_report.json").read_text())["init"] == "a"


def test_heads_on_a_quantised_target_are_quantised_too(llama_target_dir: Path, llama_heads_dir: Path) -> None:
    """An int8 target's heads read int8 weights; their proposals stay close to the float heads'."""
    from specwire.engine import CausalLM
    from specwire.engine.quantize import Int8Linear

    plain = CausalLM.load(str(llama_target_dir), device="cpu", dtype="float32")
    plain.attach_medusa(str(llama_heads_dir))
    lm = CausalLM.load(str(llama_target_dir), device="cpu", dtype="float32", quantization="int8")
    lm.attach_medusa(str(llama_heads_dir))
    assert lm.medusa is not None and plain.medusa is not None
    linears = [module for module in lm.medusa.modules() if isinstance(module, (torch.nn.Linear, Int8Linear))]
    assert linears and all(isinstance(module, Int8Linear) for module in linears)
    hidden = torch.randn(4, lm.medusa.config.hidden_size)
    agree = (lm.medusa.top_ids(hidden, 1) == plain.medusa.top_ids(hidden, 1)).float().mean()
    assert agree >= 0.75
