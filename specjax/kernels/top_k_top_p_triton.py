"""Top-k / top-p keep thresholds without sorting the vocabulary: a radix search as Pallas kernels lowered
through Triton (NVIDIA sm_80+).

Both thresholds are the largest ordered key c for which a monotone weight of the tokens with keys >= c still
reaches a target: their count reaching k (top-k), their mass within the top-k set reaching top_p of that
set's mass (top-p; top_k_top_p_reference.py states the rules). So c is found a digit at a time from the
top: with 4-bit digits in 8 rounds, each weighing over the whole row the 15 candidates that extend the prefix
known so far by one digit; the next digit is the largest candidate that still reaches the target. A sort of a
large row costs many reads of it (benchmarks/RESULTS.md); the search reads it 8 times per threshold (16 with
the 2-bit digits that suit large batches, where the comparisons are the cost).

A round is one kernel of (row, chunk) programs. Each program first ends the previous round: it sums that
round's partial weights over the row's chunks, always in the same order, and picks the digit (every program
of the row picks the same). It then writes the partial weights of its own chunk for the new candidates.
The chunking depends on the vocabulary alone, so a row's thresholds do not depend on how many rows share the
call: a decode step (B rows) and a verify step (B x (k+1) rows) keep the same tokens for the same logits.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from specjax.kernels.top_k_top_p_reference import from_ordered_keys, ordered_keys

# Candidates are built as unsigned words (prefix | digit << shift); XOR with the sign bit maps the unsigned
# order onto the int32 order of ordered_keys.
_SIGN = -(1 << 31)
# ordered_keys of -inf and +inf, in numpy: a JAX computation at import would start the XLA backend before a
# harness can call jax.distributed.initialize().
_HIGHEST_KEY = int(np.float32(np.inf).view(np.int32))
_LOWEST_KEY = int(np.float32(-np.inf).view(np.int32)) ^ 0x7FFFFFFF


@dataclasses.dataclass(frozen=True)
class SearchConfig:
    """Static launch parameters (part of the compiled program)."""

    radix_bits: int = 4      # bits per round: 2**radix_bits candidates, 32 / radix_bits rounds
    max_chunks: int = 32     # programs per row (a power of two), fewer for a small vocabulary
    block: int = 256         # logits per inner step
    num_warps: int = 4

    def __post_init__(self):
        if self.radix_bits not in (1, 2, 4):
            raise ValueError(f"SearchConfig.radix_bits must be 1, 2 or 4 (a divisor of 32, the candidates "
                             f"unrolled), got {self.radix_bits}")


@dataclasses.dataclass(frozen=True)
class _Layout:
    chunks: int   # programs per row
    steps: int    # blocks per program


def _layout(vocab: int, config: SearchConfig) -> _Layout:
    blocks = -(-vocab // config.block)
    chunks = 1
    while chunks * 2 <= min(config.max_chunks, blocks):
        chunks *= 2
    return _Layout(chunks=chunks, steps=-(-blocks // chunks))


def _as_float(keys: jax.Array) -> jax.Array:
    """The float32 whose ordered key is `keys`, the words past the infinities (NaNs) clamped to them: x >= it
    then holds exactly when x's key >= `keys`, for every non-NaN x (comparing floats measured faster)."""
    return from_ordered_keys(jnp.clip(keys, _LOWEST_KEY, _HIGHEST_KEY))


def _next_digit(weight: jax.Array, target: jax.Array) -> jax.Array:
    """The largest candidate index j >= 1 whose weight [..., candidates] reaches target [...,] (weights fall
    with j), 0 if none does; in the kernels and after the last round alike."""
    reached = (jnp.arange(weight.shape[-1]) > 0) & (weight >= target[..., None])
    return jnp.sum(reached.astype(jnp.int32), axis=-1)


def _round_kernel(shift_ref, logits_ref, lmax_ref, floor_ref, target_ref, prefix_ref, partial_ref,
                  out_prefix_ref, out_partial_ref, *, vocab: int, layout: _Layout, config: SearchConfig,
                  mass: bool):
    row, chunk = pl.program_id(0), pl.program_id(1)
    shift = shift_ref[0]
    # End the previous round (the first round gets zero weights: its digit is 0). Shifting twice keeps each
    # shift below 32, where LLVM's is undefined.
    digit = _next_digit(jnp.sum(partial_ref[0], axis=0), target_ref[0])
    prefix = prefix_ref[0] | ((digit << shift) << config.radix_bits)

    @pl.when(chunk == 0)
    def _():
        out_prefix_ref[0] = prefix

    # One [block] accumulator per candidate, the candidates scalars: no tensor mixes the two axes, so Triton
    # needs no layout conversion (a trip through shared memory) per step.
    candidates = [_as_float((prefix | (j << shift)) ^ _SIGN) for j in range(1, 1 << config.radix_bits)]
    lmax, floor = lmax_ref[0], _as_float(floor_ref[0])
    offsets = jnp.arange(config.block, dtype=jnp.int32)
    first = chunk * (layout.steps * config.block)

    def step(i, accs):
        start = pl.multiple_of(first + i * config.block, config.block)
        in_row = start + offsets < vocab
        x = plt.load(logits_ref.at[row, pl.ds(start, config.block)], mask=in_row, other=-jnp.inf)
        w = jnp.where(x >= floor, jnp.exp(x - lmax), 0.0) if mass else in_row.astype(jnp.float32)
        return tuple(acc + jnp.where(x >= c, w, 0.0) for acc, c in zip(accs, candidates))

    zeros = tuple(jnp.zeros((config.block,), jnp.float32) for _ in candidates)
    accs = lax.fori_loop(0, layout.steps, step, zeros)
    out_partial_ref[0, 0, 0] = jnp.float32(0)
    for j, acc in enumerate(accs, start=1):
        out_partial_ref[0, 0, j] = jnp.sum(acc)


