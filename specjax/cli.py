"""The `specjax` command (also `python -m specjax`):

    specjax generate "The capital of France is" --max-tokens 32 --method ngram --num-speculative-tokens 4
    specjax generate --input prompts.jsonl --output outputs.jsonl --draft-model EAGLE3-SmolLM2-135M-Instruct
    specjax chat --draft-model EAGLE3-SmolLM2-135M-Instruct --num-speculative-tokens 3
    specjax bench latency --batch-size 1 8 --num-speculative-tokens 0 3 --method ngram --output-json b.json
    specjax convert gguf-to-hf IN.gguf OUT_DIR
    specjax train --prompts prompts.jsonl --out HEAD_DIR --work WORK_DIR

Without a speculative flag the model decodes plainly. A mistake in what was asked (a bad flag value, a
missing file, a prompt too long) ends with one line on stderr and exit status 1.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

# This module imports only the standard library at the top, so building the parser (and --help) loads no
# JAX; each command imports what it runs.

PERCENTILES = (10, 25, 50, 75, 90, 99)   # as `vllm bench latency` reports
USER_ERRORS = (ValueError, TypeError, FileNotFoundError)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in DELEGATED:
            return DELEGATED[argv[0]](argv[1:])
        args = build_parser().parse_args(argv)
        return args.run(args)
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specjax", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _generate_parser(commands)
    _chat_parser(commands)
    _bench_parser(commands)
    # Listed for --help; their arguments (and own --help) are the delegated CLIs', dispatched in main().
    commands.add_parser("convert", add_help=False,
                        help="convert checkpoints: gguf-to-hf, hf-to-orbax (specjax convert --help)")
    commands.add_parser("train", add_help=False,
                        help="train an EAGLE-3 or MTP head from prompts (specjax train --help)")
    return parser


# --------------------------------------------------------------------------------------------
# Flags shared by generate, chat and bench
# --------------------------------------------------------------------------------------------

def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model and engine (LLM arguments)")
    group.add_argument("--model", default=None,
                       help="HF directory, Hub id or orbax checkpoint (default: the embedded SmolLM2-135M-Instruct)")
    group.add_argument("--tokenizer", default=None, help="tokenizer directory or Hub id (default: the model's)")
    group.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--max-num-seqs", type=int, default=16, help="rows generated together (batch size)")
    group.add_argument("--tensor-parallel-size", type=int, default=1)
    group.add_argument("--seed", type=int, default=0)


def _add_speculative_flags(parser: argparse.ArgumentParser, *, sweep: bool = False) -> None:
    group = parser.add_argument_group("speculative decoding (speculative_config keys; none given: plain decoding)")
    group.add_argument("--speculative-config", type=json_object, default=None, metavar="JSON",
                       help="vLLM's speculative_config as JSON; the flags below override its keys")
    group.add_argument("--method", default=None, help="ngram, draft_model, eagle, eagle3 or mtp (inferred if omitted)")
    group.add_argument("--draft-model", default=None,
                       help="draft model or head: a directory, Hub id, or EAGLE3-SmolLM2-135M-Instruct (shipped)")
    if sweep:
        group.add_argument("--num-speculative-tokens", type=int, nargs="+", default=[0], metavar="K",
                           help="k values to measure; 0 is plain decoding, the speedups' baseline (default: 0)")
    else:
        group.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K")
    group.add_argument("--prompt-lookup-min", type=int, default=None)
    group.add_argument("--prompt-lookup-max", type=int, default=None)


def _add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling (SamplingParams; unset: the model's defaults)")
    group.add_argument("--temperature", type=float, default=None, help="0 is greedy")
    group.add_argument("--top-p", type=float, default=None)
    group.add_argument("--top-k", type=int, default=None)
    group.add_argument("--min-p", type=float, default=None)
    group.add_argument("--max-tokens", type=int, default=None)
    group.add_argument("--min-tokens", type=int, default=None)
    group.add_argument("--n", type=int, default=None, help="completions per prompt")
    group.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true", default=None)


def json_object(text: str) -> dict:
    """An argparse type: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not valid JSON ({err.msg}): {text!r}") from err
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens", "n", "stop", "ignore_eos")
SPECULATIVE_FLAGS = {"method": "method", "draft_model": "model", "num_speculative_tokens": "num_speculative_tokens",
                     "prompt_lookup_min": "prompt_lookup_min", "prompt_lookup_max": "prompt_lookup_max"}


def speculative_config(args: argparse.Namespace, **overrides: Any) -> dict | None:
    """--speculative-config with the flags given over it; None when nothing asks for speculation."""
    config = dict(args.speculative_config or {})
    flags = {key: getattr(args, flag) for flag, key in SPECULATIVE_FLAGS.items()}
    config.update({key: value for key, value in {**flags, **overrides}.items() if value is not None})
    return config or None


