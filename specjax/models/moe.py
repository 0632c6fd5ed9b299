"""DeepSeekMoE: the router (V3 "noaux_tc", V2 "greedy" / "group_limited_greedy") and the routed SwiGLU experts
in three equal forms, plus the shared experts.

Weights (a dict; matrices stored [in, out]):
  w_router         [hidden, E] fp32      mlp.gate.weight, transposed (routing stays fp32 whatever the model dtype)
  router_bias      [E] fp32              mlp.gate.e_score_correction_bias (V3 only; selection only)
  w_gate_up        [E, hidden, 2I]       experts' gate_proj and up_proj, transposed and fused column by column
                                         (checkpoints_conv.fused_columns.interleave_columns([gate, up], I)), so
                                         one grouped matmul makes both and a split of I over devices keeps pairs
  w_down           [E, I, hidden]        experts' down_proj, transposed
  w_shared_gate_up [hidden, 2 I_s]       shared_experts' gate/up, same fusion; I_s = moe_intermediate_size *
  w_shared_down    [I_s, hidden]         n_shared_experts
The expert axis leads every expert leaf, for expert parallelism.

Expert forms (`routed_experts`): "dense" runs every expert on every token and combines by routing weight (the
reference); "grouped" sorts the token-slots by expert and runs two `jax.lax.ragged_dot` grouped matmuls; "gathered"
gathers the selected experts' weight slices per token-slot and runs batched matvecs, so a step reads only those
N*k slices. How much "grouped" reads depends on ragged_dot's lowering: on CPU and by default on GPU it is a dense
masked matmul over all groups; with jax_ragged_dot_use_gpu_pallas_triton_lowering (GPU) it is a grouped GEMM over
the selected experts. "auto" takes "gathered" while N*k <= E (the gathered slices are then at most all the
weights; at decode k of E) and "grouped" beyond.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from specjax.kernels.projection_reference import swiglu

EXPERT_FORMS = ("auto", "dense", "grouped", "gathered")


@dataclasses.dataclass(frozen=True)
class Routing:
    """Static routing settings. transformers' DeepSeek-V3 always routes as scoring="sigmoid",
    topk_method="noaux_tc" (whatever config.json says); DeepSeek-V2 as scoring="softmax" with the config's
    topk_method. norm_topk_prob: transformers' V3 normalises when it is set (adding 1e-20), its V2 never does
    (DeepSeek's V2 code does when it is set; released V2 configs leave it false)."""
    num_experts_per_tok: int
    scoring: str = "sigmoid"            # "sigmoid" | "softmax"
    topk_method: str = "noaux_tc"       # "noaux_tc" | "greedy" | "group_limited_greedy"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0


def route(x: jax.Array, w_router: jax.Array, router_bias: jax.Array | None,
          routing: Routing) -> tuple[jax.Array, jax.Array]:
    """Expert ids [N, k] (int32, best first) and their weights [N, k] (fp32) for tokens x [N, hidden].

    logits = x W in fp32 at full precision; scores = sigmoid or softmax of them; the choice scores (scores + bias)
    pick the experts, within the top topk_group of n_group groups for the grouped methods (a group's score is the
    sum of its two best choice scores for noaux_tc, its best score for group_limited_greedy); the weights are the
    unbiased scores of the chosen experts, normalised if norm_topk_prob, times routed_scaling_factor."""
    logits = jnp.dot(x.astype(jnp.float32), w_router.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    if routing.scoring == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    elif routing.scoring == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    else:
        raise ValueError(f"scoring {routing.scoring!r} is not one of 'sigmoid', 'softmax'")
    choice = scores if router_bias is None else scores + router_bias.astype(jnp.float32)
    if routing.topk_method in ("noaux_tc", "group_limited_greedy"):
        choice = _within_top_groups(choice, routing)
    elif routing.topk_method != "greedy":
        raise ValueError(f"topk_method {routing.topk_method!r} is not one of 'noaux_tc', 'greedy', "
                         "'group_limited_greedy'")
    _, ids = lax.top_k(choice, routing.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if routing.norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return ids.astype(jnp.int32), weights * routing.routed_scaling_factor


def _within_top_groups(choice: jax.Array, routing: Routing) -> jax.Array:
    """choice [N, E] with the experts outside each token's top topk_group groups set to -inf.
    (transformers' V2 sets them to 0; its softmax scores are positive, so the same experts win.)"""
    num_tokens, num_experts = choice.shape
    grouped = choice.reshape(num_tokens, routing.n_group, num_experts // routing.n_group)
    if routing.topk_method == "noaux_tc":
        group_scores = lax.top_k(grouped, 2)[0].sum(axis=-1)
    else:
        group_scores = grouped.max(axis=-1)
    _, top_groups = lax.top_k(group_scores, routing.topk_group)
    kept = jax.nn.one_hot(top_groups, routing.n_group, dtype=jnp.bool_).any(axis=1)   # [N, n_group]
    return jnp.where(kept[:, :, None], grouped, -jnp.inf).reshape(num_tokens, num_experts)


def routed_experts(x: jax.Array, ids: jax.Array, weights: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, *,
                   form: str = "auto") -> jax.Array:
    """Σ_j weights[n, j] · Expert_{ids[n, j]}(x[n]) for tokens x [N, hidden], in the chosen form (module doc)."""
    num_slots, num_experts = ids.size, w_gate_up.shape[0]
    if form == "auto":
        form = "gathered" if num_slots <= num_experts else "grouped"
    forms = {"dense": _dense_experts, "grouped": _grouped_experts, "gathered": _gathered_experts}
    if form not in forms:
        raise ValueError(f"expert form {form!r} is not one of {EXPERT_FORMS}")
    return forms[form](x, ids, weights, w_gate_up, w_down)


def _dense_experts(x, ids, weights, w_gate_up, w_down) -> jax.Array:
    """Every expert on every token, combined by a [N, E] matrix of routing weights (zero where not chosen)."""
    hidden = swiglu(jnp.einsum("nh,ehf->enf", x, w_gate_up))
    out = jnp.einsum("enf,efh->enh", hidden, w_down, preferred_element_type=jnp.float32)
    combine = (jax.nn.one_hot(ids, w_gate_up.shape[0], dtype=jnp.float32) * weights[..., None]).sum(axis=1)
    return jnp.einsum("ne,enh->nh", combine, out).astype(x.dtype)


def _grouped_experts(x, ids, weights, w_gate_up, w_down) -> jax.Array:
    """Token-slots sorted by expert, two ragged_dot grouped matmuls, then unsorted and combined."""
    num_tokens, k = ids.shape
    flat_ids = ids.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)
    group_sizes = jnp.bincount(flat_ids, length=w_gate_up.shape[0]).astype(jnp.int32)
    hidden = swiglu(lax.ragged_dot(x[order // k], w_gate_up, group_sizes))
    out_sorted = lax.ragged_dot(hidden, w_down, group_sizes)
    out = jnp.zeros_like(out_sorted).at[order].set(out_sorted, unique_indices=True)
    return _combine(out.reshape(num_tokens, k, -1), weights, x.dtype)


def _gathered_experts(x, ids, weights, w_gate_up, w_down) -> jax.Array:
    """Each token-slot's expert weights gathered (one [hidden, 2I] and one [I, hidden] slice per slot: the weight
    leaves feed nothing but these gathers), then batched matvecs."""
    hidden = swiglu(jnp.einsum("nh,nkhf->nkf", x, w_gate_up[ids]))
    out = jnp.einsum("nkf,nkfh->nkh", hidden, w_down[ids], preferred_element_type=jnp.float32)
    return _combine(out, weights, x.dtype)


def _combine(out: jax.Array, weights: jax.Array, dtype) -> jax.Array:
    """Σ_j weights[n, j] out[n, j] in fp32, cast to the activations' dtype."""
    return jnp.einsum("nkh,nk->nh", out.astype(jnp.float32), weights).astype(dtype)


def moe(x: jax.Array, weights: dict, routing: Routing, *, form: str = "auto") -> jax.Array:
    """The MoE block on x [..., hidden]: routed experts plus the shared experts."""
    tokens = x.reshape(-1, x.shape[-1])
    ids, routing_weights = route(tokens, weights["w_router"], weights.get("router_bias"), routing)
    routed = routed_experts(tokens, ids, routing_weights, weights["w_gate_up"], weights["w_down"], form=form)
    shared = swiglu(tokens @ weights["w_shared_gate_up"]) @ weights["w_shared_down"]
    return (routed + shared).reshape(x.shape)
