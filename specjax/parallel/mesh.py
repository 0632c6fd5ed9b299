"""The device mesh and the layout a model is traced under: which mesh axis splits its heads and vocabulary,
and the sharding pins a model places on its activations."""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Iterator, Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec as P

MODEL_AXIS = "model"
DATA_AXIS = "data"


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the model being traced is laid out: its heads (and vocabulary) split over `head_axis` of `mesh`
    (the mesh as seen where the model is traced, abstract inside a replica), or whole on every device
    when head_axis is None (a replicated draft model)."""

    mesh: Mesh | AbstractMesh
    head_axis: str | None

    @property
    def shards(self) -> int:
        """How many ways heads are split (1 when whole)."""
        return 1 if self.head_axis is None else self.mesh.shape[self.head_axis]

    def kv_head_axis(self, num_kv_heads: int) -> str | None:
        """The axis kv heads (and so a head-major KV cache) are split over; None when they are whole on every
        device."""
        if self.head_axis is None or not shards_kv_heads(num_kv_heads, self.shards):
            return None
        return self.head_axis


_LAYOUT: contextvars.ContextVar[Layout | None] = contextvars.ContextVar("specjax_layout", default=None)


@contextlib.contextmanager
def traced_with(layout: Layout | None) -> Iterator[None]:
    """Trace model code inside under `layout` (None: unsharded). Enter it inside the function being traced,
    so that a jitted function's cached trace never depends on its caller's context."""
    token = _LAYOUT.set(layout)
    try:
        yield
    finally:
        _LAYOUT.reset(token)


def current_layout() -> Layout | None:
    return _LAYOUT.get()


def pin_cache(cache: Any) -> Any:
    """A model's cache (models.family.Cache) held to its layout's sharding while tracing over a mesh (split by
    kv head, or whole on each device), as it is after every step; unchanged off a mesh."""
    layout = current_layout()
    if layout is None:
        return cache
    return jax.tree.map(lambda leaf, spec: jax.lax.with_sharding_constraint(leaf, NamedSharding(layout.mesh, spec)),
                        cache, cache.specs(layout))


def shards_kv_heads(num_kv_heads: int, num_shards: int) -> bool:
    """Whether kv heads are split over `num_shards` devices; otherwise (fewer kv heads than devices) every
    device keeps all of them, as vLLM replicates the K/V projections then."""
    return num_kv_heads % num_shards == 0


def pin_heads(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q, k, v [B, T, heads, D] pinned to the current layout: q split by head, k and v by kv head, or whole
    when there are fewer kv heads than devices. Without the pin XLA splits k and v like q in that case (all
    three are slices of one fused projection) and carries the KV cache split that way through the loop,
    resharding it for attention every step."""
    layout = current_layout()
    if layout is None or layout.head_axis is None:
        return q, k, v
    kv_axis = layout.kv_head_axis(k.shape[2])

    def pin(x: jax.Array, axis: str | None) -> jax.Array:
        return jax.lax.with_sharding_constraint(x, NamedSharding(layout.mesh, P(None, None, axis, None)))

    return pin(q, layout.head_axis), pin(k, kv_axis), pin(v, kv_axis)


def gather_vocab(logits: jax.Array) -> jax.Array:
    """Vocabulary-parallel logits [..., V] gathered whole onto every device (unchanged unless traced under
    a tensor-parallel layout). Sampling and verification then run without collectives. Otherwise XLA gives
    each vocabulary reduction its own small all-reduce; and pinning only the whole result makes it gather
    the (tied) embedding matrix instead of the logits, hence the vocab-split pin first."""
    layout = current_layout()
    if layout is None or layout.shards == 1:
        return logits
    leading = (None,) * (logits.ndim - 1)
    if logits.shape[-1] % layout.shards == 0:  # else the vocabulary is replicated
        logits = jax.lax.with_sharding_constraint(logits, NamedSharding(layout.mesh, P(*leading, layout.head_axis)))
    return jax.lax.with_sharding_constraint(logits, NamedSharding(layout.mesh, P()))


def build_mesh(tensor_parallel_size: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ("data", "model") mesh. devices=None: the first tensor_parallel_size of jax.devices() (every
    process's devices under jax.distributed), one replica. Given devices: len(devices) // tp replicas."""
    available = jax.devices() if devices is None else list(devices)
    if tensor_parallel_size > len(available):
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} is larger than the {len(available)} "
                         f"{available[0].platform} device(s) available: lower tensor_parallel_size "
                         "(on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N simulates N devices)")
    if devices is None:
        available = available[:tensor_parallel_size]
    if len(available) % tensor_parallel_size:
        raise ValueError(f"{len(available)} devices cannot be split into replicas of tensor_parallel_size="
                         f"{tensor_parallel_size}: give a multiple of it")
    grid = np.asarray(available).reshape(len(available) // tensor_parallel_size, tensor_parallel_size)
    # Auto axes: XLA's partitioner places the collectives the layouts imply (explicit axes would put
    # shardings into the types of every traced op).
    return Mesh(grid, (DATA_AXIS, MODEL_AXIS), axis_types=(AxisType.Auto, AxisType.Auto))
