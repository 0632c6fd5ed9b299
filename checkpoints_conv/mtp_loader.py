"""A checkpoint's MTP layers (the target's own, or an MTP head directory written for that target) -> an MtpHead
sharing the target's embedding and lm_head (the checkpoint's duplicates of them are not read, as in vLLM)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np
from flax import nnx

from checkpoints_conv.safetensors_loader import load_params
from specjax.kernels.policy import KernelPolicy
from specjax.models.mtp import MtpHead, mtp_config, mtp_ignored, mtp_weight_map
from specjax.models.registry import read_config_json


def load_mtp_head(path: str | Path, target_cfg: Any, target_params: Mapping[str, Any], dtype: np.dtype, *,
                  kernels: KernelPolicy = KernelPolicy()) -> MtpHead:
    """Read the MTP layer in `path` into an MtpHead in `dtype` (FP8 blocks stay FP8, as the target's)."""
    cfg = mtp_config(read_config_json(path), target_cfg)
    params = load_params(path, mtp_weight_map(cfg), dtype, ignored=mtp_ignored(cfg))
    embed = _array(target_params["embed"])
    params.update(embed=embed, lm_head=embed if target_cfg.tie_word_embeddings else _array(target_params["lm_head"]))
    head = nnx.eval_shape(lambda: MtpHead(cfg, dtype=dtype, rngs=nnx.Rngs(0), kernels=kernels))
    nnx.update(head, params)
    return head


def _array(leaf: Any) -> Any:
    return leaf[...] if isinstance(leaf, nnx.Variable) else leaf
