"""Continuous admission: a queue of more requests than slots run as one jitted call. The slots start with the
queue's first requests; the loop decodes until enough slots have finished (or every row has), then prefills
the next requests into the free slots as one batch (their caches, proposer state and settings replace the
finished rows'), and goes on until the queue is empty and every row done. A slot's finished row is copied to
its request's entry of the results before the slot is reused, so the results come back in request order.
Randomness is keyed by (seed, position), never by slot, so admission order does not change a sampled row.

Over a mesh (parallel.sharded_loop.sharded_admitting) the slots' caches are pinned to their layout after every
prefill and decode run, so the outer loop carries them split as the wave loop does.

The outer while_loop alternates one decode run, which stops as soon as the next admission is due, and one
admission, with no lax.cond around either (a conditional would copy the KV caches each time it is taken; see
loop._body_fn). The decode run is the loop's only copy, so the call compiles the decode loop and its tiers once;
the admission after the last decode run admits nothing, and a conditional around the prefill alone (its output
the fresh rows, no slot's cache) skips that prefill's model pass.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.engine import loop
from specjax.engine.adaptive import PolicyInputs
from specjax.engine.proposers.base import Proposer
from specjax.engine.state import LoopState, RowParams
from specjax.parallel.mesh import pin_cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Queue:
    """The requests of one call, [Q] rows padded to a bucket; only the first `size` are real."""
    tokens: jax.Array    # i32 [Q, P] prompts, padded
    lengths: jax.Array   # i32 [Q]
    rows: RowParams      # [Q]
    size: jax.Array      # i32 []


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Admission:
    """The carry of the outer loop: the slots' loop state and what admission keeps beside it."""
    loop: LoopState      # [B] slots
    rows: RowParams      # [B] the settings of each slot's request
    request: jax.Array   # i32 [B] the queue index of each slot's request
    admitted_at: jax.Array  # i32 [B] the iteration (loop.steps) its request entered the slot
    busy: jax.Array      # i32 [B] iterations the slot ran requests it has handed on
    admissions: jax.Array   # i32 [] prefill batches run after the first
    next: jax.Array      # i32 [] the first request not yet admitted
    results: LoopState   # [Q] each handed-on request's row (no caches, counts or proposer state)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AdmissionOutput:
    results: LoopState   # [Q], as a wave's final state holds its rows
    steps: jax.Array     # i32 [] loop iterations run
    busy: jax.Array      # i32 [B] iterations each slot ran a request
    admissions: jax.Array   # i32 [] prefill batches after the first
    adapt: Any           # an adaptive loop's record; None for a fixed k


