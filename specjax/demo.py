"""The main job: the embedded default model (SmolLM2-135M-Instruct) generating with and without
speculation (n-gram prompt lookup, and the shipped EAGLE-3 head), showing that outputs are identical and
what speculation buys.

    python -m specjax.demo [--max-tokens 96]
"""
from __future__ import annotations

import argparse
import time

from specjax import LLM, SamplingParams
from specjax.default_model import DEFAULT_EAGLE3_HEAD

PROMPTS = [
    [{"role": "user", "content": "Repeat this sentence exactly, then repeat it once more: "
                                 "The quick brown fox jumps over the lazy dog near the river bank."}],
    [{"role": "user", "content": "Rewrite this code with the variable renamed from x to count:\n"
                                 "def total(items):\n    x = 0\n    for item in items:\n        x += item\n"
                                 "    return x\n"}],
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Natalia sold clips to 48 of her friends in April, and then she sold half as "
                                 "many clips in May. How many clips did Natalia sell altogether?"}],
    # Word problems like those the EAGLE-3 head was trained on (written here, not from its training data).
    [{"role": "user", "content": "A library has 120 books and buys 3 boxes of 15 books each. Then it lends out "
                                 "40 books. How many books are left in the library?"}],
    [{"role": "user", "content": "Maria runs 3 miles every weekday and 5 miles on Saturday. How many miles does "
                                 "she run in 4 weeks?"}],
]

CONFIGS = [
    ("plain decoding", None),
    ("ngram, k=4", {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                    "prompt_lookup_min": 2}),
    # The EAGLE-3 head trained for the default model (python -m specjax.training), shipped in the package.
    ("EAGLE-3, k=3", {"method": "eagle3", "model": DEFAULT_EAGLE3_HEAD, "num_speculative_tokens": 3}),
]


def run(name: str, spec: dict | None, params: SamplingParams) -> tuple[list, float, LLM]:
    # One request at a time: the latency case speculation is for. Batched on a CPU, verifying k+1 tokens
    # costs about k+1 decode steps and speculation does not pay (benchmarks/RESULTS.md).
    llm = LLM(speculative_config=spec, max_num_seqs=1, max_model_len=1024)
    llm.chat(PROMPTS, params, use_tqdm=False)  # compile once, outside the timing
    start = time.perf_counter()
    outputs = llm.chat(PROMPTS, params, use_tqdm=False)
    return outputs, time.perf_counter() - start, llm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    baseline = None
    for name, spec in CONFIGS:
        outputs, seconds, llm = run(name, spec, params)
        n_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        print(f"\n=== {name}: {n_tokens} tokens in {seconds:.2f} s = {n_tokens / seconds:.1f} tok/s"
              + ("" if baseline is None else f", speedup {baseline[1] / seconds:.2f}x"))
        for out in outputs:
            c = out.outputs[0]
            extra = f"  [acceptance length {c.mean_acceptance_length:.2f}]" if spec else ""
            print(f"--- {c.text.strip()[:300]!r}{extra}")
        if baseline is None:
            baseline = (outputs, seconds)
        else:
            same = all(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outputs, baseline[0]))
            print(f"identical to plain decoding: {same}")
            for metric in llm.get_metrics():
                print(f"  {metric.name} = {getattr(metric, 'value', getattr(metric, 'values', None))}")


if __name__ == "__main__":
    main()
