"""Verify/decode attention: reference vs a float64 oracle, Pallas kernel (interpret mode) vs reference, with
and without a sliding window, and the dispatcher's choice. Interpret mode is slow on CPU: shapes are tiny and
cases few."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from jax.experimental import pallas as pl

from specjax.kernels.attention import attention, choose_attention
from specjax.kernels.attention_reference import attention_reference
from specjax.kernels.attention_triton import KernelConfig, attention_triton, default_config, merge_splits
from specjax.kernels.policy import KernelPolicy, has_kernels
from specjax.kernels.tree_mask import TreeMask

INTERPRET = KernelPolicy(impl="triton", interpret=True)

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


@pytest.fixture(autouse=True)
def exact_float32_matmuls():
    """fp32 at full precision, as the engine runs fp32 models: on a GPU the default is TF32 (~3e-4 relative
    here), which would hide nothing but fail the 1e-5 tolerance."""
    with jax.default_matmul_precision("highest"):
        yield


def make_inputs(seed, batch, tokens, q_heads, kv_heads, slots, head_dim, dtype, layers=2,
                starts=None):
    """Random q and caches; slots past each row's last written token hold NaN (garbage)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, tokens, q_heads, head_dim))
    k = rng.standard_normal((layers, batch, kv_heads, slots, head_dim))
    v = rng.standard_normal((layers, batch, kv_heads, slots, head_dim))
    if starts is None:
        starts = rng.integers(0, slots - tokens + 1, size=batch)
    starts = np.asarray(starts)
    for b, first in enumerate(starts):
        k[:, b, :, first + tokens:] = np.nan
        v[:, b, :, first + tokens:] = np.nan
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
            jnp.asarray(starts, jnp.int32))


