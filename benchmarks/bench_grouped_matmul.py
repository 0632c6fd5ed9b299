"""DeepSeek's routed experts of one MoE layer in each form, against the floor: the grouped matmul kernel (the auto
form where kernels run), XLA's gathered slices and XLA's ragged_dot over dequantized stacks, at the slot counts of
decode and verify. V3: 256 FP8 experts of 7168 x 2048 (top 8); V2-Lite: 64 bf16 experts of 2048 x 1408 (top 6).

The floor reads the distinct experts the step's routing selects (random distinct experts per token) once, over
the copy bandwidth measured in the same process; each form's error is against the gathered one. `--sweep` times
launch parameters of the kernel on the calls of a V3 step (routed experts, FP8 projections as one group, the
router, MLA's per-head products), over every axis of SWEEP or those `--sweep-over` names (the others as the
default config has them), each timed call reading another copy of its matrix (ROTATION_BYTES in all), so that
matrices smaller than the 50 MB L2 stream from memory as in a step.

    PYTHONPATH=. python benchmarks/bench_grouped_matmul.py [--sweep | --sweep-only] [--sweep-over AXES] [--smoke]

Writes $OUT/bench_grouped_matmul.json (and bench_grouped_matmul_sweep.json) and prints each row as it comes.
"""
from __future__ import annotations

import argparse
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import (add_sweep_arguments, copy_bandwidth, interpret_kernels, median_time, print_table,
                               relative_error, rotation_copies, swept_axes, swept_configs, write_json)
from benchmarks.device_trace import busy_ns, traced_kernels
from specjax.kernels.grouped_matmul import grouped_matmul
from specjax.kernels.grouped_matmul_triton import default_config, needs_pairs
from specjax.kernels.moe_routing import ROUTER_CONFIG
from specjax.kernels.policy import KernelPolicy
from specjax.models import random_init
from specjax.models.fp8 import FP8_BLOCK
from specjax.models.moe import routed_experts

SHAPES = {"v3_fp8": dict(experts=256, hidden=7168, inter=2048, top=8, fp8=True, heads=128, nope=128, rank=512),
          "v2_lite_bf16": dict(experts=64, hidden=2048, inter=1408, top=6, fp8=False)}
SMOKE_SHAPES = {"v3_fp8": dict(experts=8, hidden=256, inter=128, top=2, fp8=True, heads=4, nope=32, rank=64)}
TOKENS, SMOKE_TOKENS = (1, 8, 32, 128), (1, 4)
FORMS = {"kernel": ("grouped", KernelPolicy(interpret=interpret_kernels())),
         "xla gathered": ("gathered", KernelPolicy(impl="reference")),
         "xla ragged_dot": ("grouped", KernelPolicy(impl="reference"))}
# block_n in output columns (128 lost by far when it counted pairs: RESULTS.md); pairs: False loads a stack as
# it is (impossible for a 2-4 GiB one), True reads it as column pairs (the default); f16_rows: False multiplies
# the bf16 rows as they are, True as scaled float16 (the default); k_splits: K cut into that many programs' runs
# (the default aims at a number of programs per tile)
SWEEP = dict(block_n=(32, 64, 128, 256), num_warps=(4, 8), num_stages=(2, 3, 4), pairs=(False, True), f16_rows=(False, True),
             k_splits=(None, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32))
# The row counts the single matrices are swept at: a decode step's at batch 1 and 8.
SINGLE_ROWS = (1, 8)
# Bytes a sweep's timed calls cycle through (copies of the matrix they read): twice the H100's / H200's L2. A
# 7-17 MB matrix timed back to back sat in L2, and a config faster there was slower in the step (RESULTS.md,
# "The router's and MLA's products: launch parameters").
ROTATION_BYTES = 96 << 20


def experts_of(shape: dict, seed: int = 0) -> dict[str, jax.Array]:
    """Random expert stacks (FP8 codes with block scales near 1/64, or bf16)."""
    E, H, I = shape["experts"], shape["hidden"], shape["inter"]
    keys = jax.random.split(jax.random.key(seed), 3)
    dtype = jnp.float8_e4m3fn if shape["fp8"] else jnp.bfloat16
    experts = {}
    for key, (name, (rows, cols)) in zip(keys, {"we_gate": (H, I), "we_up": (H, I), "we_down": (I, H)}.items()):
        experts[name] = random_init.normal(key, (E, rows, cols), dtype, scale=16.0 if shape["fp8"] else 0.02)
        if shape["fp8"]:
            grid = (E, -(-rows // FP8_BLOCK[0]), -(-cols // FP8_BLOCK[1]))
            experts[name + "_scale"] = jax.random.uniform(key, grid, jnp.float32, 0.5, 1.5) / 1024
    return experts


def routing_of(shape: dict, tokens: int, seed: int) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(shape["experts"])[:shape["top"]] for _ in range(tokens)])
    return jnp.asarray(ids, jnp.int32), jnp.asarray(rng.uniform(0.1, 1.0, ids.shape), jnp.float32)


