"""What the loop asks of a draft mechanism. Proposers know the model interface, not each other."""
from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp

from specjax.engine.state import RowParams


class Proposer(Protocol):
    k: int

    def init(self, draft_state: Any, prompt_tokens: jax.Array, prompt_lengths: jax.Array, cache_len: int) -> Any:
        """The proposer's carry after the prompt (e.g. the draft model's prefilled KV cache)."""

    def propose(self, draft_state: Any, carry: Any, tokens: jax.Array, lengths: jax.Array,
                rows: RowParams) -> tuple[jax.Array, jax.Array | None, Any]:
        """Drafts [B, k] (-1 = none) following tokens[b, :lengths[b]], their probs [B, k, V] or None when
        the drafts are deterministic, and the new carry."""


class NoProposer:
    """k = 0: the loop is plain autoregressive decoding."""
    k = 0

    def init(self, draft_state, prompt_tokens, prompt_lengths, cache_len):
        return None

    def propose(self, draft_state, carry, tokens, lengths, rows):
        return jnp.zeros((tokens.shape[0], 0), jnp.int32), None, carry