def oracle(q, k_cache, v_cache, layer, start, scale, window=0):
    """Float64 numpy attention, one query at a time; a query sees the `window` slots ending at its own
    (transformers' sliding mask: kv > q - window) when window > 0."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k_cache[layer], v_cache[layer]))
    batch, tokens, q_heads, _ = q.shape
    group = q_heads // k.shape[1]
    out = np.zeros_like(q)
    for b in range(batch):
        for t in range(tokens):
            end = int(start[b]) + t + 1
            first = max(0, end - window) if window else 0
            for head in range(q_heads):
                keys, values = k[b, head // group, first:end], v[b, head // group, first:end]
                logits = keys @ q[b, t, head] * scale
                weights = np.exp(logits - logits.max())
                out[b, t, head] = weights @ values / weights.sum()
    return out


def relative_error(out, expected):
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    expected = np.asarray(jnp.asarray(expected, jnp.float32), np.float64)
    assert np.isfinite(out).all(), "output has NaN/Inf (unwritten element or garbage slot read)"
    return np.linalg.norm(out - expected) / np.linalg.norm(expected)


@pytest.mark.parametrize("window", [0, 1, 5])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_reference_matches_float64_oracle(dtype, window):
    q, k, v, start = make_inputs(0, batch=3, tokens=4, q_heads=8, kv_heads=2, slots=24,
                                 head_dim=16, dtype=dtype, starts=[0, 7, 20])
    out = attention_reference(q, k, v, jnp.int32(1), start, scale=0.3, window=window)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert relative_error(out, oracle(q, k, v, 1, start, 0.3, window)) < TOLERANCE[dtype]


def test_a_window_wider_than_the_context_changes_nothing_and_a_narrow_one_does():
    q, k, v, start = make_inputs(7, batch=2, tokens=3, q_heads=4, kv_heads=2, slots=32,
                                 head_dim=16, dtype=jnp.float32, starts=[2, 20])
    full = attention_reference(q, k, v, 0, start, scale=0.25)
    np.testing.assert_array_equal(attention_reference(q, k, v, 0, start, scale=0.25, window=23), full)
    assert relative_error(attention_reference(q, k, v, 0, start, scale=0.25, window=22), full) > 1e-3


@pytest.mark.parametrize("window", [0, 6])
def test_reference_query_chunks_match_single_pass(window):
    q, k, v, start = make_inputs(1, batch=2, tokens=11, q_heads=4, kv_heads=4, slots=32,
                                 head_dim=16, dtype=jnp.float32, starts=[0, 13])
    whole = attention_reference(q, k, v, 0, start, scale=0.25, window=window)
    chunked = attention_reference(q, k, v, 0, start, scale=0.25, window=window, query_chunk=4)
    assert relative_error(chunked, whole) < 1e-6


KERNEL_CASES = [
    # (batch, tokens, q_heads, kv_heads, slots, head_dim, dtype, config or None, starts or None, window)
    (2, 1, 4, 4, 40, 16, jnp.float32, None, [0, 39], 0),                  # decode, MHA, S not pow2
    (3, 5, 8, 2, 48, 32, jnp.bfloat16, None, [0, 17, 43], 0),             # verify, GQA 4
    (2, 16, 8, 1, 64, 16, jnp.float32, None, None, 0),                    # T=16, GQA 8: 128 rows
    (3, 5, 8, 2, 48, 16, jnp.float32,                                     # split-KV + row tiles
     KernelConfig(block_k=16, rows_per_tile=16, num_splits=3), [0, 9, 43], 0),
    (2, 3, 16, 2, 80, 16, jnp.bfloat16,                                   # GQA 8, splits, tiles
     KernelConfig(block_k=16, rows_per_tile=16, num_splits=4, num_warps=8), [5, 77], 0),
    # Sliding windows: blocks before a tile's window skipped, windows across block and split edges.
    (2, 1, 4, 4, 40, 16, jnp.float32, KernelConfig(block_k=16), [0, 39], 1),  # decode sees itself only
    (3, 5, 8, 2, 48, 16, jnp.float32,
     KernelConfig(block_k=16, rows_per_tile=16, num_splits=3), [0, 9, 43], 7),
    (2, 16, 8, 1, 64, 16, jnp.bfloat16, KernelConfig(block_k=16, rows_per_tile=32), [0, 40], 5),
]


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_kernel_matches_reference(case):
    check_kernel_case(case, interpret=True)


@pytest.mark.skipif(not has_kernels(jax.devices()[0]), reason="compiles the Triton kernel (NVIDIA sm80+)")
@pytest.mark.parametrize("case", KERNEL_CASES)
def test_compiled_kernel_matches_reference_on_the_gpu(case):
    check_kernel_case(case, interpret=False)


def check_kernel_case(case, interpret: bool) -> None:
    batch, tokens, q_heads, kv_heads, slots, head_dim, dtype, config, starts, window = case
    q, k, v, start = make_inputs(2, batch, tokens, q_heads, kv_heads, slots, head_dim, dtype,
                                 starts=starts)
    scale = head_dim ** -0.5
    # Interpret mode fills outputs with NaN before the kernel runs (checked below), so
    # relative_error's finiteness check proves every element was written.
    out = attention_triton(q, k, v, jnp.int32(1), start, scale=scale, window=window, config=config,
                           interpret=interpret)
    expected = attention_reference(q, k, v, jnp.int32(1), start, scale=scale, window=window)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert relative_error(out, expected) < TOLERANCE[dtype]


LATENT_CASES = [
    # (batch, tokens, q_heads, slots, value_dim, rope_dim, dtype, config or None, starts)
    (2, 1, 16, 64, 32, 16, jnp.float32, None, [0, 63]),                             # decode, one tile
    (3, 3, 8, 48, 32, 16, jnp.bfloat16, KernelConfig(block_k=16, num_splits=2), [0, 20, 45]),   # verify, splits
    (2, 2, 16, 40, 64, 16, jnp.float32, KernelConfig(block_k=16, rows_per_tile=16), [3, 38]),   # row tiles
]


def latent_inputs(seed, batch, tokens, q_heads, slots, value_dim, rope_dim, dtype, starts):
    """q and a latent cache [L, B, 1, S, value_dim + rope_dim] (one kv head), NaN past each row's last token."""
    q, k, _, start = make_inputs(seed, batch, tokens, q_heads, 1, slots, value_dim + rope_dim, dtype, starts=starts)
    return q, k, start


