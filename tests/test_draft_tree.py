"""Tree speculation: the tree-masked attention (kernel in interpret mode against the reference and a float64
oracle), the trees proposers build (n-gram tries, EAGLE-2's expansion, a head's level passes), acceptance (greedy:
the longest argmax path; sampled: the target distribution, chi-square), the loop (greedy output equal to plain
decoding, the accepted path's KV moved into place) and the config's errors."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from chi_square import chi_square_p_value
from deepseek_checkpoints import deepseek_config
from eagle_heads import write_head
from flax import nnx
from conftest import jitted_forward
from test_engine_loop import MAX_LEN, TARGET, _generated, _rows, _run

from checkpoints_conv.eagle_loader import load_eagle_head
from specjax import LLM, SamplingParams
from specjax.config import SpeculativeConfig
from specjax.config.draft_tree import TreeShape
from specjax.engine.draft_tree import DraftTree, chain, from_chains, grow
from specjax.engine.proposers.base import NoProposer, Stateless, TargetPass
from specjax.engine.proposers.eagle import HeadProposer
from specjax.engine.proposers.ngram import NgramProposer, propose_ngram, propose_ngram_continuations
from specjax.engine.tree_acceptance import accept_tree
from specjax.kernels.attention_reference import attention_reference
from specjax.kernels.attention_triton import KernelConfig, attention_triton
from specjax.kernels.policy import KernelPolicy, has_kernels
from specjax.models.deepseek import FAMILY as DEEPSEEK
from specjax.models.llama import FAMILY, LlamaConfig


@pytest.fixture(autouse=True)
def exact_float32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


def random_tree(rng: np.random.Generator, batch: int, nodes: int, vocab: int, max_children: int = 3) -> DraftTree:
    """Random topologically ordered trees with distinct sibling tokens (as top-k drafting makes them)."""
    tokens, parents, depth = (np.zeros((batch, nodes), np.int32) for _ in range(3))
    for b in range(batch):
        node_depth, used = [0], {0: set()}
        for j in range(nodes):
            choices = [i for i in range(j + 1) if len(used[i]) < max_children]
            parent = int(rng.choice(choices))
            token = int(rng.choice([t for t in range(vocab) if t not in used[parent]]))
            used[parent].add(token)
            used[j + 1] = set()
            node_depth.append(node_depth[parent] + 1)
            tokens[b, j], parents[b, j], depth[b, j] = token, parent, node_depth[-1]
    return DraftTree(jnp.asarray(tokens), jnp.asarray(parents), jnp.asarray(depth))


# ------------------------------------------------------------------------------------------------------------
# attention over a tree
# ------------------------------------------------------------------------------------------------------------

def _oracle(q, k_cache, v_cache, layer, tree: DraftTree, start, scale, window):
    """float64: each node sees the prefix (its position's window) and its ancestors' slots."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k_cache[layer], v_cache[layer]))
    anc = np.asarray(tree.ancestry(tree.tokens.shape[1]))
    depths = np.concatenate([np.zeros((q.shape[0], 1), int), np.asarray(tree.depth)], axis=1)
    group = q.shape[2] // k.shape[1]
    out = np.zeros_like(q)
    for b in range(q.shape[0]):
        s0 = int(start[b])
        for t in range(q.shape[1]):
            pos = s0 + depths[b, t]
            prefix = [s for s in range(s0) if window == 0 or s > pos - window]
            slots = prefix + [s0 + j for j in range(q.shape[1]) if anc[b, t, j]]
            for h in range(q.shape[2]):
                logits = k[b, h // group, slots] @ q[b, t, h] * scale
                p = np.exp(logits - logits.max())
                out[b, t, h] = (p / p.sum()) @ v[b, h // group, slots]
    return out


TREE_KERNEL_CASES = [(0, None, 11), (6, None, 11), (0, KernelConfig(block_k=16, num_splits=2), 11),
                     (0, None, 40), (0, KernelConfig(block_k=32), 70)]


@pytest.mark.parametrize("window, config, N", TREE_KERNEL_CASES)
def test_tree_attention_kernel_and_reference_match_the_oracle(window, config, N):
    """N nodes: the kernel's bit words for the visible nodes, one (11), two (40) and three padded to four (70)."""
    check_tree_kernel(window, config, N, interpret=True)


@pytest.mark.skipif(not has_kernels(jax.devices()[0]), reason="compiles the Triton kernel (NVIDIA sm80+)")
@pytest.mark.parametrize("window, config, N", TREE_KERNEL_CASES)
def test_the_compiled_tree_kernel_matches_the_oracle_on_the_gpu(window, config, N):
    with jax.default_matmul_precision("highest"):   # fp32 as the engine runs it, not TF32
        check_tree_kernel(window, config, N, interpret=False)


def check_tree_kernel(window, config, N, interpret: bool) -> None:
    rng = np.random.default_rng(0)
    B, Hq, Hkv, D = 2, 4, 2, 16
    S = 48 + 64 * (N > 11)
    tree = random_tree(rng, B, N, vocab=50)
    start = jnp.asarray([7, 20], jnp.int32)
    q = jnp.asarray(rng.standard_normal((B, N + 1, Hq, D)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, B, Hkv, S, D)), jnp.float32) for _ in range(2))
    mask = tree.verify_mask(start, N)
    expected = _oracle(q, k, v, 1, tree, start, 0.3, window)
    reference = attention_reference(q, k, v, 1, start, scale=0.3, window=window, tree=mask)
    kernel = attention_triton(q, k, v, 1, start, scale=0.3, window=window, tree=mask, config=config,
                              interpret=interpret)
    np.testing.assert_allclose(reference, expected, atol=1e-5)
    np.testing.assert_allclose(kernel, expected, atol=1e-5)


def test_a_chain_shaped_tree_attends_as_the_causal_pass():
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((2, 5, 4, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((1, 2, 2, 32, 16)), jnp.float32) for _ in range(2))
    start = jnp.asarray([3, 17], jnp.int32)
    mask = chain(jnp.asarray([[1, 2, 3, 4]] * 2)).verify_mask(start, 4)
    for window in (0, 6):   # a window longer than the tree
        np.testing.assert_allclose(attention_reference(q, k, v, 0, start, scale=0.25, window=window, tree=mask),
                                   attention_reference(q, k, v, 0, start, scale=0.25, window=window), atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "deepseek"])
