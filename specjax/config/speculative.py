"""`speculative_config`: vLLM's keys, defaults, method inference and validation; the draft's compatibility."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from collections.abc import Mapping
from typing import Any, Protocol

from specjax.config.draft_tree import TreeShape, parse_tree
from specjax.config.speculation_policy import SpeculationPolicy, parse_policy
from specjax.config.validators import (ANY, check_int, check_optional_str, is_number, optional_bool,
                                       path_or_id)

KNOWN_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp")
# Model families whose checkpoints carry MTP layers, for the error a target without them gets.
MTP_FAMILIES = "DeepSeek-V3 / V3.1 / R1 (num_nextn_predict_layers) and MiMo-7B (model.mtp_layers)"
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
REJECTION_SAMPLE_METHODS = ("standard", "synthetic")
# vLLM's default n-gram window when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5

SPEC_KEYS = (
    "method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
    "draft_tensor_parallel_size", "max_model_len", "revision", "enforce_eager", "draft_sample_method",
    "rejection_sample_method", "synthetic_acceptance_rates", "synthetic_acceptance_length",
    "num_speculative_tokens_per_batch_size", "speculation_policy", "step_costs", "tree_nodes", "tree_branching",
)
# vLLM speculative_config keys for its CUDA engine: accepted only at these neutral values.
SPEC_NO_EFFECT_KEYS: dict[str, Any] = {
    "quantization": None,
    "code_revision": ANY,
    "disable_padded_drafter_batch": ANY,
    "attention_backend": ANY,
}


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """A validated `speculative_config` (vLLM's keys and defaults).

    method: "ngram", "draft_model", "eagle", "eagle3" or "mtp". model: the draft / head
    checkpoint; None for ngram, and for mtp (the target's own MTP layers).
    prompt_lookup_min/max: the n-gram window (ngram only; 0 for other methods, as vLLM).
    draft_tensor_parallel_size: 1 or the target's (default the target's).
    max_model_len: the draft's length limit, at most the target's (default the target's).
    enforce_eager: None inherits the target's setting.
    synthetic_acceptance_rates: when rejection_sample_method is "synthetic", the resolved
    per-position *unconditional* rates: entry i is P(the first i+1 drafts are all accepted).
    policy: how many of num_speculative_tokens (the most) each iteration drafts (speculation_policy.py).
    tree: the draft tree (draft_tree.py), num_speculative_tokens its depth; None drafts chains.
    """

    method: str
    num_speculative_tokens: int
    max_model_len: int
    draft_tensor_parallel_size: int
    model: str | None = None
    prompt_lookup_max: int = 0
    prompt_lookup_min: int = 0
    revision: str | None = None
    enforce_eager: bool | None = None
    draft_sample_method: str = "greedy"
    rejection_sample_method: str = "standard"
    synthetic_acceptance_rates: tuple[float, ...] | None = None
    policy: SpeculationPolicy | None = None
    tree: TreeShape | None = None

    def __post_init__(self):
        if self.policy is None:
            object.__setattr__(self, "policy", SpeculationPolicy("fixed", (self.num_speculative_tokens,)))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None, *, target_max_model_len: int,
                  target_tensor_parallel_size: int, target_mtp_layers: int = 0) -> SpeculativeConfig | None:
        """Parse and validate `speculative_config`; None (no speculation) stays None. target_mtp_layers: the MTP
        layers method "mtp" drafts with (the target's, or those of the MTP head given as 'model')."""
        if d is None:
            return None
        check_int(target_max_model_len, "target_max_model_len", minimum=1)
        check_int(target_tensor_parallel_size, "target_tensor_parallel_size", minimum=1)
        if not isinstance(d, Mapping):
            raise TypeError(f"speculative_config must be a dict or None, got {d!r}")
        d = _spec_keys_checked(d)
        method, model = _infer_method(d.get("method"), d.get("model"))
        if method == "mtp":
            k = _mtp_k(d.get("num_speculative_tokens"), target_mtp_layers, model)
        else:
            k = _required_k(d.get("num_speculative_tokens"))
        if k >= target_max_model_len:
            raise ValueError(f"speculative_config num_speculative_tokens={k} leaves no room within max_model_len="
                             f"{target_max_model_len}: draft fewer tokens than max_model_len (a few, e.g. 3-5)")
        lookup_min, lookup_max = _prompt_lookup(method, d.get("prompt_lookup_min"), d.get("prompt_lookup_max"))
        draft_sample, rejection_sample = _sample_methods(d)
        policy = parse_policy(d.get("speculation_policy"), d.get("num_speculative_tokens_per_batch_size"),
                              d.get("step_costs"), k, tree=d.get("tree_nodes") is not None)
        return cls(
            method=method, num_speculative_tokens=k, model=model,
            prompt_lookup_max=lookup_max, prompt_lookup_min=lookup_min,
            draft_tensor_parallel_size=_draft_tp(d.get("draft_tensor_parallel_size"), target_tensor_parallel_size),
            max_model_len=_draft_max_model_len(d.get("max_model_len"), target_max_model_len),
            revision=check_optional_str(d.get("revision"), "speculative_config['revision']"),
            enforce_eager=optional_bool(d.get("enforce_eager"), "speculative_config['enforce_eager']"),
            draft_sample_method=draft_sample, rejection_sample_method=rejection_sample,
            synthetic_acceptance_rates=_synthetic_rates(rejection_sample, k, d.get("synthetic_acceptance_rates"),
                                                        d.get("synthetic_acceptance_length")),
            policy=policy,
            tree=parse_tree(d, method, k, draft_sample, rejection_sample == "synthetic"),
        )

    def synthetic_rates(self) -> tuple[float, ...] | None:
        """Per-position *conditional* acceptance probabilities for synthetic rejection (else None).

        Entry i is P(draft i accepted | drafts 0..i-1 accepted) = u_i / u_{i-1} (u_{-1} = 1),
        from the unconditional rates u; 0 after a zero, where the chain has already stopped.
        As in vLLM, the sampler accepts draft i iff a fresh uniform < entry i, stops at the
        first rejection, and emits the target's own token there.
        """
        rates = self.synthetic_acceptance_rates
        if rates is None:
            return None
        previous = (1.0, *rates[:-1])
        return tuple(u / p if p > 0 else 0.0 for u, p in zip(rates, previous))


class _HasVocab(Protocol):
    vocab_size: int


def check_draft_compatible(target_cfg: _HasVocab, draft_cfg: _HasVocab) -> None:
    """A draft model must share the target's vocabulary (vLLM checks the same)."""
    if target_cfg.vocab_size != draft_cfg.vocab_size:
        raise ValueError(
            f"The draft model's vocab_size={draft_cfg.vocab_size} differs from the target's "
            f"vocab_size={target_cfg.vocab_size}: draft tokens would index the wrong vocabulary. "
            "Use a draft model with the same tokenizer and vocabulary size as the target "
            "(usually a smaller model of the same family).")


def _spec_keys_checked(d: Mapping[str, Any]) -> dict[str, Any]:
    """Reject tensor_parallel_size and unknown keys; drop vLLM CUDA-only keys with a warning."""
    if "tensor_parallel_size" in d:
        raise ValueError("'tensor_parallel_size' is not a valid key in speculative_config; "
                         "use 'draft_tensor_parallel_size' (1 or the target's tensor_parallel_size)")
    unknown = sorted(set(d) - set(SPEC_KEYS) - set(SPEC_NO_EFFECT_KEYS))
    if unknown:
        raise ValueError(f"speculative_config has unknown key(s) {unknown}; accepted keys: {', '.join(SPEC_KEYS)}")
    for key in set(d) & set(SPEC_NO_EFFECT_KEYS):
        required = SPEC_NO_EFFECT_KEYS[key]
        if required is not ANY and d[key] != required:
            raise ValueError(f"speculative_config[{key!r}]={d[key]!r} is not supported by specjax; "
                             f"remove it or set it to {required!r}")
        warnings.warn(f"speculative_config[{key!r}] has no effect in specjax; ignored", stacklevel=4)
    return {key: value for key, value in d.items() if key in SPEC_KEYS}


def _infer_method(method: Any, model: Any) -> tuple[str, str | None]:
    """vLLM's rules: model "ngram"/"[ngram]" -> ngram; "eagle-" in the model name -> eagle,
    "eagle3" -> eagle3 (even over an explicit draft_model); other models -> draft_model;
    "<family>_mtp" method names are old spellings of "mtp"."""
    if model is not None:
        model = path_or_id(model, "speculative_config['model']")
    if method is not None and not isinstance(method, str):
        raise TypeError(f"speculative_config['method'] must be a string, one of {KNOWN_METHODS}, got {method!r}")
    if method == "[ngram]" or (method is None and model in ("ngram", "[ngram]")):
        method = "ngram"
    elif method is not None and method.endswith("_mtp"):
        warnings.warn(f"speculative_config method {method!r} is deprecated; use 'mtp'", stacklevel=4)
        method = "mtp"
    elif method is None and model is None:
        raise ValueError("speculative_config needs 'method' or 'model': e.g. {'method': 'ngram', "
                         "'num_speculative_tokens': 4} or {'model': '<draft checkpoint>', "
                         "'num_speculative_tokens': 4}")
    elif method in (None, "draft_model"):
        method = _method_from_model_name(model)
    if method not in KNOWN_METHODS:
        raise ValueError(f"speculative_config['method'] must be one of {KNOWN_METHODS}, got {method!r}")
    if method in ("draft_model", "eagle", "eagle3") and model is None:
        raise ValueError(f"speculative_config method {method!r} needs 'model': the draft checkpoint "
                         "(a Hugging Face Hub id or a local directory)")
    return method, None if method == "ngram" else model


def _method_from_model_name(model: str | None) -> str:
    name = (model or "").lower()
    if "eagle-" in name:
        return "eagle"
    if "eagle3" in name:
        return "eagle3"
    return _method_from_local_config(model) or "draft_model"


def _method_from_local_config(model: str | None) -> str | None:
    """A local head directory whose config.json says eagle / eagle3 (speculators_model_type, or an Eagle
    architecture) is that method whatever its name."""
    config_file = os.path.join(os.path.expanduser(model or ""), "config.json")
    if not model or not os.path.isfile(config_file):
        return None
    with open(config_file) as f:
        return method_from_head_config(json.load(f))


def method_from_head_config(d: Mapping[str, Any]) -> str | None:
    """"eagle3" / "eagle" when a head's config.json says so (speculators type, Eagle3 architectures), else
    None."""
    speculators_type = d.get("speculators_model_type")
    if speculators_type is not None:
        return str(speculators_type)
    architectures = " ".join(d.get("architectures") or []).lower()
    if "eagle3" in architectures:
        return "eagle3"
    if "eagle" in architectures:
        return "eagle"
    return None


def _mtp_k(k: Any, mtp_layers: int, model: str | None) -> int:
    """vLLM's rules for method "mtp": k defaults to the number of MTP layers; a larger k must be a multiple of
    it and runs the layers again on their own outputs (with vLLM's warning)."""
    if model is None and mtp_layers == 0:
        raise ValueError(f"speculative_config method 'mtp' drafts with the target's own MTP layers, and this target "
                         f"has none (its config.json sets no num_nextn_predict_layers); targets that ship them: "
                         f"{MTP_FAMILIES}. Pass 'model' (an MTP head directory) or use another method")
    if k is None:
        if mtp_layers == 0:
            raise ValueError("speculative_config needs 'num_speculative_tokens' for an MTP head given as 'model' "
                             "whose config.json declares no num_nextn_predict_layers")
        return mtp_layers
    k = _required_k(k)
    if mtp_layers and k > mtp_layers and k % mtp_layers:
        raise ValueError(f"speculative_config num_speculative_tokens={k} must be a multiple of the "
                         f"{mtp_layers} MTP layers when larger than it")
    if k > 1:
        warnings.warn("Enabling num_speculative_tokens > 1 will run multiple times of forward on same MTP layer, "
                      "which may result in lower acceptance rate", stacklevel=5)
    return k


def _required_k(k: Any) -> int:
    if k is None:
        raise ValueError("speculative_config needs 'num_speculative_tokens' (an int > 0: tokens drafted "
                         "per step, e.g. 4)")
    check_int(k, "speculative_config['num_speculative_tokens']", minimum=1)
    return int(k)


def _prompt_lookup(method: str, lookup_min: Any, lookup_max: Any) -> tuple[int, int]:
    """(min, max) n-gram window: both unset -> 5/5, one set -> mirrored (vLLM); 0/0 off ngram."""
    for name, value in (("prompt_lookup_min", lookup_min), ("prompt_lookup_max", lookup_max)):
        if value is not None:
            check_int(value, f"speculative_config[{name!r}]", minimum=1)
    if method != "ngram":
        return 0, 0
    if lookup_min is None and lookup_max is None:
        return DEFAULT_PROMPT_LOOKUP, DEFAULT_PROMPT_LOOKUP
    lookup_min = lookup_max if lookup_min is None else lookup_min
    lookup_max = lookup_min if lookup_max is None else lookup_max
    if lookup_min > lookup_max:
        raise ValueError(f"speculative_config prompt_lookup_min={lookup_min} must be <= "
                         f"prompt_lookup_max={lookup_max}")
    return int(lookup_min), int(lookup_max)


def _draft_tp(draft_tp: Any, target_tp: int) -> int:
    if draft_tp is None:
        return target_tp
    check_int(draft_tp, "speculative_config['draft_tensor_parallel_size']", minimum=1)
    if draft_tp not in (1, target_tp):
        raise ValueError(f"speculative_config draft_tensor_parallel_size={draft_tp} must be 1 or the target's "
                         f"tensor_parallel_size={target_tp}")
    return int(draft_tp)


def _draft_max_model_len(max_len: Any, target_max_model_len: int) -> int:
    if max_len is None:
        return target_max_model_len
    check_int(max_len, "speculative_config['max_model_len']", minimum=1)
    if max_len > target_max_model_len:
        raise ValueError(f"speculative_config max_model_len={max_len} cannot be larger than the target's "
                         f"max_model_len={target_max_model_len}; lower it or leave it unset")
    return int(max_len)


def _sample_methods(d: Mapping[str, Any]) -> tuple[str, str]:
    draft = d.get("draft_sample_method", "greedy")
    if draft not in DRAFT_SAMPLE_METHODS:
        raise ValueError(f"speculative_config['draft_sample_method'] must be one of {DRAFT_SAMPLE_METHODS}, "
                         f"got {draft!r}")
    rejection = d.get("rejection_sample_method", "standard")
    if rejection == "block":
        raise NotImplementedError("rejection_sample_method='block' is not implemented in specjax; "
                                  f"available: {REJECTION_SAMPLE_METHODS}")
    if rejection not in REJECTION_SAMPLE_METHODS:
        raise ValueError(f"speculative_config['rejection_sample_method'] must be one of "
                         f"{REJECTION_SAMPLE_METHODS}, got {rejection!r}")
    return draft, rejection


def _synthetic_rates(rejection: str, k: int, rates: Any, length: Any) -> tuple[float, ...] | None:
    """vLLM's resolution: exactly one of rates / length, only with rejection "synthetic"."""
    if rejection != "synthetic":
        if rates is not None or length is not None:
            raise ValueError("synthetic_acceptance_rates / synthetic_acceptance_length are only valid with "
                             "rejection_sample_method='synthetic'")
        return None
    if (rates is None) == (length is None):
        raise ValueError("rejection_sample_method='synthetic' needs exactly one of synthetic_acceptance_rates "
                         f"(a list of {k} non-increasing values in [0, 1]) or synthetic_acceptance_length "
                         f"(in [1, {k + 1}])")
    if rates is not None:
        return _checked_rates(rates, k)
    return _rates_from_length(length, k)


def _checked_rates(rates: Any, k: int) -> tuple[float, ...]:
    if not isinstance(rates, (list, tuple)) or not all(is_number(r) for r in rates):
        raise TypeError(f"synthetic_acceptance_rates must be a list of numbers, got {rates!r}")
    if len(rates) != k:
        raise ValueError(f"synthetic_acceptance_rates must have num_speculative_tokens={k} entries, got {rates}")
    if not all(0.0 <= r <= 1.0 for r in rates):
        raise ValueError(f"synthetic_acceptance_rates entries must be in [0, 1], got {rates}")
    if any(later > earlier for earlier, later in zip(rates, rates[1:])):
        raise ValueError(f"synthetic_acceptance_rates must be non-increasing (entry i is the probability that "
                         f"the first i+1 drafts are all accepted), got {rates}")
    return tuple(float(r) for r in rates)


def _rates_from_length(length: Any, k: int) -> tuple[float, ...]:
    """vLLM's minimum-variance schedule: accepted drafts L-1 = whole positions of rate 1, then
    one fractional position, then zeros. E.g. L=2.6, k=3 -> (1.0, 0.6, 0.0)."""
    if not is_number(length) or not math.isfinite(length):
        raise TypeError(f"synthetic_acceptance_length must be a number, got {length!r}")
    if not 1.0 <= length <= k + 1:
        raise ValueError(f"synthetic_acceptance_length must be in [1, {k + 1}] (num_speculative_tokens + 1), "
                         f"got {length}")
    accepted = float(length) - 1.0
    whole = int(accepted)
    return tuple(([1.0] * whole + [accepted - whole] + [0.0] * k)[:k])
