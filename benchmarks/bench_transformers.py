"""The peer on the same shapes as bench_engine: transformers with a Llama-3.1-8B-shaped target and a
Llama-3.2-1B-shaped draft, random bf16 weights, greedy, a prompt of 128 random tokens, 256 new tokens.
Variants: its eager `generate` (dynamic cache), `generate` with the static cache (whose forward transformers
compiles with torch.compile on CUDA), and assisted generation with the draft (batch 1 only, transformers' limit). With random
weights the draft is almost never accepted, so the assisted row is the cost of transformers' speculative
loop at acceptance length ~1, to set against bench_engine's spec suite at AL 1.5.

    PYTHONPATH=. python benchmarks/bench_transformers.py [--variants eager,static,assisted] [--batches 1,8]
        [--new-tokens 256] [--smoke]

Writes $OUT/bench_transformers.json (or benchmarks/results/).
"""
from __future__ import annotations

import argparse

import torch
import transformers

from benchmarks.common import LLAMA31_8B, LLAMA32_1B, SMOKE_DRAFT, SMOKE_TARGET, median_time, print_table, write_json
from specjax.models.llama import LlamaConfig

PROMPT_LEN = 128


def hf_config(cfg: LlamaConfig) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
        rope_scaling=cfg.rope_scaling, tie_word_embeddings=cfg.tie_word_embeddings,
        max_position_embeddings=cfg.max_position_embeddings, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def random_model(cfg: LlamaConfig, device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(hf_config(cfg), dtype=torch.bfloat16).eval()


def timed_generate(model, prompts: torch.Tensor, new_tokens: int, repeats: int, **kwargs) -> float:
    """Median seconds of one greedy generate of exactly new_tokens tokens per row, after two warm-ups."""
    def run() -> None:
        with torch.no_grad():
            out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, top_p=None, top_k=None,
                                 temperature=None, **kwargs)
        assert out.shape[1] == prompts.shape[1] + new_tokens
        if prompts.is_cuda:
            torch.cuda.synchronize()

    return median_time(run, repeats=repeats)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default="eager,static,assisted")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, a few tokens (checks the script)")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target_cfg, draft_cfg = (SMOKE_TARGET, SMOKE_DRAFT) if args.smoke else (LLAMA31_8B, LLAMA32_1B)
    new_tokens = 8 if args.smoke else args.new_tokens
    repeats = 1 if args.smoke else 3
    variants = args.variants.split(",")
    target = random_model(target_cfg, device)
    draft = random_model(draft_cfg, device) if "assisted" in variants else None
    rows = []

    def add(variant: str, batch: int, seconds: float) -> None:
        rows.append(dict(variant=variant, batch=batch, new_tokens=new_tokens, seconds=seconds,
                         tok_s=batch * new_tokens / seconds, device=device))
        print(rows[-1], flush=True)

    for batch in (int(b) for b in args.batches.split(",")):
        prompts = torch.randint(3, target_cfg.vocab_size, (batch, PROMPT_LEN), device=device)
        if "eager" in variants:
            add("eager generate", batch, timed_generate(target, prompts, new_tokens, repeats))
        if "assisted" in variants and batch == 1:
            add("assisted (1B-shaped draft)", batch,
                timed_generate(target, prompts, new_tokens, repeats, assistant_model=draft))
    if "static" in variants:
        # On CUDA, generate compiles the forward itself for a static cache (its CompileConfig, CUDA graphs
        # stepped between calls); a forward compiled by hand with mode="reduce-overhead" failed on the H200
        # ("accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run").
        target.generation_config.cache_implementation = "static"
        for batch in (int(b) for b in args.batches.split(",")):
            prompts = torch.randint(3, target_cfg.vocab_size, (batch, PROMPT_LEN), device=device)
            add("static cache (auto-compiled)", batch, timed_generate(target, prompts, new_tokens, repeats))
    print_table(rows)
    write_json("bench_transformers", rows)


if __name__ == "__main__":
    main()
