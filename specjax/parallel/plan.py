"""Parameter shardings from a model family's partition rules.

A family's rules map a leaf's name (the last part of its tree path) to the axis of the leaf that is split
over the "model" mesh axis, counted from the end so that one rule holds for stacked layer leaves (a leading
layer axis) and per-layer ones alike, or to None (replicated). Every leaf must have a rule: a family that
adds a parameter adds its rule beside it.
"""
from __future__ import annotations

from typing import Any, Mapping

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from specjax.parallel.mesh import MODEL_AXIS

# Leaf name -> split axis (negative, from the end), or None for replicated.
PartitionRules = Mapping[str, int | None]


def leaf_spec(path: str, ndim: int, rules: PartitionRules) -> P:
    """The PartitionSpec of the param leaf at `path` ("layers/w_qkv", "embed", "layers/3/w_qkv") with `ndim`
    axes."""
    name = path.split("/")[-1]
    if name not in rules:
        raise ValueError(f"no partition rule for parameter {path!r}: add one to its model family's "
                         "partition_rules")
    axis = rules[name]
    if axis is None:
        return P()
    return P(*(MODEL_AXIS if i == axis % ndim else None for i in range(ndim)))


def param_shardings(shapes: Mapping[str, tuple[int, ...]], rules: PartitionRules, mesh: Mesh, *,
                    replicated: bool = False) -> dict:
    """Nested dict of NamedSharding for leaves of the given shapes ("/"-joined tree path -> shape), the
    structure a loader fills. replicated=True: every leaf whole on every device (a draft model with
    draft_tensor_parallel_size=1)."""
    return nest_paths({path: NamedSharding(mesh, P() if replicated else leaf_spec(path, len(shape), rules))
                       for path, shape in shapes.items()})


def shard_state(state: Any, rules: PartitionRules, mesh: Mesh, *, replicated: bool = False) -> Any:
    """Place an existing param tree (an nnx.State or nested dict, e.g. random weights) onto its shardings."""
    def place(path, leaf):
        spec = P() if replicated else leaf_spec(_path_str(path), leaf.ndim, rules)
        return jax.device_put(leaf, NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(place, state)


def replicate_onto(state: Any, mesh: Mesh) -> Any:
    """Leaves not yet on `mesh` copied whole onto each of its devices; those already on it (weights shared
    with the target) kept as they are."""
    def place(leaf):
        on_mesh = isinstance(leaf.sharding, NamedSharding) and leaf.sharding.mesh == mesh
        return leaf if on_mesh else jax.device_put(leaf, NamedSharding(mesh, P()))

    return jax.tree.map(place, state)


def nest_paths(flat: Mapping[str, Any]) -> dict:
    """{"layers/wq": x} -> {"layers": {"wq": x}}; numeric parts become int keys ({"layers": {0: ...}}), as
    in the state of a module's list of layers."""
    tree: dict = {}
    for path, leaf in flat.items():
        *parents, name = path_keys(path)
        node = tree
        for key in parents:
            node = node.setdefault(key, {})
        node[name] = leaf
    return tree


def path_keys(path: str) -> list[str | int]:
    """The dict keys of a "/"-joined tree path, numeric parts as ints."""
    return [int(part) if part.isdigit() else part for part in path.split("/")]


def _path_str(path: tuple) -> str:
    """The "/"-joined dict keys of a tree path (nnx.State adds a trailing `.value` attribute key)."""
    return "/".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))
