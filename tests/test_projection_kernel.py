"""Fused decoder projections: reference vs a float64 oracle, the Pallas kernel (interpret mode) vs the
reference, row independence (what exact speculation needs), the dispatcher's choice, bad inputs."""
from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from specjax.kernels.policy import KernelPolicy
from specjax.kernels.projection import projection
from specjax.kernels.projection_reference import projection_reference
from specjax.parallel.mesh import traced_with
from specjax.kernels.projection_triton import BLOCK_M, ProjectionConfig, default_config, projection_triton

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
SMALL_TILES = ProjectionConfig(block_n=16, block_k=32)   # several column blocks and K chunks at test sizes


def make_inputs(seed, rows, k, n, dtype, norm=False, activation=None, residual=False, lead=None):
    rng = np.random.default_rng(seed)
    out = n // 2 if activation == "swiglu" else n
    shape = lead or (rows,)
    x = jnp.asarray(rng.standard_normal(shape + (k,)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype)
    scale = jnp.asarray(1 + 0.2 * rng.standard_normal(k), dtype) if norm else None
    res = jnp.asarray(rng.standard_normal(shape + (out,)), dtype) if residual else None
    return dict(x=x, w=w, norm=scale, eps=1e-5, activation=activation, residual=res)


def oracle(x, w, norm, eps, activation, residual):
    """float64 numpy: residual + act(rms_norm(x) @ w), gate/up interleaved column by column."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    if norm is not None:
        x = np.asarray(norm, np.float64) * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    y = x @ w
    if activation == "swiglu":
        gate, up = y[..., 0::2], y[..., 1::2]
        y = gate / (1 + np.exp(-gate)) * up
    return y if residual is None else np.asarray(residual, np.float64) + y


def relative_error(out, expected):
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    assert np.isfinite(out).all(), "output has NaN/Inf (an unwritten element)"
    return np.linalg.norm(out - expected) / np.linalg.norm(expected)


FLAGS = [dict(norm=True), dict(residual=True), dict(norm=True, activation="swiglu"), dict()]


@pytest.mark.parametrize("flags", FLAGS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_reference_matches_float64_oracle(flags, dtype):
    args = make_inputs(0, rows=3, k=48, n=40, dtype=dtype, **flags)
    with jax.default_matmul_precision("highest"):
        out = projection_reference(**args)
    assert relative_error(out, oracle(**args)) < TOLERANCE[dtype]


@pytest.mark.parametrize("flags", FLAGS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_matches_reference(flags, dtype):
    # 20 rows: two row tiles, the second partly padding; N=72: a partial column block; K=100: partial chunk.
    # Interpret mode starts outputs as NaN (tests/test_attention_kernel.py checks it), so the finiteness
    # check in relative_error proves every element was written.
    args = make_inputs(1, rows=20, k=100, n=72, dtype=dtype, **flags)
    with jax.default_matmul_precision("highest"):
        out = projection_triton(**args, config=SMALL_TILES, interpret=True)
        expected = projection_reference(**args)
    assert out.shape == expected.shape and out.dtype == args["x"].dtype
    assert relative_error(out, np.asarray(expected.astype(jnp.float32), np.float64)) < TOLERANCE[dtype]


# No shrinking: each interpret-mode example costs about a second.
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(rows=st.integers(1, 40), k=st.integers(1, 200), half_n=st.integers(1, 60),
       flags=st.sampled_from(FLAGS), seed=st.integers(0, 2**16))
def test_kernel_random_shapes(rows, k, half_n, flags, seed):
    args = make_inputs(seed, rows=rows, k=k, n=2 * half_n, dtype=jnp.float32, **flags)
    with jax.default_matmul_precision("highest"):
        out = projection_triton(**args, config=SMALL_TILES, interpret=True)
    assert relative_error(out, oracle(**args)) < TOLERANCE[jnp.float32]


def test_default_config_runs_and_keeps_leading_dims():
    args = make_inputs(2, rows=0, k=64, n=48, dtype=jnp.float32, norm=True, activation="swiglu",
                       residual=True, lead=(2, 3))
    with jax.default_matmul_precision("highest"):
        out = projection_triton(**args, interpret=True)
    assert out.shape == (2, 3, 24)
    assert relative_error(out, oracle(**args)) < TOLERANCE[jnp.float32]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_row_rounds_the_same_whatever_the_row_count(dtype):
    """A token's projection in a one-token decode step equals it inside a many-token verify pass, bit for
    bit: greedy speculation reproduces plain decoding only if it does."""
    args = make_inputs(3, rows=2 * BLOCK_M + 3, k=96, n=64, dtype=dtype, norm=True, activation="swiglu")
    many = projection_triton(**args, config=SMALL_TILES, interpret=True)
    for row in (0, BLOCK_M + 1, 2 * BLOCK_M + 2):
        one = projection_triton(**(args | dict(x=args["x"][row:row + 1])), config=SMALL_TILES, interpret=True)
        np.testing.assert_array_equal(np.asarray(one[0], np.float32), np.asarray(many[row], np.float32))


def fake_device(platform, capability=None):
    return types.SimpleNamespace(platform=platform, compute_capability=capability)


def uses_kernel(device, x_shape, w_shape, impl="auto"):
    """Whether projection() traces the Pallas kernel under a policy for `device` (traced, not run)."""
    kernels = KernelPolicy(impl=impl, device=device)
    x, w = jnp.zeros(x_shape, jnp.bfloat16), jnp.zeros(w_shape, jnp.bfloat16)
    return "pallas_call" in str(jax.make_jaxpr(lambda x, w: projection(x, w, kernels=kernels))(x, w))


def test_dispatcher_uses_the_kernel_only_where_launches_bound_the_projection():
    h100 = fake_device("gpu", "9.0")
    small = (576, 960)                                    # the default model's q/k/v
    big = (4096, 6144)                                    # Llama-3.1-8B's q/k/v: XLA's GEMM streams it
    policy = KernelPolicy()
    assert 2 * small[0] * small[1] <= policy.projection_max_weight_bytes < 2 * big[0] * big[1]
    assert uses_kernel(h100, (1, 1, 576), small)
    assert uses_kernel(h100, (4, 4, 576), small)            # a k=3 verify pass of 4 rows
    assert not uses_kernel(h100, (8, 4, 576), small)        # of 8 rows: XLA's GEMM ran faster
    assert not uses_kernel(h100, (1, policy.projection_max_rows + 1, 576), small)   # a prefill
    assert not uses_kernel(h100, (1, 1, 4096), big)
    assert not uses_kernel(fake_device("gpu", "7.5"), (1, 1, 576), small)   # T4
    assert not uses_kernel(fake_device("cpu"), (1, 1, 576), small)
    assert uses_kernel(fake_device("cpu"), (1, 1, 4096), big, impl="triton")
    assert not uses_kernel(h100, (1, 1, 576), small, impl="reference")


def test_dispatcher_leaves_tensor_parallel_projections_to_xla():
    """Under a tensor-parallel layout XLA's partitioner splits the reference's matmul; a Pallas call it
    cannot, so even impl="triton" runs the reference there."""
    two_devices = types.SimpleNamespace(mesh=types.SimpleNamespace(size=2))
    with traced_with(two_devices):
        assert not uses_kernel(fake_device("gpu", "9.0"), (1, 1, 576), (576, 960), impl="triton")


def test_auto_on_this_host_equals_the_reference_off_gpus():
    args = make_inputs(4, rows=2, k=32, n=24, dtype=jnp.float32, norm=True, residual=True)
    if jax.default_backend() != "gpu":
        np.testing.assert_array_equal(np.asarray(projection(**args)), np.asarray(projection_reference(**args)))


@pytest.mark.parametrize("change, error", [
    (dict(activation="gelu"), ValueError),
    (dict(w=jnp.zeros((8, 16))), ValueError),                 # K != x's last axis
    (dict(w=jnp.zeros((32, 16), jnp.bfloat16)), TypeError),   # dtypes differ
    (dict(norm=jnp.ones((8,))), ValueError),
    (dict(activation="swiglu", w=jnp.zeros((32, 15))), ValueError),
    (dict(residual=jnp.zeros((2, 3))), ValueError),
])
def test_invalid_inputs_raise_clear_errors(change, error):
    args = dict(x=jnp.zeros((2, 32)), w=jnp.zeros((32, 16))) | change
    with pytest.raises(error, match="projection"):
        projection(args.pop("x"), args.pop("w"), **args)


def test_default_config_spreads_columns_and_chunks_the_reduction():
    assert default_config(576, 960).block_n == 16
    assert default_config(4096, 14336).block_n == 64
    assert default_config(576, 960).block_k == 256 and default_config(40, 960).block_k == 64