def _round(shift, logits, lmax, floor, target, prefix, partial, *, mass: bool, layout: _Layout,
           config: SearchConfig, interpret: bool):
    rows, vocab = logits.shape
    per_row = pl.BlockSpec((1,), lambda r, c: (r,))
    candidates = 1 << config.radix_bits
    kernel = functools.partial(_round_kernel, vocab=vocab, layout=layout, config=config, mass=mass)
    return pl.pallas_call(
        kernel,
        grid=(rows, layout.chunks),
        in_specs=[pl.BlockSpec((1,), lambda r, c: (0,)), pl.BlockSpec(), per_row, per_row, per_row, per_row,
                  pl.BlockSpec((1, layout.chunks, candidates), lambda r, c: (r, 0, 0))],
        out_specs=(per_row, pl.BlockSpec((1, 1, candidates), lambda r, c: (r, c, 0))),
        out_shape=(jax.ShapeDtypeStruct((rows,), jnp.int32),
                   jax.ShapeDtypeStruct((rows, layout.chunks, candidates), jnp.float32)),
        compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=1),
        interpret=interpret,
        name=f"top_k_top_p_search_{'mass' if mass else 'count'}",
    )(shift, logits, lmax, floor, target, prefix, partial)


def _threshold(logits, lmax, floor, target, *, mass: bool, config: SearchConfig, interpret: bool):
    """Per row, the largest key c whose weight (count, or mass of keys >= floor) at keys >= c reaches target;
    the smallest key when even the whole row's does not. target must be positive."""
    rows, vocab = logits.shape
    layout = _layout(vocab, config)
    bits, candidates = config.radix_bits, 1 << config.radix_bits

    def one_round(i, carry):
        shift = jnp.full((1,), 32 - bits, jnp.int32) - bits * i
        return _round(shift, logits, lmax, floor, target, *carry, mass=mass, layout=layout, config=config,
                      interpret=interpret)

    start = (jnp.zeros((rows,), jnp.int32), jnp.zeros((rows, layout.chunks, candidates), jnp.float32))
    prefix, partial = lax.fori_loop(0, 32 // bits, one_round, start)
    return (prefix | _next_digit(jnp.sum(partial, axis=1), target)) ^ _SIGN


def keep_mask_triton(logits: jax.Array, top_k: jax.Array, top_p: jax.Array, *, interpret: bool = False,
                     config: SearchConfig | None = None) -> jax.Array:
    """keep_mask_reference's mask (top-k then top-p) by the radix search: logits [..., V] f32; top_k, top_p
    broadcastable to [..., 1]. Each search runs only when some row uses its filter (a batch-wide lax.cond).
    `interpret=True` runs the kernels in Pallas interpret mode (CPU tests)."""
    config = config or SearchConfig()
    shape, vocab = logits.shape, logits.shape[-1]
    x = logits.reshape(-1, vocab)
    k = jnp.broadcast_to(top_k, shape[:-1] + (1,)).reshape(-1)
    p = jnp.broadcast_to(top_p, shape[:-1] + (1,)).reshape(-1).astype(jnp.float32)
    lowest = jnp.full(k.shape, _SIGN, jnp.int32)
    search = functools.partial(_threshold, config=config, interpret=interpret)
    lmax = jnp.max(x, axis=-1)

    top_k_on = (k > 0) & (k < vocab)
    k_threshold = lax.cond(jnp.any(top_k_on),
                           lambda: search(x, lmax, lowest, k.astype(jnp.float32), mass=False),
                           lambda: lowest)
    k_threshold = jnp.where(top_k_on, k_threshold, lowest)

    keys = ordered_keys(x)
    top_p_on = p < 1.0
    top_k_mass = jnp.sum(jnp.where(keys >= k_threshold[:, None], jnp.exp(x - lmax[:, None]), 0.0), axis=-1)
    # At least the smallest normal float: a top_p so small that the target flushes to zero still keeps the top
    # token (and its ties), as the sort does.
    target = jnp.maximum(p * top_k_mass, jnp.finfo(jnp.float32).tiny)
    p_threshold = lax.cond(jnp.any(top_p_on), lambda: search(x, lmax, k_threshold, target, mass=True),
                           lambda: lowest)
    p_threshold = jnp.where(top_p_on, p_threshold, lowest)
    threshold = jnp.maximum(k_threshold, p_threshold)
    return (keys >= threshold[:, None]).reshape(shape)
