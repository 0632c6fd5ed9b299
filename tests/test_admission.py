"""Continuous admission: more requests than slots in one jitted call, each slot taking the next request when
its row finishes. Greedy output equals plain decoding in waves for every drafter (trees and adaptive policies
included) over 100+ prompts of mixed lengths and budgets through 8 slots; logprobs, prompt logprobs, penalties
and counters come back per request in request order; seeded sampling is the same alone, in a batch and in any
admission order; the slots' occupancy is reported."""
from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from eagle_heads import write_head
from jaxpr_counts import primitive_counts

from specjax import LLM, SamplingParams, make_generate_fn
from specjax.engine import loop, runner
from specjax.engine.adaptive import policy_inputs
from specjax.engine.admission import Queue, admit_batch, build_admitting
from specjax.engine.rows import row_params
from specjax.kernels.policy import has_kernels

K = 3
MAX_LEN = 64
SLOTS = 8
REQUESTS = 104


@pytest.fixture(scope="module")
def tiny_dir(tiny_checkpoint_factory):
    return tiny_checkpoint_factory("llama")


@pytest.fixture(scope="module")
def workload(tiny_dir):
    """REQUESTS prompts of 2 to 30 tokens (repetitive, so n-gram finds matches) with max_tokens 1 to 40."""
    vocab = json.loads((tiny_dir / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(1)
    prompts, params = [], []
    for _ in range(REQUESTS):
        motif = rng.integers(3, vocab, size=int(rng.integers(1, 5))).tolist()
        prompts.append({"prompt_token_ids": (motif * 30)[:int(rng.integers(2, 31))]})
        params.append(SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=int(rng.integers(1, 41))))
    return prompts, params


def _llm(model_dir, default_model_dir, spec=None, **kwargs) -> LLM:
    return LLM(str(model_dir), tokenizer=str(default_model_dir), max_model_len=MAX_LEN, max_num_seqs=SLOTS,
               speculative_config=spec, **kwargs)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def waves_llm(tiny_dir, default_model_dir):
    return _llm(tiny_dir, default_model_dir, continuous_admission=False)


@pytest.fixture(scope="module")
def plain_tokens(waves_llm, workload):
    return _tokens(waves_llm.generate(*workload, use_tqdm=False))


@pytest.fixture(scope="module")
def eagle3_head(tiny_dir, tmp_path_factory):
    config = json.loads((tiny_dir / "config.json").read_text())
    return write_head(tmp_path_factory.mktemp("EAGLE3-tiny"), config, "eagle3_yuhuili", scale=0.3)


AUTO = {"speculation_policy": "auto", "step_costs": {0: 1.0, 1: 1.6, 2: 1.8, 3: 2.0}}
TABLE = {"num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 5, 0], [6, 8, 1]]}


@pytest.mark.parametrize("method, extra", [
    (None, {}), ("ngram", {}), ("draft_model", {}), ("eagle3", {}), ("ngram", TABLE), ("eagle3", AUTO),
    ("ngram", {"tree_nodes": 6, "tree_branching": 2})],
    ids=["plain", "ngram", "draft_model", "eagle3", "ngram-table", "eagle3-auto", "ngram-tree"])
def test_greedy_admission_equals_plain_decoding_in_waves(tiny_dir, default_model_dir, workload, plain_tokens,
                                                         eagle3_head, method, extra):
    drafter = {"ngram": {"prompt_lookup_min": 1, "prompt_lookup_max": 3},
               "draft_model": {"model": str(tiny_dir)},   # the target drafting for itself
               "eagle3": {"model": str(eagle3_head)}, None: {}}[method]
    spec = None if method is None else {"method": method, "num_speculative_tokens": K, **drafter, **extra}
    llm = _llm(tiny_dir, default_model_dir, spec)
    outs = llm.generate(*workload, use_tqdm=False)
    assert _tokens(outs) == plain_tokens
    [trace] = llm.admission_trace()
    assert (trace.slots, trace.requests) == (SLOTS, REQUESTS) and trace.admissions > 0
    # Every request held a slot for at least one iteration (its prefill's token aside), and no slot for more
    # iterations than the call ran.
    assert all(0 < b <= trace.steps for b in trace.busy_per_slot)
    assert 0.5 < np.mean(trace.occupancy) <= 1.0
    if spec is not None:
        metrics = {m.name: m for m in llm.get_metrics()}
        assert metrics["vllm:spec_decode_num_drafts"].value == sum(o.outputs[0].num_drafts for o in outs) > 0
    if "speculation_policy" in extra or "num_speculative_tokens_per_batch_size" in extra:
        [adaptive] = llm.speculation_trace()
        assert len(adaptive.k_per_step) == trace.steps and max(adaptive.live_per_step) <= SLOTS
        if "speculation_policy" in extra:   # auto: the choice follows the acceptance
            assert len(set(adaptive.k_per_step)) > 1
        else:   # the table: admission keeps the 8 slots full (its tail too, longest first), so its K for 8 rows
            assert adaptive.k_per_step[0] == 1 and set(adaptive.k_per_step) <= {0, 1, 3}
    if method == "draft_model":   # self-drafting accepts every draft, admitted rows included
        metrics = {m.name: m for m in llm.get_metrics()}
        assert metrics["vllm:spec_decode_num_accepted_tokens"].value == \
            metrics["vllm:spec_decode_num_draft_tokens"].value


def test_records_and_counters_come_back_per_request_in_order(tiny_dir, default_model_dir, workload):
    """Logprobs, ranks, prompt logprobs, penalties and the speculative counters under admission equal the
    waves' for each request."""
    prompts, _ = workload
    rng = np.random.default_rng(2)
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=int(rng.integers(1, 30)), logprobs=2,
                             prompt_logprobs=1, repetition_penalty=1.3 if i % 3 == 0 else 1.0)
              for i in range(40)]
    spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    admitted = _llm(tiny_dir, default_model_dir, spec).generate(prompts[:40], params, use_tqdm=False)
    waves = _llm(tiny_dir, default_model_dir, spec, continuous_admission=False).generate(prompts[:40], params,
                                                                                          use_tqdm=False)
    for a, w in zip(admitted, waves):
        assert a.prompt_token_ids == w.prompt_token_ids
        ca, cw = a.outputs[0], w.outputs[0]
        assert ca.token_ids == cw.token_ids
        for la, lw in zip(ca.logprobs, cw.logprobs):
            assert la.keys() == lw.keys()
            for t in la:
                assert la[t].rank == lw[t].rank
                np.testing.assert_allclose(la[t].logprob, lw[t].logprob, rtol=1e-5, atol=1e-5)
        assert [None if d is None else sorted(d) for d in a.prompt_logprobs] == \
            [None if d is None else sorted(d) for d in w.prompt_logprobs]
        assert (ca.num_drafts, ca.num_draft_tokens, ca.num_accepted_tokens, ca.num_accepted_tokens_per_pos) == \
            (cw.num_drafts, cw.num_draft_tokens, cw.num_accepted_tokens, cw.num_accepted_tokens_per_pos)


