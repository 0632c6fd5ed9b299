"""How a model family says where its parameters come from in an HF checkpoint: one `LeafSpec` per leaf of
its param tree (tensor names, transposes, fusions), read by checkpoints_conv's generic loader.

Fused projection weights: several [in, out_i] matrices stored side by side as one [in, sum out_i], so a layer
runs one matmul where it ran two or three. The columns are interleaved in groups (one per kv head for
q/k/v, one per column for gate/up) so that an even split over devices keeps each group on one device: the
fused leaf shards exactly as its parts did. The loader fuses (`interleave_columns`); the model splits the
matmul's output (`split_columns`).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    """Where one leaf of the tree comes from: one tensor, or several fused side by side on the last axis in
    `groups` interleaved groups; or, with `combine`, any function of several tensors (per-expert tensors stacked,
    a tensor split by rows)."""
    hf_names: tuple[str, ...]  # per-layer tensors carry an "{i}" placeholder for the layer index
    shape: tuple[int, ...]     # the leaf's shape in the tree (stacked leaves lead with the layer count)
    transpose: bool = False    # HF Linear weights are [out, in]; the tree stores [in, out]
    widths: tuple[int, ...] = ()   # each fused tensor's share of the last axis (one tensor: all of it)
    groups: int = 1
    # The tensors' dtype kept as it is (float8 weights, their float32 block scales); None: the model's dtype.
    dtype: str | None = None
    # combine(parts) -> one layer's leaf, replacing transpose and fusion; part_shapes: the parts' HF shapes.
    combine: Callable[[list[np.ndarray]], np.ndarray] | None = None
    part_shapes: tuple[tuple[int, ...], ...] = ()
    # The layer indices a stacked leaf's entries read ("{i}"); () means 0 .. shape[0] - 1.
    layer_indices: tuple[int, ...] = ()

    @property
    def stacked(self) -> bool:
        return "{i}" in self.hf_names[0]

    def layers(self) -> tuple[int, ...]:
        return self.layer_indices or tuple(range(self.shape[0]))

    def hf_shapes(self) -> list[tuple[int, ...]]:
        """The shape of each HF tensor feeding this leaf (one layer's slice for stacked leaves)."""
        if self.part_shapes:
            return list(self.part_shapes)
        shape = self.shape[1:] if self.stacked else self.shape
        parts = [shape[:-1] + (width,) for width in self.widths or shape[-1:]]
        return [tuple(reversed(part)) if self.transpose else part for part in parts]

    def assemble(self, parts: list[np.ndarray]) -> np.ndarray:
        """One layer's leaf from its HF tensors (in hf_names order)."""
        if self.combine is not None:
            return self.combine(parts)
        parts = [part.T if self.transpose else part for part in parts]
        return parts[0] if len(parts) == 1 else interleave_columns(parts, self.groups)


def fused(names: Sequence[str], lead: tuple[int, ...], widths: tuple[int, ...], groups: int,
          transpose: bool) -> LeafSpec:
    """A leaf fusing `names` side by side (widths on the last axis), interleaved in `groups` groups."""
    return LeafSpec(tuple(names), lead + (sum(widths),), transpose, widths, groups)


def interleave_columns(parts: Sequence[np.ndarray], groups: int) -> np.ndarray:
    """Matrices (or vectors) [..., n_i] side by side in one [..., sum n_i], in `groups` interleaved groups:
    group g holds the g-th 1/groups of each part's columns, in part order."""
    lead = parts[0].shape[:-1]
    return np.concatenate([p.reshape(*lead, groups, -1) for p in parts], axis=-1).reshape(*lead, -1)


def split_columns(fused_array: jax.Array, sizes: Sequence[int], groups: int) -> list[jax.Array]:
    """The parts of `interleave_columns` (widths `sizes`) back out of a fused [..., sum(sizes)] array."""
    grouped = fused_array.reshape(*fused_array.shape[:-1], groups, -1)
    bounds = np.cumsum([size // groups for size in sizes])[:-1]
    return [part.reshape(*fused_array.shape[:-1], size)
            for part, size in zip(jnp.split(grouped, bounds, axis=-1), sizes)]
