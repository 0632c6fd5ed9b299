"""The DeepSeek-V2/V3 building blocks (specjax.models.rope, mla, moe, fp8) against transformers' own PyTorch
modules on the same weights (fp32, CPU; weights from tiny random models, tests/deepseek_checkpoints.py) and the
FP8 pieces against numpy."""
from __future__ import annotations

import functools
import json
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from deepseek_checkpoints import (
    FP8_QUANTIZED,
    YARN_EQUAL_MSCALE,
    YARN_UNEQUAL_MSCALE,
    YARN_V2_LITE,
    build_tiny_deepseek,
    dequantize_blocks_numpy,
    quantize_blocks_numpy,
    save_tiny_deepseek,
    write_fp8_copy,
)
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf_v2
from transformers.models.deepseek_v3 import configuration_deepseek_v3
from transformers import modeling_rope_utils as rope_utils
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3

from specjax.kernels import attention_reference
from specjax.kernels.grouped_matmul_triton import f16_rows
from specjax.kernels.moe_routing_reference import within_top_groups
from specjax.kernels.projection_reference import rms_norm
from specjax.kernels.policy import KernelPolicy
from specjax.models import fp8, mla, moe, random_init, rope

REL_TOL = 1e-5
MLA_VARIANTS = ("v3", "v3_dense3_no_q_lora", "v3_one_group_rotate_half", "v2_lite", "v2_group_limited")
ROUTER_VARIANTS = ("v3", "v3_dense3_no_q_lora", "v3_one_group_rotate_half", "v2_lite", "v2_group_limited")
MOE_VARIANTS = ("v3", "v3_dense3_no_q_lora", "v2_group_limited")   # the expert math is the same code for all
V3_REAL_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
                "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


@functools.cache
def tiny(variant: str):
    return build_tiny_deepseek(variant)


def as_numpy(module) -> dict[str, np.ndarray]:
    return {name: t.detach().float().numpy() for name, t in module.state_dict().items()}


def is_v3(config) -> bool:
    return config.model_type == "deepseek_v3"


# ---------------------------------------------------------------------------------------------------------- rope

ROPE_CASES = {
    "default": (16, {"rope_type": "default", "rope_theta": 10000.0}),
    "linear": (16, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    "llama3": (16, {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "yarn_v3_real": (64, V3_REAL_YARN),
    "yarn_equal_mscale": (8, YARN_EQUAL_MSCALE),
    "yarn_unequal_mscale": (8, YARN_UNEQUAL_MSCALE),
    "yarn_v2_lite": (8, YARN_V2_LITE),
    "yarn_no_mscale_untruncated": (16, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                        "original_max_position_embeddings": 64, "truncate": False}),
    "yarn_explicit_attention_factor": (16, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                            "original_max_position_embeddings": 64, "attention_factor": 0.8}),
    "yarn_factor_derived": (16, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": None,
                                 "original_max_position_embeddings": 64}),
    "yarn_original_defaulted": (16, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}),
}
MAX_POSITIONS = 512


