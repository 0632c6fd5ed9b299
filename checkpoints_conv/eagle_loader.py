"""EAGLE draft heads in the layouts people publish (specjax/models/eagle.py lists them) -> an EagleHead sharing
what it lacks with the target.

The head's tensors are read from safetensors or pytorch_model.bin under one canonical spelling ("midlayer."
is layer 0, a "model." prefix is dropped), then filled into the tree the head's weight map describes by the
generic loader. Weights missing from the head (embedding; the lm_head of EAGLE-1 and of full-vocabulary
EAGLE-3 heads) are the target's own arrays, shared rather than copied.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from checkpoints_conv.safetensors_loader import load_tree, tensor_files
from specjax.kernels.policy import KernelPolicy
from specjax.models.eagle import EagleConfig, EagleHead, LmHeadSource, head_weight_map
from specjax.models.registry import read_config_json

BIN_FILE = "pytorch_model.bin"
# What to fetch of a head on the Hub: the published heads ship pytorch_model.bin or safetensors.
EAGLE_HEAD_FILES = ("config.json", "*.safetensors", "model.safetensors.index.json", BIN_FILE)
CONVERT_HINT = ("install torch (`pip install torch`) to read it, or convert it once where torch is installed: "
                "python -c \"import torch; from safetensors.torch import save_file; "
                "sd = torch.load('pytorch_model.bin', map_location='cpu'); "
                "save_file({k: v.contiguous() for k, v in sd.items()}, 'model.safetensors')\"")
# Canonical tensor name -> its contents.
Tensors = Mapping[str, Callable[[], np.ndarray]]


def load_eagle_head(path: str | Path, method: str, target_cfg: Any, target_params: Mapping[str, Any],
                    dtype: np.dtype, *, kernels: KernelPolicy = KernelPolicy()) -> EagleHead:
    """Read the head in `path` into an EagleHead in `dtype`; the target's embedding / lm_head fill what it
    lacks. target_params: the target's param tree (nnx.State or nested dict) with "embed" and, when untied,
    "lm_head"."""
    path = Path(path)
    tensors = read_head_tensors(path)
    cfg = EagleConfig.from_hf(read_config_json(path), method, target_cfg,
                              lm_head_source=_lm_head_source(method, tensors, target_cfg),
                              fc_bias="fc.bias" in tensors)   # EAGLE-1 trains with an fc bias, EAGLE-3 without
    if cfg.reduced_vocab and cfg.lm_head_source != "head":
        raise ValueError(f"the head in {path} has a reduced draft vocabulary ({cfg.draft_vocab_size} of "
                         f"{cfg.layers.vocab_size}) but no lm_head.weight")
    params = load_tree(head_weight_map(cfg, embed="embed_tokens.weight" in tensors), _reader(tensors, cfg, path),
                       dtype)
    if cfg.reduced_vocab:
        params["draft_to_target"] = _draft_to_target(cfg, tensors, path)
    params.update(_shared_from_target(cfg, tensors, target_params, target_cfg))
    head = nnx.eval_shape(lambda: EagleHead(cfg, dtype=dtype, rngs=nnx.Rngs(0), kernels=kernels))
    nnx.update(head, params)
    return head


def _lm_head_source(method: str, tensors: Tensors, target: Any) -> LmHeadSource:
    """EAGLE-3 heads usually bring an lm_head; EAGLE-1 heads always use the target's (as vLLM does)."""
    if method == "eagle3" and "lm_head.weight" in tensors:
        return "head"
    return "target_embed" if target.tie_word_embeddings else "target"


def _reader(tensors: Tensors, cfg: EagleConfig, path: Path):
    def read(name: str, expected: tuple[int, ...]) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"tensor {name!r} is missing from the {cfg.method} head in {path}; the files do not "
                             f"match its config.json (or the head is not a {cfg.method} head)")
        array = tensors[name]()
        if tuple(array.shape) != tuple(expected):
            raise ValueError(f"tensor {name!r} in {path} has shape {tuple(array.shape)}, expected {tuple(expected)} "
                             "from the head's config.json and the target; the head does not fit this target")
        return array

    return read


