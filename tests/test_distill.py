"""`specwire distill`: the loss and α functions against direct computation, and a short run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from specwire.client.cli import main as cli_main
from specwire.draft_service.distill import acceptance, distillation_loss, greedy_agreement
from specwire.draft_service.scratch import parse_warpers
from transformers import GenerationConfig

from specwire.engine import CausalLM
from specwire.processing import ProcessingConfig, sampling_probs
from specwire.sparse_distill import sparse_targets, warped_alpha


def test_loss_is_kl_from_target_to_draft_and_alpha_is_one_minus_total_variation() -> None:
    generator = torch.Generator().manual_seed(0)
    target_logits, draft_logits = torch.randn(2, 3, 11, generator=generator), torch.randn(2, 3, 11, generator=generator)
    p, q = target_logits.softmax(-1), draft_logits.softmax(-1)
    assert distillation_loss(target_logits, draft_logits) == pytest.approx(float((p * (p / q).log()).sum(-1).mean()))
    assert distillation_loss(target_logits, target_logits) == pytest.approx(0.0, abs=1e-6)
    assert torch.allclose(acceptance(target_logits, draft_logits), 1 - 0.5 * (p - q).abs().sum(-1), atol=1e-6)
    assert torch.equal(greedy_agreement(target_logits, draft_logits), p.argmax(-1) == q.argmax(-1))


def test_warped_alpha_from_the_cached_top_k_equals_alpha_of_the_warped_dense_distributions() -> None:
    """α under temperature, top-k 6 and top-p 0.9 from a teacher's top 16 of 40 ids and a draft over
    30 of them equals Σ min(p_w, q_w) of the dense warped rows (`sampling_probs`, as served)."""
    generator = torch.Generator().manual_seed(1)
    kept = torch.randperm(40, generator=generator)[:30].sort().values  # the draft's target ids
    table = torch.full((40,), -1, dtype=torch.long)
    table[kept] = torch.arange(30)
    target_logits = 2 * torch.randn(64, 40, generator=generator)
    draft_logits = target_logits[:, kept] + torch.randn(64, 30, generator=generator)
    logp, ids = target_logits.log_softmax(-1).topk(16, dim=-1)
    idx, inside = sparse_targets(ids, table)
    dense_draft = torch.full((64, 40), float("-inf")).index_copy(1, kept, draft_logits)
    none = torch.zeros((64, 1), dtype=torch.long)
    for temperature, top_p in ((0.7, 0.9), (1.0, 1.0)):
        warpers = ProcessingConfig(temperature=temperature, top_k=6, top_p=top_p)
        p, q = sampling_probs(target_logits, none, warpers), sampling_probs(dense_draft, none, warpers)
        expected = torch.minimum(p, q).sum(-1)
        got = warped_alpha(logp, idx, inside, draft_logits, warpers)
        assert torch.allclose(got, expected, atol=1e-5)
        assert 0.2 < float(got.mean()) < 0.95
        assert torch.allclose(warped_alpha(logp, idx, inside, target_logits[:, kept], warpers)[inside[:, :6].all(-1)], torch.tensor(1.0), atol=1e-5)


@pytest.mark.parametrize("text", ["0.7,27", "hot,27,0.9", "0,27,0.9", "0.7,-1,0.9", "0.7,27,1.5"])
def test_a_bad_accept_warpers_flag_is_refused_naming_it(text: str) -> None:
    with pytest.raises(SystemExit, match="--accept-warpers"):
        parse_warpers(text)
    assert parse_warpers("0.7,27,0.9") == ProcessingConfig(temperature=0.7, top_k=27, top_p=0.9)


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
                "--text-windows", "8", "--text-weight", "0.1", "--steps", "40", "--batch-size", "4", "--lr", "5e-3", "--warmup", "4",
                "--accept-weight", "0.5", "--accept-warpers", "0.8,8,0.95"]
        assert cli_main(argv) == 0
    report = json.loads((outs[0] / "distill_report.json").read_text())
    assert report["after"]["kl"] < report["before"]["kl"]
    assert report["after"]["alpha"] > report["before"]["alpha"]
    assert report["after"]["sampled_alpha"] > report["before"]["sampled_alpha"]
    assert report["accept_warpers"] == {"temperature": 0.8, "top_k": 8, "top_p": 0.95}
    assert report["before"]["alpha"] <= report["before"]["alpha_upper"]
    first, second = (load_file(str(out / "model.safetensors")) for out in outs)
    assert all(torch.equal(first[name], second[name]) for name in first)
    lm = CausalLM.load(str(outs[0]), device="cpu", dtype="float32")
    assert lm.vocab_size == 320 and int(lm.model.get_input_embeddings().weight.shape[0]) == 256


def test_self_text_continues_prompts_as_transformers_greedy_does(llama_target_dir: Path) -> None:
    """The engine's continuation of a prompt is transformers' greedy `generate`, token for token,
    over two `MAX_PROPOSE` steps; the prompts are statement openings of the stdlib's training files."""
    from specwire.draft_service.self_text import continuation, prompts

    from specwire.engine import MAX_PROPOSE, Engine, EngineLimits

    lm = CausalLM.load(str(llama_target_dir), device="cpu", dtype="float32")
    engine = Engine(lm, "target", EngineLimits(max_batch_rows=3, max_cache_len=256, compile="off"))
    prompt = [1, 17, 42, 99, 5]
    new_tokens = MAX_PROPOSE + 37  # two steps; at 115 its top two logits lie 0.002 apart (a tie to float error)
    ours = continuation(engine, prompt, new_tokens, ends=set())
    greedy = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=[])  # no end id: every step's argmax
    reference = lm.model.generate(torch.tensor([prompt]), generation_config=greedy)[0, len(prompt):].tolist()
    assert len(reference) == new_tokens
    assert ours == reference
    cut = continuation(engine, prompt, new_tokens, ends={reference[10]})
    assert cut == reference[: reference.index(reference[10]) + 1]
    openings = prompts(5, 3, seed=1)
    assert openings == prompts(5, 3, seed=1) and len(set(openings)) == 5
    assert all(text.count("\n") == 3 and text.strip() and not text.lstrip().startswith("#") for text in openings)


