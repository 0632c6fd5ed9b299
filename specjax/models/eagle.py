"""EAGLE draft heads as Flax NNX modules: small decoders that read the target's hidden states.

EAGLE-1: x = fc([embed(token); target final hidden]); decoder layer(s), the first without an input norm;
  no final norm; the target's lm_head gives the logits (the head predicts the target's next feature).
EAGLE-3: the residual streams entering three target layers are concatenated and projected by `fc` to one
  hidden state h; the first layer attends over [norm(embed(token)); norm(h)] (q/k/v read 2H features) with h
  (or its norm, `norm_before_residual`) as the residual; a final norm; an lm_head over a reduced draft
  vocabulary whose ids map to target ids through `draft_to_target` (d2t offsets resolved at load time).

At position p a head reads the token at p+1 with the hidden state at p and predicts the token at p+2.
Drafting feeds the head its own hidden state back: the EAGLE-3 pre-norm output, the EAGLE-1 output.
Layer maths is shared by inference (a KV cache, `__call__`) and training (`decode` with another attention).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Literal, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.kernels.attention import attention
from specjax.kernels.projection import projection
from specjax.models.kv_cache import KVCache, write_layer
from specjax.models.layers import apply_rope, qkv_projection, rms_norm, rope_inv_freq, swiglu_mlp
from specjax.models.model_config import ModelConfig

Method = Literal["eagle", "eagle3"]
# Where the lm_head comes from: the head's own [H, Vd]; the target's untied [H, V]; a tied target's
# embedding [V, H] (read transposed, so sharing it costs no copy).
LmHeadSource = Literal["head", "target", "target_embed"]
# attend(layer_index, q [B,T,Hq,D], k [B,T,Hkv,D], v [B,T,Hkv,D]) -> [B,T,Hq,D]; q and k already rotated.
Attend = Callable[[int, jax.Array, jax.Array, jax.Array], jax.Array]


class Frozen(nnx.Variable):
    """Weights a head uses but never trains: the (shared) embedding and lm_head, the vocabulary map."""


@dataclasses.dataclass(frozen=True)
class EagleConfig:
    method: Method
    layers: ModelConfig              # the head's decoder hyper-parameters; vocab_size = the target's
    target_hidden_size: int          # width of each target hidden state the head reads
    draft_vocab_size: int            # lm_head rows; < vocab_size when reduced (EAGLE-3 d2t)
    aux_layer_ids: tuple[int, ...]   # EAGLE-3: target layers whose entering residual stream fc reads
    norm_before_residual: bool = False
    fc_bias: bool = False
    lm_head_source: LmHeadSource = "head"

    @property
    def hidden_size(self) -> int:
        return self.layers.hidden_size

    @property
    def reduced_vocab(self) -> bool:
        return self.draft_vocab_size != self.layers.vocab_size

    @property
    def fc_in_features(self) -> int:
        if self.method == "eagle3":
            return len(self.aux_layer_ids) * self.target_hidden_size
        return 2 * self.hidden_size


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """vLLM's EAGLE-3 default: the residual stream entering layers 2, L // 2 and L - 3."""
    return (2, num_target_layers // 2, num_target_layers - 3)


def _init(rngs: nnx.Rngs, shape: Sequence[int], dtype) -> nnx.Param:
    return nnx.Param((0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype))


def _ones(shape: Sequence[int], dtype) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, dtype))


class HeadLayer(nnx.Module):
    """One Llama decoder layer whose q/k/v read `in_features` (2H for EAGLE-3's first layer)."""

    def __init__(self, cfg: ModelConfig, in_features: int, *, input_norm: bool, hidden_norm: bool, dtype,
                 rngs: nnx.Rngs):
        H, I = cfg.hidden_size, cfg.intermediate_size
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        if input_norm:
            self.attn_norm = _ones((H,), dtype)
        if hidden_norm:
            self.hidden_norm = _ones((H,), dtype)
        self.w_qkv = _init(rngs, (in_features, q + 2 * kv), dtype)
        if cfg.attention_bias:
            self.b_qkv = _init(rngs, (q + 2 * kv,), dtype)
        self.wo = _init(rngs, (q, H), dtype)
        self.mlp_norm = _ones((H,), dtype)
        self.w_gate_up, self.w_down = _init(rngs, (H, 2 * I), dtype), _init(rngs, (I, H), dtype)


