"""One engine forward for every architecture: Llama, Qwen2, Qwen3, Mistral (sliding window),
Gemma-3 (sliding and global layers) and GPT-2 run batched over the slot cache through
transformers' attention-function registry, and their greedy and beam outputs equal
transformers' `generate` token for token, alone and with other sessions in the same forwards.
Quantised weights change the outputs, but never between a session's solo and batched runs.
Gemma-3-270M itself is checked where `specwire models fetch gemma-3-270m` has prepared it."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from specwire.client.sdk import build_request
from specwire.orchestrator.generation import Decoder
from specwire.orchestrator.models import LocalModel

from specwire.engine import CausalLM, Engine, EngineLimits
from specwire.engine.forward import HFForward
from specwire.engine.quantize import Int4Linear, Int8Linear, W4A8Linear, W8A8Linear, w4a8_kernel
from specwire.session import OpenRequest, ScoreKind, Scoring
from tests.conftest import gemma_dir, hf_model
from tests.tiny import save_gemma3, save_gpt2, save_llama, save_mistral, save_qwen2, save_qwen3

BUILDERS: dict[str, Callable[..., Path]] = {
    "llama": save_llama, "qwen2": save_qwen2, "qwen3": save_qwen3,
    "mistral": save_mistral, "gemma3": save_gemma3, "gpt2": save_gpt2,
}
# Longer than the sliding windows (8 tokens) of the tiny Mistral and Gemma-3, so those matter.
PROMPTS = [
    "def add(a, b):\n    return a + b\n\nfor i in range(10):",
    "the quick brown fox",
    "class Point:\n    def __init__(self, x, y):",
    "import os",
]
NEW_TOKENS = 20


@pytest.fixture(scope="module", params=list(BUILDERS))
def arch_dir(request: pytest.FixtureRequest, models_dir: Path, tokenizer: Any) -> Path:
    path = models_dir / f"arch-{request.param}"
    return path if path.exists() else BUILDERS[request.param](path, tokenizer, seed=11)


def engine(path: Path, quantization: str = "none", **limits: Any) -> Engine:
    lm = CausalLM.load(str(path), device="cpu", dtype="float32", quantization=quantization)
    return Engine(lm, "target", EngineLimits(**({"max_batch_rows": 12, "max_cache_len": 128} | limits)))


def generate(backend: Engine, prompt_ids: list[int], **kwargs: Any) -> list[list[int]]:
    decoder = Decoder(LocalModel(backend, "target"), None, backend.lm.tokenizer)
    request = build_request(input_ids=prompt_ids, max_new_tokens=NEW_TOKENS, ignore_eos=True, **kwargs)
    result = asyncio.run(decoder.generate(request))
    return [sequence.token_ids for sequence in result.sequences] if result.sequences else [result.token_ids]


def transformers_generate(model: Any, prompt_ids: list[int], **kwargs: Any) -> list[list[int]]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0, **kwargs)
    return [row[len(prompt_ids):].tolist() for row in out]


JOBS: list[dict[str, Any]] = [
    {"strategy": "greedy"},
    {"strategy": "beam", "num_beams": 3, "num_return_sequences": 2},
]


def test_every_architecture_runs_on_the_batched_engine(arch_dir: Path) -> None:
    backend = engine(arch_dir)
    assert backend.batches and isinstance(backend.scheduler.model if backend.scheduler else None, HFForward)


def test_greedy_and_beam_equal_transformers_alone_and_batched(arch_dir: Path, tokenizer: Any) -> None:
    """Each prompt × strategy equals `generate`; then all of them at once, on threads sharing the
    engine's forwards, equal their solo runs."""
    backend = engine(arch_dir)
    reference = hf_model(arch_dir)
    runs = [(tokenizer(prompt).input_ids, job) for prompt in PROMPTS for job in JOBS]
    solo = [generate(backend, ids, **job) for ids, job in runs]
    for (ids, job), ours in zip(runs, solo, strict=True):
        hf_kwargs = {k: v for k, v in job.items() if k != "strategy"}
        assert ours == transformers_generate(reference, ids, **hf_kwargs), (job, tokenizer.decode(ids))
    assert backend.scheduler is not None
    backend.scheduler.stats.max_rows = 0
    with ThreadPoolExecutor(max_workers=len(runs)) as pool:
        together = list(pool.map(lambda run: generate(backend, run[0], **run[1]), runs))
    assert together == solo
    assert backend.scheduler.stats.max_rows > 3  # the sessions did share forwards
    assert backend.cache is not None and backend.cache.usage().rows_in_use == 0


