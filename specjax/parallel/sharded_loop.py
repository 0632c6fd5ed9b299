"""The generate loop run over a mesh, and proposers traced with their model whole on each device."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from specjax.parallel.mesh import DATA_AXIS, MODEL_AXIS, Layout, current_layout, pin_cache, traced_with


def sharded_generate(generate: Callable, mesh: Mesh) -> Callable:
    """build_generate's function (target_state, draft_state, prompt_tokens, prompt_lengths, rows, cache_len,
    synthetic_rates=None, policy=None) run over `mesh`: each "data" replica on its own rows under shard_map (rows never
    interact, so replicas exchange nothing), tensor-parallel over "model" inside. The target's cache is
    pinned to its own sharding (`cache.specs(layout)`), which pins the while_loop carry the same way; every
    cache leaf keeps its batch on axis 1. The proposer's carry is not returned (its row axis is the
    proposer's business); `steps` is the most any replica ran; an adaptive loop's record (`adapt`) is the
    first replica's (each replica chooses its tiers from its own rows)."""

    def replica(target_state, draft_state, prompt_tokens, prompt_lengths, rows, synthetic_rates, policy, *,
                cache_len):
        layout = Layout(jax.sharding.get_abstract_mesh(), head_axis=MODEL_AXIS)  # this replica's rows only
        with traced_with(layout):
            state = generate(target_state, draft_state, prompt_tokens, prompt_lengths, rows, cache_len,
                             synthetic_rates, policy)
            cache = pin_cache(state.cache)
        per_replica = jax.tree.map(lambda leaf: leaf[None], (state.steps, state.adapt))
        return dataclasses.replace(state, cache=None, proposer=None, steps=None, adapt=None), cache, per_replica

    def run(target_state, draft_state, prompt_tokens, prompt_lengths, rows, cache_len: int, synthetic_rates=None,
            policy=None):
        by_rows = P(DATA_AXIS)
        state, cache, (steps, adapt) = jax.shard_map(
            functools.partial(replica, cache_len=cache_len), mesh=mesh, axis_names={DATA_AXIS},
            in_specs=(P(), P(), by_rows, by_rows, by_rows, P(), P()),
            out_specs=(by_rows, P(None, DATA_AXIS), by_rows), check_vma=False,
        )(target_state, draft_state, prompt_tokens, prompt_lengths, rows, synthetic_rates, policy)
        return dataclasses.replace(state, cache=cache, steps=jnp.max(steps),
                                   adapt=jax.tree.map(lambda leaf: leaf[0], adapt))

    return run


def sharded_admitting(admitting: Callable, mesh: Mesh) -> Callable:
    """build_admitting's function run over a mesh of one data replica: one queue for every device, tensor-parallel
    over "model" as the wave loop is (admission.py pins the slots' caches to their layout inside its loop, since
    it returns no cache whose sharding would pin them). Several replicas would each need their own queue."""
    if mesh.shape[DATA_AXIS] != 1:
        raise ValueError(f"continuous admission runs over meshes of one data replica; this one has "
                         f"{mesh.shape[DATA_AXIS]} (run waves: continuous_admission=False)")
    layout = Layout(mesh, head_axis=MODEL_AXIS)

    def run(*args, **kwargs):
        with traced_with(layout):
            return admitting(*args, **kwargs)

    return run


class Replicated:
    """`inner` (a proposer) with every method traced with its model's heads whole on each device: a draft
    model with draft_tensor_parallel_size=1 inside a tensor-parallel loop. Attributes pass through."""

    def __init__(self, inner: Any):
        self._inner = inner

    def with_k(self, k: int) -> Replicated:
        return Replicated(self._inner.with_k(k))

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def traced(*args, **kwargs):
            layout = current_layout()
            with traced_with(None if layout is None else dataclasses.replace(layout, head_axis=None)):
                return attr(*args, **kwargs)

        return traced