def build_admitting(target_graph: nnx.GraphDef, proposer: Proposer, spec: loop.LoopSpec, *,
                    admit_batch: int) -> Callable:
    """A pure function (target_state, draft_state, queue, slots, cache_len, record_len, synthetic_rates=None,
    policy=None) -> AdmissionOutput. slots, cache_len and record_len are static: the rows decoded together, the
    buffer length every request fits (shapes.buffer_len over the queue) and the iterations an adaptive record
    holds. admit_batch: requests prefilled together once that many slots are free (fewer when fewer wait)."""

    def generate(target_state, draft_state, queue: Queue, slots: int, cache_len: int, record_len: int,
                 synthetic_rates: jax.Array | None = None, policy: PolicyInputs | None = None) -> AdmissionOutput:
        target = nnx.merge(target_graph, target_state)
        width = min(admit_batch, slots)

        def prefill(indices: jax.Array) -> tuple[LoopState, RowParams]:
            picked = jax.tree.map(lambda x: x[jnp.minimum(indices, queue.tokens.shape[0] - 1)],
                                  (queue.tokens, queue.lengths, queue.rows))
            state = loop.prefill_rows(target, proposer, draft_state, *picked, cache_len, spec, policy, record_len)
            return dataclasses.replace(state, cache=pin_cache(state.cache)), picked[2]

        def prefill_taken(take: jax.Array, indices: jax.Array) -> tuple[LoopState, RowParams]:
            """prefill(indices) where some request is admitted; zeros of its shape where none is (the admission
            after the last decode run), so that one costs no model pass. Only the fresh rows come out of the
            branch, so the slots' caches are not copied into it."""
            def none_taken(indices):
                state, rows = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(prefill, indices))
                return dataclasses.replace(state, cache=pin_cache(state.cache)), rows

            return jax.lax.cond(take > 0, prefill, none_taken, indices)

        def decode(a: Admission) -> Admission:
            waiting = queue.size - a.next
            due = jnp.minimum(width, waiting)

            def admission_due(s: LoopState) -> jax.Array:
                return (waiting > 0) & (jnp.sum(s.done) >= due)

            state = loop.decode_rows(target, proposer, draft_state, a.loop, a.rows, spec, synthetic_rates,
                                     pause=admission_due)
            return dataclasses.replace(a, loop=dataclasses.replace(state, cache=pin_cache(state.cache)))

        def admit(a: Admission) -> Admission:
            B = a.request.shape[0]
            take = jnp.minimum(jnp.minimum(jnp.sum(a.loop.done), width), queue.size - a.next)   # 0: none waits
            free_first = jnp.argsort(~a.loop.done, stable=True)[:width]
            into = jnp.where(jnp.arange(width) < take, free_first, B)   # B: out of range, dropped
            fresh, rows = prefill_taken(take, a.next + jnp.arange(width))
            fresh = dataclasses.replace(fresh, done_at=jnp.full_like(fresh.done_at, a.loop.steps))
            state = _with_rows(dataclasses.replace(a.loop, steps=None, adapt=None),
                               dataclasses.replace(fresh, steps=None, adapt=None), into)
            return dataclasses.replace(
                _hand_on(a, into), loop=dataclasses.replace(state, steps=a.loop.steps, adapt=a.loop.adapt),
                rows=_with_rows(a.rows, rows, into), request=a.request.at[into].set(a.next + jnp.arange(width),
                                                                                mode="drop"),
                admitted_at=a.admitted_at.at[into].set(a.loop.steps, mode="drop"),
                admissions=a.admissions + (take > 0), next=a.next + take)

        def running(a: Admission) -> jax.Array:
            return (a.next < queue.size) | ~jnp.all(a.loop.done)

        with loop.exact_matmuls(target.embed[...].dtype):
            first = jnp.arange(slots)
            state, rows = prefill(first)
            Q = queue.tokens.shape[0]
            results = jax.tree.map(lambda x: jnp.zeros((Q,) + x.shape[1:], x.dtype), _row_fields(state))
            a = Admission(loop=state, rows=rows, request=first, admitted_at=jnp.zeros((slots,), jnp.int32),
                          busy=jnp.zeros((slots,), jnp.int32), admissions=jnp.zeros((), jnp.int32),
                          next=jnp.minimum(queue.size, slots), results=results)
            a = jax.lax.while_loop(running, lambda a: admit(decode(a)), a)
            a = _hand_on(a, first)
        return AdmissionOutput(a.results, a.loop.steps, a.busy, a.admissions, a.loop.adapt)

    return generate


def _row_fields(state: LoopState) -> LoopState:
    """What a request's result keeps of its row: everything per row but the caches, counts and proposer."""
    return dataclasses.replace(state, cache=None, proposer=None, counts=None, steps=None, adapt=None)


def _hand_on(a: Admission, slots: jax.Array) -> Admission:
    """The admission state with the rows in `slots` (B: none) copied to their requests' results, and their
    iterations counted as busy."""
    B = a.request.shape[0]
    rows = jnp.minimum(slots, B - 1)   # in range for the reads; the writes drop slot B
    at = jnp.where(slots < B, a.request[rows], a.results.lengths.shape[0])
    picked = jax.tree.map(lambda x: x[rows], _row_fields(a.loop))
    results = jax.tree.map(lambda kept, new: kept.at[at].set(new, mode="drop"), a.results, picked)
    ran = (a.loop.done_at - a.admitted_at)[rows]
    return dataclasses.replace(a, results=results, busy=a.busy.at[slots].add(ran, mode="drop"))


def _with_rows(tree: Any, fresh: Any, slots: jax.Array) -> Any:
    """A pytree of per-row arrays (a loop state without its scalars, row settings) with its rows `slots` (out
    of range: skipped) replaced by fresh's rows, caches and proposer state included. Caches keep the batch on
    axis 1 (models.family.Cache), everything else on axis 0."""
    def put(old: Any, new: Any) -> Any:
        if _is_cache(old):
            return jax.tree.map(lambda o, n: o.at[:, slots].set(n, mode="drop"), old, new)
        return old.at[slots].set(new, mode="drop")

    return jax.tree.map(put, tree, fresh, is_leaf=_is_cache)


def _is_cache(node: Any) -> bool:
    return hasattr(node, "gathered") and hasattr(node, "specs")


def admit_batch(slots: int) -> int:
    """Requests prefilled together: a sixteenth of the slots (at least one), so a freed slot waits a few
    iterations at most for its next request while each prefill still fills several rows."""
    return max(1, slots // 16)
