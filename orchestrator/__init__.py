"""The orchestrator: the public `Generate` API and every decoding strategy.

It owns the tokenizer and the authoritative token history; the model services only compute.
"""
