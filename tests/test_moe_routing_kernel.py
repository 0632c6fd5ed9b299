"""MoE routing: the Pallas kernel (interpret mode) against the pure-JAX reference on tied and untied scores, every
method, group layouts and widths that are not powers of two; a token's choice alone and among others; logits as
partial sums; the router's logits alone and among other tokens; bad input."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specjax.kernels.grouped_matmul_triton import MAX_SPLIT_ROWS
from specjax.kernels.moe_routing import router_logits, select_experts
from specjax.kernels.moe_routing_reference import Routing, select_experts_reference
from specjax.kernels.moe_routing_triton import select_experts_triton
from specjax.kernels.policy import KernelPolicy, has_kernels

# (experts, n_group, topk_group, k): V3's layout scaled down, V2's 160 experts in groups of 20, one group.
LAYOUTS = [(32, 8, 4, 8), (64, 8, 3, 6), (160, 8, 3, 6), (24, 4, 2, 3), (16, 1, 1, 4)]


def routing_for(layout, method: str, scoring: str, norm: bool) -> Routing:
    experts, n_group, topk_group, k = layout
    return Routing(k, scoring, method, n_group, topk_group, norm_topk_prob=norm, routed_scaling_factor=2.5)


def draw_logits(seed: int, tokens: int, experts: int, tied: bool) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if tied:   # a few values, so that experts and groups tie
        return rng.choice(np.float32([-1.0, -0.25, 0.5, 1.5]), (tokens, experts))
    return rng.standard_normal((tokens, experts)).astype(np.float32)


# Each example compiles the kernel for its shapes.
@settings(max_examples=16, deadline=None)
@given(st.integers(0, 2 ** 31 - 1), st.sampled_from(LAYOUTS),
       st.sampled_from([("noaux_tc", "sigmoid"), ("group_limited_greedy", "softmax"), ("greedy", "softmax"),
                        ("greedy", "sigmoid")]),
       st.booleans(), st.booleans(), st.booleans())
def test_the_kernel_chooses_as_the_reference(seed, layout, method_scoring, tied, biased, norm):
    """The same experts in the same order (ties to the lower expert and group, as lax.top_k), the weights within
    rounding; the first token alone chooses as it does among the others."""
    method, scoring = method_scoring
    routing = routing_for(layout, method, scoring, norm)
    logits = jnp.asarray(draw_logits(seed, 5, layout[0], tied))
    bias = (jnp.asarray(np.random.default_rng(seed + 1).choice(np.float32([0.0, 0.125]), layout[0]))
            if biased else None)
    want_ids, want_weights = select_experts_reference(logits, bias, routing)
    got_ids, got_weights = select_experts_triton(logits, bias, routing, interpret=True)
    np.testing.assert_array_equal(np.asarray(got_ids), np.asarray(want_ids))
    np.testing.assert_allclose(np.asarray(got_weights), np.asarray(want_weights), rtol=2e-6, atol=0)
    alone_ids, alone_weights = select_experts_triton(logits[:1], bias, routing, interpret=True)
    np.testing.assert_array_equal(np.asarray(alone_ids), np.asarray(got_ids[:1]))
    np.testing.assert_array_equal(np.asarray(alone_weights), np.asarray(got_weights[:1]))


@pytest.mark.parametrize("layout", [LAYOUTS[0], LAYOUTS[3]])
def test_an_always_chosen_expert_is_one_more_column_of_weight_one(layout):
    """always_expert (a shared expert run as a routed one): the kernel and the reference append its id with
    weight 1 to every token's choice, which is otherwise the choice without it, bit for bit."""
    routing = routing_for(layout, "noaux_tc", "sigmoid", True)
    logits = jnp.asarray(draw_logits(3, 5, layout[0], False))
    for select in (lambda *a, **k: select_experts_triton(*a, interpret=True, **k),
                   lambda *a, **k: select_experts_reference(*a, **k)):
        ids, weights = select(logits, None, routing)
        joined_ids, joined_weights = select(logits, None, routing, always_expert=layout[0])
        np.testing.assert_array_equal(np.asarray(joined_ids[:, :-1]), np.asarray(ids))
        np.testing.assert_array_equal(np.asarray(joined_weights[:, :-1]), np.asarray(weights))
        assert (np.asarray(joined_ids[:, -1]) == layout[0]).all() and (np.asarray(joined_weights[:, -1]) == 1).all()


@pytest.mark.skipif(not has_kernels(jax.devices()[0]), reason="compiles the Triton kernel (a CUDA GPU)")
@pytest.mark.parametrize("layout, method, scoring", [((256, 8, 4, 8), "noaux_tc", "sigmoid"),
                                                     ((160, 8, 3, 6), "group_limited_greedy", "softmax")])
