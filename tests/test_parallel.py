"""Tensor parallelism on 8 simulated CPU devices: greedy outputs equal TP=1 token for token for every method,
parameters and KV cache really sharded, only the collectives the layout needs, attention per shard under
shard_map (the Pallas kernel in interpret mode too), replicas over a data axis, clear errors, and two
processes under jax.distributed sharing one tensor-parallel mesh.

XLA reads --xla_force_host_platform_device_count once, when JAX starts, and the rest of the suite runs in a
one-device process; so `test_tensor_parallel_suite_on_8_cpu_devices` reruns this file in a subprocess with
8 devices, where the other tests run (they are skipped in a process with fewer devices).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from deepseek_checkpoints import save_tiny_deepseek, save_tiny_deepseek_with_mtp, write_fp8_copy
from eagle_heads import write_head
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from specjax import LLM, SamplingParams, make_generate_fn
from specjax.engine.admission import Queue
from specjax.engine.loop import LoopSpec, build_generate
from specjax.engine.proposers.ngram import NgramProposer
from specjax.engine.runner import Request
from specjax.engine.shapes import bucket
from specjax.engine.state import RowParams
from specjax.kernels.attention import attention
from specjax.kernels.attention_reference import attention_reference
from specjax.kernels.policy import KernelPolicy
from specjax.models.llama import FAMILY, LlamaConfig
from specjax.models.registry import config_from_dir
from specjax.parallel import mesh as parallel_mesh
from specjax.parallel.plan import leaf_spec, shard_state

DEVICES = 8
HERE = Path(__file__).resolve()
# String conditions are evaluated when a test runs, not at import: a --worker process (below) must not start
# JAX before jax.distributed.initialize.
needs_8 = pytest.mark.skipif("jax.device_count() < DEVICES",
                             reason="needs 8 devices: run by test_tensor_parallel_suite_on_8_cpu_devices")

V = 128
TARGET = dict(vocab_size=V, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=4, tie_word_embeddings=False)
# A Qwen2 draft: q/k/v biases, tied embeddings, 4 heads (so not splittable 8 ways), 2 kv heads.
DRAFT = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, tie_word_embeddings=True, use_sliding_window=False)
COMMON = dict(max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
              pad_token_id=0)
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [40, 41, 42], [77], [100, 3, 100, 3, 100, 3, 100, 3, 100]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
LIMITS = dict(max_model_len=64, max_num_seqs=4)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# Expected split axis of each leaf, written out here rather than read from the family's partition rules.
SPLIT_AXIS = {"embed": 0, "lm_head": 1, "w_qkv": 2, "b_qkv": 1, "wo": 1, "w_gate_up": 2, "w_down": 1}
KV_LEAVES = {"w_qkv", "b_qkv"}


# ---------------------------------------------------------------------------------------------- the driver

@pytest.mark.skipif("jax.device_count() >= DEVICES", reason="this process has 8 devices: the tests run here")
def test_tensor_parallel_suite_on_8_cpu_devices():
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE)],
                         cwd=HERE.parent.parent, env=env, capture_output=True, text=True, timeout=2700)
    report = run.stdout[-6000:] + run.stderr[-3000:]
    assert run.returncode == 0, report
    counts = dict((kind, int(n)) for n, kind in re.findall(r"(\d+) (passed|skipped|failed|error)", run.stdout))
    assert counts.get("passed", 0) >= 40 and counts.get("skipped") == 1, report  # only this driver skips there


# ------------------------------------------------------------------------------------------------ fixtures

def _write_checkpoint(out: Path, config_class: str, fields: dict, seed: int) -> Path:
    """A random fp32 transformers model in HF layout, norms and biases randomised so a swapped or mis-split
    leaf changes the output."""
    import torch
    import transformers

    config = getattr(transformers, config_class)(**fields, **COMMON)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn(param.shape))
            else:  # sharper distributions: greedy argmax margins well above fp32 reduction-order noise
                param.mul_(3.0)
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return _write_checkpoint(tmp_path_factory.mktemp("tp_target"), "LlamaConfig", TARGET, seed=0)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return _write_checkpoint(tmp_path_factory.mktemp("tp_draft"), "Qwen2Config", DRAFT, seed=1)


@pytest.fixture(scope="module")
def eagle_dirs(target_dir, tmp_path_factory):
    """An EAGLE-1 head and an EAGLE-3 head (reduced draft vocabulary, d2t) for the target."""
    config = json.loads((target_dir / "config.json").read_text())
    eagle = write_head(tmp_path_factory.mktemp("tp_eagle"), config, "eagle1_yuhuili", scale=0.3)
    eagle3 = write_head(tmp_path_factory.mktemp("tp_eagle3"), config, "eagle3_speculators", scale=0.3,
                        draft_vocab=64, aux_layer_ids=[0, 1, 1])
    return {"eagle": eagle, "eagle3": eagle3}


@pytest.fixture(scope="module")
def build(target_dir, draft_dir, eagle_dirs, default_model_dir):
    """build(tp, method) -> (LLM, [token ids per prompt]), each built and run once per module."""
    specs = {"none": None, "ngram": NGRAM,
             "draft_tp1": {"model": str(draft_dir), "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1},
             "draft_tp_same": {"model": str(draft_dir), "num_speculative_tokens": 3},
             **{m: {"method": m, "model": str(d), "num_speculative_tokens": 3} for m, d in eagle_dirs.items()}}
    made = {}

    def make(tp: int, method: str):
        if (tp, method) not in made:
            llm = LLM(str(target_dir), tokenizer=str(default_model_dir), tensor_parallel_size=tp,
                      speculative_config=specs[method], **LIMITS)
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
            made[tp, method] = llm, outs
        return made[tp, method]

    return make


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _accepted(outs):
    return [o.outputs[0].num_accepted_tokens for o in outs]


# ------------------------------------------------------------------------------- outputs equal TP=1

# EAGLE heads at TP 2 and 8 only: each case compiles its own loop, the heads are replicated at every TP, and the
# target's TP-4 layout (one kv head per shard) is covered by the other TP-4 cases, whose builds other tests need.
CASES = [(2, "none"), (2, "ngram"), (2, "draft_tp1"), (2, "draft_tp_same"), (2, "eagle"), (2, "eagle3"),
         (4, "none"), (4, "ngram"), (4, "draft_tp_same"),
         (8, "none"), (8, "ngram"), (8, "draft_tp1"), (8, "eagle"), (8, "eagle3")]


@needs_8
@pytest.mark.parametrize("tp,method", CASES, ids=[f"tp{tp}-{m}" for tp, m in CASES])
def test_greedy_outputs_equal_tp1(build, tp, method):
    _, reference = build(1, "draft_tp1" if method.startswith("draft") else method)  # TP=1: one device
    _, outs = build(tp, method)
    assert _tokens(outs) == _tokens(reference)
    assert [len(t) for t in _tokens(outs)] == [GREEDY.max_tokens] * len(PROMPTS)
    if method != "none":  # the same drafts were proposed and accepted
        assert [o.outputs[0].num_draft_tokens for o in outs] == [o.outputs[0].num_draft_tokens for o in reference]
        assert _accepted(outs) == _accepted(reference)
        if not method.startswith("eagle"):  # random EAGLE heads hardly ever agree with the target
            assert sum(_accepted(outs)) > 0


SHORT_METHODS = ("none", "ngram", "draft_tp_same", "eagle3")


# Each kind of proposer cache at TP 2 (a split draft model's, a replicated head's), and the target's on one device
# (each case compiles its own short bucket).
@needs_8
@pytest.mark.parametrize("tp, method", [(1, "none")] + [(2, method) for method in SHORT_METHODS])
def test_requests_shorter_than_the_prompt_bucket_generate(build, tp, method):
    """prompt + max_tokens <= 8 once crashed in the KV write: the cache was sized from them, not from the
    16-token prompt bucket the prefill writes."""
    llm, _ = build(tp, method)
    _, reference = build(1, "none")
    short = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": PROMPTS[2]}, {"prompt_token_ids": PROMPTS[1]}], short, use_tqdm=False)
    assert _tokens(outs) == [_tokens(reference)[2][:3], _tokens(reference)[1][:3]]


@needs_8
@pytest.mark.parametrize("method", ["none", "ngram"])
def test_continuous_admission_at_tp4_equals_tp1(build, target_dir, default_model_dir, method):
    """More requests than slots over a tensor-parallel mesh: one admitting call whose loops carry the slots' KV
    caches split by kv head, the same tokens as waves on one device."""
    llm = LLM(str(target_dir), tokenizer=str(default_model_dir), tensor_parallel_size=4,
              speculative_config=None if method == "none" else NGRAM, max_model_len=64, max_num_seqs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert _tokens(outs) == _tokens(build(1, method)[1])
    (trace,) = llm.admission_trace()
    assert (trace.slots, trace.requests) == (2, len(PROMPTS)) and trace.admissions >= 1
    fn, args = _queue_state(llm)
    whiles = " ".join(line for line in fn.lower(*args).compile().as_text().splitlines() if " while(" in line)
    assert set(re.findall(r"f32\[2,2,(\d+),\d+,8\]", whiles)) == {"1"}   # [L, slots, kv heads / 4, S, D]


@needs_8
def test_functional_core_at_tp2_equals_tp1(build):
    """make_generate_fn on a tensor-parallel LLM runs the sharded loop inside the user's jit."""
    results = []
    for tp in (1, 2):
        llm, _ = build(tp, "ngram")
        fn = jax.jit(make_generate_fn(llm, GREEDY))
        width = max(map(len, PROMPTS))
        tokens = jnp.asarray([p + [0] * (width - len(p)) for p in PROMPTS], jnp.int32)
        lengths = jnp.asarray([len(p) for p in PROMPTS], jnp.int32)
        out, out_lengths, _ = fn(llm.params, llm.draft_params, tokens, lengths, jax.random.key(0))
        results.append([np.asarray(out[b, :int(out_lengths[b])]).tolist() for b in range(len(PROMPTS))])
    assert results[0] == results[1]