@pytest.mark.parametrize("case", LATENT_CASES)
def test_kernel_with_the_values_inside_the_keys_matches_the_reference(case):
    """MLA's absorbed form: keys read in two pieces, the first being the values; every output written."""
    batch, tokens, q_heads, slots, value_dim, rope_dim, dtype, config, starts = case
    q, cache, start = latent_inputs(3, batch, tokens, q_heads, slots, value_dim, rope_dim, dtype, starts)
    out = attention_triton(q, cache, None, jnp.int32(1), start, scale=0.2, config=config, interpret=True,
                           value_dim=value_dim)
    expected = attention_reference(q, cache, None, jnp.int32(1), start, scale=0.2, value_dim=value_dim)
    assert out.shape == (batch, tokens, q_heads, value_dim) and out.dtype == q.dtype
    assert relative_error(out, expected) < TOLERANCE[dtype]


def test_values_inside_the_keys_are_the_keys_first_columns():
    """The reference's latent form against the float64 oracle with the values spelled out as a separate cache."""
    q, cache, start = latent_inputs(4, 2, 3, 8, 32, 32, 16, jnp.float32, [0, 29])
    values = jnp.concatenate([cache[..., :32], jnp.zeros_like(cache[..., 32:])], axis=-1)
    got = attention_reference(q, cache, None, 1, start, scale=0.2, value_dim=32)
    assert relative_error(got, oracle(q, cache, values, 1, start, 0.2)[..., :32]) < 1e-5


def test_a_tree_pass_over_a_latent_cache_matches_the_reference():
    q, cache, start = latent_inputs(5, 2, 4, 16, 48, 32, 16, jnp.float32, [10, 40])
    rng = np.random.default_rng(5)
    parents = np.tril(rng.integers(0, 2, (2, 4, 4)), -1).astype(bool) | np.eye(4, dtype=bool)[None]
    tree = TreeMask(positions=start[:, None] + jnp.asarray([[0, 1, 1, 2]] * 2, jnp.int32), region_start=start,
                    visible=jnp.asarray(parents))
    out = attention_triton(q, cache, None, 0, start, scale=0.2, config=KernelConfig(block_k=16), interpret=True,
                           tree=tree, value_dim=32)
    expected = attention_reference(q, cache, None, 0, start, scale=0.2, tree=tree, value_dim=32)
    assert relative_error(out, expected) < 1e-5


@pytest.mark.parametrize("value_dim, v_cache, match", [
    (None, None, "without v_cache pass value_dim"),
    (64, None, "without v_cache pass value_dim"),
    (16, "given", "value_dim is for a cache whose keys hold the values"),
])
def test_a_latent_cache_needs_its_value_width(value_dim, v_cache, match):
    q, cache, start = latent_inputs(6, 1, 1, 4, 16, 32, 16, jnp.float32, [0])
    with pytest.raises(ValueError, match=match):
        attention(q, cache, cache if v_cache else None, 0, start, scale=0.2, value_dim=value_dim)


def test_the_latent_kernel_needs_power_of_two_pieces():
    q, cache, start = latent_inputs(7, 1, 1, 4, 16, 32, 8, jnp.float32, [0])
    assert choose_attention(KernelPolicy(interpret=True), q.shape, cache.shape, 32) == "reference"
    with pytest.raises(ValueError, match="value_dim and head_dim - value_dim"):
        attention(q, cache, None, 0, start, scale=0.2, value_dim=32, kernels=INTERPRET)


# No shrinking: each interpret-mode example costs about a second.
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(tokens=st.integers(1, 16), group=st.sampled_from([1, 4, 8]), slots=st.integers(16, 72),
       splits=st.sampled_from([1, 2]), window=st.sampled_from([0, 1, 3, 17]), seed=st.integers(0, 2**16))
def test_kernel_random_shapes(tokens, group, slots, splits, window, seed):
    slots = max(slots, tokens)
    q, k, v, start = make_inputs(seed, batch=2, tokens=tokens, q_heads=2 * group, kv_heads=2,
                                 slots=slots, head_dim=16, dtype=jnp.float32, layers=1)
    config = KernelConfig(block_k=16, rows_per_tile=32, num_splits=splits)
    out = attention_triton(q, k, v, 0, start, scale=0.25, window=window, config=config, interpret=True)
    expected = attention_reference(q, k, v, 0, start, scale=0.25, window=window)
    assert relative_error(out, expected) < TOLERANCE[jnp.float32]


