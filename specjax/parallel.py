"""Tensor parallelism: the device mesh, the partition rules of every parameter and of the KV cache, and the
wrapper that runs the jitted loop sharded.

Mesh axes: "model" (tensor parallel, size tensor_parallel_size) and "data" (replicas: whole copies of the
model, each generating for its own slice of the batch rows under shard_map, sharing nothing). `LLM` uses
tensor_parallel_size devices and one replica, as vLLM's `LLM` does; `build_mesh(tp, devices)` with more
devices gives len(devices) // tp replicas, which `sharded_generate` runs side by side.

Layout (Megatron-style, as vLLM): the fused q/k/v and gate/up weights column-parallel (output features
split; their columns are grouped by kv head and by intermediate column, so each device holds whole heads
and matching gate/up columns), o and down row-parallel (input features split; XLA all-reduces their
outputs), embedding and lm_head split over the vocabulary, norms replicated, the KV cache split by kv head.
With fewer kv heads than devices the q/k/v projection and the cache are replicated (tp must then be a
multiple of the kv heads): each device computes every head's projection and attends with its own q heads
(vLLM instead gives each device its q heads and one copy of their kv head). A vocabulary not divisible by
tp is replicated rather than padded.

XLA's partitioner (GSPMD) places the collectives these layouts imply: one all-reduce after each of o and
down, one after the vocabulary-parallel embedding lookup, and one all-gather of the vocabulary-parallel
logits (`gather_vocab`). Attention runs per device under shard_map (specjax.kernels.attention), steered by
the `Layout` the model is traced under (`traced_with`); a replicated draft model is traced with its heads
whole (`Replicated`).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec as P

from checkpoints_conv.safetensors_loader import hf_name_map, nest_paths
from specjax.models.model_config import ModelConfig

MODEL_AXIS = "model"
DATA_AXIS = "data"

# Leaf name -> which axis of the leaf is split over "model", counted from the end so that it holds for
# stacked layer leaves (leading layer axis) and per-layer ones alike; matrices are [in, out].
_COLUMN_PARALLEL = {"w_gate_up": -1}
_KV_COLUMN_PARALLEL = {"w_qkv": -1, "b_qkv": -1}
_ROW_PARALLEL = {"wo": -2, "w_down": -2}
_VOCAB_PARALLEL = {"embed": -2, "lm_head": -1}
_REPLICATED = {"attn_norm", "mlp_norm", "q_norm", "k_norm", "final_norm"}


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the model being traced is laid out: its heads (and vocabulary) split over `head_axis` of `mesh`
    (the mesh as seen where the model is traced, abstract inside a replica), or whole on every device
    when head_axis is None (a replicated draft model)."""

    mesh: Mesh | AbstractMesh
    head_axis: str | None

    def kv_head_axis(self, num_kv_heads: int) -> str | None:
        """The axis kv heads (and so the KV cache) are split over; None when they are whole on every device."""
        if self.head_axis is None or not shards_kv_heads(num_kv_heads, self.mesh.shape[self.head_axis]):
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


