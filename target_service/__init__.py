"""The target service: the large causal LM that scores and verifies."""