def test_seeded_sampling_is_the_same_alone_in_a_batch_and_in_any_admission_order(tiny_dir, default_model_dir,
                                                                                 workload):
    prompts, _ = workload
    n = 30
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=5 + i % 17, ignore_eos=True)
              for i in range(n)]
    spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = _llm(tiny_dir, default_model_dir, spec)
    in_order = _tokens(llm.generate(prompts[:n], params, use_tqdm=False))
    order = np.random.default_rng(3).permutation(n)
    shuffled = _tokens(llm.generate([prompts[i] for i in order], [params[i] for i in order], use_tqdm=False))
    assert [shuffled[list(order).index(i)] for i in range(n)] == in_order
    alone = [_tokens(llm.generate([prompts[i]], [params[i]], use_tqdm=False))[0] for i in (0, 7, 29)]
    assert alone == [in_order[i] for i in (0, 7, 29)]
    waves = _llm(tiny_dir, default_model_dir, spec, continuous_admission=False)
    assert _tokens(waves.generate(prompts[:n], params, use_tqdm=False)) == in_order


def test_waves_are_kept_when_the_requests_fit_the_slots(waves_llm, tiny_dir, default_model_dir, workload):
    llm = _llm(tiny_dir, default_model_dir)
    llm.generate(workload[0][:SLOTS], workload[1][:SLOTS], use_tqdm=False)
    assert llm.admission_trace() == []
    waves_llm.generate(*workload, use_tqdm=False)
    assert waves_llm.admission_trace() == []


def test_continuous_admission_must_be_a_bool(tiny_dir, default_model_dir):
    with pytest.raises(TypeError, match="continuous_admission"):
        _llm(tiny_dir, default_model_dir, continuous_admission="yes")


