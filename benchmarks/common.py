"""Shared benchmark helpers: timing, device ceilings, the standard speed subjects, result output."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
import argparse
import itertools
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.loop_profile import loop_profile
from specjax import LLM, SamplingParams
from specjax.engine.proposers.draft_model import DraftModelProposer
from specjax.kernels.policy import KernelPolicy, has_kernels
from specjax.models.kv_cache import KVCache
from specjax.models.llama import FAMILY, LlamaConfig, LlamaForCausalLM

LLAMA31_8B = LlamaConfig(
    architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
    num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
    tie_word_embeddings=False, attention_bias=False, qk_norm=False, max_position_embeddings=131072,
    bos_token_id=128000, eos_token_ids=(128001,), torch_dtype="bfloat16")
# A Llama-3.2-1B-shaped draft for the 8B target (same vocabulary).
LLAMA32_1B = LlamaConfig(
    architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
    num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling=LLAMA31_8B.rope_scaling, tie_word_embeddings=True, attention_bias=False, qk_norm=False,
    max_position_embeddings=131072, bos_token_id=128000, eos_token_ids=(128001,), torch_dtype="bfloat16")
# The default model's shape (SmolLM2-135M-Instruct): its decode step is launch-bound, not bandwidth-bound.
SMOLLM2_135M = LlamaConfig(
    architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
    num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, rope_scaling=None,
    tie_word_embeddings=True, attention_bias=False, qk_norm=False, max_position_embeddings=8192,
    bos_token_id=1, eos_token_ids=(2,), torch_dtype="bfloat16")
# The 8B target and its 1B draft shrunk for --smoke runs, which check a script on a CPU in seconds.
_SMOKE_SIZES = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=16)
SMOKE_TARGET = dataclasses.replace(LLAMA31_8B, **_SMOKE_SIZES)
SMOKE_DRAFT = dataclasses.replace(LLAMA32_1B, **{**_SMOKE_SIZES, "num_layers": 1})


def random_model(cfg: LlamaConfig, kernels: KernelPolicy = KernelPolicy(), seed: int = 0,
                 dtype=jnp.bfloat16) -> LlamaForCausalLM:
    """A model of cfg with random weights, bf16 unless said (speed does not depend on their values)."""
    return FAMILY.random(cfg, dtype=dtype, seed=seed, kernels=kernels)


def graph_with(cfg: LlamaConfig, kernels: KernelPolicy) -> nnx.GraphDef:
    """The graph of random_model(cfg) under other kernels, built without weights: it runs that model's state
    with other kernel choices."""
    return nnx.graphdef(nnx.eval_shape(lambda: random_model(cfg, kernels)))


def draft_proposer(draft: LlamaForCausalLM, k: int) -> DraftModelProposer:
    """Greedy drafting of k tokens with `draft` (its cache counted whole on each device: draft TP 1)."""
    return DraftModelProposer(nnx.graphdef(draft), k, probabilistic=False, cache_bytes=draft.cache_bytes)


def interpret_kernels() -> bool:
    """Whether Pallas kernels must run in interpret mode here: the device cannot run them (a CPU --smoke run)."""
    return not has_kernels(jax.devices()[0])


def on_gpu() -> bool:
    return jax.devices()[0].platform == "gpu"


def rotation_copies(bytes_per_call: int, rotation_bytes: int, most: int | None = None) -> int:
    """Distinct copies of a timed call's inputs to cycle through so that back-to-back calls read `rotation_bytes`
    in all (more than the L2) and none finds its bytes still there: at least 2, at most `most`."""
    wanted = max(2, math.ceil(rotation_bytes / bytes_per_call))
    return wanted if most is None else min(most, wanted)


def median_time(fn: Callable[[], object], repeats: int = 10, warmup: int = 2) -> float:
    """Median seconds of fn() (its result blocked on), after warm-up."""
    for _ in range(warmup):
        wall_seconds(fn)
    return statistics.median(wall_seconds(fn) for _ in range(repeats))


def wall_seconds(fn: Callable[[], object]) -> float:
    """Seconds of one fn() call, its result blocked on."""
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def relative_error(out, expected) -> float:
    """||out - expected|| / ||expected|| in float64; NaN when out holds a non-finite value."""
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    expected = np.asarray(jnp.asarray(expected, jnp.float32), np.float64)
    if not np.isfinite(out).all():
        return float("nan")
    return float(np.linalg.norm(out - expected) / np.linalg.norm(expected))


def copy_bandwidth(num_bytes: int = 2 << 30) -> float:
    """The device's copy ceiling in bytes/s (bytes read plus bytes written): the fastest of copy_bandwidths'."""
    return max(copy_bandwidths(num_bytes).values())


def copy_bandwidths(num_bytes: int = 2 << 30) -> dict[str, float]:
    """Copy bandwidth in bytes/s of `num_bytes` by XLA's elementwise pass and, where PyTorch sees a GPU, by its
    copy_ (a plain device copy; XLA's pass has read about two thirds of PyTorch's rate on the H200). Each is the
    fastest of its runs after WARM_SECONDS of them: an idle GPU clocks up over its first tenths of a second (a
    median of a few runs at process start read 2.35-3.52 TB/s in one session), and other work only adds time."""
    return {"xla": _xla_copy_bandwidth(num_bytes), **_torch_copy_bandwidth(num_bytes)}


WARM_SECONDS = 0.5


def fastest_seconds(measure: Callable[[], float], repeats: int = 20) -> float:
    """The smallest of `repeats` measure() readings (seconds), after WARM_SECONDS of readings."""
    begin = time.perf_counter()
    while time.perf_counter() - begin < WARM_SECONDS:
        measure()
    return min(measure() for _ in range(repeats))


def _xla_copy_bandwidth(num_bytes: int) -> float:
    x = jnp.ones((num_bytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a * 1.0001)
    return 2 * x.nbytes / fastest_seconds(lambda: wall_seconds(lambda: copy(x)))


def _torch_copy_bandwidth(num_bytes: int) -> dict[str, float]:
    """{"torch_copy": bytes/s} of PyTorch's copy_ timed by CUDA events, on GPUs where PyTorch is there; its
    buffers handed back to the device afterwards."""
    if not on_gpu():
        return {}
    try:
        import torch
    except ImportError:
        return {}
    rate = _torch_copy_rate(torch, num_bytes)
    torch.cuda.empty_cache()
    return {"torch_copy": rate}


def _torch_copy_rate(torch, num_bytes: int) -> float:
    src = torch.ones(num_bytes // 4, device="cuda")
    dst = torch.empty_like(src)

    def seconds() -> float:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3

    return 2 * src.nbytes / fastest_seconds(seconds)


def matmul_flops(n: int = 8192) -> float:
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda x, y: x @ y)
    return 2 * n ** 3 / median_time(lambda: mm(a, b))


def weight_bytes(cfg: LlamaConfig, itemsize: int = 2) -> int:
    H, I, L, D = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.head_dim
    attn = H * D * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    per_layer = attn + 3 * H * I + 2 * H
    # The lm_head (or the tied embedding) is streamed whole each step; embedding lookups read a few rows.
    return itemsize * (L * per_layer + H * cfg.vocab_size + H)


def kv_bytes_per_token(cfg: LlamaConfig, dtype=jnp.bfloat16) -> int:
    return KVCache.bytes(cfg.num_layers, 1, cfg.num_kv_heads, 1, cfg.head_dim, dtype)


def add_sweep_arguments(parser: argparse.ArgumentParser, sweep: dict[str, tuple]) -> None:
    """--sweep, --sweep-only and --sweep-over (a comma list of `sweep`'s axes; all by default)."""
    parser.add_argument("--sweep", action="store_true", help="also time the kernel's launch parameters")
    parser.add_argument("--sweep-only", action="store_true", help="only the launch parameters")
    parser.add_argument("--sweep-over", default=",".join(sweep), help="the axes swept: " + ", ".join(sweep))


def swept_axes(parser: argparse.ArgumentParser, args: argparse.Namespace, sweep: dict[str, tuple]) -> tuple[str, ...]:
    """--sweep-over's axes, each one of `sweep`'s (a parser error naming the others)."""
    axes = tuple(args.sweep_over.split(","))
    if not set(axes) <= set(sweep):
        parser.error(f"--sweep-over: {sorted(set(axes) - set(sweep))} not among {list(sweep)}")
    return axes


def swept_configs(default: Any, sweep: dict[str, tuple], axes: tuple[str, ...]) -> Iterator[Any]:
    """The default config (a dataclass) with every combination of `sweep`'s values on `axes`."""
    for values in itertools.product(*(sweep[axis] for axis in axes)):
        yield dataclasses.replace(default, **dict(zip(axes, values)))


def device_name() -> str:
    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', '')}"


def reuse_compilations() -> None:
    """A persistent JAX compilation cache for this process, in a fresh folder: an engine built again over the
    same programs (another synthetic acceptance rate, another runner object) loads them instead of compiling
    them again."""
    jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="specjax-bench-jax-"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def out_dir() -> Path:
    """Where results go: $OUT, else benchmarks/results."""
    folder = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def write_json(name: str, rows: list[dict]) -> Path:
    out = out_dir() / f"{name}.json"
    out.write_text(json.dumps({"device": device_name(), "jax": jax.__version__,
                               "date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1))
    return out


def print_table(rows: list[dict]) -> None:
    if not rows:
        return
    keys = list(rows[0])
    widths = [max(len(k), *(len(_fmt(r.get(k))) for r in rows)) for k in keys]
    print("  ".join(k.ljust(w) for k, w in zip(keys, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(k)).ljust(w) for k, w in zip(keys, widths)))


def _fmt(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def time_llm(model_dir, spec: dict | None, prompt_ids: list[list[int]], batch: int, max_tokens: int | list[int],
             dtype: str = "auto", continuous_admission: bool = True, profile: bool = False,
             max_model_len: int = 1024) -> dict:
    """Greedy generation of prompt_ids through the LLM facade, batch slots (more prompts than slots: admitted
    as rows finish, or in waves), compiled beforehand: tokens per prompt, seconds, vLLM's acceptance length
    and per-position acceptance rates, (adaptive speculation) the timed run's loop iterations at each k, and
    (admission) the mean slot occupancy and prefill batches of the timed run. max_tokens: one for all, or one
    per prompt. profile: also the launches per iteration of the loop one wave of the first `batch` prompts runs,
    and on a GPU where its device time goes (loop_profile.py), after the timed run; the engine is then compiled
    without CUDA graphs (enforce_eager: a loop that is one graph hides its kernels from the profiler), so its
    timings are eager ones."""
    llm = LLM(str(model_dir), speculative_config=spec, max_model_len=max_model_len, max_num_seqs=batch, dtype=dtype,
              continuous_admission=continuous_admission, enforce_eager=profile)
    budgets = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompt_ids)
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in budgets]
    inputs = [{"prompt_token_ids": ids} for ids in prompt_ids]
    llm.generate(inputs, params, use_tqdm=False)  # compiles every shape bucket the timed run meets
    warm_iterations = _iterations_per_k(llm)
    start = time.perf_counter()
    outs = [o.outputs[0] for o in llm.generate(inputs, params, use_tqdm=False)]
    seconds = time.perf_counter() - start
    drafts = sum(o.num_drafts for o in outs)
    accepted = sum(o.num_accepted_tokens for o in outs)
    per_position = ([sum(o.num_accepted_tokens_per_pos[i] for o in outs) / drafts
                     for i in range(spec["num_speculative_tokens"])] if spec and drafts else None)
    iterations = _iterations_per_k(llm)
    timed = llm.admission_trace()[-1] if llm.admission_trace() else None
    return dict(tokens=[o.token_ids for o in outs], seconds=seconds,
                acceptance_length=(1 + accepted / drafts) if drafts else None, per_position=per_position,
                iterations_per_k=iterations and [n - w for n, w in zip(iterations, warm_iterations)],
                occupancy=timed and sum(timed.occupancy) / timed.slots, admissions=timed and timed.admissions,
                profile=loop_profile(llm, prompt_ids[:batch], params[0]) if profile else None)


def _iterations_per_k(llm: LLM) -> list[int] | None:
    """Loop iterations run at each k so far (adaptive speculation), else None."""
    found = [m.values for m in llm.get_metrics() if m.name == "specjax:spec_decode_iterations_per_k"]
    return found[0] if found else None
