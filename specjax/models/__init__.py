"""Flax NNX causal language models and the registry from HF `architectures` to them."""