def sampling_params(llm, args: argparse.Namespace, **overrides: Any):
    """The model's default SamplingParams with the flags given (then `overrides`) over them."""
    given = {name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name) is not None}
    return dataclasses.replace(llm.get_default_sampling_params(), **{**given, **overrides})


def load_llm(args: argparse.Namespace, spec: dict | None):
    from tqdm.auto import tqdm

    from specjax import LLM

    # tqdm.write keeps the line clear of a progress bar running meanwhile (bench's).
    tqdm.write(f"loading {args.model or 'the default model'}"
               + (f" with speculative_config={json.dumps(spec)}" if spec else " (plain decoding)"), file=sys.stderr)

    return LLM(args.model, tokenizer=args.tokenizer, dtype=args.dtype, max_model_len=args.max_model_len,
               max_num_seqs=args.max_num_seqs, tensor_parallel_size=args.tensor_parallel_size, seed=args.seed,
               speculative_config=spec)


# --------------------------------------------------------------------------------------------
# generate
# --------------------------------------------------------------------------------------------

def _generate_parser(commands) -> None:
    parser = commands.add_parser(
        "generate", help="generate for prompts; JSON lines out",
        description="Generate for prompts given as arguments, in --input (text lines, or JSON lines with "
                    "'prompt', 'prompt_token_ids' or 'messages') or on stdin. Writes one JSON object per prompt "
                    "(vLLM's RequestOutput fields and the speculative counters), in input order.")
    parser.add_argument("prompts", nargs="*", help="prompt texts (none: read --input, else stdin)")
    _add_prompt_file_flags(parser)
    parser.add_argument("--output", "-o", default=None, help="JSON lines file (default: stdout)")
    _add_engine_flags(parser)
    _add_speculative_flags(parser)
    _add_sampling_flags(parser)
    parser.set_defaults(run=run_generate)


def _add_prompt_file_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", "-i", default=None,
                        help="prompts file ('-': stdin): text lines, or JSON lines with 'prompt', "
                             "'prompt_token_ids' or 'messages'")
    parser.add_argument("--chat", action="store_true",
                        help="send text prompts as a user turn through the chat template")


def run_generate(args: argparse.Namespace) -> int:
    records = read_prompts(args.prompts, args.input, chat=args.chat)
    llm = load_llm(args, speculative_config(args))
    params = sampling_params(llm, args)
    start = time.perf_counter()
    outputs = generate_records(llm, records, params)
    seconds = time.perf_counter() - start
    with _open_output(args.output) as sink:
        for output in outputs:
            sink.write(json.dumps(output_record(output)) + "\n")
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    length = mean_acceptance_length(llm)
    print(f"{len(outputs)} prompts, {tokens} tokens in {seconds:.2f} s, compilation included"
          + ("" if length is None else f"; acceptance length {length:.2f}"), file=sys.stderr)
    return 0


