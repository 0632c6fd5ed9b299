"""MoE expert selection (kernels/moe_routing_reference.py's rules) as one Pallas kernel lowered through Triton:
one program per token does the scoring, the group limit, the top-k and the weights in registers. Written with
XLA ops these are a reduction or a sort each, about ten launches per MoE layer at decode (DeepSeek-V3: 58 such
layers a step).

Each token's choice depends on its own logits alone, so a decode step and a verify pass pick the same experts
with the same weights for the same token. Ties go to the lower expert and the lower group, as lax.top_k breaks
them; a token's weights are summed in expert-rank order, so they may differ from the reference's by rounding.
The logits may come as the router product's partial sums over a split of K, which the kernel sums itself.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from specjax.kernels.moe_routing_reference import Routing


def select_experts_triton(logits: jax.Array, bias: jax.Array | None, routing: Routing, *,
                          interpret: bool = False, always_expert: int | None = None) -> tuple[jax.Array, jax.Array]:
    """select_experts_reference as one kernel: ids [N, k] int32 best first, weights [N, k] fp32 (k + 1 columns
    with always_expert, written by the same launch). logits [S, N, E]: partial sums of the logits, summed in
    split order first (as a chain of adds over the leading axis sums them)."""
    logits = logits if logits.ndim == 3 else logits[None]
    _, tokens, experts = logits.shape
    k = routing.num_experts_per_tok + (always_expert is not None)
    args = [logits.astype(jnp.float32)] + ([] if bias is None else [bias.astype(jnp.float32)])
    kernel = functools.partial(_routing_kernel, routing=routing, experts=experts, has_bias=bias is not None,
                               always_expert=always_expert)
    return pl.pallas_call(
        kernel,
        grid=(tokens,),
        in_specs=[pl.BlockSpec() for _ in args],   # unblocked: the kernel indexes its row
        out_specs=(pl.BlockSpec(), pl.BlockSpec()),
        out_shape=(jax.ShapeDtypeStruct((tokens, k), jnp.int32), jax.ShapeDtypeStruct((tokens, k), jnp.float32)),
        compiler_params=plt.CompilerParams(num_warps=1),
        interpret=interpret,
        name="specjax_moe_routing",
    )(*args)


def _routing_kernel(logits_ref, *refs, routing: Routing, experts: int, has_bias: bool,
                    always_expert: int | None) -> None:
    bias_ref = refs[0] if has_bias else None
    ids_ref, weights_ref = refs[-2:]
    token = pl.program_id(0)
    width = pl.next_power_of_2(experts)
    expert = jnp.arange(width, dtype=jnp.int32)
    real = expert < experts
    logits = plt.load(logits_ref.at[0, token, expert], mask=real, other=-jnp.inf)
    for split in range(1, logits_ref.shape[0]):   # in split order, as the partials' sum beside a call rounds
        logits = logits + plt.load(logits_ref.at[split, token, expert], mask=real, other=0.0)
    scores = _scores(logits, routing.scoring)
    choice = scores if bias_ref is None else scores + plt.load(bias_ref.at[expert], mask=real, other=0.0)
    choice = jnp.where(real, choice, -jnp.inf)
    if routing.group_limited:
        choice = _within_top_groups(choice, expert, experts, routing)
    k = routing.num_experts_per_tok
    slot = jnp.arange(pl.next_power_of_2(k + (always_expert is not None)), dtype=jnp.int32)
    ids = jnp.zeros(slot.shape, jnp.int32)
    weights = jnp.zeros(slot.shape, jnp.float32)
    for j in range(k):   # the best left, the lowest expert among equals (lax.top_k's order)
        best = _first_of(choice, jnp.max(choice), expert, width)
        ids = jnp.where(slot == j, best, ids)
        weights = jnp.where(slot == j, jnp.sum(jnp.where(expert == best, scores, 0.0)), weights)
        choice = jnp.where(expert == best, -jnp.inf, choice)
    if routing.norm_topk_prob:
        weights = weights / (jnp.sum(weights) + 1e-20)
    weights = weights * routing.routed_scaling_factor
    if always_expert is not None:
        ids = jnp.where(slot == k, always_expert, ids)
        weights = jnp.where(slot == k, 1.0, weights)
        k += 1
    plt.store(ids_ref.at[token, slot], ids, mask=slot < k)
    plt.store(weights_ref.at[token, slot], weights, mask=slot < k)


def _scores(logits: jax.Array, scoring: str) -> jax.Array:
    """sigmoid, or softmax over the row (padding at -inf weighs nothing)."""
    if scoring == "sigmoid":
        return jax.nn.sigmoid(logits)
    shifted = jnp.exp(logits - jnp.max(logits))
    return shifted / jnp.sum(shifted)


def _first_of(values: jax.Array, target: jax.Array, index: jax.Array, width: int) -> jax.Array:
    """The lowest index whose value equals target."""
    return jnp.min(jnp.where(values == target, index, width))


def _within_top_groups(choice: jax.Array, expert: jax.Array, experts: int, routing: Routing) -> jax.Array:
    """choice with the experts outside the top topk_group of n_group groups at -inf (the reference's rule: a
    group's score its best plus the best of the rest for noaux_tc, its best otherwise; ties to the lower
    group)."""
    per_group = experts // routing.n_group
    group = expert // per_group
    group_scores = []
    for g in range(routing.n_group):
        mine = jnp.where(group == g, choice, -jnp.inf)
        best = jnp.max(mine)
        if routing.topk_method == "noaux_tc":
            first = _first_of(mine, best, expert, choice.shape[0])
            best = best + jnp.max(jnp.where(expert == first, -jnp.inf, mine))
        group_scores.append(best)
    keep = jnp.zeros(choice.shape, jnp.bool_)
    for g, score in enumerate(group_scores):
        ahead = sum(((other > score) | ((other == score) & (h < g))).astype(jnp.int32)
                    for h, other in enumerate(group_scores))
        keep = keep | ((group == g) & (ahead < routing.topk_group))
    return jnp.where(keep, choice, -jnp.inf)