def prompt_logits(backend: Engine, prompt_ids: list[int]) -> torch.Tensor:
    session = backend.new_session()
    opened = session.open(OpenRequest(prompt_ids, scoring=Scoring(ScoreKind.LOGITS, positions=len(prompt_ids))))
    session.close()
    assert opened.scores is not None and opened.scores.dense is not None
    return opened.scores.dense  # [positions, vocab]


# The cosine bounds: random weights at 4 bits (mixed: the head's only).
@pytest.mark.parametrize(
    "mode, kind, cosine",
    [("int8", Int8Linear, 0.995), ("int4", Int4Linear, 0.95), ("w4a8", W4A8Linear, 0.95), ("mixed", W4A8Linear, 0.95),
     ("w8a8", W8A8Linear, 0.995)],
)
def test_quantised_outputs_equal_their_solo_runs_under_batching(
    models_dir: Path, tokenizer: Any, mode: str, kind: type, cosine: float
) -> None:
    """Sliding and global layers with quantised linears (the tied LM head too): concurrent
    sessions choose exactly their solo tokens, and the logits stay near the float model's."""
    path = models_dir / "arch-gemma3"
    path = path if path.exists() else save_gemma3(path, tokenizer, seed=11)
    backend = engine(path, mode)
    assert backend.lm.quantization == mode
    assert isinstance(backend.lm.model.get_output_embeddings(), kind)
    if mode in ("mixed", "w8a8"):
        assert isinstance(backend.lm.model.model.layers[0].mlp.down_proj, W8A8Linear)
    runs = [tokenizer(prompt).input_ids for prompt in PROMPTS] * 2
    solo = [generate(backend, ids) for ids in runs]
    with ThreadPoolExecutor(max_workers=len(runs)) as pool:
        together = list(pool.map(lambda ids: generate(backend, ids), runs))
    assert together == solo
    ours, theirs = prompt_logits(backend, runs[0]), prompt_logits(engine(path), runs[0])
    assert torch.nn.functional.cosine_similarity(ours, theirs, dim=-1).min() > cosine


@pytest.mark.parametrize("generic", [True, False], ids=["hf", "hand-written"])
def test_ragged_rows_packed_give_what_the_padded_batch_gives(arch_dir: Path, generic: bool) -> None:
    """A verification of 4 new tokens beside rows of 1 and 2: the layers on the 7 real tokens
    packed give the logits and cached keys of the same batch padded to 3 × 4, to float32
    rounding (a matrix product's sums may split by its row count), and its tokens' argmaxes."""
    from specwire.engine.forward import lean_model
    from specwire.engine.scheduler import ForwardJob, build_batch, logit_index

    backend = engine(arch_dir, compile="off")
    assert backend.scheduler is not None and backend.cache is not None
    model = lean_model(backend.lm.model, generic)
    if model is None:
        pytest.skip("no hand-written forward for this architecture")
    cache, torch_rng = backend.cache, torch.Generator().manual_seed(3)

    def run(widths: list[int], start: int, pack: bool) -> torch.Tensor:
        jobs = [ForwardJob([row], torch.randint(0, 200, (1, n), generator=torch_rng), start, n)
                for row, n in enumerate(widths)]
        batch = build_batch(jobs, torch.device("cpu"), cache.scratch_row, pack=pack)
        batch.logit_index = logit_index(jobs, int(batch.input_ids.shape[1]), torch.device("cpu"))
        assert (batch.packed is not None) == (pack and len(set(widths)) > 1)
        with torch.inference_mode():
            out = model.forward(cache, batch)
        assert out.logits is not None
        return out.logits

    run([9, 9, 9], 0, pack=True)  # a prompt for each row (not ragged: nothing packed)
    state = torch_rng.get_state()
    padded = run([4, 1, 2], 9, pack=False)
    keys = [layer[:3, :, 9:13].clone() for layer in cache.keys]
    torch_rng.set_state(state)
    packed = run([4, 1, 2], 9, pack=True)
    torch.testing.assert_close(packed, padded, rtol=1e-4, atol=1e-4)
    assert torch.equal(packed.argmax(-1), padded.argmax(-1))
    for layer, before in zip(cache.keys, keys, strict=True):  # real slots: row 0's 4, row 1's 1, row 2's 2
        for row, n in enumerate([4, 1, 2]):
            torch.testing.assert_close(layer[row, :, 9 : 9 + n], before[row, :, :n], rtol=1e-4, atol=1e-5)