def read_prompts(texts: Sequence[str], path: str | None, *, chat: bool) -> list[dict]:
    """Prompt records ({"prompt"} / {"prompt_token_ids"} / {"messages"}) from the arguments, then the file
    ("-": stdin; stdin also when neither is given)."""
    lines: list[tuple[str, int, str]] = [("argument", n, t) for n, t in enumerate(texts, 1)]
    if path is not None or not texts:
        source = "stdin" if path in (None, "-") else path
        text = sys.stdin.read() if source == "stdin" else Path(path).read_text()
        lines += [(source, n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise ValueError("no prompts: pass them as arguments, with --input FILE, or on stdin")
    return [_prompt_record(source, n, line, chat=chat) for source, n, line in lines]


def _prompt_record(source: str, number: int, line: str, *, chat: bool) -> dict:
    if source != "argument" and line.lstrip().startswith("{"):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{source}:{number}: not valid JSON ({err.msg})") from err
        if not any(key in record for key in ("prompt", "prompt_token_ids", "messages")):
            raise ValueError(f"{source}:{number}: a JSON line needs 'prompt', 'prompt_token_ids' or 'messages'")
        return record
    return {"messages": [{"role": "user", "content": line}]} if chat else {"prompt": line}


def generate_records(llm, records: list[dict], params, use_tqdm: bool = True) -> list:
    """RequestOutputs in the records' order: conversations through llm.chat, the rest through llm.generate,
    request ids numbered by input line."""
    outputs: list = [None] * len(records)
    chats = [i for i, r in enumerate(records) if "messages" in r]
    plain = [i for i, r in enumerate(records) if "messages" not in r]
    if chats:
        for i, out in zip(chats, llm.chat([records[i]["messages"] for i in chats], params, use_tqdm=use_tqdm)):
            outputs[i] = out
    if plain:
        for i, out in zip(plain, llm.generate([records[i] for i in plain], params, use_tqdm=use_tqdm)):
            outputs[i] = out
    for i, out in enumerate(outputs):
        out.request_id = str(i)
    return outputs


def output_record(output) -> dict:
    """A RequestOutput as JSON: vLLM's fields, each completion with its mean acceptance length added."""
    record = dataclasses.asdict(output)
    for fields, completion in zip(record["outputs"], output.outputs):
        fields["mean_acceptance_length"] = completion.mean_acceptance_length
    return record


def _open_output(path: str | None):
    return contextlib.nullcontext(sys.stdout) if path is None else open(path, "w")


def mean_acceptance_length(llm) -> float | None:
    """Over every request so far, from llm.get_metrics() (None without speculation)."""
    metrics = {m.name: m for m in llm.get_metrics()}
    if not metrics:
        return None
    drafts = metrics["vllm:spec_decode_num_drafts"].value
    return 1 + metrics["vllm:spec_decode_num_accepted_tokens"].value / drafts if drafts else 1.0


# --------------------------------------------------------------------------------------------
# chat
# --------------------------------------------------------------------------------------------

def _chat_parser(commands) -> None:
    parser = commands.add_parser(
        "chat", help="chat interactively, replies streamed (the conversation is kept)",
        description="Read one user turn per line on stdin, print each reply as it is generated. /reset starts "
                    "the conversation over; /exit or end of input quits.")
    parser.add_argument("--system", default=None, help="a system message opening the conversation")
    _add_engine_flags(parser)
    _add_speculative_flags(parser)
    _add_sampling_flags(parser)
    parser.set_defaults(run=run_chat, max_tokens=512, max_num_seqs=1)


def run_chat(args: argparse.Namespace) -> int:
    llm = load_llm(args, speculative_config(args))
    params = sampling_params(llm, args)
    opening = [{"role": "system", "content": args.system}] if args.system else []
    conversation = list(opening)
    print("chat: one turn per line; /reset starts over, /exit or Ctrl-D quits", file=sys.stderr)
    for line in _user_turns():
        if line == "/exit":
            break
        if line == "/reset":
            conversation = list(opening)
            continue
        conversation.append({"role": "user", "content": line})
        conversation.append({"role": "assistant", "content": reply(llm, conversation, params)})
    return 0


def _user_turns() -> Iterator[str]:
    while True:
        try:
            line = input("> " if sys.stdin.isatty() else "").strip()
        except EOFError:
            return
        if line:
            yield line


def reply(llm, conversation: list[dict], params) -> str:
    """Generate the assistant's next turn, printing it as it comes (LLM.chat_stream), and return its text. (The
    one place that prints a reply.)"""
    start = time.perf_counter()
    printer = TrimmedPrinter()
    for update in llm.chat_stream(conversation, params):
        printer.write(update.text)
        if update.output is not None:   # the last update
            completion = update.output.outputs[0]
    printer.end()
    seconds = time.perf_counter() - start
    print(f"[{len(completion.token_ids)} tokens, {len(completion.token_ids) / seconds:.1f} tokens/s"
          + (f", acceptance length {completion.mean_acceptance_length:.2f}]" if completion.num_drafts else "]"),
          file=sys.stderr)
    return completion.text


class TrimmedPrinter:
    """Prints text pieces as they come, as print("".join(pieces).strip()) would at the end: leading whitespace
    dropped, other whitespace held back until text follows it (a reply's trailing newlines never show)."""

    def __init__(self):
        self._held, self._begun = "", False

    def write(self, piece: str) -> None:
        text = self._held + piece if self._begun else piece.lstrip()
        shown = text.rstrip()
        if shown:
            print(shown, end="", flush=True)
            self._begun = True
        self._held = text[len(shown):]

    def end(self) -> None:
        print(flush=True)


# --------------------------------------------------------------------------------------------
# bench
# --------------------------------------------------------------------------------------------

def _bench_parser(commands) -> None:
    parser = commands.add_parser(
        "bench", help="latency / throughput over k and batch size, as vllm bench does; JSON and a plot",
        description="Time generation (ignore_eos) for every k in --num-speculative-tokens and every "
                    "--batch-size: warm-up iterations, then timed ones; median, percentiles and the speedup "
                    "over k=0 at the same batch size. Prompts: --input's (cycled), else random token ids "
                    "below 10000 as vLLM's dummy inputs (on which drafts are seldom accepted).")
    parser.add_argument("mode", choices=("latency", "throughput"),
                        help="latency: one call of batch-size prompts per iteration; throughput: --num-prompts "
                             "prompts per iteration, batch-size at a time")
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1], metavar="B")
    _add_prompt_file_flags(parser)
    parser.add_argument("--input-len", type=int, default=32, help="random prompts' length (without --input)")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=64, help="throughput mode: prompts per iteration")
    parser.add_argument("--num-iters-warmup", type=int, default=2)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--output-json", default=None, help="write the results here")
    parser.add_argument("--plot", default=None, help="save the speedup over k and batch size here (PNG, SVG, ...)")
    _add_engine_flags(parser)
    _add_speculative_flags(parser, sweep=True)
    _add_sampling_flags(parser)
    parser.set_defaults(run=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    records = read_prompts([], args.input, chat=args.chat) if args.input else None
    ks, batches = sorted(set(args.num_speculative_tokens)), sorted(set(args.batch_size))
    if min(ks) < 0 or min(batches) < 1 or args.num_iters < 1:
        raise ValueError("--num-speculative-tokens must be >= 0 (0: plain), --batch-size and --num-iters >= 1")
    if args.plot and 0 not in ks:
        raise ValueError("--plot shows the speedup over plain decoding: include 0 in --num-speculative-tokens")
    runs = len(ks) * len(batches) * (args.num_iters_warmup + args.num_iters)
    results = []
    with tqdm(total=runs, desc=f"bench {args.mode}", file=sys.stderr) as bar:
        for k in ks:
            spec = speculative_config(args, num_speculative_tokens=k) if k else None
            for batch in batches:
                results.append(bench_cell(args, records, spec, k, batch, bar.update))
    _add_speedups(results)
    summary = {"mode": args.mode, "model": args.model, "input": args.input, "input_len": args.input_len,
               "output_len": args.output_len, "results": results}
    print_table(results)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(summary, indent=2) + "\n")
    if args.plot:
        from specjax import plots

        plots.speedup(results, title=f"specjax bench {args.mode}: speedup over plain decoding", path=args.plot)
    return 0


