"""MTP speculation (method "mtp") with a target's own MTP layer, DeepSeek-V3's and MiMo's layouts: the first step
and chained steps against transformers' MTP layer on the same weights, greedy output equal to plain decoding at
k = 1, 2, 3, the sampled distribution, a "perfect MTP" that accepts every draft, vLLM's config rules and
metrics."""
from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from chi_square import chi_square_p_value
from deepseek_checkpoints import save_tiny_deepseek_with_mtp
from flax import nnx
from mimo_checkpoints import save_tiny_mimo
from safetensors.torch import load_file, save_file
from transformers.cache_utils import MtpCache

from checkpoints_conv.mtp_loader import load_mtp_head
from conftest import read_checkpoint
from specjax import LLM, SamplingParams
from specjax.config import SpeculativeConfig
from specjax.engine.loop import LoopSpec, build_generate
from specjax.engine.proposers.base import TargetPass
from specjax.engine.proposers.eagle import HeadProposer
from specjax.engine.rows import greedy_rows
from specjax.models.registry import config_from_dir

REL_TOL = 1e-4
LIMITS = dict(max_model_len=96, max_num_seqs=4)
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6, 9, 11]}, {"prompt_token_ids": [40, 41]},
           {"prompt_token_ids": [9, 3, 8, 20, 31]}]   # ids within both tiny vocabularies
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


LAYOUTS = ("deepseek", "mimo")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """layout -> (transformers target, transformers MtpModel, checkpoint directory in that MTP layout)."""
    made = {}

    def make(layout: str):
        if layout not in made:
            out = tmp_path_factory.mktemp(f"{layout}_mtp")
            made[layout] = save_tiny_deepseek_with_mtp("v3", out) if layout == "deepseek" else save_tiny_mimo(out)
        return made[layout]

    return make


@pytest.fixture(scope="module")
def with_mtp(checkpoints):
    return checkpoints("deepseek")


def load(path):
    """The target module and the MTP head built from the checkpoint (fp32)."""
    cfg, params = read_checkpoint(path, dtype="float32")
    target = config_from_dir(path)[0].build(cfg, params, unroll_layers=False)
    return target, load_mtp_head(path, cfg, nnx.state(target), np.float32)


@pytest.fixture(scope="module")
def loaded(with_mtp):
    return load(with_mtp[2])


def target_pass(target, tokens: np.ndarray, cache=None, start=None):
    B = tokens.shape[0]
    start = jnp.zeros((B,), jnp.int32) if start is None else start
    cache = target.init_cache(B, 64) if cache is None else cache
    with jax.default_matmul_precision("highest"):
        return target(jnp.asarray(tokens, jnp.int32), start, cache)


def hf_first_step(hf_target, hf_mtp, tokens: list[int]):
    """transformers' MTP layer over a sequence: (token t+1, the target's final hidden state at t) for every t,
    the embedding at position 0 zeroed as vLLM does; (post-norm outputs, logits, the MtpCache it filled)."""
    T = len(tokens) - 1
    with torch.no_grad():
        hidden = hf_target(torch.tensor([tokens[:T]]), output_hidden_states=True).hidden_states[-1]
        embeds = hf_mtp.embed_tokens(torch.tensor([tokens[1:]])).clone()
        embeds[:, 0] = 0
        cache = MtpCache()
        out = hf_mtp.forward_layer(0, hidden, torch.arange(T)[None] + 1, cache, inputs_embeds=embeds)
        return out, hf_mtp._project_to_logits(out), cache


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_first_step_matches_transformers_mtp_layer(checkpoints, layout):
    hf_target, hf_mtp, path = checkpoints(layout)
    target, head = load(path)
    tokens = np.random.default_rng(0).integers(0, target.cfg.vocab_size, 13).tolist()
    _, want, _ = hf_first_step(hf_target, hf_mtp, tokens)
    hidden, _, _ = target_pass(target, np.asarray([tokens[:-1]]))
    with jax.default_matmul_precision("highest"):
        out, feed, _ = head(jnp.asarray([tokens[1:]], jnp.int32), hidden, jnp.zeros((1,), jnp.int32),
                            head.init_cache(1, 64))
        got = np.asarray(head.logits(out))
    assert np.abs(got - want.numpy()).max() / np.abs(want.numpy()).max() < REL_TOL
    assert (got.argmax(-1) == want.numpy().argmax(-1)).all() and out is feed


