"""The architecture hyper-parameters of a Llama-family model, read from an HF config.json."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        archs = d.get("architectures") or [d.get("model_type", "unknown")]
        arch = archs[0]
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        rope_scaling = d.get("rope_scaling") or _rope_parameters_scaling(d.get("rope_parameters"))
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(d),
            rope_scaling=rope_scaling,
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            # Qwen2 always has q/k/v biases; Llama/Mistral only when `attention_bias` says so.
            attention_bias=d.get("attention_bias", arch.startswith("Qwen2")),
            qk_norm=arch.startswith("Qwen3"),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(
                f"{config_file} does not exist: a model directory needs an HF config.json "
                "(convert a GGUF with `python -m checkpoints_conv gguf-to-hf`).")
        return cls.from_hf_dict(json.loads(config_file.read_text()))


def _rope_theta(d: dict[str, Any]) -> float:
    params = d.get("rope_parameters") or {}
    return float(d.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_parameters_scaling(params: dict | None) -> dict | None:
    """transformers >= 5 writes `rope_parameters`; a `default` rope type means no scaling."""
    if not params or params.get("rope_type", "default") == "default":
        return None
    return dict(params)
