"""One jitted call per wave of requests: batched prefill, then ONE lax.while_loop of
propose -> verify -> accept -> commit -> observe. Plain decoding is the same loop with k = 0.
Streaming runs the same prefill and loop as two jitted functions, the loop in bounded chunks (build_stream).
`observe` hands the proposer the target's hidden states of the pass just committed (EAGLE reads them).
Adaptive speculation (spec.policy) runs the loop in segments, each of one k tier chosen on the device
(engine/adaptive.py), k = 0 a plain decode step. A proposer with a draft tree (proposer.tree) drafts one tree per
step, verified in one target pass with a tree mask (engine/tree_acceptance.py); the accepted path's KV is moved
to contiguous slots, so rejection stays a length update.
Penalties (when the rows carry them) are applied at every verify position to the counts a plain step would
see there: the committed tokens plus the drafts before that position, which are committed when it matters.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from specjax.config.speculation_policy import SpeculationPolicy
from specjax.engine import sampling
from specjax.engine.adaptive import PolicyInputs, choose_tier, init_adapt, record, segment_kinds
from specjax.engine.draft_tree import DraftTree
from specjax.engine.proposers.base import Proposer, TargetPass
from specjax.engine.rejection import rejection_sample
from specjax.engine.state import LoopState, RowParams, SpecCounters, TokenCounts, TokenLogprobs
from specjax.engine.tree_acceptance import accept_tree
from specjax.parallel.mesh import gather_vocab
from specjax.parallel.sharded_loop import sharded_generate


@dataclasses.dataclass(frozen=True)
class LoopSpec:
    """What a compiled loop is specialised on (besides array shapes)."""
    k: int                      # speculative tokens per step (0 = plain decoding)
    n_top: int                  # top logprobs kept per generated token
    max_model_len: int
    greedy: bool = False        # every row greedy: argmax only (no distributions, draws or batch-wide cond)
    ranks: bool = False         # rank each generated token in the vocabulary (vLLM's Logprob.rank)
    prompt_top: int | None = None   # prompt logprobs with this many top entries per token; None: none
    policy: SpeculationPolicy | None = None   # adaptive speculation's tiers (k the most); None: k every step


def build_generate(target_graph: nnx.GraphDef, proposer: Proposer, spec: LoopSpec, *,
                   mesh: Mesh | None = None) -> Callable:
    """A pure function (target_state, draft_state, prompt_tokens [B,P], prompt_lengths [B], rows, cache_len,
    synthetic_rates=None, policy=None) -> final LoopState, run tensor-parallel over `mesh` when given (the
    states placed on it). `cache_len` is static: the wave's KV/token buffer length (shapes.buffer_len).
    `synthetic_rates` (f32 [k], benchmarks only) replaces verification by acceptance at those conditional rates;
    it is an argument rather than part of the spec so that sweeping rates does not recompile. `policy`
    (PolicyInputs) is what an adaptive spec's tier choice reads: step costs, a forced tier."""

    def generate(target_state, draft_state, prompt_tokens, prompt_lengths, rows: RowParams, cache_len: int,
                 synthetic_rates: jax.Array | None = None, policy: PolicyInputs | None = None):
        target = nnx.merge(target_graph, target_state)
        with exact_matmuls(target.embed[...].dtype):
            state = prefill_rows(target, proposer, draft_state, prompt_tokens, prompt_lengths, rows, cache_len,
                                 spec, policy)
            return decode_rows(target, proposer, draft_state, state, rows, spec, synthetic_rates)

    return generate if mesh is None else sharded_generate(generate, mesh)


