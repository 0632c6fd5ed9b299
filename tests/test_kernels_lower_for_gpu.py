"""The Pallas kernels lower to Triton IR that verifies, checked on a host without a GPU.

Interpret mode (the other kernel tests) runs the kernels' JAX semantics; it never builds the Triton module,
so a kernel that computes right there can still be rejected by Triton on the device (a loop bound of the
wrong integer type did, once). Lowering for CUDA needs no GPU; the module is verified as XLA would parse it.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
# JAX's private Triton lowering: when a JAX release moves it, this import fails the suite (rather than skipping
# the only check that the kernels build for a GPU); find its new home and update the import.
from jax._src.pallas.triton import pallas_call_registration as registration

from specjax.kernels.attention_triton import attention_triton
from specjax.kernels.grouped_matmul_triton import ScaledRows, default_config, f16_rows, grouped_matmul_triton
from specjax.kernels.latent_rows import latent_rows
from specjax.kernels.swiglu_rows import swiglu_rows
from specjax.kernels.moe_routing import router_logits
from specjax.kernels.moe_routing_reference import Routing
from specjax.kernels.moe_routing_triton import select_experts_triton
from specjax.kernels.policy import KernelPolicy
from specjax.kernels.projection_triton import projection_triton
from specjax.kernels.top_k_top_p import LARGE_BATCH_CONFIG
from specjax.kernels.top_k_top_p_triton import SearchConfig, keep_mask_triton
from specjax.kernels.tree_mask import TreeMask


@pytest.fixture
def triton_modules(monkeypatch):
    """The Triton modules built by the next lowering (jax's private lowering hook, wrapped)."""
    built = []
    lower = registration.lowering.lower_jaxpr_to_triton_module

    def keep(*args, **kwargs):
        result = lower(*args, **kwargs)
        built.append(result.module)
        return result

    monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_triton_module", keep)
    return built


def lower_for_cuda(fn, *args) -> None:
    jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def assert_verified(modules) -> None:
    assert modules, "no Triton module was built"
    for module in modules:
        assert module.operation.verify()


@pytest.mark.parametrize("batch, tokens, heads, kv_heads, slots, head_dim, dtype, window", [
    (1, 1, 32, 8, 1024, 128, jnp.bfloat16, 0),     # decode, split KV
    (4, 5, 9, 3, 600, 64, jnp.bfloat16, 0),        # verify, the default model's heads
    (1, 300, 32, 8, 512, 128, jnp.bfloat16, 0),    # prefill: row tiles
    (2, 3, 16, 16, 100, 64, jnp.float32, 0),
    (1, 1, 32, 8, 1024, 128, jnp.bfloat16, 256),   # sliding window, split KV
    (1, 300, 32, 8, 512, 128, jnp.bfloat16, 64),   # sliding window, row tiles
])
def test_attention_kernel_lowers(triton_modules, batch, tokens, heads, kv_heads, slots, head_dim, dtype, window):
    """The window is traced (one layer's value of a scanned stack), as the model passes it."""
    q = jnp.zeros((batch, tokens, heads, head_dim), dtype)
    cache = jnp.zeros((2, batch, kv_heads, slots, head_dim), dtype)
    start = jnp.zeros((batch,), jnp.int32)
    lower_for_cuda(lambda q, k, v, s, w: attention_triton(q, k, v, 1, s, scale=0.1, window=w), q, cache, cache, start,
                   jnp.int32(window))
    assert_verified(triton_modules)


@pytest.mark.parametrize("batch, nodes, slots, window", [(1, 32, 1024, 0), (8, 16, 600, 0), (1, 64, 512, 4096)])
def test_tree_attention_kernel_lowers(triton_modules, batch, nodes, slots, window):
    """A draft tree's verify pass: the tree mask's loads (the default model's heads)."""
    q = jnp.zeros((batch, nodes + 1, 9, 64), jnp.bfloat16)
    cache = jnp.zeros((2, batch, 3, slots, 64), jnp.bfloat16)
    start = jnp.zeros((batch,), jnp.int32)
    tree = TreeMask(positions=jnp.zeros((batch, nodes + 1), jnp.int32), region_start=start,
                    visible=jnp.zeros((batch, nodes + 1, nodes + 1), bool))
    lower_for_cuda(lambda q, k, v, s, w, t: attention_triton(q, k, v, 1, s, scale=0.1, window=w, tree=t), q, cache,
                   cache, start, jnp.int32(window), tree)
    assert_verified(triton_modules)


@pytest.mark.parametrize("batch, tokens, heads, slots", [(8, 1, 128, 4096), (2, 4, 16, 1024), (64, 1, 16, 32768)])
def test_latent_attention_kernel_lowers(triton_modules, batch, tokens, heads, slots):
    """MLA's absorbed form: DeepSeek's 576-wide latent rows, one kv head, values the first 512 columns."""
    q = jnp.zeros((batch, tokens, heads, 576), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((2, batch, 1, slots, 576), jnp.bfloat16)   # 4.8 GB at 64 x 32768: shape only
    start = jnp.zeros((batch,), jnp.int32)
    lower_for_cuda(lambda q, c, s: attention_triton(q, c, None, 1, s, scale=0.1, value_dim=512), q, cache, start)
    assert_verified(triton_modules)


@pytest.mark.parametrize("norm, activation, residual", [(True, None, False), (True, "swiglu", False),
                                                        (False, None, True)])
def test_projection_kernel_lowers(triton_modules, norm, activation, residual):
    rows, k, n = 5, 576, 3072 if activation else 576
    x = jnp.zeros((rows, k), jnp.bfloat16)
    w = jnp.zeros((k, n), jnp.bfloat16)
    scale = jnp.ones((k,), jnp.bfloat16) if norm else None
    res = jnp.zeros((rows, n // 2 if activation else n), jnp.bfloat16) if residual else None
    lower_for_cuda(lambda x, w: projection_triton(x, w, norm=scale, eps=1e-5, activation=activation,
                                                  residual=res), x, w)
    assert_verified(triton_modules)


@pytest.mark.parametrize("vocab, config", [(49152, SearchConfig()), (128256, SearchConfig()),
                                           (128256, LARGE_BATCH_CONFIG)])
def test_top_k_top_p_search_lowers(triton_modules, vocab, config):
    logits = jnp.zeros((5, vocab), jnp.float32)
    lower_for_cuda(lambda x, k, p: keep_mask_triton(x, k, p, config=config), logits, jnp.zeros((5, 1), jnp.int32),
                   jnp.ones((5, 1), jnp.float32))
    assert_verified(triton_modules)


@pytest.mark.parametrize("rows, shape, fp8_rows, pairs, f16_rows", [
    (8, (16, 256, 256), False, None, None),    # decode: an FP8 expert stack (read as pairs), K split, f16 rows
    (8, (16, 256, 256), False, False, None),   # the same loaded as it is
    (8, (16, 256, 256), False, None, False),   # bf16 rows as they are
    (8, (16, 256, 256), True, None, None),     # FP8 x FP8
    (8, (16, 256, 256), True, False, None),
    (1, (1, 512, 256), False, None, None),     # one dense FP8 matrix
    (3, (2, 200, 150), False, None, None),     # edge blocks: masked FP8 loads
    (3, (2, 200, 150), False, False, None),
    (5000, (4, 256, 128), False, None, None),  # prefill: no K split
])
def test_grouped_matmul_kernel_lowers(triton_modules, rows, shape, fp8_rows, pairs, f16_rows):
    groups, k, n = shape
    x = jnp.zeros((rows, k), jnp.bfloat16)
    w = jnp.zeros(shape, jnp.float8_e4m3fn)
    scale = jnp.ones((groups, -(-k // 128), -(-n // 128)), jnp.float32)
    config = dataclasses.replace(default_config(groups, 1), pairs=pairs, f16_rows=f16_rows)
    lower_for_cuda(lambda x, w, s, g: grouped_matmul_triton(x, w, g, scale=s, block=(128, 128), config=config,
                                                            fp8_rows=fp8_rows),
                   x, w, scale, jnp.zeros((groups,), jnp.int32))
    assert_verified(triton_modules)


def test_grouped_matmul_lowers_on_prepared_rows_read_through_an_index(triton_modules):
    """A MoE layer's sorted slots at verify sizes: 8 tokens' rows normalised and scaled once (f16_rows keeping
    the normalised rows), their 64 top-8 slots read through the sort's order."""
    x, norm = jnp.zeros((8, 256), jnp.bfloat16), jnp.ones((256,), jnp.bfloat16)
    w = jnp.zeros((16, 256, 256), jnp.float8_e4m3fn)
    scale = jnp.ones((16, 2, 2), jnp.float32)

    def layer(x, norm, w, scale, sizes, order):
        values, unscale, normalised = f16_rows(x, norm=(norm, 1e-6), keep_normalised=True)
        out = grouped_matmul_triton(ScaledRows(values, unscale), w, sizes, row_index=order, scale=scale,
                                    block=(128, 128))
        return out, normalised

    lower_for_cuda(layer, x, norm, w, scale, jnp.zeros((16,), jnp.int32), jnp.zeros((64,), jnp.int32))
    assert_verified(triton_modules)


@pytest.mark.parametrize("tokens", [1, 8])
def test_router_logits_and_the_choice_from_their_partial_sums_lower(triton_modules, tokens):
    """V3's router: bf16 rows times the fp32 router matrix (an fp32 dot at full precision), its K split's partial
    products summed by the routing kernel."""
    routing = Routing(8, "sigmoid", "noaux_tc", 8, 4, routed_scaling_factor=2.5)
    bias = jnp.zeros((256,), jnp.float32)
    kernels = KernelPolicy(impl="triton")
    lower_for_cuda(lambda x, w: select_experts_triton(router_logits(x, w, routing, kernels=kernels), bias, routing,
                                                      always_expert=256),
                   jnp.zeros((tokens, 7168), jnp.bfloat16), jnp.zeros((7168, 256), jnp.float32))
    assert_verified(triton_modules)
    assert len(triton_modules) == 2


@pytest.mark.parametrize("tokens", [1, 8])
def test_gate_and_up_of_routed_and_shared_experts_lower_as_one_kernel(triton_modules, tokens):
    """A V3 MoE layer's gate and up (each the routed stack and the shared expert) of one token's slots or of 8
    tokens' sorted slots: one f16_rows and one grouped matmul module, where two calls built two of each."""
    x = jnp.zeros((tokens, 256), jnp.bfloat16)
    routed, shared = jnp.zeros((16, 256, 256), jnp.float8_e4m3fn), jnp.zeros((1, 256, 256), jnp.float8_e4m3fn)
    scales = (jnp.ones((16, 2, 2), jnp.float32), jnp.ones((1, 2, 2), jnp.float32))
    ids = jnp.zeros((tokens, 3), jnp.int32)
    groups = dict(row_groups=ids) if tokens == 1 else dict(group_sizes=jnp.zeros((17,), jnp.int32),
                                                           row_index=ids.reshape(-1))
    lower_for_cuda(lambda x: grouped_matmul_triton(x, [(routed, shared)] * 2, **groups, scale=[scales] * 2,
                                                   block=(128, 128)), x)
    assert_verified(triton_modules)
    assert len(triton_modules) == 2


@pytest.mark.parametrize("tokens, shape", [(1, (128, 128, 512)), (8, (128, 512, 128)), (40, (16, 128, 512))])
def test_interleaved_grouped_matmul_lowers(triton_modules, tokens, shape):
    """MLA's per-head products (W_UK, W_UV at V3's and at 8-way split widths): bf16 stacks, rows a head apart."""
    heads, k, _ = shape
    lower_for_cuda(lambda x, w: grouped_matmul_triton(x, w, interleaved=True),
                   jnp.zeros((tokens * heads, k), jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16))
    assert_verified(triton_modules)


@pytest.mark.parametrize("tokens, experts, routing, biased", [
    (1, 256, Routing(8, "sigmoid", "noaux_tc", 8, 4, routed_scaling_factor=2.5), True),   # DeepSeek-V3
    (64, 160, Routing(6, "softmax", "group_limited_greedy", 8, 3, norm_topk_prob=False), False),   # V2: groups of 20
    (8, 64, Routing(6, "softmax", "greedy", norm_topk_prob=False), False),                    # V2-Lite
])
def test_moe_routing_kernel_lowers(triton_modules, tokens, experts, routing, biased):
    bias = jnp.zeros((experts,), jnp.float32) if biased else None
    always = experts if biased else None   # V3: its shared expert chosen as one more
    lower_for_cuda(lambda logits: select_experts_triton(logits, bias, routing, always_expert=always),
                   jnp.zeros((tokens, experts)))
    assert_verified(triton_modules)


@pytest.mark.parametrize("rows, splits, interleaved", [(1, 28, True), (12, 2, False)])
def test_latent_rows_kernel_lowers(triton_modules, rows, splits, interleaved):
    """DeepSeek-V3's widths: q_a 1536 of 1536 columns, c_kv 512, k_rope 64; a decode row and a verify pass."""
    partials = jnp.zeros((splits, rows, 1536 + 512 + 64), jnp.float32)
    norms = ((jnp.ones((1536,), jnp.bfloat16), 1e-6), (jnp.ones((512,), jnp.bfloat16), 1e-6))
    cache = jnp.zeros((4, rows, 1040, 576), jnp.bfloat16)
    lower_for_cuda(lambda p, r, c, s: latent_rows(p, *norms, 1536, r, c, 2, s, interleaved=interleaved),
                   partials, jnp.zeros((rows, 64), jnp.float32), cache, jnp.zeros((rows,), jnp.int32))
    assert_verified(triton_modules)


@pytest.mark.parametrize("splits, rows, width", [(2, 9, 2048), (3, 1, 18432)])
def test_swiglu_rows_kernel_lowers(triton_modules, splits, rows, width):
    """DeepSeek-V3's experts (a token's 9 slots) and its dense MLP (18432 wide, in chunks)."""
    partials = jnp.zeros((splits, rows, width), jnp.float32)
    lower_for_cuda(swiglu_rows, partials, partials)
    assert_verified(triton_modules)
