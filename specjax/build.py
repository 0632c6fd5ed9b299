"""The build layer: validated `LLM(...)` settings -> everything the engine runs (the resolved config, the target
module and weights, the tokenizer, the proposer and its weights, the mesh). Hub resolution, weight loading and
the memory check happen here, nowhere in the engine.

Proposers are built from one table, PROPOSER_BUILDERS {method: builder}: a new speculative method adds its
proposer under specjax/engine/proposers/ and its builder here.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Callable, Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from transformers import GenerationConfig

from checkpoints_conv.eagle_loader import EAGLE_HEAD_FILES, load_eagle_head
from checkpoints_conv.mtp_loader import load_mtp_head
from checkpoints_conv.orbax_io import load_checkpoint
from specjax.config import EngineConfig, SpeculativeConfig, check_draft_compatible, check_kv_cache_fits
from specjax.config.dtypes import NUMPY_DTYPES
from specjax.config.speculation_policy import PROBE_EVERY
from specjax.engine.proposers.base import NoProposer, Proposer, spare_slots
from specjax.engine.proposers.draft_model import DraftModelProposer
from specjax.engine.proposers.eagle import HeadProposer
from specjax.engine.proposers.ngram import NgramProposer
from specjax.engine.shapes import buffer_len
from specjax.hub import load_tokenizer, resolve_model
from specjax.kernels.policy import KernelPolicy
from specjax.models.family import CausalLM, ModelConfig, ModelFamily
from specjax.models.mtp import num_mtp_layers
from specjax.models.registry import config_from_hf, read_config_json
from specjax.parallel.mesh import build_mesh
from specjax.parallel.plan import param_shardings, replicate_onto
from specjax.parallel.sharded_loop import Replicated


@dataclasses.dataclass(frozen=True)
class Target:
    """The loaded target and what its proposer may share or must match."""
    family: ModelFamily
    cfg: ModelConfig
    model_dir: Path
    module: CausalLM
    graph: nnx.GraphDef
    params: Any
    dtype: np.dtype
    kernels: KernelPolicy
    mesh: Mesh | None


@dataclasses.dataclass(frozen=True)
class Engine:
    """What `LLM` runs: the resolved config and the built pieces."""
    config: EngineConfig
    model_dir: Path
    tokenizer: Any
    target: Target
    proposer: Proposer
    draft_params: Any
    sampling_defaults: dict


def build_engine(config: EngineConfig) -> Engine:
    """Resolve `config` against the model, check what can be checked before loading (speculative config,
    tensor-parallel split), load the target and the proposer, then check that every cache fits."""
    path = resolve_model(config.model, revision=config.revision)
    hf_config = read_config_json(path)
    family, model_cfg = config_from_hf(hf_config)
    config = config.resolve(model_cfg, _mtp_layers(hf_config, config.speculative_config))
    tokenizer = load_tokenizer(path if config.tokenizer == config.model else config.tokenizer,
                               trust_remote_code=config.trust_remote_code)
    target = load_target(family, model_cfg, path, config)
    proposer, draft_params = build_proposer(config.speculative, target, unroll_layers=config.unroll_layers)
    check_caches_fit(config, target, proposer, free_device_bytes())
    return Engine(config=config, model_dir=path, tokenizer=tokenizer, target=target, proposer=proposer,
                  draft_params=draft_params, sampling_defaults=generation_config_defaults(path))


def load_target(family: ModelFamily, cfg: ModelConfig, path: Path, config: EngineConfig) -> Target:
    """The target's weights straight onto their devices (split over the mesh at tensor_parallel_size > 1)."""
    tp = config.tensor_parallel_size
    mesh = shardings = None
    weight_map = family.weight_map(cfg)
    if tp > 1:
        mesh = build_mesh(tp)
        family.check_tensor_parallel(cfg, tp, field="tensor_parallel_size")
        shardings = param_shardings(_shapes(weight_map), family.partition_rules(cfg, tp), mesh)
    dtype = NUMPY_DTYPES[config.dtype]
    kernels = KernelPolicy(impl=config.attention_impl)
    params = load_checkpoint(path, weight_map, dtype, shardings, ignored=family.ignored_tensors(cfg))
    module = family.build(cfg, params, kernels=kernels, unroll_layers=config.unroll_layers)
    graph, params = nnx.split(module)
    return Target(family=family, cfg=cfg, model_dir=path, module=module, graph=graph, params=params, dtype=dtype,
                  kernels=kernels, mesh=mesh)


