"""EAGLE draft heads as Flax NNX modules: small decoders that read the target's hidden states. This module owns
their config (every published layout's config.json), their weight map (in canonical tensor names) and their
forward pass, built from the Llama family's decoder layer.

EAGLE-1: x = fc([embed(token); target final hidden]); decoder layer(s), the first without an input norm;
  no final norm; the target's lm_head gives the logits (the head predicts the target's next feature).
EAGLE-3: the residual streams entering three target layers are concatenated and projected by `fc` to one
  hidden state h; the first layer attends over [norm(embed(token)); norm(h)] (q/k/v read 2H features) with h
  (or its norm, `norm_before_residual`) as the residual; a final norm; an lm_head over a reduced draft
  vocabulary whose ids map to target ids through `draft_to_target` (d2t offsets resolved at load time).

At position p a head reads the token at p+1 with the hidden state at p and predicts the token at p+2.
Drafting feeds the head its own hidden state back: the EAGLE-3 pre-norm output, the EAGLE-1 output.
Layer maths is shared by inference (a KV cache, `__call__`) and training (`decode` with another attention).

Published layouts (tensor names as in vLLM's llama_eagle.py / llama_eagle3.py loaders; checkpoints_conv's
eagle_loader reads them into the canonical names of `head_weight_map`):
- yuhuili EAGLE-1 (e.g. EAGLE-LLaMA3.1-Instruct-8B): a Llama config.json with num_hidden_layers=1;
  fc.weight [H, 2H] (fc.bias when trained with one), layers.{i}.*, no input norm on layer 0, maybe embed_tokens.
- yuhuili / SpecForge EAGLE-3 (architectures LlamaForCausalLMEagle3): midlayer.* (= layers.0.*, with
  hidden_norm), fc.weight [H, 3*Ht], norm.weight, lm_head.weight [Vd, H], d2t [Vd] (target id - draft id),
  t2d [V] (unused); config draft_vocab_size, optionally target_hidden_size and
  eagle_config.eagle_aux_hidden_state_layer_ids.
- speculators EAGLE-3 (e.g. RedHatAI): config with speculators_model_type "eagle3",
  transformer_layer_config (the layer's Llama config), draft_vocab_size, norm_before_residual (vLLM's default
  when absent: true), target_hidden_size, eagle_aux_hidden_state_layer_ids; tensors layers.0.*, fc, norm,
  lm_head, d2t, t2d, embed_tokens.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.config.speculative import method_from_head_config
from specjax.kernels.attention import attention
from specjax.kernels.policy import KernelPolicy
from specjax.kernels.tree_mask import TreeMask
from specjax.models.family import Frozen
from specjax.models.kv_cache import KVCache, write_layer
from specjax.models.layers import LayerAttend, decoder_layer, rms_norm
from specjax.models.random_init import normal_param, ones_param
from specjax.models.rope import rotary
from specjax.models.llama import LlamaConfig
from specjax.models.weight_map import LeafSpec, fused

Method = Literal["eagle", "eagle3"]
EAGLE_METHODS = ("eagle", "eagle3")
# Where the lm_head comes from: the head's own [H, Vd]; the target's untied [H, V]; a tied target's
# embedding [V, H] (read transposed, so sharing it costs no copy).
LmHeadSource = Literal["head", "target", "target_embed"]


@dataclasses.dataclass(frozen=True)
class EagleConfig:
    method: Method
    layers: LlamaConfig              # the head's decoder hyper-parameters; vocab_size = the target's
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
    def vocab_size(self) -> int:
        """The target's vocabulary (the head's draft vocabulary may be a subset)."""
        return self.layers.vocab_size

    @property
    def reduced_vocab(self) -> bool:
        return self.draft_vocab_size != self.layers.vocab_size

    @property
    def fc_in_features(self) -> int:
        if self.method == "eagle3":
            return len(self.aux_layer_ids) * self.target_hidden_size
        return 2 * self.hidden_size

    @classmethod
    def from_hf(cls, d: Mapping[str, Any], method: str, target: Any, *, lm_head_source: LmHeadSource = "head",
                fc_bias: bool = False) -> EagleConfig:
        """Parse a head's config.json (any published layout) and check it fits the target's config."""
        declared = method_from_head_config(d)
        if declared is not None and declared != method:
            raise ValueError(f"the head's config.json describes a {declared!r} head but speculative_config method "
                             f"is {method!r}; set method to {declared!r} (or leave it unset to infer it)")
        if method not in EAGLE_METHODS:
            raise NotImplementedError(f"EAGLE head type {method!r} is not supported; supported: {EAGLE_METHODS}")
        speculators = "speculators_model_type" in d
        layer_dict = dict(d["transformer_layer_config"]) if speculators else dict(d)
        if d.get("norm_before_fc"):
            raise NotImplementedError("EAGLE-3 heads with norm_before_fc=true are not supported")
        layer_dict.setdefault("vocab_size", target.vocab_size)
        layer_dict["architectures"] = ["LlamaForCausalLM"]   # the head's decoder layer is a Llama layer
        layers = LlamaConfig.from_hf_dict(layer_dict)
        # vLLM reads q/k/v biases from `qkv_bias` where a config gives it.
        layers = dataclasses.replace(layers, attention_bias=bool(layer_dict.get("qkv_bias", layers.attention_bias)))
        cfg = cls(
            method=method, layers=layers,
            target_hidden_size=int(d.get("target_hidden_size") or layers.hidden_size),
            draft_vocab_size=int(d.get("draft_vocab_size") or layers.vocab_size),
            aux_layer_ids=_aux_layer_ids(d, target.num_layers) if method == "eagle3" else (),
            norm_before_residual=bool(d.get("norm_before_residual", speculators)),
            fc_bias=fc_bias, lm_head_source=lm_head_source)
        cfg.check_fits(target)
        return cfg

    def check_fits(self, target: Any) -> None:
        """A head must read the target's hidden states and speak its vocabulary."""
        if self.layers.vocab_size != target.vocab_size:
            raise ValueError(
                f"the EAGLE head's vocab_size={self.layers.vocab_size} differs from the target's "
                f"vocab_size={target.vocab_size}: the head was trained for another model; use a head trained for "
                "this target")
        width = self.target_hidden_size if self.method == "eagle3" else self.hidden_size
        if width != target.hidden_size:
            raise ValueError(
                f"the EAGLE head reads hidden states of size {width} but the target's hidden_size is "
                f"{target.hidden_size}: the head was trained for another model; use a head trained for this "
                "target")
        if self.draft_vocab_size > target.vocab_size:
            raise ValueError(f"the EAGLE head's draft_vocab_size={self.draft_vocab_size} exceeds the target's "
                             f"vocab_size={target.vocab_size}")


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """vLLM's EAGLE-3 default: the residual stream entering layers 2, L // 2 and L - 3, each clamped to the
    target's layers (a target of fewer than three layers has no layer 2)."""
    return tuple(min(max(i, 0), num_target_layers - 1) for i in (2, num_target_layers // 2, num_target_layers - 3))


def _aux_layer_ids(d: Mapping[str, Any], num_target_layers: int) -> tuple[int, ...]:
    ids = d.get("eagle_aux_hidden_state_layer_ids") or (d.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    ids = tuple(int(i) for i in ids) if ids else default_aux_layer_ids(num_target_layers)
    bad = [i for i in ids if not 0 <= i < num_target_layers]
    if bad:
        raise ValueError(f"the head's eagle_aux_hidden_state_layer_ids {list(ids)} name layers {bad} outside the "
                         f"target's 0..{num_target_layers - 1}: this head was trained for another target model")
    return ids


def head_weight_map(cfg: EagleConfig, *, embed: bool) -> dict[str, LeafSpec]:
    """The head's own weights (tree path -> LeafSpec, canonical tensor names: `layers.{i}.*`, no "model."
    prefix); embed: the head brings its own embed_tokens. The vocabulary map (d2t) and the weights shared
    with the target are not in it."""
    c, H = cfg.layers, cfg.hidden_size
    specs = {"fc": LeafSpec(("fc.weight",), (cfg.fc_in_features, H), True)}
    if cfg.fc_bias:
        specs["fc_bias"] = LeafSpec(("fc.bias",), (H,), False)
    for i in range(c.num_layers):
        specs.update({f"layers/{i}/{name}": spec for name, spec in _layer_map(cfg, i).items()})
    if cfg.method == "eagle3":
        specs["norm"] = LeafSpec(("norm.weight",), (H,), False)
    if cfg.lm_head_source == "head":
        specs["lm_head"] = LeafSpec(("lm_head.weight",), (H, cfg.draft_vocab_size), True)
    if embed:
        specs["embed"] = LeafSpec(("embed_tokens.weight",), (c.vocab_size, H), False)
    return specs


def _layer_map(cfg: EagleConfig, i: int) -> dict[str, LeafSpec]:
    c = cfg.layers
    H, I = c.hidden_size, c.intermediate_size
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    first3 = cfg.method == "eagle3" and i == 0
    in_features = 2 * H if first3 else H
    p, attn = f"layers.{i}.", f"layers.{i}.self_attn."
    qkv = [attn + "q_proj", attn + "k_proj", attn + "v_proj"]
    specs = {
        "w_qkv": fused([n + ".weight" for n in qkv], (in_features,), (q, kv, kv), c.num_kv_heads, True),
        "wo": LeafSpec((attn + "o_proj.weight",), (q, H), True),
        "mlp_norm": LeafSpec((p + "post_attention_layernorm.weight",), (H,), False),
        "w_gate_up": fused([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], (H,), (I, I), I, True),
        "w_down": LeafSpec((p + "mlp.down_proj.weight",), (I, H), True),
    }
    if c.attention_bias:
        specs["b_qkv"] = fused([n + ".bias" for n in qkv], (), (q, kv, kv), c.num_kv_heads, False)
    if cfg.method == "eagle3" or i > 0:   # EAGLE-1's first layer has no input norm
        specs["attn_norm"] = LeafSpec((p + "input_layernorm.weight",), (H,), False)
    if first3:
        specs["hidden_norm"] = LeafSpec((p + "hidden_norm.weight",), (H,), False)
    return specs


class HeadLayer(nnx.Module):
    """One Llama decoder layer whose q/k/v read `in_features` (2H for EAGLE-3's first layer)."""

    def __init__(self, cfg: LlamaConfig, in_features: int, *, input_norm: bool, hidden_norm: bool, dtype,
                 rngs: nnx.Rngs):
        H, I = cfg.hidden_size, cfg.intermediate_size
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        if input_norm:
            self.attn_norm = ones_param((H,), dtype)
        if hidden_norm:
            self.hidden_norm = ones_param((H,), dtype)
        self.w_qkv = normal_param(rngs, (in_features, q + 2 * kv), dtype)
        if cfg.attention_bias:
            self.b_qkv = normal_param(rngs, (q + 2 * kv,), dtype)
        self.wo = normal_param(rngs, (q, H), dtype)
        self.mlp_norm = ones_param((H,), dtype)
        self.w_gate_up, self.w_down = normal_param(rngs, (H, 2 * I), dtype), normal_param(rngs, (I, H), dtype)

    def arrays(self) -> dict[str, jax.Array]:
        return {name: var[...] for name, var in vars(self).items() if isinstance(var, nnx.Param)}


class EagleHead(nnx.Module):
    supports_trees = True

    def __init__(self, cfg: EagleConfig, *, dtype=jnp.float32, rngs: nnx.Rngs,
                 kernels: KernelPolicy = KernelPolicy()):
        self.cfg = cfg
        self.kernels = kernels
        layers_cfg, H, V = cfg.layers, cfg.hidden_size, cfg.layers.vocab_size
        eagle3 = cfg.method == "eagle3"
        self.fc = normal_param(rngs, (cfg.fc_in_features, H), dtype)
        if cfg.fc_bias:
            self.fc_bias = nnx.Param(jnp.zeros((H,), dtype))
        self.embed = Frozen(normal_param(rngs, (V, H), dtype)[...])
        self.layers = nnx.List([
            HeadLayer(layers_cfg, 2 * H if eagle3 and i == 0 else H, input_norm=eagle3 or i > 0,
                      hidden_norm=eagle3 and i == 0, dtype=dtype, rngs=rngs)
            for i in range(layers_cfg.num_layers)])
        if eagle3:
            self.norm = ones_param((H,), dtype)
        if cfg.lm_head_source == "head":
            self.lm_head = normal_param(rngs, (H, cfg.draft_vocab_size), dtype)
        else:
            shape = (H, V) if cfg.lm_head_source == "target" else (V, H)
            self.lm_head = Frozen(jnp.zeros(shape, dtype))
        if cfg.reduced_vocab:
            self.draft_to_target = Frozen(jnp.arange(cfg.draft_vocab_size, dtype=jnp.int32))

    @property
    def dtype(self):
        return self.fc[...].dtype

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """EAGLE-3 reads the residual stream entering these target layers; EAGLE-1 the final hidden state."""
        return self.cfg.aux_layer_ids if self.cfg.method == "eagle3" else ()

    def combine(self, target_hidden: jax.Array) -> jax.Array:
        """The target's features -> the head's input hidden state [..., H]: EAGLE-3 projects the captured
        layers with fc; EAGLE-1 reads the target's final hidden state as is."""
        if self.cfg.method == "eagle":
            return target_hidden
        return self._fc(target_hidden)

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        c = self.cfg.layers
        return KVCache.init(c.num_layers, batch, c.num_kv_heads, max_len, c.head_dim, self.dtype)

    def cache_bytes(self, batch: int, max_len: int) -> int:
        """Bytes of init_cache(batch, max_len); the head is replicated, so each device holds all of it."""
        c = self.cfg.layers
        return KVCache.bytes(c.num_layers, batch, c.num_kv_heads, max_len, c.head_dim, self.dtype)

    def __call__(self, tokens: jax.Array, hidden: jax.Array, start: jax.Array,
                 cache: KVCache, tree: TreeMask | None = None) -> tuple[jax.Array, jax.Array, KVCache]:
        """Run T tokens per row [B, T] with hidden states [B, T, H] at positions start[b] + t (a draft tree's:
        tree.positions), writing the head's KV cache at slots start[b] + t. Returns (output for the logits,
        hidden state to feed back, cache)."""
        T = tokens.shape[1]
        positions = start[:, None] + jnp.arange(T, dtype=start.dtype)[None, :] if tree is None else tree.positions
        k_cache, v_cache = cache.k, cache.v
        scale = self.cfg.layers.head_dim ** -0.5

        def attend(i, q, k, v):
            nonlocal k_cache, v_cache
            k_cache, v_cache = write_layer(k_cache, i, k, start), write_layer(v_cache, i, v, start)
            return attention(q, k_cache, v_cache, jnp.int32(i), start, scale=scale, kernels=self.kernels, tree=tree)

        out, feed = self.decode(tokens, hidden, positions, attend)
        return out, feed, KVCache(k_cache, v_cache)

    def decode(self, tokens: jax.Array, hidden: jax.Array, positions: jax.Array,
               attend: LayerAttend) -> tuple[jax.Array, jax.Array]:
        """The layers' maths with the attention supplied by the caller (a KV cache, or training's mask)."""
        cfg, eps = self.cfg, self.cfg.layers.rms_norm_eps
        embeds = self.embed[...][tokens]
        if cfg.method == "eagle":
            h = self._fc(jnp.concatenate([embeds, hidden], axis=-1))
            x, residual, norm = h, h, None   # the first EAGLE-1 layer has no input norm
        else:
            x, residual = self._eagle3_first_input(self.layers[0], embeds, hidden)
            norm = None                      # its two halves are normed already
        c = cfg.layers
        rotate = rotary(c.head_dim, c.rope_theta, c.rope_scaling, max_position_embeddings=c.max_position_embeddings)
        for i, layer in enumerate(self.layers):
            w = layer.arrays()
            if i > 0:
                x, residual, norm = h, h, w["attn_norm"]
            h = decoder_layer(x, residual, w, c, positions, rotate,
                              lambda q, k, v, i=i: attend(i, q, k, v), self.kernels, input_norm=norm)
        if cfg.method == "eagle":
            return h, h
        return rms_norm(h, self.norm[...], eps), h

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