@needs_8
def test_plain_and_speculative_agree_at_tp1_too(build):
    """The TP=1 references are themselves lossless, so the comparisons above compare like with like."""
    plain = _tokens(build(1, "none")[1])
    for method in ("ngram", "draft_tp1", "eagle", "eagle3"):
        assert _tokens(build(1, method)[1]) == plain


# -------------------------------------------------------------------------------- params really sharded

def _check_leaf(path: str, leaf: jax.Array, tp: int, cfg: LlamaConfig, replicated: bool = False) -> None:
    name = path.split("/")[-1]
    axis = None if replicated else SPLIT_AXIS.get(name)
    if axis is not None and any(part.isdigit() for part in path.split("/")):
        axis -= 1  # a per-layer leaf (unrolled layout) has no leading layer axis
    if name in KV_LEAVES and cfg.num_kv_heads < tp:
        axis = None  # fewer kv heads than devices: K/V projections replicated
    expected_spec = P(*("model" if i == axis else None for i in range(leaf.ndim)))
    expected_shape = tuple(n // tp if i == axis else n for i, n in enumerate(leaf.shape))
    assert isinstance(leaf.sharding, NamedSharding), path
    assert leaf.sharding.mesh.shape["model"] == tp, path
    spec = tuple(leaf.sharding.spec) + (None,) * (leaf.ndim - len(leaf.sharding.spec))  # trailing Nones optional
    assert P(*spec) == expected_spec, (path, leaf.sharding.spec, expected_spec)
    assert {d.id for d in leaf.sharding.device_set} == set(range(tp)), path
    shards = leaf.addressable_shards
    assert len(shards) == tp and all(s.data.shape == expected_shape for s in shards), (path, expected_shape)
    if axis is not None:  # each device holds a different slice
        assert len({s.index[axis].start for s in shards}) == tp, path


def _leaves(state) -> dict[str, jax.Array]:
    return {"/".join(str(k.key) for k in p if isinstance(k, jax.tree_util.DictKey)): x
            for p, x in jax.tree_util.tree_leaves_with_path(state)}


@needs_8
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_each_param_leaf_is_sharded_as_the_layout_says(build, tp):
    llm, _ = build(tp, "none")
    leaves = _leaves(llm.params)
    assert {"embed", "lm_head", "layers/w_qkv", "layers/w_gate_up", "layers/w_down", "final_norm"} <= set(leaves)
    for path, leaf in leaves.items():
        _check_leaf(path, leaf, tp, llm.model_config)


@needs_8
def test_unrolled_per_layer_leaves_are_sharded_and_generate_like_tp1(build, target_dir, default_model_dir):
    """The GPU default layout (one weight set per layer, unrolled) forced on CPU at TP=4: every per-layer
    leaf split as the layout says, the same greedy tokens as TP=1."""
    llm = LLM(str(target_dir), tokenizer=str(default_model_dir), tensor_parallel_size=4, unroll_layers=True,
              **LIMITS)
    leaves = _leaves(llm.params)
    assert {"layers/0/w_qkv", "layers/1/w_down", "embed"} <= set(leaves)
    for path, leaf in leaves.items():
        _check_leaf(path, leaf, 4, llm.model_config)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert _tokens(outs) == _tokens(build(1, "none")[1])


@needs_8
@pytest.mark.parametrize("tp,method", [(8, "draft_tp1"), (4, "draft_tp_same")])
def test_draft_params_are_replicated_or_split_like_the_target(build, draft_dir, tp, method):
    llm, _ = build(tp, method)
    cfg = config_from_dir(draft_dir)[1]
    leaves = _leaves(llm.draft_params)
    assert {"embed", "layers/b_qkv", "layers/wo"} <= set(leaves)  # tied, with q/k/v biases
    for path, leaf in leaves.items():
        _check_leaf(path, leaf, tp, cfg, replicated=method == "draft_tp1")


@needs_8
def test_an_eagle_head_is_replicated_and_shares_the_targets_split_lm_head(build):
    tp = 8
    llm, _ = build(tp, "eagle")
    leaves = _leaves(llm.draft_params)
    assert leaves["lm_head"] is llm.params["lm_head"][...]  # EAGLE-1 uses the target's lm_head, still split
    assert leaves["embed"] is llm.params["embed"][...]
    own = {path: leaf for path, leaf in leaves.items() if path not in ("lm_head", "embed")}
    assert "fc" in own and any(path.endswith("/w_qkv") for path in own)
    for path, leaf in own.items():
        assert leaf.sharding.mesh == llm.params["embed"][...].sharding.mesh, path
        assert all(s.data.shape == leaf.shape for s in leaf.addressable_shards) and len(leaf.addressable_shards) == tp


# ---------------------------------------------------------------------------------- KV cache and HLO

def _queue_state(llm):
    """The admitting function and its arguments for PROMPTS as one queue, as run_queue calls it."""
    runner = llm._runner
    requests = [Request(p, GREEDY, i) for i, p in enumerate(PROMPTS)]
    slots = llm.config.max_num_seqs
    prompts, lengths, rows, cache_len = runner._pack(requests, num_rows=max(bucket(len(requests)), slots))
    queue = Queue(prompts, lengths, rows, np.int32(len(requests)))
    return runner.admitting_fn(0, True), (runner.target_state, runner.draft_state, queue, slots, cache_len, 1,
                                          runner.synthetic_rates, None)


def _wave_state(llm):
    runner = llm._runner
    wave = [Request(p, GREEDY, i) for i, p in enumerate(PROMPTS)]
    prompts, lengths, rows, cache_len = runner._pack(wave)
    args = (runner.target_state, runner.draft_state, prompts, lengths, rows, cache_len, runner.synthetic_rates)
    return runner.generate_fn(0, True), args   # (n_top, all rows greedy)


@needs_8
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_kv_cache_is_split_by_kv_head_or_replicated_when_fewer(build, tp):
    llm, _ = build(tp, "ngram")
    fn, args = _wave_state(llm)
    cache = fn(*args).cache
    L, B, Hkv, S, D = cache.k.shape
    assert (L, B, Hkv, D) == (2, 4, 4, 8)
    per_device = (L, B, Hkv // tp if Hkv >= tp else Hkv, S, D)
    for array in (cache.k, cache.v):
        assert len(array.addressable_shards) == tp
        assert all(s.data.shape == per_device for s in array.addressable_shards)
        starts = {s.index[2].start for s in array.addressable_shards}
        assert len(starts) == (tp if Hkv >= tp else 1)
    # Inside the compiled loop too: the while carries hold the per-device cache, never the whole one.
    hlo = fn.lower(*args).compile().as_text()
    carried = re.findall(r"f32\[" + ",".join(map(str, (L, B))) + r",\d+," + f"{S},{D}" + r"\]",
                         " ".join(line for line in hlo.splitlines() if " while(" in line))
    assert carried and set(carried) == {"f32[" + ",".join(map(str, per_device)) + "]"}, set(carried)


def _collectives(hlo: str) -> dict[str, list[str]]:
    """The array shapes each kind of collective in compiled HLO text produces (XLA may combine several into
    one tuple-shaped collective: each element counts)."""
    found: dict[str, list[str]] = {}
    for result, kind in re.findall(r"= (\(.*?\)|\S+) (all-reduce|all-gather|reduce-scatter|all-to-all|"
                                   r"collective-permute|collective-broadcast)(?:-start)?\(", hlo):
        found.setdefault(kind, []).extend(re.findall(r"\w+\[[\d,]*\]", result))
    return found


@needs_8
@pytest.mark.parametrize("method", ["none", "ngram"])
def test_only_the_layout_collectives_are_compiled(build, method):
    """Per forward pass (prefill, then each loop step): one all-reduce after the vocab-parallel embedding,
    one after o and one after down (inside the scanned layer body), one all-gather of the logits."""
    tp = 2
    llm, _ = build(tp, method)
    fn, args = _wave_state(llm)
    found = _collectives(fn.lower(*args).compile().as_text())
    assert set(found) <= {"all-reduce", "all-gather"}, found
    B, P_bucket, k = 4, 16, llm.proposer.k
    reduce_shapes = sorted(found["all-reduce"])
    assert reduce_shapes == sorted([f"f32[{B},{P_bucket},64]"] * 3 + [f"f32[{B},{k + 1},64]"] * 3), reduce_shapes
    assert sorted(found["all-gather"]) == sorted([f"f32[{B},1,{V}]", f"f32[{B},{k + 1},{V}]"]), found


# ----------------------------------------------------------------------- attention per shard, replicas

@needs_8
@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("num_kv_heads", [4, 2], ids=["kv-split", "kv-replicated"])
def test_attention_runs_per_shard_under_shard_map(impl, num_kv_heads):
    tp, B, T, Hq, S, D, L = 4, 2, 3, 8, 32, 16, 2
    mesh = parallel_mesh.build_mesh(tp)
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (B, T, Hq, D))
    k_cache = jax.random.normal(keys[1], (L, B, num_kv_heads, S, D))
    v_cache = jax.random.normal(keys[2], (L, B, num_kv_heads, S, D))
    start = jnp.array([5, 20], jnp.int32)
    kv_axis = "model" if num_kv_heads >= tp else None
    q = jax.device_put(q, NamedSharding(mesh, P(None, None, "model")))
    k_cache, v_cache = (jax.device_put(c, NamedSharding(mesh, P(None, None, kv_axis))) for c in (k_cache, v_cache))

    def sharded(q, k_cache, v_cache, layer, start):
        with parallel_mesh.traced_with(parallel_mesh.Layout(mesh, head_axis="model")):
            return attention(q, k_cache, v_cache, layer, start, scale=D ** -0.5,
                             kernels=KernelPolicy(impl=impl, interpret=True))

    fn = jax.jit(sharded)
    out = fn(q, k_cache, v_cache, jnp.int32(1), start)
    expected = attention_reference(*(jax.device_get(x) for x in (q, k_cache, v_cache)), 1, start, scale=D ** -0.5)
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=2e-5, atol=2e-5)
    assert out.sharding.spec[2] == "model" and out.addressable_shards[0].data.shape == (B, T, Hq // tp, D)
    hlo = fn.lower(q, k_cache, v_cache, jnp.int32(1), start).compile().as_text()
    assert not _collectives(hlo), "attention over heads needs no communication"


SMALL = LlamaConfig(architecture="LlamaForCausalLM", vocab_size=V, hidden_size=64, intermediate_size=64,
                    num_layers=2, num_heads=8, num_kv_heads=4, head_dim=8, rms_norm_eps=1e-5, rope_theta=1e4,
                    rope_scaling=None, tie_word_embeddings=True, attention_bias=False, qk_norm=False,
                    max_position_embeddings=128, bos_token_id=None, eos_token_ids=(), torch_dtype="float32")


@needs_8
def test_replicas_on_a_data_axis_each_generate_their_rows():
    """8 devices as 2 replicas x TP 4: the same tokens as one device, the cache split by rows and kv heads,
    and no collective between the replicas other than the final step count."""
    graph, state = nnx.split(FAMILY.random(SMALL, seed=0))
    state = jax.tree.map(lambda x: x * 6, state)
    generate = build_generate(graph, NgramProposer(3, 1, 3), LoopSpec(k=3, n_top=0, max_model_len=64))
    B = 4
    rows = RowParams(temperature=np.zeros(B, np.float32), top_k=np.zeros(B, np.int32), top_p=np.ones(B, np.float32),
                     min_p=np.zeros(B, np.float32), seed=np.arange(B, dtype=np.uint32),
                     max_tokens=np.full(B, 20, np.int32), min_tokens=np.zeros(B, np.int32),
                     stop_ids=np.full((B, 1), -1, np.int32))
    prompts = np.random.RandomState(0).randint(0, V, (B, 16)).astype(np.int32)
    lengths = np.array([9, 4, 1, 7], np.int32)
    one_device = jax.jit(generate, static_argnums=5)(state, None, prompts, lengths, rows, 48)
    mesh = parallel_mesh.build_mesh(4, jax.devices())
    assert dict(mesh.shape) == {"data": 2, "model": 4}
    fn = jax.jit(build_generate(graph, NgramProposer(3, 1, 3), LoopSpec(k=3, n_top=0, max_model_len=64), mesh=mesh),
                 static_argnums=5)
    args = (shard_state(state, FAMILY.partition_rules(SMALL, 4), mesh), None, prompts, lengths, rows, 48)
    out = fn(*args)
    np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(one_device.lengths))
    for b in range(B):
        assert (np.asarray(out.tokens)[b, :int(out.lengths[b])] ==
                np.asarray(one_device.tokens)[b, :int(one_device.lengths[b])]).all()
    assert {s.data.shape for s in out.cache.k.addressable_shards} == {(2, B // 2, 1, 48, 8)}
    # Each replica's own tensor-parallel collectives, on its 2 rows, and the step count's max over replicas.
    found = _collectives(fn.lower(*args).compile().as_text())
    assert set(found) == {"all-reduce", "all-gather"}, found
    assert sorted(found["all-reduce"]) == sorted(["f32[2,16,64]"] * 3 + ["f32[2,4,64]"] * 3 + ["s32[]"])
    assert sorted(found["all-gather"]) == ["f32[2,1,128]", "f32[2,4,128]"]


# ------------------------------------------------------------------------------------ DeepSeek: MLA + MoE

@pytest.fixture(scope="module")
def deepseek_dirs(tmp_path_factory):
    """A tiny DeepSeek-V3 of 8 heads and 8 routed experts, and an FP8 copy of it (16 x 16 blocks)."""
    bf = save_tiny_deepseek("v3_tp8", tmp_path_factory.mktemp("ds_v3"))
    return {"bf16": bf, "fp8": write_fp8_copy(bf, tmp_path_factory.mktemp("ds_fp8"), block=(16, 16))}


@needs_8
@pytest.mark.parametrize("weights", ["bf16", "fp8"])
def test_deepseek_at_tp_2_4_8_equals_tp1_with_experts_split(deepseek_dirs, default_model_dir, weights):
    """MLA heads split, the latent cache replicated, the routed experts split over the devices (each device
    routes every token the same and runs its own experts), with n-gram speculation on top. FP8 at TP 8 alone
    (its blocks split with their scales there as at 2 and 4; each TP compiles its own loop)."""
    prompts = [{"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6]}, {"prompt_token_ids": [40, 41]}, {"prompt_token_ids": [9]}]
    outs = {}
    for tp in (1, 2, 4, 8) if weights == "bf16" else (1, 8):
        llm = LLM(str(deepseek_dirs[weights]), tokenizer=str(default_model_dir), tensor_parallel_size=tp,
                  speculative_config=NGRAM, dtype="float32", **LIMITS)
        outs[tp] = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
        if tp > 1:
            experts = llm.params["moe"]["we_gate"][...]
            assert {s.data.shape[1] for s in experts.addressable_shards} == {8 // tp}
            assert llm.params["moe"]["w_uk"][...].addressable_shards[0].data.shape[1] == 8 // tp
    assert all(tokens == outs[1] for tokens in outs.values())


@needs_8
def test_the_vllm_mtp_example_at_tp8_equals_tp1(tmp_path, default_model_dir):
    """vLLM's MTP example with a tiny DeepSeek-V3 directory in place of the hub id: trust_remote_code,
    tensor_parallel_size=8 on 8 CPU devices, the target's own MTP layer drafting; the same tokens and
    acceptance as on one device."""
    _, _, path = save_tiny_deepseek_with_mtp("v3_tp8", tmp_path / "v3_mtp")
    prompts = [{"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6]}, {"prompt_token_ids": [40, 41, 42]}]
    outs = {}
    for tp in (1, 8):
        llm = LLM(model=str(path), tokenizer=str(default_model_dir), trust_remote_code=True, tensor_parallel_size=tp,
                  dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": 1}, **LIMITS)
        outs[tp] = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert llm.get_metrics()[0].value > 0   # vllm:spec_decode_num_drafts
    assert _tokens(outs[8]) == _tokens(outs[1]) and _accepted(outs[8]) == _accepted(outs[1])


@needs_8
def test_deepseek_moe_layers_combine_with_one_all_reduce(deepseek_dirs, default_model_dir):
    """Per layer: the all-reduce after o_proj (attention) and, for the dense layer its down projection's, for
    the MoE layers one all-reduce of the routed and shared experts' partial sums over the flattened tokens; and
    the logits' all-gather. (The MoE layers are scanned: their body appears once in the program.)"""
    llm = LLM(str(deepseek_dirs["bf16"]), tokenizer=str(default_model_dir), tensor_parallel_size=4, dtype="float32",
              **LIMITS)
    fn, args = _wave_state(llm)
    found = _collectives(fn.lower(*args).compile().as_text())
    assert set(found) <= {"all-reduce", "all-gather"}, found
    B, P_bucket, H, V = 4, 16, 64, 160
    # Prefill and the decode step: the embedding, the dense layer's o and down, the MoE layer's o at [B, T, H];
    # the MoE combine at [B * T, H].
    expected = [f"f32[{B},{T},{H}]" for T in (P_bucket, 1) for _ in range(4)] + [f"f32[{B * P_bucket},{H}]",
                                                                                  f"f32[{B},{H}]"]
    assert sorted(found["all-reduce"]) == sorted(expected), found
    assert sorted(found["all-gather"]) == [f"f32[{B},1,{V}]"] * 2, found


# ------------------------------------------------------------------------------------------------- rules

def test_partition_rules_cover_every_leaf_of_every_family():
    variants = [SMALL, dataclasses.replace(SMALL, tie_word_embeddings=False, attention_bias=True, qk_norm=True,
                                           vocab_size=97)]
    for cfg in variants:
        for tp in (2, 4, 8):
            rules = FAMILY.partition_rules(cfg, tp)
            specs = {p: leaf_spec(p, len(spec.shape), rules) for p, spec in FAMILY.weight_map(cfg).items()}
            for path, spec in specs.items():
                name = path.split("/")[-1]
                vocab_replicated = name in ("embed", "lm_head") and cfg.vocab_size % tp
                kv_replicated = name in KV_LEAVES and cfg.num_kv_heads < tp
                if name in SPLIT_AXIS and not vocab_replicated and not kv_replicated:
                    assert spec[SPLIT_AXIS[name]] == "model", (path, spec)
                else:
                    assert all(s is None for s in spec), (path, spec)


@pytest.mark.parametrize("heads,kv_heads,inter,tp,match", [
    (9, 3, 64, 2, "num_heads=9 is not divisible by tensor_parallel_size=2"),
    (12, 6, 64, 4, "num_kv_heads=6 is not divisible by tensor_parallel_size=4"),
    (12, 3, 64, 4, "larger than the model's num_kv_heads=3 but not a multiple"),
    (8, 4, 60, 8, "intermediate_size=60 is not divisible"),
])
def test_shapes_that_cannot_be_split_are_refused(heads, kv_heads, inter, tp, match):
    cfg = dataclasses.replace(SMALL, num_heads=heads, num_kv_heads=kv_heads, intermediate_size=inter)
    with pytest.raises(ValueError, match=match):
        FAMILY.check_tensor_parallel(cfg, tp, field="tensor_parallel_size")


@needs_8
def test_mesh_from_the_global_device_list():
    """What jax.distributed changes is jax.devices(): it lists every process's devices, and the mesh is
    built from it the same way."""
    mesh = parallel_mesh.build_mesh(2)
    assert dict(mesh.shape) == {"data": 1, "model": 2}
    assert list(mesh.devices.flat) == jax.devices()[:2]
    mesh = parallel_mesh.build_mesh(2, jax.devices())
    assert dict(mesh.shape) == {"data": 4, "model": 2}
    assert mesh.devices.tolist() == np.asarray(jax.devices()).reshape(4, 2).tolist()
    with pytest.raises(ValueError, match="cannot be split into replicas"):
        parallel_mesh.build_mesh(3, jax.devices())
    with pytest.raises(ValueError, match="tensor_parallel_size=16 is larger than the 8"):
        parallel_mesh.build_mesh(16)


@needs_8
def test_llm_refuses_bad_tensor_parallel_sizes_before_loading(default_model_dir, target_dir, draft_dir, tmp_path):
    """SmolLM2 (9 heads, 3 kv heads): TP 2 and 4 are refused from its config.json alone (no weights here)."""
    (tmp_path / "config.json").write_text((default_model_dir / "config.json").read_text())
    for tp in (2, 4):
        with pytest.raises(ValueError, match=f"num_heads=9 is not divisible by tensor_parallel_size={tp}"):
            LLM(str(tmp_path), tokenizer=str(default_model_dir), tensor_parallel_size=tp)
    with pytest.raises(ValueError, match="tensor_parallel_size=16 is larger than the 8"):
        LLM(str(tmp_path), tokenizer=str(default_model_dir), tensor_parallel_size=16)
    with pytest.raises(ValueError, match="draft_tensor_parallel_size=2 must be 1 or the target's"):
        LLM(str(target_dir), tokenizer=str(default_model_dir), tensor_parallel_size=4,
            speculative_config={"model": str(draft_dir), "num_speculative_tokens": 2,
                                "draft_tensor_parallel_size": 2})
    with pytest.raises(ValueError, match="draft model's num_heads=4 is not divisible by draft_tensor_parallel_size=8"
                                         ".*draft_tensor_parallel_size'\\] = 1"):
        LLM(str(target_dir), tokenizer=str(default_model_dir), tensor_parallel_size=8,
            speculative_config={"model": str(draft_dir), "num_speculative_tokens": 2})


# --------------------------------------------------------------------------------- the default model's shape

# The default model's (SmolLM2-135M's) head counts and vocabulary on 2 narrow layers: the split is what matters.
SMOLLM2_SPLIT = dict(vocab_size=49152, hidden_size=72, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)


@needs_8
def test_default_models_heads_at_tp3_equal_tp1(default_model_dir, tmp_path):
    """SmolLM2-135M's shape split 3 ways: 9 heads and 3 kv heads, vocabulary 49152 (tied to the embedding)."""
    model_dir = _write_checkpoint(tmp_path, "LlamaConfig", SMOLLM2_SPLIT, seed=2)
    prompts = ["The capital of France is", "1, 2, 3, 4, 5, 6,"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = {}
    for tp in (1, 3):
        llm = LLM(str(model_dir), tokenizer=str(default_model_dir), tensor_parallel_size=tp,
                  speculative_config=NGRAM, max_model_len=128, max_num_seqs=2)
        outs[tp] = llm.generate(prompts, params, use_tqdm=False)
    assert _tokens(outs[3]) == _tokens(outs[1])
    assert _accepted(outs[3]) == _accepted(outs[1])
    assert llm.params["layers"]["w_qkv"].addressable_shards[0].data.shape == (2, 72, (72 + 2 * 24) // 3)


# ------------------------------------------------------------------------------------------- multi-host

@needs_8
def test_two_processes_share_one_mesh_under_jax_distributed(build, target_dir, default_model_dir):
    """Two processes with 4 CPU devices each (gloo collectives) run LLM(tensor_parallel_size=8) over all 8:
    each gets the whole result, equal to one device's."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4",
               PYTHONPATH=os.pathsep.join([str(HERE.parent.parent), os.environ.get("PYTHONPATH", "")]))
    workers = [subprocess.Popen([sys.executable, str(HERE), "--worker", str(i), str(port), str(target_dir),
                                 str(default_model_dir)], env=env, cwd=HERE.parent.parent,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = [w.communicate(timeout=600)[0] for w in workers]
    assert all(w.returncode == 0 for w in workers), "\n".join(log[-3000:] for log in logs)
    expected = _tokens(build(1, "none")[1])
    for log in logs:
        result = json.loads(re.search(r"^RESULT (.*)$", log, re.M).group(1))
        assert result == expected


def _worker(process_id: int, port: int, target: str, tokenizer: str) -> None:
    """One process of the multi-host test (run as `python tests/test_parallel.py --worker ...`)."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    assert jax.device_count() == 8 and jax.local_device_count() == 4
    llm = LLM(target, tokenizer=tokenizer, tensor_parallel_size=8, **LIMITS)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    print("RESULT " + json.dumps(_tokens(outs)), flush=True)


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
