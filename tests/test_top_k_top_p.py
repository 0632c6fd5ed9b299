"""Top-k / top-p keep masks: the sort-free radix search (Pallas, interpret mode here) keeps exactly the
tokens the sort keeps, under vLLM's rules, and the dispatcher picks it only where it should run."""
from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.kernels import top_k_top_p as dispatcher
from specjax.kernels.policy import KernelPolicy, has_kernels
from specjax.kernels.top_k_top_p_reference import from_ordered_keys, keep_mask_reference, ordered_keys
from specjax.kernels.top_k_top_p_triton import SearchConfig, keep_mask_triton
from specjax.parallel.mesh import traced_with

# Small chunks and blocks, so that a small vocabulary still spans several programs and steps per row.
SMALL = SearchConfig(max_chunks=4, block=32)


# One program per shape, not the operations one by one.
_search = jax.jit(keep_mask_triton, static_argnames=("interpret", "config"))
_sort = jax.jit(keep_mask_reference)


def search(logits, top_k, top_p, config=SMALL):
    return np.asarray(_search(jnp.asarray(logits, jnp.float32), jnp.asarray(top_k, jnp.int32),
                              jnp.asarray(top_p, jnp.float32), interpret=True, config=config))


def sort(logits, top_k, top_p):
    return np.asarray(_sort(jnp.asarray(logits, jnp.float32), jnp.asarray(top_k, jnp.int32),
                            jnp.asarray(top_p, jnp.float32)))