def pin_heads(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q, k, v [B, T, heads, D] pinned to the layout the model is traced under: q split by head, k and v by
    kv head, or whole when there are fewer kv heads than devices. Without the pin XLA splits k and v like q
    in that case (all three are slices of one fused projection) and carries the KV cache split that way
    through the loop, resharding it for attention every step."""
    layout = current_layout()
    if layout is None or layout.head_axis is None:
        return q, k, v
    kv_axis = layout.kv_head_axis(k.shape[2])

    def pin(x: jax.Array, axis: str | None) -> jax.Array:
        return jax.lax.with_sharding_constraint(x, NamedSharding(layout.mesh, P(None, None, axis, None)))

    return pin(q, layout.head_axis), pin(k, kv_axis), pin(v, kv_axis)


def shards_kv_heads(num_kv_heads: int, num_shards: int) -> bool:
    """Whether kv heads are split over `num_shards` devices; otherwise (fewer kv heads than devices) every
    device keeps all of them, as vLLM replicates the K/V projections then."""
    return num_kv_heads % num_shards == 0


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


def plan(cfg: ModelConfig, tensor_parallel_size: int) -> tuple[Mesh | None, dict | None]:
    """(mesh, param shardings) for a target model, checked before anything is loaded; (None, None) for one
    device (the unsharded path)."""
    if tensor_parallel_size == 1:
        return None, None
    mesh = build_mesh(tensor_parallel_size)
    check_tensor_parallel(cfg, tensor_parallel_size)
    return mesh, param_shardings(cfg, mesh)


def draft_shardings(cfg: ModelConfig, mesh: Mesh | None, draft_tensor_parallel_size: int) -> dict | None:
    """A draft model's param shardings: replicated when its TP is 1, split like the target's when equal."""
    if mesh is None:
        return None
    if draft_tensor_parallel_size == 1:
        return param_shardings(cfg, mesh, replicated=True)
    check_tensor_parallel(cfg, draft_tensor_parallel_size, name="draft model")
    return param_shardings(cfg, mesh)


def check_tensor_parallel(cfg: ModelConfig, tensor_parallel_size: int, *, name: str = "model") -> None:
    """Raise before loading when `cfg` cannot be split over tensor_parallel_size devices."""
    tp = tensor_parallel_size
    fix = ("lower it" if name == "model" else
           "or set speculative_config['draft_tensor_parallel_size'] = 1 to replicate the draft")
    field = "tensor_parallel_size" if name == "model" else "draft_tensor_parallel_size"
    if cfg.num_heads % tp:
        raise ValueError(f"the {name}'s num_heads={cfg.num_heads} is not divisible by {field}={tp}: "
                         f"use a divisor of {cfg.num_heads}, {fix}")
    if cfg.num_kv_heads >= tp and cfg.num_kv_heads % tp:
        raise ValueError(f"the {name}'s num_kv_heads={cfg.num_kv_heads} is not divisible by {field}={tp}: "
                         f"use a divisor of {cfg.num_kv_heads}, {fix}")
    if cfg.num_kv_heads < tp and tp % cfg.num_kv_heads:
        raise ValueError(f"{field}={tp} is larger than the {name}'s num_kv_heads={cfg.num_kv_heads} but not a "
                         f"multiple of it (kv heads are then replicated): use a multiple, {fix}")
    if cfg.intermediate_size % tp:
        raise ValueError(f"the {name}'s intermediate_size={cfg.intermediate_size} is not divisible by "
                         f"{field}={tp}: {fix}")


def leaf_spec(path: str, cfg: ModelConfig, tensor_parallel_size: int) -> P:
    """The PartitionSpec of the param leaf at `path` ("layers/w_qkv", "embed", or "layers/3/w_qkv" for the
    per-layer layout of unrolled models)."""
    parts = path.split("/")
    name, layer_index = parts[-1], [p for p in parts if p.isdigit()]
    ndim = len(hf_name_map(cfg)["/".join(p for p in parts if not p.isdigit())].shape) - len(layer_index)
    if name in _COLUMN_PARALLEL:
        return _split(ndim, _COLUMN_PARALLEL[name])
    if name in _KV_COLUMN_PARALLEL:
        split = shards_kv_heads(cfg.num_kv_heads, tensor_parallel_size)
        return _split(ndim, _KV_COLUMN_PARALLEL[name]) if split else P()
    if name in _ROW_PARALLEL:
        return _split(ndim, _ROW_PARALLEL[name])
    if name in _VOCAB_PARALLEL:
        return _split(ndim, _VOCAB_PARALLEL[name]) if cfg.vocab_size % tensor_parallel_size == 0 else P()
    if name in _REPLICATED:
        return P()
    raise ValueError(f"no partition rule for parameter {path!r}: add one to specjax/parallel.py")


def param_shardings(cfg: ModelConfig, mesh: Mesh, *, replicated: bool = False) -> dict:
    """Nested dict of NamedSharding with the param tree's structure (load_checkpoint's `shardings`).
    replicated=True: every leaf whole on every device (a draft model with draft_tensor_parallel_size=1)."""
    tp = mesh.shape[MODEL_AXIS]
    return nest_paths({path: NamedSharding(mesh, P() if replicated else leaf_spec(path, cfg, tp))
                       for path in hf_name_map(cfg)})


def shard_state(state: Any, cfg: ModelConfig, mesh: Mesh, *, replicated: bool = False) -> Any:
    """Place an existing param tree (an nnx.State or nested dict, e.g. random weights) onto its shardings."""
    tp = mesh.shape[MODEL_AXIS]

    def place(path, leaf):
        spec = P() if replicated else leaf_spec(_path_str(path), cfg, tp)
        return jax.device_put(leaf, NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(place, state)


def replicate_onto(state: Any, mesh: Mesh) -> Any:
    """Leaves not yet on `mesh` copied whole onto each of its devices; those already on it (weights shared
    with the target) kept as they are."""
    def place(leaf):
        on_mesh = isinstance(leaf.sharding, NamedSharding) and leaf.sharding.mesh == mesh
        return leaf if on_mesh else jax.device_put(leaf, NamedSharding(mesh, P()))

    return jax.tree.map(place, state)


def cache_shards(cfg: ModelConfig, tensor_parallel_size: int) -> int:
    """How many ways one replica's KV cache is split (the per-device share of cache_bytes)."""
    return tensor_parallel_size if shards_kv_heads(cfg.num_kv_heads, tensor_parallel_size) else 1