def test_a_tree_pass_scores_each_node_as_its_own_path(family):
    """The target's hidden state at every node of a random tree equals a causal pass over the prefix and that
    node's path (Llama's GQA and DeepSeek's MLA, absorbed)."""
    if family == "llama":
        model = FAMILY.random(LlamaConfig.from_hf_dict(TINY), seed=0)
    else:
        hf = {**deepseek_config("v3").to_dict(), "architectures": ["DeepseekV3ForCausalLM"]}
        model = DEEPSEEK.random(DEEPSEEK.config_from_hf(hf), seed=0)
    rng = np.random.default_rng(7)
    N, prefix = 9, 6
    tree = random_tree(rng, 1, N, vocab=40)
    context = jnp.asarray(rng.integers(0, 40, (1, prefix)), jnp.int32)
    start = jnp.asarray([prefix - 1], jnp.int32)
    zeros = jnp.zeros((1,), jnp.int32)
    _, _, cache = jitted_forward(model, context[:, :-1], zeros, model.init_cache(1, 32))
    verify = jnp.concatenate([context[:, -1:], tree.tokens], axis=1)
    hidden, _, _ = jitted_forward(model, verify, start, cache, tree.verify_mask(start, N))
    anc = np.asarray(tree.ancestry(N))[0]
    for node in range(N + 1):
        path = [int(verify[0, j]) for j in range(N + 1) if anc[node, j]]   # ancestors come first (topological)
        # One causal pass over the prefix and the path, right-padded to one width (one compiled program).
        alone = np.zeros((1, prefix + N), np.int32)
        alone[0, :prefix - 1], alone[0, prefix - 1:prefix - 1 + len(path)] = context[0, :-1], path
        out, _, _ = jitted_forward(model, jnp.asarray(alone), zeros, model.init_cache(1, 32))
        np.testing.assert_allclose(hidden[0, node], out[0, prefix - 2 + len(path)], atol=2e-4, rtol=2e-4)

