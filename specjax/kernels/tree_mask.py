"""Attention over a draft tree: which cache slots each query of a tree-shaped pass sees.

A tree pass writes its T tokens at consecutive slots (in the tree's flattened order, not by position), so slot
and position part ways: a node at depth d sits at position root + d whatever its slot. Below `region_start` the
cache holds the committed prefix, where slot = position and the usual causal / sliding-window rule applies to
each query's own position. From region_start the slots hold tree nodes (this pass's and, for a drafter growing
its tree level by level, earlier passes'): a query sees exactly those its `visible` row marks (its ancestors and
itself), the window left out: a model's sliding window must be longer than the tree's region, so every
ancestor lies within it (the model checks). A chain is the tree whose every node has one child.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreeMask:
    positions: jax.Array      # i32 [B, T]: each query's position (rope, window)
    region_start: jax.Array   # i32 [B]: the first slot of the tree's nodes; below it the committed prefix
    visible: jax.Array        # bool [B, T, R]: query t sees slot region_start + r

    @property
    def region(self) -> int:
        return self.visible.shape[2]


def tree_visible_slots(tree: TreeMask, num_slots: int, window: jax.Array) -> jax.Array:
    """bool [B, T, S]: the slots each query sees (the reference's mask; the kernel computes it per block)."""
    slots = jnp.arange(num_slots, dtype=jnp.int32)[None, None, :]
    positions = tree.positions[:, :, None]
    in_prefix = slots < tree.region_start[:, None, None]
    prefix_ok = (slots <= positions) & ((window <= 0) | (slots > positions - window))
    offset = slots - tree.region_start[:, None, None]
    in_region = (offset >= 0) & (offset < tree.region)
    region_ok = jnp.take_along_axis(tree.visible, jnp.clip(offset, 0, tree.region - 1).astype(jnp.int32)
                                    .repeat(tree.visible.shape[1], axis=1), axis=2)
    return jnp.where(in_prefix, prefix_ok, in_region & region_ok)


def check_tree(tree: TreeMask, batch: int, num_tokens: int) -> None:
    """Shape errors before tracing, naming the field."""
    if tree.positions.shape != (batch, num_tokens):
        raise ValueError(f"attention: tree.positions must be [B, T] = {(batch, num_tokens)}, got "
                         f"{tree.positions.shape}")
    if tree.region_start.shape != (batch,):
        raise ValueError(f"attention: tree.region_start must be [B] = ({batch},), got {tree.region_start.shape}")
    if tree.visible.ndim != 3 or tree.visible.shape[:2] != (batch, num_tokens):
        raise ValueError(f"attention: tree.visible must be [B, T, R] with [B, T] = {(batch, num_tokens)}, got "
                         f"{tree.visible.shape}")