def test_auto_quantisation_leaves_a_model_that_fits_in_cache_in_float(arch_dir: Path) -> None:
    lm = CausalLM.load(str(arch_dir), device="cpu", dtype="float32", quantization="auto")
    assert lm.quantization == "none"


def test_auto_quantisation_picks_by_the_linear_weights_bytes() -> None:
    """none in cache; with AVX-512 but no VNNI int4 for mid-sized models (int8 where a width is
    not in groups of 32) and int8 for large ones; with AVX2 only or AVX-512 VNNI, mixed (a w4a8
    head); none on CUDA. Sizes only: the weights live on the meta device."""
    from torch import nn

    from specwire.engine import quantize
    from specwire.engine.trimmed_vocab import TargetVocabHead, TrimmedVocab

    class Model(nn.Module):
        def __init__(self, mib: float, in_features: int) -> None:
            super().__init__()
            self.head = nn.Linear(in_features, int(mib * 2**20 / 4 / in_features), bias=False, device="meta")

        def get_output_embeddings(self) -> nn.Module:
            return self.head

    def model(mib: float, in_features: int = 1024) -> nn.Module:
        return Model(mib, in_features)

    cpu = torch.device("cpu")
    assert quantize.resolve("auto", cpu, model(31), "AVX512", vnni=False) == "none"
    assert quantize.resolve("auto", cpu, model(48), "AVX512", vnni=False) == "int4"
    assert quantize.resolve("auto", cpu, model(48, in_features=688), "AVX512", vnni=False) == "int8"
    assert quantize.resolve("auto", cpu, model(300), "AVX512", vnni=False) == "int8"
    # With VNNI the w4a8 and w8a8 kernels use it; the head at 4 bits reads half of int8's bytes.
    assert quantize.resolve("auto", cpu, model(31), "AVX512", vnni=True) == "none"
    assert quantize.resolve("auto", cpu, model(48), "AVX512", vnni=True) == "mixed"
    assert quantize.resolve("auto", cpu, model(300), "AVX512", vnni=True) == "mixed"
    assert quantize.resolve("auto", cpu, model(48, in_features=688), "AVX512", vnni=True) == "int8"
    # Without AVX-512 (so without VNNI) oneDNN's int8 is slow: the kernels' AVX2 paths.
    assert quantize.resolve("auto", cpu, model(31), "AVX2", vnni=False) == "none"
    assert quantize.resolve("auto", cpu, model(48), "AVX2", vnni=False) == "mixed"
    assert quantize.resolve("auto", cpu, model(300), "AVX2", vnni=False) == "mixed"
    assert quantize.resolve("auto", cpu, model(48, in_features=688), "AVX2", vnni=False) == "int8"
    assert quantize.resolve("auto", torch.device("cuda"), model(300)) == "none"
    # A trimmed draft's head is its own linear inside the wrapper that scatters it over the target's ids.
    trimmed = model(48)
    vocab = TrimmedVocab(trimmed.head.out_features + 7, tuple(range(trimmed.head.out_features)), 0)
    trimmed.head = TargetVocabHead(trimmed.head, vocab, 1024)
    assert quantize.resolve("auto", cpu, trimmed, "AVX512", vnni=True) == "mixed"
    assert quantize.resolve("auto", cpu, trimmed, "AVX2", vnni=False) == "mixed"


