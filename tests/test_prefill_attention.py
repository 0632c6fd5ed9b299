"""Prefill attention: when cuDNN's fused attention is chosen, that it computes what the cache path does, and
that the model's prefill (fresh=True) wired through it matches the ordinary forward."""
from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.kernels.attention_reference import attention_reference
from specjax.kernels.policy import KernelPolicy
from specjax.kernels.prefill_attention import causal_self_attention, prefill_path
from specjax.models.llama import FAMILY, LlamaConfig
from specjax.parallel.mesh import traced_with

H100 = types.SimpleNamespace(platform="gpu", compute_capability="9.0")
LONG = KernelPolicy().prefill_fused_min_tokens


@pytest.mark.parametrize("impl, device, q_shape, dtype, expected", [
    ("auto", H100, (1, LONG, 32, 128), jnp.bfloat16, "fused"),
    ("auto", H100, (4, 4 * LONG, 9, 64), jnp.float16, "fused"),
    ("auto", H100, (1, LONG - 1, 32, 128), jnp.bfloat16, "cache"),       # short prompt: our kernel is faster
    ("auto", H100, (1, LONG, 32, 128), jnp.float32, "cache"),            # cuDNN's fused path is half precision
    ("auto", H100, (1, LONG, 32, 100), jnp.bfloat16, "cache"),           # head dim not a multiple of 8
    ("auto", H100, (1, LONG, 32, 256), jnp.bfloat16, "cache"),
    ("auto", types.SimpleNamespace(platform="gpu", compute_capability="7.5"), (1, LONG, 32, 128),
     jnp.bfloat16, "cache"),                                              # T4
    ("auto", types.SimpleNamespace(platform="cpu"), (1, LONG, 32, 128), jnp.bfloat16, "cache"),
    ("triton", H100, (1, LONG, 32, 128), jnp.bfloat16, "cache"),          # a forced impl keeps its meaning
    ("reference", H100, (1, LONG, 32, 128), jnp.bfloat16, "cache"),
])
def test_prefill_path(impl, device, q_shape, dtype, expected):
    assert prefill_path(KernelPolicy(impl=impl, device=device), q_shape, dtype) == expected


def test_tensor_parallel_prefill_stays_on_the_cache_path():
    with traced_with(types.SimpleNamespace(mesh=types.SimpleNamespace(size=2))):
        assert prefill_path(KernelPolicy(device=H100), (1, LONG, 32, 128), jnp.bfloat16) == "cache"


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_self_attention_equals_the_cache_path(heads, kv_heads):
    """Causal self-attention over the fresh K/V equals the reference reading them from the cache at
    start 0 (the cache also holds slots past the prompt, poisoned with NaN: neither may read them)."""
    batch, tokens, slots, head_dim = 2, 37, 50, 16
    keys = jax.random.split(jax.random.key(heads * 10 + kv_heads), 3)
    q = jax.random.normal(keys[0], (batch, tokens, heads, head_dim), jnp.float32)
    k = jax.random.normal(keys[1], (batch, tokens, kv_heads, head_dim), jnp.float32)
    v = jax.random.normal(keys[2], (batch, tokens, kv_heads, head_dim), jnp.float32)
    pad = ((0, 0), (0, 0), (0, slots - tokens), (0, 0))
    k_cache = jnp.pad(k.swapaxes(1, 2), pad, constant_values=jnp.nan)[None]
    v_cache = jnp.pad(v.swapaxes(1, 2), pad, constant_values=jnp.nan)[None]
    scale = head_dim ** -0.5
    with jax.default_matmul_precision("highest"):
        fused = causal_self_attention(q, k, v, scale=scale, implementation="xla")
        cached = attention_reference(q, k_cache, v_cache, 0, jnp.zeros((batch,), jnp.int32), scale=scale)
    np.testing.assert_allclose(np.asarray(fused), np.asarray(cached), rtol=1e-5, atol=1e-5)


def test_model_prefill_through_the_fused_path_matches_the_forward():
    """With the fused path chosen from the first token (XLA standing in for cuDNN, which this host lacks), a
    fresh prefill gives the hidden states and KV cache of the ordinary forward."""
    cfg = LlamaConfig(architecture="LlamaForCausalLM", vocab_size=61, hidden_size=32, intermediate_size=48,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5,
                      rope_theta=10000.0, rope_scaling=None, tie_word_embeddings=True, attention_bias=False,
                      qk_norm=False, max_position_embeddings=64, bos_token_id=1, eos_token_ids=(2,),
                      torch_dtype="float32")
    fused_policy = KernelPolicy(prefill_fused_impl="xla", prefill_fused_min_tokens=1)
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, cfg.vocab_size)
    start = jnp.zeros((2,), jnp.int32)

    def forward(kernels, fresh):
        model = FAMILY.random(cfg, seed=3, kernels=kernels)
        program = jax.make_jaxpr(lambda t, s, c: model(t, s, c, fresh=fresh))(tokens, start, model.init_cache(2, 16))
        return str(program), model(tokens, start, model.init_cache(2, 16), fresh=fresh)

    with jax.default_matmul_precision("highest"):
        _, (hidden, cache, _) = forward(KernelPolicy(), fresh=False)
        cache_path, _ = forward(KernelPolicy(), fresh=True)
        fused_path, (fused_hidden, fused_cache, _) = forward(fused_policy, fresh=True)
    assert prefill_path(fused_policy, (2, 9, 4, 8), jnp.float32) == "fused"
    assert fused_path != cache_path, "the fresh prefill did not follow the policy to the fused attention"
    np.testing.assert_allclose(np.asarray(fused_hidden), np.asarray(hidden), rtol=1e-5, atol=1e-5)
    for fused, plain in ((fused_cache.k, cache.k), (fused_cache.v, cache.v)):
        np.testing.assert_array_equal(np.asarray(fused[0]), np.asarray(plain[0]))   # before any attention
        np.testing.assert_allclose(np.asarray(fused), np.asarray(plain), rtol=1e-5, atol=1e-6)