def test_the_functional_core_admits_rows_into_slots_inside_the_users_jit(tiny_dir, default_model_dir, workload):
    llm = _llm(tiny_dir, default_model_dir, {"method": "ngram", "num_speculative_tokens": K,
                                             "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    ids = [p["prompt_token_ids"] for p in workload[0][:20]]
    P = max(map(len, ids))
    tokens = jnp.asarray([i + [0] * (P - len(i)) for i in ids], jnp.int32)
    lengths = jnp.asarray([len(i) for i in ids], jnp.int32)
    sampled = SamplingParams(temperature=0.9, max_tokens=10, ignore_eos=True)
    whole, admitted = (jax.jit(make_generate_fn(llm, sampled, slots=slots)) for slots in (None, 3))
    rngs = jax.random.split(jax.random.key(0), 2)
    a = jax.vmap(whole, in_axes=(None, None, None, None, 0))(llm.params, None, tokens, lengths, rngs)
    b = jax.vmap(admitted, in_axes=(None, None, None, None, 0))(llm.params, None, tokens, lengths, rngs)
    np.testing.assert_array_equal(a[1], np.broadcast_to(lengths + 10, (2, 20)))
    np.testing.assert_array_equal(b[1], a[1])
    for s in range(2):
        for row in range(20):
            np.testing.assert_array_equal(b[0][s, row, :int(a[1][s, row])], a[0][s, row, :int(a[1][s, row])])
    np.testing.assert_array_equal(b[2]["num_drafts"], a[2]["num_drafts"])
    with pytest.raises(ValueError, match="slots must be >= 1"):
        make_generate_fn(llm, sampled, slots=0)


@pytest.mark.parametrize("spec", [None, "eagle3-auto"])
def test_an_admitting_call_traces_the_decode_loop_once(tiny_dir, default_model_dir, eagle3_head, spec):
    """Its matmuls are a wave's (a prefill and the decode loop with every tier) and one more prefill's (the
    admissions'), not a second copy of the decode loop: that copy doubled the program and its compile time. The
    admissions' prefill sits in a conditional whose other branch has no matmul: the admission after the last
    decode run, which admits nothing, runs no model pass."""
    if spec:
        spec = {"method": "eagle3", "model": str(eagle3_head), "num_speculative_tokens": K, **AUTO}
    r = _llm(tiny_dir, default_model_dir, spec)._runner
    key = (0, True, False, None)
    loop_spec = r._spec(*key)
    policy = None if r.policy is None else policy_inputs(np.ones(len(r.policy.tiers), np.float32))
    tokens, lengths = np.full((SLOTS, 8), 5, np.int32), np.full((SLOTS,), 8, np.int32)
    rows = row_params([SamplingParams(temperature=0.0, max_tokens=4)] * SLOTS, vocab_size=r.vocab_size,
                      max_tokens=[4] * SLOTS, eos_token_ids=())
    generate = loop.build_generate(r.target_graph, r.proposer, loop_spec)
    wave = _dots(functools.partial(generate, cache_len=MAX_LEN, policy=policy), r.target_state, r.draft_state,
                 tokens, lengths, rows)
    prefill, _ = loop.build_stream(r.target_graph, r.proposer, loop_spec)
    one_prefill = _dots(functools.partial(prefill, cache_len=MAX_LEN, policy=policy), r.target_state,
                        r.draft_state, tokens, lengths, rows)
    admitting = build_admitting(r.target_graph, r.proposer, loop_spec, admit_batch=admit_batch(SLOTS))
    queue = Queue(np.concatenate([tokens, tokens]), np.concatenate([lengths, lengths]),
                  jax.tree.map(lambda x: np.concatenate([x, x]), rows), np.int32(2 * SLOTS))
    branches = []
    admitted = _dots(functools.partial(admitting, slots=SLOTS, cache_len=MAX_LEN, record_len=64, policy=policy),
                     r.target_state, r.draft_state, queue, branches=branches)
    assert wave > one_prefill > 0   # the decode loop has matmuls of its own
    assert admitted == wave + one_prefill
    assert [0, one_prefill] in [sorted(b["dot_general"] for b in cond) for cond in branches]


def _dots(fn, *args, branches: list | None = None) -> int:
    return primitive_counts(fn, *args, branches=branches)["dot_general"]


def test_a_queue_too_large_for_one_call_runs_in_several(tiny_dir, default_model_dir, workload, plain_tokens,
                                                        monkeypatch):
    """The results of a call are bounded (runner.QUEUE_RESULT_BYTES): past it the requests go in several
    admitted calls, each more than the slots, the outputs unchanged."""
    monkeypatch.setattr(runner, "QUEUE_RESULT_BYTES", 30 * (MAX_LEN + 1) * runner.RECORD_BYTES)
    llm = _llm(tiny_dir, default_model_dir)
    assert _tokens(llm.generate(*workload, use_tqdm=False)) == plain_tokens
    assert [t.requests for t in llm.admission_trace()] == [30, 30, 30, 14]


def test_length_groups_keep_short_prompts_out_of_long_prompts_calls():
    slots = 3
    # Buckets 16 (x5), 32, 64 (x2), 256 (x4): 64 is within 4x of 16; 256 is not, and 4 requests fill the slots.
    lengths = [10, 300, 12, 40, 200, 5, 60, 250, 64, 3, 9, 220]
    assert runner.length_groups(lengths, slots) == [[0, 2, 3, 5, 6, 8, 9, 10], [1, 4, 7, 11]]
    # Too few long ones to fill the slots: they join the short ones.
    assert runner.length_groups(lengths[:5], slots) == [[0, 1, 2, 3, 4]]
    # Too few short ones to close a group: the long ones join them.
    assert runner.length_groups([3, 4, 300, 301, 302, 303], slots) == [[0, 1, 2, 3, 4, 5]]
    assert runner.length_groups([], slots) == []


def test_prompts_of_very_different_lengths_are_admitted_in_calls_of_their_own(tiny_dir, default_model_dir):
    """Short prompts do not prefill at the width of a long one: they run in their own admitted call; the outputs
    are still in request order and equal waves'."""
    rng = np.random.default_rng(5)
    lengths = [int(n) for n in rng.permutation([4] * 20 + [100] * 20)]   # buckets 16 and 128
    prompts = [{"prompt_token_ids": [(7 * n + 3 * j) % 90 + 3 for j in range(n)]} for n in lengths]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=6)
    limits = dict(tokenizer=str(default_model_dir), max_model_len=128, max_num_seqs=SLOTS)
    waves = LLM(str(tiny_dir), continuous_admission=False, **limits).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(tiny_dir), **limits)
    assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == _tokens(waves)
    assert [t.requests for t in llm.admission_trace()] == [20, 20]