def _same_bits_alone_compiled_and_on_avx2(layer: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, isa: str) -> None:
    """`y` = layer(x) again for each row alone, through torch.compile, and (from VNNI) on the AVX2 path."""
    assert torch.equal(torch.cat([layer(row[None]) for row in x]), y)
    assert torch.equal(torch.compile(layer, fullgraph=True)(x), y)
    if isa == "avx512vnni":
        kernel = w4a8_kernel()
        kernel.use_vnni(False)
        assert torch.equal(layer(x), y)
        kernel.use_vnni(True)


@pytest.mark.parametrize("isa", ["avx2", "avx512vnni"])
def test_w4a8_equals_its_formula_for_every_row_alone_and_compiled(isa: str) -> None:
    """The kernel against the same sum in float64 from its packed weights, steps and minima:
    y = (a/127) Σ_g Σ_k (u·s_g + m_g)·round(127 x/a), a = max |x| per row; a row alone, in a batch
    (17 rows: passes of 8 and 4 and what is left) and through torch.compile gives the same bits,
    and the VNNI path the AVX2 path's bits."""
    from torch import nn

    kernel = w4a8_kernel()
    try:
        if kernel.use_vnni(isa == "avx512vnni") != isa:
            pytest.skip(f"this CPU has no {isa}")
        torch.manual_seed(0)
        for in_features, out_features in ((640, 1000), (192, 20), (96, 40), (256, 33)):
            linear = nn.Linear(in_features, out_features)
            with torch.no_grad():
                linear.weight[:, :32] += 0.5  # a group far from zero: its minimum carries it
            before = linear.weight.clone()
            layer = W4A8Linear(linear)
            assert torch.equal(linear.weight, before)
            x = torch.randn(17, in_features) * torch.logspace(-2, 2, 17)[:, None]
            y = layer(x)
            unsigned, step, low = layer.levels()
            shape = (out_features, -1, layer.group)
            weight = (unsigned.double().view(shape) * step.double()[..., None] + low.double()[..., None]).view(out_features, -1)
            amax = x.double().abs().amax(dim=1, keepdim=True)
            expected = torch.round(x.double() / amax * 127) * amax / 127 @ weight.T + linear.bias.double()
            assert (y.double() - expected).abs().max() < 1e-5 * expected.abs().max()
            # Within half a step, plus the float16 rounding of the minimum and step (2^-11 relative).
            error = (weight - linear.weight.double()).view(shape).abs().amax(dim=-1)
            assert (error <= step.double() * (0.5 + 16 * 2**-11) + low.double().abs() * 2**-11 + 1e-7).all()
            _same_bits_alone_compiled_and_on_avx2(layer, x, y, isa)
    finally:
        kernel.use_vnni(True)


@pytest.mark.parametrize("isa", ["avx2", "avx512vnni"])
def test_w8a8_equals_its_formula_for_every_row_alone_and_compiled(isa: str) -> None:
    """y = (a/127)·s_n·Σ_k w·round(127 x/a) in float64 from the packed int8 weights; a row alone,
    in a batch of 17, compiled, and on the other instruction set gives the same bits."""
    from torch import nn

    kernel = w4a8_kernel()
    try:
        if kernel.use_vnni(isa == "avx512vnni") != isa:
            pytest.skip(f"this CPU has no {isa}")
        torch.manual_seed(0)
        for in_features, out_features in ((640, 1000), (2048, 40), (12, 33)):
            linear = nn.Linear(in_features, out_features)
            layer = W8A8Linear(linear)
            x = torch.randn(17, in_features) * torch.logspace(-2, 2, 17)[:, None]
            y = layer(x)
            levels, scales = layer.weight_levels()
            weight = levels.double() * scales.double()[:, None]
            amax = x.double().abs().amax(dim=1, keepdim=True)
            expected = torch.round(x.double() / amax * 127) * amax / 127 @ weight.T + linear.bias.double()
            assert (y.double() - expected).abs().max() < 1e-5 * expected.abs().max()
            assert (weight - linear.weight.double()).abs().max() <= scales.max() / 2 + 1e-7
            _same_bits_alone_compiled_and_on_avx2(layer, x, y, isa)
    finally:
        kernel.use_vnni(True)


