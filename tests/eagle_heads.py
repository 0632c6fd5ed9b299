"""Random EAGLE heads written in the published layouts (tensor names, file formats, config fields) for a
target config.json: yuhuili EAGLE-1 (pytorch_model.bin), yuhuili EAGLE-3 (midlayer.*, d2t/t2d) and
speculators EAGLE-3 (transformer_layer_config, speculators_config)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

LAYOUTS = ("eagle1_yuhuili", "eagle3_yuhuili", "eagle3_speculators")


def write_head(out: Path, target_config: dict, layout: str, *, seed: int = 0, draft_vocab: int | None = None,
               aux_layer_ids: list[int] | None = None, scale: float = 0.05, embed: bool = False,
               lm_head: bool = True) -> Path:
    """Write a random head of `layout` for the target described by `target_config` into `out`."""
    rng = np.random.default_rng(seed)
    H, V, I = target_config["hidden_size"], target_config["vocab_size"], target_config["intermediate_size"]
    heads, kv_heads = target_config["num_attention_heads"], target_config["num_key_value_heads"]
    head_dim = target_config.get("head_dim") or H // heads

    def w(*shape):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    def norm():
        return (1 + 0.1 * rng.standard_normal(H)).astype(np.float32)

    def layer(prefix: str, in_features: int, input_norm: bool, hidden_norm: bool) -> dict:
        t = {f"{prefix}self_attn.q_proj.weight": w(heads * head_dim, in_features),
             f"{prefix}self_attn.k_proj.weight": w(kv_heads * head_dim, in_features),
             f"{prefix}self_attn.v_proj.weight": w(kv_heads * head_dim, in_features),
             f"{prefix}self_attn.o_proj.weight": w(H, heads * head_dim),
             f"{prefix}mlp.gate_proj.weight": w(I, H), f"{prefix}mlp.up_proj.weight": w(I, H),
             f"{prefix}mlp.down_proj.weight": w(H, I), f"{prefix}post_attention_layernorm.weight": norm()}
        if input_norm:
            t[f"{prefix}input_layernorm.weight"] = norm()
        if hidden_norm:
            t[f"{prefix}hidden_norm.weight"] = norm()
        return t

    out.mkdir(parents=True, exist_ok=True)
    layer_config = {k: v for k, v in target_config.items() if k not in ("architectures", "torch_dtype", "dtype")}
    layer_config.update(num_hidden_layers=1, architectures=["LlamaForCausalLM"], model_type="llama")
    if layout == "eagle1_yuhuili":
        tensors = layer("layers.0.", H, input_norm=False, hidden_norm=False)
        tensors.update({"fc.weight": w(H, 2 * H), "fc.bias": w(H)})
        if embed:
            tensors["embed_tokens.weight"] = w(V, H)
        _save_torch(tensors, out / "pytorch_model.bin")
        (out / "config.json").write_text(json.dumps(layer_config))
        return out
    Vd = draft_vocab or V
    n_aux = len(aux_layer_ids) if aux_layer_ids else 3
    prefix = "midlayer." if layout == "eagle3_yuhuili" else "layers.0."
    tensors = layer(prefix, 2 * H, input_norm=True, hidden_norm=True)
    tensors.update({"fc.weight": w(H, n_aux * H), "norm.weight": norm()})
    if lm_head:
        tensors["lm_head.weight"] = w(Vd, H)
    if embed:
        tensors["embed_tokens.weight"] = w(V, H)
    if Vd < V:
        ids = np.sort(rng.choice(V, Vd, replace=False))
        tensors["d2t"] = (ids - np.arange(Vd)).astype(np.int64)
        t2d = np.zeros(V, bool)
        t2d[ids] = True
        tensors["t2d"] = t2d
    _save_safetensors(tensors, out / "model.safetensors")
    if layout == "eagle3_yuhuili":
        config = dict(layer_config, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=Vd)
        if aux_layer_ids:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layer_ids}
    else:
        config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                  "speculators_version": "0.1.0", "transformer_layer_config": layer_config,
                  "draft_vocab_size": Vd, "norm_before_residual": True, "target_hidden_size": None,
                  "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                         "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                         "verifier": {"name_or_path": "target", "architectures":
                                                      target_config.get("architectures")}}}
        if aux_layer_ids:
            config["eagle_aux_hidden_state_layer_ids"] = aux_layer_ids
    (out / "config.json").write_text(json.dumps(config))
    return out


def _save_safetensors(tensors: dict, path: Path) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, str(path))


def _save_torch(tensors: dict, path: Path) -> None:
    import torch

    torch.save({name: torch.from_numpy(t) for name, t in tensors.items()}, str(path))
