"""Compile for an NVIDIA H200 on a machine without one, to read what the GPU would run: the optimized module of a
generate loop (its kernels per iteration, through hlo_source.py) and each Pallas kernel's PTX, assembled by ptxas
for its registers, spills and the width of its loads.

XLA compiles for a GPU it is only told about (deviceless compilation): the CUDA plugin makes a topology from a
target description, and a jit lowered onto that topology's device compiles all the way to PTX and a cubin. Nothing
runs, so nothing here is a time; the kernel counts are the device's to within 1-2% (the default model's loop
compiled here: plain 263 per token, EAGLE-3 k=3 / 5 321 / 362 per iteration; the H200's profiler: 260-261,
327.5, 369.2 kernels, benchmarks/RESULTS.md).

Needs, beside jax: the CUDA plugin of the same version and ptxas (`pip install -e ".[gpu-compile]"`; no driver,
cuDNN or cuBLAS), and in the environment before jax starts its backends: JAX_PLATFORMS=cpu (the host runs everything) and JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 (the plugin
otherwise refuses to load without cuDNN).

    JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 PYTHONPATH=. python -m benchmarks.gpu_target [--smoke]

prints the kernels' PTX report for the shapes below (bench_eagle.py --target h200 counts a loop's launches).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import glob
import importlib.util
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kernels.policy import KernelPolicy

# The H200 (SXM) by its datasheet where XLA's cost model reads it (memory, bandwidth, clock); the per-SM limits
# are Hopper's (compute capability 9.0), as the device reports them.
H200_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 150754820096
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 12 }
runtime_version { major: 13 minor: 0 }
device_description_str: "NVIDIA H200"
"""


def missing() -> str | None:
    """What this host lacks to compile for a GPU (the CUDA plugin, ptxas), or None."""
    if importlib.util.find_spec("jax_plugins") is None or not any(
            importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") for v in (13, 12)):
        return "no CUDA plugin for jax: pip install -e \".[gpu-compile]\""
    try:
        _ptxas()
    except RuntimeError as error:
        return str(error)
    return None


@functools.cache
def h200() -> jax.Device:
    """A device of a one-H200 topology: jits lowered onto it compile for the H200."""
    from jax.experimental import topologies
    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=H200_TARGET, topology="1x1x1")
    except (NotImplementedError, RuntimeError) as error:
        raise RuntimeError("compiling for an H200 here needs the CUDA plugin of this jax and ptxas (pip install -e "
                           "\".[gpu-compile]\") and JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 set before "
                           "jax starts") from error
    return topology.devices[0]


@contextlib.contextmanager
def compiling_for(device: jax.Device) -> Iterator[None]:
    """specjax's platform choices made for `device` while models and engines are built and traced: jax's default
    backend reads "gpu" (unrolled layers, the loop's CUDA-graph options) and kernel policies without a device of
    their own consult this one (the Pallas kernels where it has them)."""
    own = KernelPolicy._device
    with mock.patch.object(jax, "default_backend", lambda: device.platform), \
            mock.patch.object(KernelPolicy, "_device", lambda self: device if self.device is None else own(self)):
        yield


def on_device(tree: Any, device: jax.Device) -> Any:
    """Arrays (and shapes, as jax.eval_shape gives them) of `tree` as shapes placed on `device`, what a lowering
    onto it takes; other leaves as they are."""
    placed = jax.sharding.SingleDeviceSharding(device)

    def shape(leaf):
        if isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)):
            return jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype, sharding=placed)
        return leaf

    return jax.tree.map(shape, tree)


def compiled_for(fn: Callable, args: tuple, device: jax.Device, dump: Path | None = None) -> jax.stages.Compiled:
    """jit(fn) (or a jitted fn) compiled for `device` on these arguments' shapes; `dump`: XLA writes the module's
    PTX (one file per kernel) there."""
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    options = {"xla_dump_to": str(dump)} if dump else None
    return jitted.lower(*on_device(args, device)).compile(compiler_options=options)


@dataclasses.dataclass(frozen=True)
class PtxReport:
    kernel: str
    registers: int
    spill_bytes: int
    global_copies: dict[str, int]    # asynchronous copies into shared memory by width ("16B": count)
    global_loads: dict[str, int]     # direct loads into registers by instruction
    matrix_ops: dict[str, int]       # mma.sync / wgmma by instruction
    conversions: dict[str, int]      # conversions between float formats by instruction (cvt.bf16.f16: 1 element)


def kernel_reports(dump: Path, prefix: str = "specjax_") -> list[PtxReport]:
    """ptxas's figures (sm_90a) and the memory and matrix instructions of each kernel named `prefix`* in a dump."""
    reports = []
    for path in sorted(dump.glob("*.ptx")):
        text = path.read_text()
        for kernel in re.findall(rf"\.entry ({prefix}\w*)", text):
            registers, spills = _assembled(path)
            reports.append(PtxReport(
                kernel=kernel, registers=registers, spill_bytes=spills,
                global_copies=_counts(r"cp\.async\.\w+\.shared\.global \[[^]]*\], \[[^]]*\], (0x[0-9a-f]+|\d+)", text,
                                      lambda width: f"{int(width, 0)}B"),
                global_loads=_counts(r"(ld\.global[\w.:]*)", text),
                matrix_ops=_counts(r"((?:wgmma\.mma_async|mma\.sync)[\w.]*)", text),
                conversions=_counts(r"(cvt(?:\.\w+)*\.(?:bf16|f16|f32|e4m3|e5m2)\w*(?:\.\w+)*)\s", text)))
    return reports


