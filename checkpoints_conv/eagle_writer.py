"""Save an EAGLE-3 head in the published yuhuili / SpecForge layout, so other engines load it too:

    config.json        the target's Llama config with num_hidden_layers=1, architectures
                       ["LlamaForCausalLMEagle3"], draft_vocab_size, target_hidden_size and
                       eagle_config.eagle_aux_hidden_state_layer_ids
    model.safetensors  midlayer.* (q/k/v read 2H), fc.weight [H, 3H], norm.weight, lm_head.weight [Vd, H],
                       d2t [Vd] (target id - draft id), t2d [V] (bool); no embed_tokens (the target's is used)

vLLM infers method "eagle3" from a directory name containing "eagle3" (or pass method="eagle3").
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import numpy as np
from safetensors.numpy import save_file

from checkpoints_conv.safetensors_writer import cast_to, hf_tensors, module_leaves
from specjax.models.eagle import EagleHead, head_weight_map

def save_eagle3_head(head: EagleHead, out_dir: str | Path, target_config: Mapping[str, Any],
                     dtype: str = "float16") -> Path:
    """Write `head` (an EAGLE-3 EagleHead with its own lm_head) into out_dir; returns out_dir."""
    cfg = head.cfg
    if cfg.method != "eagle3" or cfg.lm_head_source != "head":
        raise ValueError("save_eagle3_head writes EAGLE-3 heads with their own lm_head (what training makes)")
    tensors = {**cast_to(_published_tensors(head), dtype), **_vocabulary_maps(head)}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(_config(head, target_config, dtype), indent=2) + "\n")
    return out


def _published_tensors(head: EagleHead) -> dict[str, np.ndarray]:
    """The head's own leaves under their published names (layer 0 as "midlayer.")."""
    tensors = hf_tensors(module_leaves(head), head_weight_map(head.cfg, embed=False))
    return {name.replace("layers.0.", "midlayer.", 1) if name.startswith("layers.0.") else name: part
            for name, part in tensors.items()}


def _vocabulary_maps(head: EagleHead) -> dict[str, np.ndarray]:
    """d2t (offsets, int64) and t2d (bool mask) for a reduced draft vocabulary; nothing for a full one."""
    if not head.cfg.reduced_vocab:
        return {}
    ids = np.asarray(head.draft_to_target[...], np.int64)
    t2d = np.zeros(head.cfg.layers.vocab_size, bool)
    t2d[ids] = True
    return {"d2t": ids - np.arange(len(ids)), "t2d": t2d}


def _config(head: EagleHead, target_config: Mapping[str, Any], dtype: str) -> dict[str, Any]:
    cfg = head.cfg
    config = {k: v for k, v in target_config.items() if k not in ("architectures", "torch_dtype", "dtype")}
    config.update(
        architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
        hidden_size=cfg.hidden_size, intermediate_size=cfg.layers.intermediate_size,
        num_attention_heads=cfg.layers.num_heads, num_key_value_heads=cfg.layers.num_kv_heads,
        head_dim=cfg.layers.head_dim, vocab_size=cfg.layers.vocab_size, draft_vocab_size=cfg.draft_vocab_size,
        target_hidden_size=cfg.target_hidden_size, tie_word_embeddings=False, torch_dtype=dtype,
        norm_before_residual=cfg.norm_before_residual,
        eagle_config={"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids), "use_aux_hidden_state": True})
    return config