def build_stream(target_graph: nnx.GraphDef, proposer: Proposer, spec: LoopSpec) -> tuple[Callable, Callable]:
    """build_generate's loop cut where the host can look in: (prefill, advance). prefill(target_state,
    draft_state, prompt_tokens, prompt_lengths, rows, cache_len, policy=None) -> the LoopState after the first
    token;
    advance(target_state, draft_state, state, rows, max_steps, synthetic_rates=None) -> the state after at most
    max_steps more iterations (fewer once every row is done). max_steps is traced, so any chunk size runs the
    same executable; chaining advance until every row is done runs the very steps generate runs. One device
    (sharded_generate does not hand the proposer's carry back out)."""

    def prefill(target_state, draft_state, prompt_tokens, prompt_lengths, rows: RowParams, cache_len: int,
                policy: PolicyInputs | None = None):
        target = nnx.merge(target_graph, target_state)
        with exact_matmuls(target.embed[...].dtype):
            return prefill_rows(target, proposer, draft_state, prompt_tokens, prompt_lengths, rows, cache_len,
                                spec, policy)

    def advance(target_state, draft_state, state: LoopState, rows: RowParams, max_steps: jax.Array,
                synthetic_rates: jax.Array | None = None):
        target = nnx.merge(target_graph, target_state)
        with exact_matmuls(target.embed[...].dtype):
            return decode_rows(target, proposer, draft_state, state, rows, spec, synthetic_rates, max_steps)

    return prefill, advance


def decode_rows(target, proposer, draft_state, state: LoopState, rows: RowParams, spec: LoopSpec,
                synthetic_rates, max_steps: jax.Array | None = None,
                pause: Callable[[LoopState], jax.Array] | None = None) -> LoopState:
    """The step repeated while a row is running, (when max_steps is given) at most max_steps times, and (when
    pause is given) until pause(state) holds."""
    stop_at = None if max_steps is None else state.steps + max_steps

    def running(s: LoopState) -> jax.Array:
        going = jnp.any(~s.done)
        if stop_at is not None:
            going &= s.steps < stop_at
        return going if pause is None else going & ~pause(s)

    body = _body_fn(target, proposer, draft_state, rows, spec, synthetic_rates, running)
    return jax.lax.while_loop(running, body, state)


def jit_generate(target_graph: nnx.GraphDef, proposer: Proposer, spec: LoopSpec, *, mesh: Mesh | None = None,
                 compiler_options: dict[str, str] | None = None) -> Callable:
    """build_generate's function jitted as every caller runs it (runner, recording, benchmarks; the functional
    core hands the unjitted one to the user's jit): `cache_len` static, compiled with loop_compiler_options()
    unless other options are given."""
    options = loop_compiler_options() if compiler_options is None else compiler_options
    return jax.jit(build_generate(target_graph, proposer, spec, mesh=mesh), static_argnums=(5,),
                   compiler_options=options)


def jit_stream(target_graph: nnx.GraphDef, proposer: Proposer, spec: LoopSpec, *,
               compiler_options: dict[str, str] | None = None) -> tuple[Callable, Callable]:
    """build_stream's (prefill, advance) jitted as the runner streams with them: prefill's `cache_len` static;
    advance donates the state it is given, so a chunk updates the KV caches in place rather than copying them."""
    options = loop_compiler_options() if compiler_options is None else compiler_options
    prefill, advance = build_stream(target_graph, proposer, spec)
    return (jax.jit(prefill, static_argnums=(5,), compiler_options=options),
            jax.jit(advance, donate_argnums=(2,), compiler_options=options))


def loop_compiler_options() -> dict[str, str]:
    """XLA options to jit a generate loop with (`jax.jit(generate, compiler_options=...)`). On GPUs the whole
    while loop, its condition included, becomes one CUDA graph (WHILE and CONDITIONAL command buffers, beside
    XLA's default kinds): the host no longer reads the loop predicate back and relaunches the body's graph
    every step (benchmarks/RESULTS.md has the gain). Empty elsewhere."""
    if jax.default_backend() != "gpu":
        return {}
    return {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,"
                                             "WHILE,CONDITIONAL"}


def eager_compiler_options() -> dict[str, str]:
    """What `enforce_eager=True` compiles the loop with: no CUDA graphs at all (XLA's command buffers off, its
    default kinds included), as vLLM's enforce_eager runs without them; every kernel is then launched from the
    host, where a profiler or a debugger sees it. Empty off GPUs, which have no CUDA graphs."""
    return {"xla_gpu_enable_command_buffer": ""} if jax.default_backend() == "gpu" else {}


def exact_matmuls(dtype) -> contextlib.AbstractContextManager:
    """float32 models trace their matmuls at full float32 precision: GPUs otherwise run them in TF32, which
    rounds a (k+1)-token verify pass differently from a one-token step, so greedy speculation would no longer
    reproduce plain decoding token for token. Other dtypes keep the default."""
    return jax.default_matmul_precision("highest") if dtype == jnp.float32 else contextlib.nullcontext()