def hf_rotary(head_dim: int, params: dict, **fields):
    config = configuration_deepseek_v3.DeepseekV3Config(qk_rope_head_dim=head_dim, rope_parameters=dict(params),
                                                         max_position_embeddings=MAX_POSITIONS, **fields)
    return config, hf_v3.DeepseekV3RotaryEmbedding(config)


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_inv_freq_and_attention_factor_match_transformers(case):
    head_dim, params = ROPE_CASES[case]
    _, rotary = hf_rotary(head_dim, params)
    inv_freq = rope.rope_inv_freq(head_dim, params["rope_theta"], params, max_position_embeddings=MAX_POSITIONS)
    assert inv_freq.dtype == np.float32 and inv_freq.shape == (head_dim // 2,)
    np.testing.assert_allclose(inv_freq, rotary.inv_freq.numpy(), rtol=1e-6, atol=0)
    assert rope.rope_attention_factor(params, max_position_embeddings=MAX_POSITIONS) == pytest.approx(
        rotary.attention_scaling, rel=1e-12)


@pytest.mark.parametrize("case", [name for name, (_, p) in ROPE_CASES.items() if "factor" not in p or p["factor"]])
def test_softmax_scale_matches_deepseek_attention(case):
    """(Not for a null factor: transformers' yarn_apply_mscale reads factor as given.)"""
    head_dim, params = ROPE_CASES[case]
    config, _ = hf_rotary(head_dim, params, qk_nope_head_dim=24, hidden_size=32, num_attention_heads=2,
                          q_lora_rank=16, kv_lora_rank=16, v_head_dim=8)
    want = hf_v3.DeepseekV3Attention(config, 0).scaling
    assert rope.yarn_softmax_scale(24 + head_dim, params) == pytest.approx(want, rel=1e-12)
    if params.get("mscale_all_dim"):   # the multiplier is really there (V3: 1 + 0.1 ln 40 squared, ~1.874)
        assert want > (24 + head_dim) ** -0.5 * 1.01


# transformers moved yarn_get_mscale from the DeepSeek-V3 model file to its rope utilities (5.25).
hf_yarn_get_mscale = getattr(hf_v3, "yarn_get_mscale", None) or rope_utils.yarn_get_mscale


def test_yarn_mscale_matches_transformers():
    for factor, mscale in [(40.0, 1.0), (4.0, 0.707), (1.0, 1.0), (0.5, 2.0)]:
        assert rope.yarn_mscale(factor, mscale) == hf_yarn_get_mscale(factor, mscale)


def rope_inputs(head_dim: int, params: dict, seed: int = 0):
    """q, k [B, T, H, D] (k with one head) and positions [B, T] starting at different offsets per row."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, 5, 3, head_dim)).astype(np.float32)
    k = rng.standard_normal((2, 5, 1, head_dim)).astype(np.float32)
    positions = np.array([0, 37])[:, None] + np.arange(5)[None, :]
    inv_freq = rope.rope_inv_freq(head_dim, params["rope_theta"], params, max_position_embeddings=MAX_POSITIONS)
    factor = rope.rope_attention_factor(params, max_position_embeddings=MAX_POSITIONS)
    return q, k, positions, functools.partial(rope.apply_rope, inv_freq=inv_freq, attention_factor=factor)


def test_rotate_half_matches_transformers():
    params = YARN_UNEQUAL_MSCALE   # attention factor != 1: cos and sin are scaled
    q, k, positions, apply = rope_inputs(8, params)
    _, rotary = hf_rotary(8, params)
    cos, sin = rotary(torch.from_numpy(q), torch.from_numpy(positions))
    want_q, want_k = hf_v3.apply_rotary_pos_emb(torch.from_numpy(q), torch.from_numpy(k), cos, sin, unsqueeze_dim=2)
    got_q = apply(jnp.asarray(q), jnp.asarray(positions), interleaved=False)
    got_k = apply(jnp.asarray(k), jnp.asarray(positions), interleaved=False)
    np.testing.assert_allclose(got_q, want_q.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_k, want_k.numpy(), rtol=1e-5, atol=1e-6)


def test_interleaved_matches_deepseek_v2_layout():
    """V2's complex multiply keeps adjacent pairs in place: the raw rotated tensors match."""
    params = YARN_V2_LITE
    q, k, positions, apply = rope_inputs(8, params)
    config = hf_v2.DeepseekV2Config(qk_rope_head_dim=8, rope_parameters=dict(params),
                                    max_position_embeddings=MAX_POSITIONS)
    freqs_cis = hf_v2.DeepseekV2RotaryEmbedding(config)(torch.from_numpy(q), torch.from_numpy(positions))
    heads_first = [torch.from_numpy(a).transpose(1, 2) for a in (q, k)]   # V2 rotates [B, H, T, D]
    want_q, want_k = (t.transpose(1, 2).numpy() for t in hf_v2.apply_rotary_emb(*heads_first, freqs_cis))
    np.testing.assert_allclose(apply(jnp.asarray(q), jnp.asarray(positions), interleaved=True), want_q,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(apply(jnp.asarray(k), jnp.asarray(positions), interleaved=True), want_k,
                               rtol=1e-5, atol=1e-6)


def test_interleaved_matches_deepseek_v3_up_to_layout():
    """V3 (rope_interleave=True) writes evens then odds: the raw tensors match after that permutation, and q·k
    (what attention sees) matches as is."""
    params = YARN_UNEQUAL_MSCALE
    q, k, positions, apply = rope_inputs(8, params)
    _, rotary = hf_rotary(8, params)
    cos, sin = rotary(torch.from_numpy(q), torch.from_numpy(positions))
    want_q, want_k = (t.numpy() for t in hf_v3.apply_rotary_pos_emb_interleave(
        torch.from_numpy(q), torch.from_numpy(k), cos, sin, unsqueeze_dim=2))
    got_q = np.asarray(apply(jnp.asarray(q), jnp.asarray(positions), interleaved=True))
    got_k = np.asarray(apply(jnp.asarray(k), jnp.asarray(positions), interleaved=True))
    de_interleave = np.concatenate([np.arange(0, 8, 2), np.arange(1, 8, 2)])
    np.testing.assert_allclose(got_q[..., de_interleave], want_q, rtol=1e-5, atol=1e-6)
    got_scores = np.einsum("bthd,bshd->bhts", got_q, np.broadcast_to(got_k, got_q.shape))
    want_scores = np.einsum("bthd,bshd->bhts", want_q, np.broadcast_to(want_k, want_q.shape))
    assert relative_error(got_scores, want_scores) < 1e-6
    assert relative_error(got_q, want_q) > 0.1   # the layouts do differ


# ----------------------------------------------------------------------------------------------------------- MLA

def mla_weights(attn, config) -> dict[str, jax.Array]:
    """The specjax layout (mla module doc) of a transformers DeepseekV{2,3}Attention's weights."""
    sd = as_numpy(attn)
    w_uk, w_uv = mla.split_kv_b(sd["kv_b_proj.weight"], config.num_attention_heads, config.qk_nope_head_dim,
                                config.v_head_dim)
    kv_a = sd["kv_a_proj_with_mqa.weight"].T
    weights = {"kv_norm": sd["kv_a_layernorm.weight"], "w_uk": w_uk, "w_uv": w_uv, "wo": sd["o_proj.weight"].T}
    if config.q_lora_rank is None:
        weights.update(wq=sd["q_proj.weight"].T, wkv_a=kv_a)
    else:
        weights.update(wqkv_a=np.concatenate([sd["q_a_proj.weight"].T, kv_a], axis=1),
                       q_norm=sd["q_a_layernorm.weight"], wq_b=sd["q_b_proj.weight"].T)
    return {name: jnp.asarray(w) for name, w in weights.items()}


def latent_width(weights) -> int:
    """A latent cache row's width: wkv_a's, or wqkv_a's columns past q_a's (unpadded: no FP8 blocks here)."""
    return weights["wkv_a"].shape[1] if "wkv_a" in weights else weights["wqkv_a"].shape[1] - weights["q_norm"].shape[0]


def mla_rope_settings(config) -> dict:
    """inv_freq, attention_factor, scale and layout for specjax's MLA as the config's rope asks."""
    params = config.rope_parameters
    max_positions = config.max_position_embeddings
    return {"inv_freq": rope.rope_inv_freq(config.qk_rope_head_dim, params["rope_theta"], params,
                                           max_position_embeddings=max_positions),
            "attention_factor": rope.rope_attention_factor(params, max_position_embeddings=max_positions),
            "scale": rope.yarn_softmax_scale(config.qk_nope_head_dim + config.qk_rope_head_dim, params),
            "interleaved": getattr(config, "rope_interleave", True)}   # V2 is always interleaved


def mla_step(x, weights, cache, layer, start, inv_freq, attention_factor, scale, *, interleaved, absorbed):
    """mla.mla_attention with the rope settings as arguments (jitted below: one compile serves every variant of
    the same shapes and softmax scale, a static float as the attention kernel takes it)."""
    rotate = functools.partial(rope.apply_rope, inv_freq=inv_freq, interleaved=interleaved,
                               attention_factor=attention_factor)
    return mla.mla_attention(x, weights, cache, layer, start, rotate=rotate, rope_interleaved=interleaved,
                             scale=scale, absorbed=absorbed)


jitted_mla_step = jax.jit(mla_step, static_argnames=("scale", "interleaved", "absorbed"))


def hf_attention_rows(model, hidden: np.ndarray, lengths) -> list[np.ndarray]:
    """transformers' attention (the last layer's) over each row's first lengths[b] tokens, causal from 0."""
    attn = model.model.layers[-1].self_attn
    outs = []
    with torch.no_grad():
        for row, n in enumerate(lengths):
            h = torch.from_numpy(hidden[row:row + 1, :n])
            embeddings = model.model.rotary_emb(h, torch.arange(n)[None])
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            outs.append(attn(hidden_states=h, attention_mask=mask, position_embeddings=embeddings)[0][0].numpy())
    return outs


PREFIX = np.array([5, 2, 9])      # rows at different offsets
VERIFY = 4                         # a verify step of k + 1 = 4 query tokens
CACHE_SLOTS = 16


@functools.cache
def mla_case(variant: str):
    """(weights, rope settings, hidden [B, 14, hidden], reference outputs per row) for prefix + 1 + 4 tokens."""
    model = tiny(variant)
    config = model.config
    lengths = PREFIX + 1 + VERIFY
    hidden = np.random.default_rng(1).standard_normal((3, lengths.max(), config.hidden_size)).astype(np.float32)
    return (mla_weights(model.model.layers[-1].self_attn, config), mla_rope_settings(config), hidden,
            hf_attention_rows(model, hidden, lengths))


def run_mla_steps(variant: str, prefill_absorbed: bool, step_absorbed: bool):
    """Prefill (rows right-padded with noise to the longest prefix, into a NaN-filled cache), a decode step
    (T=1) and a verify step (T=4) at each row's own offset. Returns [(got, want)] per step and row."""
    weights, settings, hidden, want = mla_case(variant)
    cache = jnp.full((1, 3, CACHE_SLOTS, latent_width(weights)), jnp.nan, jnp.float32)
    noise = np.random.default_rng(2).standard_normal(hidden.shape).astype(np.float32)
    padded = np.where(np.arange(hidden.shape[1])[None, :, None] < PREFIX[:, None, None], hidden, noise)
    steps = [(padded[:, :PREFIX.max()], np.zeros(3, np.int32), prefill_absorbed, [slice(0, n) for n in PREFIX]),
             (np.stack([hidden[b, p:p + 1] for b, p in enumerate(PREFIX)]), PREFIX, step_absorbed,
              [slice(p, p + 1) for p in PREFIX]),
             (np.stack([hidden[b, p + 1:p + 1 + VERIFY] for b, p in enumerate(PREFIX)]), PREFIX + 1, step_absorbed,
              [slice(p + 1, p + 1 + VERIFY) for p in PREFIX])]
    pairs = []
    for x, start, absorbed, rows in steps:
        out, cache = jitted_mla_step(jnp.asarray(x), weights, cache, 0, jnp.asarray(start, jnp.int32),
                                     **settings, absorbed=absorbed)
        out = np.asarray(out)
        pairs += [(out[b, :rows[b].stop - rows[b].start], want[b][rows[b]]) for b in range(3)]
    return pairs


@pytest.mark.parametrize("variant", MLA_VARIANTS)
@pytest.mark.parametrize("forms", [(False, False), (True, True), (False, True)],
                         ids=["expanded", "absorbed", "expanded_prefill_absorbed_steps"])
def test_mla_matches_transformers_attention_with_cache(variant, forms):
    for got, want in run_mla_steps(variant, *forms):
        assert np.isfinite(got).all()
        assert relative_error(got, want) < REL_TOL


@pytest.mark.parametrize("absorbed", [False, True], ids=["expanded", "absorbed"])
def test_mla_long_prefill_in_query_chunks(monkeypatch, absorbed):
    """A prefill of 9 tokens in chunks of 4 (padded to 12) equals transformers' attention (the expanded form chunks
    in mla.py, the absorbed one in the attention reference)."""
    monkeypatch.setattr(mla, "QUERY_CHUNK", 4)
    monkeypatch.setattr(attention_reference, "QUERY_CHUNK", 4)
    weights, settings, hidden, want = mla_case("v3")
    cache = jnp.full((2, 1, CACHE_SLOTS, latent_width(weights)), jnp.nan, jnp.float32)
    step = jax.jit(mla_step, static_argnames=("scale", "interleaved", "absorbed"))   # its own trace, under the patch
    args = (jnp.asarray(hidden[2:3, :9]), weights, cache, 1, jnp.zeros(1, jnp.int32))
    assert "scan" in str(jax.make_jaxpr(functools.partial(mla_step, **settings, absorbed=absorbed))(*args))
    out, cache = step(*args, **settings, absorbed=absorbed)
    assert relative_error(out[0], want[2][:9]) < REL_TOL
    assert np.isnan(np.asarray(cache[0])).all()   # the other layer untouched


def test_absorbed_mla_runs_in_bfloat16():
    """bf16 weights (passed as arguments) and activations: within bf16 rounding of transformers' fp32 result.
    (XLA's CPU backend has no bf16 x bf16 -> fp32 kernel for some batched dots, so the weight-absorption einsums
    stay in the activations' dtype.)"""
    weights, settings, hidden, want = mla_case("v3")
    bf16 = {name: w.astype(jnp.bfloat16) for name, w in weights.items()}
    cache = jnp.zeros((1, 3, CACHE_SLOTS, latent_width(weights)), jnp.bfloat16)
    out, _ = jitted_mla_step(jnp.asarray(hidden[:, :9], jnp.bfloat16), bf16, cache, 0, jnp.zeros(3, jnp.int32),
                             **settings, absorbed=True)
    assert out.dtype == jnp.bfloat16
    assert relative_error(out[2].astype(jnp.float32), want[2][:9]) < 3e-2


def test_per_head_matmul_in_the_kernel_equals_the_batched_product_and_a_token_alone():
    """MLA's per-head products through the grouped kernel (interpreted; 16 heads, so that the kernel takes the
    rows) equal XLA's batched einsum, and a token's row comes out the same bits alone as among 6 tokens; past
    head_matmul_max_tokens the einsum runs."""
    heads, width, out = 16, 32, 64
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((2, 3, heads, width)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((heads, width, out)) / np.sqrt(width), jnp.bfloat16)
    kernels = KernelPolicy(interpret=True, head_matmul_max_tokens=6)
    got = mla.per_head_matmul(x, w, kernels)
    assert "pallas_call" in str(jax.make_jaxpr(functools.partial(mla.per_head_matmul, kernels=kernels))(x, w))
    want = jnp.einsum("bthk,hkn->bthn", x.astype(jnp.float32), w.astype(jnp.float32))
    assert relative_error(got, want) < 1e-2
    alone = mla.per_head_matmul(x[1:, 2:], w, kernels)
    np.testing.assert_array_equal(np.asarray(alone[0, 0], np.float32), np.asarray(got[1, 2], np.float32))
    beyond = KernelPolicy(interpret=True, head_matmul_max_tokens=5)
    assert "pallas_call" not in str(jax.make_jaxpr(functools.partial(mla.per_head_matmul, kernels=beyond))(x, w))


@pytest.mark.parametrize("tokens", [1, 3])
def test_absorbed_mla_through_the_attention_kernel_equals_the_expanded_form(tokens):
    """The absorbed form's multi-query attention over the latent cache in the interpreted Pallas kernel (keys read
    in a 32-wide value piece and a 16-wide rope piece) against the expanded form in pure JAX, NaN past each row's
    last written slot."""
    H, R, rope_dim, nope, v, S = 4, 32, 16, 16, 24, 40
    rng = np.random.default_rng(11)
    start = np.array([0, 21], np.int32)
    cache = rng.standard_normal((2, 2, S, R + rope_dim)).astype(np.float32)
    for b, first in enumerate(start):
        cache[:, b, first + tokens:] = np.nan
    q_nope, q_rope = (jnp.asarray(rng.standard_normal((2, tokens, H, d)), jnp.float32) for d in (nope, rope_dim))
    w_uk = jnp.asarray(rng.standard_normal((H, nope, R)) / np.sqrt(R), jnp.float32)
    w_uv = jnp.asarray(rng.standard_normal((H, R, v)) / np.sqrt(R), jnp.float32)
    args = (q_nope, q_rope, jnp.asarray(cache), 1, jnp.asarray(start), w_uk, w_uv)
    with jax.default_matmul_precision("highest"):
        got = mla.absorbed_attention(*args, scale=0.3, kernels=KernelPolicy(impl="triton", interpret=True))
        want = mla.expanded_attention(*args, scale=0.3)
    assert "pallas_call" in str(jax.make_jaxpr(functools.partial(
        mla.absorbed_attention, scale=0.3, kernels=KernelPolicy(impl="triton", interpret=True)))(*args))
    assert np.isfinite(np.asarray(got)).all()
    assert relative_error(got, want) < 1e-5


@pytest.mark.parametrize("starts", [(0, 3, 6), (3,), (7,)])
def test_write_latent_places_rows_at_each_start(starts):
    """Rows land at each row's start in the given layer (one row: a dynamic_update_slice), a window past the end
    clamped back so that it fits, as the scatter clamps."""
    batch = len(starts)
    cache = jnp.full((2, batch, 8, 5), jnp.nan, jnp.float32)
    rows = jnp.arange(batch * 2 * 5, dtype=jnp.float32).reshape(batch, 2, 5)
    got = np.asarray(jax.jit(mla.write_latent)(cache, jnp.int32(1), rows, jnp.asarray(starts, jnp.int32)))
    want = np.full((2, batch, 8, 5), np.nan, np.float32)
    for b, s in enumerate(starts):
        s = min(s, 8 - 2)
        want[1, b, s:s + 2] = rows[b]
    np.testing.assert_array_equal(got, want)


def test_split_kv_b_is_head_major_with_keys_first():
    heads, nope, v, rank = 3, 2, 4, 5
    kv_b = np.arange(heads * (nope + v) * rank, dtype=np.float32).reshape(heads * (nope + v), rank)
    w_uk, w_uv = mla.split_kv_b(kv_b, heads, nope, v)
    assert w_uk.shape == (heads, nope, rank) and w_uv.shape == (heads, rank, v)
    np.testing.assert_array_equal(w_uk[1, 0], kv_b[(nope + v) * 1 + 0])
    np.testing.assert_array_equal(w_uv[2, :, 3], kv_b[(nope + v) * 2 + nope + 3])


# ----------------------------------------------------------------------------------------------------------- MoE

def routing_of(config) -> moe.Routing:
    if is_v3(config):   # transformers' V3 router: sigmoid and top-2-sum groups whatever the config names
        return moe.Routing(config.num_experts_per_tok, "sigmoid", "noaux_tc", config.n_group, config.topk_group,
                           config.norm_topk_prob, config.routed_scaling_factor)
    return moe.Routing(config.num_experts_per_tok, "softmax", config.topk_method, config.n_group or 1,
                       config.topk_group or 1, False, config.routed_scaling_factor)   # transformers' V2: no norm


def moe_weights(block, config) -> dict[str, jax.Array]:
    """The specjax layout (moe module doc) of a transformers DeepseekV{2,3} MoE block's weights."""
    sd = as_numpy(block)
    inter = config.moe_intermediate_size
    gate_up = sd["experts.gate_up_proj"]                                 # [E, 2I, H], gate rows first
    weights = {"w_router": sd["gate.weight"].T, "we_gate": gate_up[:, :inter].transpose(0, 2, 1),
               "we_up": gate_up[:, inter:].transpose(0, 2, 1), "we_down": sd["experts.down_proj"].transpose(0, 2, 1),
               "ws_gate": sd["shared_experts.gate_proj.weight"].T, "ws_up": sd["shared_experts.up_proj.weight"].T,
               "ws_down": sd["shared_experts.down_proj.weight"].T}
    if "gate.e_score_correction_bias" in sd:
        weights["router_bias"] = sd["gate.e_score_correction_bias"]
    return {name: jnp.asarray(w) for name, w in weights.items()}


def moe_block(variant: str):
    model = tiny(variant)
    return model.model.layers[model.config.first_k_dense_replace].mlp, model.config


def by_expert(ids: np.ndarray, weights: np.ndarray):
    """Each token's (ids, weights) sorted by id (torch.topk(sorted=False) fixes no order)."""
    order = np.argsort(ids, axis=-1)
    return np.take_along_axis(ids, order, -1), np.take_along_axis(weights, order, -1)


@pytest.mark.parametrize("variant", ROUTER_VARIANTS)
def test_routing_matches_transformers_router(variant):
    block, config = moe_block(variant)
    x = np.random.default_rng(3).standard_normal((256, config.hidden_size)).astype(np.float32)
    with torch.no_grad():
        _, want_weights, want_ids = block.gate(torch.from_numpy(x))
    weights = moe_weights(block, config)
    routing = routing_of(config)
    ids, got_weights = moe.route(jnp.asarray(x), weights["w_router"], weights.get("router_bias"), routing)
    got_ids, got_weights = by_expert(np.asarray(ids), np.asarray(got_weights))
    want_ids, want_weights = by_expert(want_ids.numpy(), want_weights.numpy())
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_allclose(got_weights, want_weights, rtol=1e-5, atol=0)
    # The fixture exercises what it claims: the bias and the group limit each change some selections.
    if "router_bias" in weights:
        unbiased, _ = moe.route(jnp.asarray(x), weights["w_router"], None, routing)
        assert (np.sort(np.asarray(unbiased), -1) != got_ids).any(axis=-1).mean() > 0.05
    if routing.n_group > routing.topk_group:
        ungrouped, _ = moe.route(jnp.asarray(x), weights["w_router"], weights.get("router_bias"),
                                 moe.Routing(routing.num_experts_per_tok, routing.scoring, "greedy"))
        assert (np.sort(np.asarray(ungrouped), -1) != got_ids).any(axis=-1).mean() > 0.05


def top_groups_oracle(choice: np.ndarray, routing: moe.Routing) -> np.ndarray:
    """numpy: each token's group scores (sum of the two best, or the best), the topk_group best groups by a
    stable sort (ties to the lower index, as lax.top_k), the experts of the others set to -inf."""
    grouped = choice.reshape(choice.shape[0], routing.n_group, -1)
    ordered = -np.sort(-grouped, axis=-1)
    scores = ordered[..., :2].sum(-1) if routing.topk_method == "noaux_tc" else ordered[..., 0]
    out = np.full_like(grouped, -np.inf)
    for token, row in enumerate(scores):
        for group in np.argsort(-row, kind="stable")[:routing.topk_group]:
            out[token, group] = grouped[token, group]
    return out.reshape(choice.shape)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2 ** 31 - 1), st.sampled_from([(1, 4), (2, 3), (4, 2), (8, 4)]), st.integers(1, 8),
       st.sampled_from(["noaux_tc", "group_limited_greedy"]))