def build_proposer(spec: SpeculativeConfig | None, target: Target, *,
                   unroll_layers: bool | None = None) -> tuple[Proposer, Any]:
    """The proposer of spec.method and its weights (None when it has none)."""
    if spec is None:
        return NoProposer(), None
    if spec.method not in PROPOSER_BUILDERS:
        raise NotImplementedError(f"speculative method {spec.method!r} has no proposer yet; "
                                  f"available: {sorted(PROPOSER_BUILDERS)}")
    if spec.tree is not None and not target.module.supports_trees:
        raise ValueError(f"speculative_config['tree_nodes']: this target ({target.cfg.architecture}) cannot verify "
                         "a draft tree yet; drop tree_nodes to draft chains")
    return PROPOSER_BUILDERS[spec.method](spec, target, unroll_layers)


def _ngram(spec: SpeculativeConfig, target: Target, unroll_layers: bool | None) -> tuple[Proposer, Any]:
    return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max,
                         tree=spec.tree), None


def _draft_model(spec: SpeculativeConfig, target: Target, unroll_layers: bool | None) -> tuple[Proposer, Any]:
    """A smaller model of the target's vocabulary, placed on the target's mesh: replicated when
    draft_tensor_parallel_size is 1, split like the target when equal."""
    path = resolve_model(spec.model, revision=spec.revision)
    family, cfg = config_from_hf(read_config_json(path))
    check_draft_compatible(target.cfg, cfg)
    weight_map = family.weight_map(cfg)
    shardings, shards = None, 1
    if target.mesh is not None:
        split = spec.draft_tensor_parallel_size > 1
        if split:
            family.check_tensor_parallel(cfg, spec.draft_tensor_parallel_size, field="draft_tensor_parallel_size")
            shards = spec.draft_tensor_parallel_size
        shardings = param_shardings(_shapes(weight_map), family.partition_rules(cfg, shards), target.mesh,
                                    replicated=not split)
    params = load_checkpoint(path, weight_map, target.dtype, shardings, ignored=family.ignored_tensors(cfg))
    draft = family.build(cfg, params, kernels=target.kernels, unroll_layers=unroll_layers)
    if spec.tree is not None and not draft.supports_trees:
        raise ValueError(f"speculative_config['tree_nodes']: this draft model ({cfg.architecture}) cannot draft a "
                         "tree yet; drop tree_nodes to draft chains")
    graph, state = nnx.split(draft)
    proposer = DraftModelProposer(graph, spec.num_speculative_tokens,
                                  probabilistic=spec.draft_sample_method == "probabilistic",
                                  cache_bytes=lambda batch, max_len: draft.cache_bytes(batch, max_len, shards),
                                  tree=spec.tree)
    if target.mesh is not None and shards == 1:
        return Replicated(proposer), state
    return proposer, state


def _eagle(spec: SpeculativeConfig, target: Target, unroll_layers: bool | None) -> tuple[Proposer, Any]:
    """An EAGLE-1 / EAGLE-3 head, sharing the target's embedding (and lm_head where it has none). One layer:
    replicated whatever draft_tensor_parallel_size says; the embedding / lm_head it shares with the target
    stay split over the vocabulary."""
    path = resolve_model(spec.model, revision=spec.revision, allow_patterns=EAGLE_HEAD_FILES)
    head = load_eagle_head(path, spec.method, target.cfg, target.params, target.dtype, kernels=target.kernels)
    return _head_proposer(head, spec, target)