def prefill_rows(target, proposer, draft_state, prompt_tokens, prompt_lengths, rows, cache_len, spec,
                 policy: PolicyInputs | None, record_len: int | None = None) -> LoopState:
    """The rows' prompts run into fresh caches and their first tokens committed. record_len: iterations an
    adaptive loop's record holds (cache_len by default, more than a wave runs)."""
    B, P = prompt_tokens.shape
    cache = target.init_cache(B, cache_len)
    start = jnp.zeros((B,), jnp.int32)
    hidden, cache, aux = target(prompt_tokens, start, cache, capture_layers=proposer.capture_layers, fresh=True)
    last_hidden = hidden[jnp.arange(B), prompt_lengths - 1][:, None]  # [B, 1, H]
    raw_logits = gather_vocab(target.logits(last_hidden))
    counts = None if rows.penalties is None else _prompt_counts(prompt_tokens, prompt_lengths, raw_logits.shape[-1])
    logits = _penalised(_mask_stop_ids(raw_logits, rows, generated=jnp.zeros((B,), jnp.int32)), rows, counts,
                        jnp.zeros((B, 0), jnp.int32))
    first = sampling.sample(logits[:, 0], rows.temperature, rows.top_k, rows.top_p, rows.min_p,
                            rows.seed, prompt_lengths, greedy_only=spec.greedy, kernels=target.kernels)
    tokens = jnp.zeros((B, cache_len), jnp.int32).at[:, :P].set(prompt_tokens)
    state = LoopState(
        tokens=tokens, lengths=prompt_lengths, prompt_lengths=prompt_lengths,
        logprobs=TokenLogprobs(jnp.zeros((B, cache_len), jnp.float32), jnp.zeros((B, cache_len), jnp.int32),
                               jnp.zeros((B, cache_len, spec.n_top), jnp.int32),
                               jnp.zeros((B, cache_len, spec.n_top), jnp.float32)),
        prompt_logprobs=None if spec.prompt_top is None else _prompt_logprobs(target, hidden, prompt_tokens, spec),
        counts=counts, done=jnp.zeros((B,), bool), done_at=jnp.zeros((B,), jnp.int32), cache=cache,
        proposer=proposer.init(draft_state, prompt_tokens, prompt_lengths, cache_len),
        counters=SpecCounters(*(jnp.zeros((B,), jnp.int32) for _ in range(3)),
                              jnp.zeros((B, spec.k), jnp.int32)),
        steps=jnp.zeros((), jnp.int32), adapt=_init_adapt(spec, record_len or cache_len, policy))
    state = _commit(state, first[:, None], jnp.ones((B,), jnp.int32), raw_logits, rows, spec)
    return _observe(proposer, draft_state, state, TargetPass(hidden, aux.captured, start), rows)


def _init_adapt(spec: LoopSpec, record_len: int, policy: PolicyInputs | None):
    """An adaptive loop's statistics (None for a fixed k), recording up to record_len iterations."""
    if spec.policy is None:
        return None
    if policy is None:
        raise ValueError("an adaptive loop (LoopSpec.policy) needs its PolicyInputs (step costs) as `policy`")
    return init_adapt(spec.k, record_len, policy)