def test_the_group_limit_ranks_groups_as_top_k_ties_included(seed, groups, topk_group, method):
    """_within_top_groups against a sort-based oracle on scores drawn from a few values, so that experts and
    groups tie: the same groups kept, the same values, bit for bit."""
    n_group, per_group = groups
    routing = moe.Routing(2, "sigmoid", method, n_group, min(topk_group, n_group))
    choice = np.random.default_rng(seed).choice(np.float32([0.125, 0.25, 0.5, 0.75]), (16, n_group * per_group))
    got = np.asarray(within_top_groups(jnp.asarray(choice), routing))
    np.testing.assert_array_equal(got, top_groups_oracle(choice, routing))


@functools.partial(jax.jit, static_argnames=("routing", "policies"))
def moe_in_forms(x, weights, routing, policies):
    """moe.moe under each kernel policy of `policies`, in one compiled program."""
    return [moe.moe(x, weights, routing, kernels=policy) for policy in policies]


def forms(*names, kernel=False):
    """Kernel policies for these expert forms (the grouped one through the interpreted Pallas kernel too, at any
    number of slots)."""
    kernels = (KernelPolicy(moe_form="grouped", interpret=True, grouped_matmul_min_plain_rows=1),) if kernel else ()
    return tuple(KernelPolicy(moe_form=name) for name in names) + kernels


