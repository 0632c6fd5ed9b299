"""The DeepSeek-V2/V3 family against transformers' own DeepseekV3ForCausalLM / DeepseekV2ForCausalLM (fp32, CPU):
logits of a batched prefill and of decode / verify steps over the latent cache in both MLA forms, greedy
continuations through the engine loop, FP8 block-quantized checkpoints kept FP8 on the device, and clear errors
for configs and checkpoints that do not fit."""
from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from deepseek_checkpoints import (DEEPSEEK_VARIANTS, build_tiny_deepseek, dequantize_blocks_numpy,
                                  write_fp8_copy)
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from conftest import jitted_forward, read_checkpoint
from specjax import LLM, SamplingParams
from specjax.engine.loop import LoopSpec, jit_generate
from specjax.engine.proposers.base import NoProposer
from specjax.engine.rows import greedy_rows
from specjax.kernels.policy import KernelPolicy
from specjax.models.deepseek import FAMILY
from specjax.models.registry import config_from_dir

REL_TOL = 1e-4
VARIANTS = sorted(DEEPSEEK_VARIANTS)
PROMPT_LENGTHS = (7, 3, 5)


def relative_error(got, want) -> float:
    return float(np.max(np.abs(np.asarray(got) - np.asarray(want))) / np.max(np.abs(np.asarray(want))))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """variant -> (transformers model, saved checkpoint directory), built once."""
    made = {}

    def make(variant: str):
        if variant not in made:
            model = build_tiny_deepseek(variant)
            out = tmp_path_factory.mktemp(variant)
            model.save_pretrained(out, safe_serialization=True)
            made[variant] = model, out
        return made[variant]

    return make


def torch_logits(model, rows: list[list[int]]) -> list[np.ndarray]:
    with torch.no_grad():
        return [model(torch.tensor([row])).logits[0].numpy() for row in rows]


def stepped_logits(model, rows: list[list[int]], steps: tuple[int, ...]) -> list[np.ndarray]:
    """specjax logits of each row: a right-padded batched prefill of the first PROMPT_LENGTHS tokens, then the
    rest fed `steps` tokens at a time at each row's own position (decode T=1, verify T=4), over the cache."""
    B, total = len(rows), len(rows[0])
    prompt = np.zeros((B, max(PROMPT_LENGTHS)), np.int32)
    for b, n in enumerate(PROMPT_LENGTHS):
        prompt[b, :n] = rows[b][:n]
    cache = model.init_cache(B, total + max(steps))
    with jax.default_matmul_precision("highest"):
        _, scores, cache = jitted_forward(model, jnp.asarray(prompt), jnp.zeros((B,), jnp.int32), cache, fresh=True)
        logits = [[np.asarray(scores[b, :n])] for b, n in enumerate(PROMPT_LENGTHS)]
        position = np.asarray(PROMPT_LENGTHS)
        for T in steps:
            tokens = np.asarray([row[p:p + T] for row, p in zip(rows, position)], np.int32)
            _, scores, cache = jitted_forward(model, jnp.asarray(tokens), jnp.asarray(position, jnp.int32), cache)
            for b in range(B):
                logits[b].append(np.asarray(scores[b]))
            position = position + T
    return [np.concatenate(parts) for parts in logits]

@pytest.mark.parametrize("absorbed", [True, False], ids=["absorbed", "expanded"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_decode_and_verify_logits_match_transformers(checkpoints, variant, absorbed):
    hf_model, path = checkpoints(variant)
    cfg, params = read_checkpoint(path, dtype="float32")
    model = FAMILY.build(cfg, params, kernels=KernelPolicy(mla_absorbed=absorbed), unroll_layers=absorbed)
    steps = (1, 4, 1, 1)
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, cfg.vocab_size, n + sum(steps)).tolist() for n in PROMPT_LENGTHS]
    got = stepped_logits(model, rows, steps)
    want = torch_logits(hf_model, rows)
    for g, w, n in zip(got, want, PROMPT_LENGTHS):
        assert g.shape == w[:n + sum(steps)].shape
        assert relative_error(g, w) < REL_TOL
        assert (g.argmax(-1) == w.argmax(-1)).all()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, top_p=None, top_k=None,
                             temperature=None, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("absorbed", [True, False], ids=["absorbed", "expanded"])