def _body_fn(target, proposer, draft_state, rows: RowParams, spec: LoopSpec, synthetic_rates, running):
    """The loop body: one step of a fixed k; or (adaptive) a segment of up to SEGMENT steps of the tier chosen
    at its start: every tier's segment is a while loop of its own, one after the other, and only the chosen
    one's condition holds. A while loop updates its carry in place, so a tier that does not run costs one
    predicate; a lax.switch over the tiers copied every buffer its branches update, the KV caches among them,
    at each choice (benchmarks/RESULTS.md, "Compiling for an H200 without one")."""
    policy = spec.policy
    if policy is None:
        if proposer.tree is not None:
            step = _tree_step(target, proposer, draft_state, rows, spec)
        else:
            step = _tier_step(target, proposer, draft_state, rows, spec, synthetic_rates, spec.k, adaptive=False)
        return lambda state: step(state)[0]

    def segment(k: int, shadow: bool):
        if proposer.tree is not None and k > 0:
            step = _tree_step(target, proposer, draft_state, rows, spec)
        else:
            step = _tier_step(target, proposer, draft_state, rows, spec, synthetic_rates, k, adaptive=True,
                              shadow=shadow)

        def recorded_step(state: LoopState, segment_steps: jax.Array) -> LoopState:
            active = ~state.done
            # The positions the step paid to verify: every one its budget allows, drafted or not. A proposer
            # that found no draft there (an n-gram miss) gained nothing from them, so they count as rejected.
            offered = jnp.clip(_budget(state, rows, spec) - 1, 0, k + shadow)
            state, accepted = step(state)
            adapt = record(state.adapt, state.steps, k, jnp.sum(active).astype(jnp.int32), offered, accepted,
                           active, segment_steps, shadow)
            return dataclasses.replace(state, adapt=adapt)

        def run(state: LoopState, chosen: jax.Array, steps: jax.Array, end: jax.Array) -> LoopState:
            return jax.lax.while_loop(lambda s: chosen & running(s) & (s.steps < end),
                                      lambda s: recorded_step(s, steps), state)

        return run

    kinds = segment_kinds(policy)
    segments = [segment(k, shadow) for k, shadow in kinds]

    def body(state: LoopState) -> LoopState:
        tier, shadow, steps, adapt = choose_tier(state.adapt, jnp.sum(~state.done).astype(jnp.int32), policy)
        # Rows fall behind the proposer only in plain segments, so a drafting segment catches up once, here.
        drafting = jnp.asarray(policy.tiers)[tier] > 0
        carry = proposer.catch_up(draft_state, state.proposer, state.tokens, state.lengths, rows, drafting)
        state = dataclasses.replace(state, adapt=adapt, proposer=carry)
        end = state.steps + steps   # once: every tier's loop would otherwise add it again
        for (k, shadowed), run in zip(kinds, segments):
            state = run(state, (tier == policy.tiers.index(k)) & (shadow == shadowed), steps, end)
        return state

    return body


def _tier_step(target, proposer, draft_state, rows: RowParams, spec: LoopSpec, synthetic_rates, k: int,
               adaptive: bool, shadow: bool = False):
    """One iteration drafting k tokens per row: state -> (state, each row's drafts accepted). An adaptive loop's
    k = 0 tier is a plain decode step: no proposer, a one-token target pass, plain sampling; the proposer only
    keeps (`skipped`) what its catch_up needs later. A shadow (engine/adaptive.py) drafts k + 1 and verifies the
    last at the bonus position (a row of logits padded on for a bonus never emitted); it emits what tier k
    would, and its accepted count includes that draft."""
    drafted = k + shadow
    drafter = proposer.with_k(drafted) if adaptive and k > 0 else proposer
    plain_tier = adaptive and k == 0   # a fixed k = 0 (plain decoding, recording) runs its proposer as any k
    rates = None if synthetic_rates is None else synthetic_rates[:drafted]

    def step(state: LoopState) -> tuple[LoopState, jax.Array]:
        B = state.lengths.shape[0]
        budget = _budget(state, rows, spec)
        if plain_tier:
            drafts, draft_probs, proposer_state = jnp.zeros((B, 0), jnp.int32), None, state.proposer
        else:
            drafts, draft_probs, proposer_state = drafter.propose(draft_state, state.proposer, state.tokens,
                                                                  state.lengths, rows)
        drafts = _clamp_drafts(drafts, budget, drafted)
        last = state.tokens[jnp.arange(B), state.lengths - 1]
        verify_tokens = jnp.concatenate([last[:, None], jnp.maximum(drafts[:, :k], 0)], axis=1)
        start = state.lengths - 1
        hidden, cache, aux = target(verify_tokens, start, state.cache, capture_layers=proposer.capture_layers)
        raw_logits = gather_vocab(target.logits(hidden))  # [B, k+1, V]
        logits = _mask_stop_ids(raw_logits, rows, generated=state.lengths - state.prompt_lengths)
        logits = _penalised(logits, rows, state.counts, drafts[:, :k])
        if shadow:
            logits = jnp.pad(logits, ((0, 0), (0, 1), (0, 0)))
        out, verdicts = _verify(logits, drafts, draft_probs, rows, state.lengths, spec, drafted, rates,
                                target.kernels)
        accepted = jnp.minimum(verdicts, k)
        active = ~state.done
        state = dataclasses.replace(state, cache=cache, proposer=proposer_state,
                                    counters=_count(state.counters, drafts[:, :k], accepted, active),
                                    steps=state.steps + 1)
        state = _commit(state, out[:, :k + 1], accepted + 1, raw_logits, rows, spec)
        passed = TargetPass(hidden, aux.captured, start)
        if plain_tier:
            carry = proposer.skipped(draft_state, state.proposer, passed, state.tokens, state.lengths, rows)
            return dataclasses.replace(state, proposer=carry), verdicts
        return _observe(drafter, draft_state, state, passed, rows), verdicts

    return step


