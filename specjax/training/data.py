"""Training prompts for a draft head (questions, a held-out split, chat formatting) and its draft vocabulary."""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Sequence

import numpy as np


def load_questions(path: str | Path) -> list[str]:
    """The `question` field of each JSON line (GSM8K layout); a line with `prompt` is used as is."""
    questions = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            text = record.get("question", record.get("prompt"))
            if not isinstance(text, str):
                raise ValueError(f"{path}:{number} has neither a 'question' nor a 'prompt' string")
            questions.append(text)
    return questions


def split_heldout(questions: Sequence[str], num_heldout: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """(train, held-out): a seeded shuffle, the first num_heldout held out, so evaluation never sees
    questions the head was trained on."""
    if not 0 <= num_heldout < len(questions):
        raise ValueError(f"num_heldout={num_heldout} must be in [0, {len(questions)}) (the number of prompts)")
    order = list(range(len(questions)))
    random.Random(seed).shuffle(order)
    held = [questions[i] for i in order[:num_heldout]]
    train = [questions[i] for i in order[num_heldout:]]
    return train, held


def chat_prompt_ids(tokenizer: Any, questions: Sequence[str]) -> list[list[int]]:
    """Each question as a one-turn chat with the generation prompt, tokenized (no extra special tokens)."""
    prompts = []
    for q in questions:
        text = tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def draft_vocabulary(response_tokens: np.ndarray, all_tokens: np.ndarray, vocab_size: int,
                     draft_vocab_size: int) -> np.ndarray:
    """The draft vocabulary: the draft_vocab_size target ids most frequent in the responses (ties broken by
    frequency in all tokens, then by id), sorted. EAGLE-3 builds its d2t map the same way, from frequencies."""
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} must be in [1, vocab_size={vocab_size}]")
    response = np.bincount(response_tokens, minlength=vocab_size)
    overall = np.bincount(all_tokens, minlength=vocab_size)
    # lexsort: the last key is the primary one.
    order = np.lexsort((np.arange(vocab_size), -overall, -response))
    return np.sort(order[:draft_vocab_size]).astype(np.int32)
