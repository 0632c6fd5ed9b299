"""EAGLE draft heads in the layouts people publish -> an EagleHead sharing what it lacks with the target.

Layouts (tensor names as in vLLM's llama_eagle.py / llama_eagle3.py loaders):
- yuhuili EAGLE-1 (e.g. EAGLE-LLaMA3.1-Instruct-8B): a Llama config.json with num_hidden_layers=1;
  pytorch_model.bin with fc.weight [H, 2H] (fc.bias when trained with one), layers.{i}.self_attn.*,
  layers.{i}.mlp.*, layers.{i}.post_attention_layernorm (no input norm on layer 0), maybe embed_tokens.
- yuhuili / SpecForge EAGLE-3 (architectures LlamaForCausalLMEagle3): midlayer.* (= layers.0.*, with
  hidden_norm), fc.weight [H, 3*Ht], norm.weight, lm_head.weight [Vd, H], d2t [Vd] (target id - draft id),
  t2d [V] (unused); config draft_vocab_size, optionally target_hidden_size and
  eagle_config.eagle_aux_hidden_state_layer_ids.
- speculators EAGLE-3 (e.g. RedHatAI): config with speculators_model_type "eagle3",
  transformer_layer_config (the layer's Llama config), draft_vocab_size, norm_before_residual (vLLM's default
  when absent: true), target_hidden_size, eagle_aux_hidden_state_layer_ids, speculators_config; tensors
  layers.0.*, fc, norm, lm_head, d2t, t2d, embed_tokens.
Weights missing from the head (embedding; the lm_head of EAGLE-1 and of full-vocabulary EAGLE-3 heads)
are the target's own arrays, shared rather than copied.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from safetensors import safe_open

from checkpoints_conv.fused_columns import interleave_columns
from checkpoints_conv.safetensors_loader import resolve_dtype, tensor_files

if TYPE_CHECKING:  # specjax imports this package at import time; runtime imports back are made in functions
    from specjax.models.eagle import EagleConfig, EagleHead
    from specjax.models.model_config import ModelConfig

EAGLE_METHODS = ("eagle", "eagle3")
BIN_FILE = "pytorch_model.bin"
# What to fetch of a head on the Hub: the published heads ship pytorch_model.bin or safetensors.
EAGLE_HEAD_FILES = ("config.json", "*.safetensors", "model.safetensors.index.json", BIN_FILE)
CONVERT_HINT = ("install torch (`pip install torch`) to read it, or convert it once where torch is installed: "
                "python -c \"import torch; from safetensors.torch import save_file; "
                "sd = torch.load('pytorch_model.bin', map_location='cpu'); "
                "save_file({k: v.contiguous() for k, v in sd.items()}, 'model.safetensors')\"")


def read_head_config(path: str | Path) -> dict[str, Any]:
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} does not exist: an EAGLE head directory needs the config.json "
                                "it was published with")
    return json.loads(config_file.read_text())


def method_from_head_config(d: Mapping[str, Any]) -> str | None:
    """"eagle3" / "eagle" when the config says so (speculators type, Eagle3 architectures), else None."""
    speculators_type = d.get("speculators_model_type")
    if speculators_type is not None:
        return str(speculators_type)
    architectures = " ".join(d.get("architectures") or []).lower()
    if "eagle3" in architectures:
        return "eagle3"
    if "eagle" in architectures:
        return "eagle"
    return None


def eagle_config_from_hf(d: Mapping[str, Any], method: str, target: ModelConfig,
                         lm_head_source: str = "head") -> EagleConfig:
    """Parse a head's config.json (any published layout) and check it fits the target."""
    from specjax.models.eagle import EagleConfig
    from specjax.models.model_config import ModelConfig

    declared = method_from_head_config(d)
    if declared is not None and declared != method:
        raise ValueError(f"the head's config.json describes a {declared!r} head but speculative_config method is "
                         f"{method!r}; set method to {declared!r} (or leave it unset to infer it)")
    if method not in EAGLE_METHODS:
        raise NotImplementedError(f"EAGLE head type {method!r} is not supported; supported: {EAGLE_METHODS}")
    speculators = "speculators_model_type" in d
    layer_dict = dict(d["transformer_layer_config"]) if speculators else dict(d)
    if d.get("norm_before_fc"):
        raise NotImplementedError("EAGLE-3 heads with norm_before_fc=true are not supported")
    layer_dict.setdefault("vocab_size", target.vocab_size)
    layers = ModelConfig.from_hf_dict(layer_dict)
    # vLLM reads q/k/v biases from `qkv_bias` where a config gives it.
    layers = dataclasses.replace(layers, attention_bias=bool(layer_dict.get("qkv_bias", layers.attention_bias)))
    cfg = EagleConfig(
        method=method, layers=layers,
        target_hidden_size=int(d.get("target_hidden_size") or layers.hidden_size),
        draft_vocab_size=int(d.get("draft_vocab_size") or layers.vocab_size),
        aux_layer_ids=_aux_layer_ids(d, target) if method == "eagle3" else (),
        norm_before_residual=bool(d.get("norm_before_residual", speculators)),
        lm_head_source=lm_head_source)
    check_head_fits_target(cfg, target)
    return cfg


