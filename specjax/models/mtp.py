"""MTP (multi-token prediction) layers as a draft head: the layers a target's checkpoint carries after its decoder,
drafting the token after next from the target's hidden state. Two layouts:
- DeepSeek-V3 (`model.layers.{num_hidden_layers + i}`: enorm, hnorm, eh_proj, shared_head.norm, an MLA + MoE block);
- MiMo-7B (`model.mtp_layers.{i}`: token_layernorm, hidden_layernorm, input_proj, final_layernorm, a Qwen2 block),
  whose projection reads the hidden state first; also the layout of MTP head directories that specjax.training
  writes for any Llama-family target (the block shaped like the target's layers).

One MTP step for the pair (token t+1, hidden h_t) at position t (vLLM's convention; the embedding is zeroed at
position 0, as vLLM does):
    x = eh_proj([enorm(embed(token)); hnorm(h)])    (MiMo-style checkpoints put hnorm(h) first)
    y = the family's decoder block (its own cache) on x
    out = shared_head_norm(y);   logits = the target's lm_head(out)
and `out`, the post-norm output, is what the next step reads as its hidden state (vLLM 0.33 recycles it for
DeepSeek; the pre-norm one is what the layer was never trained on). The embedding and lm_head are the target's
(the checkpoint's duplicates are not read). A larger k runs the layer again on its own output.

The head offers what specjax.engine.proposers.eagle.HeadProposer asks of a draft head, so MTP drafting is that
proposer with this head.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from specjax.kernels.attention import attention
from specjax.kernels.policy import KernelPolicy
from specjax.kernels.tree_mask import TreeMask
from specjax.kernels.projection_reference import rms_norm
from specjax.models import deepseek, llama
from specjax.models.family import Frozen
from specjax.models.kv_cache import KVCache, write_layer
from specjax.models.layers import LayerAttend, decoder_layer
from specjax.models.mla import LatentCache
from specjax.models.rope import rotary
from specjax.models.weight_map import LeafSpec
from specjax.parallel.plan import nest_paths

# layout -> (the MTP layer's tensor prefix, names of enorm, hnorm, eh_proj, the shared head's norm)
LAYOUTS = {"deepseek": ("model.layers.{layer}.", ("enorm", "hnorm", "eh_proj", "shared_head.norm")),
           "mimo": ("model.mtp_layers.0.", ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm"))}


@dataclasses.dataclass(frozen=True)
class MtpConfig:
    target: Any                   # the target family's config, which the block is built from
    num_mtp_layers: int           # in the checkpoint (one is used: k beyond it reruns it)
    layout: str = "deepseek"
    hidden_first: bool = False    # eh_proj reads [hnorm(h); enorm(e)]
    method: str = "mtp"
    aux_layer_ids: tuple[int, ...] = ()

    @property
    def hidden_size(self) -> int:
        return self.target.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    @property
    def layers(self) -> Any:
        """The config the block is built from (what training reads an EAGLE head's `layers` for)."""
        return self.target

    # The head drafts over the target's whole vocabulary (as training asks of a draft head).
    reduced_vocab = False

    @property
    def draft_vocab_size(self) -> int:
        return self.vocab_size

    @property
    def prefix(self) -> str:
        """The checkpoint's tensor-name prefix of the (first) MTP layer."""
        return LAYOUTS[self.layout][0].format(layer=self.target.num_layers)


def num_mtp_layers(d: Mapping[str, Any]) -> int:
    """The MTP layers a target's config.json declares (vLLM reads num_nextn_predict_layers)."""
    return int(d.get("num_nextn_predict_layers") or 0)


def mtp_config(d: Mapping[str, Any], target: Any) -> MtpConfig:
    """The MTP head of a config.json (the target's, or an MTP head directory's written for that target)."""
    count = num_mtp_layers(d)
    if count == 0:
        raise ValueError("this checkpoint's config.json declares no MTP layers (num_nextn_predict_layers); MTP "
                         "speculation needs a target that ships them (DeepSeek-V3 / R1) or an MTP head directory")
    if count > 1:
        raise ValueError(f"config.json declares {count} MTP layers; specjax drafts with checkpoints of one MTP layer "
                         "(DeepSeek-V3 / R1), rerunning it for k > 1")
    if isinstance(target, deepseek.DeepseekConfig):
        return MtpConfig(target=target, num_mtp_layers=count)
    if isinstance(target, llama.LlamaConfig):   # MiMo's own layers, or a head trained for a Llama-family target
        return MtpConfig(target=target, num_mtp_layers=count, layout="mimo", hidden_first=True)
    raise ValueError(f"MTP layers of a {target.architecture} target are not supported; supported: "
                     f"{', '.join(deepseek.ARCHITECTURES)}, MiMoForCausalLM and MTP head directories of "
                     "Llama-family targets")


def mtp_weight_map(cfg: MtpConfig) -> dict[str, LeafSpec]:
    """The head's own leaves: enorm, hnorm, eh_proj [2H, H], shared_norm, and block/* (the decoder block,
    stacked over its one layer)."""
    H, prefix = cfg.hidden_size, cfg.prefix
    enorm, hnorm, eh_proj, shared_norm = LAYOUTS[cfg.layout][1]
    specs = {"enorm": LeafSpec((prefix + enorm + ".weight",), (H,)),
             "hnorm": LeafSpec((prefix + hnorm + ".weight",), (H,)),
             "eh_proj": LeafSpec((prefix + eh_proj + ".weight",), (2 * H, H), True),
             "shared_norm": LeafSpec((prefix + shared_norm + ".weight",), (H,))}
    if cfg.layout == "deepseek":
        block = deepseek.layer_weight_map(cfg.target, "moe", (cfg.target.num_layers,))
    else:
        block = llama.layer_weight_map(cfg.target, "model.mtp_layers.{i}.", 1)   # stacked over layer 0 alone
    return {**specs, **{f"block/{name}": spec for name, spec in block.items()}}


def mtp_ignored(cfg: MtpConfig) -> str:
    """The checkpoint tensors the head does not read: the target's, and the MTP layer's copies of the target's
    embedding and lm_head."""
    prefix = cfg.prefix.replace(".", r"\.")
    return rf"(?!{prefix})|{prefix}(embed_tokens|shared_head\.head)\."


class MtpHead(nnx.Module):
    supports_trees = True

    def __init__(self, cfg: MtpConfig, *, dtype=jnp.float32, rngs: nnx.Rngs, kernels: KernelPolicy = KernelPolicy()):
        self.cfg = cfg
        self.kernels = kernels
        flat = {path: deepseek.init_leaf(path, spec, dtype, rngs.params()) for path, spec in mtp_weight_map(cfg).items()}
        tree = nest_paths(flat)
        self.block = nnx.Dict({name: nnx.Param(leaf) for name, leaf in tree.pop("block").items()})
        for name, leaf in tree.items():
            setattr(self, name, nnx.Param(leaf))
        target, H = cfg.target, cfg.hidden_size
        self.embed = Frozen(jnp.zeros((target.vocab_size, H), dtype))
        self.lm_head = Frozen(jnp.zeros((target.vocab_size, H) if target.tie_word_embeddings
                                        else (H, target.vocab_size), dtype))

    @property
    def dtype(self):
        return self.eh_proj[...].dtype

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return ()

    def combine(self, target_hidden: jax.Array) -> jax.Array:
        """The target's final-normed hidden states are the head's input as they are."""
        return target_hidden

    def init_cache(self, batch: int, max_len: int) -> LatentCache | KVCache:
        """The block's own one-layer cache, in its family's layout."""
        target = self.cfg.target
        if self.cfg.layout == "deepseek":
            return LatentCache.init(1, batch, max_len, target.latent_width, self.dtype)
        return KVCache.init(1, batch, target.num_kv_heads, max_len, target.head_dim, self.dtype)

    def cache_bytes(self, batch: int, max_len: int) -> int:
        """The head is replicated: each device holds its whole cache."""
        target = self.cfg.target
        if self.cfg.layout == "deepseek":
            return LatentCache.bytes(1, batch, max_len, target.latent_width, self.dtype)
        return KVCache.bytes(1, batch, target.num_kv_heads, max_len, target.head_dim, self.dtype)

    def __call__(self, tokens: jax.Array, hidden: jax.Array, start: jax.Array,
                 cache: LatentCache | KVCache, tree: TreeMask | None = None
                 ) -> tuple[jax.Array, jax.Array, LatentCache | KVCache]:
        """One MTP step for T pairs per row (tokens [B, T], hidden [B, T, H]) at positions start[b] + t (a draft
        tree's: tree.positions), writing the head's cache at slots start[b] + t. Returns (output for the logits,
        hidden state to feed back: the same, cache)."""
        positions = (start[:, None] + jnp.arange(tokens.shape[1], dtype=start.dtype)[None, :] if tree is None
                     else tree.positions)
        if self.cfg.layout == "deepseek":
            weights = {name: var[...][0] for name, var in self.block.items()}
            y, latent = deepseek.decoder_layer(self._input(tokens, hidden, positions), cache.latent, weights, 0,
                                               start, self.cfg.target, self.kernels, moe_layer=True, tree=tree)
            out = rms_norm(y, self.shared_norm[...], self.cfg.target.rms_norm_eps)
            return out, out, LatentCache(latent)
        k_cache, v_cache, scale = cache.k, cache.v, self.cfg.target.head_dim ** -0.5

        def attend(layer, q, k, v):
            nonlocal k_cache, v_cache
            k_cache, v_cache = write_layer(k_cache, 0, k, start), write_layer(v_cache, 0, v, start)
            return attention(q, k_cache, v_cache, 0, start, scale=scale, kernels=self.kernels, tree=tree)

        out, feedback = self.decode(tokens, hidden, positions, attend)
        return out, feedback, KVCache(k_cache, v_cache)

    def decode(self, tokens: jax.Array, hidden: jax.Array, positions: jax.Array,
               attend: LayerAttend) -> tuple[jax.Array, jax.Array]:
        """A Llama-family (MiMo-layout) step with the block's attention supplied by the caller (the head's cache,
        or training's mask): (output for the logits, hidden state to feed back)."""
        target = self.cfg.target
        weights = {name: var[...][0] for name, var in self.block.items()}
        rotate = rotary(target.head_dim, target.rope_theta, target.rope_scaling,
                        max_position_embeddings=target.max_position_embeddings)
        x = self._input(tokens, hidden, positions)
        y = decoder_layer(x, x, weights, target, positions, rotate, lambda q, k, v: attend(0, q, k, v), self.kernels,
                          input_norm=weights["attn_norm"])
        out = rms_norm(y, self.shared_norm[...], target.rms_norm_eps)
        return out, out

    def _input(self, tokens: jax.Array, hidden: jax.Array, positions: jax.Array) -> jax.Array:
        """eh_proj over the normed embedding and hidden state (the embedding zeroed at position 0)."""
        cfg, eps = self.cfg, self.cfg.target.rms_norm_eps
        embeds = jnp.where((positions > 0)[..., None], self.embed[...][tokens], 0).astype(hidden.dtype)
        parts = [rms_norm(embeds, self.enorm[...], eps), rms_norm(hidden, self.hnorm[...], eps)]
        return jnp.concatenate(parts[::-1] if cfg.hidden_first else parts, axis=-1) @ self.eh_proj[...]

    def logits(self, out: jax.Array) -> jax.Array:
        """fp32 logits over the target's vocabulary, through its lm_head."""
        head = self.lm_head[...]
        if self.cfg.target.tie_word_embeddings:
            return jnp.einsum("...h,vh->...v", out, head, preferred_element_type=jnp.float32)
        return jnp.dot(out, head, preferred_element_type=jnp.float32)

    target_logits = logits

    def to_target_ids(self, ids: jax.Array) -> jax.Array:
        return ids
