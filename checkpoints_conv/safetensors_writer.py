"""A param tree back into HF-named tensors by its weight map (the loader read backwards): fused leaves split,
matrices back to HF's [out, in], stacked leaves one tensor per layer. The heads specjax.training writes use it."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np
from flax import nnx
from flax.traverse_util import flatten_dict

from specjax.models.weight_map import LeafSpec, split_columns


HEAD_DTYPES = {"float32": np.float32, "float16": np.float16}


def cast_to(tensors: Mapping[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    """The tensors in `dtype` ("float32" or "float16", the dtypes heads are saved in), contiguous."""
    if dtype not in HEAD_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(HEAD_DTYPES)}, got {dtype!r}")
    return {name: np.ascontiguousarray(array.astype(HEAD_DTYPES[dtype])) for name, array in tensors.items()}


def module_leaves(module: nnx.Module) -> dict[str, np.ndarray]:
    """A module's Params by their weight-map paths ("block/w_qkv"), as float32 numpy arrays."""
    params = flatten_dict(nnx.to_pure_dict(nnx.state(module, nnx.Param)))
    return {"/".join(str(k) for k in path): np.asarray(leaf, np.float32) for path, leaf in params.items()}


def hf_tensors(leaves: Mapping[str, np.ndarray], weight_map: Mapping[str, LeafSpec]) -> dict[str, np.ndarray]:
    """Every leaf of `weight_map` under its checkpoint names (combine-built leaves are not written back)."""
    tensors: dict[str, Any] = {}
    for path, spec in weight_map.items():
        if spec.combine is not None:
            raise ValueError(f"{path}: leaves built by a combine function cannot be written back")
        layers = list(enumerate(spec.layers())) if spec.stacked else [(None, None)]
        for index, layer in layers:
            array = leaves[path] if index is None else leaves[path][index]
            for name, part in zip(spec.hf_names, _unfused(array, spec)):
                tensors[name if layer is None else name.format(i=layer)] = np.ascontiguousarray(part)
    return tensors


def _unfused(array: np.ndarray, spec: LeafSpec) -> list[np.ndarray]:
    parts = [array] if not spec.widths else [np.asarray(p) for p in split_columns(array, spec.widths, spec.groups)]
    return [part.T if spec.transpose else part for part in parts]