def _aux_layer_ids(d: Mapping[str, Any], target: ModelConfig) -> tuple[int, ...]:
    from specjax.models.eagle import default_aux_layer_ids

    ids = d.get("eagle_aux_hidden_state_layer_ids") or (d.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    ids = tuple(int(i) for i in ids) if ids else default_aux_layer_ids(target.num_layers)
    bad = [i for i in ids if not 0 <= i < target.num_layers]
    if bad:
        raise ValueError(f"the head's eagle_aux_hidden_state_layer_ids {list(ids)} name layers {bad} outside the "
                         f"target's 0..{target.num_layers - 1}: this head was trained for another target model")
    return ids


def check_head_fits_target(cfg: EagleConfig, target: ModelConfig) -> None:
    """A head must read the target's hidden states and speak its vocabulary."""
    if cfg.layers.vocab_size != target.vocab_size:
        raise ValueError(
            f"the EAGLE head's vocab_size={cfg.layers.vocab_size} differs from the target's "
            f"vocab_size={target.vocab_size}: the head was trained for another model; use a head trained for "
            "this target")
    width = cfg.target_hidden_size if cfg.method == "eagle3" else cfg.hidden_size
    if width != target.hidden_size:
        raise ValueError(
            f"the EAGLE head reads hidden states of size {width} but the target's hidden_size is "
            f"{target.hidden_size}: the head was trained for another model; use a head trained for this target")
    if cfg.draft_vocab_size > target.vocab_size:
        raise ValueError(f"the EAGLE head's draft_vocab_size={cfg.draft_vocab_size} exceeds the target's "
                         f"vocab_size={target.vocab_size}")


def load_eagle_head(path: str | Path, method: str, target_cfg: ModelConfig, target_params: Mapping[str, Any],
                    dtype: Any = "auto", *, attention_impl: str = "auto") -> EagleHead:
    """Read the head in `path` into an EagleHead; the target's embedding / lm_head fill what it lacks.

    target_params: the target's param tree (nnx.State or nested dict) with "embed" and, when untied, "lm_head".
    """
    from specjax.models.eagle import EagleHead

    path = Path(path)
    d = read_head_config(path)
    tensors = read_head_tensors(path)
    names = _canonical_names(tensors)
    cfg = eagle_config_from_hf(d, method, target_cfg, _lm_head_source(method, names, target_cfg))
    cfg = _with_fc_bias(cfg, names)
    np_dtype = resolve_dtype(dtype, target_cfg)
    params = _head_params(cfg, names, tensors, np_dtype, path)
    params.update(_shared_from_target(cfg, names, target_params, target_cfg))
    head = nnx.eval_shape(lambda: EagleHead(cfg, dtype=np_dtype, rngs=nnx.Rngs(0), attention_impl=attention_impl))
    nnx.update(head, params)
    return head


def _lm_head_source(method: str, names: Mapping[str, str], target: ModelConfig) -> str:
    """EAGLE-3 heads usually bring an lm_head; EAGLE-1 heads always use the target's (as vLLM does)."""
    if method == "eagle3" and "lm_head.weight" in names:
        return "head"
    return "target_embed" if target.tie_word_embeddings else "target"


def _with_fc_bias(cfg: EagleConfig, names: Mapping[str, str]) -> EagleConfig:
    """EAGLE-1 training code defaults to an fc bias, EAGLE-3's to none: follow the tensors."""
    return dataclasses.replace(cfg, fc_bias="fc.bias" in names)


# ----------------------------------------------------------------------------------------------------------
# tensors
# ----------------------------------------------------------------------------------------------------------

TensorReader = Callable[[str], np.ndarray]


def read_head_tensors(path: Path) -> dict[str, TensorReader]:
    """Tensor name -> a reader, from safetensors (preferred) or pytorch_model.bin (through torch)."""
    if list(path.glob("*.safetensors")):
        files = tensor_files(path)
        return {name: _safetensors_reader(file, name) for name, file in files.items()}
    if (path / BIN_FILE).is_file():
        return _torch_bin_readers(path / BIN_FILE)
    raise FileNotFoundError(f"no *.safetensors or {BIN_FILE} in {path}: an EAGLE head directory needs its weights")


def _safetensors_reader(file: Path, name: str) -> TensorReader:
    def read(_: str) -> np.ndarray:
        with safe_open(str(file), framework="numpy") as handle:
            return np.asarray(handle.get_tensor(name))

    return read


def _torch_bin_readers(file: Path) -> dict[str, TensorReader]:
    try:
        import torch
    except ImportError as err:
        raise ImportError(f"{file} is a PyTorch pickle; {CONVERT_HINT}") from err
    state = torch.load(file, map_location="cpu", weights_only=True)

    def reader(tensor) -> TensorReader:
        def read(_: str) -> np.ndarray:
            if tensor.is_floating_point():
                return tensor.float().numpy()
            return tensor.numpy()
        return read

    return {name: reader(t) for name, t in state.items()}


def _canonical_names(tensors: Mapping[str, TensorReader]) -> dict[str, str]:
    """Published name -> one spelling: "midlayer." is layer 0; a "model." prefix is dropped."""
    out = {}
    for name in tensors:
        canonical = name.removeprefix("model.")
        canonical = canonical.replace("midlayer.", "layers.0.", 1) if canonical.startswith("midlayer.") else canonical
        out[canonical] = name
    return out


def _head_params(cfg: EagleConfig, names: Mapping[str, str], tensors: Mapping[str, TensorReader],
                 dtype: np.dtype, path: Path) -> dict:
    """The head's own weights in the module's layout (matrices [in, out])."""
    H, V, Vd = cfg.hidden_size, cfg.layers.vocab_size, cfg.draft_vocab_size

    def read(name: str, shape: tuple[int, ...], transpose: bool = False) -> jax.Array:
        if name not in names:
            raise ValueError(f"tensor {name!r} is missing from the {cfg.method} head in {path}; the files do not "
                             f"match its config.json (or the head is not a {cfg.method} head)")
        array = tensors[names[name]](name)
        expected = tuple(reversed(shape)) if transpose else shape
        if tuple(array.shape) != expected:
            raise ValueError(f"tensor {name!r} in {path} has shape {tuple(array.shape)}, expected {expected} from "
                             "the head's config.json and the target; the head does not fit this target")
        return jnp.asarray((array.T if transpose else array).astype(dtype))

    params: dict[str, Any] = {"fc": read("fc.weight", (cfg.fc_in_features, H), transpose=True)}
    if cfg.fc_bias:
        params["fc_bias"] = read("fc.bias", (H,))
    params["layers"] = {i: _layer_params(cfg, i, read) for i in range(cfg.layers.num_layers)}
    if cfg.method == "eagle3":
        params["norm"] = read("norm.weight", (H,))
    if cfg.lm_head_source == "head":
        params["lm_head"] = read("lm_head.weight", (H, Vd), transpose=True)
    elif cfg.reduced_vocab:
        raise ValueError(f"the head in {path} has a reduced draft vocabulary ({Vd} of {V}) but no lm_head.weight")
    if "embed_tokens.weight" in names:
        params["embed"] = read("embed_tokens.weight", (V, H))
    if cfg.reduced_vocab:
        params["draft_to_target"] = _draft_to_target(cfg, names, tensors, path)
    return params


def _layer_params(cfg: EagleConfig, i: int, read) -> dict:
    c = cfg.layers
    H, I = c.hidden_size, c.intermediate_size
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    first3 = cfg.method == "eagle3" and i == 0
    in_features = 2 * H if first3 else H
    p, attn = f"layers.{i}.", f"layers.{i}.self_attn."
    def fused(parts: list[tuple[str, tuple[int, ...]]], groups: int, transpose: bool = False) -> jax.Array:
        return jnp.asarray(interleave_columns([np.asarray(read(name, shape, transpose)) for name, shape in parts],
                                              groups))

    qkv = [attn + "q_proj.", attn + "k_proj.", attn + "v_proj."]
    out = {
        "w_qkv": fused([(n + "weight", (in_features, w)) for n, w in zip(qkv, (q, kv, kv))], c.num_kv_heads, True),
        "wo": read(attn + "o_proj.weight", (q, H), True),
        "mlp_norm": read(p + "post_attention_layernorm.weight", (H,)),
        "w_gate_up": fused([(p + "mlp.gate_proj.weight", (H, I)), (p + "mlp.up_proj.weight", (H, I))], I, True),
        "w_down": read(p + "mlp.down_proj.weight", (I, H), True),
    }
    if c.attention_bias:
        out["b_qkv"] = fused([(n + "bias", (w,)) for n, w in zip(qkv, (q, kv, kv))], c.num_kv_heads)
    if cfg.method == "eagle3" or i > 0:   # EAGLE-1's first layer has no input norm
        out["attn_norm"] = read(p + "input_layernorm.weight", (H,))
    if first3:
        out["hidden_norm"] = read(p + "hidden_norm.weight", (H,))
    return out


def _draft_to_target(cfg: EagleConfig, names, tensors, path: Path) -> jax.Array:
    """d2t stores target id - draft id; resolve it to absolute target ids and check them."""
    if "d2t" not in names:
        raise ValueError(f"the head in {path} has draft_vocab_size={cfg.draft_vocab_size} < vocab_size="
                         f"{cfg.layers.vocab_size} but no 'd2t' tensor mapping draft ids to target ids")
    offsets = np.asarray(tensors[names["d2t"]]("d2t")).astype(np.int64)
    if offsets.shape != (cfg.draft_vocab_size,):
        raise ValueError(f"'d2t' in {path} has shape {offsets.shape}, expected ({cfg.draft_vocab_size},)")
    ids = np.arange(cfg.draft_vocab_size) + offsets
    if ids.min() < 0 or ids.max() >= cfg.layers.vocab_size:
        raise ValueError(f"'d2t' in {path} maps draft ids outside the target vocabulary [0, "
                         f"{cfg.layers.vocab_size}): the head belongs to another target")
    return jnp.asarray(ids, jnp.int32)


def _shared_from_target(cfg: EagleConfig, names: Mapping[str, str], target_params: Mapping[str, Any],
                        target_cfg: ModelConfig) -> dict:
    """The target's embedding (when the head has none) and lm_head (when it has none), as the same arrays."""
    shared = {}
    if "embed_tokens.weight" not in names:
        if cfg.hidden_size != target_cfg.hidden_size:
            raise ValueError(f"the EAGLE head has no embed_tokens and its hidden_size={cfg.hidden_size} differs "
                             f"from the target's {target_cfg.hidden_size}, so it cannot share the target's")
        shared["embed"] = _array(target_params["embed"])
    if cfg.lm_head_source == "target":
        shared["lm_head"] = _array(target_params["lm_head"])
    elif cfg.lm_head_source == "target_embed":
        shared["lm_head"] = _array(target_params["embed"])
    return shared


def _array(leaf: Any) -> jax.Array:
    return leaf[...] if isinstance(leaf, nnx.Variable) else leaf
