"""The Flax models on loaded weights against transformers' PyTorch forward: logits within 1e-4 relative (fp32)
for every tiny family (sliding windows included, on prompts well past them) and through an orbax round trip (the
real SmolLM2 against its GGUF-loaded model: test_gguf_default_model.py, beside the weights' test that loads the
same reference)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dataclasses
import weakref

from checkpoints_conv import convert_hf_to_orbax
from conftest import TINY_FAMILIES, jitted_forward, read_checkpoint
from specjax.kernels.policy import KernelPolicy
from specjax.models.family import unstack_leaves
from specjax.models.llama import FAMILY, LlamaConfig, stack_layers, unstack_layers

REL_TOL = 1e-4
TINY_PROMPT_LENGTHS = (7, 3, 12)   # rows of different lengths share one right-padded batch
WINDOW_FAMILIES = ("mistral_window", "qwen2_window", "qwen3_layer_types")
PAST_THE_WINDOW = (41, 9, 26)      # the tiny windows are 6 and 8 tokens


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def flax_logits(cfg: LlamaConfig, params: dict, prompts: list[list[int]], unroll_layers: bool | None = None,
                kernels: KernelPolicy = KernelPolicy(), fresh: bool = False) -> list[np.ndarray]:
    """Logits [len, V] per prompt from one right-padded batched prefill starting at position 0 (`fresh`: as
    the engine's prefill, which may take the fused attention path)."""
    width = max(len(p) for p in prompts)
    tokens = np.zeros((len(prompts), width), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, :len(prompt)] = prompt
    model = FAMILY.build(cfg, params, unroll_layers=unroll_layers, kernels=kernels)
    cache = model.init_cache(len(prompts), width)
    # Full fp32 matmuls: on GPUs JAX's default precision for fp32 is TF32 (about 1e-3 relative).
    with jax.default_matmul_precision("highest"):
        _, logits, _ = jitted_forward(model, jnp.asarray(tokens), jnp.zeros((len(prompts),), jnp.int32), cache,
                                      fresh=fresh)
        logits = np.asarray(logits)
    return [logits[row, :len(prompt)] for row, prompt in enumerate(prompts)]


def torch_logits(model, prompts: list[list[int]]) -> list[np.ndarray]:
    """Reference logits, each prompt run alone (no padding involved)."""
    import torch

    with torch.no_grad():
        return [model(torch.tensor([prompt])).logits[0].float().numpy() for prompt in prompts]


def random_prompts(vocab_size: int, lengths, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, size=n).tolist() for n in lengths]


