"""The static shapes of a wave: bucketed sizes (few shapes, so few compilations) and the buffer length of the
KV caches and token buffer."""
from __future__ import annotations

# Prompts are padded to at least this many tokens (a power of two), so short prompts share one shape.
MIN_PROMPT_BUCKET = 16


def bucket(n: int, minimum: int = 1) -> int:
    """Next power of two >= max(n, minimum)."""
    return max(minimum, 1 << max(0, (n - 1).bit_length()))


def buffer_len(prompt_width: int, longest_prompt: int, max_new_tokens: int, k: int, max_model_len: int) -> int:
    """Slots of a wave's KV caches and token buffer: the padded prompts (`prompt_width` columns, which the
    prefill writes whole), the longest row's committed tokens (bucketed, at most max_model_len), and the k
    draft slots a verify pass writes beyond a row's last committed token."""
    committed = min(bucket(longest_prompt + max_new_tokens), max_model_len)
    return max(prompt_width, committed) + k + 1