# ------------------------------------------------------------------------------------------------------------
# building trees
# ------------------------------------------------------------------------------------------------------------

def test_continuations_merge_into_a_trie():
    chains = jnp.asarray([[[5, 6, 7], [5, 6, 8], [9, 1, -1], [5, 6, 7]]])
    tree = from_chains(chains, 12)
    # depth-major: (d, m) is node d * 4 + m; shared prefixes and repeats are no node
    assert tree.tokens[0].tolist() == [5, -1, 9, -1, 6, -1, 1, -1, 7, 8, -1, -1]
    assert tree.depth[0].tolist() == [1] * 4 + [2] * 4 + [3] * 4
    valid = tree.tokens[0] >= 0
    assert tree.parents[0][valid].tolist() == [0, 0, 1, 3, 5, 5]


def test_ngram_continuations_are_the_earliest_occurrences():
    tokens = jnp.asarray([[1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2, 0, 0]])
    lengths = jnp.asarray([11])
    chains = propose_ngram_continuations(tokens, lengths, 2, 4, 1, 2)
    assert chains[0].tolist() == [[3, 1], [4, 1], [5, 1], [-1, -1]]   # the 4th occurrence is the suffix itself
    assert chains[0, 0].tolist() == propose_ngram(tokens, lengths, 2, 1, 2)[0].tolist()


def _paths(tree: DraftTree, b: int) -> set[tuple[int, ...]]:
    paths = {0: ()}
    for j in range(tree.tokens.shape[1]):
        if int(tree.tokens[b, j]) >= 0:
            paths[j + 1] = paths[int(tree.parents[b, j])] + (int(tree.tokens[b, j]),)
    return set(paths.values()) - {()}


def test_grow_keeps_eagle2s_best_nodes():
    """Against a brute force of EAGLE-2 on a drafter whose log-probabilities depend on the path."""
    V, depth, b, nodes = 7, 3, 2, 7

    def logprobs_of(path):
        seed = sum(t * 31 ** i for i, t in enumerate(path)) + 1
        return jax.nn.log_softmax(jnp.asarray(np.random.default_rng(seed).standard_normal(V) * 2, jnp.float32))

    def step(level, carry, tokens, paths, visible):
        return jnp.stack([logprobs_of(tuple(p) + (int(t),)) for p, t in zip(np.asarray(paths[0]), tokens[0])])[None], \
            jnp.concatenate([paths, tokens[..., None]], axis=2), carry

    # The state fed along each branch is the path itself, so the drafter scores paths (unjitted, B = 1).
    step_paths = grow(logprobs_of(())[None], jnp.zeros((1, 0), jnp.int32), step, None, depth=depth, branching=b,
                      nodes=nodes)[0]
    pool, frontier = {}, [()]
    for level in range(depth):
        children = {p + (t,): (pool.get(p, 0.0) + float(logprobs_of(p)[t]))
                    for p in frontier for t in np.argsort(-np.asarray(logprobs_of(p)), kind="stable")[:b]}
        pool.update(children)
        frontier = sorted(children, key=lambda p: -children[p])[:b]
    best = sorted(pool, key=lambda p: -pool[p])[:nodes]
    assert _paths(step_paths, 0) == set(best)
    assert np.all(np.asarray(step_paths.parents) < np.arange(1, nodes + 1))


# ------------------------------------------------------------------------------------------------------------
# acceptance
# ------------------------------------------------------------------------------------------------------------

