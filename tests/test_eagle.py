"""EAGLE / EAGLE-3 heads: published layouts load and run, greedy output equals plain decoding (a 4-layer model
with the default model's vocabulary), drafts made incrementally inside the loop equal a from-scratch
recomputation, sampled output follows the target with the head's q used, and heads that do not fit the target
are refused clearly."""
from __future__ import annotations

import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from chi_square import chi_square_p_value
from eagle_heads import write_head
from flax import nnx

from checkpoints_conv.eagle_loader import load_eagle_head
from specjax import LLM, SamplingParams
from specjax import config as config_lib
from specjax.engine.loop import LoopSpec, build_generate
from specjax.engine.proposers.base import TargetPass
from specjax.engine.proposers.eagle import HeadProposer
from specjax.engine.state import RowParams
from specjax.models.eagle import EagleHead, default_aux_layer_ids
from specjax.models.llama import FAMILY, LlamaConfig

TINY = dict(architectures=["LlamaForCausalLM"], vocab_size=61, hidden_size=32, intermediate_size=48,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
            rope_theta=1e4, tie_word_embeddings=True, max_position_embeddings=256)
TINY_CFG = LlamaConfig.from_hf_dict(TINY)
TINY_AUX = [0, 2, 3]


@pytest.fixture(scope="module")
def tiny_target():
    """A random tiny target, scaled so its next-token distributions are peaked but not one-hot."""
    graph, state = nnx.split(FAMILY.random(TINY_CFG, seed=0))
    return graph, jax.tree.map(lambda x: x * 3, state)


def _tiny_head(tmp_path, tiny_target, layout, **kwargs) -> EagleHead:
    path = write_head(tmp_path / layout, TINY, layout, scale=0.3, **kwargs)
    method = "eagle" if layout.startswith("eagle1") else "eagle3"
    return load_eagle_head(path, method, TINY_CFG, tiny_target[1], np.float32)


# ------------------------------------------------------------------------------------------------------------
# incremental drafting == recomputation from scratch
# ------------------------------------------------------------------------------------------------------------

def _reference_attention():
    """Plain causal attention over every key seen so far, kept per layer (no KV cache, no positions)."""
    keys: dict[int, tuple[jax.Array, jax.Array]] = {}

    def attend(i, q, k, v):
        old_k, old_v = keys.get(i, (k[:, :0], v[:, :0]))
        all_k, all_v = jnp.concatenate([old_k, k], 1), jnp.concatenate([old_v, v], 1)
        keys[i] = (all_k, all_v)
        group = q.shape[2] // k.shape[2]
        all_k, all_v = jnp.repeat(all_k, group, axis=2), jnp.repeat(all_v, group, axis=2)
        scores = jnp.einsum("bthd,bshd->bhts", q, all_k) * q.shape[-1] ** -0.5
        query_at = old_k.shape[1] + jnp.arange(q.shape[1])
        scores = jnp.where(jnp.arange(all_k.shape[1])[None, :] <= query_at[:, None], scores, -jnp.inf)
        return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, -1), all_v)

    return attend


def _reference_drafts(target, head: EagleHead, committed: list[int], k: int) -> list[int]:
    """The head's greedy drafts after `committed`, recomputed from nothing: one teacher-forced target pass,
    the head over every committed position, then k - 1 steps fed back its own hidden state."""
    return _reference_draft_ids(target, head, jnp.asarray([committed], jnp.int32), k).tolist()


@nnx.jit(static_argnums=3)
def _reference_draft_ids(target, head: EagleHead, seq: jax.Array, k: int) -> jax.Array:
    # One program per length: run op by op, the recomputation compiled some 500 single operations.
    n = seq.shape[1]
    cache = target.init_cache(1, n + 1)
    hidden, _, aux = target(seq, jnp.zeros((1,), jnp.int32), cache, capture_layers=tuple(head.cfg.aux_layer_ids))
    features = head.combine(aux.captured if head.cfg.method == "eagle3" else hidden)[:, :n - 1]
    attend = _reference_attention()
    out, feed = head.decode(seq[:, 1:], features, jnp.arange(n - 1)[None], attend)
    drafts = [jnp.argmax(head.target_logits(out[0, -1]))]
    hidden = feed[:, -1:]
    for i in range(k - 1):
        out, hidden = head.decode(drafts[-1].reshape(1, 1), hidden, jnp.asarray([[n - 1 + i]]), attend)
        drafts.append(jnp.argmax(head.target_logits(out[0, 0])))
    return jnp.stack(drafts)


