"""Incremental detokenization: ids arriving a few at a time become text, whole characters only."""

from __future__ import annotations

import numbers
from collections.abc import Iterable

from treespark_jax.models.tokenizer import Tokenizer

__all__ = ["StreamDecoder"]


class StreamDecoder:
    """Incremental detokenizer: feed ids as they are generated, get back only finished text.

    Text is emitted once it no longer ends in an incomplete UTF-8 sequence (shown by the
    decoder as U+FFFD), and each piece is decoded together with the few ids before it so that
    decoders whose output depends on context stay consistent. The pieces joined, plus
    :meth:`flush`, equal ``tokenizer.decode(all_ids)`` for ids that form valid UTF-8.

    Example::

        stream = StreamDecoder(tokenizer)
        for ids in generated_chunks:
            print(stream.push(ids), end="")
        print(stream.flush())
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        """Args:
          tokenizer: the tokenizer whose ids will be pushed.
          skip_special_tokens: drop special tokens (e.g. ``<|im_end|>``) from the text.
        """
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window decoded with each new piece
        self._read = 0  # ids before this index have been emitted

    def push(self, ids: int | Iterable[int]) -> str:
        """Adds ``ids`` (one id or several) and returns the text they complete, possibly ``""``."""
        self._ids.extend([int(ids)] if isinstance(ids, numbers.Integral) else (int(i) for i in ids))
        done = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix, len(self._ids))
        if len(text) <= len(done) or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(done):]

    def flush(self) -> str:
        """Returns whatever text is still pending (incomplete bytes become U+FFFD) and resets."""
        done = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix, len(self._ids))
        self._ids, self._prefix, self._read = [], 0, 0
        return text[len(done):]

    def _decode(self, start: int, stop: int) -> str:
        return self._tokenizer.decode(self._ids[start:stop], skip_special_tokens=self._skip)