def _accept(logits, tree, temperature, seed=None, draft_probs=None, greedy_only=False, max_depth=None):
    B = tree.tokens.shape[0]
    max_depth = int(jnp.max(tree.depth)) if max_depth is None else max_depth
    seed = jnp.zeros((B,), jnp.uint32) if seed is None else seed
    return accept_tree(logits, tree, draft_probs, max_depth, jnp.full((B,), temperature), jnp.zeros((B,), jnp.int32),
                       jnp.ones((B,)), jnp.zeros((B,)), seed, jnp.full((B,), 10, jnp.int32), greedy_only=greedy_only)


def test_greedy_acceptance_takes_the_longest_argmax_path():
    rng = np.random.default_rng(2)
    B, N, V = 64, 12, 4      # a small vocabulary: many nodes hit the argmax
    tree = random_tree(rng, B, N, V)
    logits = jnp.asarray(rng.standard_normal((B, N + 1, V)), jnp.float32)
    argmax = np.asarray(jnp.argmax(logits, -1))
    for greedy_only in (True, False):
        out, accepted, path = _accept(logits, tree, 0.0, greedy_only=greedy_only)
        for b in range(B):
            best, node = [], 0
            while True:   # siblings are distinct: at most one child matches
                kids = [j for j in range(N) if int(tree.parents[b, j]) == node and int(tree.tokens[b, j]) == argmax[b, node]]
                if not kids:
                    break
                node = kids[0] + 1
                best.append(node)
            assert int(accepted[b]) == len(best)
            assert path[b, :len(best)].tolist() == best
            assert out[b, :len(best) + 1].tolist() == [int(tree.tokens[b, j - 1]) for j in best] + [argmax[b, node]]


def _siblings_tree(B: int, first: np.ndarray, second: np.ndarray) -> DraftTree:
    """The root's children first [B, m] (nodes 0..m-1), each with children second [B, m, m]."""
    m = first.shape[1]
    parents = np.concatenate([np.zeros((B, m), int), np.repeat(np.arange(1, m + 1), m)[None].repeat(B, 0)], axis=1)
    depth = np.concatenate([np.ones((B, m), int), np.full((B, m * m), 2)], axis=1)
    return DraftTree(jnp.asarray(np.concatenate([first, second.reshape(B, m * m)], axis=1), jnp.int32),
                     jnp.asarray(parents, jnp.int32), jnp.asarray(depth, jnp.int32))


@pytest.mark.parametrize("probabilistic", [False, True], ids=["top-k children", "drawn without replacement"])
def test_sampled_tree_acceptance_follows_the_target_distribution(probabilistic):
    """Random p (per node) and q over 6 tokens, 3 siblings per node, two levels: the first emitted token follows
    p at the root, and the second, after the first was a child's token, p at that child."""
    V, m, B = 6, 3, 40000
    rng = np.random.default_rng(3)
    p_logits = rng.standard_normal((1 + m + m * m, V)) * 1.5
    q = np.exp(rng.standard_normal((1 + m, V)))
    q /= q.sum(-1, keepdims=True)
    keys = jax.random.split(jax.random.key(4), (B, 1 + m))
    if probabilistic:   # Gumbel top-m: m draws without replacement from each node's q
        gumbel = jax.vmap(jax.vmap(lambda k, logq: jax.lax.top_k(logq + jax.random.gumbel(k, (V,)), m)[1]))
        drawn = np.asarray(gumbel(keys, jnp.broadcast_to(jnp.log(q), (B, 1 + m, V))))
    else:               # the m most probable under q (a deterministic drafter)
        drawn = np.broadcast_to(np.argsort(-q, axis=-1)[:, :m], (B, 1 + m, m))
    first, second = drawn[:, 0], drawn[:, 1:]
    tree = _siblings_tree(B, first, second)
    # Node j's p: the root's, its first-level parent's slot, and each second-level node's own.
    logits = jnp.broadcast_to(jnp.asarray(p_logits, jnp.float32), (B, 1 + m + m * m, V))
    draft_probs = None
    if probabilistic:
        draft_probs = jnp.asarray(np.concatenate([np.repeat(q[:1], m, 0), np.repeat(q[1:], m, 0)])[None]
                                  .repeat(B, 0), jnp.float32)
    out, accepted, _ = jax.jit(lambda lg, t, dp, s: _accept(lg, t, 1.0, seed=s, draft_probs=dp, max_depth=2))(
        logits, tree, draft_probs, jnp.arange(B, dtype=jnp.uint32))
    out = np.asarray(out)
    p = np.asarray(jax.nn.softmax(jnp.asarray(p_logits), -1))
    assert chi_square_p_value(out[:, 0], p[0]) > 1e-3
    for child in range(m):   # the second token after the first-level child whose token came first
        token = first[:, child]
        rows = (out[:, 0] == token) & (np.asarray(accepted) >= 1)
        assert rows.sum() > 500
        assert chi_square_p_value(out[rows, 1], p[1 + child]) > 1e-3