def test_self_text_samples_within_the_warpers_and_replays_its_seed(llama_target_dir: Path) -> None:
    """Sampled continuations: each token among the top k of transformers' logits at its position,
    the same tokens from the same seed, others from another, and not the greedy path."""
    from specwire.draft_service.self_text import continuation

    from specwire.engine import Engine, EngineLimits
    from specwire.processing import ProcessingConfig

    lm = CausalLM.load(str(llama_target_dir), device="cpu", dtype="float32")
    engine = Engine(lm, "target", EngineLimits(max_batch_rows=3, max_cache_len=256, compile="off"))
    prompt, new_tokens = [1, 17, 42, 99, 5], 40
    sampling = ProcessingConfig(temperature=1.5, top_k=3)
    drawn = continuation(engine, prompt, new_tokens, set(), sampling, seed=7)
    assert len(drawn) == new_tokens
    assert drawn == continuation(engine, prompt, new_tokens, set(), sampling, seed=7)
    assert drawn != continuation(engine, prompt, new_tokens, set(), sampling, seed=8)
    assert drawn != continuation(engine, prompt, new_tokens, set())
    with torch.no_grad():
        logits = lm.model(torch.tensor([prompt + drawn])).logits[0, len(prompt) - 1 : -1]  # [new_tokens, vocab]
    allowed = logits.topk(3, dim=-1).indices
    assert (allowed == torch.tensor(drawn)[:, None]).any(-1).all()


def test_distill_init_trains_a_scratch_draft_further_on_the_target_own_text(llama_target_dir: Path, tmp_path: Path) -> None:
    """self-text's corpus, then `--init`: the draft keeps its shape and vocabulary and moves toward the target."""
    text = tmp_path / "self.txt"
    argv = ["self-text", "--target", str(llama_target_dir), "--out", str(text), "--prompts", "12", "--lines", "2",
            "--new-tokens", "48", "--streams", "3", "--max-len", "128", "--compile", "off", "--threads", "1"]
    assert cli_main(argv) == 0
    assert text.read_text().count("\n\n\n") >= 11
    common = ["--target", str(llama_target_dir), "--data", str(text), "--seq-len", "32", "--top-k", "16",
              "--windows", "16", "--held-out-windows", "2", "--batch-size", "4", "--warmup", "2"]
    first, second = tmp_path / "first", tmp_path / "second"
    assert cli_main(["distill", "--from-scratch", "--out", str(first), "--teacher-cache", str(tmp_path / "c1"), *common,
                     "--layers", "1", "--hidden", "32", "--vocab-top", "200", "--steps", "4", "--lr", "5e-3"]) == 0
    assert cli_main(["distill", "--from-scratch", "--init", str(first), "--out", str(second),
                     "--teacher-cache", str(tmp_path / "c1"), *common, "--steps", "30", "--lr", "5e-3"]) == 0
    before, after = (json.loads((out / "distill_report.json").read_text()) for out in (first, second))
    assert after["init"] == str(first) and after["shape"] == before["shape"]
    assert (second / "draft_vocab.json").read_text() == (first / "draft_vocab.json").read_text()
    assert after["before"] == before["after"]  # it starts where the first run ended
    assert after["after"]["kl"] < after["before"]["kl"]
    # Deepened (`--grow-layers`): twice the layers, starting from what the first draft computes.
    deeper = tmp_path / "deeper"
    assert cli_main(["distill", "--from-scratch", "--init", str(first), "--grow-layers", "2", "--out", str(deeper),
                     "--teacher-cache", str(tmp_path / "c1"), *common, "--steps", "30", "--lr", "5e-3"]) == 0
    grown = json.loads((deeper / "distill_report.json").read_text())
    assert grown["shape"] == before["shape"] | {"layers": 2} and grown["before"] == before["after"]
    assert grown["after"]["kl"] < grown["before"]["kl"]


