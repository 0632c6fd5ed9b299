"""The DeepSeek-V2/V3 family (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM): multi-head latent attention over a
latent cache (models/mla.py), DeepSeekMoE (models/moe.py), YaRN (models/rope.py), FP8 block-quantized weights kept
FP8 on the device (models/fp8.py); its config, HF weight map, partition rules, cache and forward pass.

The decoder layers come in two groups, each stacked (and scanned) or one weight set per layer (unrolled), as in
the Llama family: the first `first_k_dense_replace` layers with a dense SwiGLU MLP ("dense"), the rest with MoE
("moe"). A layer is pre-norm: h += MLA(input_norm(h)); h += MLP(post_attention_norm(h)). Decode and verify
attend in the weight-absorbed form (the kernel policy's mla_absorbed), a fresh prompt's prefill in the expanded
one. The MTP layers a checkpoint may carry after the last decoder layer (model.layers.{num_hidden_layers + i})
are not part of the target (the mtp proposer reads them).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specjax.kernels.moe_routing_reference import SCORING_FUNCS, TOPK_METHODS, Routing
from specjax.kernels.policy import KernelPolicy
from specjax.kernels.tree_mask import TreeMask
from specjax.kernels.projection_reference import rms_norm
from specjax.models.family import ForwardAux, default_unroll, module_from_params, unstack_leaves
from specjax.models import random_init
from specjax.models.fp8 import dequantize_blocks
from specjax.models.mla import LatentCache, fused_q_width, mla_attention, split_kv_b
from specjax.models.moe import moe, splits_shared, swiglu_mlp
from specjax.models.rope import rotary, rope_type, yarn_softmax_scale
from specjax.models.weight_map import LeafSpec
from specjax.parallel.plan import PartitionRules, nest_paths

ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM")
GROUPS = ("dense", "moe")
FP8_FORMAT = {"quant_method": "fp8", "fmt": "e4m3"}


@dataclasses.dataclass(frozen=True)
class DeepseekConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int            # the dense layers' MLP
    moe_intermediate_size: int        # each routed expert's
    num_layers: int
    num_heads: int
    q_lora_rank: int | None           # None: one q_proj (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    topk_method: str
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    rope_interleave: bool
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    num_nextn_predict_layers: int
    fp8_block: tuple[int, int] | None  # HF's [out, in] block of FP8 weights; None: not quantized

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        """Values per token per layer in the latent cache: c_kv and the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def group_layers(self) -> dict[str, tuple[int, ...]]:
        dense = tuple(range(min(self.first_k_dense_replace, self.num_layers)))
        return {"dense": dense, "moe": tuple(range(len(dense), self.num_layers))}

    @property
    def routing(self) -> Routing:
        return Routing(self.num_experts_per_tok, self.scoring_func, self.topk_method, self.n_group,
                       self.topk_group, self.norm_topk_prob, self.routed_scaling_factor)

    @property
    def block(self) -> tuple[int, int] | None:
        """The FP8 block in the tree's [in, out] orientation."""
        return None if self.fp8_block is None else (self.fp8_block[1], self.fp8_block[0])

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> DeepseekConfig:
        arch = (d.get("architectures") or ["DeepseekV3ForCausalLM"])[0]
        v3 = arch == "DeepseekV3ForCausalLM"
        params = d.get("rope_parameters") or {}
        scaling = d.get("rope_scaling") or (dict(params) if rope_type(params) != "default" else None)
        eos = d.get("eos_token_id")
        cfg = cls(
            architecture=arch, vocab_size=_required(d, "vocab_size"), hidden_size=_required(d, "hidden_size"),
            intermediate_size=_required(d, "intermediate_size"),
            moe_intermediate_size=_required(d, "moe_intermediate_size"),
            num_layers=_required(d, "num_hidden_layers"), num_heads=_required(d, "num_attention_heads"),
            q_lora_rank=d.get("q_lora_rank"), kv_lora_rank=_required(d, "kv_lora_rank"),
            qk_nope_head_dim=_required(d, "qk_nope_head_dim"), qk_rope_head_dim=_required(d, "qk_rope_head_dim"),
            v_head_dim=_required(d, "v_head_dim"), n_routed_experts=_required(d, "n_routed_experts"),
            num_experts_per_tok=_required(d, "num_experts_per_tok"), n_shared_experts=d.get("n_shared_experts") or 0,
            n_group=d.get("n_group") or 1, topk_group=d.get("topk_group") or 1,
            topk_method=d.get("topk_method") or ("noaux_tc" if v3 else "greedy"),
            scoring_func=d.get("scoring_func") or ("sigmoid" if v3 else "softmax"),
            norm_topk_prob=bool(d.get("norm_topk_prob", v3)),
            routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0),
            first_k_dense_replace=d.get("first_k_dense_replace") or 0, rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(d.get("rope_theta") or params.get("rope_theta") or 10000.0), rope_scaling=scaling,
            # V2's rotation is a complex multiply of adjacent pairs; V3 says which layout its config wants.
            rope_interleave=bool(d.get("rope_interleave", True)) if v3 else True,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=d.get("tie_word_embeddings", False), bos_token_id=d.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,)),
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "bfloat16"),
            num_nextn_predict_layers=d.get("num_nextn_predict_layers") or 0,
            fp8_block=_fp8_block(d.get("quantization_config")))
        _check(cfg, d)
        return cfg


