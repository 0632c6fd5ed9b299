"""Save an MTP head trained for a Llama-family target as a head directory in MiMo-7B's MTP layout, which
`speculative_config={"method": "mtp", "model": DIR}` loads beside that target:

    config.json        the target's config plus num_nextn_predict_layers = 1
    model.safetensors  model.mtp_layers.0.{token_layernorm, hidden_layernorm, input_proj, final_layernorm,
                       input_layernorm, post_attention_layernorm, self_attn.*, mlp.*}; no embedding or lm_head
                       (the target's are used)
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from safetensors.numpy import save_file

from checkpoints_conv.safetensors_writer import cast_to, hf_tensors, module_leaves
from specjax.models.mtp import MtpHead, mtp_weight_map


def save_mtp_head(head: MtpHead, out_dir: str | Path, target_config: Mapping[str, Any],
                  dtype: str = "float16") -> Path:
    """Write `head` (a MiMo-layout MtpHead) into out_dir; returns out_dir."""
    if head.cfg.layout != "mimo":
        raise ValueError("save_mtp_head writes MiMo-layout MTP heads (what training makes for Llama-family targets)")
    tensors = cast_to(hf_tensors(module_leaves(head), mtp_weight_map(head.cfg)), dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    config = {k: v for k, v in target_config.items() if k not in ("torch_dtype", "dtype")}
    config.update(num_nextn_predict_layers=1, torch_dtype=dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
