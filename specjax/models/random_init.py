"""Random weights for benchmarks and tests, shared by the families.

A large leaf is drawn in slices inside one compiled program, so that no float32 copy of a whole narrow leaf ever
exists: drawn whole, DeepSeek-V3's FP8 expert stacks of three layers asked the H200 for 42 GiB of float32 (and the
CPU's program for 168 GiB of temporaries)."""
from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

SLICE_VALUES = 1 << 26   # the most values drawn at once (256 MiB of float32)


def normal(key: jax.Array, shape: tuple[int, ...], dtype, scale: float = 0.02) -> jax.Array:
    """scale * N(0, 1) of `shape` in `dtype`. A leaf of more than SLICE_VALUES values is drawn over its leading
    axes, as many trailing slices at once as fit in SLICE_VALUES, each slice from its own key."""
    if math.prod(shape) <= SLICE_VALUES:
        return _draw(key, shape, dtype, scale)
    return _sliced(key, shape, dtype, scale)


def _draw(key: jax.Array, shape: tuple[int, ...], dtype, scale: float) -> jax.Array:
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _sliced(key: jax.Array, shape: tuple[int, ...], dtype, scale: float) -> jax.Array:
    lead = next(n for n in range(1, len(shape) + 1) if math.prod(shape[n:]) <= SLICE_VALUES)
    rows, row = math.prod(shape[:lead]), shape[lead:]
    per_batch = max(1, SLICE_VALUES // math.prod(row))
    slices = lax.map(lambda k: _draw(k, row, dtype, scale), jax.random.split(key, rows), batch_size=per_batch)
    return slices.reshape(shape)


def normal_param(rngs: nnx.Rngs, shape: Sequence[int], dtype) -> nnx.Param:
    """A matrix of normal * 0.02."""
    return nnx.Param(normal(rngs.params(), tuple(shape), jnp.dtype(dtype)))


def ones_param(shape: Sequence[int], dtype) -> nnx.Param:
    """A norm's weight."""
    return nnx.Param(jnp.ones(shape, dtype))
