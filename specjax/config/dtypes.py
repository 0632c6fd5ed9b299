"""The one dtype table: the names a user may give, the names checkpoints use, and the numpy dtypes loaded."""
from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

# Every accepted spelling -> its canonical name ("auto": the checkpoint's own dtype).
DTYPE_ALIASES = {
    "auto": "auto",
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}
NUMPY_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}


def canonical_dtype(dtype: Any) -> str:
    """"auto" | "float32" | "bfloat16" | "float16" from a name, alias, or numpy/JAX/torch dtype."""
    name = dtype if isinstance(dtype, str) else _dtype_name(dtype)
    canonical = DTYPE_ALIASES.get(name.lower().removeprefix("torch.") if isinstance(name, str) else name)
    if canonical is None:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_ALIASES)} (or a float32/bfloat16/float16 "
                         f"dtype object), got {dtype!r}")
    return canonical


def resolve_dtype(dtype: Any, checkpoint_dtype: str) -> np.dtype:
    """The numpy dtype to load weights in: `dtype` ("auto" = `checkpoint_dtype`, config.json's torch_dtype)."""
    name = canonical_dtype(dtype)
    if name == "auto":
        name = canonical_dtype(checkpoint_dtype)
        if name == "auto":
            raise ValueError(f"config.json's torch_dtype {checkpoint_dtype!r} is not a dtype; pass dtype=")
    return NUMPY_DTYPES[name]


def _dtype_name(dtype: Any) -> str | None:
    """The plain name of a numpy / JAX / torch dtype object, e.g. torch.bfloat16 -> "bfloat16"."""
    text = str(dtype)
    if text.startswith("torch."):
        return text.removeprefix("torch.")
    try:
        return np.dtype(dtype).name
    except (TypeError, ValueError):
        return None