def test_the_largest_budgets_are_admitted_first_so_the_call_ends_with_its_longest_request(tiny_dir,
                                                                                        default_model_dir):
    """16 requests of 4 tokens, then one of 40: admitted in request order the 40-token request would start after
    the short ones (about 48 iterations); admitted first it overlaps them and the call lasts its own 40 tokens.
    The outputs stay in request order and equal waves'."""
    prompts = [{"prompt_token_ids": [5 + i, 6, 7]} for i in range(17)]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4)] * 16 + [
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=40)]
    llm = _llm(tiny_dir, default_model_dir)
    waves = _llm(tiny_dir, default_model_dir, continuous_admission=False)
    tokens = _tokens(llm.generate(prompts, params, use_tqdm=False))
    assert tokens == _tokens(waves.generate(prompts, params, use_tqdm=False))
    assert [len(t) for t in tokens] == [4] * 16 + [40]
    assert llm.admission_trace()[-1].steps <= 40


@pytest.mark.skipif(not has_kernels(jax.devices()[0]), reason="the GPU's program at the default model's shape")
def test_auto_admission_at_128_slots_runs_on_the_gpu_and_equals_plain_decoding():
    """An adaptive admission loop at 128 slots, the default model's shape with an EAGLE-3-shaped head (random
    float32 weights, the engine's kernels), runs on the GPU and gives plain decoding's greedy tokens. With
    1ba82a5's catch-up (a one-trip loop around the head's own) every such run hit an illegal address on an H100
    while the CPU ran it clean (benchmarks/RESULTS.md, "V3's step after the launch cuts, on an H100"). float32:
    in bfloat16 a random model's near-tied logits round differently in a k + 1 token verify pass than in a
    one-token step, and the greedy tokens part (seen on an H100)."""
    from flax import nnx

    from benchmarks import bench_sweep
    from benchmarks.common import SMOLLM2_135M, random_model
    from specjax.config import EngineConfig
    from specjax.engine.proposers.base import NoProposer

    cfg = SMOLLM2_135M
    graph, state = nnx.split(random_model(cfg, dtype=jnp.float32))
    head = bench_sweep.drafter("eagle3", cfg, state, None, smoke=False)
    requests = bench_sweep.requests(256, (64, 256), (32, 160), cfg.vocab_size)

    def tokens(spec: dict | None) -> list[list[int]]:
        proposer, draft_state = (NoProposer(), None) if spec is None else head.make(3, True)
        config = EngineConfig(model="random", tokenizer="random", max_num_seqs=128, max_model_len=1024,
                              speculative_config=spec).resolve(cfg)
        run = runner.WaveRunner(graph, state, proposer, draft_state, config, eos_token_ids=(),
                                vocab_size=cfg.vocab_size, cost_key="test+eagle3-head")
        out = {}
        for indices in run.queues(requests):
            out.update(zip(indices, run.run_queue([requests[i] for i in indices])))
        return [out[i].token_ids for i in range(len(requests))]

    auto = tokens({"method": "eagle3", "model": "random", "num_speculative_tokens": 3, "speculation_policy": "auto"})
    assert auto == tokens(None)