def expert_bytes(experts: dict[str, jax.Array]) -> int:
    return sum(leaf[0].nbytes for leaf in experts.values())


def form_rows(shapes: dict, tokens_list, bandwidth: float) -> list[dict]:
    rows = []
    for name, shape in shapes.items():
        experts = experts_of(shape)
        block = FP8_BLOCK if shape["fp8"] else None
        for tokens in tokens_list:
            x = random_init.normal(jax.random.key(tokens), (tokens, shape["hidden"]), jnp.bfloat16, scale=1.0)
            ids, weights = routing_of(shape, tokens, tokens)
            floor_ms = 1e3 * len(np.unique(np.asarray(ids))) * expert_bytes(experts) / bandwidth
            outputs = {}
            for form, (expert_form, policy) in FORMS.items():
                fn = jax.jit(lambda x, ids, weights, experts, form=expert_form, policy=policy: routed_experts(
                    x, ids, weights, experts, form=form, block=block, kernels=policy))
                outputs[form] = fn(x, ids, weights, experts)
                ms = 1e3 * median_time(lambda: fn(x, ids, weights, experts))
                device_ms, _ = device_times(lambda: fn(x, ids, weights, experts))
                row = dict(shape=name, tokens=tokens, slots=tokens * shape["top"], form=form, ms=ms,
                           device_ms=device_ms, floor_ms=floor_ms, of_floor=floor_ms / device_ms,
                           rel_err_vs_gathered=relative_error(outputs[form], outputs.get("xla gathered",
                                                                                         outputs[form])))
                rows.append(row)
                print_table([row])
    return rows


def sweep_cases(shape: dict, matrices: tuple[str, ...] | None = None) -> list[dict]:
    """The kernel's calls in a V3 step: the routed gate ([7168, 2048]) and down ([2048, 7168]) matmuls at one
    token's 8 slots (in slot order, as a batch-1 step runs them: the gate from the token's one row, the down
    projection from its 8 hidden rows) and at 8 tokens' 64 (sorted), and the FP8 projections as one group (rows in
    order, as fp8.linear calls them) at 1 and 8 rows: q_a and kv_a side by side (wqkv_a), q_b, o_proj, the dense
    layer's gate, the shared expert's gate; the router (fp32, bf16 rows; its own config, ROUTER_CONFIG) at 1 and 8
    rows, and MLA's per-head products W_UK and W_UV (bf16, a row per head) at 1 and 8 tokens. `matrices`: only the
    calls of these matrices."""
    experts = experts_of(shape)
    ids, _ = routing_of(shape, 1, 8)
    cases = [dict(matrix="we_gate", rows=1, w=experts["we_gate"], scale=experts["we_gate_scale"],
                  call=dict(row_groups=ids)),
             dict(matrix="we_down", rows=ids.size, w=experts["we_down"], scale=experts["we_down_scale"],
                  call=dict(row_groups=ids[0]))]
    ids, _ = routing_of(shape, 8, 64)
    sizes = jnp.bincount(ids.reshape(-1), length=shape["experts"]).astype(jnp.int32)
    cases += [dict(matrix=name, rows=ids.size, w=experts[name], scale=experts[name + "_scale"],
                   call=dict(group_sizes=sizes)) for name in ("we_gate", "we_down")]
    H = shape["hidden"]
    singles = {"wqkv_a": (H, 1536 + 576), "wq_b": (1536, 24576), "wo": (16384, H), "w_gate": (H, 18432),
               "ws_gate": (H, shape["inter"])}
    for index, (name, (rows, cols)) in enumerate(singles.items()):
        if matrices is None or name in matrices:
            single = experts_of(dict(shape, experts=1, hidden=rows, inter=cols), seed=index + 1)
            cases += [dict(matrix=name, rows=tokens, w=single["we_gate"], scale=single["we_gate_scale"],
                           call=dict(interleaved=True)) for tokens in SINGLE_ROWS]
    keys = jax.random.split(jax.random.key(7), 3)
    router = jax.random.normal(keys[0], (1, H, shape["experts"]), jnp.float32) / np.sqrt(H)
    cases += [dict(matrix="router", rows=tokens, w=router, scale=None, call=dict(interleaved=True),
                   config=ROUTER_CONFIG) for tokens in SINGLE_ROWS]
    heads, nope, rank = shape["heads"], shape["nope"], shape["rank"]
    for key, (name, (rows, cols)) in zip(keys[1:], {"w_uk": (nope, rank), "w_uv": (rank, nope)}.items()):
        w = random_init.normal(key, (heads, rows, cols), jnp.bfloat16, scale=0.02)
        cases += [dict(matrix=name, rows=heads * tokens, w=w, scale=None, call=dict(interleaved=True))
                  for tokens in SINGLE_ROWS]
    return [case for case in cases if matrices is None or case["matrix"] in matrices]


