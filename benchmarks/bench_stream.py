"""What streaming costs: the default model's generation as one call against LLM.generate_stream in chunks of
a few loop steps (each chunk a device round trip, the host reading the tokens so far and decoding them).

    PYTHONPATH=. python benchmarks/bench_stream.py [--max-tokens 128] [--intervals 1,4,16] [--repeats 5]
        [--method ngram] [--model DIR] [--smoke]

Greedy with ignore_eos, batch 1, compiled beforehand (one warm-up call each); the median of --repeats rounds
in which the runs take turns.
Writes $OUT/bench_stream.json (or benchmarks/results): one row for generate, one per stream interval, with
tokens/s, the time to the first streamed token, and whether the streamed tokens are generate's. `--smoke`: 4
tokens, one interval, one run (checks the script). `--model`: another checkpoint than the default model.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time

from benchmarks.common import print_table, write_json
from specjax import LLM, SamplingParams

PROMPT = [{"role": "user", "content": "Write a short story about a lighthouse keeper and a storm."}]


def time_generate(llm: LLM, params: SamplingParams) -> tuple[float, None, list[int]]:
    start = time.perf_counter()
    tokens = llm.chat(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    return time.perf_counter() - start, None, tokens


def time_stream(llm: LLM, params: SamplingParams, interval: int) -> tuple[float, float, list[int]]:
    """(seconds, seconds to the first token, the streamed tokens)."""
    start, first, tokens = time.perf_counter(), None, []
    for update in llm.chat_stream(PROMPT, params, stream_interval=interval):
        if update.token_ids and first is None:
            first = time.perf_counter() - start
        tokens += update.token_ids
    return time.perf_counter() - start, first, tokens


def measure(runs: dict, repeats: int) -> dict:
    """Per named run: median seconds, tokens/s and first-token seconds over `repeats` rounds after one warm-up
    call each (which compiles). The runs take turns within each round, so a load that comes and goes on the
    machine falls on all of them alike."""
    for run in runs.values():
        run()
    samples = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            samples[name].append(run())
    results = {}
    for name, timed in samples.items():
        median = statistics.median(seconds for seconds, _, _ in timed)
        firsts = [first for _, first, _ in timed if first is not None]
        results[name] = dict(seconds=median, tok_s=len(timed[0][2]) / median, tokens=timed[0][2],
                             first_token_s=statistics.median(firsts) if firsts else None)
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--intervals", default="1,4,16", help="stream_interval values (loop steps per update)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--method", default=None, choices=[None, "ngram"], help="ngram: k=4 prompt lookup")
    parser.add_argument("--model", help="a checkpoint directory (default: the default model)")
    parser.add_argument("--smoke", action="store_true", help="4 tokens, one interval, one run: checks the script")
    args = parser.parse_args(argv)
    if args.smoke:
        args.max_tokens, args.intervals, args.repeats = 4, "2", 1
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
            "prompt_lookup_min": 2} if args.method else None
    max_model_len = 256 if args.smoke else 1024   # the smoke test's 4-layer model has 512 positions
    llm = LLM(args.model, max_model_len=max_model_len, max_num_seqs=1, speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    intervals = [int(i) for i in args.intervals.split(",")]
    runs = {None: lambda: time_generate(llm, params)}
    runs.update({interval: functools.partial(time_stream, llm, params, interval) for interval in intervals})
    results = measure(runs, args.repeats)
    base = results[None]
    rows = [dict(mode="generate" if interval is None else "generate_stream", interval=interval,
                 tok_s=r["tok_s"], seconds=r["seconds"], cost_vs_generate=r["seconds"] / base["seconds"] - 1,
                 first_token_s=r["first_token_s"], same_tokens=r["tokens"] == base["tokens"])
            for interval, r in results.items()]
    print_table(rows)
    write_json("bench_stream", rows)
    if not all(row["same_tokens"] for row in rows):
        raise SystemExit("streamed tokens differ from generate's")


if __name__ == "__main__":
    main()