@pytest.mark.parametrize("variant", MOE_VARIANTS)
def test_moe_block_matches_transformers_in_every_form(variant):
    """Prefill-sized input (14 tokens, more slots than experts) in each explicit form and through the grouped
    kernel; decode-sized (1 token) in the auto form, which gathers there."""
    block, config = moe_block(variant)
    weights, routing = moe_weights(block, config), routing_of(config)
    rng = np.random.default_rng(4)
    for shape, policies in [((2, 7, config.hidden_size), forms("dense", "grouped", "gathered", kernel=True)),
                            ((1, 1, config.hidden_size), forms("auto"))]:
        x = rng.standard_normal(shape).astype(np.float32)
        with torch.no_grad():
            want = block(torch.from_numpy(x)).numpy()
        for policy, got in zip(policies, moe_in_forms(jnp.asarray(x), weights, routing, policies)):
            assert got.shape == want.shape
            assert relative_error(got, want) < REL_TOL, policy


def consumers(jaxpr, var) -> list:
    return [eqn for eqn in jaxpr.eqns if any(v is var for v in eqn.invars)]


def test_gathered_experts_read_only_the_selected_slices():
    """At decode (one token, k of E experts) the auto form is the gathered one, and the expert weights feed
    nothing but gathers of single-expert slices [N, k, ...]; the dense form, for contrast, contracts them whole."""
    block, config = moe_block("v3")
    weights = moe_weights(block, config)
    x = jnp.ones((1, config.hidden_size), jnp.float32)
    ids, routing_weights = moe.route(x, weights["w_router"], weights["router_bias"], routing_of(config))
    k = ids.shape[1]

    experts = {name: weights[name] for name in ("we_gate", "we_up", "we_down")}

    def weight_consumers(form):
        closed = jax.make_jaxpr(lambda x, ids, w, experts: moe.routed_experts(x, ids, w, experts, form=form))(
            x, ids, routing_weights, experts)
        return [eqn for var in closed.jaxpr.invars[3:] for eqn in consumers(closed.jaxpr, var)]

    for eqn in weight_consumers("auto"):
        assert eqn.primitive.name == "gather"
        assert eqn.params["slice_sizes"][0] == 1
        assert eqn.outvars[0].aval.shape[:2] == (1, k)
    assert {eqn.primitive.name for eqn in weight_consumers("dense")} == {"dot_general"}