def device_times(run, calls: int = 5) -> tuple[float, float]:
    """(ms the device was busy, ms in the grouped matmul kernel) per call of run(), from a profiler trace; NaN off
    GPUs."""
    kernels = traced_kernels(lambda: [run() for _ in range(calls)])
    if not kernels:
        return float("nan"), float("nan")
    own = sum(k.duration_ns for k in kernels if "grouped_matmul" in k.name)
    return busy_ns(kernels) / calls / 1e6, own / calls / 1e6


def sweep_rows(shape: dict, bandwidth: float, axes: tuple[str, ...] = tuple(SWEEP),
               matrices: tuple[str, ...] | None = None, rotation_bytes: int = ROTATION_BYTES) -> list[dict]:
    """Launch parameters of the kernel on each of sweep_cases over `axes` of SWEEP (the others the default
    config's), against the floor (the selected matrices' bytes)."""
    rows = []
    for case in sweep_cases(shape, matrices):
        w, scale = case["w"], case["scale"]
        call, block = case["call"], None if case["scale"] is None else FP8_BLOCK
        x = random_init.normal(jax.random.key(case["rows"]), (case["rows"], w.shape[1]), jnp.bfloat16, scale=1.0)
        arrays = {key: value for key, value in call.items() if key != "interleaved"}
        interleaved = "interleaved" in call
        want = grouped_matmul(x, w, **arrays, scale=scale, block=block, interleaved=interleaved,
                              kernels=KernelPolicy(impl="reference"))
        selected = (jnp.unique(call["row_groups"]).size if "row_groups" in call
                    else int((call["group_sizes"] > 0).sum()) if "group_sizes" in call else w.shape[0])
        read_bytes = selected * (w[0].nbytes + (0 if scale is None else scale[0].nbytes))
        floor_ms = 1e3 * read_bytes / bandwidth
        count = rotation_copies(read_bytes, rotation_bytes, most=64) if 2 * w.nbytes <= 1 << 30 else 1
        copies = [(w, scale)] + [(jnp.copy(w), None if scale is None else jnp.copy(scale)) for _ in range(count - 1)]
        base = case.get("config") or default_config(w.shape[0], w.dtype.itemsize)
        for config in swept_configs(base, SWEEP, axes):
            if config.pairs is False and needs_pairs(w):   # its offsets need pairs
                continue
            if w.dtype.itemsize != 1 and (config.pairs or config.f16_rows):   # FP8 stacks' options only
                continue
            fn = jax.jit(lambda x, w, scale, arrays, config=config: grouped_matmul(
                x, w, **arrays, scale=scale, block=block, config=config, interleaved=interleaved))
            try:
                got = fn(x, w, scale, arrays)
            except jax.errors.JaxRuntimeError as error:   # e.g. wide fp32 blocks past the shared memory
                print(case["matrix"], case["rows"], config, "does not launch:", str(error).splitlines()[0])
                continue
            pool = itertools.cycle(copies)
            device_ms, kernel_ms = device_times(lambda: fn(x, *next(pool), arrays), calls=max(5, len(copies)))
            row = dict(matrix=case["matrix"], rows=case["rows"], **{axis: getattr(config, axis) for axis in SWEEP},
                       device_ms=device_ms, kernel_ms=kernel_ms, of_floor=floor_ms / kernel_ms,
                       device_of_floor=floor_ms / device_ms, rel_err=relative_error(got, want))
            rows.append(row)
            print_table([row])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_sweep_arguments(parser, SWEEP)
    parser.add_argument("--shapes", default=",".join(SHAPES), help="the forms' shapes: " + ", ".join(SHAPES))
    parser.add_argument("--sweep-matrices", help="sweep only these calls' matrices (comma list; default all): "
                        "we_gate, we_down, wqkv_a, wq_b, wo, w_gate, ws_gate, router, w_uk, w_uv")
    parser.add_argument("--smoke", action="store_true", help="tiny experts, to check the script")
    args = parser.parse_args()
    axes = swept_axes(parser, args, SWEEP)
    bandwidth = copy_bandwidth(64 << 20 if args.smoke else 2 << 30)
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    shapes, tokens = (SMOKE_SHAPES, SMOKE_TOKENS) if args.smoke else (
        {name: SHAPES[name] for name in args.shapes.split(",")}, TOKENS)
    if not args.sweep_only:
        print("wrote", write_json("bench_grouped_matmul", form_rows(shapes, tokens, bandwidth)))
    if args.sweep or args.sweep_only:
        shape = (SMOKE_SHAPES if args.smoke else SHAPES)["v3_fp8"]
        print("wrote", write_json("bench_grouped_matmul_sweep", sweep_rows(
            shape, bandwidth, axes, args.sweep_matrices and tuple(args.sweep_matrices.split(",")),
            0 if args.smoke else ROTATION_BYTES)))


if __name__ == "__main__":
    main()
