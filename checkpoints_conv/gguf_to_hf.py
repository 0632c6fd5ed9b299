"""GGUF file (llama.cpp) -> HF directory: config.json, model.safetensors, tokenizer files.

Weights are dequantized with the `gguf` package. llama.cpp's converter permutes the rows of q_proj and k_proj
of `llama` models (its RoPE pairs adjacent dims, HF's rotate-half pairs dims i and i + D/2); we undo that
permutation, as transformers' GGUF loader does. The tokenizer is rebuilt by transformers' GGUF tokenizer
conversion and saved in the fast-tokenizer format.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

if TYPE_CHECKING:  # `gguf` is imported only when converting, so loading models works without it
    from gguf import GGUFReader

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
PERMUTED_QK_ARCHS = ("llama",)   # llama.cpp interleaves q/k rows only where the model uses GPT-J style RoPE
OUTPUT_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
                 "float16": np.dtype(np.float16)}
VOCABULARY_FIELDS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                     "tokenizer.ggml.scores")
SPECIAL_TOKEN_FIELDS = {"bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
                        "unk_token": "tokenizer.ggml.unknown_token_id", "pad_token": "tokenizer.ggml.padding_token_id"}
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def convert_gguf_to_hf(gguf_path: str | Path, out_dir: str | Path, *, dtype: str = "float32") -> Path:
    """Write an HF directory for a Llama/Qwen2/Qwen3 GGUF file; the directory appears atomically."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if dtype not in OUTPUT_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {', '.join(OUTPUT_DTYPES)}")
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists; remove it or choose another output directory")
    reader = _open_reader(gguf_path)
    meta = _metadata(reader)
    config = hf_config(meta, {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}, dtype)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        save_file(hf_state_dict(reader, config, OUTPUT_DTYPES[dtype]), str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(_generation_config(config), indent=2) + "\n")
        save_tokenizer(reader, meta, tmp)
        tmp.chmod(0o755)   # mkdtemp makes it private
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _open_reader(gguf_path: Path) -> GGUFReader:
    from gguf import GGUFReader

    try:
        return GGUFReader(gguf_path)
    except (ValueError, OSError, KeyError, IndexError) as err:
        raise ValueError(f"{gguf_path} is not a readable GGUF file ({err}); it may be truncated — "
                         "download it again") from err


def _metadata(reader: GGUFReader) -> dict[str, Any]:
    """Metadata without the vocabulary arrays (tens of thousands of entries, read by the tokenizer step)."""
    return {name: field.contents() for name, field in reader.fields.items() if name not in VOCABULARY_FIELDS}


