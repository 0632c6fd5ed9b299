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

from specjax.kernels.platform import IMPLS, Impl, kernel_mode
from specjax.kernels.top_k_top_p_reference import keep_mask_reference
from specjax.kernels.top_k_top_p_triton import SearchConfig, keep_mask_triton

# Batch x vocabulary from which the search is used. Below it (batch 1 of a 128k vocabulary, batch 2 of 49k)
# a decode step's few rows sort in about 60 us, faster than the search's eight dependent rounds (RESULTS.md).
MIN_SEARCH_ELEMENTS = 1 << 17
# From here (batch 17+ of 128k, 43+ of 49k) the rounds' comparisons bound the search: 2-bit digits (three
# candidates, 16 rounds) beat 4-bit ones (fifteen, 8 rounds) on an H200.
LARGE_BATCH_ELEMENTS = 1 << 21
LARGE_BATCH_CONFIG = SearchConfig(radix_bits=2, block=512, max_chunks=16)


def keep_mask(logits: jax.Array, top_k: jax.Array, top_p: jax.Array, *, impl: Impl = "auto",
              interpret: bool = False, config: SearchConfig | None = None) -> jax.Array:
    """Tokens kept by top-k then top-p (vLLM's rules), a bool mask like logits [..., V] f32; top_k, top_p
    broadcastable to [..., 1] (top_k <= 0 or >= V, top_p >= 1: that filter is off). `interpret=True` runs the
    kernels in Pallas interpret mode (CPU tests); `config` overrides the search's launch parameters."""
    if impl not in IMPLS:
        raise ValueError(f"keep_mask: impl={impl!r} is not one of {IMPLS}")
    elements = batch_elements(logits.shape)
    if _use_search(impl, interpret, elements):
        config = config or (LARGE_BATCH_CONFIG if elements >= LARGE_BATCH_ELEMENTS else SearchConfig())
        return keep_mask_triton(logits, top_k, top_p, interpret=interpret, config=config)
    return keep_mask_reference(logits, top_k, top_p)


def batch_elements(shape: tuple[int, ...]) -> int:
    """Batch x vocabulary of logits [V], [B, V] or [B, T, V]: the time axis does not count."""
    return (shape[0] if len(shape) > 1 else 1) * shape[-1]


def _use_search(impl: Impl, interpret: bool, elements: int) -> bool:
    mode = kernel_mode(impl, interpret)
    return mode == "triton" or (mode == "auto" and elements >= MIN_SEARCH_ELEMENTS)
