"""Which devices run the Pallas (Triton) kernels, and the implementation choices every dispatcher takes."""
from __future__ import annotations

from typing import Literal

import jax

# How a kernel call may run: chosen by the device ("auto"), pure JAX, or the Pallas kernel forced.
Impl = Literal["auto", "reference", "triton"]
IMPLS = ("auto", "reference", "triton")
# Triton's Pallas backend needs Ampere (sm_80) or newer.
_MIN_COMPUTE_CAPABILITY = 8


def choose_impl(device: jax.Device) -> Literal["reference", "triton"]:
    """The implementation `impl="auto"` uses on `device`: the kernels on NVIDIA sm_80+, else the reference."""
    if device.platform != "gpu":
        return "reference"
    capability = str(getattr(device, "compute_capability", ""))
    major = capability.split(".")[0]
    # ROCm devices report a gfx name here, not a number: they get the reference.
    if not major.isdigit() or int(major) < _MIN_COMPUTE_CAPABILITY:
        return "reference"
    return "triton"
