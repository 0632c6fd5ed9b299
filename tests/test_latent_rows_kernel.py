"""MLA's latent rows kernel (kernels/latent_rows.py), interpreted, against the launches it replaces
(benchmarks/bench_row_kernels.py `separate_latent_rows`, which the benchmark times it against;
tests/test_deepseek_row_kernels.py runs it in the model)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.bench_row_kernels import separate_latent_rows
from specjax.kernels.latent_rows import latent_rows
from specjax.models.rope import rotary, unit_rotation

Q_WIDTH, Q_RANK, RANK, ROPE = 256, 200, 128, 64   # q_a's columns zero-padded to whole blocks, as in wqkv_a
YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}


@pytest.mark.parametrize("batch, tokens, splits, interleaved, scaling", [
    (1, 1, 7, True, YARN), (3, 4, 2, True, YARN), (2, 3, 1, False, None)])
def test_the_kernel_is_the_separate_launches_bit_for_bit(batch, tokens, splits, interleaved, scaling):
    keys = jax.random.split(jax.random.key(batch * 10 + tokens), 6)
    rows = batch * tokens
    partials = jax.random.normal(keys[0], (splits, rows, Q_WIDTH + RANK + ROPE), jnp.float32) * 3
    q_norm = (1 + 0.1 * jax.random.normal(keys[1], (Q_RANK,))).astype(jnp.bfloat16), 1e-6
    kv_norm = (1 + 0.1 * jax.random.normal(keys[2], (RANK,))).astype(jnp.bfloat16), 1e-6
    cache = jax.random.normal(keys[3], (2, batch, 16, RANK + ROPE), jnp.bfloat16)
    start = jax.random.randint(keys[4], (batch,), 0, 16 - tokens, jnp.int32)
    positions = start[:, None] + jnp.arange(tokens, dtype=jnp.int32) + 1000   # positions apart from slots (trees)
    rotate = rotary(ROPE, 10000.0, scaling, interleaved=interleaved, max_position_embeddings=163840)
    layer = jnp.int32(1)

    want_values, want_unscale, want_cache = separate_latent_rows(partials, q_norm, kv_norm, Q_WIDTH, rotate,
                                                                 positions, cache, layer, start, interpret=True)
    rotation = unit_rotation(rotate, positions, ROPE, interleaved)
    run = jax.jit(lambda p, qw, kvw, r, c, s: latent_rows(p, (qw, q_norm[1]), (kvw, kv_norm[1]), Q_WIDTH, r, c,
                                                          layer, s, interleaved=interleaved, interpret=True))
    got, got_cache = run(partials, q_norm[0], kv_norm[0], rotation, cache, start)
    np.testing.assert_array_equal(np.asarray(got.values), np.asarray(want_values))
    np.testing.assert_array_equal(np.asarray(got.unscale), np.asarray(want_unscale))
    got_cache, want_cache = np.asarray(got_cache, np.float32), np.asarray(want_cache, np.float32)
    np.testing.assert_array_equal(got_cache[..., :RANK], want_cache[..., :RANK])
    # The rotation's a cos - b sin may be contracted to a fused multiply-add by either compiler: a bf16 ulp.
    np.testing.assert_allclose(got_cache[..., RANK:], want_cache[..., RANK:], rtol=2 ** -7, atol=0)


def test_the_unit_rotation_is_the_rotations_cos_and_sin():
    rotate = rotary(ROPE, 10000.0, YARN, interleaved=True, max_position_embeddings=163840)
    positions = jnp.array([[0, 5, 70000]], jnp.int32)
    pairs = unit_rotation(rotate, positions, ROPE, interleaved=True).reshape(3, ROPE // 2, 2)
    x = jax.random.normal(jax.random.key(0), (1, 3, 1, ROPE), jnp.float32)
    a, b = x[0, :, 0, 0::2], x[0, :, 0, 1::2]
    cos, sin = pairs[..., 0], pairs[..., 1]
    rotated = rotate(x, positions)[0, :, 0]
    np.testing.assert_array_equal(np.asarray(rotated[:, 0::2]), np.asarray(a * cos - b * sin))
    np.testing.assert_array_equal(np.asarray(rotated[:, 1::2]), np.asarray(b * cos + a * sin))