def test_a_deepened_draft_computes_what_it_did_and_its_copies_can_learn(llama_target_dir: Path) -> None:
    """`deepen`: 2 → 4 layers with the same logits; each copy keeps its layer's input weights (so
    training moves it at once) and only its output projections start at zero; 3 is refused."""
    from specwire.draft_service.scratch import DraftShape, deepen, new_draft
    from transformers import AutoConfig

    from specwire.engine.trimmed_vocab import TrimmedVocab

    config = AutoConfig.from_pretrained(str(llama_target_dir))
    vocab = TrimmedVocab(config.vocab_size, tuple(range(24)), fallback=1)
    model = new_draft(DraftShape(layers=2, hidden=64, vocab_top=24), vocab, config, 64, seed=3).eval()
    grown = deepen(model, 4).eval()
    ids = torch.tensor([[1, 5, 9, 2, 17, 3]])
    with torch.no_grad():
        torch.testing.assert_close(grown(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=1e-5)
    layers = grown.model.layers
    assert len(layers) == 4 and torch.equal(layers[3].self_attn.q_proj.weight, model.model.layers[1].self_attn.q_proj.weight)
    assert not layers[3].mlp.down_proj.weight.any() and layers[2].mlp.down_proj.weight.any()
    with pytest.raises(SystemExit, match="multiple"):
        deepen(model, 3)


def test_pair_keeps_a_first_draft_built_before_self_text_as_its_base(tmp_path: Path) -> None:
    """A pair directory whose draft was trained on the stdlib alone: that draft becomes draft-base
    (with its recorded seconds), so `specwire pair` trains only the steps after it."""
    from specwire.client.pair import RECORD, _keep_first_draft

    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "distill_report.json").write_text(json.dumps({"steps": 1500}))
    (tmp_path / RECORD).write_text(json.dumps({"name": "x", "draft_seconds": 12.5}))
    _keep_first_draft(tmp_path)
    assert not (tmp_path / "draft").exists() and (tmp_path / "draft-base" / "distill_report.json").exists()
    assert json.loads((tmp_path / RECORD).read_text()) == {"name": "x", "draft_base_seconds": 12.5}
    (tmp_path / "draft").mkdir()  # trained further (`init`): stays
    (tmp_path / "draft" / "distill_report.json").write_text(json.dumps({"init": str(tmp_path / "draft-base")}))
    _keep_first_draft(tmp_path)
    assert (tmp_path / "draft" / "distill_report.json").exists()


def test_a_bfloat16_teacher_cache_is_close_to_the_float32_one_and_a_cache_keeps_its_dtype(
    llama_target_dir: Path, tmp_path: Path
) -> None:
    """The same windows through the teacher in bfloat16 and float32: the same shapes and nearly the
    same log-probabilities; `auto` extends a cache in the dtype it has, and another dtype is refused,
    naming it."""
    from specwire import teacher_cache

    text = tmp_path / "text.py"
    text.write_text("".join(f"def g{i}(y):\n    return y - {i} * {i % 5}\n\n" for i in range(200)))
    caches = {}
    for dtype in ("float32", "bfloat16"):
        cache, _ = teacher_cache.build(llama_target_dir, tmp_path / dtype, [text], train_windows=16, held_out_windows=4,
                                       seq_len=32, top_k=8, dtype=dtype)
        assert cache.spec.dtype == dtype
        caches[dtype] = cache.load("train")
    full, half = caches["float32"], caches["bfloat16"]
    assert torch.equal(full["tokens"], half["tokens"])
    assert (full["lse"] - half["lse"]).abs().max() < 0.05
    assert (full["topk_ids"][..., 0] == half["topk_ids"][..., 0]).float().mean() > 0.9
    again, _ = teacher_cache.build(llama_target_dir, tmp_path / "float32", [text], train_windows=32, held_out_windows=4,
                                   seq_len=32, top_k=8, dtype="auto")
    assert again.spec.dtype == "float32" and len(again.shards("train")) == 2
    with pytest.raises(SystemExit, match="dtype"):
        teacher_cache.build(llama_target_dir, tmp_path / "float32", [text], train_windows=16, held_out_windows=4,
                            seq_len=32, top_k=8, dtype="bfloat16")
