"""The SwiGLU rows kernel (kernels/swiglu_rows.py), interpreted: the products' sums, silu(gate) * up and
f16_rows' scaling."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.kernels.grouped_matmul_triton import f16_rows
from specjax.kernels.swiglu_rows import swiglu_rows


@pytest.mark.parametrize("splits, rows, width", [(2, 9, 256), (3, 1, 5000), (1, 4, 100)])
def test_the_rows_are_swiglu_of_the_summed_products_to_half_a_bf16_ulp(splits, rows, width):
    """Each product summed in split order and rounded to bf16 as XLA's sum is, then silu(gate) * up rounded once
    (within half a bf16 ulp of the exact value: XLA's own sigmoid on the CPU is several ulps off for large
    negative gates), as float16 rows scaled by the power of two that f16_rows gives them."""
    keys = jax.random.split(jax.random.key(splits * 100 + width), 2)
    gate, up = (jax.random.normal(key, (splits, rows, width), jnp.float32) * 4 for key in keys)
    g, u = (np.asarray(functools.reduce(jnp.add, list(p)).astype(jnp.bfloat16), np.float64) for p in (gate, up))
    exact = g / (1 + np.exp(-g)) * u
    got = jax.jit(functools.partial(swiglu_rows, interpret=True))(gate, up)
    rows_back = np.asarray(got.bf16(), np.float64)
    # Half a bf16 ulp (2^-8 of the binade), but for values so small against their row's largest (2^-24) that
    # float16 holds them as subnormals (ScaledRows: exact only from 2^-28 of it).
    floor = 2.0 ** -24 * np.abs(exact).max(axis=1, keepdims=True)
    assert np.all(np.abs(rows_back - exact) <= 2 ** -8 * np.abs(exact) + floor)
    _, want_unscale = f16_rows(jnp.asarray(rows_back, jnp.bfloat16), True)
    np.testing.assert_array_equal(np.asarray(got.unscale), np.asarray(want_unscale))


def test_mismatched_products_are_refused():
    with pytest.raises(ValueError, match="gate and up must be alike"):
        swiglu_rows(jnp.zeros((2, 3, 8)), jnp.zeros((2, 3, 9)))