def _tree_step(target, proposer: Proposer, draft_state, rows: RowParams, spec: LoopSpec):
    """One iteration drafting a tree per row: one target pass over the root (the last committed token) and the
    tree's nodes, the accepted path's KV and hidden states moved to follow the root, the path committed:
    state -> (state, each row's drafts accepted)."""
    depth = proposer.k

    def step(state: LoopState) -> tuple[LoopState, jax.Array]:
        B = state.lengths.shape[0]
        budget = _budget(state, rows, spec)
        tree, draft_probs, proposer_state = proposer.propose_tree(draft_state, state.proposer, state.tokens,
                                                                  state.lengths, rows)
        tree = tree.within(budget - 1)
        last = state.tokens[jnp.arange(B), state.lengths - 1]
        verify_tokens = jnp.concatenate([last[:, None], jnp.maximum(tree.tokens, 0)], axis=1)
        start = state.lengths - 1
        hidden, cache, aux = target(verify_tokens, start, state.cache, capture_layers=proposer.capture_layers,
                                    tree=tree.verify_mask(start, depth))
        raw_logits = gather_vocab(target.logits(hidden))  # [B, N+1, V]
        depths = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), tree.depth], axis=1)
        logits = _mask_stop_ids(raw_logits, rows, generated=state.lengths - state.prompt_lengths, offsets=depths)
        logits = _penalised_tree(logits, rows, state.counts, tree, depth)
        out, accepted, path = accept_tree(logits, tree, draft_probs, depth, rows.temperature, rows.top_k,
                                          rows.top_p, rows.min_p, rows.seed, state.lengths, greedy_only=spec.greedy,
                                          kernels=target.kernels)
        kept = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), path], axis=1)   # root, then the path by depth
        active = ~state.done
        state = dataclasses.replace(state, cache=cache.gathered(start[:, None] + kept[:, 1:], start + 1),
                                    proposer=proposer_state,
                                    counters=_count(state.counters, tree.tokens, accepted, active),
                                    steps=state.steps + 1)
        state = _commit(state, out, accepted + 1, _along(raw_logits, kept), rows, spec)
        captured = None if aux.captured is None else _along(aux.captured, kept)
        passed = TargetPass(_along(hidden, kept), captured, start)
        return _observe(proposer, draft_state, state, passed, rows), accepted

    return step


def _along(values: jax.Array, indices: jax.Array) -> jax.Array:
    """values [B, T, ...] at indices [B, K] along axis 1."""
    return jnp.take_along_axis(values, indices.reshape(indices.shape + (1,) * (values.ndim - 2)), axis=1)


def _penalised_tree(logits: jax.Array, rows: RowParams, counts: TokenCounts | None, tree: DraftTree,
                    depth: int) -> jax.Array:
    """_penalised for a tree's N + 1 positions: each counts its strict ancestors' tokens as generated."""
    if rows.penalties is None:
        return logits
    strict = tree.ancestry(depth)[:, :, 1:] & ~jnp.eye(logits.shape[1], dtype=bool)[None, :, 1:]   # [B, N+1, N]
    drafted = jax.nn.one_hot(tree.tokens, logits.shape[-1], dtype=jnp.int32)                  # -1: all zero
    generated = counts.generated[:, None] + jnp.einsum("bij,bjv->biv", strict.astype(jnp.int32), drafted)
    p = rows.penalties
    return sampling.apply_penalties(logits, counts.in_prompt, generated, p.presence, p.frequency, p.repetition)


