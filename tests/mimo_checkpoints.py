"""A tiny MiMo-7B-style checkpoint (no hub): a random Qwen2 decoder saved by transformers, renamed MiMoForCausalLM,
with one MTP layer built by transformers' MtpModel in MiMo's order (the hidden state first:
mtp_hidden_states_first) and written under MiMo's names (model.mtp_layers.0.{token_layernorm, hidden_layernorm,
input_proj, final_layernorm, self_attn.*, mlp.*, input_layernorm, post_attention_layernorm})."""
from __future__ import annotations

import json
from pathlib import Path

from conftest import randomize_norms_and_biases

TINY_MIMO = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
                 tie_word_embeddings=False, use_sliding_window=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
MIMO_NAMES = {"enorm": "token_layernorm", "hnorm": "hidden_layernorm", "eh_proj": "input_proj",
              "post_norm": "final_layernorm"}


def save_tiny_mimo(out_dir: Path, *, seed: int = 0):
    """(transformers Qwen2 target, transformers MtpModel, out_dir)."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file
    from transformers.modeling_layers import MtpModel

    config = transformers.Qwen2Config(**TINY_MIMO)
    config.num_mtp_layers, config.mtp_hidden_states_first, config.mtp_layer_types = 1, True, ["full_attention"]
    torch.manual_seed(seed)
    target = transformers.Qwen2ForCausalLM(config).to(torch.float32).eval()
    mtp = MtpModel(target, 1).to(torch.float32).eval()
    randomize_norms_and_biases(target, seed)
    randomize_norms_and_biases(mtp, seed + 1)
    out_dir = Path(out_dir)
    target.save_pretrained(out_dir, safe_serialization=True)
    tensors = load_file(out_dir / "model.safetensors")
    for name, tensor in mtp.state_dict().items():
        if name.startswith("layers.0."):
            rest = name.removeprefix("layers.0.").removeprefix("mtp_block.")
            part, _, suffix = rest.partition(".")
            tensors["model.mtp_layers.0." + MIMO_NAMES.get(part, part) + "." + suffix] = tensor.detach().clone()
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    hf = json.loads((out_dir / "config.json").read_text())
    hf.update(architectures=["MiMoForCausalLM"], model_type="mimo", num_nextn_predict_layers=1)
    (out_dir / "config.json").write_text(json.dumps(hf, indent=2))
    return target, mtp, out_dir