def test_w8a8_on_amx_gives_vnni_bits() -> None:
    """Where the CPU has AMX, products of 1 to 50 rows (one, two and three row tiles a pass, a
    second pass past 48) give the VNNI path's bits: the tiles' int32 sums are the same integers."""
    from torch import nn

    kernel = w4a8_kernel()
    from_rows = kernel.amx_rows()
    try:
        if not kernel.use_amx(True, 1):
            pytest.skip("this CPU (or its OS) offers no AMX")
        torch.manual_seed(0)
        for in_features, out_features in ((640, 1000), (2048, 40), (1024, 33)):
            layer = W8A8Linear(nn.Linear(in_features, out_features))
            for rows in (1, 5, 16, 17, 33, 48, 50):
                x = torch.randn(rows, in_features) * torch.logspace(-2, 2, rows)[:, None]
                kernel.use_amx(True, 1)
                tiles = layer(x)
                kernel.use_amx(False, 1)
                assert torch.equal(tiles, layer(x)), (in_features, out_features, rows)
    finally:
        kernel.use_amx(True, from_rows)


def test_an_unknown_quantisation_is_refused_naming_the_flag(arch_dir: Path) -> None:
    with pytest.raises(ValueError, match="--quantize"):
        CausalLM.load(str(arch_dir), device="cpu", quantization="int3")


