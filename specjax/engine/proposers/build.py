"""SpeculativeConfig -> the proposer the loop runs, and the draft weights it needs."""
from __future__ import annotations

from typing import Any

from flax import nnx
from jax.sharding import Mesh

from checkpoints_conv import load_checkpoint
from checkpoints_conv.eagle_loader import EAGLE_HEAD_FILES, load_eagle_head
from specjax import config as config_lib
from specjax import parallel
from specjax.engine.proposers.base import IgnoresTarget, NoProposer, Proposer
from specjax.engine.proposers.draft_model import DraftModelProposer
from specjax.engine.proposers.eagle import EagleProposer
from specjax.engine.proposers.ngram import propose_ngram
from specjax.hub import resolve_model
from specjax.models.model_config import ModelConfig
from specjax.models.registry import build_model


class NgramProposer(IgnoresTarget):
    """Prompt lookup: stateless, drafts from the row's own committed tokens (q one-hot)."""

    def __init__(self, k: int, min_n: int, max_n: int):
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def init(self, draft_state, prompt_tokens, prompt_lengths, cache_len):
        return None

    def propose(self, draft_state, carry, tokens, lengths, rows):
        return propose_ngram(tokens, lengths, self.k, self.min_n, self.max_n), None, carry


def build_proposer(spec: "config_lib.SpeculativeConfig | None", target_cfg: ModelConfig, dtype,
                   *, attention_impl: str = "auto", unroll_layers: bool | None = None,
                   target_params: Any = None, mesh: Mesh | None = None) -> tuple[Proposer, Any]:
    """target_params: the target's param tree; EAGLE heads share its embedding / lm_head where they lack one.
    mesh: the target's tensor-parallel mesh; a draft model is placed on it (replicated when
    draft_tensor_parallel_size is 1, split like the target when equal), an EAGLE head replicated."""
    if spec is None:
        return NoProposer(), None
    if spec.method == "ngram":
        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max), None
    if spec.method == "draft_model":
        path = resolve_model(spec.model, revision=spec.revision)
        draft_cfg = ModelConfig.from_dir(path)
        config_lib.check_draft_compatible(target_cfg, draft_cfg)
        shardings = parallel.draft_shardings(draft_cfg, mesh, spec.draft_tensor_parallel_size)
        draft = build_model(draft_cfg, load_checkpoint(path, draft_cfg, dtype, shardings),
                            attention_impl=attention_impl, unroll_layers=unroll_layers)
        graph, state = nnx.split(draft)
        proposer = DraftModelProposer(graph, spec.num_speculative_tokens,
                                      probabilistic=spec.draft_sample_method == "probabilistic")
        if mesh is not None and spec.draft_tensor_parallel_size == 1:
            proposer = parallel.Replicated(proposer)
        return proposer, state
    if spec.method in ("eagle", "eagle3"):
        path = resolve_model(spec.model, revision=spec.revision, allow_patterns=EAGLE_HEAD_FILES)
        head = load_eagle_head(path, spec.method, target_cfg, target_params, dtype, attention_impl=attention_impl)
        graph, state = nnx.split(head)
        proposer = EagleProposer(graph, head, spec.num_speculative_tokens,
                                 probabilistic=spec.draft_sample_method == "probabilistic")
        if mesh is None:
            return proposer, state
        # One layer: replicated whatever draft_tensor_parallel_size says; the embedding / lm_head it shares
        # with the target stay split over the vocabulary.
        return parallel.Replicated(proposer), parallel.replicate_onto(state, mesh)
    raise NotImplementedError(f"speculative method {spec.method!r} has no proposer yet; "
                              f"available: {sorted(config_lib.IMPLEMENTED_METHODS)}")
