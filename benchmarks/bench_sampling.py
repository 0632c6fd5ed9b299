"""What sampling costs on a GPU, per decode step and per verify step, by sampling setting.

Run in one device call:  PYTHONPATH=. python benchmarks/bench_sampling.py
For the SmolLM2 (49152) and Llama-3 (128256) vocabularies and rows = batch x positions (1 = batch-1
decode, 5 = batch-1 verify with k=4, up to 64 x 5): device time (profiler trace) of
- `sample` on [rows, V] logits (plain decoding's draw), and
- `processed_probs` on [rows, V] (the distribution the rejection sampler compares against),
for greedy, temperature 0.8, top-k 50, top-p 0.9 and min-p 0.1 rows. Compare with a step's time in
RESULTS.md (SmolLM2 0.79 ms, 8B 4.33 ms at batch 1) to see where filtering matters.
Then the top-k / top-p keep mask alone (specjax.kernels.top_k_top_p): the sort against the radix search with
4-bit and 2-bit digits, with the number of tokens where their masks differ. In the steps table the rows are
the batch (the dispatcher's choice: the sort below 2**17 batch x vocabulary elements).
Prints tables; writes bench_sampling.json and bench_sampling_filters.json.
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from benchmarks.common import device_name, print_table, write_json
from benchmarks.device_trace import device_us_per_call
from specjax.engine import sampling
from specjax.kernels.top_k_top_p import LARGE_BATCH_CONFIG, keep_mask
from specjax.kernels.top_k_top_p_triton import SearchConfig

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


# name -> launch parameters of the radix search: the dispatcher's two (by batch x vocabulary)
SEARCH_CONFIGS = {"search_4bit": SearchConfig(), "search_2bit": LARGE_BATCH_CONFIG}
INTERPRET = jax.devices()[0].platform != "gpu"   # a CPU smoke run of the script
FILTERS = {"top_k50": (50, 1.0), "top_p0.9": (0, 0.9), "top_k50_top_p0.9": (50, 0.9)}


def filter_case(vocab: int, rows: int) -> list[dict]:
    logits = logits_like_a_model(rows, vocab) / 0.8
    out = []
    for name, (top_k, top_p) in FILTERS.items():
        k, p = jnp.full((rows, 1), top_k, jnp.int32), jnp.full((rows, 1), top_p, jnp.float32)
        sort = keep_mask(logits, k, p, impl="reference")
        row = dict(vocab=vocab, rows=rows, filter=name, kept_per_row=int(sort.sum()) // rows,
                   sort_us=device_us_per_call(lambda x, k, p: keep_mask(x, k, p, impl="reference"), logits, k, p))
        for label, config in SEARCH_CONFIGS.items():
            search = lambda x, k, p, c=config: keep_mask(x, k, p, impl="triton", config=c, interpret=INTERPRET)
            row[f"{label}_us"] = device_us_per_call(search, logits, k, p)
            row[f"{label}_differ"] = int(jnp.sum(jax.jit(search)(logits, k, p) != sort))
        out.append(row)
        print(row, flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocabs", default=",".join(map(str, VOCABS)))
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--sections", default="filters,steps", help="filters (the keep mask alone), "
                        "steps (sample and processed_probs per setting)")
    args = parser.parse_args()
    print(device_name(), jax.__version__, flush=True)
    shapes = [(vocab, n) for vocab in map(int, args.vocabs.split(",")) for n in map(int, args.rows.split(","))]
    sections = args.sections.split(",")
    if "filters" in sections:
        rows = [r for vocab, n in shapes for r in filter_case(vocab, n)]
        print_table(rows)
        print("saved", write_json("bench_sampling_filters", rows))
    if "steps" in sections:
        rows = [r for vocab, n in shapes for r in case(vocab, n)]
        print_table(rows)
        print("saved", write_json("bench_sampling", rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
