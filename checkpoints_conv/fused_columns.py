"""Fused projection weights: several [in, out_i] matrices stored side by side as one [in, sum out_i], so a
layer runs one matmul where it ran two or three. The columns are interleaved in groups (one per kv head for
q/k/v, one per column for gate/up) so that an even split over devices keeps each group on one device: the
fused leaf shards exactly as its parts did. The loaders fuse; the model splits the matmul's output.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def interleave_columns(parts: Sequence[np.ndarray], groups: int) -> np.ndarray:
    """Matrices (or vectors) [..., n_i] side by side in one [..., sum n_i], in `groups` interleaved groups:
    group g holds the g-th 1/groups of each part's columns, in part order."""
    lead = parts[0].shape[:-1]
    return np.concatenate([p.reshape(*lead, groups, -1) for p in parts], axis=-1).reshape(*lead, -1)


def split_columns(fused: jax.Array, sizes: Sequence[int], groups: int) -> list[jax.Array]:
    """The parts of `interleave_columns` (widths `sizes`) back out of a fused [..., sum(sizes)] array."""
    grouped = fused.reshape(*fused.shape[:-1], groups, -1)
    bounds = np.cumsum([size // groups for size in sizes])[:-1]
    return [part.reshape(*fused.shape[:-1], size)
            for part, size in zip(jnp.split(grouped, bounds, axis=-1), sizes)]