def vllm_rule(row: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """vLLM's top-k then top-p for one row in float64: keep a token unless the mass strictly above it (in the
    top-k set) reaches top_p."""
    vocab = len(row)
    if 0 < top_k < vocab:
        row = np.where(row >= np.sort(row)[::-1][top_k - 1], row, -np.inf)
    if top_p >= 1:
        return np.isfinite(row)
    probs = np.exp(row - row.max())
    probs /= probs.sum()
    above = np.array([probs[row > value].sum() for value in row])
    return (above < top_p) & np.isfinite(row)


def test_ordered_keys_keep_the_order_of_floats_and_invert():
    values = np.array([-np.inf, -3e38, -2.0, -1.0, -1e-30, -0.0, 0.0, 1e-30, 1.0, 2.5, 3e38, np.inf],
                      np.float32)
    keys = np.asarray(ordered_keys(jnp.asarray(values)))
    assert (np.diff(keys[:6]) > 0).all() and keys[5] == keys[6] and (np.diff(keys[6:]) > 0).all()
    back = np.asarray(from_ordered_keys(jnp.asarray(keys)))
    np.testing.assert_array_equal(back, np.where(values == 0, np.float32(0), values))


@pytest.mark.parametrize("scale, offset", [(2.0, 0.0), (0.3, 0.0), (4.0, -40.0), (1.0, 25.0)],
                         ids=["peaked", "flat", "negative", "positive"])
def test_search_keeps_what_the_sort_keeps(scale, offset):
    """Rows with top-p only, top-k only, both, neither, on logits of several shapes and signs."""
    rng = np.random.default_rng(int(scale * 10 + offset))
    vocab = 777     # not a multiple of a block: the last one is partly outside the row
    logits = scale * rng.gumbel(size=(8, vocab)) + offset
    top_k = np.array([0, 0, 50, 5, 1, vocab, 300, -1])[:, None]
    top_p = np.array([0.9, 0.3, 1.0, 0.95, 0.5, 1.0, 0.99, 0.05])[:, None]
    kept = search(logits, top_k, top_p)
    np.testing.assert_array_equal(kept, sort(logits, top_k, top_p))
    for row in range(len(logits)):
        np.testing.assert_array_equal(kept[row], vllm_rule(logits[row].astype(np.float32), top_k[row, 0],
                                                           top_p[row, 0]))


@pytest.mark.parametrize("config", [SMALL, SearchConfig(radix_bits=2, max_chunks=2, block=64)], ids=["4bit", "2bit"])
def test_search_keeps_ties_signed_zeros_and_masked_tokens_like_the_sort(config):
    """Integer logits (many ties, some at the top-k and top-p cuts), -0.0 beside 0.0, and -inf tokens (min-p's
    mask) that top-k counts and top-p weighs as zero."""
    rng = np.random.default_rng(3)
    logits = np.round(rng.normal(size=(6, 200)) * 2)
    logits[0, :10] = -0.0
    logits[1, :150] = -np.inf
    logits[2, 1:] = -np.inf
    top_k = np.array([7, 60, 3, 0, 20, 199])[:, None]
    top_p = np.array([1.0, 0.8, 0.5, 0.6, 0.9, 0.999])[:, None]
    np.testing.assert_array_equal(search(logits, top_k, top_p, config), sort(logits, top_k, top_p))


def test_a_vanishing_top_p_keeps_the_top_token_and_its_ties():
    logits = np.array([[1.0, 3.0, 3.0, -2.0, 0.5] * 20, [4.0] + [0.0] * 99])
    top_k, top_p = np.array([[0], [0]]), np.array([[1e-45], [1e-30]])
    kept = search(logits, top_k, top_p)
    np.testing.assert_array_equal(kept, sort(logits, top_k, top_p))
    assert kept[0].sum() == 40 and kept[1].sum() == 1


def test_search_keeps_the_same_tokens_whatever_the_rows_around_it():
    """The chunking is the vocabulary's: a row keeps the same tokens alone and in a batch (decode and verify
    steps agree)."""
    logits = 0.5 * np.random.default_rng(5).gumbel(size=(5, 2, 500))
    top_k, top_p = np.full((5, 2, 1), 100), np.full((5, 2, 1), 0.9)
    together = search(logits, top_k, top_p)
    alone = search(logits[3:4, 1:], top_k[3:4, 1:], top_p[3:4, 1:])
    np.testing.assert_array_equal(together[3:4, 1:], alone)


def test_search_under_vmap():
    """functional.make_generate_fn may be vmapped over seeds: the kernels then run batched."""
    logits = np.random.default_rng(4).gumbel(size=(3, 2, 300))
    top_k, top_p = np.full((3, 2, 1), 20), np.full((3, 2, 1), 0.7)
    batched = jax.jit(jax.vmap(lambda x, k, p: keep_mask_triton(x, k, p, interpret=True, config=SMALL)))(
        jnp.asarray(logits, jnp.float32), jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p, jnp.float32))
    np.testing.assert_array_equal(np.asarray(batched), sort(logits, top_k, top_p))


def test_search_with_the_default_launch_parameters():
    logits = 1.5 * np.random.default_rng(9).gumbel(size=(2, 5000))
    top_k, top_p = np.array([[0], [40]]), np.array([[0.8], [0.95]])
    for config in (SearchConfig(), dispatcher.LARGE_BATCH_CONFIG):
        np.testing.assert_array_equal(search(logits, top_k, top_p, config=config), sort(logits, top_k, top_p))


def fake_device(platform, capability=None):
    return types.SimpleNamespace(platform=platform, compute_capability=capability)


def chosen(device, shape, impl="auto"):
    """What keep_mask runs for logits of `shape` under a policy for `device`: None (the sort) or the search's
    SearchConfig; the traced program must contain the kernel exactly when the search is chosen."""
    kernels = KernelPolicy(impl=impl, device=device)
    elements = dispatcher.batch_elements(shape)
    lead = shape[:-1] + (1,)

    def keep(logits):
        return dispatcher.keep_mask(logits, jnp.zeros(lead, jnp.int32), jnp.ones(lead), kernels=kernels)

    program = str(jax.make_jaxpr(keep)(jax.ShapeDtypeStruct(shape, jnp.float32)))
    assert ("pallas_call" in program) == kernels.use_search(elements)
    return dispatcher.search_config(kernels, elements) if kernels.use_search(elements) else None


