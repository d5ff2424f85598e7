"""The draft service: a small causal LM (or a model-free n-gram drafter) that proposes tokens."""
