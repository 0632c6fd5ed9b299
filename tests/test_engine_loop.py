"""The jitted loop on tiny random models: speculation is lossless, limits hold, one while_loop, counters."""
from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specjax.engine.loop import LoopSpec, build_generate, loop_compiler_options
from specjax.engine.proposers.base import NoProposer
from specjax.engine.proposers.draft_model import DraftModelProposer
from specjax.engine.proposers.ngram import NgramProposer
from specjax.engine.state import RowParams
from specjax.kernels.policy import KernelPolicy
from specjax.models.llama import FAMILY, LlamaConfig

V = 61
CFG = LlamaConfig(architecture="LlamaForCausalLM", vocab_size=V, hidden_size=32, intermediate_size=48,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=1e4,
                  rope_scaling=None, tie_word_embeddings=True, attention_bias=False, qk_norm=False,
                  max_position_embeddings=256, bos_token_id=None, eos_token_ids=(), torch_dtype="float32")
MAX_LEN = 64
LENGTHS = np.array([9, 4, 1, 7])


def _sharp_model(seed: int, kernels: KernelPolicy = KernelPolicy()):
    """Random weights scaled up so next-token distributions are peaked (repetitive, n-gram friendly)."""
    model = FAMILY.random(CFG, seed=seed, kernels=kernels)
    graph, state = nnx.split(model)
    return graph, jax.tree.map(lambda x: x * 6, state), model


TARGET = _sharp_model(0)
DRAFT = _sharp_model(1)
# Every kernel as on a GPU (interpret mode), the top-k / top-p search from the smallest batch.
ALL_KERNELS = KernelPolicy(interpret=True, search_min_elements=1)


def _rows(B, temperature=0.0, max_tokens=(30, 30, 12, 30), min_tokens=0, stop_ids=((-1,),) * 4, seed=None):
    return RowParams(
        temperature=jnp.full((B,), temperature, jnp.float32), top_k=jnp.zeros((B,), jnp.int32),
        top_p=jnp.ones((B,), jnp.float32), min_p=jnp.zeros((B,), jnp.float32),
        seed=jnp.arange(B, dtype=jnp.uint32) if seed is None else jnp.asarray(seed, jnp.uint32),
        max_tokens=jnp.asarray(max_tokens, jnp.int32), min_tokens=jnp.full((B,), min_tokens, jnp.int32),
        stop_ids=jnp.asarray(stop_ids, jnp.int32))


def _prompts():
    rng = np.random.RandomState(0)
    tokens = np.zeros((4, 16), np.int32)
    for b, n in enumerate(LENGTHS):
        tokens[b, :n] = rng.randint(0, V, n)
    return jnp.asarray(tokens), jnp.asarray(LENGTHS, jnp.int32)


def _run(proposer, rows, k, synthetic=None, target=TARGET, draft=DRAFT):
    fn = jax.jit(build_generate(target[0], proposer, LoopSpec(k=k, n_top=0, max_model_len=MAX_LEN)),
                 static_argnums=5)
    tokens, lengths = _prompts()
    rates = None if synthetic is None else jnp.asarray(synthetic, jnp.float32)
    return fn(target[1], draft[1] if isinstance(proposer, DraftModelProposer) else None,
              tokens, lengths, rows, MAX_LEN + k + 1, rates)


def _generated(state):
    return [np.asarray(state.tokens[b, int(state.prompt_lengths[b]):int(state.lengths[b])]).tolist()
            for b in range(state.lengths.shape[0])]


@pytest.fixture(scope="module")
def plain():
    return _generated(_run(NoProposer(), _rows(4), 0))


def _draft_proposer(k, probabilistic=False, draft=DRAFT):
    return DraftModelProposer(draft[0], k, probabilistic, cache_bytes=draft[2].cache_bytes)