def sharded_generate(generate: Callable, mesh: Mesh) -> Callable:
    """build_generate's function (target_state, draft_state, prompt_tokens, prompt_lengths, rows, cache_len,
    synthetic_rates=None) run over `mesh`: each "data" replica on its own rows under shard_map (rows never
    interact, so replicas exchange nothing), tensor-parallel over "model" inside. The target KV cache is
    pinned to its kv-head sharding, which pins the while_loop carry the same way. The proposer's carry is
    not returned (its row axis is the proposer's business); `steps` is the most any replica ran."""

    def replica(target_state, draft_state, prompt_tokens, prompt_lengths, rows, synthetic_rates, *, cache_len):
        inner = jax.sharding.get_abstract_mesh()  # "data" is manual in here: this replica's rows only
        with traced_with(Layout(inner, head_axis=MODEL_AXIS)):
            state = generate(target_state, draft_state, prompt_tokens, prompt_lengths, rows, cache_len,
                             synthetic_rates)
        heads = _kv_heads_axis(state.cache.k.shape[2], mesh)
        cache = jax.lax.with_sharding_constraint(state.cache, NamedSharding(inner, P(None, None, heads)))
        return dataclasses.replace(state, cache=None, proposer=None, steps=None), cache, state.steps[None]

    def run(target_state, draft_state, prompt_tokens, prompt_lengths, rows, cache_len: int, synthetic_rates=None):
        by_rows = P(DATA_AXIS)
        state, cache, steps = jax.shard_map(
            functools.partial(replica, cache_len=cache_len), mesh=mesh, axis_names={DATA_AXIS},
            in_specs=(P(), P(), by_rows, by_rows, by_rows, P()),
            out_specs=(by_rows, P(None, DATA_AXIS), by_rows), check_vma=False,
        )(target_state, draft_state, prompt_tokens, prompt_lengths, rows, synthetic_rates)
        return dataclasses.replace(state, cache=cache, steps=jnp.max(steps))

    return run


def gather_vocab(logits: jax.Array) -> jax.Array:
    """Vocabulary-parallel logits [..., V] gathered whole onto every device (unchanged unless traced under
    a tensor-parallel layout). Sampling and verification then run without collectives. Otherwise XLA gives
    each vocabulary reduction its own small all-reduce; and pinning only the whole result makes it gather
    the (tied) embedding matrix instead of the logits, hence the vocab-split pin first."""
    layout = current_layout()
    if layout is None or layout.head_axis is None or layout.mesh.shape[layout.head_axis] == 1:
        return logits
    leading = (None,) * (logits.ndim - 1)
    if logits.shape[-1] % layout.mesh.shape[layout.head_axis] == 0:  # else the vocabulary is replicated
        split = NamedSharding(layout.mesh, P(*leading, layout.head_axis))
        logits = jax.lax.with_sharding_constraint(logits, split)
    return jax.lax.with_sharding_constraint(logits, NamedSharding(layout.mesh, P()))


class Replicated:
    """`inner` (a proposer) with every method traced with its model's heads whole on each device: a draft
    model with draft_tensor_parallel_size=1 inside a tensor-parallel loop. Attributes pass through."""

    def __init__(self, inner: Any):
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def traced(*args, **kwargs):
            layout = current_layout()
            with traced_with(None if layout is None else dataclasses.replace(layout, head_axis=None)):
                return attr(*args, **kwargs)

        return traced


def _kv_heads_axis(num_kv_heads: int, mesh: Mesh) -> str | None:
    return MODEL_AXIS if shards_kv_heads(num_kv_heads, mesh.shape[MODEL_AXIS]) else None


def _split(ndim: int, axis: int) -> P:
    return P(*(MODEL_AXIS if i == axis % ndim else None for i in range(ndim)))


def _path_str(path: tuple) -> str:
    """The "/"-joined dict keys of a tree path (nnx.State adds a trailing `.value` attribute key)."""
    return "/".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))