def _required(d: Mapping[str, Any], key: str) -> Any:
    if d.get(key) is None:
        raise ValueError(f"config.json has no {key!r}, which a {(d.get('architectures') or ['DeepSeek'])[0]} "
                         "config needs: the file is incomplete or belongs to another architecture")
    return d[key]


def _fp8_block(quantization: Mapping[str, Any] | None) -> tuple[int, int] | None:
    """The weight block of an FP8 checkpoint's quantization_config; None without one."""
    if not quantization:
        return None
    if any(quantization.get(key, value) != value for key, value in FP8_FORMAT.items()):
        raise ValueError(f"config.json's quantization_config {dict(quantization)} is not supported: specjax reads "
                         "DeepSeek's FP8 format (quant_method 'fp8', fmt 'e4m3', weight_block_size [128, 128]); "
                         "use a bf16 checkpoint or dequantize it")
    block = quantization.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0
                                                                        for b in block)):
        raise ValueError(f"config.json's quantization_config weight_block_size must be two positive ints (e.g. "
                         f"[128, 128]), got {block!r}")
    return int(block[0]), int(block[1])


def _check(cfg: DeepseekConfig, d: Mapping[str, Any]) -> None:
    """The routing and layer settings specjax implements, refused clearly otherwise (before any loading)."""
    if cfg.scoring_func not in SCORING_FUNCS:
        raise ValueError(f"config.json's scoring_func {cfg.scoring_func!r} is not one of {SCORING_FUNCS}")
    if cfg.topk_method not in TOPK_METHODS:
        raise ValueError(f"config.json's topk_method {cfg.topk_method!r} is not one of {TOPK_METHODS}")
    if cfg.n_routed_experts % cfg.n_group or not 1 <= cfg.topk_group <= cfg.n_group:
        raise ValueError(f"config.json's n_group={cfg.n_group} / topk_group={cfg.topk_group} do not split "
                         f"n_routed_experts={cfg.n_routed_experts}: n_group must divide it and 1 <= topk_group <= "
                         "n_group")
    if not 1 <= cfg.num_experts_per_tok <= cfg.n_routed_experts:
        raise ValueError(f"config.json's num_experts_per_tok={cfg.num_experts_per_tok} must be in [1, "
                         f"n_routed_experts={cfg.n_routed_experts}]")
    if (d.get("moe_layer_freq") or 1) != 1:
        raise ValueError(f"config.json's moe_layer_freq={d['moe_layer_freq']} is not supported (every DeepSeek "
                         "checkpoint uses 1: every layer from first_k_dense_replace on is MoE)")
    if d.get("attention_bias"):
        raise ValueError("config.json sets attention_bias, which no DeepSeek checkpoint uses and specjax does not "
                         "implement")


# ---------------------------------------------------------------------------------------------- weights