class EagleHead(nnx.Module):
    def __init__(self, cfg: EagleConfig, *, dtype=jnp.float32, rngs: nnx.Rngs, attention_impl: str = "auto"):
        self.cfg = cfg
        self.attention_impl = attention_impl
        layers_cfg, H, V = cfg.layers, cfg.hidden_size, cfg.layers.vocab_size
        eagle3 = cfg.method == "eagle3"
        self.fc = _init(rngs, (cfg.fc_in_features, H), dtype)
        if cfg.fc_bias:
            self.fc_bias = nnx.Param(jnp.zeros((H,), dtype))
        self.embed = Frozen(_init(rngs, (V, H), dtype)[...])
        self.layers = nnx.List([
            HeadLayer(layers_cfg, 2 * H if eagle3 and i == 0 else H, input_norm=eagle3 or i > 0,
                      hidden_norm=eagle3 and i == 0, dtype=dtype, rngs=rngs)
            for i in range(layers_cfg.num_layers)])
        if eagle3:
            self.norm = _ones((H,), dtype)
        if cfg.lm_head_source == "head":
            self.lm_head = _init(rngs, (H, cfg.draft_vocab_size), dtype)
        else:
            shape = (H, V) if cfg.lm_head_source == "target" else (V, H)
            self.lm_head = Frozen(jnp.zeros(shape, dtype))
        if cfg.reduced_vocab:
            self.draft_to_target = Frozen(jnp.arange(cfg.draft_vocab_size, dtype=jnp.int32))

    def combine(self, target_hidden: jax.Array) -> jax.Array:
        """The target's features -> the head's input hidden state [..., H]: EAGLE-3 projects the captured
        layers with fc; EAGLE-1 reads the target's final hidden state as is."""
        if self.cfg.method == "eagle":
            return target_hidden
        return self._fc(target_hidden)

    def __call__(self, tokens: jax.Array, hidden: jax.Array, start: jax.Array,
                 cache: KVCache) -> tuple[jax.Array, jax.Array, KVCache]:
        """Run T tokens per row [B, T] with hidden states [B, T, H] at positions start[b] + t, writing the
        head's KV cache. Returns (output for the logits, hidden state to feed back, cache)."""
        T = tokens.shape[1]
        positions = start[:, None] + jnp.arange(T, dtype=start.dtype)[None, :]
        k_cache, v_cache = cache.k, cache.v
        scale = self.cfg.layers.head_dim ** -0.5

        def attend(i, q, k, v):
            nonlocal k_cache, v_cache
            k_cache, v_cache = write_layer(k_cache, i, k, start), write_layer(v_cache, i, v, start)
            return attention(q, k_cache, v_cache, jnp.int32(i), start, scale=scale, impl=self.attention_impl)

        out, feed = self.decode(tokens, hidden, positions, attend)
        return out, feed, KVCache(k_cache, v_cache)

    def decode(self, tokens: jax.Array, hidden: jax.Array, positions: jax.Array,
               attend: Attend) -> tuple[jax.Array, jax.Array]:
        """The layers' maths with the attention supplied by the caller (a KV cache, or training's mask)."""
        cfg = self.cfg
        embeds = self.embed[...][tokens]
        if cfg.method == "eagle":
            h = self._fc(jnp.concatenate([embeds, hidden], axis=-1))
            x, residual = h, h   # the first EAGLE-1 layer has no input norm
        else:
            x, residual = self._eagle3_first_input(self.layers[0], embeds, hidden)
        inv_freq = rope_inv_freq(cfg.layers.head_dim, cfg.layers.rope_theta, cfg.layers.rope_scaling)
        for i, layer in enumerate(self.layers):
            if i > 0:
                residual = h
                x = rms_norm(h, layer.attn_norm[...], cfg.layers.rms_norm_eps)
            h = self._layer(layer, i, x, residual, positions, inv_freq, attend)
        if cfg.method == "eagle":
            return h, h
        return rms_norm(h, self.norm[...], cfg.layers.rms_norm_eps), h

    def logits(self, out: jax.Array) -> jax.Array:
        """fp32 logits [..., draft_vocab_size] over the head's (possibly reduced) vocabulary."""
        head = self.lm_head[...]
        if self.cfg.lm_head_source == "target_embed":
            return jnp.einsum("...h,vh->...v", out, head, preferred_element_type=jnp.float32)
        return jnp.dot(out, head, preferred_element_type=jnp.float32)

    def to_target_ids(self, draft_ids: jax.Array) -> jax.Array:
        if not self.cfg.reduced_vocab:
            return draft_ids
        return self.draft_to_target[...][draft_ids]

    def target_logits(self, out: jax.Array) -> jax.Array:
        """Logits over the target's vocabulary [..., V]: tokens outside the draft vocabulary get -inf."""
        logits = self.logits(out)
        if not self.cfg.reduced_vocab:
            return logits
        full = jnp.full(logits.shape[:-1] + (self.cfg.layers.vocab_size,), -jnp.inf, logits.dtype)
        return full.at[..., self.draft_to_target[...]].set(logits)

    def _fc(self, x: jax.Array) -> jax.Array:
        y = x @ self.fc[...]
        return y + self.fc_bias[...] if self.cfg.fc_bias else y

    def _eagle3_first_input(self, layer: HeadLayer, embeds: jax.Array,
                            hidden: jax.Array) -> tuple[jax.Array, jax.Array]:
        eps = self.cfg.layers.rms_norm_eps
        normed_hidden = rms_norm(hidden, layer.hidden_norm[...], eps)
        residual = normed_hidden if self.cfg.norm_before_residual else hidden
        x = jnp.concatenate([rms_norm(embeds, layer.attn_norm[...], eps), normed_hidden], axis=-1)
        return x, residual

    def _layer(self, layer: HeadLayer, index: int, x: jax.Array, residual: jax.Array, positions: jax.Array,
               inv_freq, attend: Attend) -> jax.Array:
        cfg = self.cfg.layers
        B, T = positions.shape
        bias = layer.b_qkv[...] if cfg.attention_bias else None
        q, k, v = qkv_projection(x, layer.w_qkv[...], bias, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                 impl=self.attention_impl)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        h = projection(attend(index, q, k, v).reshape(B, T, -1), layer.wo[...], residual=residual,
                       impl=self.attention_impl)
        return swiglu_mlp(h, layer.w_gate_up[...], layer.w_down[...], norm=layer.mlp_norm[...],
                          eps=cfg.rms_norm_eps, residual=h, impl=self.attention_impl)