def test_interpret_mode_poisons_unwritten_outputs():
    """The finiteness checks above rely on interpret mode starting outputs as NaN."""

    def write_first_block_only(x_ref, o_ref):
        @pl.when(pl.program_id(0) == 0)
        def _():
            o_ref[...] = x_ref[...]

    half_written = pl.pallas_call(
        write_first_block_only, grid=(2,), in_specs=[pl.BlockSpec((8,), lambda i: (i,))],
        out_specs=pl.BlockSpec((8,), lambda i: (i,)),
        out_shape=jax.ShapeDtypeStruct((16,), jnp.float32), interpret=True)(jnp.ones(16))
    assert np.isnan(np.asarray(half_written[8:])).all()


def test_kernel_under_jit_with_traced_layer_and_window_in_scan():
    """Layers of one scanned stack with different windows (Qwen2's full then sliding layers) share the kernel."""
    q, k, v, start = make_inputs(3, batch=2, tokens=2, q_heads=4, kv_heads=2, slots=32,
                                 head_dim=16, dtype=jnp.float32, layers=3, starts=[3, 25])
    windows = (0, 4, 19)

    @jax.jit
    def all_layers(q, k, v, start):
        def step(carry, layer_and_window):
            layer, window = layer_and_window
            return carry, attention(q, k, v, layer, start, scale=0.25, window=window, kernels=INTERPRET)
        return jax.lax.scan(step, 0, (jnp.arange(3, dtype=jnp.int32), jnp.asarray(windows, jnp.int32)))[1]

    outs = all_layers(q, k, v, start)
    for layer, window in enumerate(windows):
        expected = oracle(q, k, v, layer, start, 0.25, window)
        assert relative_error(outs[layer], expected) < TOLERANCE[jnp.float32]


def fake_device(platform, capability=None):
    return types.SimpleNamespace(platform=platform, compute_capability=capability)


@pytest.mark.parametrize("device, expected", [
    (fake_device("cpu"), "reference"),
    (fake_device("gpu", "7.5"), "reference"),   # T4
    (fake_device("gpu", "8.0"), "triton"),      # A100
    (fake_device("gpu", "9.0"), "triton"),      # H100 / H200
    (fake_device("gpu", "gfx90a"), "reference"),
    (fake_device("tpu"), "reference"),
])
def test_auto_runs_the_kernel_on_nvidia_sm80_and_newer(device, expected):
    assert has_kernels(device) == (expected == "triton")
    shapes = ((1, 2, 4, 16), (1, 1, 2, 16, 16))
    assert choose_attention(KernelPolicy(device=device), *shapes) == expected
    assert choose_attention(KernelPolicy(impl="reference", device=device), *shapes) == "reference"


def test_a_kernel_policy_refuses_an_unknown_impl():
    with pytest.raises(ValueError, match="impl must be one of"):
        KernelPolicy(impl="cuda")


def test_auto_on_this_host_follows_the_device():
    q, k, v, start = make_inputs(4, batch=1, tokens=2, q_heads=4, kv_heads=2, slots=16,
                                 head_dim=16, dtype=jnp.float32)
    out = attention(q, k, v, 0, start, scale=0.25)
    if not has_kernels(jax.devices()[0]):
        expected = attention_reference(q, k, v, 0, start, scale=0.25)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))
    assert relative_error(out, oracle(q, k, v, 0, start, 0.25)) < 1e-5


def test_auto_falls_back_for_shapes_the_kernel_lacks():
    q, k, v, start = make_inputs(5, batch=1, tokens=1, q_heads=2, kv_heads=1, slots=16,
                                 head_dim=24, dtype=jnp.float32)
    out = attention(q, k, v, 0, start, scale=0.2, kernels=KernelPolicy(interpret=True))
    assert relative_error(out, oracle(q, k, v, 0, start, 0.2)) < 1e-5
    with pytest.raises(ValueError, match="head_dim"):
        attention(q, k, v, 0, start, scale=0.2, kernels=INTERPRET)