def bench_cell(args: argparse.Namespace, records: list[dict] | None, spec: dict | None, k: int, batch: int,
               tick: Callable[[], Any]) -> dict:
    """Warm-up then timed iterations of one (k, batch size) setting on a fresh LLM."""
    import numpy as np

    args = argparse.Namespace(**{**vars(args), "max_num_seqs": batch})
    llm = load_llm(args, spec)
    params = sampling_params(llm, args, max_tokens=args.output_len, ignore_eos=True)
    count = batch if args.mode == "latency" else args.num_prompts
    if records is None:
        ids = np.random.default_rng(args.seed).integers(0, min(10000, len(llm.get_tokenizer())),
                                                        (count, args.input_len))
        prompts = [{"prompt_token_ids": row.tolist()} for row in ids]
    else:
        prompts = [records[i % len(records)] for i in range(count)]
    seconds, tokens = [], 0
    for iteration in range(args.num_iters_warmup + args.num_iters):
        start = time.perf_counter()
        outputs = generate_records(llm, prompts, params, use_tqdm=False)
        if iteration >= args.num_iters_warmup:
            seconds.append(time.perf_counter() - start)
            tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        tick()
    return {"k": k, "batch_size": batch, "speculative_config": spec, "latencies": seconds,
            "median_latency": statistics.median(seconds),
            "percentiles": {str(p): float(np.percentile(seconds, p)) for p in PERCENTILES},
            "output_tokens": tokens, "tokens_per_second": tokens / statistics.median(seconds),
            "requests_per_second": count / statistics.median(seconds),
            "mean_acceptance_length": mean_acceptance_length(llm)}


def _add_speedups(results: list[dict]) -> None:
    """speedup = the k=0 median latency / this one, at the same batch size (None without a k=0 run)."""
    plain = {r["batch_size"]: r["median_latency"] for r in results if r["k"] == 0}
    for r in results:
        base = plain.get(r["batch_size"])
        r["speedup"] = base / r["median_latency"] if base else None


def print_table(results: list[dict]) -> None:
    print(f"{'k':>3s} {'batch':>5s} {'median s':>9s} {'p90 s':>8s} {'tokens/s':>9s} {'speedup':>8s} "
          f"{'acceptance length':>18s}")
    for r in results:
        speedup = "" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        length = "" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.2f}"
        print(f"{r['k']:3d} {r['batch_size']:5d} {r['median_latency']:9.3f} {r['percentiles']['90']:8.3f} "
              f"{r['tokens_per_second']:9.1f} {speedup:>8s} {length:>18s}")


# --------------------------------------------------------------------------------------------
# convert, train: the existing command lines
# --------------------------------------------------------------------------------------------

def _convert(argv: list[str]) -> int:
    from checkpoints_conv.cli import main as convert_main

    return convert_main(argv)


def _train(argv: list[str]) -> int:
    from specjax.training.__main__ import main as train_main

    return train_main(argv)


DELEGATED: dict[str, Callable[[list[str]], int]] = {"convert": _convert, "train": _train}
