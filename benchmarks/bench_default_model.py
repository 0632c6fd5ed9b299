"""The default model (SmolLM2-135M-Instruct) end to end: specjax plain / ngram / draft_model / EAGLE-3 (the
shipped head) against transformers' generate / prompt lookup / assisted generation on the same prompts, in
the same run and dtype.

    PYTHONPATH=. python benchmarks/bench_default_model.py [--max-tokens 128] [--batches 1,8] [--dtype float32]
        [--smoke]

Writes $OUT/bench_default_model_<dtype>.json (or benchmarks/results). Greedy, so every engine must produce the
same tokens; the table says whether each specjax run matched plain decoding. `--smoke`: one prompt, a few
tokens, batch 1 (checks the script).
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
import transformers
from safetensors.numpy import load_file, save_file

from benchmarks.common import print_table, time_llm, write_json
from specjax.default_model import DEFAULT_EAGLE3_HEAD, default_model_dir

# Rewriting / continuing given text, where copying from the prompt pays (prompt lookup's best case).
PROMPTS = [
    "Rewrite the following code with the function renamed to `area`:\n```python\ndef compute(width, height):\n"
    "    result = width * height\n    print('the result is', result)\n    return result\n```\n",
    "Repeat the following paragraph word for word: The committee met on Tuesday to discuss the budget. "
    "After a long debate, the committee agreed to fund the new library and to repair the old bridge.",
    "Continue this list in the same format: Monday: gym, Tuesday: swim, Wednesday: gym, Thursday: swim,",
    "Fix the typo and return the full sentence: 'The quick brown fox jumpd over the lazy dog near the river.'",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Translate into French and then repeat the English: Good morning, how are you today?",
    "Summarize: The sun is a star at the center of the solar system. It is a nearly perfect ball of hot plasma.",
    "Write a Python function that returns the sum of a list, then write a test for it.",
]


def truncated_draft(src: Path, layers: int) -> Path:
    """The target's first `layers` layers with its embedding and head: a draft of the same tokenizer."""
    out = Path(tempfile.mkdtemp(prefix="draft_"))
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, out / f.name)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config))
    tensors = load_file(src / "model.safetensors")
    save_file({n: t for n, t in tensors.items()
               if not n.startswith("model.layers.") or int(n.split(".")[2]) < layers}, out / "model.safetensors")
    return out


def chat_ids(tokenizer, prompt: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def time_transformers(model, prompts_ids, max_tokens, **kwargs):
    tokens, start = [], time.perf_counter()
    for ids in prompts_ids:  # batch 1: prompt lookup and assisted generation only support batch 1
        with torch.no_grad():
            out = model.generate(torch.tensor([ids], device=model.device), max_new_tokens=max_tokens, do_sample=False, top_p=None,
                                 top_k=None, temperature=None, pad_token_id=2, **kwargs)
        tokens.append(out[0, len(ids):].tolist())
    return tokens, time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--smoke", action="store_true", help="1 prompt, 8 tokens, batch 1: checks the script")
    args = parser.parse_args(argv)
    prompts = PROMPTS[:1] if args.smoke else PROMPTS
    if args.smoke:
        args.max_tokens, args.batches = 8, "1"
    torch_dtype = getattr(torch, args.dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model_dir = default_model_dir()
    draft_dir = truncated_draft(model_dir, 6)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    prompts_ids = [chat_ids(tokenizer, p) for p in prompts]
    rows = []
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).to(device).eval()
    hf_draft = transformers.AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch_dtype).to(device).eval()
    time_transformers(hf, prompts_ids[:1], 8)  # warm-up
    ref, hf_plain = time_transformers(hf, prompts_ids, args.max_tokens)
    n_ref = sum(map(len, ref))
    for name, kwargs in [("transformers generate", {}),
                         ("transformers prompt lookup (10)", {"prompt_lookup_num_tokens": 10}),
                         ("transformers assisted (6-layer draft)", {"assistant_model": hf_draft})]:
        tokens, seconds = (ref, hf_plain) if not kwargs else time_transformers(hf, prompts_ids, args.max_tokens,
                                                                                **kwargs)
        rows.append(dict(engine=name, batch=1, tok_s=sum(map(len, tokens)) / seconds,
                         speedup_vs_own_plain=hf_plain / seconds, acceptance_length=None,
                         same_as_plain=tokens == ref))
    for batch in (int(b) for b in args.batches.split(",")):
        plain = time_llm(model_dir, None, prompts_ids, batch, args.max_tokens, args.dtype)
        for name, spec in [("specjax plain", None),
                           ("specjax ngram k=4", {"method": "ngram", "num_speculative_tokens": 4,
                                                  "prompt_lookup_max": 4, "prompt_lookup_min": 2}),
                           ("specjax draft_model k=3 (6-layer draft)", {"model": str(draft_dir),
                                                                        "num_speculative_tokens": 3}),
                           ("specjax eagle3 k=3 (shipped head)", {"model": DEFAULT_EAGLE3_HEAD,
                                                                  "num_speculative_tokens": 3})]:
            result = plain if spec is None else time_llm(model_dir, spec, prompts_ids, batch, args.max_tokens,
                                                         args.dtype)
            rows.append(dict(engine=name, batch=batch, tok_s=sum(map(len, result["tokens"])) / result["seconds"],
                             speedup_vs_own_plain=plain["seconds"] / result["seconds"],
                             acceptance_length=result["acceptance_length"],
                             same_as_plain=result["tokens"] == plain["tokens"]))
    rows.append(dict(engine="(specjax plain == transformers greedy)", batch=1, tok_s=None,
                     speedup_vs_own_plain=None, acceptance_length=None,
                     same_as_plain=plain["tokens"] == ref if n_ref else None))
    print_table(rows)
    write_json(f"bench_default_model_{args.dtype}", rows)


if __name__ == "__main__":
    main()