@pytest.mark.parametrize("variant", ["v3", "v2_lite"])
def test_greedy_continuations_through_the_loop_equal_transformers(checkpoints, variant, absorbed):
    """64 greedy tokens for a batch of prompts of different lengths, through the engine's one while_loop."""
    hf_model, path = checkpoints(variant)
    cfg, params = read_checkpoint(path, dtype="float32")
    model = FAMILY.build(cfg, params, kernels=KernelPolicy(mla_absorbed=absorbed))
    graph, state = nnx.split(model)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in PROMPT_LENGTHS]
    tokens = np.zeros((3, 16), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = p
    generate = jit_generate(graph, NoProposer(), LoopSpec(k=0, n_top=0, max_model_len=128, greedy=True))
    out = generate(state, None, tokens, np.asarray(PROMPT_LENGTHS, np.int32), greedy_rows(3, [64] * 3, []), 96)
    for b, p in enumerate(prompts):
        got = np.asarray(out.tokens[b, len(p):len(p) + 64]).tolist()
        assert got == hf_greedy(hf_model, p, 64)


def test_llm_runs_a_deepseek_target_with_ngram_speculation(checkpoints, default_model_dir):
    """The facade: a DeepSeek-V3 directory loads like any model; speculation stays exact."""
    _, path = checkpoints("v3")
    prompts = [{"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6]}, {"prompt_token_ids": [40, 41]}]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(path), tokenizer=str(default_model_dir), max_model_len=64, max_num_seqs=2)
    spec = LLM(str(path), tokenizer=str(default_model_dir), max_model_len=64, max_num_seqs=2,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                   "prompt_lookup_max": 3})
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == want


# ----------------------------------------------------------------------------------------------------------- FP8

@pytest.fixture(scope="module")
def fp8_checkpoint(checkpoints, tmp_path_factory):
    """v3_wide (every quantized dim above 128, with edge blocks) as an FP8 copy with 128 x 128 blocks, and a
    float32 copy of the dequantized weights for transformers."""
    _, path = checkpoints("v3_wide")
    fp8 = write_fp8_copy(path, tmp_path_factory.mktemp("fp8"), block=(128, 128))
    dequantized = tmp_path_factory.mktemp("dequantized")
    tensors = load_file(fp8 / "model.safetensors")
    plain = {}
    for name, tensor in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        scale = tensors.get(name + "_scale_inv")
        plain[name] = tensor if scale is None else torch.from_numpy(dequantize_blocks_numpy(
            tensor.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn), scale.numpy(), (128, 128)))
    save_file(plain, dequantized / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((fp8 / "config.json").read_text())
    config.pop("quantization_config")
    (dequantized / "config.json").write_text(json.dumps(config))
    return fp8, dequantized


def test_fp8_weights_stay_fp8_on_the_device_and_match_transformers_on_the_dequantized_weights(fp8_checkpoint):
    fp8, dequantized = fp8_checkpoint
    cfg, params = read_checkpoint(fp8, dtype="float32")
    assert cfg.fp8_block == (128, 128)
    leaves = dict(jax.tree_util.tree_leaves_with_path(params))
    dtypes = {jax.tree_util.keystr(path): leaf.dtype for path, leaf in leaves.items()}
    for name in ("wqkv_a", "wq_b", "wo", "w_gate", "w_down", "we_gate", "we_up", "we_down", "ws_up"):
        found = [d for path, d in dtypes.items() if path.endswith(f"['{name}']")]
        assert found and all(d == jnp.float8_e4m3fn for d in found), name
    assert all(d == jnp.float32 for path, d in dtypes.items() if "_scale" in path or "router" in path)
    assert dtypes["['embed']"] == jnp.float32 and dtypes["['moe']['w_uk']"] == jnp.float32
    model = FAMILY.build(cfg, params, unroll_layers=False)
    hf_model = AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval()
    steps = (1, 4)
    rng = np.random.default_rng(2)
    rows = [rng.integers(0, cfg.vocab_size, n + sum(steps)).tolist() for n in PROMPT_LENGTHS]
    for got, want in zip(stepped_logits(model, rows, steps), torch_logits(hf_model, rows)):
        assert relative_error(got, want) < REL_TOL


# ------------------------------------------------------------------------------------------------------ bad input

def edited_copy(src, dst, config_changes=None, drop=(), rename=None):
    shutil.copytree(src, dst)
    if config_changes:
        config = json.loads((dst / "config.json").read_text())
        config.update(config_changes)
        (dst / "config.json").write_text(json.dumps(config))
    if drop or rename:
        tensors = load_file(dst / "model.safetensors")
        tensors = {(rename or {}).get(k, k): v for k, v in tensors.items() if k not in drop}
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("changes, match", [
    ({"topk_method": "aux_free"}, "topk_method 'aux_free' is not one of"),
    ({"scoring_func": "relu"}, "scoring_func 'relu' is not one of"),
    ({"n_group": 3}, "n_group=3 / topk_group=.* do not split n_routed_experts=8"),
    ({"moe_layer_freq": 2}, "moe_layer_freq=2 is not supported"),
    ({"kv_lora_rank": None}, "config.json has no 'kv_lora_rank'"),
    ({"quantization_config": {"quant_method": "awq"}}, "quantization_config .* is not supported"),
])
def test_configs_specjax_cannot_run_are_refused_naming_the_key(checkpoints, tmp_path, changes, match):
    _, path = checkpoints("v3")
    bad = edited_copy(path, tmp_path / "bad", changes)
    with pytest.raises(ValueError, match=match):
        config_from_dir(bad)


def test_a_missing_weight_scale_inv_is_named(fp8_checkpoint, tmp_path):
    fp8, _ = fp8_checkpoint
    victim = "model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"
    bad = edited_copy(fp8, tmp_path / "bad", drop=(victim,))
    with pytest.raises(ValueError, match=victim.replace(".", r"\.") + ".*missing"):
        read_checkpoint(bad)


def test_a_block_size_other_than_the_checkpoints_is_refused(fp8_checkpoint, tmp_path):
    fp8, _ = fp8_checkpoint
    config = json.loads((fp8 / "config.json").read_text())
    bad = edited_copy(fp8, tmp_path / "bad",
                      {"quantization_config": {**config["quantization_config"], "weight_block_size": [64, 64]}})
    with pytest.raises(ValueError, match=r"weight_scale_inv.*has shape .*expected"):
        read_checkpoint(bad)


@pytest.mark.parametrize("changes, match", [
    ({"n_routed_experts": 4, "n_group": 2, "topk_group": 1}, r"gate\.weight.*shape \(8, 64\), expected \(4, 64\)"),
    ({"n_routed_experts": 16}, r"gate\.weight.*shape \(8, 64\), expected \(16, 64\)"),
    # (with an MTP layer declared, layer 1's tensors would be that MTP layer: DeepSeek stores MTP layers there)
    ({"num_hidden_layers": 1, "first_k_dense_replace": 1, "num_nextn_predict_layers": 0},
     "tensor\\(s\\) config.json does not account for"),
])
def test_tensor_counts_that_do_not_match_the_config_are_refused(checkpoints, tmp_path, changes, match):
    _, path = checkpoints("v3")
    bad = edited_copy(path, tmp_path / "bad", changes)
    with pytest.raises(ValueError, match=match):
        read_checkpoint(bad)


def test_a_missing_expert_is_named(checkpoints, tmp_path):
    _, path = checkpoints("v3")
    victim = "model.layers.1.mlp.experts.5.down_proj.weight"
    with pytest.raises(ValueError, match=victim.replace(".", r"\.") + ".*missing"):
        read_checkpoint(edited_copy(path, tmp_path / "bad", drop=(victim,)))


def test_the_memory_check_counts_the_latent_cache(checkpoints, default_model_dir):
    """kv_lora_rank + qk_rope_head_dim values per token per layer, the same on every device; too little memory
    is refused naming what to lower."""
    _, path = checkpoints("v3")
    cfg, params = read_checkpoint(path)
    model = FAMILY.build(cfg, params)
    cache = model.init_cache(3, 40)
    assert cache.latent.shape == (cfg.num_layers, 3, 40, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    assert model.cache_bytes(3, 40) == cache.latent.nbytes == model.cache_bytes(3, 40, tensor_parallel_size=4)
    with pytest.raises(ValueError, match="KV cache needs .* Lower max_model_len"):
        LLM(str(path), tokenizer=str(default_model_dir), max_model_len=256, max_num_seqs=64,
            gpu_memory_utilization=1e-6)