def _assembled(ptx: Path) -> tuple[int, int]:
    """Registers per thread and spill-store bytes of the one kernel in `ptx`, by ptxas -v for sm_90a."""
    info = subprocess.run([_ptxas(), "-arch=sm_90a", "-v", str(ptx), "-o", "/dev/null"], capture_output=True,
                          text=True, check=True).stderr
    return (int(re.search(r"Used (\d+) registers", info).group(1)),
            int(re.search(r"(\d+) bytes spill stores", info).group(1)))


@functools.cache
def _ptxas() -> str:
    """The ptxas of the nvidia-cuda-nvcc wheel."""
    spec = importlib.util.find_spec("nvidia")
    roots = spec.submodule_search_locations if spec else []
    found = [p for root in roots for p in glob.glob(f"{root}/cu*/bin/ptxas")]
    if not found:
        raise RuntimeError("no ptxas: pip install -e \".[gpu-compile]\"")
    return found[0]


def _counts(pattern: str, text: str, name: Callable[[str], str] = str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for match in re.findall(pattern, text):
        counts[name(match)] = counts.get(name(match), 0) + 1
    return counts


def _kernel_cases(smoke: bool) -> list[tuple[str, Callable, tuple]]:
    """(case, function, arguments) for the kernels at the shapes they meet: DeepSeek-V3's FP8 experts (one device's
    32 of them at expert parallelism 8; 96) and a dense FP8 projection (all read as column pairs);
    the default model's and the 8B's attention and projections."""
    from specjax.kernels.attention_triton import attention_triton
    from specjax.kernels.grouped_matmul_triton import grouped_matmul_triton
    from specjax.kernels.projection_triton import projection_triton
    from specjax.kernels.tree_mask import TreeMask

    def experts(groups, rows, k=7168, n=4096):
        args = (jnp.zeros((rows, k), jnp.bfloat16), jax.ShapeDtypeStruct((groups, k, n), jnp.float8_e4m3fn),
                jnp.zeros((groups,), jnp.int32), jnp.zeros((groups, k // 128, n // 128), jnp.float32))
        return lambda x, w, g, s: grouped_matmul_triton(x, w, g, scale=s, block=(128, 128)), args

    def attention(batch, tokens, heads, kv_heads, slots, head_dim, tree=False):
        q = jnp.zeros((batch, tokens, heads, head_dim), jnp.bfloat16)
        cache = jnp.zeros((1, batch, kv_heads, slots, head_dim), jnp.bfloat16)   # one layer's stack
        start = jnp.zeros((batch,), jnp.int32)
        if not tree:
            return lambda q, k, v, s: attention_triton(q, k, v, 0, s, scale=0.125), (q, cache, cache, start)
        mask = TreeMask(positions=jnp.zeros((batch, tokens), jnp.int32), region_start=start,
                        visible=jnp.zeros((batch, tokens, tokens), bool))
        return (lambda q, k, v, s, t: attention_triton(q, k, v, 0, s, scale=0.125, tree=t),
                (q, cache, cache, start, mask))

    def projection(rows, k, n):
        return (lambda x, w: projection_triton(x, w), (jnp.zeros((rows, k), jnp.bfloat16),
                                                      jax.ShapeDtypeStruct((k, n), jnp.bfloat16)))

    cases = [("V3 experts, 32 FP8, 8 rows", *experts(32, 8)),
             ("default model attention, causal pass of 33", *attention(1, 33, 9, 3, 512, 64)),
             ("default model attention, tree of 32", *attention(1, 33, 9, 3, 512, 64, tree=True)),
             ("default model projection, 1 row, 576 x 960", *projection(1, 576, 960))]
    if smoke:
        return cases
    return cases + [("V3 experts, 96 FP8, 8 rows", *experts(96, 8)),
                    ("V3 experts, 32 FP8, 64 rows", *experts(32, 64)),
                    ("V3 q_b_proj, 1 FP8 matrix, 1 row", *experts(1, 1, 1536, 24576)),
                    ("default model attention, verify of 6", *attention(1, 6, 9, 3, 512, 64)),
                    ("8B attention, decode, batch 8", *attention(8, 1, 32, 8, 4096, 128)),
                    ("8B attention, tree of 64, batch 8", *attention(8, 65, 32, 8, 1280, 128, tree=True)),
                    ("8B projection, 1 row, 4096 x 6144", *projection(1, 4096, 6144))]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="three kernels only")
    args = parser.parse_args(argv)
    device = h200()
    rows = []
    for case, fn, fn_args in _kernel_cases(args.smoke):
        with tempfile.TemporaryDirectory() as dump:
            compiled_for(fn, fn_args, device, Path(dump))
            rows += [dict(case=case, **dataclasses.asdict(r)) for r in kernel_reports(Path(dump))]
        print(rows[-1], flush=True)
    from benchmarks.common import print_table, write_json
    write_json("gpu_target_kernels", rows)
    print_table(rows)


if __name__ == "__main__":
    main()
