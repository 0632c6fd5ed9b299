"""The Llama family (Llama 2/3/3.x, Mistral, Qwen2/2.5, Qwen3, SmolLM2): its config, HF weight map, partition
rules, cache and forward pass, as one Flax NNX module and the `FAMILY` object the registry lists.

Two layouts of the decoder layers' weights, one layer function for both: stacked on a leading layer axis
and run with one `lax.scan` (compile time flat in depth; the default off GPUs), or one weight set per layer
run unrolled (the GPU default: a matmul reads its own weight buffer, where slicing a stacked leaf inside the
generate while_loop made XLA copy every layer's weights every step). Checkpoints hold the stacked layout;
`unstack_layers` turns it into the per-layer one. Each forward pass writes the K/V of its T tokens into the
cache and attends over it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.kernels.attention import attention
from specjax.kernels.policy import KernelPolicy
from specjax.kernels.prefill_attention import prefill_attention
from specjax.kernels.tree_mask import TreeMask
from specjax.models.family import ForwardAux, default_unroll, module_from_params, unstack_leaves
from specjax.models.kv_cache import KVCache, write_layer
from specjax.models.layers import decoder_layer, rms_norm
from specjax.models.random_init import normal_param, ones_param
from specjax.models.rope import rotary
from specjax.models.weight_map import LeafSpec, fused
from specjax.parallel.mesh import shards_kv_heads
from specjax.parallel.plan import PartitionRules

# MiMo-7B (MiMoForCausalLM) is a Qwen2 decoder with MTP layers (models/mtp.py reads those).
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MiMoForCausalLM")
# transformers' sliding_window where Mistral's and Qwen2/3's config.json leave it out.
DEFAULT_SLIDING_WINDOW = 4096
# The layer_types entries these architectures know, and whether the layer attends through a sliding window.
LAYER_TYPES = {"full_attention": False, "sliding_attention": True}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
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
    # Per layer, the sliding window in tokens (a query sees its own token and the window - 1 before it), 0 for
    # full attention; () when every layer attends fully.
    attention_windows: tuple[int, ...] = ()

    def sliding_window(self, layer: int | jax.Array) -> int | jax.Array:
        """The window of `layer` (0 = none): a Python int where it is known without tracing (every layer alike,
        or `layer` a Python int, as in the unrolled layout), else picked by the traced index under lax.scan."""
        windows = self.attention_windows or (0,)
        if len(set(windows)) == 1:
            return windows[0]
        if isinstance(layer, int):
            return windows[layer]
        return jnp.asarray(windows, jnp.int32)[layer]

    def window_covers(self, tokens: int, layer: int | jax.Array) -> bool:
        """Whether `tokens` fresh tokens from position 0 attend in `layer` as under plain causal attention (no
        window, or one at least that wide); for a traced layer, in every layer."""
        window = self.sliding_window(layer)
        windows = (window,) if isinstance(window, int) else self.attention_windows
        return all(w == 0 or tokens <= w for w in windows)

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> LlamaConfig:
        arch = (d.get("architectures") or ["LlamaForCausalLM"])[0]
        heads = _required(d, "num_attention_heads")
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        num_layers = _required(d, "num_hidden_layers")
        max_positions = d.get("max_position_embeddings", 2048)
        return cls(
            architecture=arch,
            vocab_size=_required(d, "vocab_size"),
            hidden_size=_required(d, "hidden_size"),
            intermediate_size=_required(d, "intermediate_size"),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(d),
            rope_scaling=d.get("rope_scaling") or _rope_parameters_scaling(d.get("rope_parameters")),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            # Qwen2 (and MiMo, a Qwen2) always has q/k/v biases; Llama/Mistral only when `attention_bias` says so.
            attention_bias=d.get("attention_bias", arch.startswith(("Qwen2", "MiMo"))),
            qk_norm=arch.startswith("Qwen3"),
            max_position_embeddings=max_positions,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
            attention_windows=_attention_windows(d, arch, num_layers, max_positions),
        )


def _required(d: Mapping[str, Any], key: str) -> Any:
    if key not in d:
        raise ValueError(f"config.json has no {key!r}, which a {(d.get('architectures') or ['Llama'])[0]} "
                         "config needs: the file is incomplete or belongs to another architecture")
    return d[key]


def _attention_windows(d: Mapping[str, Any], arch: str, num_layers: int, max_positions: int) -> tuple[int, ...]:
    """Per-layer windows as transformers 5 applies them. Mistral: every layer, by sliding_window (null: none).
    Qwen2/Qwen3: only with use_sliding_window, in the layers layer_types names "sliding_attention" (without
    layer_types: layer max_window_layers and those after it). Llama: none. A window no shorter than
    max_position_embeddings can hide nothing and counts as none (the fused prefill stays open)."""
    if arch == "MistralForCausalLM":
        window, windowed = d.get("sliding_window", DEFAULT_SLIDING_WINDOW), [True] * num_layers
    elif arch.startswith("Qwen"):
        window = d.get("sliding_window", DEFAULT_SLIDING_WINDOW) if d.get("use_sliding_window", False) else None
        windowed = _windowed_layers(d, num_layers, window is not None)
    else:
        return ()
    if window is None:
        return ()
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"config.json's sliding_window must be a positive number of tokens or null, got {window!r}")
    if window >= max_positions or not any(windowed):
        return ()
    return tuple(window if w else 0 for w in windowed)


def _windowed_layers(d: Mapping[str, Any], num_layers: int, has_window: bool) -> list[bool]:
    """Qwen2/Qwen3: which layers have the sliding window, from layer_types or else max_window_layers."""
    layer_types = d.get("layer_types")
    if layer_types is None:
        first = d.get("max_window_layers", 28)
        return [has_window and i >= first for i in range(num_layers)]
    if not isinstance(layer_types, (list, tuple)) or len(layer_types) != num_layers:
        raise ValueError(f"config.json's layer_types must list one entry per layer ({num_layers}), got {layer_types!r}")
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"config.json's layer_types has {unknown}, which specjax does not implement; supported: "
                         f"{', '.join(LAYER_TYPES)}")
    return [LAYER_TYPES[t] for t in layer_types]


def _rope_theta(d: Mapping[str, Any]) -> float:
    params = d.get("rope_parameters") or {}
    return float(d.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_parameters_scaling(params: dict | None) -> dict | None:
    """transformers >= 5 writes `rope_parameters`; a `default` rope type means no scaling."""
    if not params or params.get("rope_type", "default") == "default":
        return None
    return dict(params)


# ---------------------------------------------------------------------------------------------- weights

def weight_map(cfg: LlamaConfig) -> dict[str, LeafSpec]:
    """Tree path -> LeafSpec: embed, layers/* (stacked over the layers), final_norm, lm_head. Matrices are stored
    [in, out]."""
    H, V = cfg.hidden_size, cfg.vocab_size
    layers = layer_weight_map(cfg, "model.layers.{i}.", cfg.num_layers)
    specs = {"embed": LeafSpec(("model.embed_tokens.weight",), (V, H), False),
             **{f"layers/{name}": spec for name, spec in layers.items()},
             "final_norm": LeafSpec(("model.norm.weight",), (H,), False)}
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = LeafSpec(("lm_head.weight",), (H, V), True)
    return specs


def layer_weight_map(cfg: LlamaConfig, prefix: str, num_layers: int) -> dict[str, LeafSpec]:
    """One decoder layer's leaves, stacked over `num_layers` layers whose tensors are named `prefix` +
    "self_attn...." ("{i}" in prefix: the layer index): the target's layers, and an MTP layer's block. q/k/v are
    fused with one group per kv head, gate/up with one group per intermediate column."""
    L, H, I, D = num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * D, cfg.num_kv_heads * D
    attn, mlp = prefix + "self_attn", prefix + "mlp"
    qkv = (f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj")
    specs = {
        "attn_norm": LeafSpec((prefix + "input_layernorm.weight",), (L, H), False),
        "mlp_norm": LeafSpec((prefix + "post_attention_layernorm.weight",), (L, H), False),
        "w_qkv": fused([f"{n}.weight" for n in qkv], (L, H), (q, kv, kv), cfg.num_kv_heads, True),
        "wo": LeafSpec((f"{attn}.o_proj.weight",), (L, q, H), True),
        "w_gate_up": fused([f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"], (L, H), (I, I), I, True),
        "w_down": LeafSpec((f"{mlp}.down_proj.weight",), (L, I, H), True),
    }
    if cfg.attention_bias:
        specs["b_qkv"] = fused([f"{n}.bias" for n in qkv], (L,), (q, kv, kv), cfg.num_kv_heads, False)
    if cfg.qk_norm:
        specs["q_norm"] = LeafSpec((f"{attn}.q_norm.weight",), (L, D), False)
        specs["k_norm"] = LeafSpec((f"{attn}.k_norm.weight",), (L, D), False)
    return specs


def partition_rules(cfg: LlamaConfig, tensor_parallel_size: int) -> PartitionRules:
    """Megatron-style, as vLLM: the fused q/k/v and gate/up weights column-parallel (their columns are grouped
    by kv head and by intermediate column, so each device holds whole heads and matching gate/up columns), o
    and down row-parallel (XLA all-reduces their outputs), embedding and lm_head split over the vocabulary,
    norms replicated. With fewer kv heads than devices q/k/v are replicated: each device computes every head
    and attends with its own q heads (vLLM instead gives each device its q heads and one copy of their kv
    head). A vocabulary not divisible by tp is replicated rather than padded."""
    kv_split = -1 if shards_kv_heads(cfg.num_kv_heads, tensor_parallel_size) else None
    vocab_split = cfg.vocab_size % tensor_parallel_size == 0
    return {"w_gate_up": -1, "w_qkv": kv_split, "b_qkv": kv_split, "wo": -2, "w_down": -2,
            "embed": -2 if vocab_split else None, "lm_head": -1 if vocab_split else None,
            "attn_norm": None, "mlp_norm": None, "q_norm": None, "k_norm": None, "final_norm": None}


def check_tensor_parallel(cfg: LlamaConfig, tensor_parallel_size: int, *, field: str) -> None:
    """Raise before loading when `cfg` cannot be split over tensor_parallel_size devices."""
    tp = tensor_parallel_size
    fix = ("lower it" if field == "tensor_parallel_size" else
           "or set speculative_config['draft_tensor_parallel_size'] = 1 to replicate the draft")
    name = "model" if field == "tensor_parallel_size" else "draft model"
    if cfg.num_heads % tp:
        raise ValueError(f"the {name}'s num_heads={cfg.num_heads} is not divisible by {field}={tp}: "
                         f"use a divisor of {cfg.num_heads}, {fix}")
    if cfg.num_kv_heads >= tp and cfg.num_kv_heads % tp:
        raise ValueError(f"the {name}'s num_kv_heads={cfg.num_kv_heads} is not divisible by {field}={tp}: "
                         f"use a divisor of {cfg.num_kv_heads}, {fix}")
    if cfg.num_kv_heads < tp and tp % cfg.num_kv_heads:
        raise ValueError(f"{field}={tp} is larger than the {name}'s num_kv_heads={cfg.num_kv_heads} but not a "
                         f"multiple of it (kv heads are then replicated): use a multiple, {fix}")
    if cfg.intermediate_size % tp:
        raise ValueError(f"the {name}'s intermediate_size={cfg.intermediate_size} is not divisible by "
                         f"{field}={tp}: {fix}")


def ignored_tensors(cfg: LlamaConfig) -> str | None:
    """Checkpoint tensors the model does not read: a tied model's lm_head copy (transformers ties it to the
    embedding too), the rotary tables old exports carry, MiMo's MTP layers (the mtp proposer reads them)."""
    ignored = r".*rotary_emb\.inv_freq$|model\.mtp_layers\."
    return r"lm_head\.weight$|" + ignored if cfg.tie_word_embeddings else ignored


def unstack_layers(params: dict, num_layers: int) -> dict:
    """A checkpoint's param tree (stacked layer leaves) in the per-layer layout: {"layers": {i: {...}}}.
    Consumes `params` leaf by leaf (family.unstack_leaves)."""
    layers = unstack_leaves(params.pop("layers"), num_layers)
    return {**params, "layers": layers}


def stack_layers(params: dict) -> dict:
    """The per-layer param tree stacked back into the checkpoint layout (a copy of the layer weights)."""
    layers = params["layers"]
    names = layers[0].keys()
    return {**params, "layers": {name: jnp.stack([layers[i][name] for i in range(len(layers))]) for name in names}}


# ---------------------------------------------------------------------------------------------- module

class DecoderWeights(nnx.Module):
    """Decoder layer weights in the weight map's layout. `lead=(L,)` stacks every leaf over L layers on axis
    0; `lead=()` holds one layer."""

    def __init__(self, cfg: LlamaConfig, dtype, rngs: nnx.Rngs, lead: tuple[int, ...] = ()):
        H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        q, kv = cfg.num_heads * D, cfg.num_kv_heads * D

        def init(*shape):
            return normal_param(rngs, lead + shape, dtype)

        def ones(*shape):
            return ones_param(lead + shape, dtype)

        self.attn_norm, self.mlp_norm = ones(H), ones(H)
        self.w_qkv, self.wo = init(H, q + 2 * kv), init(q, H)
        if cfg.attention_bias:
            self.b_qkv = init(q + 2 * kv)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = ones(D), ones(D)
        self.w_gate_up, self.w_down = init(H, 2 * I), init(I, H)

    def arrays(self) -> dict[str, jax.Array]:
        return {name: var[...] for name, var in vars(self).items() if isinstance(var, nnx.Param)}


class LlamaForCausalLM(nnx.Module):
    supports_trees = True

    def __init__(self, cfg: LlamaConfig, *, dtype=jnp.float32, rngs: nnx.Rngs,
                 kernels: KernelPolicy = KernelPolicy(), unroll_layers: bool | None = None):
        self.cfg = cfg
        self.kernels = kernels
        self.unroll_layers = default_unroll() if unroll_layers is None else unroll_layers
        self.embed = normal_param(rngs, (cfg.vocab_size, cfg.hidden_size), dtype)
        if self.unroll_layers:
            self.layers = nnx.List([DecoderWeights(cfg, dtype, rngs) for _ in range(cfg.num_layers)])
        else:
            self.layers = DecoderWeights(cfg, dtype, rngs, lead=(cfg.num_layers,))
        self.final_norm = ones_param((cfg.hidden_size,), dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = normal_param(rngs, (cfg.hidden_size, cfg.vocab_size), dtype)

    def __call__(self, tokens: jax.Array, start: jax.Array, cache: KVCache,
                 capture_layers: tuple[int, ...] = (), fresh: bool = False,
                 tree: TreeMask | None = None) -> tuple[jax.Array, KVCache, ForwardAux]:
        """Run T tokens per row [B, T] at positions start[b] .. start[b]+T-1 (the CausalLM contract)."""
        T = tokens.shape[1]
        if tree is not None and any(0 < w <= tree.region for w in self.cfg.attention_windows):
            raise ValueError(f"a draft tree of {tree.region} tokens needs sliding windows longer than that (this "
                             f"model's: {sorted(set(self.cfg.attention_windows) - {0})}): lower tree_nodes")
        positions = start[:, None] + jnp.arange(T, dtype=start.dtype)[None, :] if tree is None else tree.positions
        h = self.embed[...][tokens]
        layer_fn = self._layer_fn(positions, start, fresh, tree)
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

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        cfg = self.cfg
        return KVCache.init(cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim, self.embed[...].dtype)

    def cache_bytes(self, batch: int, max_len: int, tensor_parallel_size: int = 1) -> int:
        cfg = self.cfg
        return KVCache.bytes(cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim, self.embed[...].dtype,
                             tensor_parallel_size)

    def _layer_fn(self, positions: jax.Array, start: jax.Array, fresh: bool, tree: TreeMask | None):
        cfg, kernels = self.cfg, self.kernels
        rotate = rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                        max_position_embeddings=cfg.max_position_embeddings)
        scale = cfg.head_dim ** -0.5

        def layer(carry, xs):
            h, k_cache, v_cache = carry
            w, i = xs

            def attend(q, k, v):
                nonlocal k_cache, v_cache
                k_cache, v_cache = write_layer(k_cache, i, k, start), write_layer(v_cache, i, v, start)
                # The fused prefill knows no window: a prompt longer than the layer's window takes the cache
                # path, which applies it.
                if fresh and cfg.window_covers(q.shape[1], i):
                    return prefill_attention(q, k, v, k_cache, v_cache, i, scale=scale, kernels=kernels)
                return attention(q, k_cache, v_cache, i, start, scale=scale, window=cfg.sliding_window(i),
                                 kernels=kernels, tree=tree)

            out = decoder_layer(h, h, w, cfg, positions, rotate, attend, kernels, input_norm=w["attn_norm"])
            return (out, k_cache, v_cache), h

        return layer


# ---------------------------------------------------------------------------------------------- family

class LlamaFamily:
    name = "llama"
    architectures = ARCHITECTURES
    config_from_hf = staticmethod(LlamaConfig.from_hf_dict)
    weight_map = staticmethod(weight_map)
    partition_rules = staticmethod(partition_rules)
    check_tensor_parallel = staticmethod(check_tensor_parallel)
    ignored_tensors = staticmethod(ignored_tensors)

    @staticmethod
    def build(cfg: LlamaConfig, params: dict, *, kernels: KernelPolicy = KernelPolicy(),
              unroll_layers: bool | None = None) -> LlamaForCausalLM:
        """The module holding `params` (stacked layer leaves), consumed when the layers are unrolled."""
        return module_from_params(LlamaForCausalLM, cfg, params, kernels=kernels, unroll_layers=unroll_layers,
                                  unstack=lambda tree: unstack_layers(tree, cfg.num_layers))

    @staticmethod
    def random(cfg: LlamaConfig, *, dtype: np.dtype = jnp.float32, seed: int = 0,
               kernels: KernelPolicy = KernelPolicy(), unroll_layers: bool | None = None) -> LlamaForCausalLM:
        """Random weights (normal * 0.02), for speed benchmarks and tests."""
        return LlamaForCausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(seed), kernels=kernels, unroll_layers=unroll_layers)


FAMILY = LlamaFamily()
