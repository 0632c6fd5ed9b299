"""MoE expert selection from router logits: the Pallas kernel where the policy runs kernels (every token count,
so that a decode step and a verify pass choose alike), the pure-JAX reference elsewhere."""
from __future__ import annotations

import jax

from specjax.kernels.moe_routing_reference import Routing, select_experts_reference
from specjax.kernels.moe_routing_triton import select_experts_triton
from specjax.kernels.policy import KernelPolicy


def select_experts(logits: jax.Array, bias: jax.Array | None, routing: Routing, *,
                   kernels: KernelPolicy = KernelPolicy(),
                   always_expert: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Expert ids [N, k] (int32, best first) and weights [N, k] (fp32) for router logits [N, E] (fp32) and the
    choice-only bias [E] (noaux_tc's e_score_correction_bias, or None): moe_routing_reference's rules.
    always_expert: one more column [N, k + 1], that id with weight 1 for every token (a shared expert run as one
    more routed one)."""
    if logits.ndim != 2 or (bias is not None and bias.shape != logits.shape[1:]):
        raise ValueError(f"select_experts: logits must be [N, E] and bias [E], got logits {list(logits.shape)} and "
                         f"bias {None if bias is None else list(bias.shape)}")
    experts = logits.shape[1]
    if routing.num_experts_per_tok > experts:
        raise ValueError(f"select_experts: {experts} experts cannot give num_experts_per_tok="
                         f"{routing.num_experts_per_tok}")
    if routing.group_limited and experts % routing.n_group:
        raise ValueError(f"select_experts: {experts} experts do not split into n_group={routing.n_group} equal "
                         f"groups ({routing.topk_method} ranks groups)")
    if kernels.use_routing_kernel():
        return select_experts_triton(logits, bias, routing, interpret=kernels.interpret, always_expert=always_expert)
    return select_experts_reference(logits, bias, routing, always_expert)
