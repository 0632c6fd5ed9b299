"""EAGLE-3 and MTP on the default model (SmolLM2-135M-Instruct, fp32): the shipped heads against plain decoding
and n-gram speculation, greedy, on held-out GSM8K questions (the training runs' held-out split).

    PYTHONPATH=. python benchmarks/bench_eagle.py [--head HEAD_DIR (default: the shipped head)] [--num 32]
        [--mtp MTP_HEAD_DIR (default: the shipped MTP head; "" leaves MTP out)]
        [--max-tokens 256] [--batches 1,8] [--k 3] [--policy fixed|auto|fixed,auto] [--prompts FILE] [--dtype bfloat16]
        [--chains 3,5] [--trees 16:4:5,32:4:6] [--methods ngram,eagle3,mtp] [--profile] [--target h200] [--smoke]

Prints a table (tokens/s, speedup over plain, acceptance length and per-position rates, same tokens as plain)
and writes $OUT/bench_eagle.json (or benchmarks/results), rewritten after each engine (a run cut short keeps
what it measured). `--smoke`: one question, a few tokens, batch 1 (checks
the script). `--policy auto` runs the speculative engines under adaptive speculation (k chosen each step
between 0 and --k; the step times are measured in the untimed warm-up run), and reports how often each k ran.
`--prompts ../shared/data/chat_prompts.jsonl` takes general chat prompts instead of GSM8K's questions.
`--chains` adds EAGLE-3 (and MTP) chains of those k, `--trees NODES:BRANCHING:DEPTH,...` EAGLE-3 (and MTP) draft
trees of those shapes. `--profile` also counts the launches one iteration of each engine's compiled loop runs,
by what the engine loop called (drafting, the target's pass, acceptance, commit), and on a GPU traces one wave
after the timed run: where an iteration's device time goes, by loop call and by innermost function
(benchmarks/loop_profile.py); written to $OUT/bench_eagle_profile.json. `--target h200` runs nothing: it compiles
each engine's loop for an H200 on this host (benchmarks/gpu_target.py says what that needs) and prints the
launches per iteration a GPU would run, by loop call, and the memory its temporaries take.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.common import print_table, reuse_compilations, time_llm, write_json
from benchmarks.gpu_target import compiling_for, h200
from benchmarks.loop_profile import compiled_loop, loop_launches
from specjax import LLM, SamplingParams
from specjax.default_model import default_eagle3_head_dir, default_model_dir, default_mtp_head_dir
from specjax.hub import load_tokenizer
from specjax.training import data as data_lib

# The GSM8K questions in shared/, which sits beside the working checkout (a clone elsewhere finds it at /work).
_GSM8K_PLACES = [Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k_train.jsonl",
                 Path("/work/shared/data/gsm8k_train.jsonl")]
GSM8K = next((path for path in _GSM8K_PLACES if path.is_file()), _GSM8K_PLACES[0])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--head", default=str(default_eagle3_head_dir()))
    parser.add_argument("--mtp", default=str(default_mtp_head_dir()), help="an MTP head directory ('': none)")
    parser.add_argument("--prompts", default=GSM8K)
    parser.add_argument("--num", type=int, default=32, help="held-out questions to run")
    parser.add_argument("--num-heldout", type=int, default=200, help="the training run's held-out split size")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--dtype", default="auto", help="the engines' dtype (auto: the checkpoint's, fp32)")
    parser.add_argument("--policy", default="fixed", help="speculation_policy of the speculative engines: "
                        "fixed, auto, or both (fixed,auto)")
    parser.add_argument("--chains", default="", help="more EAGLE-3 chains: comma-separated k")
    parser.add_argument("--trees", default="", help="EAGLE-3 draft trees: comma-separated NODES:BRANCHING:DEPTH")
    parser.add_argument("--methods", default="ngram,eagle3,mtp", help="the speculative methods to run beside plain")
    parser.add_argument("--profile", action="store_true", help="each engine's launches (and GPU time) per iteration")
    parser.add_argument("--target", choices=["h200"], help="compile each loop for this GPU here and count its "
                        "launches per iteration; nothing runs")
    parser.add_argument("--smoke", action="store_true", help="1 question, 8 tokens, batch 1: checks the script")
    args = parser.parse_args(argv)
    if args.profile:   # the profile compiles each loop again to read its stack frames: from this cache, a load
        reuse_compilations()
    if args.smoke:
        args.num, args.max_tokens, args.batches, args.trees = 1, 8, "1", args.trees or "4:2:2"
    model_dir = default_model_dir()
    _, held = data_lib.split_heldout(data_lib.load_questions(args.prompts), args.num_heldout)
    prompt_ids = data_lib.chat_prompt_ids(load_tokenizer(str(model_dir)), held[:args.num])
    drafters = [(f"ngram k={args.k}", {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4,
                                       "prompt_lookup_min": 2}),
                *[(f"eagle3 k={k}", {"method": "eagle3", "model": args.head, "num_speculative_tokens": k})
                  for k in [args.k] + [int(k) for k in args.chains.split(",") if k]],
                *[(f"eagle3 tree {shape}", _tree_spec("eagle3", args.head, shape)) for shape in args.trees.split(",")
                  if shape],
                *[(f"mtp k={k}", {"method": "mtp", "model": args.mtp, "num_speculative_tokens": k})
                  for k in ([args.k] + [int(k) for k in args.chains.split(",") if k] if args.mtp else [])],
                *[(f"mtp tree {shape}", _tree_spec("mtp", args.mtp, shape)) for shape in args.trees.split(",")
                  if shape and args.mtp]]
    methods = args.methods.split(",")
    specs = [("plain", None)] + [(name if policy == "fixed" else f"{name} {policy}",
                                  {**spec, "speculation_policy": policy})
                                 for policy in args.policy.split(",") for name, spec in drafters
                                 if spec["method"] in methods]
    if args.target:
        return _target_launches(model_dir, specs, prompt_ids, args)
    rows, profiles = [], []
    for batch in (int(b) for b in args.batches.split(",")):
        plain = None
        for name, spec in specs:
            result = time_llm(model_dir, spec, prompt_ids, batch, args.max_tokens, dtype=args.dtype,
                              profile=args.profile)
            plain = plain or result
            n = sum(map(len, result["tokens"]))
            rows.append(dict(engine=f"specjax {name}", batch=batch, tok_s=round(n / result["seconds"], 1),
                             speedup=round(plain["seconds"] / result["seconds"], 2),
                             acceptance_length=result["acceptance_length"] and round(result["acceptance_length"], 3),
                             per_position=result["per_position"] and [round(r, 3) for r in result["per_position"]],
                             same_as_plain=result["tokens"] == plain["tokens"],
                             iterations_per_k=result["iterations_per_k"]))
            print(rows[-1], flush=True)
            write_json("bench_eagle", rows)
            if result["profile"] is not None:
                profiles.append(dict(engine=rows[-1]["engine"], batch=batch, **result["profile"]))
                _print_profile(profiles[-1])
                write_json("bench_eagle_profile", profiles)
    print_table(rows)


def _target_launches(model_dir: Path, specs: list[tuple[str, dict | None]], prompt_ids: list[list[int]], args) -> None:
    """Each engine's loop compiled for the --target GPU (no run): launches per iteration, by loop call, and the
    device memory its buffers need beyond arguments and outputs (temp_bytes)."""
    device = h200()
    profiles = []
    for batch in (int(b) for b in args.batches.split(",")):
        for name, spec in specs:
            with compiling_for(device):
                llm = LLM(str(model_dir), speculative_config=spec, max_model_len=1024, max_num_seqs=batch,
                          dtype=args.dtype)
                compiled = compiled_loop(llm, prompt_ids[:batch], SamplingParams(temperature=0.0,
                                         max_tokens=args.max_tokens), device)
            profiles.append(dict(engine=f"specjax {name}", batch=batch, target=args.target,
                                 temp_bytes=compiled.memory_analysis().temp_size_in_bytes,
                                 **loop_launches(compiled.as_text())))
            _print_profile(profiles[-1])
            write_json("bench_eagle_target", profiles)
    print_table([{k: p[k] for k in ("engine", "batch", "launches_per_iteration", "temp_bytes")} for p in profiles])


def _print_profile(profile: dict) -> None:
    print(f"{profile['engine']}, batch {profile['batch']}: {profile['launches_per_iteration']} launches per "
          "iteration of the compiled loop")
    print_table(profile["launches_by_loop_call"])
    if "iterations" in profile:
        print(f"device: {profile['busy_us_per_iteration']:.1f} us busy and {profile['kernels_per_iteration']:.1f} "
              f"kernels per iteration ({profile['iterations']} iterations)")
        print_table(profile["by_loop_call"])
        print_table(profile["by_function"])


def _tree_spec(method: str, head: str, shape: str) -> dict:
    nodes, branching, depth = (int(x) for x in shape.split(":"))
    return {"method": method, "model": head, "num_speculative_tokens": depth, "tree_nodes": nodes,
            "tree_branching": branching}


if __name__ == "__main__":
    main()
