"""Rotary position embeddings: inverse-frequency tables ("default", "linear", "llama3", "yarn"), YaRN's magnitude
corrections, and the rotation in both layouts.

Semantics follow transformers' rope initialisers (`modeling_rope_utils`) and its DeepSeek attention:
- the tables are float32 numpy arrays [head_dim // 2], built once at trace time;
- `rope_attention_factor` is the multiplier transformers puts on cos and sin (YaRN's "attention_factor"; 1.0 for
  the other types), so it scales q·k of the rotated dims by its square;
- `yarn_softmax_scale` is DeepSeek's softmax scale: head_dim^-1/2 times mscale(factor, mscale_all_dim)^2 whenever the
  rope type is not "default" and `mscale_all_dim` is set (transformers' and vLLM's rule; DeepSeek's own reference
  applies it only when the serving length exceeds the original one).

Layouts of `apply_rope`: rotate-half (NeoX; dims i and i + D/2 form a pair, what HF Llama checkpoints use) and
interleaved (GPT-J; dims 2i and 2i + 1 form a pair, what DeepSeek's weights use). The interleaved output keeps the
pairs in place, as DeepSeek's reference and transformers' DeepSeek-V2 do; transformers' DeepSeek-V3
(`rope_interleave=True`) writes the same values de-interleaved (all even dims, then all odd dims) into q and k alike,
which leaves every q·k unchanged.
"""
from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_type(scaling: dict | None) -> str:
    """The scaling dict's type ("rope_type", or the legacy "type"); "default" without one."""
    scaling = scaling or {}
    return scaling.get("rope_type", scaling.get("type", "default"))


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None, *,
                  max_position_embeddings: int | None = None) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] in fp32 for the rope type of `scaling` (a rope_scaling /
    rope_parameters dict). `max_position_embeddings` is read only by YaRN, for the keys it may derive from it."""
    kind = rope_type(scaling)
    if kind == "default":
        return _base_inv_freq(head_dim, theta)
    if kind == "linear":
        return (_base_inv_freq(head_dim, theta) / scaling["factor"]).astype(np.float32)
    if kind == "llama3":
        return _llama3_inv_freq(_base_inv_freq(head_dim, theta), scaling)
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling, max_position_embeddings)
    raise ValueError(f"rope_scaling type {kind!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")


def _base_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """theta^(-2i / head_dim), the unscaled table."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
    return (1.0 / (theta ** exponents)).astype(np.float32)


