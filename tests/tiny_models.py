"""Tiny random checkpoints an `LLM` can load: a TINY_FAMILIES variant with the default model's tokenizer (and so,
where text prompts or chat are needed, its vocabulary size), built in seconds."""
from __future__ import annotations

import shutil
from pathlib import Path

from conftest import TINY_COMMON, TINY_FAMILIES, copy_tokenizer

DEFAULT_VOCAB = 49152   # SmolLM2's: text prompts tokenize within it


def tiny_llm_dir(out: Path, default_model_dir: Path, family: str = "llama", *, seed: int = 0,
                 **config) -> Path:
    """A random fp32 checkpoint of `family` in `out` (TINY_COMMON, its TINY_FAMILIES fields, then `config`),
    with the default model's tokenizer files beside it."""
    import torch
    import transformers

    config_cls, extra = TINY_FAMILIES[family]
    hf_config = getattr(transformers, config_cls)(**{**TINY_COMMON, **extra, **config})
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).save_pretrained(out)
    return _add_tokenizer(out, default_model_dir)


def with_tokenizer(model_dir: Path, out: Path, default_model_dir: Path) -> Path:
    """A copy of the checkpoint in `model_dir` (e.g. tiny_checkpoint_factory's) at `out`, the default model's
    tokenizer files beside it."""
    shutil.copytree(model_dir, out)
    return _add_tokenizer(out, default_model_dir)


def _add_tokenizer(out: Path, default_model_dir: Path) -> Path:
    return copy_tokenizer(default_model_dir, out)