def assert_logits_match(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    for row, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, row
        error = relative_error(g, w)
        assert error <= REL_TOL, f"row {row}: relative error {error:.2e} > {REL_TOL}"
        assert (g.argmax(-1) == w.argmax(-1)).all(), row


@pytest.fixture(scope="module")
def torch_reference():
    def load(model_dir):
        import torch
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    return load


@pytest.mark.parametrize("unroll", [False, True], ids=["scanned", "unrolled"])
@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_tiny_family_logits_match_transformers(tiny_checkpoint_factory, torch_reference, family, unroll):
    """Both layer layouts: stacked weights under lax.scan (the CPU default) and per-layer weights unrolled
    (the GPU default)."""
    model_dir = tiny_checkpoint_factory(family)
    cfg, params = read_checkpoint(model_dir, dtype="float32")
    prompts = random_prompts(cfg.vocab_size, TINY_PROMPT_LENGTHS)
    got = flax_logits(cfg, params, prompts, unroll_layers=unroll)
    assert_logits_match(got, torch_logits(torch_reference(model_dir), prompts))


# The fused prefill (XLA's dot_product_attention standing in for cuDNN) from the first token: a window model must
# leave it for the cache path where the prompt outgrows a window, and may keep it where none does.
FUSED_PREFILL = KernelPolicy(prefill_fused_impl="xla", prefill_fused_min_tokens=1)


@pytest.mark.parametrize("kernels, fresh", [(KernelPolicy(), False), (FUSED_PREFILL, True)], ids=["forward", "fused"])
@pytest.mark.parametrize("unroll", [False, True], ids=["scanned", "unrolled"])
@pytest.mark.parametrize("family", WINDOW_FAMILIES)
def test_sliding_window_logits_match_transformers_past_the_window(tiny_checkpoint_factory, torch_reference, family,
                                                                  unroll, kernels, fresh):
    model_dir = tiny_checkpoint_factory(family)
    cfg, params = read_checkpoint(model_dir, dtype="float32")
    assert any(cfg.attention_windows) and max(PAST_THE_WINDOW) > 4 * max(cfg.attention_windows)
    prompts = random_prompts(cfg.vocab_size, PAST_THE_WINDOW, seed=2)
    got = flax_logits(cfg, params, prompts, unroll_layers=unroll, kernels=kernels, fresh=fresh)
    assert_logits_match(got, torch_logits(torch_reference(model_dir), prompts))


@pytest.mark.parametrize("family", WINDOW_FAMILIES)
def test_the_window_matters_past_it_and_not_before(tiny_checkpoint_factory, family):
    """Guard that the window families exercise the window: without it, logits past the window change; within
    it they are the same."""
    cfg, params = read_checkpoint(tiny_checkpoint_factory(family))
    unwindowed = dataclasses.replace(cfg, attention_windows=())
    short = random_prompts(cfg.vocab_size, (min(w for w in cfg.attention_windows if w),), seed=3)
    np.testing.assert_allclose(flax_logits(unwindowed, params, short)[0], flax_logits(cfg, params, short)[0],
                               rtol=1e-6, atol=1e-6)
    long = random_prompts(cfg.vocab_size, (30,), seed=3)
    assert relative_error(flax_logits(unwindowed, params, long)[0], flax_logits(cfg, params, long)[0]) > 1e-3


def test_per_layer_layout_round_trips_and_releases_the_stacked_leaves(tiny_checkpoint_factory):
    cfg, params = read_checkpoint(tiny_checkpoint_factory("qwen3"))
    stacked = {name: np.asarray(leaf) for name, leaf in params["layers"].items()}
    per_layer = unstack_layers(params, cfg.num_layers)
    assert "layers" not in params   # consumed: the stacked leaves are no longer held
    assert sorted(per_layer["layers"]) == list(range(cfg.num_layers))
    for i in range(cfg.num_layers):
        for name, leaf in per_layer["layers"][i].items():
            np.testing.assert_array_equal(leaf, stacked[name][i])
    for name, leaf in stack_layers(per_layer)["layers"].items():
        np.testing.assert_array_equal(leaf, stacked[name])


class _WatchedLeaves(dict):
    """Stacked leaves that note, each time one is taken, how many of them are still alive."""

    def __init__(self, leaves: dict):
        super().__init__(leaves)
        self.refs = [weakref.ref(leaf) for leaf in leaves.values()]
        self.alive_when_taken: list[int] = []

    def pop(self, key, *default):
        self.alive_when_taken.append(sum(ref() is not None for ref in self.refs))
        return super().pop(key, *default)


def test_unstacking_frees_each_stacked_leaf_before_taking_the_next():
    """What lets a model whose weights fill most of a device load with its layers unrolled: at most one leaf is
    held twice (the llama and DeepSeek families unstack through this)."""
    stacked = _WatchedLeaves({name: jnp.arange(12.0).reshape(3, 4) + i for i, name in enumerate("abcd")})
    layers = unstack_leaves(stacked, 3)
    assert stacked.alive_when_taken == [4, 3, 2, 1] and not stacked
    assert all(ref() is None for ref in stacked.refs)
    np.testing.assert_array_equal(layers[2]["c"], np.arange(8.0, 12.0) + 2)


def test_llama3_rope_scaling_matters(tiny_checkpoint_factory):
    """Guard that the llama3 family really exercises scaled RoPE: dropping the scaling changes the logits."""
    model_dir = tiny_checkpoint_factory("llama3_tied")
    cfg, params = read_checkpoint(model_dir)
    assert cfg.rope_scaling and cfg.rope_scaling["rope_type"] == "llama3"
    prompts = random_prompts(cfg.vocab_size, (40,))
    unscaled = dataclasses.replace(cfg, rope_scaling=None)
    assert relative_error(flax_logits(unscaled, params, prompts)[0], flax_logits(cfg, params, prompts)[0]) > 1e-3


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_orbax_round_trip_logits_match_transformers(tmp_path, tiny_checkpoint_factory, torch_reference, family):
    model_dir = tiny_checkpoint_factory(family)
    converted = convert_hf_to_orbax(model_dir, tmp_path / "converted")
    cfg, params = read_checkpoint(converted)
    prompts = random_prompts(cfg.vocab_size, TINY_PROMPT_LENGTHS, seed=1)
    got = flax_logits(cfg, params, prompts)
    assert_logits_match(got, torch_logits(torch_reference(model_dir), prompts))