@pytest.mark.skipif(gemma_dir() is None, reason="Gemma-3-270M not prepared (specwire models fetch gemma-3-270m)")
def test_gemma_3_270m_float32_greedy_and_beam_equal_transformers() -> None:
    path = gemma_dir()
    assert path is not None
    backend = engine(path, max_batch_rows=4, max_cache_len=256)
    reference = hf_model(path)
    tokenizer = backend.lm.tokenizer
    assert tokenizer is not None
    prompts = ["def fibonacci(n):\n", "The capital of France is"]
    for prompt in prompts:
        ids = tokenizer(prompt).input_ids
        for job in JOBS:
            hf_kwargs = {k: v for k, v in job.items() if k != "strategy"}
            assert generate(backend, ids, **job) == transformers_generate(reference, ids, **hf_kwargs), (prompt, job)
    with ThreadPoolExecutor(max_workers=2) as pool:
        together = list(pool.map(lambda p: generate(backend, tokenizer(p).input_ids), prompts))
    assert together == [generate(backend, tokenizer(p).input_ids) for p in prompts]


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "sdpa"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("decode", [True, False])
def test_row_attention_gives_a_row_the_same_bits_alone_and_in_any_batch(
    decode: bool, threads: int, kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attention for quantised models: each row of random batches (one new token a row, or
    ragged verifications; rows read in place or gathered, keys over whole blocks as `build_batch`
    lays them) equals the row alone, bit for bit, and each of a row's tokens equals a decode
    step at its position (so verifying γ + 1 positions chooses what γ + 1 steps would). One SDPA
    over a batch padded to its longest row, or over several new tokens, differs by ~1e-7 on x86
    CPUs, enough to flip an int8 activation's rounding. With two threads the calls are shared
    with a helper thread, each still on one. Both ways: `row_attention.cpp`, and one-thread SDPA
    calls where it does not build."""
    from specwire.engine import kernels

    if not kernel:
        monkeypatch.setattr(kernels, "available", lambda stem: False)
    elif not kernels.available("row_attention"):
        pytest.skip("row_attention.cpp does not build here")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_row_attention(decode)
    finally:
        torch.set_num_threads(before)


def _check_row_attention(decode: bool) -> None:
    from specwire.engine.forward import row_keys

    rng, heads, kv_heads, dim, limit = random.Random(0), 4, 1, 256, 1100
    torch.manual_seed(0)
    store_k, store_v = torch.randn(9, kv_heads, limit, dim), torch.randn(9, kv_heads, limit, dim)

    def attend(rows: list[int], query: torch.Tensor, extents: list[tuple[int, int]], gathered: bool) -> torch.Tensor:
        width, span = row_keys(max(slots for _, slots in extents), limit), query.shape[2]
        keys = store_k[rows][:, :, :width] if gathered else store_k[rows[0] : rows[0] + len(rows), :, :width]
        values = store_v[rows][:, :, :width] if gathered else store_v[rows[0] : rows[0] + len(rows), :, :width]
        mask = torch.zeros(len(rows), 1, span, width, dtype=torch.bool)
        for b, (tokens, slots) in enumerate(extents):
            for t in range(span):  # causal over the row's slots; padding tokens see slot 0
                mask[b, 0, t, : slots - tokens + t + 1 if t < tokens else 1] = True
        return torch.ops.specwire.row_attention(query, keys, values, mask, torch.tensor(extents), 0.125, True)

    for _ in range(40):
        count = rng.randint(2, 6)
        tokens = [1 if decode else rng.choice([1, 2, 5, 16]) for _ in range(count)]
        extents = [(n, rng.randint(n, limit)) for n in tokens]
        gathered = rng.random() < 0.5
        rows = rng.sample(range(9), count) if gathered else list(range(count))
        query = torch.randn(count, heads, max(tokens), dim)
        together = attend(rows, query, extents, gathered)
        for b, (n, slots) in enumerate(extents):
            alone = attend([rows[b]], query[b : b + 1, :, :n], [(n, slots)], gathered=False)
            assert torch.equal(together[b, :, :n], alone[0]), (extents, b)
            assert not together[b, :, n:].any()  # padding attends nowhere
            for t in range(n):
                step = attend([rows[b]], query[b : b + 1, :, t : t + 1], [(1, slots - n + t + 1)], gathered=False)
                assert torch.equal(together[b, :, t], step[0, :, 0]), (extents, b, t)


@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 1, 256), (8, 2, 72), (12, 4, 64), (6, 1, 32)])
def test_the_row_attention_kernel_equals_sdpa_over_each_rows_keys(heads: int, kv_heads: int, dim: int) -> None:
    """`row_attention.cpp` against SDPA on each row's own slots and mask (grouped heads, head sizes
    with tails, tree-like masks with holes, padding tokens): the same numbers to float32 rounding,
    zeros for padding; given the cache's rows, the bits it gives their copies."""
    from specwire.engine import kernels

    if not kernels.available("row_attention"):
        pytest.skip("row_attention.cpp does not build here")
    torch.manual_seed(0)
    rows, span, width = 5, 6, 200
    extents = torch.tensor([[6, 200], [1, 37], [3, 64], [6, 6], [2, 150]])
    query = torch.randn(rows, heads, span, dim)
    keys, values = torch.randn(rows, kv_heads, width, dim), torch.randn(rows, kv_heads, width, dim)
    mask = torch.rand(rows, 1, span, width) < 0.7
    mask[:, :, :, 0] = True  # every token sees a slot
    kernel = kernels.load("row_attention").row_attention
    out = kernel(query, keys, values, mask, extents, 0.1, None)
    cache_rows = torch.tensor([3, 0, 6, 1, 4])  # where each batch row sits in a 7-row cache
    key_store, value_store = torch.randn(7, kv_heads, width, dim), torch.randn(7, kv_heads, width, dim)
    key_store[cache_rows], value_store[cache_rows] = keys, values
    assert torch.equal(kernel(query, key_store, value_store, mask, extents, 0.1, cache_rows), out)
    with pytest.raises(RuntimeError, match="rows"):
        kernel(query, key_store, value_store, mask, extents, 0.1, torch.tensor([3, 0, 7, 1, 4]))
    for b, (tokens, slots) in enumerate(extents.tolist()):
        expected = torch.nn.functional.scaled_dot_product_attention(
            query[b : b + 1, :, :tokens], keys[b : b + 1, :, :slots], values[b : b + 1, :, :slots],
            attn_mask=mask[b : b + 1, :, :tokens, :slots], scale=0.1, enable_gqa=True)
        torch.testing.assert_close(out[b : b + 1, :, :tokens], expected, rtol=1e-5, atol=1e-5)
        assert not out[b, :, tokens:].any()