def _llama3_inv_freq(inv_freq: np.ndarray, s: dict) -> np.ndarray:
    """Llama 3.1: wavelengths beyond original_len / low_freq_factor slowed by `factor`, those below
    original_len / high_freq_factor kept, a linear blend in the band between."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    original_len = s["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    slowed = np.where(wavelength > original_len / low, inv_freq / factor, inv_freq)
    smooth = (original_len / wavelength - low) / (high - low)
    blended = (1 - smooth) * slowed / factor + smooth * slowed
    in_band = (wavelength >= original_len / high) & (wavelength <= original_len / low)
    return np.where(in_band, blended, slowed).astype(np.float32)


def _yarn_inv_freq(head_dim: int, theta: float, s: dict, max_position_embeddings: int | None) -> np.ndarray:
    """YaRN (NTK-by-parts): dims that turn fewer than beta_slow times over the original context are divided by
    `factor`, those that turn more than beta_fast times are kept, a linear ramp over the dims between."""
    factor = _yarn_factor(s, max_position_embeddings)
    original_len = _original_length(s, max_position_embeddings)
    base_freqs = theta ** (np.arange(0, head_dim, 2).astype(np.float32) / head_dim)
    kept = (1.0 / base_freqs).astype(np.float32)
    slowed = (1.0 / (factor * base_freqs)).astype(np.float32)
    low, high = _yarn_correction_range(s.get("beta_fast") or 32, s.get("beta_slow") or 1, head_dim, theta,
                                       original_len, s.get("truncate", True))
    keep_weight = 1 - _linear_ramp(low, high, head_dim // 2)
    return (slowed * (1 - keep_weight) + kept * keep_weight).astype(np.float32)


def _yarn_factor(s: dict, max_position_embeddings: int | None) -> float:
    """`factor`, or (as transformers derives it when the key is null) max positions over the original length."""
    if s.get("factor") is not None:
        return s["factor"]
    if max_position_embeddings is None:
        raise ValueError("yarn rope_scaling without a factor needs max_position_embeddings to derive it")
    return max_position_embeddings / _original_length(s, max_position_embeddings)


def _original_length(s: dict, max_position_embeddings: int | None) -> int:
    """The pretraining context; transformers falls back to max_position_embeddings when the key is absent."""
    length = s.get("original_max_position_embeddings", max_position_embeddings)
    if length is None:
        raise ValueError("yarn rope_scaling needs original_max_position_embeddings (or max_position_embeddings)")
    return length


def _yarn_correction_range(beta_fast: float, beta_slow: float, dim: int, theta: float, original_len: int,
                           truncate: bool) -> tuple[float, float]:
    """The dim indices where the ramp starts (beta_fast rotations) and ends (beta_slow), clamped to [0, dim-1];
    rounded outward to integers unless `truncate` is false."""
    def dim_with_rotations(rotations: float) -> float:
        return dim * math.log(original_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_with_rotations(beta_fast), dim_with_rotations(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _linear_ramp(low: float, high: float, n: int) -> np.ndarray:
    """0 up to index `low`, 1 from `high`, linear between (fp32)."""
    if low == high:
        high += 0.001   # a zero-width ramp would divide by zero
    ramp = (np.arange(n, dtype=np.float32) - np.float32(low)) / np.float32(high - low)
    return np.clip(ramp, 0, 1).astype(np.float32)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1.0 when not extending, factor <= 1)."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: dict | None, *, max_position_embeddings: int | None = None) -> float:
    """The multiplier on cos and sin: for YaRN an explicit "attention_factor", else
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set (1.0 for DeepSeek-V3, whose two are
    equal), else mscale(factor); 1.0 for every other rope type."""
    if rope_type(scaling) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(scaling, max_position_embeddings)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
    return yarn_mscale(factor)


def yarn_softmax_scale(qk_head_dim: int, scaling: dict | None) -> float:
    """DeepSeek's attention softmax scale: qk_head_dim^-1/2, times mscale(factor, mscale_all_dim)^2 when the rope
    type is not "default" and mscale_all_dim is non-zero (about 1.874 for DeepSeek-V3's factor 40)."""
    scale = qk_head_dim ** -0.5
    mscale_all_dim = (scaling or {}).get("mscale_all_dim", 0)
    if rope_type(scaling) == "default" or not mscale_all_dim:
        return scale
    mscale = yarn_mscale(scaling["factor"], mscale_all_dim)
    return scale * mscale * mscale


# rotate(x [B, T, H, D], positions [B, T]) -> x rotated: a model's rope with its table, layout and factor bound.
Rotate = Callable[[jax.Array, jax.Array], jax.Array]


def rotary(head_dim: int, theta: float, scaling: dict | None, *, interleaved: bool = False,
           max_position_embeddings: int | None = None) -> Rotate:
    """The rotation a model applies to its q and k (built once at trace time)."""
    return functools.partial(apply_rope, inv_freq=rope_inv_freq(head_dim, theta, scaling,
                                                                max_position_embeddings=max_position_embeddings),
                             interleaved=interleaved,
                             attention_factor=rope_attention_factor(scaling,
                                                                    max_position_embeddings=max_position_embeddings))


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, *, interleaved: bool,
               attention_factor: float = 1.0) -> jax.Array:
    """Rotate x [B, T, H, D] by its absolute positions [B, T], in fp32, cast back to x's dtype.

    interleaved=False: rotate-half pairs (i, i + D/2). interleaved=True: adjacent pairs (2i, 2i + 1), output in the
    same interleaved layout. cos and sin are multiplied by `attention_factor` (rope_attention_factor)."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)   # [B, T, D/2]
    cos = (jnp.cos(angles) * attention_factor)[:, :, None, :]
    sin = (jnp.sin(angles) * attention_factor)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    if interleaved:
        pairs = x32.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
        first, second = _rotate(pairs[..., 0], pairs[..., 1], cos, sin)
        rotated = jnp.stack([first, second], axis=-1).reshape(x.shape)
    else:
        first, second = _rotate(*jnp.split(x32, 2, axis=-1), cos, sin)
        rotated = jnp.concatenate([first, second], axis=-1)
    return rotated.astype(x.dtype)


def _rotate(a: jax.Array, b: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each pair (a, b) turned by its angle: (a cos - b sin, b cos + a sin)."""
    return a * cos - b * sin, b * cos + a * sin


def unit_rotation(rotate: Rotate, positions: jax.Array, rope: int, interleaved: bool) -> jax.Array:
    """[B * T, rope] fp32: the cos and sin `rotate` turns each pair by at positions [B, T], where the pair's first
    and second values lie (interleaved: (2i, 2i + 1), else (i, i + rope / 2)): the rotation of unit pairs (1, 0)
    in fp32, which is (cos, sin) exactly. For a kernel that rotates as `rotate` does (kernels/latent_rows.py)."""
    units = np.zeros((rope,), np.float32)   # a constant of the program: no launches to build it
    units[slice(0, None, 2) if interleaved else slice(0, rope // 2)] = 1.0
    return rotate(jnp.broadcast_to(units, (*positions.shape, 1, rope)), positions).reshape(-1, rope)