# ------------------------------------------------------------------------------------------------------------
# the loop
# ------------------------------------------------------------------------------------------------------------

class OracleTree(Stateless):
    """A tree per step whose one correct branch (plain decoding's continuation) hides among distractor siblings
    at random places, so the accepted path's nodes sit at scattered slots."""
    capture_layers = ()

    def __init__(self, reference: jax.Array, depth: int, branching: int):
        self.reference, self.k = reference, depth
        self.tree = TreeShape(nodes=depth * branching, branching=branching, depth=depth)

    def propose(self, *args):
        raise AssertionError("a tree proposer's loop calls propose_tree")

    def propose_tree(self, draft_state, carry, tokens, lengths, rows):
        B, (d, b) = lengths.shape[0], (self.k, self.tree.branching)
        key = jax.random.fold_in(jax.random.key(0), jnp.sum(lengths))
        true_at = jax.random.randint(key, (B, d), 0, b)
        truth = jnp.take_along_axis(self.reference, jnp.minimum(lengths[:, None] + jnp.arange(d), MAX_LEN - 1),
                                    axis=1)
        distractor = (truth[:, :, None] + 1 + jnp.arange(b)[None, None, :]) % 61
        tokens = jnp.where(jnp.arange(b) == true_at[:, :, None], truth[:, :, None], distractor).reshape(B, d * b)
        level = jnp.arange(d * b) // b
        parent_true = true_at[:, jnp.maximum(level - 1, 0)]
        parents = jnp.where(level == 0, 0, (level - 1) * b + parent_true + 1)
        depth = jnp.broadcast_to(level + 1, (B, d * b))
        return DraftTree(tokens.astype(jnp.int32), parents.astype(jnp.int32), depth.astype(jnp.int32)), None, carry


