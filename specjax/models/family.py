"""The contract of a model family: what the build layer and the engine ask of it.

A family is one module under specjax/models/ holding a `FAMILY` object (a `ModelFamily`) and the module class
it builds (a `CausalLM`). It owns everything about its architectures: the config keys it reads, the param tree
and its init, the HF weight map, the partition rules, the cache layout, the forward pass and the hidden-state
taps that EAGLE and MTP read. The registry (specjax/models/registry.py) maps HF `architectures` names to
families; checkpoints_conv's loader applies a family's weight map; specjax.parallel.plan applies its rules.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Protocol

import jax
import numpy as np
from flax import nnx

from specjax.kernels.policy import KernelPolicy
from specjax.kernels.tree_mask import TreeMask
from specjax.models.weight_map import LeafSpec
from specjax.parallel.mesh import Layout
from specjax.parallel.plan import PartitionRules


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ForwardAux:
    """Extra outputs of a forward pass: the residual stream entering each requested layer, concatenated on
    the last axis (None when no layer was requested)."""
    captured: jax.Array | None


class ModelConfig(Protocol):
    """What every family's config holds besides its own keys (the build layer and the engine read these)."""
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str          # the dtype config.json gives the weights: what dtype="auto" loads
    tie_word_embeddings: bool


class Cache(Protocol):
    """A family's cache for one wave: a pytree whose every leaf keeps the batch on axis 1."""

    def specs(self, layout: Layout) -> Any:
        """A pytree of PartitionSpec like this cache: how it is laid out under a tensor-parallel layout."""

    def gathered(self, source: jax.Array, first: jax.Array) -> Any:
        """The cache with slots first[b] + t holding what slots source[b, t] [B, T] held (a draft tree's
        accepted path made contiguous: rejection stays a length update)."""


class CausalLM(Protocol):
    """The module the engine runs (a target or a draft model). Rows of a batch are independent."""
    cfg: Any
    kernels: KernelPolicy
    supports_trees: bool   # whether __call__ runs a draft tree's pass (tree=...)

    def __call__(self, tokens: jax.Array, start: jax.Array, cache: Cache, capture_layers: tuple[int, ...] = (),
                 fresh: bool = False, tree: TreeMask | None = None) -> tuple[jax.Array, Cache, ForwardAux]:
        """Run tokens [B, T] at positions start[b] .. start[b]+T-1, writing their cache entries; return the
        final-normed hidden states [B, T, H], the cache and the residual streams entering `capture_layers`.
        fresh (static): a prompt's prefill from position 0 into an empty cache. tree: a draft tree's pass
        (kernels/tree_mask.py), its tokens at their own positions, written at slots start[b] + t; a family
        that cannot run one raises a ValueError saying so (`supports_trees` False)."""

    def logits(self, hidden: jax.Array) -> jax.Array:
        """float32 logits [..., V] of final-normed hidden states."""

    def init_cache(self, batch: int, max_len: int) -> Cache:
        """An empty cache of `max_len` slots per row (slot index = absolute position)."""

    def cache_bytes(self, batch: int, max_len: int, tensor_parallel_size: int = 1) -> int:
        """Bytes one device holds of init_cache(batch, max_len) when the model is split over
        tensor_parallel_size devices (for the memory check made before allocating)."""


class ModelFamily(Protocol):
    """Static knowledge of a family, used before and while its weights are loaded."""
    name: str
    architectures: tuple[str, ...]

    def config_from_hf(self, d: Mapping[str, Any]) -> ModelConfig:
        """The family's config from an HF config.json dict; a clear ValueError naming the key otherwise."""

    def weight_map(self, cfg: Any) -> dict[str, LeafSpec]:
        """Tree path ("layers/w_qkv") -> where the leaf comes from in an HF checkpoint."""

    def partition_rules(self, cfg: Any, tensor_parallel_size: int) -> PartitionRules:
        """Leaf name -> the axis split over the "model" mesh axis (from the end), or None (replicated)."""

    def ignored_tensors(self, cfg: Any) -> str | None:
        """A regex of the checkpoint tensors the model does not read (any other unread tensor is an error: the
        checkpoint and config.json disagree); None when it reads them all."""

    def check_tensor_parallel(self, cfg: Any, tensor_parallel_size: int, *, field: str) -> None:
        """Raise a ValueError naming `field` when cfg cannot be split over tensor_parallel_size devices."""

    def build(self, cfg: Any, params: dict, *, kernels: KernelPolicy, unroll_layers: bool | None) -> CausalLM:
        """The module holding `params` (a loaded tree in the weight map's layout, consumed)."""

    def random(self, cfg: Any, *, dtype: np.dtype, seed: int, kernels: KernelPolicy,
               unroll_layers: bool | None) -> CausalLM:
        """The module with random weights (speed benchmarks and tests)."""


class Frozen(nnx.Variable):
    """Weights a draft head reads but never trains: the target's embedding and lm_head it shares, a vocabulary
    map (training updates nnx.Param leaves only)."""


def default_unroll() -> bool:
    """Unrolled per-layer weights on GPUs (a matmul reads its own weight buffer, where slicing a stacked leaf inside
    the generate while_loop made XLA copy every layer's weights every step), stacked and scanned elsewhere
    (compile time flat in depth)."""
    return jax.default_backend() == "gpu"


def unstack_leaves(stacked: dict, count: int) -> dict[int, dict]:
    """Leaves stacked over `count` layers {name: [count, ...]} as {i: {name: leaf[i]}}, consuming `stacked` one leaf
    at a time: the device holds at most one leaf twice (every leaf twice would not fit a large model's device)."""
    layers: dict[int, dict] = {i: {} for i in range(count)}
    for name in list(stacked):
        leaf = stacked.pop(name)
        for i in range(count):
            layers[i][name] = leaf[i]
        del leaf
    return layers


def module_from_params(module_cls: Callable[..., nnx.Module], cfg: Any, params: dict, *, kernels: KernelPolicy,
                       unroll_layers: bool | None, unstack: Callable[[dict], dict]) -> nnx.Module:
    """A family's module holding a loaded param tree (stacked layer leaves; `unstack` turns it into the per-layer
    layout, consuming it, when the layers are unrolled): built abstract, then filled, so no random weights are
    ever made."""
    unroll = default_unroll() if unroll_layers is None else unroll_layers
    dtype = params["embed"].dtype
    model = nnx.eval_shape(lambda: module_cls(cfg, dtype=dtype, rngs=nnx.Rngs(0), kernels=kernels,
                                              unroll_layers=unroll))
    nnx.update(model, unstack(params) if unroll else params)
    return model
