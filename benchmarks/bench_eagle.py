"""EAGLE-3 on the default model (SmolLM2-135M-Instruct, fp32): the shipped head against plain decoding and
n-gram speculation, greedy, on held-out GSM8K questions (the training run's held-out split).

    PYTHONPATH=. python benchmarks/bench_eagle.py [--head heads/EAGLE3-SmolLM2-135M-Instruct] [--num 32]
        [--max-tokens 256] [--batches 1,8] [--k 3]

Prints a table (tokens/s, speedup over plain, acceptance length and per-position rates, same tokens as plain)
and writes $OUT/bench_eagle.json (or ./).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks.common import print_table, write_json
from specjax import LLM, SamplingParams
from specjax.default_model import default_model_dir
from specjax.hub import load_tokenizer
from specjax.training import data as data_lib

DEFAULT_HEAD = Path(__file__).resolve().parent.parent / "heads" / "EAGLE3-SmolLM2-135M-Instruct"
GSM8K = "/work/shared/data/gsm8k_train.jsonl"


def run(model_dir, spec, prompt_ids, batch: int, max_tokens: int) -> dict:
    llm = LLM(str(model_dir), speculative_config=spec, max_model_len=1024, max_num_seqs=batch)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    inputs = [{"prompt_token_ids": ids} for ids in prompt_ids]
    llm.generate(inputs[:batch], params, use_tqdm=False)  # compile
    start = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    drafts = sum(o.outputs[0].num_drafts for o in outs)
    accepted = sum(o.outputs[0].num_accepted_tokens for o in outs)
    per_pos = [sum(o.outputs[0].num_accepted_tokens_per_pos[i] for o in outs) / drafts
               for i in range(spec["num_speculative_tokens"])] if spec and drafts else None
    return dict(tokens=tokens, seconds=seconds, acceptance_length=(1 + accepted / drafts) if drafts else None,
                per_position=per_pos)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--head", default=str(DEFAULT_HEAD))
    parser.add_argument("--prompts", default=GSM8K)
    parser.add_argument("--num", type=int, default=32, help="held-out questions to run")
    parser.add_argument("--num-heldout", type=int, default=200, help="the training run's held-out split size")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--k", type=int, default=3)
    args = parser.parse_args()
    model_dir = default_model_dir()
    _, held = data_lib.split_heldout(data_lib.load_questions(args.prompts), args.num_heldout)
    prompt_ids = data_lib.chat_prompt_ids(load_tokenizer(str(model_dir)), held[:args.num])
    specs = [("plain", None),
             (f"ngram k={args.k}", {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4,
                                    "prompt_lookup_min": 2}),
             (f"eagle3 k={args.k}", {"method": "eagle3", "model": args.head, "num_speculative_tokens": args.k})]
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        plain = None
        for name, spec in specs:
            result = run(model_dir, spec, prompt_ids, batch, args.max_tokens)
            plain = plain or result
            n = sum(map(len, result["tokens"]))
            rows.append(dict(engine=f"specjax {name}", batch=batch, tok_s=round(n / result["seconds"], 1),
                             speedup=round(plain["seconds"] / result["seconds"], 2),
                             acceptance_length=result["acceptance_length"] and round(result["acceptance_length"], 3),
                             per_position=result["per_position"] and [round(r, 3) for r in result["per_position"]],
                             same_as_plain=result["tokens"] == plain["tokens"]))
    print_table(rows)
    write_json("bench_eagle", rows)


if __name__ == "__main__":
    main()
