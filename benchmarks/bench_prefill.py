"""Prefill attention on a GPU: the Pallas kernel (against the KV cache) vs cuDNN and XLA (fresh K/V).

Run in one device call:  PYTHONPATH=. python benchmarks/bench_prefill.py [--model] [--smoke]
A prompt prefilled from position 0 attends only to itself, so it can run as causal self-attention
over the freshly projected K/V [B, T, Hkv, D] (cuDNN's flash attention through
`jax.nn.dot_product_attention`) instead of reading them back from the head-major cache
[L, B, Hkv, S, D] (our kernel, which prefill uses today). For the Llama-3.1-8B and SmolLM2-135M
attention shapes, bf16, batch 1 and 4, T = 128 .. 4096, this prints and writes (bench_prefill.json):
device time per call from a profiler trace, achieved TFLOP/s (causal: half the T x T scores), and
the error of each against the fp32 reference.
`--model` instead times whole random-weight prefills (bf16, batch 1) of the SmolLM2-135M and
Llama-3.1-8B shapes through the model, with fresh=False (the cache path) and fresh=True (what the engine
runs: cuDNN from the kernel policy's prefill_fused_min_tokens on), and checks the two agree
(bench_prefill_model.json).
`--smoke` runs both on tiny shapes, to check the script: off GPUs our kernel in interpret mode, cuDNN skipped
and no device time (NaN).
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.common import (LLAMA31_8B, SMOKE_TARGET, SMOLLM2_135M, device_name, interpret_kernels, median_time,
                               on_gpu, print_table, random_model, relative_error, write_json)
from benchmarks.device_trace import device_us_per_call
from specjax.kernels.attention import attention
from specjax.kernels.attention_reference import attention_reference
from specjax.kernels.policy import KernelPolicy

SHAPES = {"8b": (32, 8, 128), "smollm2": (9, 3, 64)}
TOKENS = (128, 512, 1024, 2048, 4096)
BATCHES = (1, 4)
MODEL_CASES = ((SMOLLM2_135M, (1024, 2048, 4096, 8192)), (LLAMA31_8B, (2048, 4096)))
SMOKE_TOKENS, SMOKE_MODEL_CASES = (16,), ((SMOKE_TARGET, (16, 32)),)


def implementations(scale: float, kernels: KernelPolicy) -> dict:
    """name -> fn(q [B,T,Hq,D], k, v [B,T,Hkv,D], k_cache, v_cache [1,B,Hkv,S,D]) for one prefill; None for
    cuDNN off NVIDIA GPUs. kernels: how our kernel runs."""
    def start(q):
        return jnp.zeros((q.shape[0],), jnp.int32)

    return {
        "kernel": lambda q, k, v, kc, vc: attention(q, kc, vc, 0, start(q), scale=scale, kernels=kernels),
        "reference": lambda q, k, v, kc, vc: attention_reference(q, kc, vc, 0, start(q), scale=scale),
        "cudnn": (lambda q, k, v, kc, vc: jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=True, implementation="cudnn")) if on_gpu() else None,
        "xla": lambda q, k, v, kc, vc: jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=True, implementation="xla"),
    }


def inputs(batch: int, tokens: int, heads: int, kv_heads: int, head_dim: int):
    keys = jax.random.split(jax.random.key(tokens * 7 + batch), 3)
    q = jax.random.normal(keys[0], (batch, tokens, heads, head_dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (batch, tokens, kv_heads, head_dim), jnp.bfloat16)
    v = jax.random.normal(keys[2], (batch, tokens, kv_heads, head_dim), jnp.bfloat16)
    slots = tokens + 256   # the cache holds the generation budget too
    pad = ((0, 0), (0, 0), (0, slots - tokens), (0, 0))
    def cache(x):
        return jnp.pad(x.swapaxes(1, 2), pad)[None]

    return q, k, v, cache(k), cache(v)


def case(shape: str, batch: int, tokens: int, kernels: KernelPolicy) -> dict:
    heads, kv_heads, head_dim = SHAPES[shape]
    scale = head_dim ** -0.5
    args = inputs(batch, tokens, heads, kv_heads, head_dim)
    with jax.default_matmul_precision("highest"):
        expected = jax.jit(lambda q, kc, vc: attention_reference(
            q.astype(jnp.float32), kc.astype(jnp.float32), vc.astype(jnp.float32), 0,
            jnp.zeros((batch,), jnp.int32), scale=scale))(args[0], args[3], args[4])
    flops = 4 * batch * heads * head_dim * tokens * (tokens + 1) / 2
    row = dict(shape=shape, batch=batch, tokens=tokens)
    for name, fn in implementations(scale, kernels).items():
        if fn is None:
            row[f"{name}_us"] = row[f"{name}_tflops"] = row[f"{name}_err"] = None
            continue
        try:
            out = jax.jit(fn)(*args).astype(jnp.float32)
            us = device_us_per_call(fn, *args)
            tflops = flops / us / 1e6
        except Exception as error:  # record and go on: the other implementations still tell something
            print(f"{shape} B={batch} T={tokens} {name}: failed: {str(error)[:300]}", flush=True)
            row[f"{name}_us"] = row[f"{name}_tflops"] = row[f"{name}_err"] = None
            continue
        row[f"{name}_us"] = us
        row[f"{name}_tflops"] = tflops
        row[f"{name}_err"] = relative_error(out, expected)
    print(row, flush=True)
    return row


def model_prefill(cfg, token_counts) -> list[dict]:
    """Whole-model prefill time, cache path vs fresh path, and how far their hidden states differ."""
    graph, state = nnx.split(random_model(cfg))
    rows = []
    for tokens in token_counts:
        def prefill(state, prompt, fresh):
            model = nnx.merge(graph, state)
            cache = model.init_cache(1, tokens + 64)
            return model(prompt, jnp.zeros((1,), jnp.int32), cache, fresh=fresh)[0]

        runs = {fresh: jax.jit(lambda s, p, f=fresh: prefill(s, p, f)) for fresh in (False, True)}
        prompt = jax.random.randint(jax.random.key(tokens), (1, tokens), 0, cfg.vocab_size)
        cached, fresh = (runs[f](state, prompt) for f in (False, True))
        rows.append({"model": f"{cfg.num_layers}L-{cfg.hidden_size}", "tokens": tokens,
                     "cudnn_in_program": "cudnn" in runs[True].lower(state, prompt).compile().as_text().lower(),
                     "cache_path_ms": median_time(lambda r=runs[False]: r(state, prompt)) * 1e3,
                     "fresh_path_ms": median_time(lambda r=runs[True]: r(state, prompt)) * 1e3,
                     "rel_diff": relative_error(fresh, cached)})
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated: " + ", ".join(SHAPES))
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--model", action="store_true", help="time whole-model prefills instead")
    parser.add_argument("--smoke", action="store_true", help="both parts on tiny shapes, to check the script")
    args = parser.parse_args(argv)
    print(device_name(), jax.__version__, flush=True)
    if not on_gpu():
        print("cuDNN's fused attention needs an NVIDIA GPU: its columns are skipped (None)", flush=True)
    if args.model or args.smoke:
        model_prefills(SMOKE_MODEL_CASES if args.smoke else MODEL_CASES)
    if not args.model or args.smoke:
        kernels = KernelPolicy(impl="triton", interpret=interpret_kernels())
        tokens = SMOKE_TOKENS if args.smoke else tuple(map(int, args.tokens.split(",")))
        batches = (1,) if args.smoke else tuple(map(int, args.batches.split(",")))
        attention_cases([(shape, batch, n) for shape in args.shapes.split(",") for batch in batches
                         for n in tokens], kernels)
    return 0


def model_prefills(cases) -> None:
    rows = [r for cfg, token_counts in cases for r in model_prefill(cfg, token_counts)]
    print_table(rows)
    print("saved", write_json("bench_prefill_model", rows))


def attention_cases(shapes, kernels: KernelPolicy) -> None:
    rows = [case(shape, batch, tokens, kernels) for shape, batch, tokens in shapes]
    print_table([{k: v for k, v in r.items() if not k.endswith("_err")} for r in rows])
    print("saved", write_json("bench_prefill", rows))


if __name__ == "__main__":
    raise SystemExit(main())
