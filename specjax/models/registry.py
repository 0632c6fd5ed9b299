"""HF `architectures` -> the Flax module that implements it."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.models.llama import LlamaForCausalLM, default_unroll, unstack_layers
from specjax.models.model_config import ModelConfig

ARCHITECTURES: dict[str, type[nnx.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def model_class(cfg: ModelConfig) -> type[nnx.Module]:
    if cfg.architecture not in ARCHITECTURES:
        raise ValueError(f"architecture {cfg.architecture!r} is not supported; supported: "
                         f"{', '.join(sorted(ARCHITECTURES))}")
    return ARCHITECTURES[cfg.architecture]


def build_model(cfg: ModelConfig, params: dict, *, attention_impl: str = "auto",
                unroll_layers: bool | None = None) -> nnx.Module:
    """A module of cfg's architecture holding `params`, a checkpoint's nested dict (stacked layer leaves),
    which this consumes when the layers are unrolled (None: unrolled on GPUs; see models/llama.py)."""
    dtype = jax.tree_util.tree_leaves(params)[0].dtype
    cls = model_class(cfg)
    unroll = default_unroll() if unroll_layers is None else unroll_layers
    model = nnx.eval_shape(lambda: cls(cfg, dtype=dtype, rngs=nnx.Rngs(0), attention_impl=attention_impl,
                                       unroll_layers=unroll))
    nnx.update(model, unstack_layers(params, cfg.num_layers) if unroll else params)
    return model


def random_model(cfg: ModelConfig, *, dtype=jnp.float32, seed: int = 0, attention_impl: str = "auto",
                 unroll_layers: bool | None = None) -> nnx.Module:
    """Random weights (normal * 0.02), for speed benchmarks and tests."""
    return model_class(cfg)(cfg, dtype=dtype, rngs=nnx.Rngs(seed), attention_impl=attention_impl,
                            unroll_layers=unroll_layers)
