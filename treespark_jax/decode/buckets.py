"""Static-shape buckets: batch, prompt length, output length and cache capacity.

Shapes follow buckets, never the data, so a new prompt within a bucket reuses the compiled
program (MaxText / JetStream prefill buckets). ``RequestShape`` states the whole rule: a
session's prefill program is compiled once per distinct ``RequestShape`` and its decode loop
once per distinct ``RequestShape.loop`` (the prompt is in the KV cache by then), so requests with
equal shapes share both whatever their prompts and ``max_new_tokens``.
"""

from __future__ import annotations

import dataclasses

MIN_PROMPT_BUCKET = 16
HALF_OCTAVES_ABOVE = 128  # prompt buckets above this length step by half octaves (prompt_bucket)
MIN_OUTPUT_BUCKET = 16
CAPACITY_ROUNDING = 128


def pow2_bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two ≥ ``max(n, minimum)``."""
    b = minimum
    while b < n:
        b *= 2
    return b


def prompt_bucket(longest_prompt: int) -> int:
    """Padded prompt length (tokens) for a batch whose longest prompt has ``longest_prompt`` tokens.

    Powers of two up to ``HALF_OCTAVES_ABOVE``, then also three quarters of each power of two
    (192, 384, 768, ...): above it a prefill pads at most a third of its rows instead of half, for
    at most twice the prefill programs. A prefill costs its padded rows (64 GSM8K training prompts
    of at most 161 tokens: 12,288 rows at 192 against 16,384 at 256, for 7,103 prompt tokens).
    """
    bucket = pow2_bucket(longest_prompt, MIN_PROMPT_BUCKET)
    if bucket > HALF_OCTAVES_ABOVE and longest_prompt <= bucket * 3 // 4:
        return bucket * 3 // 4
    return bucket


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


@dataclasses.dataclass(frozen=True)
class RequestShape:
    """The static shapes of one request: what a decode program is compiled for.

    Attributes:
      batch: padded rows (``batch_bucket``).
      prompt: padded prompt length in tokens (``prompt_bucket``).
      output: output buffer in tokens (``output_bucket``).
      capacity: KV-cache slots per row (``cache_capacity``).
    """

    batch: int
    prompt: int
    output: int
    capacity: int

    @classmethod
    def of(cls, n_rows: int, longest_prompt: int, max_new_tokens: int, tree_rows: int = 1,
           data: int = 1) -> "RequestShape":
        """The shape of a request of ``n_rows`` prompts, the longest ``longest_prompt`` tokens.

        Args:
          n_rows: prompts in the request.
          longest_prompt: tokens of its longest prompt.
          max_new_tokens: its ``max_new_tokens``.
          tree_rows: rows one model call writes beyond the committed length (1 for AR, ``N + 1``
            for a maximum tree budget ``N``).
          data: devices on the mesh's ``data`` axis (the batch is a multiple of it).
        """
        prompt, output = prompt_bucket(longest_prompt), output_bucket(max_new_tokens)
        return cls(batch=batch_bucket(n_rows, data), prompt=prompt, output=output,
                   capacity=cache_capacity(prompt, output, tree_rows))

    @property
    def loop(self) -> tuple[int, int, int]:
        """``(batch, output, capacity)``: the shapes the decode loop program is compiled for."""
        return self.batch, self.output, self.capacity
