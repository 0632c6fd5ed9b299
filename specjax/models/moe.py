"""DeepSeekMoE: the router (its logits; the selection rules, V3 "noaux_tc" and V2 "greedy" /
"group_limited_greedy", are kernels/moe_routing.py's) and the routed SwiGLU experts in three equal forms, plus the
shared experts.

Weights (a dict; matrices stored [in, out]; gate and up kept apart, so that FP8 weights keep their 128 x 128
block scales, and so that a split of the intermediate size over devices keeps gate and up columns together):
  w_router   [hidden, E] fp32      mlp.gate.weight, transposed (routing stays fp32 whatever the model dtype)
  router_bias [E] fp32             mlp.gate.e_score_correction_bias (noaux_tc only; selection only)
  we_gate, we_up [E, hidden, I]    the experts' gate_proj / up_proj, transposed
  we_down    [E, I, hidden]        the experts' down_proj, transposed
  ws_gate, ws_up [hidden, I_s]     shared_experts' (I_s = moe_intermediate_size * n_shared_experts)
  ws_down    [I_s, hidden]
An FP8 checkpoint adds `<name>_scale` (the block scales, models/fp8.py) beside each matrix; `block` is their block
shape in the [in, out] orientation. The expert axis leads every expert leaf, for expert parallelism.

Expert forms (`routed_experts`): "dense" runs every expert on every token and combines by routing weight (the
reference); "grouped" sorts the token-slots by expert and runs grouped matmuls; "gathered" gathers the selected
experts' weight slices per token-slot and runs batched matvecs, so a step reads only those N*k slices (at decode
k of E). Where the kernel policy runs kernels, "grouped" is the Pallas grouped matmul (kernels/grouped_matmul.py),
which reads each selected expert once per 16 of its slots, FP8 weights as they are stored, and "auto" takes it for
FP8 stacks at every size and for plain ones from KernelPolicy.grouped_matmul_min_plain_rows slots; elsewhere
"grouped" is `jax.lax.ragged_dot` over dequantized stacks (on CPU a dense masked matmul over all groups) and "auto"
takes "gathered" while N*k <= E and "grouped" beyond. A shared expert of one routed expert's shape (DeepSeek-V3's)
runs in the kernel's launches as one more expert of every token, weight 1, at decode and verify sizes (where on
its own it would run in the kernel); other shared experts (V2-Lite's two, a prefill's, off the kernel) are an MLP
of their own.
"""
from __future__ import annotations

import math
from typing import Mapping

import jax
import jax.numpy as jnp
from jax import lax

from jax.sharding import PartitionSpec as P

from specjax.kernels.grouped_matmul import ScaledRows, grouped_matmul, group_count, prepared_rows
from specjax.kernels.grouped_matmul_triton import takes_f16_rows
from specjax.kernels.moe_routing import router_logits, select_experts
from specjax.kernels.moe_routing_reference import Routing, with_always_expert
from specjax.kernels.policy import KernelPolicy
from specjax.kernels.projection_reference import rms_norm
from specjax.kernels.swiglu_rows import MAX_WIDTH as SWIGLU_ROWS_MAX_WIDTH, swiglu_rows
from specjax.models.fp8 import dequantize_stack, in_kernel, linear
from specjax.parallel.mesh import Layout, current_layout

EXPERT_FORMS = ("auto", "dense", "grouped", "gathered")
# Token-slots sorted by pairwise compares up to this many (a verify pass of 512 tokens at top 8: 16M compares in
# one fusion); past it by sorting.
_COMPARE_SORT_MAX_SLOTS = 4096


