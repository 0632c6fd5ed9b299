"""The Llama-family causal LM (Llama 2/3/3.x, Mistral, Qwen2/2.5, Qwen3, SmolLM2) as a Flax NNX module.

Two layouts of the decoder layers' weights, one layer function for both: stacked on a leading layer axis
and run with one `lax.scan` (compile time flat in depth; the default off GPUs), or one weight set per layer
run unrolled (the GPU default: a matmul reads its own weight buffer, where slicing a stacked leaf inside the
generate while_loop made XLA copy every layer's weights every step). Checkpoints hold the stacked layout;
`unstack_layers` turns it into the per-layer one. Each forward pass writes the K/V of its T tokens into the
cache and attends over it.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.kernels.attention import attention
from specjax.kernels.prefill_attention import prefill_attention
from specjax.kernels.projection import projection
from specjax.models.kv_cache import KVCache, write_layer
from specjax.models.layers import apply_rope, qkv_projection, rms_norm, rope_inv_freq, swiglu_mlp
from specjax.models.model_config import ModelConfig
from specjax.parallel import pin_heads


def _init(rngs: nnx.Rngs, shape: Sequence[int], dtype) -> nnx.Param:
    return nnx.Param((0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype))


def _ones(shape: Sequence[int], dtype) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, dtype))


class DecoderWeights(nnx.Module):
    """Decoder layer weights, matrices stored [in, out], q/k/v and gate/up fused
    (checkpoints_conv.fused_columns).
    `lead=(L,)` stacks every leaf over L layers on axis 0; `lead=()` holds one layer."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, lead: tuple[int, ...] = ()):
        H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        q, kv = cfg.num_heads * D, cfg.num_kv_heads * D

        def init(*shape):
            return _init(rngs, lead + shape, dtype)

        def ones(*shape):
            return _ones(lead + shape, dtype)

        self.attn_norm, self.mlp_norm = ones(H), ones(H)
        self.w_qkv, self.wo = init(H, q + 2 * kv), init(q, H)
        if cfg.attention_bias:
            self.b_qkv = init(q + 2 * kv)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = ones(D), ones(D)
        self.w_gate_up, self.w_down = init(H, 2 * I), init(I, H)

    def arrays(self) -> dict[str, jax.Array]:
        return {name: var[...] for name, var in vars(self).items() if isinstance(var, nnx.Param)}


def unstack_layers(params: dict, num_layers: int) -> dict:
    """A checkpoint's param tree (stacked layer leaves) in the per-layer layout: {"layers": {i: {...}}}.
    Consumes `params`: each stacked leaf is dropped from it once split, so the device holds at most one
    leaf twice."""
    stacked = params.pop("layers")
    layers: dict[int, dict[str, jax.Array]] = {i: {} for i in range(num_layers)}
    for name in list(stacked):
        leaf = stacked.pop(name)
        for i in range(num_layers):
            layers[i][name] = leaf[i]
        del leaf
    return {**params, "layers": layers}


def stack_layers(params: dict) -> dict:
    """The per-layer param tree stacked back into the checkpoint layout (a copy of the layer weights)."""
    layers = params["layers"]
    names = layers[0].keys()
    return {**params, "layers": {name: jnp.stack([layers[i][name] for i in range(len(layers))]) for name in names}}


def default_unroll() -> bool:
    """Unrolled per-layer weights on GPUs, stacked and scanned elsewhere (CPU compile time stays flat)."""
    return jax.default_backend() == "gpu"


@dataclasses.dataclass(frozen=True)
class ForwardAux:
    """Extra outputs: the residual stream entering each requested layer, concatenated on the last axis."""
    captured: jax.Array | None


class LlamaForCausalLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs, attention_impl: str = "auto",
                 unroll_layers: bool | None = None):
        self.cfg = cfg
        self.attention_impl = attention_impl
        self.unroll_layers = default_unroll() if unroll_layers is None else unroll_layers
        self.embed = _init(rngs, (cfg.vocab_size, cfg.hidden_size), dtype)
        if self.unroll_layers:
            self.layers = nnx.List([DecoderWeights(cfg, dtype, rngs) for _ in range(cfg.num_layers)])
        else:
            self.layers = DecoderWeights(cfg, dtype, rngs, lead=(cfg.num_layers,))
        self.final_norm = _ones((cfg.hidden_size,), dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = _init(rngs, (cfg.hidden_size, cfg.vocab_size), dtype)

    def __call__(self, tokens: jax.Array, start: jax.Array, cache: KVCache,
                 capture_layers: tuple[int, ...] = (), fresh: bool = False) -> tuple[jax.Array, KVCache, ForwardAux]:
        """Run T tokens per row [B, T] at positions start[b] .. start[b]+T-1.

        Returns the final-normed hidden states [B, T, H], the cache with these tokens' K/V written, and the
        residual stream entering each layer of `capture_layers` (EAGLE-3 reads those). fresh (static): this is
        a prompt's prefill (start is all zeros, the cache holds nothing yet), so attention may skip the cache.
        """
        T = tokens.shape[1]
        positions = start[:, None] + jnp.arange(T, dtype=start.dtype)[None, :]
        h = self.embed[...][tokens]
        layer_fn = self._layer_fn(positions, start, fresh)
        carry = (h, cache.k, cache.v)
        if self.unroll_layers:
            entering = []
            for i, weights in enumerate(self.layers):
                carry, h_in = layer_fn(carry, (weights.arrays(), i))
                entering.append(h_in)
        else:
            layer_ids = jnp.arange(self.cfg.num_layers, dtype=jnp.int32)
            carry, entering = jax.lax.scan(layer_fn, carry, (self.layers.arrays(), layer_ids))
        h, k, v = carry
        captured = None
        if capture_layers:
            captured = jnp.concatenate([entering[i] for i in capture_layers], axis=-1)
        hidden = rms_norm(h, self.final_norm[...], self.cfg.rms_norm_eps)
        return hidden, KVCache(k, v), ForwardAux(captured)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Vocabulary logits in fp32 for final-normed hidden states [..., H]."""
        head = self.embed[...].T if self.cfg.tie_word_embeddings else self.lm_head[...]
        return jnp.dot(hidden, head, preferred_element_type=jnp.float32)

    def _layer_fn(self, positions: jax.Array, start: jax.Array, fresh: bool):
        cfg, impl = self.cfg, self.attention_impl
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        B, T = positions.shape

        def layer(carry, xs):
            h, k_cache, v_cache = carry
            w, i = xs
            q, k, v = pin_heads(*qkv_projection(h, w["w_qkv"], w.get("b_qkv"), cfg.num_heads, cfg.num_kv_heads,
                                                cfg.head_dim, norm=w["attn_norm"], eps=cfg.rms_norm_eps, impl=impl))
            if cfg.qk_norm:
                q, k = rms_norm(q, w["q_norm"], cfg.rms_norm_eps), rms_norm(k, w["k_norm"], cfg.rms_norm_eps)
            q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
            k_cache, v_cache = write_layer(k_cache, i, k, start), write_layer(v_cache, i, v, start)
            scale = cfg.head_dim ** -0.5
            if fresh:
                o = prefill_attention(q, k, v, k_cache, v_cache, i, scale=scale, impl=impl)
            else:
                o = attention(q, k_cache, v_cache, i, start, scale=scale, impl=impl)
            h_attn = projection(o.reshape(B, T, -1), w["wo"], residual=h, impl=impl)
            out = swiglu_mlp(h_attn, w["w_gate_up"], w["w_down"], norm=w["mlp_norm"], eps=cfg.rms_norm_eps,
                             residual=h_attn, impl=impl)
            return (out, k_cache, v_cache), h

        return layer