# ----------------------------------------------------------------------------------------------------------- FP8

FP8_SHAPES = [((300, 200), (128, 128)), ((48, 72), (16, 16))]   # edge blocks in both dims; whole rows, edge cols


def random_weight(shape, seed=5) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(shape) * np.exp(rng.uniform(-3, 3, size=(shape[0], 1)))).astype(np.float32)
    w[:min(16, shape[0]), :min(16, shape[1])] = 0.0   # an all-zero block (scale 1) where blocks are 16 wide
    return w


@pytest.mark.parametrize("shape,block", FP8_SHAPES)
def test_quantize_and_dequantize_blocks_match_numpy(shape, block):
    """Dequantization is exact against numpy. Quantization agrees with numpy's to within XLA's division, which
    multiplies by a rounded reciprocal: the scales may differ by an ulp and, rarely, a code by one e4m3 step."""
    w = random_weight(shape)
    want_q, want_scale = quantize_blocks_numpy(w, block)
    got_q, got_scale = fp8.quantize_blocks(jnp.asarray(w), block)
    assert got_q.dtype == jnp.float8_e4m3fn
    assert got_scale.shape == (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    np.testing.assert_allclose(got_scale, want_scale, rtol=2.0 ** -22, atol=0)
    assert (np.asarray(got_q).view(np.uint8) != want_q.view(np.uint8)).mean() < 1e-3
    deq = np.asarray(fp8.dequantize_blocks(jnp.asarray(want_q), jnp.asarray(want_scale), block))
    np.testing.assert_array_equal(deq, dequantize_blocks_numpy(want_q, want_scale, block))
    # e4m3 keeps 3 mantissa bits: within 2^-4 relative, plus half the smallest subnormal (2^-10) of the block scale
    got_deq = np.asarray(fp8.dequantize_blocks(got_q, got_scale, block))
    per_element = np.repeat(np.repeat(got_scale, block[0], 0), block[1], 1)[:shape[0], :shape[1]]
    assert (np.abs(got_deq - w) <= 2.0 ** -4 * np.abs(w) + 2.0 ** -10 * per_element).all()


@pytest.mark.parametrize("shape,block", FP8_SHAPES)
@pytest.mark.parametrize("tokens", [(3,), (2, 80)], ids=["blockwise", "dequantized"])
def test_fp8_matmul_matches_numpy(shape, block, tokens):
    """x [..., in] @ W for the HF matrix [out, in] and its scale grid, both transposed to specjax's [in, out]."""
    hf_weight = random_weight(shape)
    q, scale_inv = quantize_blocks_numpy(hf_weight, block)
    x = np.random.default_rng(6).standard_normal((*tokens, shape[1])).astype(np.float32)
    want = x.astype(np.float64) @ dequantize_blocks_numpy(q, scale_inv, block).T.astype(np.float64)
    got = fp8.fp8_matmul(jnp.asarray(x), jnp.asarray(q.T), jnp.asarray(scale_inv.T), block[::-1])
    assert got.shape == (*tokens, shape[0]) and got.dtype == jnp.float32
    assert relative_error(got, want) < 1e-6


@pytest.mark.parametrize("tokens", [(1,), (2, 5)])
def test_fp8_linear_through_the_kernel_matches_fp8_matmul(tokens):
    """Decode- and verify-sized FP8 projections under a kernel policy (the interpreted grouped matmul, one
    group) equal fp8_matmul's blockwise products; from a block's rows of tokens on, fp8_matmul itself runs."""
    block = (128, 128)
    q, scale_inv = quantize_blocks_numpy(random_weight((200, 300)), block)
    weights = {"w": jnp.asarray(q.T), "w_scale": jnp.asarray(scale_inv.T)}
    x = jnp.asarray(np.random.default_rng(8).standard_normal((*tokens, 300)), jnp.float32)
    with jax.default_matmul_precision("highest"):
        want = fp8.fp8_matmul(x, weights["w"], weights["w_scale"], block)
    got = fp8.linear(x, weights, "w", block, KernelPolicy(interpret=True))
    assert got.shape == want.shape
    assert relative_error(got, np.asarray(want, np.float64)) < 1e-6
    assert linear_kernel_calls(weights, block, x.size // 300) == 1 and linear_kernel_calls(weights, block, block[0]) == 0


@pytest.mark.parametrize("programs, splits", [(None, 4), (1, 1), (4, 2)])
@pytest.mark.parametrize("rows", [1, 5])
def test_the_policy_sets_the_programs_an_fp8_projections_k_split_aims_for(programs, splits, rows):
    """KernelPolicy.projection_programs: K's 4 chunks split for that many programs over the matrix's 2 column
    blocks (the default aims at about four per SM: 4 splits), the same split at any row count, and the product
    still fp8_matmul's."""
    block = (128, 128)
    q, scale_inv = quantize_blocks_numpy(random_weight((256, 512)), block)
    weights = {"w": jnp.asarray(q.T), "w_scale": jnp.asarray(scale_inv.T)}
    x = jnp.asarray(np.random.default_rng(10).standard_normal((rows, 512)), jnp.float32)
    policy = KernelPolicy(interpret=True, projection_programs=programs)
    with jax.default_matmul_precision("highest"):
        want = fp8.fp8_matmul(x, weights["w"], weights["w_scale"], block)
    got = fp8.linear(x, weights, "w", block, policy)
    assert relative_error(got, np.asarray(want, np.float64)) < 1e-6
    jaxpr = jax.make_jaxpr(lambda x: fp8.linear(x, weights, "w", block, policy))(x).jaxpr
    assert [shape[0] for shape in pallas_output_shapes(jaxpr)] == [splits]


def test_a_programs_target_must_be_positive():
    with pytest.raises(ValueError, match="projection_programs"):
        KernelPolicy(projection_programs=0)


def pallas_output_shapes(jaxpr) -> list[tuple[int, ...]]:
    """The output shapes of the Pallas calls in a jaxpr, nested jaxprs included."""
    shapes = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            shapes += [tuple(var.aval.shape) for var in eqn.outvars]
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)
            if hasattr(inner, "eqns"):
                shapes += pallas_output_shapes(inner)
    return shapes


def linear_kernel_calls(weights, block, rows: int) -> int:
    """Pallas calls in fp8.linear's program for `rows` rows of 300 features under an interpreting kernel policy."""
    linear = jax.make_jaxpr(lambda x: fp8.linear(x, weights, "w", block, KernelPolicy(interpret=True)))
    return str(linear(jnp.zeros((rows, 300)))).count("pallas_call")


def test_plain_linear_at_decode_sizes_runs_the_kernel_as_one_group():
    """A bf16 / fp32 projection of a few rows under a kernel policy is the interpreted grouped matmul's, equal to
    x @ w; past the policy's dense_kernel_max_plain_rows it is XLA's matmul."""
    weights = {"w": jnp.asarray(random_weight((200, 300)).T)}
    x = jnp.asarray(np.random.default_rng(9).standard_normal((2, 3, 300)), jnp.float32)
    with jax.default_matmul_precision("highest"):
        want = x @ weights["w"]
        got = fp8.linear(x, weights, "w", None, KernelPolicy(interpret=True))
    assert got.shape == want.shape
    assert relative_error(got, np.asarray(want, np.float64)) < 1e-6
    limit = KernelPolicy().dense_kernel_max_plain_rows
    assert linear_kernel_calls(weights, None, limit) == 1 and linear_kernel_calls(weights, None, limit + 1) == 0


def test_fp8_experts_are_gathered_as_bytes_never_widened_whole():
    """XLA's CPU backend widens a float8 gather's whole operand to float16 before gathering: the taken slices must
    be gathered first, then dequantized."""
    E, R, C, block = 16, 256, 128, (128, 128)
    rng = np.random.default_rng(0)
    stack = jnp.asarray(rng.standard_normal((E, R, C)), jnp.float8_e4m3fn)
    scale = jnp.asarray(rng.uniform(0.5, 2.0, (E, R // 128, C // 128)), jnp.float32)
    ids = jnp.asarray([[3, 9]], jnp.int32)
    take = jax.jit(lambda w, s, i: fp8.dequantize_stack({"w": w, "w_scale": s}, "w", block, jnp.float32, i))
    hlo = take.lower(stack, scale, ids).compile().as_text()
    assert not re.findall(rf"\b(?:f16|bf16|f32)\[{E},{R},{C}\]", hlo), "the whole stack is widened"
    want = [np.asarray(fp8.dequantize_blocks(stack[e], scale[e], block)) for e in (3, 9)]
    np.testing.assert_array_equal(np.asarray(take(stack, scale, ids))[0], np.stack(want))


def fp8_experts(rng, E: int, H: int, I: int, block: tuple[int, int]) -> dict:
    """A stack of E random SwiGLU experts (hidden H, intermediate I) quantized to FP8 blocks, with their scales."""
    experts = {}
    for name, shape in (("we_gate", (H, I)), ("we_up", (H, I)), ("we_down", (I, H))):
        quantized = [fp8.quantize_blocks(jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[0]), jnp.float32),
                                         block) for _ in range(E)]
        experts[name] = jnp.stack([q for q, _ in quantized])
        experts[name + "_scale"] = jnp.stack([s for _, s in quantized])
    return experts


def test_fp8_experts_through_the_grouped_kernel_match_the_dequantized_gathered_form():
    """Routed FP8 experts in the auto form under a kernel policy (the interpreted Pallas kernel, FP8 codes read as
    stored) against the gathered form over dequantized slices, at decode (one token: slots in their own order)
    and at verify sizes (sorted by expert)."""
    E, H, I, block = 8, 256, 128, (128, 128)
    rng = np.random.default_rng(7)
    experts = fp8_experts(rng, E, H, I, block)
    for tokens in (1, 5):
        x = jnp.asarray(rng.standard_normal((tokens, H)), jnp.float32)
        ids = jnp.asarray(np.stack([rng.permutation(E)[:3] for _ in range(tokens)]), jnp.int32)
        weights = jnp.asarray(rng.uniform(0.1, 1.0, (tokens, 3)), jnp.float32)
        with jax.default_matmul_precision("highest"):
            want = moe.routed_experts(x, ids, weights, experts, form="gathered", block=block)
        got = moe.routed_experts(x, ids, weights, experts, block=block, kernels=KernelPolicy(interpret=True))
        assert relative_error(got, np.asarray(want, np.float64)) < 1e-6


@pytest.mark.parametrize("slots, compared", [(40, True), (40, False), (1, True)])
def test_the_slots_sort_plan_is_a_stable_sort_by_expert(monkeypatch, slots, compared):
    """The slots' sorted order and each slot's place in it (ties kept in slot order), by pairwise compares up to
    the bound and by sorting past it: a stable argsort and its inverse."""
    monkeypatch.setattr(moe, "_COMPARE_SORT_MAX_SLOTS", 4096 if compared else slots - 1)
    ids = jnp.asarray(np.random.default_rng(3).integers(0, 6, slots), jnp.int32)   # many ties
    order, rank = jax.jit(moe._sort_plan)(ids)
    want = np.argsort(np.asarray(ids), kind="stable")
    np.testing.assert_array_equal(order, want)
    np.testing.assert_array_equal(rank, np.argsort(want))


def fp8_shared_expert(rng, H: int, I: int, block: tuple[int, int]) -> dict:
    """One random FP8 SwiGLU shared expert (ws_gate, ws_up, ws_down and their scales) of intermediate size I."""
    return {name.replace("we_", "ws_"): leaf[0] for name, leaf in fp8_experts(rng, 1, H, I, block).items()}


@pytest.mark.parametrize("shared", [False, True])
def test_a_tokens_experts_alone_equal_its_row_among_other_tokens(shared):
    """One token's slots go to the grouped kernel in their own order, several tokens' sorted by expert; a token's
    routed output (with a shared expert of one expert's shape: joined to the routed launches) is the same bits
    either way (a decode step and a verify pass agree: exact greedy speculation), bf16 rows meeting the FP8
    stacks as float16."""
    E, H, I, block = 8, 256, 128, (128, 128)
    rng = np.random.default_rng(9)
    experts = fp8_experts(rng, E, H, I, block)
    weights_shared = fp8_shared_expert(rng, H, I, block) if shared else None
    x = jnp.asarray(rng.standard_normal((4, H)), jnp.bfloat16)
    ids = jnp.asarray(np.stack([rng.permutation(E)[:3] for _ in range(4)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (4, 3)), jnp.float32)
    run = jax.jit(lambda x, ids, weights: moe.routed_experts(x, ids, weights, experts, block=block,
                                                             kernels=KernelPolicy(interpret=True),
                                                             shared=weights_shared))
    together = np.asarray(run(x, ids, weights), np.float32)
    assert "stablehlo.sort" not in run.lower(x[:1], ids[:1], weights[:1]).as_text()   # slots in their own order
    for token in range(4):
        alone = run(x[token:token + 1], ids[token:token + 1], weights[token:token + 1])
        np.testing.assert_array_equal(np.asarray(alone, np.float32)[0], together[token])


def grouped_launches(fn, *args) -> int:
    """The grouped matmul kernel's pallas_calls in fn's jaxpr, nested jaxprs included."""
    def count(jaxpr) -> int:
        own = sum(eqn.primitive.name == "pallas_call" and eqn.params["name"] == "specjax_grouped_matmul"
                  for eqn in jaxpr.eqns)
        return own + sum(count(sub) for sub in jax.extend.core.subjaxprs(jaxpr))
    return count(jax.make_jaxpr(fn)(*args).jaxpr)


@pytest.mark.parametrize("tokens", [1, 5])
def test_a_shared_expert_of_one_experts_shape_joins_the_routed_launches(tokens):
    """FP8 routed experts and a shared expert of one expert's shape under a kernel policy: three grouped matmul
    launches in all at one token (gate, up, down; six with the shared expert apart), two at five (gate and up
    together for sorted slots; five with the shared MLP apart), and the routed experts' gathered form
    plus the shared MLP over dequantized weights, to float32 rounding, at decode (slots in their own order) and
    at verify sizes (sorted by expert)."""
    E, H, I, block = 8, 256, 128, (128, 128)
    rng = np.random.default_rng(11)
    experts, shared = fp8_experts(rng, E, H, I, block), fp8_shared_expert(rng, H, I, block)
    x = jnp.asarray(rng.standard_normal((tokens, H)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.permutation(E)[:3] for _ in range(tokens)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (tokens, 3)), jnp.float32)
    kernels = KernelPolicy(interpret=True)
    with jax.default_matmul_precision("highest"):
        want = (moe.routed_experts(x, ids, weights, experts, form="gathered", block=block)
                + moe.swiglu_mlp(x, shared, "ws_", block))
    got = moe.routed_experts(x, ids, weights, experts, block=block, kernels=kernels, shared=shared)
    assert relative_error(got, np.asarray(want, np.float64)) < 1e-6
    wider = fp8_shared_expert(rng, H, 2 * I, block)   # two experts' width: its own MLP
    counts = [grouped_launches(lambda x, s=s: moe.routed_experts(x, ids, weights, experts, block=block,
                                                                 kernels=kernels, shared=s), x)
              for s in (shared, wider)]
    assert counts == ([3, 6] if tokens == 1 else [2, 5])
    # A prefill's many tokens keep the shared expert's own GEMM (it reads each matrix once, the kernel per 16 rows).
    assert [moe.joins_shared(experts, shared, n, 3, block, kernels) for n in (block[0] - 1, block[0])] == [True, False]


@pytest.mark.parametrize("tokens", [1, 5])
def test_the_moe_blocks_norm_gives_the_router_and_the_experts_the_same_rows(tokens):
    """moe(h, norm=...) on bf16 rows against FP8 experts (a shared one joined, chosen by the routing launch as one
    more expert): under a kernel policy the router and the experts read the rows one f16_rows launch normalised
    (moe on those rows, normalised already, gives the same bits; XLA's rms_norm launches nothing here), off the
    kernels moe(rms_norm(h))."""
    E, H, I, block = 8, 256, 128, (128, 128)
    rng = np.random.default_rng(12)
    weights = {**fp8_experts(rng, E, H, I, block), **fp8_shared_expert(rng, H, I, block),
               "w_router": jnp.asarray(rng.standard_normal((H, E)), jnp.float32)}
    routing = moe.Routing(3, "softmax", "greedy")
    h = jnp.asarray(rng.standard_normal((tokens, H)), jnp.bfloat16)
    norm = (jnp.asarray(rng.uniform(0.5, 2.0, H), jnp.bfloat16), 1e-6)
    kernels = KernelPolicy(interpret=True)
    block_moe = jax.jit(lambda h, normalise, kernels: moe.moe(h, weights, routing, kernels=kernels, block=block,
                                                              norm=norm if normalise else None), static_argnums=(1, 2))
    normalised = f16_rows(h, interpret=True, norm=norm, keep_normalised=True)[2]
    np.testing.assert_array_equal(np.asarray(block_moe(h, True, kernels), np.float32),
                                  np.asarray(block_moe(normalised, False, kernels), np.float32))
    program = jax.make_jaxpr(lambda h: moe.moe(h, weights, routing, kernels=kernels, block=block, norm=norm))(h)
    # the norm only inside f16_rows; the shared expert's id and weight written by the routing launch
    assert {"rsqrt", "concatenate"}.isdisjoint(primitives_outside_kernels(program.jaxpr))
    reference = KernelPolicy(impl="reference")
    # (to bf16 rounding: XLA may keep a fused norm's rows wider than bf16)
    want = np.asarray(block_moe(rms_norm(h, *norm), False, reference), np.float64)
    assert relative_error(block_moe(h, True, reference), want) < 2e-2


def primitives_outside_kernels(jaxpr) -> set[str]:
    """The primitives of a jaxpr and its nested jaxprs, but not those inside Pallas calls."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        if eqn.primitive.name == "pallas_call":
            continue
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)
            if hasattr(inner, "eqns"):
                names |= primitives_outside_kernels(inner)
    return names


def test_random_weights_larger_than_a_slice_are_drawn_in_slices(monkeypatch):
    """Benchmarks' random weights: a leaf over SLICE_VALUES values is drawn a few slices at a time, so its program
    holds no float32 copy of the whole leaf (DeepSeek-V3's FP8 expert stacks: 42 GiB on the H200); each slice is
    its own draw, scaled as asked; a small leaf is the plain draw."""
    monkeypatch.setattr(random_init, "SLICE_VALUES", 1 << 12)
    shape, key = (3, 16, 64, 32), jax.random.key(5)              # 96K values, 32 rows of 2**11 per slice batch
    program = jax.jit(random_init.normal, static_argnums=(1, 2, 3)).lower(key, shape, jnp.float8_e4m3fn, 1.0)
    temp = program.compile().memory_analysis().temp_size_in_bytes
    assert temp < np.prod(shape), temp                          # a quarter of the leaf in float32
    big = np.asarray(random_init.normal(key, shape, jnp.float8_e4m3fn, 1.0)).astype(np.float32)
    assert big.shape == shape and abs(big.std() - 1.0) < 0.05 and abs(big.mean()) < 0.05
    assert len({row.tobytes() for row in big.reshape(-1, 64 * 32)}) == 3 * 16
    small = random_init.normal(key, (8, 4), jnp.float32)
    np.testing.assert_array_equal(np.asarray(small), np.asarray(0.02 * jax.random.normal(key, (8, 4), jnp.float32)))


def test_fp8_copy_of_a_checkpoint(tmp_path):
    """write_fp8_copy quantizes exactly DeepSeek's linears (128 x 128 blocks with edge blocks), keeps every other
    tensor bit for bit, and records the quantization_config."""
    from safetensors.torch import load_file

    src = save_tiny_deepseek("v3_wide", tmp_path / "bf")
    out = write_fp8_copy(src, tmp_path / "fp8")
    original, copied = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    quantized = sorted(name for name in original if FP8_QUANTIZED.fullmatch(name))
    assert len(quantized) == 8 + 5 + 8 * 3 + 3      # dense layer 0; attention, 8 experts and shared of layer 1
    assert set(copied) == set(original) | {name + "_scale_inv" for name in quantized}
    edge_blocks = 0
    for name, tensor in original.items():
        if name not in quantized:
            assert torch.equal(copied[name], tensor), name
            continue
        assert copied[name].dtype == torch.float8_e4m3fn
        rows, cols = tensor.shape
        scale_inv = copied[name + "_scale_inv"].numpy()
        assert scale_inv.shape == (-(-rows // 128), -(-cols // 128)) and scale_inv.dtype == np.float32
        edge_blocks += rows % 128 != 0 or cols % 128 != 0
        fp8_bits = copied[name].view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
        deq = np.asarray(fp8.dequantize_blocks(jnp.asarray(fp8_bits), jnp.asarray(scale_inv)))
        assert relative_error(deq, tensor.numpy()) < 2.0 ** -4, name
    assert edge_blocks == len(quantized)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128]}


def test_fp8_name_pattern_on_mtp_and_router_names():
    assert FP8_QUANTIZED.fullmatch("model.layers.61.self_attn.kv_b_proj.weight")
    assert FP8_QUANTIZED.fullmatch("model.layers.61.mlp.experts.255.down_proj.weight")
    assert FP8_QUANTIZED.fullmatch("model.layers.0.mlp.gate_proj.weight")
    for name in ["model.layers.61.eh_proj.weight", "model.layers.61.shared_head.head.weight",
                 "model.layers.61.enorm.weight", "model.layers.3.mlp.gate.weight",
                 "model.layers.3.mlp.gate.e_score_correction_bias", "model.layers.0.self_attn.q_a_layernorm.weight",
                 "lm_head.weight", "model.embed_tokens.weight"]:
        assert not FP8_QUANTIZED.fullmatch(name), name