def _observe(proposer: Proposer, draft_state, state: LoopState, target: TargetPass, rows: RowParams) -> LoopState:
    """Let the proposer read what the target computed, now that the committed lengths are known."""
    carry = proposer.observe(draft_state, state.proposer, target, state.tokens, state.lengths, rows)
    return dataclasses.replace(state, proposer=carry)


def _verify(logits, drafts, draft_probs, rows: RowParams, position, spec: LoopSpec, k: int, synthetic_rates,
            kernels):
    """Output tokens [B, k+1] and accepted counts; with k = 0 this is plain sampling. kernels: the target's
    kernel policy, which the sampling filters follow."""
    if k == 0:
        token = sampling.sample(logits[:, 0], rows.temperature, rows.top_k, rows.top_p, rows.min_p,
                                rows.seed, position, greedy_only=spec.greedy, kernels=kernels)
        return token[:, None], jnp.zeros_like(position)
    return rejection_sample(logits, drafts, draft_probs, rows.temperature, rows.top_k, rows.top_p,
                            rows.min_p, rows.seed, position, synthetic_rates=synthetic_rates,
                            greedy_only=spec.greedy, kernels=kernels)


def _budget(state: LoopState, rows: RowParams, spec: LoopSpec) -> jax.Array:
    """Tokens each row may still emit: max_tokens and max_model_len both bound it; 0 for finished rows."""
    generated = state.lengths - state.prompt_lengths
    left = jnp.minimum(rows.max_tokens - generated, spec.max_model_len - state.lengths)
    return jnp.where(state.done, 0, jnp.maximum(left, 0))


def _clamp_drafts(drafts: jax.Array, budget: jax.Array, k: int) -> jax.Array:
    """A step emits accepted drafts + 1, so at most budget - 1 drafts can be used; the rest become -1,
    as does everything after a row's first missing draft."""
    allowed = jnp.clip(budget - 1, 0, k)
    pos = jnp.arange(k)[None, :]
    drafts = jnp.where(pos < allowed[:, None], drafts, -1)
    missing_before = jnp.cumsum(drafts < 0, axis=1) > 0
    return jnp.where(missing_before, -1, drafts)


def _mask_stop_ids(logits: jax.Array, rows: RowParams, generated: jax.Array,
                   offsets: jax.Array | None = None) -> jax.Array:
    """min_tokens: a stop id cannot be produced at output index < min_tokens (vLLM masks its logit). Position t
    produces output index generated + offsets[:, t] (a tree node's depth), generated + t by default."""
    B, T, V = logits.shape
    offsets = jnp.arange(T)[None, :] if offsets is None else offsets
    too_early = (generated[:, None] + offsets) < rows.min_tokens[:, None]  # [B, T]
    # Compared id by id rather than scattered into a [B, V] mask, so that the test fuses into the logits' consumer
    # instead of writing a mask every step.
    vocab = jnp.arange(V)[None, :]
    is_stop = functools.reduce(jnp.logical_or, [vocab == rows.stop_ids[:, i:i + 1]
                                                for i in range(rows.stop_ids.shape[1])])   # -1 matches no id
    return jnp.where(too_early[:, :, None] & is_stop[:, None, :], -jnp.inf, logits)


def _prompt_counts(prompt_tokens: jax.Array, prompt_lengths: jax.Array, vocab: int) -> TokenCounts:
    """The penalties' counts after the prompt: which tokens it holds (its padding excluded), none generated."""
    B, P = prompt_tokens.shape
    real = jnp.arange(P)[None, :] < prompt_lengths[:, None]
    in_prompt = jnp.zeros((B, vocab), bool).at[jnp.arange(B)[:, None], jnp.where(real, prompt_tokens, vocab)].set(
        True, mode="drop")
    return TokenCounts(in_prompt=in_prompt, generated=jnp.zeros((B, vocab), jnp.int32))


