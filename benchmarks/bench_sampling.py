"""What sampling costs on a GPU, per decode step and per verify step, by sampling setting.

Run in one device call:  PYTHONPATH=. python benchmarks/bench_sampling.py
For the SmolLM2 (49152) and Llama-3 (128256) vocabularies and rows = batch x positions (1 = batch-1
decode, 5 = batch-1 verify with k=4, up to 64 x 5): device time (profiler trace) of
- `sample` on [rows, V] logits (plain decoding's draw), and
- `processed_probs` on [rows, V] (the distribution the rejection sampler compares against),
for greedy, temperature 0.8, top-k 50, top-p 0.9 and min-p 0.1 rows. Compare with a step's time in
RESULTS.md (SmolLM2 0.79 ms, 8B 4.33 ms at batch 1) to see where filtering matters.
Prints a table; writes bench_sampling.json.
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from benchmarks.common import device_name, print_table, write_json
from benchmarks.device_trace import device_us_per_call
from specjax.engine import sampling

VOCABS = (49152, 128256)
ROWS = (1, 5, 8, 40, 320)
# name -> (temperature, top_k, top_p, min_p) of every row
SETTINGS = {
    "greedy": (0.0, 0, 1.0, 0.0),
    "temperature": (0.8, 0, 1.0, 0.0),
    "top_k50": (0.8, 50, 1.0, 0.0),
    "top_p0.9": (0.8, 0, 0.9, 0.0),
    "min_p0.1": (0.8, 0, 1.0, 0.1),
}


def logits_like_a_model(rows: int, vocab: int) -> jax.Array:
    """Heavy-tailed logits (a few large, most small), as a language model's are."""
    gumbel = jax.random.gumbel(jax.random.key(rows * 31 + vocab), (rows, vocab), jnp.float32)
    return 2.0 * gumbel


def row_params(rows: int, setting: tuple) -> tuple[jax.Array, ...]:
    temperature, top_k, top_p, min_p = setting
    full = lambda value, dtype: jnp.full((rows,), value, dtype)
    return (full(temperature, jnp.float32), full(top_k, jnp.int32), full(top_p, jnp.float32),
            full(min_p, jnp.float32))


def case(vocab: int, rows: int) -> list[dict]:
    logits = logits_like_a_model(rows, vocab)
    seed, position = jnp.arange(rows, dtype=jnp.int32), jnp.full((rows,), 100, jnp.int32)
    out = []
    for name, setting in SETTINGS.items():
        params = row_params(rows, setting)
        greedy_only = name == "greedy"
        sample_us = device_us_per_call(lambda x, *p, g=greedy_only: sampling.sample(x, *p, seed, position, greedy_only=g),
                              logits, *params)
        probs_us = None if greedy_only else device_us_per_call(sampling.processed_probs, logits, *params)
        out.append(dict(vocab=vocab, rows=rows, setting=name, sample_us=sample_us, probs_us=probs_us))
        print(out[-1], flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocabs", default=",".join(map(str, VOCABS)))
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    args = parser.parse_args()
    print(device_name(), jax.__version__, flush=True)
    rows = [r for vocab in map(int, args.vocabs.split(",")) for n in map(int, args.rows.split(","))
            for r in case(vocab, n)]
    print_table(rows)
    print("saved", write_json("bench_sampling", rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