# ----------------------------------------------------------------------------------------------------------
# tensors
# ----------------------------------------------------------------------------------------------------------

def read_head_tensors(path: Path) -> dict[str, Callable[[], np.ndarray]]:
    """Canonical tensor name -> a reader, from safetensors (preferred) or pytorch_model.bin (through torch)."""
    if list(path.glob("*.safetensors")):
        readers = {name: _safetensors_reader(file, name) for name, file in tensor_files(path).items()}
    elif (path / BIN_FILE).is_file():
        readers = _torch_bin_readers(path / BIN_FILE)
    else:
        raise FileNotFoundError(f"no *.safetensors or {BIN_FILE} in {path}: an EAGLE head directory needs its "
                                "weights")
    return {canonical_name(name): read for name, read in readers.items()}


def canonical_name(name: str) -> str:
    """A published tensor name in one spelling: "midlayer." is layer 0; a "model." prefix is dropped."""
    name = name.removeprefix("model.")
    return name.replace("midlayer.", "layers.0.", 1) if name.startswith("midlayer.") else name


def _safetensors_reader(file: Path, name: str) -> Callable[[], np.ndarray]:
    def read() -> np.ndarray:
        with safe_open(str(file), framework="numpy") as handle:
            return np.asarray(handle.get_tensor(name))

    return read


def _torch_bin_readers(file: Path) -> dict[str, Callable[[], np.ndarray]]:
    try:
        import torch
    except ImportError as err:
        raise ImportError(f"{file} is a PyTorch pickle; {CONVERT_HINT}") from err
    state = torch.load(file, map_location="cpu", weights_only=True)

    def reader(tensor) -> Callable[[], np.ndarray]:
        def read() -> np.ndarray:
            return tensor.float().numpy() if tensor.is_floating_point() else tensor.numpy()
        return read

    return {name: reader(t) for name, t in state.items()}


def _draft_to_target(cfg: EagleConfig, tensors: Tensors, path: Path) -> jnp.ndarray:
    """d2t stores target id - draft id; resolve it to absolute target ids and check them."""
    if "d2t" not in tensors:
        raise ValueError(f"the head in {path} has draft_vocab_size={cfg.draft_vocab_size} < vocab_size="
                         f"{cfg.layers.vocab_size} but no 'd2t' tensor mapping draft ids to target ids")
    offsets = np.asarray(tensors["d2t"]()).astype(np.int64)
    if offsets.shape != (cfg.draft_vocab_size,):
        raise ValueError(f"'d2t' in {path} has shape {offsets.shape}, expected ({cfg.draft_vocab_size},)")
    ids = np.arange(cfg.draft_vocab_size) + offsets
    if ids.min() < 0 or ids.max() >= cfg.layers.vocab_size:
        raise ValueError(f"'d2t' in {path} maps draft ids outside the target vocabulary [0, "
                         f"{cfg.layers.vocab_size}): the head belongs to another target")
    return jnp.asarray(ids, jnp.int32)


def _shared_from_target(cfg: EagleConfig, tensors: Tensors, target_params: Mapping[str, Any],
                        target_cfg: Any) -> dict:
    """The target's embedding (when the head has none) and lm_head (when it has none), as the same arrays."""
    shared = {}
    if "embed_tokens.weight" not in tensors:
        if cfg.hidden_size != target_cfg.hidden_size:
            raise ValueError(f"the EAGLE head has no embed_tokens and its hidden_size={cfg.hidden_size} differs "
                             f"from the target's {target_cfg.hidden_size}, so it cannot share the target's")
        shared["embed"] = _array(target_params["embed"])
    if cfg.lm_head_source == "target":
        shared["lm_head"] = _array(target_params["lm_head"])
    elif cfg.lm_head_source == "target_embed":
        shared["lm_head"] = _array(target_params["embed"])
    return shared


def _array(leaf: Any) -> Any:
    return leaf[...] if isinstance(leaf, nnx.Variable) else leaf
