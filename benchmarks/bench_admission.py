"""Continuous admission against waves on the default model (bf16 on a GPU): GSM8K questions with max_tokens
drawn from a range, through a number of slots, plain decoding and EAGLE-3 (the shipped head).

    PYTHONPATH=. python benchmarks/bench_admission.py [--num 512] [--max-tokens 32:512] [--slots 32,128,256]
        [--k 3] [--policy fixed|auto|fixed,auto] [--dtype bfloat16] [--prompts FILE] [--model DIR --head DIR]
        [--smoke]

Waves run max_num_seqs requests per jitted call, each call as long as its longest request; admission runs
every request in one call, a slot taking the next request when its row finishes. Prints a table (tokens/s,
admission over waves, mean slot occupancy, prefill batches, same tokens as waves) and writes
$OUT/bench_admission.json (or benchmarks/results). The questions: the EAGLE-3 training run's 200 held-out
GSM8K questions, then questions it trained on (acceptance there is optimistic); EOS may end a request first.
`--model` and `--head` replace the default model and its shipped EAGLE-3 head. `--smoke`: 5 questions, 2 slots,
2 to 4 tokens, plain decoding only (checks the script).
"""
from __future__ import annotations

import argparse

import numpy as np

from benchmarks.bench_eagle import GSM8K
from benchmarks.common import print_table, time_llm, write_json
from specjax.default_model import default_eagle3_head_dir, default_model_dir
from specjax.hub import load_tokenizer
from specjax.training import data as data_lib


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", default=GSM8K)
    parser.add_argument("--num", type=int, default=512)
    parser.add_argument("--max-tokens", default="32:512", help="LOW:HIGH, each request's drawn uniformly")
    parser.add_argument("--slots", default="32,128,256")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--policy", default="fixed", help="EAGLE-3's speculation_policy: fixed, auto or both")
    parser.add_argument("--dtype", default="auto", help="the engines' dtype (auto: the checkpoint's, fp32)")
    parser.add_argument("--model", help="a checkpoint directory (default: the default model)")
    parser.add_argument("--head", help="an EAGLE-3 head for --model (default: the default model's shipped head)")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    max_model_len = 512 if args.smoke else 1024   # the smoke test's 4-layer model has 512 positions
    if args.smoke:
        args.num, args.max_tokens, args.slots = 5, "2:4", "2"
    model_dir = args.model or default_model_dir()
    train, held = data_lib.split_heldout(data_lib.load_questions(args.prompts), 200)
    questions = (held + train)[:args.num]
    prompt_ids = data_lib.chat_prompt_ids(load_tokenizer(str(model_dir)), questions)
    low, high = (int(x) for x in args.max_tokens.split(":"))
    budgets = np.random.default_rng(0).integers(low, high + 1, size=len(prompt_ids)).tolist()
    head = args.head or str(default_eagle3_head_dir())
    engines = [("plain", None)] + [
        (f"eagle3 k={args.k}" + ("" if policy == "fixed" else f" {policy}"),
         {"method": "eagle3", "model": head, "num_speculative_tokens": args.k, "speculation_policy": policy})
        for policy in args.policy.split(",")]
    if args.smoke:
        engines = engines[:1]
    rows = []
    for slots in (int(s) for s in args.slots.split(",")):
        for name, spec in engines:
            waves = time_llm(model_dir, spec, prompt_ids, slots, budgets, dtype=args.dtype, continuous_admission=False,
                             max_model_len=max_model_len)
            admitted = time_llm(model_dir, spec, prompt_ids, slots, budgets, dtype=args.dtype,
                                max_model_len=max_model_len)
            n = sum(map(len, admitted["tokens"]))
            for mode, result in (("waves", waves), ("admission", admitted)):
                rows.append(dict(engine=f"specjax {name}", slots=slots, mode=mode,
                                 tok_s=round(n / result["seconds"], 1),
                                 over_waves=round(waves["seconds"] / result["seconds"], 2),
                                 occupancy=result["occupancy"] and round(result["occupancy"], 3),
                                 admissions=result["admissions"],
                                 acceptance_length=result["acceptance_length"] and round(
                                     result["acceptance_length"], 3),
                                 same_as_waves=result["tokens"] == waves["tokens"]))
    print_table(rows)
    write_json("bench_admission", rows)


if __name__ == "__main__":
    main()
