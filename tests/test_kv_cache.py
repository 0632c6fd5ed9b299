"""KV-cache writes: each row's new K/V lands at its own slots, nothing else changes, and the program does not
grow with the batch (one dynamic_update_slice per row made large batches compile and run slowly)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.kernels.policy import KernelPolicy
from specjax.models.kv_cache import write_layer
from specjax.models.llama import FAMILY
from tests.test_engine_loop import CFG


def test_each_row_writes_its_own_slots_of_one_layer():
    rng = np.random.default_rng(0)
    L, B, Hkv, S, D, T = 3, 5, 2, 16, 4, 3
    cache = rng.normal(size=(L, B, Hkv, S, D)).astype(np.float32)
    new = rng.normal(size=(B, T, Hkv, D)).astype(np.float32)
    start = np.array([0, 7, 13, 2, 9], np.int32)
    out = np.asarray(jax.jit(write_layer)(jnp.asarray(cache), jnp.int32(1), jnp.asarray(new), jnp.asarray(start)))
    expected = cache.copy()
    for b in range(B):
        expected[1, b, :, start[b]:start[b] + T] = new[b].transpose(1, 0, 2)
    np.testing.assert_array_equal(out, expected)


def test_a_window_past_the_end_is_clamped_like_dynamic_update_slice():
    cache = jnp.zeros((1, 1, 1, 8, 2))
    new = jnp.ones((1, 3, 1, 2))
    out = write_layer(cache, jnp.int32(0), new, jnp.array([7], jnp.int32))
    expected = jax.lax.dynamic_update_slice(cache, jnp.ones((1, 1, 1, 3, 2)), (0, 0, 0, 7, 0))
    np.testing.assert_array_equal(out, expected)


def _forward_size(batch: int) -> int:
    model = FAMILY.random(CFG, unroll_layers=True, kernels=KernelPolicy(impl="reference"))
    graph, state = nnx.split(model)

    def forward(state, tokens, start, cache):
        return nnx.merge(graph, state)(tokens, start, cache)[1]

    cache = model.init_cache(batch, 32)
    tokens, start = jnp.zeros((batch, 4), jnp.int32), jnp.zeros((batch,), jnp.int32)
    return len(jax.make_jaxpr(forward)(state, tokens, start, cache).jaxpr.eqns)


def test_the_unrolled_forward_does_not_grow_with_the_batch():
    assert _forward_size(2) == _forward_size(32)
