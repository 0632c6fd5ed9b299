"""HF `architectures` -> the model family that implements it, and a model directory's config.json -> its
family and config, with errors that name the file."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from specjax.models import deepseek, llama
from specjax.models.family import ModelConfig, ModelFamily

FAMILIES: tuple[ModelFamily, ...] = (llama.FAMILY, deepseek.FAMILY)
ARCHITECTURES: dict[str, ModelFamily] = {arch: family for family in FAMILIES for arch in family.architectures}
# config.json files without `architectures` (hand-written or old exports) are known by their model_type.
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "mimo": "MiMoForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
               "deepseek_v3": "DeepseekV3ForCausalLM"}


def architecture_of(d: Mapping[str, Any]) -> str:
    """The HF architecture a config.json describes: its first `architectures` entry, else the one its
    model_type stands for."""
    archs = d.get("architectures")
    if archs:
        return str(archs[0])
    model_type = d.get("model_type")
    if model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    raise ValueError(f"config.json names no `architectures` and its model_type {model_type!r} is not one specjax "
                     f"knows ({', '.join(MODEL_TYPES)}): add \"architectures\": [\"<e.g. LlamaForCausalLM>\"]; "
                     f"supported architectures: {', '.join(sorted(ARCHITECTURES))}")


def family_of(d: Mapping[str, Any]) -> ModelFamily:
    arch = architecture_of(d)
    if arch not in ARCHITECTURES:
        raise ValueError(f"architecture {arch!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}")
    return ARCHITECTURES[arch]


def config_from_hf(d: Mapping[str, Any]) -> tuple[ModelFamily, ModelConfig]:
    """(family, config) of a config.json dict; `architectures` filled from model_type where it is missing."""
    family = family_of(d)
    return family, family.config_from_hf({**d, "architectures": [architecture_of(d)]})


def read_config_json(path: str | Path) -> dict[str, Any]:
    """A model directory's config.json as a dict, or an error that names the file and what is wrong."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} does not exist: a model directory needs an HF config.json "
                                "(convert a GGUF with `python -m checkpoints_conv gguf-to-hf`)")
    try:
        d = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_file} is not valid JSON ({err}); re-download or fix it") from err
    if not isinstance(d, dict):
        raise ValueError(f"{config_file} holds a JSON {type(d).__name__}, not an object of config keys")
    return d


def config_from_dir(path: str | Path) -> tuple[ModelFamily, ModelConfig]:
    return config_from_hf(read_config_json(path))