def _mtp_layers(target_config: dict, speculative_config: Any) -> int:
    """The MTP layers method "mtp" drafts with (its num_speculative_tokens defaults to their number): an MTP head
    directory's when one is given as the "model" (a path, a Hub id or a shipped head's name), else the target's."""
    spec = speculative_config if isinstance(speculative_config, Mapping) else {}
    method, model = spec.get("method"), spec.get("model")
    if isinstance(method, str) and method.endswith("mtp") and isinstance(model, (str, Path)):
        return num_mtp_layers(read_config_json(resolve_model(model, revision=spec.get("revision"))))
    return num_mtp_layers(target_config)


def _mtp(spec: SpeculativeConfig, target: Target, unroll_layers: bool | None) -> tuple[Proposer, Any]:
    """The target's own MTP layer (or an MTP head directory's), sharing its embedding and lm_head, replicated
    on every device like an EAGLE head (its block is one decoder layer)."""
    path = target.model_dir if spec.model is None else resolve_model(spec.model, revision=spec.revision)
    head = load_mtp_head(path, target.cfg, target.params, target.dtype, kernels=target.kernels)
    return _head_proposer(head, spec, target)


def _head_proposer(head: Any, spec: SpeculativeConfig, target: Target) -> tuple[Proposer, Any]:
    graph, state = nnx.split(head)
    features = target.cfg.hidden_size * max(1, len(head.capture_layers))
    proposer = HeadProposer(graph, head, spec.num_speculative_tokens,
                            probabilistic=spec.draft_sample_method == "probabilistic", feature_size=features,
                            catch_up_window=PROBE_EVERY if spec.policy.adaptive else 0, tree=spec.tree)
    if target.mesh is None:
        return proposer, state
    return Replicated(proposer), replicate_onto(state, target.mesh)


Builder = Callable[[SpeculativeConfig, Target, "bool | None"], "tuple[Proposer, Any]"]
PROPOSER_BUILDERS: dict[str, Builder] = {"ngram": _ngram, "draft_model": _draft_model, "eagle": _eagle,
                                         "eagle3": _eagle, "mtp": _mtp}


def check_caches_fit(config: EngineConfig, target: Target, proposer: Proposer, free_bytes: int) -> None:
    """Every cache a wave of max_num_seqs rows at max_model_len allocates (the target's, split over the mesh,
    and the proposer's), against `free_bytes`, the device memory left after the weights."""
    slots = buffer_len(config.max_model_len, config.max_model_len, 0, spare_slots(proposer), config.max_model_len)
    need = (target.module.cache_bytes(config.max_num_seqs, slots, config.tensor_parallel_size)
            + proposer.cache_bytes(config.max_num_seqs, slots))
    check_kv_cache_fits(need, free_bytes, config.gpu_memory_utilization,
                        max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs)


def free_device_bytes() -> int:
    """Device memory this process has not used yet. Like vLLM, this counts the device's total memory, not what
    other processes happen to leave free; on CPU the device is host RAM, so that is RAM minus this process's
    resident size."""
    stats = jax.local_devices()[0].memory_stats() or {}  # this process's own device (jax.distributed)
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    page = os.sysconf("SC_PAGE_SIZE")
    resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    return os.sysconf("SC_PHYS_PAGES") * page - resident_pages * page


# generation_config.json field -> SamplingParams field, the ones vLLM takes over as defaults.
_GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                        "max_new_tokens": "max_tokens"}


def generation_config_defaults(model_dir: Path) -> dict:
    """The sampling settings a model's generation_config.json sets explicitly (none when it has no file)."""
    try:
        explicit = GenerationConfig.from_pretrained(model_dir).to_diff_dict()
    except OSError:
        return {}
    return {ours: explicit[theirs] for theirs, ours in _GENERATION_DEFAULTS.items() if theirs in explicit}


def _shapes(weight_map: dict) -> dict[str, tuple[int, ...]]:
    return {path: spec.shape for path, spec in weight_map.items()}
