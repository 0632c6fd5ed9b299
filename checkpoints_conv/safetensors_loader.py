"""HF safetensors checkpoint -> a model family's param tree: each leaf read as the family's weight map says
(renamed, transposed to [in, out], fused, stacked over layers), cast, and placed on its sharding.

Tensors are read one at a time from memory-mapped files into one preallocated host buffer per leaf, which is
handed to the device and dropped before the next leaf, so host memory holds at most one leaf beyond the
memory-mapped file pages.
"""
from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any, Callable, Mapping

import jax
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from specjax.models.weight_map import LeafSpec
from specjax.parallel.plan import nest_paths, path_keys

INDEX_FILE = "model.safetensors.index.json"
# safetensors dtype names read from the raw bytes (its numpy backend has no such dtype).
RAW_DTYPES = {"F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2)}
# (HF tensor name, the shape the weight map expects) -> the tensor.
TensorReader = Callable[[str, tuple[int, ...]], np.ndarray]


def load_params(model_dir: str | Path, weight_map: Mapping[str, LeafSpec], dtype: np.dtype,
                shardings: dict | None = None, ignored: str | None = None) -> dict:
    """Read an HF safetensors directory into the nested param tree a family's weight map describes, in
    `dtype`. `shardings`: None (default device) or a nested dict of jax.sharding.Sharding with the tree's
    structure. Every tensor of the checkpoint must be read, except those matching the regex `ignored` (the
    family's): an unread one means the checkpoint and config.json disagree (more experts or layers in the files
    than the config names, say), which would otherwise go unnoticed."""
    files = tensor_files(model_dir)
    used: set[str] = set()
    with contextlib.ExitStack() as stack:
        handles = {path: _open(path, stack) for path in sorted(set(files.values()))}

        def read(name: str, expected: tuple[int, ...]) -> np.ndarray:
            if name not in files:
                raise ValueError(f"tensor {name!r} is missing from the checkpoint in {model_dir}; the files do "
                                 "not match config.json — re-download or re-convert it")
            used.add(name)
            return _read_tensor(handles[files[name]], files[name], name, expected)

        params = load_tree(weight_map, read, dtype, shardings)
    unread = sorted(name for name in set(files) - used if not (ignored and re.match(ignored, name)))
    if unread:
        raise ValueError(f"the checkpoint in {model_dir} has {len(unread)} tensor(s) config.json does not account "
                         f"for, e.g. {unread[:4]}: the files and config.json do not belong together (a different "
                         "number of layers or experts?) — re-download the checkpoint or fix config.json")
    return params


def load_tree(weight_map: Mapping[str, LeafSpec], read: TensorReader, dtype: np.dtype,
              shardings: dict | None = None) -> dict:
    """The nested param tree of `weight_map`, each leaf filled from `read(hf_name, expected_shape)` in one
    host buffer, handed to its device (or sharding) and dropped before the next leaf."""
    flat = {path: jax.device_put(_fill_leaf(spec, read, dtype), sharding_at(shardings, path))
            for path, spec in weight_map.items()}
    return nest_paths(flat)


def tensor_files(model_dir: str | Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it (from the shard index, or by listing each file)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist; pass a directory in HF layout "
                                "(config.json, *.safetensors, tokenizer files)")
    index = model_dir / INDEX_FILE
    if index.is_file():
        return _files_from_index(index)
    paths = sorted(model_dir.glob("*.safetensors"))
    if not paths:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}; download the model's safetensors "
                                "weights (or convert a GGUF with `python -m checkpoints_conv gguf-to-hf`)")
    with contextlib.ExitStack() as stack:
        return {name: path for path in paths for name in _open(path, stack).keys()}


def _files_from_index(index: Path) -> dict[str, Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"{index} is not a valid safetensors index ({err}); re-download it") from err
    files = {name: index.parent / file for name, file in weight_map.items()}
    for path in set(files.values()):
        if not path.is_file():
            raise FileNotFoundError(f"{path} is listed in {index} but missing; re-download the checkpoint")
    return files


def _open(path: Path, stack: contextlib.ExitStack):
    """safe_open with header errors turned into a ValueError that names the file."""
    try:
        return stack.enter_context(safe_open(str(path), framework="numpy"))
    except SafetensorError as err:
        raise ValueError(f"{path} is not a valid safetensors file ({err}); it is probably truncated or "
                         "corrupt — delete it and download or convert it again") from err


def _read_tensor(handle, path: Path, name: str, expected: tuple[int, ...]) -> np.ndarray:
    tensor = handle.get_slice(name)
    got = tuple(tensor.get_shape())
    if got != expected:
        raise ValueError(f"tensor {name!r} in {path} has shape {got}, expected {expected} from config.json; "
                         "the weights and config.json do not belong together")
    try:
        if tensor.get_dtype() in RAW_DTYPES:
            return _read_raw(path, name, RAW_DTYPES[tensor.get_dtype()])
        return handle.get_tensor(name)
    except SafetensorError as err:
        raise ValueError(f"cannot read tensor {name!r} from {path} ({err}); the file is corrupt") from err


def _read_raw(path: Path, name: str, dtype: np.dtype) -> np.ndarray:
    """A tensor whose dtype safetensors' numpy backend cannot build (float8), viewed straight from the file: an
    8-byte little-endian header length, the JSON header (data_offsets from the end of the header), the data."""
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        entry = json.loads(f.read(header_len))[name]
    begin, end = entry["data_offsets"]
    data = np.memmap(path, np.uint8, "r", offset=8 + header_len + begin, shape=(end - begin,))
    return np.asarray(data).view(dtype).reshape(entry["shape"])


def _fill_leaf(spec: LeafSpec, read: TensorReader, dtype: np.dtype) -> np.ndarray:
    """One host buffer for the leaf, filled layer by layer (assignment casts in place)."""
    buffer = np.empty(spec.shape, np.dtype(spec.dtype) if spec.dtype else dtype)
    if not spec.stacked:
        buffer[...] = _read_layer(spec, read, {})
        return buffer
    for row, layer in enumerate(spec.layers()):
        buffer[row] = _read_layer(spec, read, {"i": layer})
    return buffer


def _read_layer(spec: LeafSpec, read: TensorReader, fields: dict) -> np.ndarray:
    """The leaf's tensors for one layer, assembled as its spec says (transposed to [in, out], fused, ...)."""
    return spec.assemble([read(name.format(**fields), shape) for name, shape in zip(spec.hf_names, spec.hf_shapes())])


def sharding_at(shardings: dict | None, path: str) -> Any:
    """The Sharding at a "/"-joined tree path of a nested-dict shardings tree (None when shardings is None)."""
    if shardings is None:
        return None
    node = shardings
    for key in path_keys(path):
        if not isinstance(node, dict) or key not in node:
            raise ValueError(f"shardings has no entry for {path!r}; give one Sharding per leaf of the param "
                             "tree (same nested-dict structure), or None for the default device")
        node = node[key]
    return node
