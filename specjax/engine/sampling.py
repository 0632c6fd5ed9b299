"""Per-row token sampling inside jit: logits processors, counter-based keys, draws.

Every sampling parameter is an array with one entry per row (shape [B], or [B, T] when
it varies along a time axis too), so one compiled function serves a batch that mixes
greedy and random rows with different temperature / top-k / top-p / min-p values.

Randomness is counter-based: a row's key is derived from (request seed, absolute token
position, purpose) only, so a seeded request draws the same numbers alone or in any
batch, and speculative and plain decoding can share draws where they mean the same.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from specjax.kernels.policy import KernelPolicy
from specjax.kernels.top_k_top_p import keep_mask
from specjax.sampling_params import GREEDY_TEMPERATURE_EPS

# Purposes keep the streams of one (seed, position) apart.
SAMPLE = 0  # a token drawn from the target distribution p (plain decoding, bonus slot)
ACCEPT = 1  # the uniform u that decides whether a draft token is accepted
RECOVER = 2  # the token drawn from max(p - q, 0) after a rejection
DRAFT = 3  # a token drawn by a probabilistic drafter from its own q
TREE_ACCEPT = 4  # plus the node's index: the uniform that decides whether a draft tree's node is accepted


def row_key(seed: jax.Array, position: jax.Array, purpose: int | jax.Array) -> jax.Array:
    """Typed PRNG keys, one per entry of `position`, from (seed, position, purpose).

    seed: int [B]; position: int [B] or [B, T]; purpose: a Python int or an int array
    broadcastable to position's shape. Returns a key array of position's shape.
    """
    position = jnp.asarray(position, jnp.int32)
    seed = jnp.asarray(seed)
    seed = jnp.broadcast_to(seed.reshape(seed.shape + (1,) * (position.ndim - seed.ndim)),
                            position.shape)
    purpose = jnp.broadcast_to(jnp.asarray(purpose, jnp.int32), position.shape)

    def one(s, p, u):
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(s), p), u)

    flat = jax.vmap(one)(seed.reshape(-1), position.reshape(-1), purpose.reshape(-1))
    return flat.reshape(position.shape)


def uniform(keys: jax.Array) -> jax.Array:
    """One float32 uniform in [0, 1) per key, shaped like `keys`."""
    flat = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys.reshape(-1))
    return flat.reshape(keys.shape)


def is_greedy(temperature: jax.Array) -> jax.Array:
    """Rows that decode greedily (vLLM: temperature below 1e-5)."""
    return jnp.asarray(temperature) < GREEDY_TEMPERATURE_EPS


def _per_row(param: jax.Array, logits: jax.Array, dtype) -> jax.Array:
    """Reshape a [B] (or [B, T]) parameter so it broadcasts against logits [..., V]."""
    param = jnp.asarray(param, dtype)
    return param.reshape(param.shape + (1,) * (logits.ndim - param.ndim))


def _min_p_mask(logits: jax.Array, min_p: jax.Array) -> jax.Array:
    """Keep tokens whose probability is at least min_p times the largest one (vLLM's min-p), tested on the
    logits: p_i >= min_p * p_max  <=>  logit_i - max logit >= log(min_p), without a softmax pass."""
    gap = logits - jnp.max(logits, axis=-1, keepdims=True)
    return jnp.where(min_p > 0, gap >= jnp.log(jnp.maximum(min_p, jnp.finfo(jnp.float32).tiny)), True)


def processed_probs(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                    top_p: jax.Array, min_p: jax.Array, kernels: KernelPolicy = KernelPolicy()) -> jax.Array:
    """The distribution a row samples from, in vLLM's order: temperature, min-p, top-k, top-p.

    logits: [..., V] (leading [B] or [B, T]); parameters: [B] or [B, T].
    top_k <= 0 or >= V, top_p >= 1 and min_p <= 0 switch a filter off. Greedy rows
    (temperature < 1e-5) get the one-hot of the first maximal raw logit.
    Top-k / top-p (specjax.kernels.top_k_top_p: a radix search on GPUs from batch 2-3, else a sort) run only
    when some row of the batch uses one (a batch-wide lax.cond; under vmap both branches run). kernels
    (static): the model's kernel policy, which their dispatcher follows.
    """
    logits = jnp.asarray(logits, jnp.float32)
    greedy = _per_row(is_greedy(temperature), logits, bool)
    temperature = _per_row(temperature, logits, jnp.float32)
    top_k = _per_row(top_k, logits, jnp.int32)
    top_p = _per_row(top_p, logits, jnp.float32)
    min_p = _per_row(min_p, logits, jnp.float32)

    scaled = logits / jnp.where(greedy, 1.0, temperature)
    scaled = jnp.where(_min_p_mask(scaled, min_p), scaled, -jnp.inf)
    vocab = logits.shape[-1]
    needs_filter = jnp.any(~greedy & (((top_k > 0) & (top_k < vocab)) | (top_p < 1.0)))
    keep = lax.cond(
        needs_filter,
        lambda: keep_mask(scaled, top_k, top_p, kernels=kernels),
        lambda: jnp.ones(scaled.shape, bool),
    )
    scaled = jnp.where(keep, scaled, -jnp.inf)
    probs = jax.nn.softmax(scaled, axis=-1)
    one_hot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), vocab, dtype=jnp.float32)
    return jnp.where(greedy, one_hot, probs)


def sample_from_probs(probs: jax.Array, keys: jax.Array) -> jax.Array:
    """Draw one token per row of probs [..., V] (need not be normalised) with keys [...].

    Gumbel-max over log-probabilities: tokens of probability zero are never drawn.
    """
    vocab = probs.shape[-1]
    flat_keys = keys.reshape(-1)
    noise = jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32))(flat_keys)
    scores = jnp.where(probs > 0, jnp.log(probs), -jnp.inf) + noise.reshape(probs.shape)
    return jnp.argmax(scores, axis=-1).astype(jnp.int32)


def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           min_p: jax.Array, seed: jax.Array, position: jax.Array,
           purpose: int = SAMPLE, greedy_only: bool = False, kernels: KernelPolicy = KernelPolicy()) -> jax.Array:
    """Next token per row: argmax for greedy rows, a keyed draw from processed_probs otherwise.

    logits: [B, V] (or [B, T, V] with position [B, T]); position: the absolute position
    of the token being chosen. Returns int32 [B] (or [B, T]). greedy_only (static): the caller knows
    every row is greedy, so only the argmax is computed (no distribution, no draws, no batch-wide cond).
    kernels (static): as in processed_probs.
    """
    if greedy_only:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    probs = processed_probs(logits, temperature, top_k, top_p, min_p, kernels)
    drawn = sample_from_probs(probs, row_key(seed, position, purpose))
    greedy = _per_row(is_greedy(temperature), drawn, bool)
    return jnp.where(greedy, jnp.argmax(logits, axis=-1).astype(jnp.int32), drawn)


def token_logprobs(logits: jax.Array, tokens: jax.Array,
                   num_top: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Raw log-softmax logprobs (vLLM's default): of `tokens`, and the top `num_top`.

    logits: [..., V]; tokens: int [...] (negative ids read token 0). Returns (chosen [...] f32,
    top_ids [..., num_top] int32, top_values [..., num_top] f32), best first.
    """
    logprobs = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
    top_values, top_ids = lax.top_k(logprobs, num_top)
    return _logprob_of(logprobs, tokens), top_ids.astype(jnp.int32), top_values


def token_ranks(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """vLLM's rank of each of `tokens` [...] under logits [..., V]: how many tokens have a log-softmax logprob
    >= its own (1 for the most likely; ties count against it). int32 [...]."""
    logprobs = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
    return jnp.sum(logprobs >= _logprob_of(logprobs, tokens)[..., None], axis=-1, dtype=jnp.int32)


def _logprob_of(logprobs: jax.Array, tokens: jax.Array) -> jax.Array:
    """logprobs [..., V] at tokens [...] (negative ids read token 0)."""
    index = jnp.maximum(jnp.asarray(tokens, jnp.int32), 0)[..., None]
    return jnp.take_along_axis(logprobs, index, axis=-1)[..., 0]


def apply_penalties(logits: jax.Array, in_prompt: jax.Array, generated: jax.Array, presence: jax.Array,
                    frequency: jax.Array, repetition: jax.Array) -> jax.Array:
    """vLLM's penalties on logits [B, T, V], in its order. in_prompt: bool [B, V], the tokens of the row's prompt;
    generated: int [B, T, V], how often each token was generated before position t; penalties [B].
    - repetition (CTRL, as vLLM and transformers): the logit of a token in the prompt or generated is divided
      by the penalty where positive, multiplied by it otherwise (1 = off);
    - frequency (OpenAI's): minus the penalty times the token's generated count (0 = off);
    - presence (OpenAI's): minus the penalty where the token was generated at all (0 = off).
    """
    logits = jnp.asarray(logits, jnp.float32)
    repetition, frequency, presence = (jnp.asarray(p, jnp.float32)[:, None, None]
                                       for p in (repetition, frequency, presence))
    was_generated = generated > 0
    seen = in_prompt[:, None, :] | was_generated
    logits = jnp.where(seen, jnp.where(logits > 0, logits / repetition, logits * repetition), logits)
    return logits - frequency * generated - presence * was_generated


def counts_through(generated: jax.Array, drafts: jax.Array) -> jax.Array:
    """The generated counts a step sees at each of T = K + 1 verify positions: generated [B, V] plus, at
    position t, the drafts before it, drafts[:, :t] [B, K] (-1 counts nothing). Returns int32 [B, T, V]."""
    vocab = generated.shape[-1]
    drafted = jnp.cumsum(jax.nn.one_hot(drafts, vocab, dtype=jnp.int32), axis=1)   # -1 is an all-zero row
    before = jnp.concatenate([jnp.zeros_like(generated)[:, None], drafted], axis=1)
    return generated[:, None] + before