@pytest.mark.parametrize("change, error", [
    (dict(q=jnp.zeros((1, 2, 3, 16))), ValueError),          # Hq not a multiple of Hkv
    (dict(start=jnp.zeros((2,), jnp.int32)), ValueError),    # wrong batch
    (dict(start=jnp.zeros((1,), jnp.float32)), ValueError),  # not integer
    (dict(q=jnp.zeros((1, 2, 4, 16), jnp.bfloat16)), TypeError),
    (dict(scale=jnp.float32(0.2)), TypeError),
    (dict(window=jnp.zeros((2,), jnp.int32)), ValueError),   # one window per call
    (dict(window=4.0), ValueError),
])
def test_invalid_inputs_raise_clear_errors(change, error):
    q, k, v, start = make_inputs(6, batch=1, tokens=2, q_heads=4, kv_heads=2, slots=16,
                                 head_dim=16, dtype=jnp.float32)
    args = dict(q=q, k_cache=k, v_cache=v, layer=0, start=start, scale=0.2) | change
    with pytest.raises(error):
        attention(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), args.pop("layer"),
                  args.pop("start"), **args)


@pytest.mark.parametrize("splits, rows, width", [(3, 37, 100), (16, 128, 512), (1, 5, 64)])
def test_the_split_merge_weights_each_split_by_its_share_of_the_mass(splits, rows, width):
    """Tiles past the rows and columns, a split count that is not a power of two, splits that saw nothing (lse
    -inf, output 0): the float64 merge, in the requested dtype."""
    rng = np.random.default_rng(splits)
    out = rng.standard_normal((splits, rows, width)).astype(np.float32)
    lse = (rng.standard_normal((splits, rows)) * 4).astype(np.float32)
    empty = rng.random((splits, rows)) < 0.3
    empty[rng.integers(0, splits, rows), np.arange(rows)] = False   # each row's own slot is in some split
    lse[empty], out[empty] = -np.inf, 0.0
    weights = np.exp2(lse.astype(np.float64) - lse.max(axis=0))
    want = (weights[..., None] * out).sum(axis=0) / weights.sum(axis=0)[:, None]
    got = merge_splits(jnp.asarray(out), jnp.asarray(lse), jnp.float32, interpret=True)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    assert merge_splits(jnp.asarray(out), jnp.asarray(lse), jnp.bfloat16, interpret=True).dtype == jnp.bfloat16


def test_default_config_for_a_latent_cache_keeps_accumulators_and_blocks_small():
    """DeepSeek's 576-wide latent, values 512 wide: 32-row tiles of 128 heads (a [32, 512] fp32 accumulator), 16
    rows for 16 heads, 64-slot blocks, 4 warps (the H200 sweep's best); at a short context a split per block."""
    v3 = default_config((8, 1, 128, 576), (61, 8, 1, 4096, 576), value_dim=512)
    tp8 = default_config((64, 1, 16, 576), (61, 64, 1, 32768, 576), value_dim=512)
    assert (v3.rows_per_tile, v3.block_k, v3.num_warps) == (32, 64, 4) and v3.num_splits > 1
    assert (tp8.rows_per_tile, tp8.block_k, tp8.num_warps) == (16, 64, 4)
    step = default_config((1, 1, 128, 576), (4, 1, 1, 1025, 576), value_dim=512)   # V3's batch-1 decode step
    assert step.num_splits * step.block_k == 1024   # a split per 64-slot block: 64 programs, not 16


def test_default_config_splits_only_when_programs_are_few():
    few = default_config((1, 1, 32, 128), (32, 1, 8, 4096, 128))
    many = default_config((64, 1, 32, 128), (32, 64, 8, 4096, 128))
    prefill = default_config((1, 2048, 32, 128), (32, 1, 8, 4096, 128))
    assert few.num_splits > 1
    assert many.num_splits == 1
    assert prefill.num_splits == 1 and prefill.rows_per_tile <= 128
