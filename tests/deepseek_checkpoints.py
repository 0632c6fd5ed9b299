"""Tiny random DeepSeek-V2/V3 models built with transformers (no hub), saved as HF safetensors checkpoints, and an
FP8 block-quantized copy of such a checkpoint in DeepSeek-V3's on-disk format.

Variants (DEEPSEEK_VARIANTS) cover: q_lora_rank set and null; first_k_dense_replace 1 and 3; n_group/topk_group
4/2, 2/1, 1/1; norm_topk_prob both ways; tied and untied heads; YaRN off, with equal mscale / mscale_all_dim
(cos/sin factor 1, as V3) and with unequal ones (factor != 1); interleaved and rotate-half rope; V2's softmax
routing with "greedy" and "group_limited_greedy"; one variant ("v3_wide") with every quantized matrix dim above
128 and not a multiple of it, so 128 x 128 FP8 blocks include edge blocks. Real checkpoints use 128 x 128; the
block size is a parameter of `write_fp8_copy` so the other variants' small matrices span several blocks too.
Every norm weight, the router weights (std 0.3, so sigmoid scores do not nearly tie) and the V3 score-correction
bias are randomised after init (transformers initialises norms to 1 and the bias to 0).

transformers 5.24 behaviours that a loader or a reference must know:
- In memory the experts are fused 3-D params: mlp.experts.gate_up_proj [E, 2I, H] (gate rows, then up rows) and
  mlp.experts.down_proj [E, H, I]; save_pretrained writes DeepSeek's per-expert names back
  (mlp.experts.{e}.{gate,up,down}_proj.weight), plus mlp.gate.weight and mlp.gate.e_score_correction_bias.
- config.json gets "rope_parameters" (rope_theta inside it) where hub checkpoints have "rope_scaling" (legacy
  "type" key) and a top-level "rope_theta"; "head_dim" is written as qk_rope_head_dim (not the attention head
  width) next to "qk_head_dim"; "num_nextn_predict_layers": 1 is written although no MTP tensors are.
- q_a_layernorm and kv_a_layernorm use eps 1e-6 whatever rms_norm_eps says (the configs here set 1e-5 so that
  a loader passing rms_norm_eps to them would show).
- DeepseekV3TopkRouter ignores scoring_func and topk_method (always sigmoid, top-2-sum groups, normalising when
  norm_topk_prob); DeepseekV2TopkRouter ignores norm_topk_prob (never normalises) and masks dropped groups with 0.
- With rope_interleave=True (the default) V3 writes the rotated rope dims de-interleaved (evens then odds) into q
  and k alike; V2's complex multiply keeps them interleaved. Both give the same q·k.
- A tied head (tie_word_embeddings) is not written: the file has no lm_head.weight.
- _keys_to_ignore_on_load_unexpected is hard-coded to model.layers.61 (V3's MTP layer): a tiny model with MTP
  tensors must override it.
- The FP8 dequantizer (integrations/finegrained_fp8.py Fp8Dequantize) derives the block from the scale grid and
  rejects matrices whose dims are not multiples of it, so it cannot be the reference for edge blocks (read in the
  source, not run: it needs accelerate, which the test environment lacks).
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np

TINY_DEEPSEEK_COMMON = {
    "vocab_size": 160, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8, "v_head_dim": 24, "n_routed_experts": 8, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5, "initializer_range": 0.08, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "attn_implementation": "eager",
}

DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
YARN_EQUAL_MSCALE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                     "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                     "mscale_all_dim": 1.0}
YARN_UNEQUAL_MSCALE = {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0,
                       "original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2, "mscale": 1.0,
                       "mscale_all_dim": 0.7}
YARN_V2_LITE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0, "original_max_position_embeddings": 16,
                "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}

# name -> (transformers config class name, fields over TINY_DEEPSEEK_COMMON)
DEEPSEEK_VARIANTS = {
    "v3": ("DeepseekV3Config", {
        "q_lora_rank": 48, "num_hidden_layers": 2, "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2,
        "num_experts_per_tok": 2, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "n_shared_experts": 1,
        "tie_word_embeddings": False, "rope_parameters": YARN_EQUAL_MSCALE}),
    "v3_dense3_no_q_lora": ("DeepseekV3Config", {
        "q_lora_rank": None, "num_hidden_layers": 4, "first_k_dense_replace": 3, "n_group": 2, "topk_group": 1,
        "num_experts_per_tok": 3, "norm_topk_prob": False, "routed_scaling_factor": 1.5, "n_shared_experts": 2,
        "tie_word_embeddings": True, "rope_parameters": DEFAULT_ROPE}),
    "v3_one_group_rotate_half": ("DeepseekV3Config", {
        "q_lora_rank": 48, "num_hidden_layers": 2, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
        "num_experts_per_tok": 2, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "n_shared_experts": 1,
        "tie_word_embeddings": False, "rope_interleave": False, "rope_parameters": YARN_UNEQUAL_MSCALE}),
    "v3_wide": ("DeepseekV3Config", {
        "hidden_size": 192, "intermediate_size": 160, "moe_intermediate_size": 136, "q_lora_rank": 136,
        "kv_lora_rank": 144, "qk_nope_head_dim": 32, "v_head_dim": 40, "num_hidden_layers": 2,
        "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2, "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "n_shared_experts": 1, "tie_word_embeddings": False,
        "rope_parameters": YARN_EQUAL_MSCALE}),
    # Eight heads and eight experts: splits over 2, 4 and 8 devices (heads, experts, every intermediate size).
    "v3_tp8": ("DeepseekV3Config", {
        "num_attention_heads": 8, "num_key_value_heads": 8, "q_lora_rank": 48, "num_hidden_layers": 3,
        "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2, "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "n_shared_experts": 1, "tie_word_embeddings": False,
        "rope_parameters": YARN_EQUAL_MSCALE}),
    "v2_lite": ("DeepseekV2Config", {
        "q_lora_rank": None, "num_hidden_layers": 2, "first_k_dense_replace": 1, "topk_method": "greedy",
        "num_experts_per_tok": 2, "norm_topk_prob": False, "routed_scaling_factor": 1.0, "n_shared_experts": 2,
        "tie_word_embeddings": False, "rope_parameters": YARN_V2_LITE}),
    "v2_group_limited": ("DeepseekV2Config", {
        "q_lora_rank": 48, "num_hidden_layers": 2, "first_k_dense_replace": 1, "topk_method": "group_limited_greedy",
        "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3, "norm_topk_prob": False,
        "routed_scaling_factor": 16.0, "n_shared_experts": 2, "tie_word_embeddings": True,
        "rope_parameters": DEFAULT_ROPE}),
}

# The tensors DeepSeek-V3 stores as FP8 with a `weight_scale_inv`: every linear of attention and of the dense,
# routed-expert and shared-expert MLPs (MTP layers' blocks included). Embeddings, lm_head, norms, the router
# (mlp.gate.weight, e_score_correction_bias) and the MTP layer's eh_proj / shared_head stay unquantized.
FP8_QUANTIZED = re.compile(
    r"model\.layers\.\d+\."
    r"(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|mlp\.(experts\.\d+\.|shared_experts\.)?(gate_proj|up_proj|down_proj))\.weight")


def deepseek_config(variant: str):
    """The transformers config of a tiny variant."""
    import transformers

    config_cls, extra = DEEPSEEK_VARIANTS[variant]
    return getattr(transformers, config_cls)(**{**TINY_DEEPSEEK_COMMON, **extra})


def build_tiny_deepseek(variant: str, *, seed: int = 0):
    """A randomly initialised fp32 *ForCausalLM of `variant` in eval mode, norms / router / bias randomised."""
    import torch
    import transformers

    config = deepseek_config(variant)
    model_cls = getattr(transformers, DEEPSEEK_VARIANTS[variant][0].removesuffix("Config") + "ForCausalLM")
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    _randomize_norms_and_router(model, seed)
    return model


def _randomize_norms_and_router(model, seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if "norm" in name:
                tensor.copy_(1.0 + 0.1 * torch.randn(tensor.shape, generator=gen))
            elif name.endswith("mlp.gate.weight"):
                tensor.copy_(0.3 * torch.randn(tensor.shape, generator=gen))
            elif name.endswith("e_score_correction_bias"):
                tensor.copy_(0.1 * torch.randn(tensor.shape, generator=gen))


def save_tiny_deepseek(variant: str, out_dir: Path, *, seed: int = 0) -> Path:
    """Save `build_tiny_deepseek(variant)` with save_pretrained (safetensors) into out_dir."""
    build_tiny_deepseek(variant, seed=seed).save_pretrained(out_dir, safe_serialization=True)
    return Path(out_dir)


def quantize_blocks_numpy(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(float8_e4m3fn [R, C], float32 scale_inv [ceil(R/br), ceil(C/bc)]): scale_inv = block amax / 448, the
    block divided by it and rounded to e4m3 (an all-zero block gets scale 1). A block-by-block loop, independent
    of specjax.models.fp8."""
    rows, cols = w.shape
    block_rows, block_cols = block
    scale_inv = np.ones((-(-rows // block_rows), -(-cols // block_cols)), np.float32)
    quantized = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            window = (slice(i * block_rows, (i + 1) * block_rows), slice(j * block_cols, (j + 1) * block_cols))
            part = w[window].astype(np.float32)
            amax = np.float32(np.abs(part).max())
            if amax > 0:
                scale_inv[i, j] = amax / np.float32(448.0)
            quantized[window] = np.clip(part / scale_inv[i, j], -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn)
    return quantized, scale_inv


def dequantize_blocks_numpy(quantized: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """float32 W = W_fp8 * scale_inv block by block (the loop form of DeepSeek's weight_dequant)."""
    per_element = np.repeat(np.repeat(scale_inv, block[0], axis=0), block[1], axis=1)
    return quantized.astype(np.float32) * per_element[:quantized.shape[0], :quantized.shape[1]]


def write_fp8_copy(src_dir: Path, out_dir: Path, *, block: tuple[int, int] = (128, 128)) -> Path:
    """Copy the checkpoint in src_dir to out_dir with every FP8_QUANTIZED tensor stored as float8_e4m3fn plus its
    `<name>_scale_inv` (float32), the others unchanged, and DeepSeek-V3's quantization_config (with
    weight_block_size = block) in config.json. Handles sharded checkpoints (the index gains the scale names)."""
    import torch
    from safetensors.torch import load_file, save_file

    src_dir, out_dir = Path(src_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    added: dict[str, str] = {}
    for shard in sorted(src_dir.glob("*.safetensors")):
        tensors = load_file(shard)
        for name in [n for n in tensors if FP8_QUANTIZED.fullmatch(n)]:
            quantized, scale_inv = quantize_blocks_numpy(tensors[name].float().numpy(), block)
            tensors[name] = torch.from_numpy(quantized.view(np.uint8)).view(torch.float8_e4m3fn)
            tensors[name + "_scale_inv"] = torch.from_numpy(scale_inv)
            added[name + "_scale_inv"] = shard.name
        save_file(tensors, out_dir / shard.name, metadata={"format": "pt"})
    for other in src_dir.iterdir():
        if other.suffix != ".safetensors" and other.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(other, out_dir / other.name)
    config = json.loads((src_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    index_path = src_dir / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
        index["weight_map"].update(added)
        (out_dir / index_path.name).write_text(json.dumps(index, indent=2))
    return out_dir


def save_tiny_deepseek_with_mtp(variant: str, out_dir: Path, *, seed: int = 0):
    """(target model, transformers MtpModel, out_dir): `variant` saved as in save_tiny_deepseek plus one MTP layer
    built with transformers' MtpModel (norms, router and bias randomised like the target's), written in
    DeepSeek-V3's layout: model.layers.{num_hidden_layers}.{enorm, hnorm, eh_proj, shared_head.norm, <the
    decoder block's tensors, experts one by one>}, with the duplicated embed_tokens and shared_head.head."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers.modeling_layers import MtpModel

    model = build_tiny_deepseek(variant, seed=seed)
    model.save_pretrained(out_dir, safe_serialization=True)
    torch.manual_seed(seed + 7)
    mtp = MtpModel(model, 1).to(torch.float32).eval()
    _initialize_fused_experts(mtp, model.config.initializer_range, seed + 7)
    _randomize_norms_and_router(mtp, seed + 7)
    layer = model.config.num_hidden_layers
    tensors = load_file(Path(out_dir) / "model.safetensors")
    tensors.update(_deepseek_mtp_tensors(mtp.state_dict(), layer, model.config.moe_intermediate_size))
    save_file(tensors, Path(out_dir) / "model.safetensors", metadata={"format": "pt"})
    return model, mtp, Path(out_dir)


def _initialize_fused_experts(mtp, std: float, seed: int) -> None:
    """MtpModel leaves its block's fused expert tensors uninitialised (zeros or garbage): draw them normally."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in mtp.named_parameters():
            if ".experts." in name:
                param.copy_(std * torch.randn(param.shape, generator=gen))


def _deepseek_mtp_tensors(state: dict, layer: int, intermediate: int) -> dict:
    """MtpModel's state dict under DeepSeek-V3's MTP names (vLLM's and DeepSeek's README_WEIGHTS layout)."""
    out, prefix = {}, f"model.layers.{layer}."
    for name, tensor in state.items():
        tensor = tensor.detach().clone().contiguous()
        if name.startswith("layers.0.mtp_block.mlp.experts.gate_up_proj"):
            for e in range(tensor.shape[0]):
                out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = tensor[e, :intermediate].contiguous()
                out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = tensor[e, intermediate:].contiguous()
        elif name.startswith("layers.0.mtp_block.mlp.experts.down_proj"):
            for e in range(tensor.shape[0]):
                out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = tensor[e].contiguous()
        elif name.startswith("layers.0.mtp_block."):
            out[prefix + name.removeprefix("layers.0.mtp_block.")] = tensor
        elif name == "layers.0.post_norm.weight":
            out[prefix + "shared_head.norm.weight"] = tensor
        elif name.startswith("layers.0."):
            out[prefix + name.removeprefix("layers.0.")] = tensor
        elif name == "embed_tokens.weight":
            out[prefix + "embed_tokens.weight"] = tensor
        elif name == "shared_head.weight":
            out[prefix + "shared_head.head.weight"] = tensor
    return out