def test_a_tree_loop_moves_the_accepted_path_into_place():
    """Every step accepts the whole correct branch (up to the budget); output equals plain decoding."""
    plain_state = _run(NoProposer(), _rows(4), 0)
    plain = _generated(plain_state)
    depth = 4
    state = _run(OracleTree(plain_state.tokens, depth, 3), _rows(4), depth)
    assert _generated(state) == plain
    # max_tokens (30, 30, 12, 30): the first token from the prefill, then up to depth + 1 per step.
    assert int(state.steps) == -(-29 // (depth + 1))
    assert state.counters.num_accepted.tolist() == [29 - -(-29 // 5), 29 - -(-29 // 5), 11 - -(-11 // 5),
                                                    29 - -(-29 // 5)]


@pytest.mark.parametrize("branching, nodes", [(2, 8), (3, 12)])
def test_greedy_ngram_trees_equal_plain_decoding(branching, nodes):
    plain = _generated(_run(NoProposer(), _rows(4), 0))
    state = _run(NgramProposer(4, 1, 3, tree=TreeShape(nodes, branching, 4)), _rows(4), 4)
    assert _generated(state) == plain


TINY = dict(architectures=["LlamaForCausalLM"], vocab_size=61, hidden_size=32, intermediate_size=48,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
            rope_theta=1e4, tie_word_embeddings=True, max_position_embeddings=256)


@pytest.fixture(scope="module")
def head_setup(tmp_path_factory):
    cfg = LlamaConfig.from_hf_dict(TINY)
    graph, target_state = nnx.split(FAMILY.random(cfg, seed=0))
    target_state = jax.tree.map(lambda x: x * 3, target_state)
    head = load_eagle_head(write_head(tmp_path_factory.mktemp("head"), TINY, "eagle3_yuhuili", scale=0.3), "eagle3",
                           cfg, target_state, np.float32)
    return cfg, graph, target_state, head


def test_a_heads_tree_passes_see_what_a_chain_along_each_branch_sees(head_setup):
    """Each node's children are the head's best continuations of that node's own path, run as a chain."""
    cfg, graph, target_state, head = head_setup
    head_graph, head_state = nnx.split(head)
    target = nnx.merge(graph, target_state)
    depth, b = 3, 2
    proposer = HeadProposer(head_graph, head, depth, probabilistic=False, feature_size=cfg.hidden_size * 3,
                            tree=TreeShape(nodes=b + 2 * b * b, branching=b, depth=depth))
    S, P = 32, 9
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, 61, (1, S)), jnp.int32)
    lengths = jnp.asarray([P], jnp.int32)
    hidden, _, aux = target(tokens[:, :P], jnp.zeros((1,), jnp.int32), target.init_cache(1, S),
                            capture_layers=proposer.capture_layers)
    rows = _rows(1)
    carry = jax.jit(proposer.observe)(head_state, proposer.init(head_state, tokens[:, :P], lengths, S),
                                      TargetPass(hidden, aux.captured, jnp.zeros((1,), jnp.int32)), tokens, lengths,
                                      rows)
    tree, _, _ = jax.jit(proposer.propose_tree)(head_state, carry, tokens, lengths, rows)
    step = nnx.jit(lambda head, token, feed, position, cache: head(token, feed, position, cache))

    def best_children(path):
        """The head run along `path` as a chain from the carry: its top-b next tokens."""
        out, feed, cache = carry.root[:, None], carry.hidden[:, None], carry.cache
        for i, token in enumerate(path):
            out, feed, cache = step(head, jnp.asarray([[token]]), feed, lengths - 1 + i, cache)
        return set(np.asarray(jax.lax.top_k(head.logits(out[0, 0]), b)[1]).tolist())

    paths = {0: ()}
    for j in range(tree.tokens.shape[1]):
        paths[j + 1] = paths[int(tree.parents[0, j])] + (int(tree.tokens[0, j]),)
    for j in range(tree.tokens.shape[1]):
        parent_path = paths[int(tree.parents[0, j])]
        assert int(tree.tokens[0, j]) in best_children(parent_path), (j, parent_path)


# ------------------------------------------------------------------------------------------------------------
# through LLM, and the config
# ------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_dir(tiny_checkpoint_factory):
    return tiny_checkpoint_factory("llama")


@pytest.mark.parametrize("method", ["ngram", "eagle3", "draft_model"])
def test_llm_greedy_trees_equal_plain_decoding_on_mixed_prompts(tiny_dir, default_model_dir, tmp_path, method):
    config = json.loads((tiny_dir / "config.json").read_text())
    rng = np.random.default_rng(6)
    prompts = [{"prompt_token_ids": (rng.integers(3, config["vocab_size"], int(rng.integers(1, 4))).tolist() * 9)
                [:int(rng.integers(2, 20))]} for _ in range(6)]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=int(n)) for n in (40, 1, 7, 23, 40, 3)]

    def run(spec):
        llm = LLM(str(tiny_dir), tokenizer=str(default_model_dir), max_model_len=96, max_num_seqs=6,
                  speculative_config=spec)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)], llm

    plain, _ = run(None)
    drafter = {"ngram": lambda: {"prompt_lookup_min": 1, "prompt_lookup_max": 3},
               "eagle3": lambda: {"model": str(write_head(tmp_path / "head", config, "eagle3_yuhuili", scale=0.3))},
               # The target drafting for itself: every node on its greedy path is accepted.
               "draft_model": lambda: {"model": str(tiny_dir)}}[method]()
    tree, llm = run({"method": method, "num_speculative_tokens": 4, "tree_nodes": 10, "tree_branching": 3, **drafter})
    assert tree == plain
    metrics = {m.name: m for m in llm.get_metrics()}
    assert metrics["vllm:spec_decode_num_draft_tokens"].value > 0
    if method == "draft_model":
        # Self-drafting: the greedy path is in the tree unless EAGLE-2's frontier dropped it for a likelier branch,
        # so nearly every token after a row's first comes as an accepted node (the rest one per drafting step).
        drafting_steps = metrics["vllm:spec_decode_num_drafts"].value
        possible = sum(map(len, plain)) - len(plain) - drafting_steps
        assert 0.9 * possible <= metrics["vllm:spec_decode_num_accepted_tokens"].value <= possible