@pytest.mark.parametrize("layout", LAYOUTS)
def test_chained_drafts_match_transformers_reusing_the_layer(checkpoints, layout):
    """k = 3 greedy drafts from the proposer (observe the prefill, then propose) equal transformers' MTP layer run
    three times, each step fed the previous draft and the previous post-norm output one position on."""
    hf_target, hf_mtp, path = checkpoints(layout)
    target, head = load(path)
    k = 3
    prompt = np.random.default_rng(1).integers(0, target.cfg.vocab_size, 9).tolist()
    # The target's first token after the prompt, then the MTP chain from there (transformers).
    hidden, cache, _ = target_pass(target, np.asarray([prompt]))
    first = int(np.argmax(np.asarray(target.logits(hidden[0, -1]))))
    committed = prompt + [first]
    out, logits, mtp_cache = hf_first_step(hf_target, hf_mtp, committed)
    want = [int(logits[0, -1].argmax())]
    last = out[:, -1:]
    with torch.no_grad():
        for step in range(1, k):
            position = torch.tensor([[len(committed) - 1 + step]])
            last = hf_mtp.forward_layer(0, last, position, mtp_cache, input_ids=torch.tensor([[want[-1]]]))
            want.append(int(hf_mtp._project_to_logits(last)[0, -1].argmax()))
    graph, state = nnx.split(head)
    proposer = HeadProposer(graph, head, k, probabilistic=False)
    tokens = jnp.asarray([committed + [0] * 8], jnp.int32)
    lengths = jnp.asarray([len(committed)], jnp.int32)
    rows = greedy_rows(1, [20], [])
    with jax.default_matmul_precision("highest"):
        carry = jax.jit(proposer.init, static_argnums=3)(state, tokens[:, :len(prompt)], lengths - 1, 32)
        carry = jax.jit(proposer.observe)(state, carry, TargetPass(hidden, None, jnp.zeros((1,), jnp.int32)),
                                          tokens, lengths, rows)
        drafts, _, _ = jax.jit(proposer.propose)(state, carry, tokens, lengths, rows)
    assert drafts[0].tolist() == want


@pytest.fixture(scope="module")
def plain(checkpoints, default_model_dir):
    made = {}

    def run(layout: str):
        if layout not in made:
            llm = LLM(str(checkpoints(layout)[2]), tokenizer=str(default_model_dir), dtype="float32", **LIMITS)
            made[layout] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        return made[layout]

    return run


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_mtp_equals_plain_decoding(checkpoints, default_model_dir, plain, layout, k):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm = LLM(str(checkpoints(layout)[2]), tokenizer=str(default_model_dir), dtype="float32", **LIMITS,
                  speculative_config={"method": "mtp", "num_speculative_tokens": k})
    assert any("same MTP layer" in str(w.message) for w in caught) == (k > 1)   # vLLM's warning
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain(layout)
    metrics = {m.name: m for m in llm.get_metrics()}
    assert metrics["vllm:spec_decode_num_drafts"].value > 0
    assert metrics["vllm:spec_decode_num_draft_tokens"].value == sum(o.outputs[0].num_draft_tokens for o in outs)
    assert len(metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values) == k