@pytest.mark.parametrize("operator", ["python", "kernel"])
def test_row_attention_compiled_reads_its_output_as_eager_does(operator: str) -> None:
    """The op's output takes the query's layout (a transposed view in the forward), as its fake
    implementation tells the compiler; code compiled around it reads the same numbers eager does.
    Both operators: the Python one, and `row_attention.cpp`'s own (what the forward calls where it
    builds), which gives the Python one's bits. The forward's check that the kernel builds traces
    as a constant: no graph break."""
    from specwire.engine.forward import _row_kernel

    if operator == "kernel" and not _row_kernel():
        pytest.skip("row_attention.cpp does not build here")
    torch.manual_seed(0)
    rows, span, heads, dim, width = 3, 5, 4, 64, 128
    query = torch.randn(rows, span, heads, dim)  # [B, T, H, D], as projected
    keys, values = torch.randn(rows, 1, width, dim), torch.randn(rows, 1, width, dim)
    mask = torch.ones(1, 1, span, width, dtype=torch.bool)  # broadcast over the rows
    extents = torch.tensor([[5, 100], [2, 60], [5, 128]])

    def attend(query: torch.Tensor, operator: str = operator) -> torch.Tensor:
        query = query.transpose(1, 2)
        if operator == "kernel" and _row_kernel():  # as the forward asks, a constant to the compiler
            out = torch.ops.specwire.row_attention_kernel(query, keys, values, mask, extents, 0.125, None)
        else:
            out = torch.ops.specwire.row_attention(query, keys, values, mask, extents, 0.125, True)
        return out.transpose(1, 2).flatten(2) * 2

    assert torch.equal(torch.compile(attend, fullgraph=True)(query), attend(query))
    assert torch.equal(attend(query), attend(query, "python"))


@pytest.mark.parametrize("out_features", [64, 256, 1024])
def test_an_int8_linear_gives_a_row_the_same_bits_in_any_batch(out_features: int) -> None:
    """oneDNN scales one row's sums differently from several rows' at small widths; the layer
    applies the scales itself, so row 0 is bit-identical at every batch size."""
    torch.manual_seed(0)
    layer = Int8Linear(torch.nn.Linear(640, out_features, bias=False))
    x = torch.randn(32, 640)
    alone = layer(x[:1])
    assert all(torch.equal(layer(x[:rows])[:1], alone) for rows in (2, 3, 8, 32))


@pytest.mark.parametrize("mode", ["int8", "w4a8"])
def test_projections_of_one_input_run_as_one_gemm_with_the_same_bits(mode: str) -> None:
    """q/k/v and gate/up of each layer become one int8 (w4a8) GEMM whose parts equal the separate
    layers' outputs bit for bit, and the shared product holds no tensor after the forward."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specwire.engine import quantize

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config).eval()
    separate = LlamaForCausalLM(config).eval()
    separate.load_state_dict(model.state_dict())
    quantize.quantize(model, mode)
    fuse = quantize._fuse_shared_inputs
    quantize._fuse_shared_inputs = lambda module, kind: 0
    try:
        quantize.quantize(separate, mode)
    finally:
        quantize._fuse_shared_inputs = fuse
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert isinstance(attention.k_proj, quantize.SharedInputLinear) and isinstance(mlp.up_proj, quantize.SharedInputLinear)
    kind = quantize.Int8Linear if mode == "int8" else quantize.W4A8Linear
    assert isinstance(attention.k_proj.product.linear, kind)
    assert isinstance(separate.model.layers[0].self_attn.k_proj, kind)
    ids = torch.randint(0, 96, (3, 7))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, separate(ids).logits)
    assert attention.k_proj.product.input is None and mlp.up_proj.product.input is None
