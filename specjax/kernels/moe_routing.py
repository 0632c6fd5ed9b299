"""MoE routing: the router's logits and the expert selection from them, as kernels where the policy runs kernels
(every token count, so that a decode step and a verify pass choose alike), the pure-JAX reference elsewhere."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from specjax.kernels.grouped_matmul_triton import GroupedMatmulConfig, MAX_SPLIT_ROWS, grouped_matmul_triton
from specjax.kernels.moe_routing_reference import Routing, select_experts_reference
from specjax.kernels.moe_routing_triton import select_experts_triton
from specjax.kernels.policy import KernelPolicy

# The router product in the grouped kernel: fp32 rows and matrix in 32-column blocks, K split for about 128
# programs (V3: 8 column blocks x 14 splits of 4 chunks), so that its partial sums stay small at verify sizes.
ROUTER_CONFIG = GroupedMatmulConfig(block_n=32, num_warps=4, target_programs=128)


def router_logits(x: jax.Array, w_router: jax.Array, routing: Routing, *,
                  kernels: KernelPolicy = KernelPolicy()) -> jax.Array:
    """x [N, H] @ w_router [H, E] in fp32 at full precision, for select_experts. Where the routing kernel runs,
    at decode and verify sizes (N top-k slots up to the grouped kernel's MAX_SPLIT_ROWS), the grouped matmul
    kernel's partial products [S, N, E] over a split of K fixed by the shapes, which the routing kernel sums:
    XLA's matvec splits K by the token count, so a token's logits could round apart in a decode step and in a
    verify pass and, at a near tie, pick another expert. Elsewhere XLA's dot, [N, E]."""
    w_router = w_router.astype(jnp.float32)
    if kernels.use_routing_kernel() and x.shape[0] * routing.num_experts_per_tok <= MAX_SPLIT_ROWS:
        return grouped_matmul_triton(x, w_router[None], interleaved=True, config=ROUTER_CONFIG,   # rows as fp32
                                     split_partials=True, interpret=kernels.interpret)            # in the kernel
    return jnp.dot(x.astype(jnp.float32), w_router, precision=lax.Precision.HIGHEST)


def select_experts(logits: jax.Array, bias: jax.Array | None, routing: Routing, *,
                   kernels: KernelPolicy = KernelPolicy(),
                   always_expert: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Expert ids [N, k] (int32, best first) and weights [N, k] (fp32) for router logits [N, E] (fp32), or their
    partial sums [S, N, E] (router_logits; summed in split order), and the choice-only bias [E] (noaux_tc's
    e_score_correction_bias, or None): moe_routing_reference's rules. always_expert: one more column [N, k + 1],
    that id with weight 1 for every token (a shared expert run as one more routed one)."""
    if logits.ndim not in (2, 3) or (bias is not None and bias.shape != logits.shape[-1:]):
        raise ValueError(f"select_experts: logits must be [N, E] (or partial sums [S, N, E]) and bias [E], got "
                         f"logits {list(logits.shape)} and bias {None if bias is None else list(bias.shape)}")
    experts = logits.shape[-1]
    if routing.num_experts_per_tok > experts:
        raise ValueError(f"select_experts: {experts} experts cannot give num_experts_per_tok="
                         f"{routing.num_experts_per_tok}")
    if routing.group_limited and experts % routing.n_group:
        raise ValueError(f"select_experts: {experts} experts do not split into n_group={routing.n_group} equal "
                         f"groups ({routing.topk_method} ranks groups)")
    if kernels.use_routing_kernel():
        return select_experts_triton(logits, bias, routing, interpret=kernels.interpret, always_expert=always_expert)
    logits = functools.reduce(jnp.add, list(logits)) if logits.ndim == 3 else logits
    return select_experts_reference(logits, bias, routing, always_expert)