def hf_config(meta: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]], dtype: str) -> dict[str, Any]:
    """config.json contents from GGUF metadata and tensor shapes (GGUF dim order), in the classic form every
    transformers version reads."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    if "rope_freqs.weight" in tensor_shapes:
        raise ValueError("this GGUF stores llama3-style RoPE frequency factors (rope_freqs.weight), which the "
                         "converter does not map back to rope_scaling; use the model's HF safetensors instead")

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    heads, hidden = get("attention.head_count"), get("embedding_length")
    config = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        # token_embd is [H, V] in GGUF dim order; some files omit {arch}.vocab_size.
        "vocab_size": get("vocab_size") or tensor_shapes["token_embd.weight"][1],
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length") or get("rope.dimension_count") or hidden // heads,
        "hidden_act": "silu",
        "max_position_embeddings": get("context_length"),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "rope_theta": get("rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(get),
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
        "attention_bias": "blk.0.attn_q.bias" in tensor_shapes,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": dtype,
    }
    missing = [key for key, value in config.items() if value is None and not key.endswith("_token_id")
               and key != "rope_scaling"]
    if missing:
        raise ValueError(f"GGUF metadata lacks the fields for {missing} (arch {arch!r}); the file is incomplete")
    return config


def _rope_scaling(get) -> dict | None:
    kind = get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "linear":
        raise ValueError(f"GGUF rope scaling type {kind!r} is not supported by the converter (only 'linear')")
    return {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    return {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")
            if config[key] is not None}


def hf_state_dict(reader: GGUFReader, config: dict[str, Any], dtype: np.dtype) -> dict[str, np.ndarray]:
    """HF tensor name -> dequantized weight in HF layout ([out, in] for Linear weights), cast to dtype."""
    state = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        weights = _dequantize(tensor)
        if config["model_type"] in PERMUTED_QK_ARCHS and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            weights = unpermute_rope_rows(weights, heads)
        state[name] = np.ascontiguousarray(weights.astype(dtype))
    return state


def hf_tensor_name(gguf_name: str) -> str:
    """"blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight" (and the global tensors)."""
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in BLOCK_TENSORS:
        return f"model.layers.{parts[1]}.{BLOCK_TENSORS[parts[2]]}.{suffix}"
    if base in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[base]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no HF counterpart in the Llama family; the file's "
                     "architecture is not supported by the converter")


def _dequantize(tensor) -> np.ndarray:
    """Float32 weights with numpy shape = GGUF dims reversed (HF's [out, in] for matrices)."""
    from gguf.quants import dequantize

    try:
        weights = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as err:
        raise ValueError(f"GGUF tensor {tensor.name!r} uses quantization type {tensor.tensor_type.name}, which "
                         f"the gguf package cannot dequantize ({err}); re-quantize the model with a supported "
                         "type (e.g. Q8_0, Q4_K_M, F16)") from err
    return weights.reshape(tuple(reversed([int(d) for d in tensor.shape]))).astype(np.float32, copy=False)


def unpermute_rope_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's per-head row interleave: rows (h, i, j) of [heads, 2, D/2] came from (h, j, i)."""
    rows = weights.shape[0]
    w = weights.reshape(num_heads, rows // num_heads // 2, 2, *weights.shape[1:])
    return w.swapaxes(1, 2).reshape(weights.shape)


def save_tokenizer(reader: GGUFReader, meta: dict[str, Any], out_dir: Path) -> None:
    """Rebuild the fast tokenizer from the GGUF vocabulary with transformers' GGUF tokenizer builders, fed the
    metadata read here (transformers' own GGUF reader needs torch, which loading a model does not), and
    store the chat template."""
    from transformers import PreTrainedTokenizerFast
    try:
        from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    except ImportError:   # transformers before 5.25 kept them in integrations.ggml
        from transformers.integrations.ggml import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    fields = {**meta, **{name: reader.fields[name].contents() for name in VOCABULARY_FIELDS if name in reader.fields}}
    tokenizer_dict = {ours: fields[f"tokenizer.{key}"] for key, ours in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
                      if f"tokenizer.{key}" in fields}
    backend, extra = convert_gguf_tokenizer(meta["general.architecture"], tokenizer_dict)
    specials = {name: tokenizer_dict["tokens"][fields[key]] for name, key in SPECIAL_TOKEN_FIELDS.items()
                if key in fields}
    PreTrainedTokenizerFast(tokenizer_object=backend, **{**extra, **specials}).save_pretrained(out_dir)
    config_file = out_dir / "tokenizer_config.json"
    tok_config = json.loads(config_file.read_text())
    for key in ("is_local", "local_files_only", "name_or_path"):
        tok_config.pop(key, None)
    # A class name every transformers version resolves (transformers 5 writes its own "TokenizersBackend").
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    arch = meta["general.architecture"]
    tok_config["model_max_length"] = meta.get(f"{arch}.context_length", tok_config.get("model_max_length"))
    for flag in ("add_bos_token", "add_eos_token"):
        if f"tokenizer.ggml.{flag}" in meta:
            tok_config[flag] = bool(meta[f"tokenizer.ggml.{flag}"])
    if "tokenizer.chat_template" in meta:
        tok_config["chat_template"] = meta["tokenizer.chat_template"]
    config_file.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")