def test_the_compiled_kernel_chooses_as_the_reference_on_the_gpu(layout, method, scoring):
    """V3's and V2's layouts at batch 1 and 32: the compiled kernel picks the reference's experts."""
    routing = routing_for(layout, method, scoring, norm=True)
    bias = jnp.asarray(np.random.default_rng(1).standard_normal(layout[0]).astype(np.float32) * 0.1)
    for tokens in (1, 32):
        logits = jnp.asarray(draw_logits(tokens, tokens, layout[0], tied=False))
        want_ids, want_weights = select_experts_reference(logits, bias, routing)
        got_ids, got_weights = jax.jit(lambda x: select_experts_triton(x, bias, routing))(logits)
        np.testing.assert_array_equal(np.asarray(got_ids), np.asarray(want_ids))
        np.testing.assert_allclose(np.asarray(got_weights), np.asarray(want_weights), rtol=1e-5, atol=0)


@pytest.mark.parametrize("policy", [KernelPolicy(interpret=True), KernelPolicy(impl="reference")])
def test_partial_sums_of_the_logits_choose_as_their_sum_in_split_order(policy):
    """Logits as partial sums [S, N, E] (the router product's K splits): the kernel and the reference choose the
    experts, with the weights, that the partials summed in split order give, bit for bit."""
    routing = routing_for(LAYOUTS[0], "noaux_tc", "sigmoid", True)
    partials = jnp.asarray(np.random.default_rng(4).standard_normal((5, 3, LAYOUTS[0][0])).astype(np.float32))
    summed = partials[0] + partials[1] + partials[2] + partials[3] + partials[4]
    want = select_experts(summed, None, routing, kernels=policy)
    got = select_experts(partials, None, routing, kernels=policy)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_router_logits_of_a_token_do_not_depend_on_the_token_count():
    """Where the routing kernel runs, a token's router logits are the grouped kernel's partial products over a K
    split fixed by the shapes: summed, within fp32 rounding of the float64 product, and the same bits alone, among
    5 tokens and among 40; past the verify sizes, and off the kernel, XLA's dot."""
    routing = Routing(8, "sigmoid", "noaux_tc", 8, 4)
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((40, 512)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((512, 64)) / 20, jnp.float32)
    kernels = KernelPolicy(interpret=True)
    partials = [router_logits(x[:n], w, routing, kernels=kernels) for n in (1, 5, 40)]
    assert partials[0].ndim == 3 and partials[0].shape[0] > 1
    for many in partials[1:]:
        np.testing.assert_array_equal(np.asarray(many[:, :1]), np.asarray(partials[0]))
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    np.testing.assert_allclose(np.asarray(partials[2].sum(axis=0)), want, rtol=0, atol=1e-5)
    past = MAX_SPLIT_ROWS // routing.num_experts_per_tok + 1
    assert router_logits(jnp.zeros((past, 512), jnp.bfloat16), w, routing, kernels=kernels).shape == (past, 64)
    off = router_logits(x, w, routing, kernels=KernelPolicy(impl="reference"))
    np.testing.assert_allclose(np.asarray(off), want, rtol=0, atol=1e-5)


def test_the_dispatcher_runs_the_kernel_where_the_policy_says():
    routing = Routing(2, "sigmoid", "noaux_tc", 2, 1)
    logits = jnp.asarray(draw_logits(3, 2, 8, tied=False))
    for kernels, kernel in ((KernelPolicy(interpret=True), True), (KernelPolicy(), False),
                            (KernelPolicy(interpret=True, routing_kernel=False), False)):
        jaxpr = str(jax.make_jaxpr(lambda l: select_experts(l, None, routing, kernels=kernels))(logits))
        assert ("pallas_call" in jaxpr) == kernel, kernels


@pytest.mark.parametrize("logits, bias, routing, match", [
    ((3, 4, 8, 2), None, Routing(2), r"logits must be \[N, E\] \(or partial sums \[S, N, E\]\) and bias \[E\]"),
    ((4, 8), (7,), Routing(2), r"and bias \[E\], got logits \[4, 8\] and bias \[7\]"),
    ((4, 8), None, Routing(9), "8 experts cannot give num_experts_per_tok=9"),
    ((4, 8), None, Routing(2, n_group=3), "8 experts do not split into n_group=3 equal groups"),
])
def test_bad_input_is_refused_naming_the_field(logits, bias, routing, match):
    with pytest.raises(ValueError, match=match):
        select_experts(jnp.zeros(logits), None if bias is None else jnp.zeros(bias), routing)


def test_greedy_routing_ignores_the_group_count():
    ids, _ = select_experts(jnp.asarray(draw_logits(5, 2, 8, tied=False)), None, Routing(2, "softmax", "greedy", 3))
    assert ids.shape == (2, 2)


def test_an_unknown_method_or_scoring_is_refused_when_the_routing_is_made():
    with pytest.raises(ValueError, match="topk_method 'aux_free' is not one of"):
        Routing(2, topk_method="aux_free")
    with pytest.raises(ValueError, match="scoring 'relu' is not one of"):
        Routing(2, scoring="relu")