def _greedy_rows(B: int) -> RowParams:
    return RowParams(temperature=jnp.zeros((B,)), top_k=jnp.zeros((B,), jnp.int32), top_p=jnp.ones((B,)),
                     min_p=jnp.zeros((B,)), seed=jnp.arange(B, dtype=jnp.uint32),
                     max_tokens=jnp.full((B,), 50, jnp.int32), min_tokens=jnp.zeros((B,), jnp.int32),
                     stop_ids=jnp.full((B, 1), -1, jnp.int32))


@pytest.mark.parametrize("layout, extra", [
    ("eagle1_yuhuili", {}),
    ("eagle3_yuhuili", {"draft_vocab": 40, "aux_layer_ids": TINY_AUX}),
    ("eagle3_speculators", {"aux_layer_ids": TINY_AUX, "lm_head": False}),
])
def test_incremental_drafts_equal_a_recomputation_from_scratch(tmp_path, tiny_target, layout, extra):
    """Prefill, then a verify pass that accepts 2 drafts in row 0 and none in row 1: after each observe, the
    proposer's drafts are the ones the head gives when recomputed over the committed tokens."""
    k, S = 3, 32
    target = nnx.merge(*tiny_target)
    head = _tiny_head(tmp_path, tiny_target, layout, **extra)
    graph, state = nnx.split(head)
    proposer = HeadProposer(graph, head, k, probabilistic=False)

    @jax.jit
    def run_target(tokens, start, cache):
        hidden, cache, aux = target(tokens, start, cache, capture_layers=proposer.capture_layers)
        return hidden, cache, aux.captured

    observe, propose = jax.jit(proposer.observe), jax.jit(proposer.propose)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 61, 7).tolist(), rng.integers(0, 61, 4).tolist()]
    tokens = np.zeros((2, S), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = p
        tokens[b, len(p)] = 5 + b    # the first generated token
    lengths = jnp.asarray([8, 5], jnp.int32)
    rows = _greedy_rows(2)
    zeros = jnp.zeros((2,), jnp.int32)
    hidden, cache, captured = run_target(jnp.asarray(tokens[:, :8]), zeros, target.init_cache(2, S))
    carry = proposer.init(state, jnp.asarray(tokens[:, :8]), lengths - 1, S)
    carry = observe(state, carry, TargetPass(hidden, captured, zeros), jnp.asarray(tokens), lengths, rows)
    drafts, _, carry = propose(state, carry, jnp.asarray(tokens), lengths, rows)
    for b in range(2):
        committed = tokens[b, :int(lengths[b])].tolist()
        assert drafts[b].tolist() == _reference_drafts(target, head, committed, k)

    start = lengths - 1
    verify = jnp.concatenate([jnp.asarray(tokens)[jnp.arange(2), start][:, None], drafts], axis=1)
    hidden, cache, captured = run_target(verify, start, cache)
    accepted = [2, 0]
    for b, a in enumerate(accepted):
        L = int(lengths[b])
        tokens[b, L:L + a] = np.asarray(drafts[b, :a])
        tokens[b, L + a] = (int(drafts[b, a]) + 1) % 61   # the target's own token where it rejected
    lengths = lengths + jnp.asarray(accepted) + 1
    carry = observe(state, carry, TargetPass(hidden, captured, start), jnp.asarray(tokens), lengths, rows)
    drafts, _, _ = propose(state, carry, jnp.asarray(tokens), lengths, rows)
    for b in range(2):
        committed = tokens[b, :int(lengths[b])].tolist()
        assert drafts[b].tolist() == _reference_drafts(target, head, committed, k)


# ------------------------------------------------------------------------------------------------------------
# sampling follows the target; the head's q is what verification uses
# ------------------------------------------------------------------------------------------------------------

def test_sampled_tokens_follow_the_target_and_use_the_heads_q(tmp_path, tiny_target):
    """2048 seeds of one prompt at temperature 1, three new tokens, one draft (k=1) from a probabilistic
    EAGLE-3 head with a reduced vocabulary (one-row loops, vmapped over seeds). Among runs whose first token
    is the most common one, the second token follows the target's p (chi-square) and the first draft is
    accepted at the rate sum(min(p, q)) of the head's own q; a verifier that ignored q would accept at
    sum(q * p)."""
    N, k, S = 2048, 1, 16
    head = _tiny_head(tmp_path, tiny_target, "eagle3_yuhuili", draft_vocab=30, aux_layer_ids=TINY_AUX)
    graph, state = nnx.split(head)
    proposer = HeadProposer(graph, head, k, probabilistic=True)
    prompt = np.asarray([3, 14, 15, 9, 26, 5], np.int32)
    rows = dataclasses.replace(_greedy_rows(1), temperature=jnp.ones((1,)), max_tokens=jnp.full((1,), 3, jnp.int32))
    generate = build_generate(tiny_target[0], proposer, LoopSpec(k=k, n_top=0, max_model_len=S))

    def one_run(seed):
        seeded = dataclasses.replace(rows, seed=seed[None])
        return generate(tiny_target[1], state, jnp.asarray(np.pad(prompt, (0, 2))[None]), jnp.asarray([6]),
                        seeded, S)

    final = jax.device_get(jax.jit(jax.vmap(one_run))(jnp.arange(N, dtype=jnp.uint32) + 7))
    out = final.tokens[:, 0, 6:9]
    first = np.bincount(out[:, 0]).argmax()
    chosen = out[:, 0] == first
    assert chosen.sum() > 200

    target = nnx.merge(*tiny_target)
    context = jnp.asarray(np.append(prompt, first)[None], jnp.int32)
    hidden, _, aux = target(context, jnp.zeros((1,), jnp.int32), target.init_cache(1, S),
                            capture_layers=proposer.capture_layers)
    p = np.asarray(jax.nn.softmax(target.logits(hidden[0, -1])), np.float64)
    assert chi_square_p_value(out[chosen, 1], p) > 1e-3

    carry = jax.jit(proposer.init, static_argnums=3)(state, context, jnp.asarray([7]), S)
    carry = jax.jit(proposer.observe)(state, carry, TargetPass(hidden, aux.captured, jnp.zeros((1,), jnp.int32)),
                                      jnp.pad(context, ((0, 0), (0, S - 7))), jnp.asarray([7]), rows)
    q = np.asarray(carry.first_probs[0], np.float64)
    assert np.count_nonzero(q) <= 30
    accepted = final.counters.num_accepted[chosen, 0] > 0
    with_q, without_q = np.minimum(p, q).sum(), (p * q).sum()
    assert abs(with_q - without_q) > 0.1
    assert abs(accepted.mean() - with_q) < 4 * np.sqrt(with_q * (1 - with_q) / chosen.sum())


# ------------------------------------------------------------------------------------------------------------
# published layouts on a chat-sized vocabulary: greedy output is plain decoding's, token for token
# ------------------------------------------------------------------------------------------------------------

PROMPTS = [
    "The capital of France is",
    "Q: Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
    "clips did Natalia sell altogether in April and May? A:",
    "def fibonacci(n):",
    "Write a short story about a robot who learns to paint.",
    "1, 2, 3, 4,",
]
GREEDY_64 = SamplingParams(temperature=0.0, max_tokens=64)
LEN = dict(max_model_len=384, max_num_seqs=8)


@pytest.fixture(scope="module")
def chat_config(tiny_chat_model):
    return json.loads((tiny_chat_model / "config.json").read_text())


@pytest.fixture(scope="module")
def plain_outputs(tiny_chat_model):
    llm = LLM(str(tiny_chat_model), **LEN)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY_64, use_tqdm=False)]