def test_tree_rows_with_penalties_stop_ids_and_sampling(tiny_dir, default_model_dir):
    """Greedy rows with penalties, min_tokens and stop ids equal plain decoding's; seeded sampled rows (the
    acceptance walk) reproduce and respect max_tokens."""
    prompts = [{"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6]}, {"prompt_token_ids": [9, 9, 4]}]
    greedy = [SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.3, presence_penalty=0.4,
                             frequency_penalty=0.2, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=30, min_tokens=6, stop_token_ids=[5, 6, 7, 9])]
    sampled = [SamplingParams(temperature=0.9, top_p=0.9, seed=s, max_tokens=20, ignore_eos=True) for s in (1, 2)]

    def llm(spec):
        return LLM(str(tiny_dir), tokenizer=str(default_model_dir), max_model_len=96, max_num_seqs=2,
                   speculative_config=spec)

    def tokens(engine, params):
        return [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]

    tree = llm({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "tree_nodes": 6,
                "tree_branching": 2})
    assert tokens(tree, greedy) == tokens(llm(None), greedy)
    first, again = tokens(tree, sampled), tokens(tree, sampled)
    assert first == again and [len(t) for t in first] == [20, 20]


@pytest.mark.parametrize("keys, match", [
    ({"tree_branching": 2}, "needs 'tree_nodes'"),
    ({"tree_nodes": 0}, "must be >= 1"),
    ({"tree_nodes": 500}, "at most 128"),
    ({"tree_nodes": 20, "tree_branching": 2}, "more than ngram drafts"),
    ({"tree_nodes": 8, "draft_sample_method": "probabilistic"}, "'greedy'"),
    ({"tree_nodes": 8, "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2.0}, "chains only"),
])
def test_bad_trees_are_refused_naming_the_field(keys, match):
    d = {"method": "ngram", "num_speculative_tokens": 4, **keys}
    with pytest.raises((TypeError, ValueError), match=match):
        SpeculativeConfig.from_dict(d, target_max_model_len=256, target_tensor_parallel_size=1)


def test_a_tree_shape_parses_with_its_depth():
    spec = SpeculativeConfig.from_dict({"method": "eagle3", "model": "x", "num_speculative_tokens": 5,
                                        "tree_nodes": 32, "tree_branching": 4},
                                       target_max_model_len=256, target_tensor_parallel_size=1)
    assert spec.tree == TreeShape(nodes=32, branching=4, depth=5)


def test_tree_verify_runs_through_the_kernels():
    """The loop with every kernel as on a GPU (interpret mode): the tree-masked verify kernel, equal output."""
    interpret = KernelPolicy(interpret=True)
    model = FAMILY.random(TARGET[2].cfg, seed=0, kernels=interpret)
    graph, state = nnx.split(model)
    target = (graph, jax.tree.map(lambda x: x * 6, state), model)
    plain = _generated(_run(NoProposer(), _rows(4, max_tokens=(8, 8, 8, 8)), 0, target=target))
    tree = _run(NgramProposer(3, 1, 3, tree=TreeShape(6, 2, 3)), _rows(4, max_tokens=(8, 8, 8, 8)), 3, target=target)
    assert _generated(tree) == plain