def _penalised(logits: jax.Array, rows: RowParams, counts: TokenCounts | None, drafts: jax.Array) -> jax.Array:
    """logits [B, T, V] with the rows' penalties applied, position t counting drafts[:, :t] [B, T-1] (-1 = none)
    as generated; unchanged when the rows have no penalties."""
    if rows.penalties is None:
        return logits
    generated = sampling.counts_through(counts.generated, drafts)
    p = rows.penalties
    return sampling.apply_penalties(logits, counts.in_prompt, generated, p.presence, p.frequency, p.repetition)


def _prompt_logprobs(target, hidden: jax.Array, prompt_tokens: jax.Array, spec: LoopSpec) -> TokenLogprobs:
    """Each prompt token's record given the tokens before it (vLLM's prompt_logprobs; the first has none)."""
    logits = gather_vocab(target.logits(hidden[:, :-1]))   # [B, P-1, V]: position t predicts token t + 1
    return _records(logits, prompt_tokens[:, 1:], spec.prompt_top, ranks=True)


def _records(logits: jax.Array, tokens: jax.Array, n_top: int, ranks: bool) -> TokenLogprobs:
    """The logprob records of tokens [B, N] under logits [B, N, V]; ranks 0 unless `ranks` (static)."""
    chosen, top_ids, top_logprobs = sampling.token_logprobs(logits, tokens, n_top)
    rank = sampling.token_ranks(logits, tokens) if ranks else jnp.zeros(chosen.shape, jnp.int32)
    return TokenLogprobs(chosen, rank, top_ids, top_logprobs)


def _commit(state: LoopState, out: jax.Array, candidates: jax.Array, raw_logits: jax.Array,
            rows: RowParams, spec: LoopSpec) -> LoopState:
    """Append each row's first n_emit tokens of `out` [B, T]: the candidates, cut after a stop id and at the
    budget. Rejected drafts are never written, so rejection is only a length update."""
    B, T = out.shape
    idx = jnp.arange(T)[None, :]
    budget = _budget(state, rows, spec)
    is_stop = jnp.any(out[:, :, None] == jnp.where(rows.stop_ids >= 0, rows.stop_ids, -2)[:, None, :], axis=-1)
    is_stop &= idx < candidates[:, None]
    first_stop = jnp.where(jnp.any(is_stop, 1), jnp.argmax(is_stop, 1), T)
    n_emit = jnp.minimum(jnp.minimum(candidates, first_stop + 1), budget)
    slots = jnp.where(idx < n_emit[:, None], state.lengths[:, None] + idx, state.tokens.shape[1])  # OOB = drop
    rows_idx = jnp.arange(B)[:, None]
    logprobs = jax.tree.map(lambda kept, new: kept.at[rows_idx, slots].set(new, mode="drop"), state.logprobs,
                            _records(raw_logits, out, spec.n_top, spec.ranks))
    done = state.done | (first_stop < n_emit) | (n_emit >= budget)
    return dataclasses.replace(
        state,
        tokens=state.tokens.at[rows_idx, slots].set(out, mode="drop"), logprobs=logprobs,
        counts=_count_generated(state.counts, out, idx < n_emit[:, None]),
        lengths=state.lengths + n_emit, done=done,
        done_at=jnp.where(done & ~state.done, state.steps, state.done_at))


def _count_generated(counts: TokenCounts | None, out: jax.Array, emitted: jax.Array) -> TokenCounts | None:
    """The counts with the emitted tokens of out [B, T] added."""
    if counts is None:
        return None
    rows_idx = jnp.arange(out.shape[0])[:, None]
    generated = counts.generated.at[rows_idx, jnp.maximum(out, 0)].add(emitted.astype(jnp.int32))
    return dataclasses.replace(counts, generated=generated)


def _count(c: SpecCounters, drafts: jax.Array, accepted: jax.Array, active: jax.Array) -> SpecCounters:
    """vLLM's counters: a step with at least one draft token is one draft."""
    proposed = jnp.sum(drafts >= 0, axis=1) * active
    accepted = accepted * active
    return SpecCounters(
        num_drafts=c.num_drafts + (proposed > 0),
        num_draft_tokens=c.num_draft_tokens + proposed,
        num_accepted=c.num_accepted + accepted,
        accepted_per_pos=c.accepted_per_pos + (jnp.arange(c.accepted_per_pos.shape[1])[None] < accepted[:, None]))