def test_dispatcher_searches_on_ampere_and_newer_for_large_batches():
    h200 = fake_device("gpu", "9.0")
    assert chosen(h200, (1, 128256)) is None                  # batch 1: the sort
    assert chosen(h200, (1, 5, 128256)) is None               # and its verify step alike
    assert chosen(h200, (8, 128256)) == SearchConfig()
    assert chosen(h200, (8, 5, 128256)) == SearchConfig()
    assert chosen(h200, (64, 128256)) == dispatcher.LARGE_BATCH_CONFIG
    assert chosen(h200, (2, 49152)) is None
    assert chosen(h200, (3, 49152)) == SearchConfig()
    assert chosen(fake_device("gpu", "7.5"), (64, 128256)) is None      # T4
    assert chosen(fake_device("cpu"), (64, 128256)) is None
    assert chosen(fake_device("cpu"), (1, 100), impl="triton") == SearchConfig()
    assert chosen(h200, (64, 128256), impl="reference") is None


def test_dispatcher_leaves_tensor_parallel_logits_to_the_sort():
    two_devices = types.SimpleNamespace(mesh=types.SimpleNamespace(size=2))
    with traced_with(two_devices):
        assert chosen(fake_device("gpu", "9.0"), (64, 128256), impl="triton") is None


def test_search_config_names_a_wrong_radix():
    with pytest.raises(ValueError, match="radix_bits"):
        SearchConfig(radix_bits=3)


def test_dispatcher_names_a_wrong_impl():
    with pytest.raises(ValueError, match="impl must be one of .* got 'cuda'"):
        dispatcher.keep_mask(jnp.zeros((1, 4)), jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1)),
                             kernels=KernelPolicy(impl="cuda"))


def test_sampling_filters_through_the_dispatcher_inside_jit():
    """processed_probs under jit with the search chosen by the policy: the kept set is the sort's."""
    from specjax.engine import sampling
    logits = jnp.asarray(np.random.default_rng(2).gumbel(size=(3, 400)), jnp.float32)
    params = (jnp.ones(3), jnp.array([0, 30, 0], jnp.int32), jnp.array([0.9, 1.0, 0.5]), jnp.zeros(3))
    expected = np.asarray(jax.jit(sampling.processed_probs)(logits, *params)) > 0
    searching = KernelPolicy(interpret=True, search_min_elements=1)

    def probs(*args):
        return sampling.processed_probs(*args, kernels=searching)

    assert "pallas_call" in str(jax.make_jaxpr(probs)(logits, *params))
    kept = np.asarray(jax.jit(probs)(logits, *params)) > 0
    np.testing.assert_array_equal(kept, expected)


@pytest.mark.skipif(not has_kernels(jax.devices()[0]), reason="needs an NVIDIA sm_80+ GPU")
@pytest.mark.parametrize("config", [SearchConfig(), dispatcher.LARGE_BATCH_CONFIG], ids=["4bit", "2bit"])
@pytest.mark.parametrize("vocab", [49152, 128256])
def test_compiled_search_keeps_what_the_sort_keeps_on_the_gpu(vocab, config):
    logits = jnp.asarray(2.0 * np.random.default_rng(vocab).gumbel(size=(12, vocab)), jnp.float32)
    top_k = jnp.asarray([0, 50, 1, 0, 1000, 0, 20, 0, 0, 5, 0, 100], jnp.int32)[:, None]
    top_p = jnp.asarray([0.9, 1.0, 1.0, 0.5, 0.95, 0.99, 0.8, 0.999, 0.1, 1.0, 0.7, 0.3])[:, None]
    searched = jax.jit(lambda *a: keep_mask_triton(*a, config=config))(logits, top_k, top_p)
    np.testing.assert_array_equal(np.asarray(searched), np.asarray(keep_mask_reference(logits, top_k, top_p)))