# The 4-layer chat model has the default model's vocabulary and tokenizer at a fraction of its cost (the shipped
# heads' test runs the default model itself).
@pytest.mark.parametrize("layout, dirname, extra", [
    ("eagle1_yuhuili", "EAGLE-SmolLM2-135M", {}),                       # method from the name, torch .bin
    # method from the config; d2t reduced vocabulary, own embedding, aux layers named by the checkpoint
    ("eagle3_speculators", "smollm2-speculator", {"draft_vocab": 8192, "embed": True,
                                                  "aux_layer_ids": [0, 1, 3]}),
])
def test_greedy_eagle_equals_plain_decoding(tiny_chat_model, chat_config, plain_outputs, tmp_path_factory,
                                            layout, dirname, extra):
    head = write_head(tmp_path_factory.mktemp(dirname), chat_config, layout, **extra)
    k = 3
    llm = LLM(str(tiny_chat_model), speculative_config={"model": str(head), "num_speculative_tokens": k}, **LEN)
    assert llm.config.speculative.method == ("eagle" if layout.startswith("eagle1") else "eagle3")
    outs = llm.generate(PROMPTS, GREEDY_64, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs
    metrics = {m.name: m for m in llm.get_metrics()}
    assert metrics["vllm:spec_decode_num_draft_tokens"].value >= k * 50


# ------------------------------------------------------------------------------------------------------------
# heads that do not fit are refused with a clear message
# ------------------------------------------------------------------------------------------------------------

def test_a_head_for_another_vocabulary_is_refused_before_compiling(default_model_dir, tmp_path):
    head = write_head(tmp_path / "EAGLE3-tiny", TINY, "eagle3_yuhuili")
    with pytest.raises(ValueError, match="vocab_size=61 differs from the target's vocab_size=49152"):
        LLM(str(default_model_dir), speculative_config={"model": str(head), "num_speculative_tokens": 3}, **LEN)


@pytest.mark.parametrize("layout, change, method, match", [
    ("eagle3_yuhuili", {"hidden_size": 48}, "eagle3", "hidden states of size 48 but the target's hidden_size is 32"),
    ("eagle1_yuhuili", {"hidden_size": 48}, "eagle", "hidden states of size 48"),
    ("eagle3_yuhuili", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 30]}}, "eagle3",
     "eagle_aux_hidden_state_layer_ids"),
    ("eagle3_yuhuili", {}, "eagle", "describes a 'eagle3' head"),
])
def test_heads_that_do_not_fit_the_target_are_refused(tmp_path, tiny_target, layout, change, method, match):
    head = write_head(tmp_path / "head", {**TINY, **change}, layout)
    if "eagle_config" in change:
        config = json.loads((head / "config.json").read_text())
        (head / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=match):
        load_eagle_head(head, method, TINY_CFG, tiny_target[1], np.float32)


