"""HF safetensors checkpoint -> the Llama-family param tree: renamed, transposed to [in, out], stacked over
layers, cast, and placed on each leaf's sharding.

Tensors are read one at a time from memory-mapped files into one preallocated host buffer per leaf, which is
handed to the device and dropped before the next leaf, so host memory holds at most one leaf beyond the
memory-mapped file pages.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from checkpoints_conv.fused_columns import interleave_columns

if TYPE_CHECKING:  # specjax imports this package at import time; a runtime import back would be circular
    from specjax.models.model_config import ModelConfig

LLAMA_FAMILY = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    """Where one leaf of the tree comes from in an HF checkpoint: one tensor, or several fused side by side
    on the last axis in `groups` interleaved groups (checkpoints_conv.fused_columns)."""
    hf_names: tuple[str, ...]  # per-layer tensors carry an "{i}" placeholder for the layer index
    shape: tuple[int, ...]     # the leaf's shape in the tree (stacked leaves lead with num_layers)
    transpose: bool            # HF Linear weights are [out, in]; the tree stores [in, out]
    widths: tuple[int, ...] = ()   # each fused tensor's share of the last axis (one tensor: all of it)
    groups: int = 1

    @property
    def stacked(self) -> bool:
        return "{i}" in self.hf_names[0]

    def hf_shapes(self) -> list[tuple[int, ...]]:
        """The shape of each HF tensor feeding this leaf (one layer's slice for stacked leaves)."""
        shape = self.shape[1:] if self.stacked else self.shape
        parts = [shape[:-1] + (width,) for width in self.widths or shape[-1:]]
        return [tuple(reversed(part)) if self.transpose else part for part in parts]


def _fused(names: tuple[str, ...], lead: tuple[int, ...], widths: tuple[int, ...], groups: int,
           transpose: bool) -> LeafSpec:
    return LeafSpec(names, lead + (sum(widths),), transpose, widths, groups)


def hf_name_map(cfg: ModelConfig) -> dict[str, LeafSpec]:
    """Tree path ("layers/w_qkv", ...) -> LeafSpec for a Llama-family config (Llama, Mistral, Qwen2, Qwen3).
    q/k/v are fused with one group per kv head, gate/up with one group per intermediate column."""
    if cfg.architecture not in LLAMA_FAMILY:
        raise ValueError(f"architecture {cfg.architecture!r} has no safetensors weight map; supported: "
                         f"{', '.join(LLAMA_FAMILY)}")
    L, H, I, D, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.vocab_size
    q, kv = cfg.num_heads * D, cfg.num_kv_heads * D
    attn, mlp = "model.layers.{i}.self_attn", "model.layers.{i}.mlp"
    qkv = (f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj")
    specs = {
        "embed": LeafSpec(("model.embed_tokens.weight",), (V, H), False),
        "layers/attn_norm": LeafSpec(("model.layers.{i}.input_layernorm.weight",), (L, H), False),
        "layers/mlp_norm": LeafSpec(("model.layers.{i}.post_attention_layernorm.weight",), (L, H), False),
        "layers/w_qkv": _fused(tuple(f"{n}.weight" for n in qkv), (L, H), (q, kv, kv), cfg.num_kv_heads, True),
        "layers/wo": LeafSpec((f"{attn}.o_proj.weight",), (L, q, H), True),
        "layers/w_gate_up": _fused((f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"), (L, H), (I, I), I, True),
        "layers/w_down": LeafSpec((f"{mlp}.down_proj.weight",), (L, I, H), True),
        "final_norm": LeafSpec(("model.norm.weight",), (H,), False),
    }
    if cfg.attention_bias:
        specs["layers/b_qkv"] = _fused(tuple(f"{n}.bias" for n in qkv), (L,), (q, kv, kv), cfg.num_kv_heads, False)
    if cfg.qk_norm:
        specs["layers/q_norm"] = LeafSpec((f"{attn}.q_norm.weight",), (L, D), False)
        specs["layers/k_norm"] = LeafSpec((f"{attn}.k_norm.weight",), (L, D), False)
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = LeafSpec(("lm_head.weight",), (H, V), True)
    return specs


def resolve_dtype(dtype: Any, cfg: ModelConfig) -> np.dtype:
    """"auto" -> the checkpoint's torch_dtype; otherwise a name in DTYPES or a numpy/jax dtype."""
    name = cfg.torch_dtype if dtype == "auto" else dtype
    if isinstance(name, str):
        name = name.removeprefix("torch.")
        if name not in DTYPES:
            raise ValueError(f"dtype {name!r} is not supported; use 'auto' or one of {', '.join(DTYPES)}")
        return DTYPES[name]
    resolved = np.dtype(name)
    if resolved not in DTYPES.values():
        raise ValueError(f"dtype {resolved} is not supported; use 'auto' or one of {', '.join(DTYPES)}")
    return resolved


def load_params(model_dir: str | Path, cfg: ModelConfig, dtype: Any = "auto",
                shardings: dict | None = None) -> dict:
    """Read an HF safetensors directory into the nested param tree of cfg's model.

    `shardings`: None (default device) or a nested dict of jax.sharding.Sharding with the tree's structure.
    """
    target = resolve_dtype(dtype, cfg)
    files = tensor_files(model_dir)
    specs = hf_name_map(cfg)
    flat: dict[str, jax.Array] = {}
    with contextlib.ExitStack() as stack:
        handles = {path: _open(path, stack) for path in sorted(set(files.values()))}

        def read(name: str, expected: tuple[int, ...]) -> np.ndarray:
            if name not in files:
                raise ValueError(f"tensor {name!r} is missing from the checkpoint in {model_dir}; the files do "
                                 f"not match config.json ({cfg.architecture}) — re-download or re-convert it")
            return _read_tensor(handles[files[name]], files[name], name, expected)

        for path, spec in specs.items():
            flat[path] = jax.device_put(_fill_leaf(spec, read, cfg.num_layers, target),
                                        sharding_at(shardings, path))
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
    got = tuple(handle.get_slice(name).get_shape())
    if got != expected:
        raise ValueError(f"tensor {name!r} in {path} has shape {got}, expected {expected} from config.json; "
                         "the weights and config.json do not belong together")
    try:
        return handle.get_tensor(name)
    except SafetensorError as err:
        raise ValueError(f"cannot read tensor {name!r} from {path} ({err}); the file is corrupt") from err


def _fill_leaf(spec: LeafSpec, read, num_layers: int, dtype: np.dtype) -> np.ndarray:
    """One host buffer for the leaf, filled layer by layer (assignment casts in place)."""
    buffer = np.empty(spec.shape, dtype)
    if not spec.stacked:
        buffer[...] = _read_fused(spec, read, {})
        return buffer
    for i in range(num_layers):
        buffer[i] = _read_fused(spec, read, {"i": i})
    return buffer


def _read_fused(spec: LeafSpec, read, fields: dict) -> np.ndarray:
    """The leaf's tensors for one layer, transposed to [in, out] and interleaved when fused."""
    parts = [read(name.format(**fields), shape) for name, shape in zip(spec.hf_names, spec.hf_shapes())]
    parts = [part.T if spec.transpose else part for part in parts]
    return parts[0] if len(parts) == 1 else interleave_columns(parts, spec.groups)


def sharding_at(shardings: dict | None, path: str) -> Any:
    """The Sharding at a "/"-joined tree path of a nested-dict shardings tree (None when shardings is None)."""
    if shardings is None:
        return None
    node = shardings
    for key in path.split("/"):
        if not isinstance(node, dict) or key not in node:
            raise ValueError(f"shardings has no entry for {path!r}; give one Sharding per leaf of the param "
                             "tree (same nested-dict structure), or None for the default device")
        node = node[key]
    return node


def nest_paths(flat: dict[str, Any]) -> dict:
    """{"layers/wq": x} -> {"layers": {"wq": x}}."""
    tree: dict = {}
    for path, leaf in flat.items():
        *parents, name = path.split("/")
        node = tree
        for key in parents:
            node = node.setdefault(key, {})
        node[name] = leaf
    return tree
