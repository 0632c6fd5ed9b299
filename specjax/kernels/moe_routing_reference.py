"""MoE expert selection from router logits, in pure JAX: DeepSeek's routing rules (V3 "noaux_tc", V2 "greedy" /
"group_limited_greedy"), the ground truth for the Pallas kernel and what runs where kernels do not."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

SCORING_FUNCS = ("sigmoid", "softmax")
TOPK_METHODS = ("noaux_tc", "greedy", "group_limited_greedy")


@dataclasses.dataclass(frozen=True)
class Routing:
    """Static routing settings (a model config's). transformers' DeepSeek-V3 routes as scoring="sigmoid",
    topk_method="noaux_tc" whatever config.json says; its DeepSeek-V2 as scoring="softmax" with the config's
    topk_method and never normalises the weights (released V2 configs leave norm_topk_prob false)."""
    num_experts_per_tok: int
    scoring: str = "sigmoid"            # "sigmoid" | "softmax"
    topk_method: str = "noaux_tc"       # "noaux_tc" | "greedy" | "group_limited_greedy"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring not in SCORING_FUNCS:
            raise ValueError(f"scoring {self.scoring!r} is not one of {SCORING_FUNCS}")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method {self.topk_method!r} is not one of {TOPK_METHODS}")

    @property
    def group_limited(self) -> bool:
        return self.topk_method in ("noaux_tc", "group_limited_greedy")


def select_experts_reference(logits: jax.Array, bias: jax.Array | None, routing: Routing,
                             always_expert: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Expert ids [N, k] (int32, best first) and their weights [N, k] (fp32) from router logits [N, E] (fp32):
    scores = sigmoid or softmax of the logits; the choice scores (scores + bias) pick the experts, within the top
    topk_group of n_group groups for the grouped methods (a group's score is the sum of its two best choice
    scores for noaux_tc, its best score for group_limited_greedy); the weights are the unbiased scores of the
    chosen experts, normalised if norm_topk_prob, times routed_scaling_factor; always_expert: that id, weight 1,
    appended to every token's."""
    scores = jax.nn.sigmoid(logits) if routing.scoring == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    choice = scores if bias is None else scores + bias.astype(jnp.float32)
    if routing.group_limited:
        choice = within_top_groups(choice, routing)
    _, ids = lax.top_k(choice, routing.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if routing.norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    ids, weights = ids.astype(jnp.int32), weights * routing.routed_scaling_factor
    return (ids, weights) if always_expert is None else with_always_expert(ids, weights, always_expert)


def with_always_expert(ids: jax.Array, weights: jax.Array, expert: int) -> tuple[jax.Array, jax.Array]:
    """ids and weights [N, k] with one more column: `expert`, weight 1, for every token."""
    return (jnp.concatenate([ids, jnp.full((ids.shape[0], 1), expert, ids.dtype)], axis=1),
            jnp.concatenate([weights, jnp.ones((ids.shape[0], 1), weights.dtype)], axis=1))


def within_top_groups(choice: jax.Array, routing: Routing) -> jax.Array:
    """choice [N, E] with the experts outside each token's top topk_group groups set to -inf.
    (transformers' V2 sets them to 0; its softmax scores are positive, so the same experts win.)
    Reductions and compares only, the groups ranked as lax.top_k ranks them (ties to the lower index)."""
    num_tokens, num_experts = choice.shape
    grouped = choice.reshape(num_tokens, routing.n_group, num_experts // routing.n_group)
    best = grouped.max(axis=-1)
    if routing.topk_method == "noaux_tc":   # the sum of a group's two best: its best plus the best of the rest
        first = jnp.argmax(grouped, axis=-1)
        rest = jnp.where(jnp.arange(grouped.shape[-1]) == first[..., None], -jnp.inf, grouped)
        group_scores = best + rest.max(axis=-1)
    else:
        group_scores = best
    index = jnp.arange(routing.n_group)
    mine, other = group_scores[:, :, None], group_scores[:, None, :]
    ahead = (other > mine) | ((other == mine) & (index[None, None, :] < index[None, :, None]))
    kept = ahead.sum(axis=-1) < routing.topk_group                                   # [N, n_group]
    return jnp.where(kept[:, :, None], grouped, -jnp.inf).reshape(num_tokens, num_experts)