def test_a_missing_tensor_is_named(tmp_path, tiny_target):
    from safetensors.numpy import load_file, save_file

    head = write_head(tmp_path / "head", TINY, "eagle3_yuhuili", aux_layer_ids=TINY_AUX)
    tensors = load_file(head / "model.safetensors")
    del tensors["midlayer.hidden_norm.weight"]
    save_file(tensors, head / "model.safetensors")
    with pytest.raises(ValueError, match="'layers.0.hidden_norm.weight' is missing"):
        load_eagle_head(head, "eagle3", TINY_CFG, tiny_target[1], np.float32)


def test_pytorch_bin_without_torch_says_how_to_convert(tmp_path, tiny_target, monkeypatch):
    head = write_head(tmp_path / "head", TINY, "eagle1_yuhuili")
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ImportError, match="model.safetensors"):
        load_eagle_head(head, "eagle", TINY_CFG, tiny_target[1], np.float32)


def test_method_is_inferred_from_a_local_heads_config(tmp_path):
    speculators = write_head(tmp_path / "plain_name_a", TINY, "eagle3_speculators")
    yuhuili3 = write_head(tmp_path / "plain_name_b", TINY, "eagle3_yuhuili")
    for path in (speculators, yuhuili3):
        cfg = config_lib.SpeculativeConfig.from_dict({"model": str(path), "num_speculative_tokens": 2},
                                                     target_max_model_len=128, target_tensor_parallel_size=1)
        assert cfg.method == "eagle3"


def test_shared_weights_are_the_targets_arrays(tmp_path, tiny_target):
    """A head without embed_tokens / lm_head reads the target's own arrays (no copy)."""
    head = _tiny_head(tmp_path, tiny_target, "eagle3_speculators", aux_layer_ids=TINY_AUX, lm_head=False)
    assert head.cfg.lm_head_source == "target_embed"
    assert head.embed[...] is tiny_target[1]["embed"][...]
    assert head.lm_head[...] is tiny_target[1]["embed"][...]
    out = head.logits(jnp.ones((1, 1, 32)))
    np.testing.assert_allclose(out, jnp.ones((1, 1, 32)) @ tiny_target[1]["embed"][...].T, rtol=1e-5)


def test_default_aux_layers_are_vllms_and_stay_inside_small_targets():
    assert default_aux_layer_ids(32) == (2, 16, 29) and default_aux_layer_ids(30) == (2, 15, 27)
    assert default_aux_layer_ids(2) == (1, 1, 0) and default_aux_layer_ids(1) == (0, 0, 0)