def _matrix(name: str, lead: tuple[int, ...], shape: tuple[int, int], cfg: DeepseekConfig, layers: tuple[int, ...],
            fp8: bool) -> dict[str, LeafSpec]:
    """A linear layer's weight ([in, out] = shape) and, FP8, its block scales (`<leaf>_scale`, float32)."""
    leaf = name.rsplit("/", 1)[-1]
    hf = _HF_NAMES[leaf]
    specs = {name: LeafSpec((hf + ".weight",), lead + shape, True, dtype="float8_e4m3fn" if fp8 else None,
                            layer_indices=layers)}
    if fp8:
        b_out, b_in = cfg.fp8_block
        grid = (-(-shape[0] // b_in), -(-shape[1] // b_out))
        specs[name + "_scale"] = LeafSpec((hf + ".weight_scale_inv",), lead + grid, True, dtype="float32",
                                          layer_indices=layers)
    return specs


_ATTN, _MLP = "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
_HF_NAMES = {"wq": _ATTN + "q_proj", "wq_b": _ATTN + "q_b_proj",
             "wkv_a": _ATTN + "kv_a_proj_with_mqa", "wo": _ATTN + "o_proj", "w_gate": _MLP + "gate_proj",
             "w_up": _MLP + "up_proj", "w_down": _MLP + "down_proj", "ws_gate": _MLP + "shared_experts.gate_proj",
             "ws_up": _MLP + "shared_experts.up_proj", "ws_down": _MLP + "shared_experts.down_proj"}


def weight_map(cfg: DeepseekConfig) -> dict[str, LeafSpec]:
    """Tree path -> LeafSpec: embed, dense/* and moe/* (stacked over each group's layers), final_norm, lm_head."""
    H, V = cfg.hidden_size, cfg.vocab_size
    specs = {"embed": LeafSpec(("model.embed_tokens.weight",), (V, H)),
             "final_norm": LeafSpec(("model.norm.weight",), (H,))}
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = LeafSpec(("lm_head.weight",), (H, V), True)
    for group, layers in cfg.group_layers.items():
        if layers:
            specs.update({f"{group}/{name}": spec for name, spec in layer_weight_map(cfg, group, layers).items()})
    return specs


def layer_weight_map(cfg: DeepseekConfig, group: str, layers: tuple[int, ...]) -> dict[str, LeafSpec]:
    """The leaves of decoder layers `layers` (stacked over them), all dense or all MoE (`group`); the target's
    groups and its MTP layers' blocks use it."""
    H, L, fp8 = cfg.hidden_size, (len(layers),), cfg.fp8_block is not None
    heads_qk = cfg.num_heads * cfg.qk_head_dim

    def matrix(name, shape):
        return _matrix(name, L, shape, cfg, layers, fp8)

    def vector(name, hf, width, dtype=None):
        return {name: LeafSpec((hf,), L + (width,), dtype=dtype, layer_indices=layers)}

    specs = {**vector("attn_norm", "model.layers.{i}.input_layernorm.weight", H),
             **vector("mlp_norm", "model.layers.{i}.post_attention_layernorm.weight", H),
             **vector("kv_norm", _ATTN + "kv_a_layernorm.weight", cfg.kv_lora_rank),
             **_kv_b_map(cfg, layers), **matrix("wo", (cfg.num_heads * cfg.v_head_dim, H))}
    if cfg.q_lora_rank is None:
        specs.update({**matrix("wq", (H, heads_qk)), **matrix("wkv_a", (H, cfg.latent_width))})
    else:
        specs.update({**_qkv_a_map(cfg, layers),
                      **vector("q_norm", _ATTN + "q_a_layernorm.weight", cfg.q_lora_rank),
                      **matrix("wq_b", (cfg.q_lora_rank, heads_qk))})
    if group == "dense":
        I = cfg.intermediate_size
        return {**specs, **matrix("w_gate", (H, I)), **matrix("w_up", (H, I)), **matrix("w_down", (I, H))}
    shared = cfg.moe_intermediate_size * cfg.n_shared_experts
    specs.update({"w_router": LeafSpec((_MLP + "gate.weight",), L + (H, cfg.n_routed_experts), True,
                                       dtype="float32", layer_indices=layers)})
    if cfg.topk_method == "noaux_tc":
        specs.update(vector("router_bias", _MLP + "gate.e_score_correction_bias", cfg.n_routed_experts, "float32"))
    if shared:
        specs.update({**matrix("ws_gate", (H, shared)), **matrix("ws_up", (H, shared)),
                      **matrix("ws_down", (shared, H))})
    return {**specs, **_experts_map(cfg, layers)}


def _qkv_a_map(cfg: DeepseekConfig, layers: tuple[int, ...]) -> dict[str, LeafSpec]:
    """wqkv_a [hidden, q_width + latent_width]: q_a_proj and kv_a_proj_with_mqa side by side (mla.py), q_a's
    columns zero-padded to q_width; FP8: their block scales side by side likewise."""
    H, q, kv = cfg.hidden_size, cfg.q_lora_rank, cfg.latent_width
    width = fused_q_width(q, cfg.block)
    names = (_ATTN + "q_a_proj.weight", _ATTN + "kv_a_proj_with_mqa.weight")

    def side_by_side(padding: int):
        def combine(parts):
            q_part, kv_part = (part.T for part in parts)
            return np.concatenate([q_part, np.zeros((q_part.shape[0], padding), q_part.dtype), kv_part], axis=1)
        return combine

    fp8 = cfg.fp8_block is not None
    specs = {"wqkv_a": LeafSpec(names, (len(layers), H, width + kv), dtype="float8_e4m3fn" if fp8 else None,
                                combine=side_by_side(width - q), part_shapes=((q, H), (kv, H)),
                                layer_indices=layers)}
    if fp8:
        b_out, b_in = cfg.fp8_block
        rows, q_blocks, kv_blocks = -(-H // b_in), width // b_out, -(-kv // b_out)
        specs["wqkv_a_scale"] = LeafSpec(tuple(name + "_scale_inv" for name in names),
                                         (len(layers), rows, q_blocks + kv_blocks), dtype="float32",
                                         combine=side_by_side(0), part_shapes=((q_blocks, rows), (kv_blocks, rows)),
                                         layer_indices=layers)
    return specs


def _kv_b_map(cfg: DeepseekConfig, layers: tuple[int, ...]) -> dict[str, LeafSpec]:
    """w_uk [H, nope, R] and w_uv [H, R, v] out of kv_b_proj.weight [H * (nope + v), R] (dequantized here when
    FP8: the absorbed attention reads them per head, and vLLM keeps them dequantized too)."""
    H, R, nope, v = cfg.num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
    hf = _ATTN + "kv_b_proj.weight"
    names, shapes = (hf,), ((H * (nope + v), R),)
    if cfg.fp8_block is not None:
        grid = (-(-H * (nope + v) // cfg.fp8_block[0]), -(-R // cfg.fp8_block[1]))
        names, shapes = (hf, hf + "_scale_inv"), shapes + (grid,)

    def part(index):
        def combine(parts):
            weight = parts[0] if len(parts) == 1 else np.asarray(
                dequantize_blocks(jnp.asarray(parts[0]), jnp.asarray(parts[1]), cfg.fp8_block))
            return split_kv_b(weight.astype(np.float32), H, nope, v)[index]
        return combine

    return {name: LeafSpec(names, (len(layers), H) + shape, combine=part(index), part_shapes=shapes,
                           layer_indices=layers)
            for index, (name, shape) in enumerate((("w_uk", (nope, R)), ("w_uv", (R, v))))}


def _experts_map(cfg: DeepseekConfig, layers: tuple[int, ...]) -> dict[str, LeafSpec]:
    """we_gate / we_up [E, H, I] and we_down [E, I, H]: the per-expert tensors of a layer stacked, transposed
    (and their FP8 block scales likewise)."""
    E, H, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    fp8 = cfg.fp8_block is not None

    def stacked(parts):
        return np.stack([part.T for part in parts])

    specs = {}
    for name, proj, shape in (("we_gate", "gate_proj", (H, I)), ("we_up", "up_proj", (H, I)),
                              ("we_down", "down_proj", (I, H))):
        names = tuple(f"{_MLP}experts.{e}.{proj}.weight" for e in range(E))
        specs[name] = LeafSpec(names, (len(layers), E) + shape, dtype="float8_e4m3fn" if fp8 else None,
                               combine=stacked, part_shapes=(shape[::-1],) * E, layer_indices=layers)
        if fp8:
            b_out, b_in = cfg.fp8_block
            grid = (-(-shape[0] // b_in), -(-shape[1] // b_out))
            specs[name + "_scale"] = LeafSpec(tuple(n + "_scale_inv" for n in names), (len(layers), E) + grid,
                                              dtype="float32", combine=stacked, part_shapes=(grid[::-1],) * E,
                                              layer_indices=layers)
    return specs


def ignored_tensors(cfg: DeepseekConfig) -> str | None:
    """Checkpoint tensors the target does not read: the MTP layers after the last decoder layer."""
    if not cfg.num_nextn_predict_layers:
        return None
    mtp = "|".join(str(cfg.num_layers + i) for i in range(cfg.num_nextn_predict_layers))
    return rf"model\.layers\.({mtp})\."


def partition_rules(cfg: DeepseekConfig, tensor_parallel_size: int) -> PartitionRules:
    """MLA heads split (q_b / q columns and w_uk / w_uv by head, o rows), the latent path (q_a, kv_a and their
    norms) replicated; the dense MLP and the shared experts Megatron-style (gate/up by column, down by row);
    the routed experts split over the expert axis (expert parallel: models/moe.py, one all-reduce per layer), the
    shared experts by intermediate column where they divide (in whole FP8 blocks); embedding and lm_head by
    vocabulary. Other FP8 block scales are small and replicated. A vocabulary not divisible by tp is
    replicated."""
    vocab = -2 if cfg.vocab_size % tensor_parallel_size == 0 else None
    shared = splits_shared(cfg.moe_intermediate_size * cfg.n_shared_experts, tensor_parallel_size, cfg.block)
    rules: dict[str, int | None] = {
        "embed": vocab, "lm_head": -1 if vocab is not None else None, "final_norm": None,
        "attn_norm": None, "mlp_norm": None, "q_norm": None, "kv_norm": None, "wqkv_a": None, "wkv_a": None,
        "wq": -1, "wq_b": -1, "w_uk": -3, "w_uv": -3, "wo": -2,
        "w_gate": -1, "w_up": -1, "w_down": -2, "w_router": None, "router_bias": None,
        "ws_gate": -1 if shared else None, "ws_up": -1 if shared else None, "ws_down": -2 if shared else None}
    scales = {name + "_scale": None for name in rules}
    experts = {name: -3 for name in ("we_gate", "we_up", "we_down", "we_gate_scale", "we_up_scale", "we_down_scale")}
    shared_scales = {name + "_scale": rules[name] for name in ("ws_gate", "ws_up", "ws_down")}
    return {**rules, **scales, **experts, **shared_scales}


def check_tensor_parallel(cfg: DeepseekConfig, tensor_parallel_size: int, *, field: str) -> None:
    """Heads, routed experts and the MLPs' intermediate sizes must divide over the devices."""
    tp = tensor_parallel_size
    sizes = {"num_attention_heads": cfg.num_heads, "n_routed_experts": cfg.n_routed_experts,
             "intermediate_size": cfg.intermediate_size,
             "moe_intermediate_size * n_shared_experts": cfg.moe_intermediate_size * cfg.n_shared_experts}
    for name, size in sizes.items():
        if size % tp:
            raise ValueError(f"the model's {name}={size} is not divisible by {field}={tp}: use a divisor of {size}")


# ---------------------------------------------------------------------------------------------- module

def init_leaf(path: str, spec: LeafSpec, dtype, key: jax.Array) -> jax.Array:
    """Random weights for benchmarks and tests: norms 1, the router bias 0, FP8 weights of unit scale under
    scales of 0.02, other matrices normal * 0.02."""
    name = path.rsplit("/", 1)[-1]
    leaf_dtype = jnp.dtype(spec.dtype) if spec.dtype else dtype
    if name.endswith("norm"):
        return jnp.ones(spec.shape, leaf_dtype)
    if name == "router_bias":
        return jnp.zeros(spec.shape, leaf_dtype)
    if name.endswith("_scale"):
        return jnp.full(spec.shape, 0.02, leaf_dtype)
    return random_init.normal(key, tuple(spec.shape), leaf_dtype, 1.0 if spec.dtype == "float8_e4m3fn" else 0.02)


def _as_nnx(tree: Any) -> Any:
    """Nested dicts of arrays (int keys: one entry per layer) as nnx containers of Params, for the module's
    attributes."""
    if not isinstance(tree, dict):
        return nnx.Param(tree)
    if tree and all(isinstance(key, int) for key in tree):
        return nnx.List([_as_nnx(tree[i]) for i in range(len(tree))])
    return nnx.Dict({key: _as_nnx(value) for key, value in tree.items()})


def unstack_groups(params: dict, cfg: DeepseekConfig) -> dict:
    """A checkpoint's tree (each group's leaves stacked over its layers) in the per-layer layout
    {group: {j: {...}}}; consumes `params` leaf by leaf (family.unstack_leaves)."""
    for group, layers in cfg.group_layers.items():
        if layers:
            params[group] = unstack_leaves(params.pop(group), len(layers))
    return params


class DeepseekForCausalLM(nnx.Module):
    supports_trees = True

    def __init__(self, cfg: DeepseekConfig, *, dtype=jnp.float32, rngs: nnx.Rngs,
                 kernels: KernelPolicy = KernelPolicy(), unroll_layers: bool | None = None):
        self.cfg = cfg
        self.kernels = kernels
        self.unroll_layers = default_unroll() if unroll_layers is None else unroll_layers
        # No name holds the flat leaves: unstacking frees each stacked leaf once split.
        tree = nest_paths({path: init_leaf(path, spec, dtype, rngs.params()) for path, spec in weight_map(cfg).items()})
        if self.unroll_layers:
            tree = unstack_groups(tree, cfg)
        for name, value in tree.items():
            setattr(self, name, _as_nnx(value))

    def __call__(self, tokens: jax.Array, start: jax.Array, cache: LatentCache,
                 capture_layers: tuple[int, ...] = (), fresh: bool = False,
                 tree: TreeMask | None = None) -> tuple[jax.Array, LatentCache, ForwardAux]:
        """Run T tokens per row [B, T] at positions start[b] .. start[b]+T-1 (the CausalLM contract)."""
        h = self.embed[...][tokens]
        latent, entering = cache.latent, []
        for group, layers in self.cfg.group_layers.items():
            if layers:
                h, latent, inputs = self._run_group(group, layers, h, latent, start, fresh, tree)
                entering.extend(inputs)
        captured = jnp.concatenate([entering[i] for i in capture_layers], axis=-1) if capture_layers else None
        hidden = rms_norm(h, self.final_norm[...], self.cfg.rms_norm_eps)
        return hidden, LatentCache(latent), ForwardAux(captured)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Vocabulary logits in fp32 for final-normed hidden states [..., H]."""
        head = self.embed[...].T if self.cfg.tie_word_embeddings else self.lm_head[...]
        return jnp.dot(hidden, head, preferred_element_type=jnp.float32)

    def init_cache(self, batch: int, max_len: int) -> LatentCache:
        cfg = self.cfg
        return LatentCache.init(cfg.num_layers, batch, max_len, cfg.latent_width, self.embed[...].dtype)

    def cache_bytes(self, batch: int, max_len: int, tensor_parallel_size: int = 1) -> int:
        cfg = self.cfg
        return LatentCache.bytes(cfg.num_layers, batch, max_len, cfg.latent_width, self.embed[...].dtype)

    def _run_group(self, group: str, layers: tuple[int, ...], h, latent, start, fresh, tree):
        """The group's layers over (h, latent): scanned over stacked weights or unrolled over per-layer ones.
        Returns h, latent and the residual stream entering each of its layers."""
        layer_fn = self._layer_fn(group, start, fresh, tree)
        weights = getattr(self, group)
        if self.unroll_layers:
            inputs, carry = [], (h, latent)
            for index, layer_weights in zip(layers, weights):
                carry, h_in = layer_fn(carry, (_arrays(layer_weights), jnp.int32(index)))
                inputs.append(h_in)
            return carry[0], carry[1], inputs
        (h, latent), stacked_inputs = jax.lax.scan(layer_fn, (h, latent),
                                                   (_arrays(weights), jnp.asarray(layers, jnp.int32)))
        return h, latent, list(stacked_inputs)

    def _layer_fn(self, group: str, start: jax.Array, fresh: bool, tree: TreeMask | None):
        def layer(carry, xs):
            h, latent = carry
            w, index = xs
            out, latent = decoder_layer(h, latent, w, index, start, self.cfg, self.kernels, moe_layer=group == "moe",
                                        fresh=fresh, tree=tree)
            return (out, latent), h

        return layer


def decoder_layer(h: jax.Array, latent: jax.Array, w: Mapping[str, jax.Array], index: jax.Array | int,
                  start: jax.Array, cfg: DeepseekConfig, kernels: KernelPolicy, *, moe_layer: bool,
                  fresh: bool = False, tree: TreeMask | None = None) -> tuple[jax.Array, jax.Array]:
    """One DeepSeek decoder layer on h [B, T, H] at positions start[b] + t (a draft tree's: tree.positions):
    h += MLA(input_norm(h)) over layer `index` of the latent cache, then h += MLP(post_attention_norm(h)), the
    MLP dense or MoE. The target's layers and its MTP layers' blocks run this. Returns (h, latent)."""
    rotate = rotary(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling, interleaved=cfg.rope_interleave,
                    max_position_embeddings=cfg.max_position_embeddings)
    attn, latent = mla_attention(h, w, latent, index, start,
                                 rotate=rotate, rope_interleaved=cfg.rope_interleave,
                                 scale=yarn_softmax_scale(cfg.qk_head_dim, cfg.rope_scaling),
                                 absorbed=kernels.mla_absorbed and not fresh, block=cfg.block, tree=tree,
                                 kernels=kernels, norm=(w["attn_norm"], cfg.rms_norm_eps))
    h = h + attn
    norm = (w["mlp_norm"], cfg.rms_norm_eps)
    if moe_layer:
        return h + moe(h, w, cfg.routing, kernels=kernels, block=cfg.block, norm=norm), latent
    return h + swiglu_mlp(h, w, "w_", cfg.block, kernels, norm=norm), latent


def _arrays(weights: nnx.Dict) -> dict[str, jax.Array]:
    return {name: var[...] for name, var in weights.items()}


# ---------------------------------------------------------------------------------------------- family

class DeepseekFamily:
    name = "deepseek"
    architectures = ARCHITECTURES
    config_from_hf = staticmethod(DeepseekConfig.from_hf_dict)
    weight_map = staticmethod(weight_map)
    partition_rules = staticmethod(partition_rules)
    check_tensor_parallel = staticmethod(check_tensor_parallel)
    ignored_tensors = staticmethod(ignored_tensors)

    @staticmethod
    def build(cfg: DeepseekConfig, params: dict, *, kernels: KernelPolicy = KernelPolicy(),
              unroll_layers: bool | None = None) -> DeepseekForCausalLM:
        """The module holding `params` (each group stacked over its layers), consumed when unrolled."""
        return module_from_params(DeepseekForCausalLM, cfg, params, kernels=kernels, unroll_layers=unroll_layers,
                                  unstack=lambda tree: unstack_groups(tree, cfg))

    @staticmethod
    def random(cfg: DeepseekConfig, *, dtype: np.dtype = jnp.float32, seed: int = 0,
               kernels: KernelPolicy = KernelPolicy(), unroll_layers: bool | None = None) -> DeepseekForCausalLM:
        return DeepseekForCausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(seed), kernels=kernels,
                                   unroll_layers=unroll_layers)


FAMILY = DeepseekFamily()