@pytest.mark.parametrize("make", [lambda k: NgramProposer(k, 1, 3), _draft_proposer], ids=["ngram", "draft"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculation_equals_plain_decoding(plain, make, k):
    state = _run(make(k), _rows(4), k)
    assert _generated(state) == plain
    assert [len(g) for g in plain] == [30, 30, 12, 30]


def test_greedy_speculation_equals_plain_decoding_with_the_kernels(plain):
    """The model through the Pallas kernels (interpret mode, as on a GPU: the fused projections, attention):
    a verify pass rounds each token as a decode step does, so speculation still reproduces plain decoding
    exactly; and plain decoding matches the XLA path's tokens on this peaked model."""
    target = _sharp_model(0, ALL_KERNELS)
    with_kernels = _generated(_run(NoProposer(), _rows(4), 0, target=target))
    assert _generated(_run(NgramProposer(3, 1, 3), _rows(4), 3, target=target)) == with_kernels
    assert with_kernels == plain


def test_self_drafting_accepts_every_draft_the_limits_allow():
    k = 3
    proposer = DraftModelProposer(TARGET[0], k, False, cache_bytes=TARGET[2].cache_bytes)
    fn = jax.jit(build_generate(TARGET[0], proposer, LoopSpec(k=k, n_top=0, max_model_len=MAX_LEN)),
                 static_argnums=5)
    tokens, lengths = _prompts()
    state = fn(TARGET[1], TARGET[1], tokens, lengths, _rows(4), MAX_LEN + k + 1)
    c = jax.device_get(state.counters)
    # 30 new tokens: 1 from prefill, then 29 = 7 full steps of 4 and a last step whose budget of one token
    # leaves no room for a draft.
    np.testing.assert_array_equal(c.num_drafts[[0, 1, 3]], 7)
    np.testing.assert_array_equal(c.num_accepted[[0, 1, 3]], 7 * 3)
    np.testing.assert_array_equal(c.num_draft_tokens, c.num_accepted)


def test_max_model_len_and_max_tokens_bound_the_output():
    k = 5
    rows = _rows(4, max_tokens=(200, 3, 1, 0))
    state = _run(NgramProposer(k, 1, 3), rows, k)
    lengths = np.asarray(state.lengths)
    assert lengths[0] == MAX_LEN  # stopped by max_model_len, not past it
    np.testing.assert_array_equal(lengths[1:] - LENGTHS[1:], [3, 1, 0])


def test_stop_ids_end_a_row_and_min_tokens_masks_them(plain):
    stop = plain[0][4]
    first = plain[0].index(stop)
    stop_ids = ((stop,),) * 4
    state = _run(NgramProposer(3, 1, 3), _rows(4, stop_ids=stop_ids), 3)
    assert _generated(state)[0] == plain[0][:first + 1]
    state = _run(NgramProposer(3, 1, 3), _rows(4, stop_ids=stop_ids, min_tokens=30), 3)
    assert all(stop not in g for g in _generated(state))


def test_seeded_sampling_is_batch_invariant():
    """A seeded row draws the same tokens whatever its neighbours are."""
    k = 3
    seeds = np.array([11, 12, 13, 14])
    full = _generated(_run(_draft_proposer(k, True), _rows(4, temperature=1.0, seed=seeds), k))
    other = _generated(_run(_draft_proposer(k, True), _rows(4, temperature=1.0, seed=[11, 99, 98, 97]), k))
    assert full[0] == other[0]
    assert full[1] != other[1]


def test_sampled_speculation_through_the_radix_search_draws_what_the_sort_would():
    """Top-k / top-p by the sort-free search inside the loop (interpret mode, as on a GPU, every kernel): it
    keeps the tokens the sort keeps, so a seeded, probabilistically drafted run emits the very same tokens."""
    k = 3
    rows = dataclasses.replace(_rows(4, temperature=1.0, seed=[5, 6, 7, 8]),
                               top_k=jnp.asarray([0, 7, 0, 20], jnp.int32),
                               top_p=jnp.asarray([0.8, 1.0, 0.6, 0.9], jnp.float32))
    sorted_run = _generated(_run(_draft_proposer(k, True), rows, k))
    target, draft = _sharp_model(0, ALL_KERNELS), _sharp_model(1, ALL_KERNELS)
    searched_run = _generated(_run(_draft_proposer(k, True, draft), rows, k, target=target, draft=draft))
    assert searched_run == sorted_run


@pytest.mark.parametrize("kernels, searches", [(KernelPolicy(impl="reference"), False), (ALL_KERNELS, True)])
def test_sampling_filters_follow_the_models_kernel_policy(kernels, searches):
    """The models' kernel policy reaches top-k / top-p too, at every call site: the target's verify and plain
    draws and the draft's own distribution (impl "reference" keeps the sort on a GPU as well)."""
    k = 2
    graph, state, _ = _sharp_model(0, kernels)
    draft = _sharp_model(1, kernels)
    rows = dataclasses.replace(_rows(4, temperature=1.0), top_p=jnp.full((4,), 0.9, jnp.float32))
    fn = build_generate(graph, _draft_proposer(k, True, draft), LoopSpec(k=k, n_top=0, max_model_len=MAX_LEN))
    tokens, lengths = _prompts()
    program = str(jax.make_jaxpr(functools.partial(fn, cache_len=MAX_LEN + k + 1))(state, draft[1], tokens,
                                                                                  lengths, rows))
    sites = program.count("name=top_k_top_p_search_mass")
    assert sites >= 3 if searches else sites == 0


def test_counters_match_a_hand_trace():
    """Synthetic acceptance with rates (1, 0): every step accepts exactly the first draft."""
    k = 2
    state = _run(NgramProposer(k, 1, 1), _rows(4, max_tokens=(9, 9, 9, 9)), k, synthetic=(1.0, 0.0))
    c = jax.device_get(state.counters)
    out = _generated(state)
    for b in range(4):
        # Steps that had drafts each emit 2 tokens; steps without drafts emit 1.
        drafted = int(c.num_drafts[b])
        assert int(c.num_accepted[b]) == drafted
        assert c.accepted_per_pos[b].tolist() == [drafted, 0]
        assert len(out[b]) == 9


def test_decode_loop_is_one_while_primitive():
    fn = build_generate(TARGET[0], NgramProposer(3, 1, 3), LoopSpec(k=3, n_top=0, max_model_len=MAX_LEN))
    tokens, lengths = _prompts()
    jaxpr = jax.make_jaxpr(fn, static_argnums=5)(TARGET[1], None, tokens, lengths, _rows(4), MAX_LEN + 4)
    top_level = [eqn.primitive.name for eqn in jaxpr.jaxpr.eqns]
    assert top_level.count("while") == 1


@pytest.mark.parametrize("dtype, precision", [(jnp.float32, "HIGHEST"), (jnp.bfloat16, "DEFAULT")])
def test_float32_loops_pin_full_precision_matmuls(dtype, precision):
    """On GPUs the default float32 matmul is TF32, under which verify and decode round differently."""
    fn = jax.jit(build_generate(TARGET[0], NgramProposer(3, 1, 3), LoopSpec(k=3, n_top=0, max_model_len=MAX_LEN)),
                 static_argnums=5)
    tokens, lengths = _prompts()
    state = jax.tree.map(lambda x: x.astype(dtype), TARGET[1])
    text = fn.lower(state, None, tokens, lengths, _rows(4), MAX_LEN + 4).as_text()
    precisions = set(re.findall(r"dot_general.*precision = \[(\w+), \w+\]", text))
    assert precisions == {precision}


def test_loop_compiler_options_are_options_xla_accepts(monkeypatch):
    """On GPUs the loop compiles with WHILE/CONDITIONAL command buffers (the whole loop one CUDA graph);
    elsewhere with XLA's defaults. XLA parses the options on any backend, so a misspelt kind fails here."""
    if jax.default_backend() != "gpu":
        assert loop_compiler_options() == {}
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    options = loop_compiler_options()
    kinds = options["xla_gpu_enable_command_buffer"].split(",")
    assert {"WHILE", "CONDITIONAL", "FUSION", "CUBLAS", "CUSTOM_CALL"} <= set(kinds)
    monkeypatch.undo()
    assert float(jax.jit(lambda x: x + 1, compiler_options=options)(1.0)) == 2.0
