"""Verification of draft tokens against the target: exact speculative rejection sampling.

Leviathan et al. 2023 / Chen et al. 2023 as vLLM implements it, vectorised over rows
that mix greedy and random sampling:
- greedy rows accept a draft while it equals the target argmax, then emit the argmax;
- random rows accept draft x with probability min(1, p(x) / q(x)); at the first
  rejection they draw from max(p - q, 0) renormalised; when every draft is accepted
  they draw a bonus token from p. The emitted tokens then follow p exactly.
A draft id of -1 means "no draft": it is rejected, and so is everything after it, and
the token emitted in its place is a plain draw from p.

Only the first rejected slot needs a fresh draw, so one V-sized draw per row is made,
keyed by (seed, absolute position of that slot, purpose).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.engine.sampling import (ACCEPT, RECOVER, SAMPLE, is_greedy, processed_probs,
                                     row_key, sample_from_probs, uniform)
from specjax.kernels.policy import KernelPolicy

NO_TOKEN = -1


def _gather_slot(values: jax.Array, slot: jax.Array) -> jax.Array:
    """values [B, N, ...] at slot [B] -> [B, ...]."""
    index = slot.reshape(slot.shape + (1,) * (values.ndim - 1))
    return jnp.take_along_axis(values, index, axis=1)[:, 0]


def _accepted_prefix_length(accepted: jax.Array) -> jax.Array:
    """Number of leading True entries per row of accepted [B, K]."""
    return jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def _standard_accepts(target_probs: jax.Array, drafts: jax.Array, has_draft: jax.Array,
                      draft_probs: jax.Array | None, u: jax.Array) -> jax.Array:
    """accept x iff u' * q(x) <= p(x) with u' uniform in (0, 1] (vLLM rejects q(x) = 0)."""
    k = drafts.shape[1]
    p_x = jnp.take_along_axis(target_probs[:, :k], drafts[..., None], axis=-1)[..., 0]
    if draft_probs is None:
        q_x = jnp.ones_like(p_x)
    else:
        q_x = jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
    return has_draft & (q_x > 0) & ((1.0 - u) * q_x <= p_x)


def _fallback_distribution(p_slot: jax.Array, q_slot: jax.Array,
                           residual: jax.Array) -> jax.Array:
    """max(p - q, 0) where `residual`, else p; p where p - q has no mass left."""
    leftover = jnp.maximum(p_slot - q_slot, 0.0)
    use_leftover = residual[:, None] & (jnp.sum(leftover, axis=-1, keepdims=True) > 0)
    return jnp.where(use_leftover, leftover, p_slot)


def _draft_distribution_at(slot: jax.Array, drafts: jax.Array, draft_probs: jax.Array | None,
                           vocab: int) -> jax.Array:
    """q at slot [B] (one-hot of the draft when draft_probs is None), the bonus slot clamped."""
    k = drafts.shape[1]
    clamped = jnp.minimum(slot, k - 1)
    if draft_probs is None:
        return jax.nn.one_hot(_gather_slot(drafts, clamped), vocab, dtype=jnp.float32)
    return _gather_slot(draft_probs.astype(jnp.float32), clamped)


def _emit(drafts: jax.Array, num_accepted: jax.Array, last_token: jax.Array) -> jax.Array:
    """[B, K+1]: accepted drafts, then last_token at slot num_accepted, then -1."""
    batch, k = drafts.shape
    slots = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    padded = jnp.concatenate([drafts, jnp.full((batch, 1), NO_TOKEN, jnp.int32)], axis=1)
    out = jnp.where(slots < num_accepted[:, None], padded, NO_TOKEN)
    return jnp.where(slots == num_accepted[:, None], last_token[:, None], out).astype(jnp.int32)


def _check_shapes(target_logits, draft_tokens, draft_probs, synthetic_rates) -> None:
    """Shape errors surface here, before tracing, naming the argument at fault."""
    if draft_tokens.ndim != 2 or draft_tokens.shape[1] < 1:
        raise ValueError(f"draft_tokens must be [B, K] with K >= 1, got {draft_tokens.shape}")
    batch, k = draft_tokens.shape
    if target_logits.ndim != 3 or target_logits.shape[:2] != (batch, k + 1):
        raise ValueError(f"target_logits must be [B, K+1, V] = [{batch}, {k + 1}, V] to match "
                         f"draft_tokens, got {target_logits.shape}")
    if draft_probs is not None and draft_probs.shape != (batch, k, target_logits.shape[2]):
        raise ValueError(f"draft_probs must be [B, K, V] = {(batch, k, target_logits.shape[2])} "
                         f"or None for deterministic drafts, got {draft_probs.shape}")
    if synthetic_rates is not None and jnp.shape(synthetic_rates) != (k,):
        raise ValueError(f"synthetic_rates must have one rate per draft position ({k}), "
                         f"got shape {jnp.shape(synthetic_rates)}")


def rejection_sample(target_logits: jax.Array, draft_tokens: jax.Array,
                     draft_probs: jax.Array | None, temperature: jax.Array, top_k: jax.Array,
                     top_p: jax.Array, min_p: jax.Array, seed: jax.Array, position: jax.Array,
                     synthetic_rates: jax.Array | None = None, greedy_only: bool = False,
                     kernels: KernelPolicy = KernelPolicy()) -> tuple[jax.Array, jax.Array]:
    """Verify K drafts per row; return (out_tokens [B, K+1] int32, num_accepted [B] int32).

    target_logits [B, K+1, V] f32: the target's logits at output slots 0..K.
    draft_tokens [B, K] int32, -1 = no draft. draft_probs [B, K, V] (the drafter's q,
    after its own processors) or None for deterministic drafters (q one-hot).
    temperature, top_k, top_p, min_p, seed [B]; position [B]: absolute position of slot 0.
    synthetic_rates: None, or f32 [K] conditional acceptance probabilities (benchmarks):
    draft i is accepted with probability synthetic_rates[i] given all earlier ones were,
    and the target's own token (argmax or a draw from p) is emitted at the first rejection.
    Out slots 0..num_accepted-1 hold the accepted drafts, slot num_accepted the
    recovered / bonus token, later slots -1.
    greedy_only (static): every row is greedy; the target's distribution is then never built.
    kernels (static): the target's kernel policy, which the top-k / top-p filters follow.
    """
    _check_shapes(target_logits, draft_tokens, draft_probs, synthetic_rates)
    batch, k = draft_tokens.shape
    vocab = target_logits.shape[-1]
    position = jnp.asarray(position, jnp.int32)
    drafts = jnp.asarray(draft_tokens, jnp.int32)
    has_draft = jnp.cumprod((drafts >= 0) & (drafts < vocab), axis=1).astype(bool)
    drafts = jnp.where(has_draft, drafts, 0)
    greedy = is_greedy(temperature)

    target_argmax = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)
    slot_positions = position[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :]
    u = uniform(row_key(seed, slot_positions, ACCEPT))
    if synthetic_rates is None:
        greedy_accepts = has_draft & (drafts == target_argmax[:, :k])
    else:
        greedy_accepts = has_draft & (u < jnp.asarray(synthetic_rates, jnp.float32)[None, :])
    if greedy_only:
        num_accepted = _accepted_prefix_length(greedy_accepts)
        return _emit(drafts, num_accepted, _gather_slot(target_argmax, num_accepted)), num_accepted

    target_probs = processed_probs(target_logits, temperature, top_k, top_p, min_p, kernels)
    if synthetic_rates is None:
        random_accepts = _standard_accepts(target_probs, drafts, has_draft, draft_probs, u)
    else:
        random_accepts = greedy_accepts
    accepts = jnp.where(greedy[:, None], greedy_accepts, random_accepts)
    num_accepted = _accepted_prefix_length(accepts)

    # The recovered token comes from max(p - q, 0) only after a real draft was rejected
    # in standard mode; for a missing draft, the bonus slot and synthetic mode it is a
    # plain draw from p, keyed like plain decoding (SAMPLE) at that position.
    rejected_real_draft = _gather_slot(
        jnp.concatenate([has_draft, jnp.zeros((batch, 1), bool)], axis=1), num_accepted)
    residual = rejected_real_draft if synthetic_rates is None else jnp.zeros_like(greedy)
    p_slot = _gather_slot(target_probs, num_accepted)
    q_slot = _draft_distribution_at(num_accepted, drafts, draft_probs, vocab)
    fallback = _fallback_distribution(p_slot, q_slot, residual)
    keys = row_key(seed, position + num_accepted, jnp.where(residual, RECOVER, SAMPLE))
    drawn = sample_from_probs(fallback, keys)
    last_token = jnp.where(greedy, _gather_slot(target_argmax, num_accepted), drawn)
    return _emit(drafts, num_accepted, last_token), num_accepted