@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_mtp_trees_equal_plain_decoding(checkpoints, default_model_dir, plain, layout):
    """Draft trees from the MTP layer (DeepSeek's over MLA's tree mask, MiMo's over the Qwen2 layer's)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # vLLM's warning for k above the MTP layers
        llm = LLM(str(checkpoints(layout)[2]), tokenizer=str(default_model_dir), dtype="float32", **LIMITS,
                  speculative_config={"method": "mtp", "num_speculative_tokens": 3, "tree_nodes": 8,
                                      "tree_branching": 2})
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain(layout)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mtp_under_continuous_admission_equals_plain_waves(checkpoints, default_model_dir, layout):
    """12 requests through 3 slots: admitted rows get fresh MTP caches (MLA's latent one for DeepSeek)."""
    prompts = [{"prompt_token_ids": [(7 * i + j) % 38 + 3 for j in range(2 + i % 9)]} for i in range(12)]
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 3 * (i % 9), ignore_eos=True) for i in range(12)]
    path, tokenizer = str(checkpoints(layout)[2]), str(default_model_dir)
    one_wave = LLM(path, tokenizer=tokenizer, dtype="float32", max_model_len=96, max_num_seqs=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # vLLM's warning for k above the MTP layers
        admitted = LLM(path, tokenizer=tokenizer, dtype="float32", max_model_len=96, max_num_seqs=3,
                       speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    outs = admitted.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == \
        [o.outputs[0].token_ids for o in one_wave.generate(prompts, params, use_tqdm=False)]
    assert admitted.admission_trace()[0].admissions > 0
    assert sum(o.outputs[0].num_drafts for o in outs) > 0


def test_k_defaults_to_the_mtp_layers_and_legacy_names_map(with_mtp, default_model_dir):
    llm = LLM(str(with_mtp[2]), tokenizer=str(default_model_dir), **LIMITS, speculative_config={"method": "mtp"})
    assert llm.config.speculative.num_speculative_tokens == 1 and llm.proposer.k == 1
    with pytest.warns(UserWarning, match="deprecated"):
        spec = SpeculativeConfig.from_dict({"method": "deepseek_mtp"}, target_max_model_len=64,
                                           target_tensor_parallel_size=1, target_mtp_layers=1)
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("mtp", None, 1)


def test_a_target_without_mtp_layers_is_refused_naming_the_families(default_model_dir):
    with pytest.raises(ValueError, match="has none .* DeepSeek-V3 .* MiMo"):
        LLM(str(default_model_dir), max_model_len=64, speculative_config={"method": "mtp",
                                                                          "num_speculative_tokens": 1})


# -------------------------------------------------------------------------------------------- sampling

def test_sampled_mtp_follows_the_target_distribution(with_mtp, loaded):
    """1024 seeds of one prompt at temperature 0.35 (the tiny random target is flat at 1), two new tokens, one
    probabilistic MTP draft: the second token follows the target's p (chi-square) and the draft is accepted at
    the rate sum(min(p, q))."""
    target, head = loaded
    N, k, S = 1024, 1, 24
    graph, state = nnx.split(head)
    target_graph, target_state = nnx.split(target)
    proposer = HeadProposer(graph, head, k, probabilistic=True)
    prompt = np.asarray([3, 14, 15, 9, 26, 5], np.int32)
    temperature = 0.35
    rows = dataclasses.replace(jax.tree.map(jnp.asarray, greedy_rows(1, [3], [])),
                               temperature=jnp.full((1,), temperature))
    generate = build_generate(target_graph, proposer, LoopSpec(k=k, n_top=0, max_model_len=S))

    def one_run(seed):
        return generate(target_state, state, jnp.asarray(np.pad(prompt, (0, 10))[None]), jnp.asarray([6]),
                        dataclasses.replace(rows, seed=seed[None]), S)

    final = jax.device_get(jax.jit(jax.vmap(one_run))(jnp.arange(N, dtype=jnp.uint32) + 3))
    out = final.tokens[:, 0, 6:8]
    first = np.bincount(out[:, 0]).argmax()
    chosen = out[:, 0] == first
    assert chosen.sum() > 100
    context = np.append(prompt, first)[None]
    hidden, _, _ = target_pass(target, context)
    p = np.asarray(jax.nn.softmax(target.logits(hidden[0, -1]) / temperature), np.float64)
    assert chi_square_p_value(out[chosen, 1], p) > 1e-3
    with jax.default_matmul_precision("highest"):
        # The draft of the token after `first` comes from the pair (first, h at the position before it).
        draft_out, _, _ = head(jnp.asarray(np.append(prompt[1:], first)[None], jnp.int32), hidden[:, :-1],
                               jnp.zeros((1,), jnp.int32), head.init_cache(1, S))
    q = np.asarray(jax.nn.softmax(head.logits(draft_out[0, -1]) / temperature), np.float64)
    accepted = final.counters.num_accepted[chosen, 0] > 0
    rate = np.minimum(p, q).sum()
    assert abs(accepted.mean() - rate) < 4 * np.sqrt(rate * (1 - rate) / chosen.sum()) + 1e-3


# ------------------------------------------------------------------------------------------- perfect MTP

@pytest.fixture(scope="module")
def perfect_mtp(with_mtp, tmp_path_factory):
    """Every block of the target and of the MTP layer an identity (o_proj and every down projection zero),
    every norm 1, eh_proj = [I | 0]: the target is a bigram model lm_head(norm(embed(t))) and the MTP layer,
    reading norm(embed(t + 1)), predicts exactly the target's next token, whatever the recycled hidden state."""
    _, _, path = with_mtp
    out = tmp_path_factory.mktemp("perfect_mtp")
    for item in path.iterdir():
        (out / item.name).write_bytes(item.read_bytes())
    tensors = load_file(out / "model.safetensors")
    H = 64
    for name, tensor in tensors.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = torch.zeros_like(tensor)
        elif "norm" in name and name.endswith(".weight"):
            tensors[name] = torch.ones_like(tensor)
        elif name.endswith("eh_proj.weight"):
            tensors[name] = torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_perfect_mtp_layer_has_every_draft_accepted(perfect_mtp, default_model_dir, k):
    steps = 6
    params = SamplingParams(temperature=0.0, max_tokens=1 + steps * (k + 1), ignore_eos=True)
    llm = LLM(str(perfect_mtp), tokenizer=str(default_model_dir), dtype="float32", **LIMITS,
              speculative_config={"method": "mtp", "num_speculative_tokens": k})
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        completion = out.outputs[0]
        assert completion.num_drafts == steps and completion.num_accepted_tokens == k * steps
        assert completion.mean_acceptance_length == k + 1
        assert completion.num_accepted_tokens_per_pos == [steps] * k


def test_a_perfect_mtp_layers_tree_accepts_its_first_level_every_step(perfect_mtp, default_model_dir):
    """The MTP layer's distribution is the target's, so the root's best children hold the target's token: depth 1
    is accepted at every step, deeper nodes where EAGLE-2's frontier kept the target's path; the accepted nodes lie
    at scattered slots of MLA's latent cache, moved into place. Output equals plain decoding's."""
    params = SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True)
    plain = LLM(str(perfect_mtp), tokenizer=str(default_model_dir), dtype="float32", **LIMITS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # vLLM's warning for k above the MTP layers
        llm = LLM(str(perfect_mtp), tokenizer=str(default_model_dir), dtype="float32", **LIMITS,
                  speculative_config={"method": "mtp", "num_speculative_tokens": 3, "tree_nodes": 6,
                                      "tree_branching": 2})
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in outs] == want
    for out in outs:
        completion = out.outputs[0]
        assert completion.num_accepted_tokens_per_pos[0] == completion.num_drafts > 0
        assert completion.num_accepted_tokens_per_pos[1] > 0
