"""Which implementation each kernel call runs: one policy object per model, made once from the engine's
settings and handed to every dispatcher (attention, prefill attention, projection, top-k/top-p).

`impl="auto"` runs the Pallas (Triton) kernels on NVIDIA sm_80+ where they pay, by the thresholds below
(measured on an H200, benchmarks/RESULTS.md), and the pure-JAX references elsewhere; "reference" is pure JAX
everywhere; "triton" forces the kernels. `interpret=True` runs the kernels in Pallas interpret mode (CPU
tests), chosen by the same size rules as on a GPU. `device` is the device whose capabilities "auto"
consults (None: the first JAX device when the call is traced), so a test can ask what a GPU would run.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax

from specjax.parallel.mesh import current_layout

Impl = Literal["auto", "reference", "triton"]
IMPLS = ("auto", "reference", "triton")
# Triton's Pallas backend needs Ampere (sm_80) or newer; its float8 conversions Ada (sm_89) or newer.
_MIN_COMPUTE_CAPABILITY = (8, 0)
_MIN_FP8_COMPUTE_CAPABILITY = (8, 9)


@dataclasses.dataclass(frozen=True)
class KernelPolicy:
    impl: Impl = "auto"
    interpret: bool = False
    device: Any = None
    # Fused norm + projection kernel: weights this small at this few rows (decode steps and short verify passes),
    # where launches and not bytes bound a projection; from 32 rows XLA's GEMM ran the default model's loop faster.
    projection_max_weight_bytes: int = 4 << 20
    projection_max_rows: int = 16
    # Top-k / top-p radix search: from this many batch x vocabulary elements; 2-bit digits from the second.
    search_min_elements: int = 1 << 17
    search_large_elements: int = 1 << 21
    # A fresh prompt of at least this many tokens per row is prefilled through jax.nn.dot_product_attention
    # with this implementation: cuDNN's fused kernel on GPUs ("xla" computes the same anywhere).
    prefill_fused_min_tokens: int = 2048
    prefill_fused_impl: Literal["cudnn", "xla"] = "cudnn"
    # Multi-head latent attention (DeepSeek): decode and verify in the weight-absorbed form over the latent cache
    # (False: every cached row expanded per head, the form transformers computes; prefill always expands).
    mla_absorbed: bool = True
    # MoE experts: "auto" (the grouped matmul kernel where kernels run; elsewhere gathered slices at decode,
    # grouped matmuls beyond), "dense", "grouped", "gathered".
    moe_form: str = "auto"
    # The grouped matmul kernel for MoE experts and few-row projections where kernels run (False: XLA's).
    # A plain (not FP8) stack of experts from this many rows: below it XLA's gathered slices were faster (V2-Lite
    # bf16 at 6 rows: the sort and tile table around the call cost more launches than the bytes saved), while FP8
    # stacks take the kernel at any size (XLA's forms dequantize them first). A single plain matrix (a dense
    # projection) takes it up to dense_kernel_max_plain_rows rows, one tile (XLA's bf16 matvecs there ran at about
    # a quarter of the copy bandwidth); FP8 ones below their block's rows (models/fp8.py `linear`).
    grouped_matmul_kernel: bool = True
    grouped_matmul_min_plain_rows: int = 16
    dense_kernel_max_plain_rows: int = 16
    # FP8 stacks in the kernel multiply FP8 activations (each row's chunk of a scale block's rows quantized to e4m3
    # with its own scale, as DeepSeek-V3's inference and vLLM do): no weight conversion in the kernel's loop, rows
    # rounded to e4m3. Off: the rows keep their values and the weights are converted (what the reference computes,
    # and what runs off the kernels whatever this says); bf16 rows enter the kernel as power-of-two-scaled
    # float16, the same products (kernels/grouped_matmul_triton.py).
    fp8_activations: bool = False
    # MLA's per-head products (W_UK into the queries, W_UV out of the attended latent) in the grouped matmul kernel
    # (rows interleaved by head) up to this many tokens a call; 0: XLA's batched products (not yet timed against
    # them on a GPU: bench_deepseek.py's "head_kernel" form sets 64).
    head_matmul_max_tokens: int = 0
    # Programs a single FP8 projection's K split aims for in the grouped matmul kernel (None: the kernel's
    # default, about four per SM); a function of the weight's shape alone, so decode and verify still round alike
    # (not yet timed against the default on a GPU: bench_deepseek.py's "programsN" forms set N).
    projection_programs: int | None = None
    # MoE routing (scores, group limit, top-k, weights) as one kernel per call, where XLA's ops launch about ten.
    routing_kernel: bool = True
    # MLA's fused q_a / kv_a product summed, its latent row normalised, rotated and written into the cache, and
    # q_a's rows prepared for an FP8 q_b, in one launch where that product runs in the grouped kernel (XLA launched
    # four: kernels/latent_rows.py).
    latent_rows_kernel: bool = True
    # An MLP's gate and up partial sums and SwiGLU as its FP8 down's scaled float16 rows, in one launch where the
    # MLP runs in the grouped kernel and its rows are narrow (an expert's; XLA's fusion and f16_rows were two:
    # kernels/swiglu_rows.py).
    swiglu_rows_kernel: bool = True

    def __post_init__(self) -> None:
        if self.impl not in IMPLS:
            raise ValueError(f"kernel impl must be one of {IMPLS}, got {self.impl!r}")
        if self.projection_programs is not None and self.projection_programs < 1:
            raise ValueError(f"KernelPolicy.projection_programs must be a positive program count or None (the "
                             f"kernel's default), got {self.projection_programs}")

    def mode(self) -> Literal["reference", "triton", "auto"]:
        """How a single-device kernel may run here: "reference" when forced so, under tensor parallelism (the
        partitioner cannot split a Pallas or cuDNN call) or on a device without the kernels; "triton" when
        forced; "auto" where the kernels run (or in interpret mode), the call's own size rule deciding."""
        if self.impl == "reference" or _tensor_parallel():
            return "reference"
        if self.impl == "triton":
            return "triton"
        return "auto" if self.interpret or self.device_has_kernels() else "reference"

    def device_has_kernels(self) -> bool:
        """Whether the Pallas (Triton) kernels run on this policy's device: NVIDIA sm_80+."""
        return has_kernels(self._device())

    def _device(self) -> Any:
        return jax.devices()[0] if self.device is None else self.device

    def use_projection_kernel(self, rows: int, weight_bytes: int) -> bool:
        mode = self.mode()
        small = rows <= self.projection_max_rows and weight_bytes <= self.projection_max_weight_bytes
        return mode == "triton" or (mode == "auto" and small)

    def use_grouped_matmul_kernel(self, fp8: bool, rows: int, groups: int) -> bool:
        """Whether a grouped matmul of `rows` rows over `groups` matrices runs the kernel: FP8 stacks wherever
        kernels run on sm_89+; plain stacks of experts from grouped_matmul_min_plain_rows rows, a single plain
        matrix up to dense_kernel_max_plain_rows."""
        mode = self.mode()
        if mode != "auto":
            return mode == "triton"
        if not fp8:
            fits = (rows <= self.dense_kernel_max_plain_rows if groups == 1
                    else rows >= self.grouped_matmul_min_plain_rows)
            return self.grouped_matmul_kernel and fits
        fp8_ok = self.interpret or has_kernels(self._device(), _MIN_FP8_COMPUTE_CAPABILITY)
        return self.grouped_matmul_kernel and fp8_ok

    def use_head_matmul_kernel(self, tokens: int) -> bool:
        """Whether per-head products (MLA's W_UK / W_UV) of `tokens` tokens run the grouped matmul kernel."""
        mode = self.mode()
        return mode == "triton" or (mode == "auto" and self.grouped_matmul_kernel
                                    and tokens <= self.head_matmul_max_tokens)

    def use_routing_kernel(self) -> bool:
        """Whether MoE routing runs the kernel (at every token count: a token's experts must not depend on it)."""
        mode = self.mode()
        return mode == "triton" or (mode == "auto" and self.routing_kernel)

    def use_search(self, elements: int) -> bool:
        """Whether top-k / top-p over `elements` (batch x vocabulary) runs the radix search, not the sort."""
        mode = self.mode()
        return mode == "triton" or (mode == "auto" and elements >= self.search_min_elements)

    def use_fused_prefill(self, tokens: int) -> bool:
        """Whether a fresh prompt of `tokens` per row (in a supported dtype and head dim) goes through the
        fused attention: impl "auto", one device, where its implementation runs, long enough."""
        if self.impl != "auto" or _tensor_parallel():
            return False
        runs = self.prefill_fused_impl == "xla" or self.device_has_kernels()
        return runs and tokens >= self.prefill_fused_min_tokens


def _tensor_parallel() -> bool:
    """Traced under a layout over several devices: the partitioner cannot split a Pallas or cuDNN call."""
    layout = current_layout()
    return layout is not None and layout.mesh.size > 1


def has_kernels(device: Any, minimum: tuple[int, int] = _MIN_COMPUTE_CAPABILITY) -> bool:
    """NVIDIA GPUs of compute capability `minimum`+ (8.0 by default) run the Pallas (Triton) kernels; ROCm
    devices report a gfx name as their capability, CPUs none."""
    if device.platform != "gpu":
        return False
    parts = str(getattr(device, "compute_capability", "")).split(".")
    if not all(part.isdigit() for part in parts) or not parts[0]:
        return False
    return tuple(int(part) for part in parts + ["0"])[:2] >= minimum
