"""What sampling costs on a GPU, per decode step and per verify step, by sampling setting.

Run in one device call:  PYTHONPATH=. python benchmarks/bench_sampling.py [--smoke]
For the SmolLM2 (49152) and Llama-3 (128256) vocabularies and rows = batch x positions (1 = batch-1
decode, 5 = batch-1 verify with k=4, up to 64 x 5): device time (profiler trace) of
- `sample` on [rows, V] logits (plain decoding's draw), and
- `processed_probs` on [rows, V] (the distribution the rejection sampler compares against),
for greedy, temperature 0.8, top-k 50, top-p 0.9 and min-p 0.1 rows. Compare with a step's time in
RESULTS.md to see where filtering matters.
Then the top-k / top-p keep mask alone (specjax.kernels.top_k_top_p): the sort against the radix search with
4-bit and 2-bit digits, with the number of tokens where their masks differ. In the steps table the rows are
the batch (the dispatcher's choice: the sort below KernelPolicy.search_min_elements batch x vocabulary
elements).
Prints tables; writes bench_sampling.json and bench_sampling_filters.json. `--smoke`: one small vocabulary and
row count, to check the script (off GPUs the search in interpret mode and no device time: NaN).
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import device_name, interpret_kernels, print_table, write_json
from benchmarks.device_trace import device_us_per_call
from specjax.engine import sampling
from specjax.engine.rows import row_params
from specjax.kernels.policy import KernelPolicy
from specjax.kernels.top_k_top_p import LARGE_BATCH_CONFIG, keep_mask
from specjax.kernels.top_k_top_p_triton import SearchConfig
from specjax.sampling_params import SamplingParams

VOCABS = (49152, 128256)
ROWS = (1, 5, 8, 40, 320)
SMOKE_VOCABS, SMOKE_ROWS = (4096,), (5,)
# name -> the settings of every row
SETTINGS = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature": SamplingParams(temperature=0.8),
    "top_k50": SamplingParams(temperature=0.8, top_k=50),
    "top_p0.9": SamplingParams(temperature=0.8, top_p=0.9),
    "min_p0.1": SamplingParams(temperature=0.8, min_p=0.1),
}


def logits_like_a_model(rows: int, vocab: int) -> jax.Array:
    """Heavy-tailed logits (a few large, most small), as a language model's are."""
    gumbel = jax.random.gumbel(jax.random.key(rows * 31 + vocab), (rows, vocab), jnp.float32)
    return 2.0 * gumbel


def filter_params(rows: int, vocab: int, setting: SamplingParams) -> tuple[np.ndarray, ...]:
    """(temperature, top_k, top_p, min_p), one entry per row, as the loop hands them to the sampler."""
    p = row_params([setting] * rows, vocab_size=vocab, max_tokens=[0] * rows, eos_token_ids=())
    return p.temperature, p.top_k, p.top_p, p.min_p


def case(vocab: int, rows: int) -> list[dict]:
    logits = logits_like_a_model(rows, vocab)
    seed, position = jnp.arange(rows, dtype=jnp.int32), jnp.full((rows,), 100, jnp.int32)
    out = []
    for name, setting in SETTINGS.items():
        params = filter_params(rows, vocab, setting)
        greedy_only = name == "greedy"
        sample_us = device_us_per_call(lambda x, *p, g=greedy_only: sampling.sample(x, *p, seed, position, greedy_only=g),
                              logits, *params)
        probs_us = None if greedy_only else device_us_per_call(sampling.processed_probs, logits, *params)
        out.append(dict(vocab=vocab, rows=rows, setting=name, sample_us=sample_us, probs_us=probs_us))
        print(out[-1], flush=True)
    return out


# name -> launch parameters of the radix search: the dispatcher's two (by batch x vocabulary)
SEARCH_CONFIGS = {"search_4bit": SearchConfig(), "search_2bit": LARGE_BATCH_CONFIG}
FILTERS = {"top_k50": (50, 1.0), "top_p0.9": (0, 0.9), "top_k50_top_p0.9": (50, 0.9)}
SORT = KernelPolicy(impl="reference")


def filter_case(vocab: int, rows: int, search_kernels: KernelPolicy) -> list[dict]:
    """search_kernels: how the search runs (impl "triton", interpreted where the device cannot run it)."""
    logits = logits_like_a_model(rows, vocab) / 0.8
    out = []
    for name, (top_k, top_p) in FILTERS.items():
        k, p = jnp.full((rows, 1), top_k, jnp.int32), jnp.full((rows, 1), top_p, jnp.float32)
        sort = keep_mask(logits, k, p, kernels=SORT)
        row = dict(vocab=vocab, rows=rows, filter=name, kept_per_row=int(sort.sum()) // rows,
                   sort_us=device_us_per_call(lambda x, k, p: keep_mask(x, k, p, kernels=SORT), logits, k, p))
        for label, config in SEARCH_CONFIGS.items():
            def search(x, k, p, c=config):
                return keep_mask(x, k, p, kernels=search_kernels, config=c)

            row[f"{label}_us"] = device_us_per_call(search, logits, k, p)
            row[f"{label}_differ"] = int(jnp.sum(jax.jit(search)(logits, k, p) != sort))
        out.append(row)
        print(row, flush=True)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocabs", default=",".join(map(str, VOCABS)))
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--sections", default="filters,steps", help="filters (the keep mask alone), "
                        "steps (sample and processed_probs per setting)")
    parser.add_argument("--smoke", action="store_true", help="one small shape, to check the script")
    args = parser.parse_args(argv)
    print(device_name(), jax.__version__, flush=True)
    vocabs = SMOKE_VOCABS if args.smoke else tuple(map(int, args.vocabs.split(",")))
    row_counts = SMOKE_ROWS if args.smoke else tuple(map(int, args.rows.split(",")))
    shapes = [(vocab, n) for vocab in vocabs for n in row_counts]
    sections = args.sections.split(",")
    if "filters" in sections:
        search_kernels = KernelPolicy(impl="triton", interpret=interpret_kernels())
        rows = [r for vocab, n in shapes for r in filter_case(vocab, n, search_kernels)]
        print_table(rows)
        print("saved", write_json("bench_sampling_filters", rows))
    if "steps" in sections:
        rows = [r for vocab, n in shapes for r in case(vocab, n)]
        print_table(rows)
        print("saved", write_json("bench_sampling", rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
