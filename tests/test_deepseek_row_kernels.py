"""DeepSeek-V3's row kernels in the model (kernels/latent_rows.py, kernels/swiglu_rows.py), through the
interpreted kernels on a tiny FP8 V3 in bf16: each against the launches it replaces, and a verify pass rounding as
decode steps do."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from benchmarks.bench_deepseek import V3_4_LAYERS, config
from specjax.kernels import swiglu_rows
from specjax.kernels.policy import KernelPolicy
from specjax.models import moe
from specjax.models.deepseek import FAMILY

KERNEL_NAMES = {"latent_rows_kernel": "specjax_latent_rows", "swiglu_rows_kernel": "specjax_swiglu_rows"}


def tiny_v3():
    cfg = config(V3_4_LAYERS, smoke=True)
    return cfg, FAMILY.random(cfg, dtype=jnp.bfloat16, kernels=KernelPolicy(interpret=True))


@pytest.mark.parametrize("tokens", [1, 3])
def test_a_v3_with_the_latent_rows_kernel_equals_it_without(tokens):
    """With the kernel and without it (the rest alike): the same logits and cache up to a bf16 ulp of the
    rotation; and the kernel is in the one program and not the other."""
    cfg, model = tiny_v3()
    graph, state = nnx.split(model)
    without = nnx.graphdef(nnx.eval_shape(lambda: FAMILY.random(
        cfg, dtype=jnp.bfloat16, kernels=KernelPolicy(interpret=True, latent_rows_kernel=False))))
    tokens_in = jax.random.randint(jax.random.key(3), (2, tokens), 0, cfg.vocab_size, jnp.int32)
    start = jnp.array([5, 9], jnp.int32)

    def step(g, st):
        model = nnx.merge(g, st)
        cache = model.init_cache(2, 16)
        hidden, cache, _ = model(tokens_in, start, cache)
        return model.logits(hidden), cache.latent

    (got_logits, got_cache), (want_logits, want_cache) = (jax.jit(functools.partial(step, g))(state)
                                                          for g in (graph, without))
    np.testing.assert_allclose(np.asarray(got_cache, np.float32), np.asarray(want_cache, np.float32),
                               rtol=2 ** -7, atol=2 ** -7)
    np.testing.assert_allclose(np.asarray(got_logits, np.float32), np.asarray(want_logits, np.float32),
                               rtol=0.05, atol=0.05)
    assert KERNEL_NAMES["latent_rows_kernel"] in str(jax.make_jaxpr(lambda st: step(graph, st))(state))
    assert KERNEL_NAMES["latent_rows_kernel"] not in str(jax.make_jaxpr(lambda st: step(without, st))(state))


@pytest.mark.parametrize("tokens", [1, 6])
def test_an_mlp_with_the_swiglu_rows_kernel_equals_it_without(tokens):
    """A MoE block (routed experts in slot order at one token, sorted beyond; the shared expert) and a dense
    MLP with the kernel and without it: within a few bf16 ulps of the output's scale (the sigmoid's own
    rounding; compared block by block, since in a whole random model such an ulp can flip a near-tied expert)."""
    cfg, model = tiny_v3()
    weights = {name: leaf[0] for name, leaf in nnx.to_pure_dict(nnx.state(model))["moe"].items()}
    x = jax.random.normal(jax.random.key(tokens), (tokens, cfg.hidden_size), jnp.bfloat16)
    norm = (weights["mlp_norm"], cfg.rms_norm_eps)
    blocks = {"moe": lambda k: moe.moe(x, weights, cfg.routing, kernels=k, block=cfg.block, norm=norm),
              "mlp": lambda k: moe.swiglu_mlp(x, weights, "ws_", cfg.block, k, norm=norm)}
    on, off = KernelPolicy(interpret=True), KernelPolicy(interpret=True, swiglu_rows_kernel=False)
    for name, block in blocks.items():
        got, want = (np.asarray(jax.jit(lambda: block(k))(), np.float32) for k in (on, off))
        assert np.abs(got - want).max() <= 2 ** -5 * np.abs(want).max(), name
        assert KERNEL_NAMES["swiglu_rows_kernel"] in str(jax.make_jaxpr(lambda: block(on))())
        assert KERNEL_NAMES["swiglu_rows_kernel"] not in str(jax.make_jaxpr(lambda: block(off))())

def test_the_swiglu_rows_kernel_takes_rows_up_to_its_width():
    """A row is one program of the kernel: a dense MLP's wide rows stay with XLA's fusion and f16_rows."""
    def weights(width: int) -> dict:
        shapes = {"w_gate": (128, width), "w_up": (128, width), "w_down": (width, 128)}
        out = {name: jnp.zeros(shape, jnp.float8_e4m3fn) for name, shape in shapes.items()}
        return out | {name + "_scale": jnp.ones((shape[0] // 128, shape[1] // 128)) for name, shape in shapes.items()}

    kernels = KernelPolicy(interpret=True)
    assert moe.swiglu_in_kernel(jnp.bfloat16, weights(swiglu_rows.MAX_WIDTH), "w_", kernels, 1)
    assert not moe.swiglu_in_kernel(jnp.bfloat16, weights(swiglu_rows.MAX_WIDTH + 128), "w_", kernels, 1)


def test_a_verify_pass_rounds_as_decode_steps_do():
    """Exact speculation needs a token's rows the same in a decode step and in a verify pass: through the
    interpreted kernels, four one-token steps and one four-token pass write the same cache and give the same
    logits, bit for bit."""
    cfg, model = tiny_v3()
    graph, state = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(4), (2, 4), 0, cfg.vocab_size, jnp.int32)
    start = jnp.array([3, 7], jnp.int32)

    @jax.jit
    def passes(st):
        model = nnx.merge(graph, st)
        cache = model.init_cache(2, 16)
        hidden, whole, _ = model(tokens, start, cache)
        steps = []
        for t in range(4):
            step_hidden, cache, _ = model(tokens[:, t:t + 1], start + t, cache)
            steps.append(model.logits(step_hidden))
        return model.logits(hidden), whole.latent, jnp.concatenate(steps, axis=1), cache.latent

    verify_logits, verify_cache, step_logits, step_cache = passes(state)
    program = str(jax.make_jaxpr(passes)(state))
    assert all(name in program for name in KERNEL_NAMES.values())
    np.testing.assert_array_equal(np.asarray(verify_cache, np.float32), np.asarray(step_cache, np.float32))
    np.testing.assert_array_equal(np.asarray(verify_logits, np.float32), np.asarray(step_logits, np.float32))
