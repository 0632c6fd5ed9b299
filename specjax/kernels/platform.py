"""Which devices run the Pallas (Triton) kernels, and the implementation choices every dispatcher takes."""
from __future__ import annotations

from typing import Literal

import jax

from specjax.parallel import current_layout

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


def kernel_mode(impl: Impl, interpret: bool,
                device: jax.Device | None = None) -> Literal["reference", "triton", "auto"]:
    """How a dispatcher of a single-device kernel may run: "reference" when forced so, under tensor
    parallelism (the partitioner cannot split a Pallas or cuDNN call) or on a device without the kernels
    (`device`, the first one by default); "triton" when forced; "auto" where the kernels run (or in interpret
    mode), the dispatcher's own size rule deciding."""
    layout = current_layout()
    if impl == "reference" or (layout is not None and layout.mesh.size > 1):
        return "reference"
    if impl == "triton":
        return "triton"
    device = jax.devices()[0] if device is None else device
    return "auto" if interpret or choose_impl(device) == "triton" else "reference"