def route(x: jax.Array, w_router: jax.Array, router_bias: jax.Array | None, routing: Routing,
          kernels: KernelPolicy = KernelPolicy(), always_expert: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Expert ids [N, k] (int32, best first) and their weights [N, k] (fp32) for tokens x [N, hidden]: the logits
    x W in fp32 at full precision, then the selection (kernels/moe_routing.py; always_expert: its id, weight 1,
    as one more column)."""
    logits = router_logits(x, w_router, routing, kernels=kernels)
    return select_experts(logits, router_bias, routing, kernels=kernels, always_expert=always_expert)


def routed_experts(x: jax.Array, ids: jax.Array, weights: jax.Array, experts: Mapping[str, jax.Array], *,
                   form: str = "auto", block: tuple[int, int] | None = None,
                   kernels: KernelPolicy = KernelPolicy(), shared: Mapping[str, jax.Array] | None = None,
                   scaled: ScaledRows | None = None, shared_in_ids: bool = False) -> jax.Array:
    """Σ_j weights[n, j] · Expert_{ids[n, j]}(x[n]) for tokens x [N, hidden], in the chosen form (module doc).
    experts: we_gate, we_up, we_down (and their `_scale` leaves with `block`). shared: leaves holding the shared
    experts (ws_*; none there: no shared experts), their output added: where the grouped kernel runs and they
    are one expert's shape (DeepSeek-V3), as one more expert of every token, weight 1, in the routed experts'
    launches (three launches a layer fewer, its bytes streamed with theirs); else as their own MLP. scaled: x's
    rows as the grouped kernel takes them (grouped_matmul.prepared_rows), for its calls. shared_in_ids: ids and
    weights already end with that expert (route's always_expert, where `joins_shared` says it joins)."""
    num_slots, num_experts = ids.size, experts["we_gate"].shape[0]
    kernel = kernels.use_grouped_matmul_kernel(fp8=experts["we_gate"].dtype.itemsize == 1, rows=num_slots,
                                              groups=num_experts)
    if form == "auto":
        form = "gathered" if num_slots <= num_experts and not kernel else "grouped"
    forms = {"dense": _dense_experts, "grouped": _grouped_experts, "gathered": _gathered_experts}
    if form not in forms:
        raise ValueError(f"expert form {form!r} is not one of {EXPERT_FORMS}")
    if shared_in_ids or joins_shared(experts, shared, ids.shape[0], ids.shape[1], block, kernels, form):
        if not shared_in_ids:
            ids, weights = with_always_expert(ids, weights, num_experts)
        return _grouped_experts(x, ids, weights, _joined(experts, shared), block, kernels, scaled)
    if form == "grouped":
        routed = _grouped_experts(x, ids, weights, experts, block, kernels if kernel else None,
                                  scaled if kernel else None)
    else:
        routed = forms[form](x, ids, weights, experts, block)
    return routed if shared is None else routed + _shared(x, shared, block, kernels)


def joins_shared(experts: Mapping[str, jax.Array], shared: Mapping[str, jax.Array] | None, tokens: int,
                 top_k: int, block, kernels: KernelPolicy, form: str = "auto") -> bool:
    """Whether `tokens` tokens' shared experts run as one more routed expert (of top_k each) in the grouped
    kernel's launches: the kernel runs the experts (`form` auto or grouped), the shared experts are one expert's
    shapes and dtypes, scaled alike, at a token count where on their own they would run in the kernel too (a
    prefill's many rows keep their GEMM, which reads each matrix once, where the kernel's tiles of 16 rows would
    read it once per tile)."""
    if shared is None or "ws_gate" not in shared or form not in ("auto", "grouped"):
        return False
    if not kernels.use_grouped_matmul_kernel(fp8=experts["we_gate"].dtype.itemsize == 1, rows=tokens * top_k,
                                             groups=experts["we_gate"].shape[0]):
        return False
    if not in_kernel(tokens, "ws_gate_scale" in shared, block, kernels):
        return False
    return all(shared[s_name].shape == experts[e_name].shape[1:] and shared[s_name].dtype == experts[e_name].dtype
               and (s_name + "_scale" in shared) == (e_name + "_scale" in experts)
               for e_name, s_name in zip(EXPERT_LEAVES, SHARED_LEAVES))


def _joined(experts: Mapping[str, jax.Array], shared: Mapping[str, jax.Array]) -> dict:
    """Each expert leaf as a tuple (routed stack, the shared expert as a stack of one): grouped_matmul numbers
    the shared expert after the routed ones."""
    joined = {}
    for e_name, s_name in zip(EXPERT_LEAVES, SHARED_LEAVES):
        for suffix in ("", "_scale"):
            if e_name + suffix in experts:
                joined[e_name + suffix] = (experts[e_name + suffix], shared[s_name + suffix][None])
    return joined


def _stacks(experts: Mapping[str, jax.Array], block, dtype, ids=None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(gate, up, down) stacks, taken at `ids` first when given (only those slices are read), FP8 dequantized."""
    return tuple(dequantize_stack(experts, name, block, dtype, ids) for name in ("we_gate", "we_up", "we_down"))


def _dense_experts(x, ids, weights, experts, block) -> jax.Array:
    """Every expert on every token, combined by a [N, E] matrix of routing weights (zero where not chosen)."""
    gate, up, down = _stacks(experts, block, x.dtype)
    hidden = jax.nn.silu(jnp.einsum("nh,ehf->enf", x, gate)) * jnp.einsum("nh,ehf->enf", x, up)
    out = jnp.einsum("enf,efh->enh", hidden, down, preferred_element_type=jnp.float32)
    combine = (jax.nn.one_hot(ids, gate.shape[0], dtype=jnp.float32) * weights[..., None]).sum(axis=1)
    return jnp.einsum("ne,enh->nh", combine, out).astype(x.dtype)


@jax.custom_batching.custom_vmap
def _ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """lax.ragged_dot, which JAX cannot vmap: under vmap (make_generate_fn vmapped over seeds) it runs once per
    batch element, in sequence."""
    return lax.ragged_dot(lhs, rhs, group_sizes)


@_ragged_dot.def_vmap
def _ragged_dot_vmap(axis_size: int, in_batched: list[bool], lhs, rhs, group_sizes):
    args = [a if batched else jnp.broadcast_to(a, (axis_size,) + a.shape)
            for a, batched in zip((lhs, rhs, group_sizes), in_batched)]
    return lax.map(lambda per_element: _ragged_dot(*per_element), tuple(args)), True


def _grouped_experts(x, ids, weights, experts, block, kernels: KernelPolicy | None = None,
                     scaled: ScaledRows | None = None) -> jax.Array:
    """Token-slots sorted by expert, grouped matmuls (the Pallas kernel under `kernels`, else ragged_dot over
    dequantized stacks; of `scaled`, x's rows as the kernel takes them, where given), then unsorted and combined.
    One token's slots (a batch-1 decode step) name distinct experts: under `kernels` they stay in their own order,
    each its own tile (grouped_matmul's row_groups: no sort, count, tile table or unsort to launch; the same bytes
    read and, row by row, the same products)."""
    num_tokens, k = ids.shape
    flat_ids = ids.reshape(-1)
    rows = x if scaled is None else scaled
    in_slot_order = kernels is not None and num_tokens == 1
    if in_slot_order:   # each of the token's k slot tiles reads its one row (no k-fold copy of it to convert)
        into, within, slots = dict(row_groups=ids), dict(row_groups=flat_ids), rows
    else:
        order, rank = _sort_plan(flat_ids)
        within = dict(group_sizes=_slots_per_expert(flat_ids, group_count(experts["we_gate"])))
        if kernels is None:
            into, slots = within, x[order // k]
        else:   # the kernel reads each slot's token row through the order: no sorted copy of the rows
            into, slots = dict(within, row_index=order), rows
    if kernels is None:
        stacks = dict(zip(EXPERT_LEAVES, _stacks(experts, block, x.dtype)))

        def matmul(lhs, names, groups, partials=False):   # no kernel, no partials (swiglu_in_kernel is False)
            return [_ragged_dot(lhs, stacks[name], groups["group_sizes"]) for name in names]
    else:
        def matmul(lhs, names, groups, partials=False):
            fp8 = names[0] + "_scale" in experts
            return grouped_matmul(lhs, [experts[name] for name in names], **groups,
                                  scale=[experts[name + "_scale"] for name in names] if fp8 else None,
                                  block=block if fp8 else None, kernels=kernels, split_partials=partials)
    rows_kernel = swiglu_in_kernel(x.dtype, experts, "we_", kernels, group_count(experts["we_down"]))
    # Sorted slots' gate and up in one launch: their tiles run in waves, whose last one the pair then pays once;
    # a token's slots (9 tiles) fill the GPU in one wave per launch, which joined they overfill (H100 profile:
    # benchmarks/RESULTS.md, "Gate and up in one launch").
    gate, up = (matmul(slots, ["we_gate"], into, rows_kernel) + matmul(slots, ["we_up"], into, rows_kernel)
                if in_slot_order else matmul(slots, ["we_gate", "we_up"], into, rows_kernel))
    hidden = swiglu_rows(gate, up, kernels.interpret) if rows_kernel else jax.nn.silu(gate) * up
    (out,) = matmul(hidden, ["we_down"], within)
    if not in_slot_order:
        out = out[rank]   # a gather the combine's fusion takes in (a scatter needed zeros of its own)
    return _combine(out.reshape(num_tokens, k, -1), weights, x.dtype)


def _sort_plan(flat_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(order, rank) of the slots sorted by expert, stably: order[r] the slot at sorted place r, rank[s] slot s's
    place. Up to _COMPARE_SORT_MAX_SLOTS slots (decode and verify) from pairwise compares and sums (two fusions,
    where a sort and its unsort's zeros and scatter took more); past it (prefill) by sorting."""
    slots = flat_ids.shape[0]
    if slots > _COMPARE_SORT_MAX_SLOTS:
        order = jnp.argsort(flat_ids, stable=True)
        return order, jnp.argsort(order)
    index = jnp.arange(slots, dtype=jnp.int32)
    mine, other = flat_ids[:, None], flat_ids[None, :]
    before = (other < mine) | ((other == mine) & (index[None, :] < index[:, None]))
    rank = before.sum(axis=1, dtype=jnp.int32)
    order = jnp.where(rank[None, :] == index[:, None], index[None, :], 0).sum(axis=1, dtype=jnp.int32)
    return order, rank


def _slots_per_expert(flat_ids: jax.Array, experts: int) -> jax.Array:
    """int32 [E] counts of each expert among the slots, as one compare-and-sum (bincount's zeros and scatter-add
    are two launches on GPUs)."""
    return (flat_ids[:, None] == jnp.arange(experts, dtype=flat_ids.dtype)[None, :]).sum(axis=0, dtype=jnp.int32)


def _gathered_experts(x, ids, weights, experts, block) -> jax.Array:
    """Each token-slot's expert weights gathered (the weight leaves feed nothing but these gathers: one slice per
    slot), then batched matvecs."""
    gate, up, down = _stacks(experts, block, x.dtype, ids)
    hidden = jax.nn.silu(jnp.einsum("nh,nkhf->nkf", x, gate)) * jnp.einsum("nh,nkhf->nkf", x, up)
    out = jnp.einsum("nkf,nkfh->nkh", hidden, down, preferred_element_type=jnp.float32)
    return _combine(out, weights, x.dtype)


def _combine(out: jax.Array, weights: jax.Array, dtype) -> jax.Array:
    """Σ_j weights[n, j] out[n, j] in fp32, cast to the activations' dtype."""
    return jnp.einsum("nkh,nk->nh", out.astype(jnp.float32), weights).astype(dtype)


def swiglu_mlp(x: jax.Array, weights: Mapping[str, jax.Array], prefix: str,
               block: tuple[int, int] | None = None, kernels: KernelPolicy = KernelPolicy(),
               norm: tuple[jax.Array, float] | None = None) -> jax.Array:
    """down(silu(gate(x)) * up(x)) of the weights `{prefix}gate`, `{prefix}up`, `{prefix}down` (FP8 or not): a
    dense layer's MLP (prefix "w_") or the shared experts ("ws_"). norm (weight, eps): of rms_norm(x, weight, eps)
    instead, normalised inside the kernel's row scaling where that runs (fp8.linear)."""
    rows_kernel = (swiglu_in_kernel(x.dtype, weights, prefix, kernels, 1)
                   and in_kernel(math.prod(x.shape[:-1]), True, block, kernels))
    gate, up = (linear(x, weights, prefix + name, block, kernels, norm=norm, split_partials=rows_kernel)
                for name in ("gate", "up"))
    hidden = swiglu_rows(gate, up, kernels.interpret) if rows_kernel else jax.nn.silu(gate) * up
    return linear(hidden, weights, prefix + "down", block, kernels).reshape(*x.shape[:-1], -1)


def swiglu_in_kernel(dtype, weights: Mapping[str, jax.Array], prefix: str, kernels: KernelPolicy | None,
                     groups: int) -> bool:
    """Whether an MLP's down (`{prefix}down`, a stack of `groups`) takes its rows from the SwiGLU rows kernel
    (kernels/swiglu_rows.py): FP8 gate, up and down in the grouped kernel, meeting bf16 rows as float16, rows of
    up to swiglu_rows.MAX_WIDTH."""
    names = [prefix + name for name in ("gate", "up", "down")]
    down = weights[names[-1]]
    down = down[0] if isinstance(down, tuple) else down   # routed and shared stacks joined: alike
    return (kernels is not None and kernels.swiglu_rows_kernel and down.shape[-2] <= SWIGLU_ROWS_MAX_WIDTH
            and all(name + "_scale" in weights for name in names)
            and takes_f16_rows(dtype, down, kernels.fp8_activations)
            and kernels.use_grouped_matmul_kernel(fp8=True, rows=1, groups=groups))


def moe(x: jax.Array, weights: Mapping[str, jax.Array], routing: Routing, *,
        kernels: KernelPolicy = KernelPolicy(), block: tuple[int, int] | None = None,
        norm: tuple[jax.Array, float] | None = None) -> jax.Array:
    """The MoE block on x [..., hidden] (normalised first by norm (weight, eps) where given): routed experts plus
    the shared experts. Where the grouped kernel takes the rows as scaled float16, the router's normalised rows
    and the experts' come from one launch. Traced under a tensor-parallel layout, expert parallel
    (`_expert_parallel`)."""
    tokens = x.reshape(-1, x.shape[-1])
    tokens, scaled = _normalised(tokens, norm, weights, routing, kernels)
    layout = current_layout()
    if layout is not None and layout.shards > 1:
        ids, routing_weights = route(tokens, weights["w_router"], weights.get("router_bias"), routing, kernels)
        return _expert_parallel(tokens, ids, routing_weights, weights, layout, kernels, block).reshape(x.shape)
    joined = joins_shared(weights, weights, tokens.shape[0], routing.num_experts_per_tok, block, kernels,
                          kernels.moe_form)   # the shared expert as expert E, chosen by the routing launch
    ids, routing_weights = route(tokens, weights["w_router"], weights.get("router_bias"), routing, kernels,
                                 always_expert=weights["we_gate"].shape[0] if joined else None)
    out = routed_experts(tokens, ids, routing_weights, weights, form=kernels.moe_form, block=block, kernels=kernels,
                         shared=weights, scaled=scaled, shared_in_ids=joined)
    return out.reshape(x.shape)


def _normalised(tokens: jax.Array, norm: tuple[jax.Array, float] | None, weights: Mapping[str, jax.Array],
                routing: Routing, kernels: KernelPolicy) -> tuple[jax.Array, ScaledRows | None]:
    """(the tokens normalised by `norm`, and the same rows as the grouped kernel's calls take them where those
    are ScaledRows, else None)."""
    if norm is None:
        return tokens, None
    if kernels.moe_form not in ("auto", "grouped"):
        return rms_norm(tokens, *norm), None
    experts = weights["we_gate"]
    normalised, rows = prepared_rows(tokens, norm, experts, rows=tokens.shape[0] * routing.num_experts_per_tok,
                                     groups=experts.shape[0], kernels=kernels)
    return normalised, rows if isinstance(rows, ScaledRows) else None


def _shared(tokens: jax.Array, weights: Mapping[str, jax.Array], block, kernels: KernelPolicy) -> jax.Array:
    """The shared experts' output (zero for a layer without them)."""
    if "ws_gate" not in weights:
        return jnp.zeros_like(tokens)
    return swiglu_mlp(tokens, weights, "ws_", block, kernels)


EXPERT_LEAVES = ("we_gate", "we_up", "we_down")
SHARED_LEAVES = ("ws_gate", "ws_up", "ws_down")
SHARED_COLUMNS, SHARED_ROWS = ("ws_gate", "ws_up"), ("ws_down",)


def _expert_parallel(tokens, ids, routing_weights, weights, layout: Layout, kernels: KernelPolicy,
                     block) -> jax.Array:
    """Each device runs its own slice of the routed experts (the expert axis split over the layout's axis) on
    every token, its slots for other devices' experts weighted 0, and its columns of the shared experts (split
    like a dense MLP when the model's partition rules split them); the partial outputs meet in one all-reduce."""
    axis = layout.head_axis
    experts = {name: weights[name] for name in weights if name.split("_scale")[0] in EXPERT_LEAVES}
    shared = {name: weights[name] for name in weights if name.startswith("ws_")}
    split_shared = "ws_gate" in shared and splits_shared(shared["ws_gate"].shape[-1], layout.shards, block)
    shared_specs = {name: _shared_spec(name, axis) if split_shared else P() for name in shared}

    def local(tokens, ids, routing_weights, experts, shared):
        count = experts["we_gate"].shape[0]
        local_ids = ids - jax.lax.axis_index(axis) * count
        mine = (local_ids >= 0) & (local_ids < count)
        routed = routed_experts(tokens, jnp.clip(local_ids, 0, count - 1), jnp.where(mine, routing_weights, 0.0),
                                experts, form=kernels.moe_form, block=block, kernels=kernels)
        own_shared = _shared(tokens, shared, block, kernels)
        if not split_shared:   # whole on every device: count it once in the sum
            own_shared = jnp.where(jax.lax.axis_index(axis) == 0, own_shared, 0)
        return jax.lax.psum(routed + own_shared, axis)

    return jax.shard_map(local, mesh=layout.mesh,
                         in_specs=(P(), P(), P(), {name: P(axis) for name in experts}, shared_specs),
                         out_specs=P(), check_vma=False)(tokens, ids, routing_weights, experts, shared)


def splits_shared(width: int, shards: int, block: tuple[int, int] | None) -> bool:
    """Whether the shared experts' `width` intermediate columns divide over `shards` devices (FP8 ones in whole
    blocks, so that each device's columns have their own block scales); else they stay whole on every device."""
    return width % shards == 0 and (block is None or (width // shards) % block[0] == 0
                                    and (width // shards) % block[1] == 0)


def _shared_spec(name: str, axis: str) -> P:
    base = name.split("_scale")[0]
    return P(None, axis) if base in SHARED_COLUMNS else P(axis, None)
