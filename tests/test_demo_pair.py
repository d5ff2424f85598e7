"""The embedded demo pair: loads as the services load it, shares one tokenizer, and the target is
measurably better than the draft on held-out standard-library source."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specwire.demo import demo_draft_dir, demo_target_dir
from specwire.demo.train_pair import encode_stream, evaluate, load_corpus, windows
from specwire.engine import CausalLM, Engine, load_tokenizer, tokenizer_fingerprint

pytestmark = pytest.mark.skipif(not (demo_target_dir() / "config.json").exists(), reason="demo pair not built")


def test_pair_shares_one_tokenizer_and_vocabulary() -> None:
    target, draft = (Engine(CausalLM.load(str(d), device="cpu"), role).info() for d, role in
                     ((demo_target_dir(), "target"), (demo_draft_dir(), "draft")))
    assert target.vocab_size == draft.vocab_size == 4096
    assert target.tokenizer_fingerprint == draft.tokenizer_fingerprint != ""
    assert target.eos_token_ids == draft.eos_token_ids


def test_target_beats_draft_on_held_out_stdlib_files() -> None:
    tokenizer = load_tokenizer(str(demo_target_dir()))
    assert tokenizer is not None and tokenizer_fingerprint(tokenizer)
    held_out = load_corpus().val  # every 50th file: never trained on
    stream = encode_stream(tokenizer, [text for _, text in held_out[:4]])
    eval_windows = windows(np.asarray(stream), 256)[:12]
    assert len(eval_windows) >= 4
    losses = {}
    for name, path in (("target", demo_target_dir()), ("draft", demo_draft_dir())):
        lm = CausalLM.load(str(path), device="cpu", dtype="float32")
        with torch.inference_mode():
            losses[name] = evaluate(lm.model, eval_windows)
    assert losses["target"] < losses["draft"] - 0.1, losses
