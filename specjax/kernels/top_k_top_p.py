"""Top-k / top-p dispatcher: the sort-free radix search (Pallas/Triton) on NVIDIA sm_80+ for batches large
enough to gain from it, one sort per row (the pure-JAX reference) everywhere else.

The choice depends on the device, the vocabulary and the leading (batch) axis only, never on the time axis,
so plain decoding ([B, V]), verification ([B, k+1, V]) and a drafter's own distribution ([B, V]) of one
engine keep tokens by one rule and round alike. Across batch sizes the sort and the search sum a row's mass
in different orders, so they can disagree where the top-p cut falls within float rounding of a token's mass
(no token differed in RESULTS.md's 30 GPU cases; the tests compare them token for token). Outside tensor
parallelism only: the partitioner cannot split a Pallas call.
"""
from __future__ import annotations

import jax

from specjax.kernels.policy import KernelPolicy
from specjax.kernels.top_k_top_p_reference import keep_mask_reference
from specjax.kernels.top_k_top_p_triton import SearchConfig, keep_mask_triton

# From the policy's search_large_elements the rounds' comparisons bound the search: 2-bit digits (three
# candidates, 16 rounds) beat 4-bit ones (fifteen, 8 rounds) on an H200.
LARGE_BATCH_CONFIG = SearchConfig(radix_bits=2, block=512, max_chunks=16)


def keep_mask(logits: jax.Array, top_k: jax.Array, top_p: jax.Array, *, kernels: KernelPolicy = KernelPolicy(),
              config: SearchConfig | None = None) -> jax.Array:
    """Tokens kept by top-k then top-p (vLLM's rules), a bool mask like logits [..., V] f32; top_k, top_p
    broadcastable to [..., 1] (top_k <= 0 or >= V, top_p >= 1: that filter is off). `kernels` chooses the
    implementation by batch x vocabulary; `config` overrides the search's launch parameters."""
    elements = batch_elements(logits.shape)
    if kernels.use_search(elements):
        config = config or search_config(kernels, elements)
        return keep_mask_triton(logits, top_k, top_p, interpret=kernels.interpret, config=config)
    return keep_mask_reference(logits, top_k, top_p)


def search_config(kernels: KernelPolicy, elements: int) -> SearchConfig:
    """The search's launch parameters for a batch of `elements` (batch x vocabulary)."""
    return LARGE_BATCH_CONFIG if elements >= kernels.search_large_elements else SearchConfig()


def batch_elements(shape: tuple[int, ...]) -> int:
    """Batch x vocabulary of logits [V], [B, V] or [B, T, V]: the time axis does not count."""
    return (shape[0] if len(shape) > 1 else 1) * shape[-1]

