"""The serving engine: one slot cache per model, a batching scheduler, compiled forwards.

`cache` holds the keys and values in rows that sessions own; `scheduler` batches whatever the
concurrent sessions have ready into one forward; `forward` runs any transformers architecture
over the slot cache through transformers' attention-function registry; `quantize` swaps its
linear layers for int8/int4 kernels; `model` loads a model (directory, hub id, GGUF);
`session` is a generation's view of it; `core` ties them into the `Engine` a service runs.
"""

from specwire.engine.core import COST_POSITIONS, DECODE_TOKENS, Engine, EngineLimits, cache_size
from specwire.engine.model import CausalLM, resolve_device, resolve_dtype
from specwire.engine.session import MAX_BRANCHES, MAX_PROPOSE, DynamicKV, EngineSession, SessionKV, SlotKV
from specwire.tokenizer import eos_token_ids, load_tokenizer, tokenizer_fingerprint

__all__ = [
    "COST_POSITIONS",
    "DECODE_TOKENS",
    "MAX_BRANCHES",
    "MAX_PROPOSE",
    "CausalLM",
    "DynamicKV",
    "Engine",
    "EngineLimits",
    "EngineSession",
    "SessionKV",
    "SlotKV",
    "cache_size",
    "eos_token_ids",
    "load_tokenizer",
    "resolve_device",
    "resolve_dtype",
    "tokenizer_fingerprint",
]
