"""Static-shape buckets: batch, prompt length, output length and cache capacity.

Shapes follow buckets, never the data, so a new prompt within a bucket reuses the compiled
program (MaxText / JetStream prefill buckets).
"""

from __future__ import annotations

MIN_PROMPT_BUCKET = 16
MIN_OUTPUT_BUCKET = 16
CAPACITY_ROUNDING = 128


def pow2_bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two ≥ ``max(n, minimum)``."""
    b = minimum
    while b < n:
        b *= 2
    return b


def prompt_bucket(longest_prompt: int) -> int:
    """Padded prompt length (tokens) for a batch whose longest prompt has ``longest_prompt`` tokens."""
    return pow2_bucket(longest_prompt, MIN_PROMPT_BUCKET)


def batch_bucket(n_rows: int, multiple: int = 1) -> int:
    """Padded batch size for ``n_rows`` prompts: a power of two, rounded up to a multiple of
    ``multiple`` (the devices on a mesh's ``data`` axis, so rows split evenly)."""
    b = pow2_bucket(n_rows, 1)
    return -(-b // multiple) * multiple


def output_bucket(max_new_tokens: int) -> int:
    """Size of the on-device output buffer (tokens) for ``max_new_tokens``."""
    return pow2_bucket(max_new_tokens, MIN_OUTPUT_BUCKET)


def cache_capacity(prompt_len: int, max_new_tokens: int, tree_rows: int = 1) -> int:
    """KV-cache slots per row: prompt + generated tokens + the scratch rows of one model call.

    Rounded up to a multiple of ``CAPACITY_ROUNDING`` so nearby requests share a program.

    Args:
      prompt_len: padded prompt length (tokens).
      max_new_tokens: padded output length (tokens).
      tree_rows: rows a decode call writes beyond the committed length (1 for AR; ``N + 1``
        for verifying a tree of budget ``N``).
    """
    need = prompt_len + max_new_tokens + tree_rows
    return -(-need // CAPACITY_ROUNDING) * CAPACITY_ROUNDING
