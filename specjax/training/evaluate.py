"""Acceptance length of a saved head, measured with the real engine (LLM + the one while_loop), greedy."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from specjax.llm import LLM
from specjax.sampling_params import SamplingParams


def acceptance(target: str, head_dir: str | Path, prompt_ids: Sequence[list[int]], *, k: int = 3,
               max_new_tokens: int = 256, max_model_len: int = 1024, max_num_seqs: int = 16,
               method: str = "eagle3", use_tqdm: bool = True) -> dict:
    """vLLM's definitions over all prompts: acceptance length = 1 + accepted / drafts, acceptance rate =
    accepted / draft tokens, per-position rate = accepted at position i / drafts."""
    llm = LLM(target, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
              speculative_config={"method": method, "model": str(head_dir), "num_speculative_tokens": k})
    llm.generate([{"prompt_token_ids": p} for p in prompt_ids], SamplingParams(temperature=0.0,
                                                                                max_tokens=max_new_tokens),
                 use_tqdm=use_tqdm)
    metrics = {m.name.removeprefix("vllm:spec_decode_"): m for m in llm.get_metrics()}
    drafts = metrics["num_drafts"].value
    accepted = metrics["num_accepted_tokens"].value
    per_pos = metrics["num_accepted_tokens_per_pos"].values
    return {"acceptance_length": 1 + accepted / max(drafts, 1),
            "acceptance_rate": accepted / max(metrics["num_draft_tokens"].value, 1),
            "per_position": [a / max(drafts, 1) for a in per_pos], "num_drafts": drafts, "k": k,
            "num_prompts": len(prompt_ids)}
