"""Tokenizer, chat template and stop tokens, from a Hugging Face directory or GGUF metadata.

:class:`Tokenizer` wraps a ``tokenizers.Tokenizer`` (the Rust library; no ``transformers`` at
run time) and adds what generation needs: the chat template rendered the way ``transformers``
renders it (``models/chat_template.py``), BOS/EOS/EOT ids, and ``stop_ids``, the
end-of-sequence set merged from every place a checkpoint may declare one. GGUF files carry no
``tokenizer.json``; ``models/tokenizer_files.py`` rebuilds their byte-level BPE tokenizer.
``models/stream_decode.py`` turns ids arriving a few at a time into text.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import gguf
import jinja2
from tokenizers import Tokenizer as BackendTokenizer

from treespark_jax.models.chat_template import render_chat
from treespark_jax.models.tokenizer_files import (SPECIAL_NAMES, TokenizerError, add_named_specials, gguf_backend,
                                                  hf_chat_template, id_list, read_json, token_text)

__all__ = ["Tokenizer", "TokenizerError"]

_PROBE = "TREESPARK-END-OF-TURN-PROBE"


class Tokenizer:
    """Text ↔ token ids, chat template and stop tokens of one checkpoint.

    Build it with :meth:`from_hf_dir` or :meth:`from_gguf`.

    Attributes:
      backend: the wrapped ``tokenizers.Tokenizer``.
      chat_template: Jinja source of the chat template, or None.
      special_tokens: ``bos_token``/``eos_token``/``unk_token``/``pad_token`` → token text, for
        the names the checkpoint sets (the template sees them as variables).
      bos: id of the BOS token, or None.
      eos: id of the EOS token, or None.
      eot: id of the end-of-turn token (GGUF ``eot_token_id``, else the token the chat template
        writes after a message, e.g. ``<|im_end|>``), or None.
      stop_ids: every id that ends generation: ``eos``, ``eot``, GGUF ``eom_token_id``, the
        ``eos_token_id`` of ``config.json`` and ``generation_config.json`` (int or list), and the
        chat template's end-of-turn token when it is a special token of the vocabulary.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        special_tokens: Mapping[str, str | None],
        chat_template: str | None = None,
        eot: int | None = None,
        extra_stop_ids: Iterable[int] = (),
    ):
        """Wraps ``backend``; prefer :meth:`from_hf_dir` and :meth:`from_gguf`.

        Args:
          backend: a ready ``tokenizers.Tokenizer`` (its post-processor decides what
            ``encode(add_special_tokens=True)`` adds).
          special_tokens: ``bos_token``/``eos_token``/``unk_token``/``pad_token`` → token text.
          chat_template: Jinja source, or None.
          eot: explicit end-of-turn id (GGUF ``eot_token_id``), or None to take the template's.
          extra_stop_ids: more end-of-sequence ids from configuration files.

        Raises:
          TokenizerError: a special token or stop id is not in the vocabulary.
        """
        self.backend = backend
        self.chat_template = chat_template
        self.special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
        self.bos = self._special_id("bos_token")
        self.eos = self._special_id("eos_token")
        turn_end = self._template_turn_end()
        self.eot = eot if eot is not None else turn_end
        candidates = {self.eos, self.eot, turn_end, *extra_stop_ids} - {None}
        for i in candidates:
            if not 0 <= i < self.vocab_size:
                raise TokenizerError(f"stop token id {i} is outside the vocabulary of {self.vocab_size} ids.")
        self.stop_ids: frozenset[int] = frozenset(candidates)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Loads ``tokenizer.json`` plus the metadata around it from a Hugging Face directory.

        Reads ``tokenizer_config.json`` (special tokens, ``chat_template``),
        ``chat_template.jinja`` (preferred over the config's template when present), and
        ``eos_token_id`` from ``config.json`` and ``generation_config.json``. Whether BOS/EOS are
        added is decided by ``tokenizer.json``'s post-processor alone; like ``transformers`` 5,
        the config's ``add_bos_token``/``add_eos_token`` are ignored when ``tokenizer.json``
        exists.

        Args:
          path: the model directory.

        Raises:
          TokenizerError: ``tokenizer.json`` is missing or a special token is not in it.
        """
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise TokenizerError(f"directory {str(path)!r} has no tokenizer.json.")
        backend = BackendTokenizer.from_file(str(path / "tokenizer.json"))
        config = read_json(path / "tokenizer_config.json")
        special = {name: token_text(config.get(name)) for name in SPECIAL_NAMES}
        add_named_specials(backend, special)
        extra = [
            *id_list(read_json(path / "config.json").get("eos_token_id")),
            *id_list(read_json(path / "generation_config.json").get("eos_token_id")),
        ]
        return cls(backend, special_tokens=special, chat_template=hf_chat_template(path, config),
                   extra_stop_ids=extra)

    @classmethod
    def from_gguf(cls, source: str | Path | gguf.GGUFReader) -> Tokenizer:
        """Builds the byte-level BPE tokenizer described by a GGUF file's metadata.

        Mirrors ``transformers``' GGUF conversion: vocabulary from ``tokenizer.ggml.tokens``
        (tokens outside the byte alphabet re-spelled byte by byte), merges from
        ``tokenizer.ggml.merges``, CONTROL tokens added as special tokens and USER_DEFINED ones
        as plain added tokens (``tokenizer.ggml.token_type``), the split regex chosen by
        ``tokenizer.ggml.pre``, BOS/EOS added per ``tokenizer.ggml.add_bos_token`` /
        ``add_eos_token``, the template from ``tokenizer.chat_template``.

        Args:
          source: the GGUF path, or an open ``gguf.GGUFReader`` (opening one parses all the
            metadata, which takes seconds for a 150k vocabulary, so a loader may share it).

        Raises:
          TokenizerError: the file has no tokenizer, a tokenizer model other than byte-level BPE
            (``gpt2``), or a pre-tokenizer type this library does not know.
        """
        backend, special, extra = gguf_backend(source)
        return cls(backend, special_tokens=special, **extra)

    # ------------------------------------------------------------------ properties

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows (model vocabulary plus added tokens)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def add_bos(self) -> bool:
        """True when ``encode(text)`` (with special tokens) starts with the BOS token."""
        return self.bos is not None and self.backend.encode("", add_special_tokens=True).ids[:1] == [self.bos]

    # ------------------------------------------------------------------ text ↔ ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenizes ``text``; special tokens written in it (``<|im_start|>``) stay whole.

        Args:
          text: the text.
          add_special_tokens: add BOS/EOS as the checkpoint asks (see :attr:`add_bos`); pass
            False for text rendered by the chat template, which writes its own.

        Returns:
          ``[T]`` token ids.
        """
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Turns ids back into text (bytes that do not form UTF-8 become U+FFFD).

        Args:
          ids: ``[T]`` token ids (ints or a 1-D integer array).
          skip_special_tokens: drop special tokens such as ``<|im_end|>`` from the text.
        """
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """Returns the id of the token spelled ``token`` in the vocabulary, or None."""
        return self.backend.token_to_id(token)

    # ------------------------------------------------------------------ chat

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Renders a conversation with the checkpoint's chat template, as ``transformers`` does.

        The template runs in Jinja's immutable sandbox with ``trim_blocks`` and
        ``lstrip_blocks``, the ``loopcontrols`` extension, and the helpers ``transformers``
        provides (``raise_exception``, ``strftime_now``, a non-escaping ``tojson``); the special
        token texts (``bos_token``, ``eos_token``…) are template variables.

        Args:
          messages: ``[{"role": ..., "content": ...}, ...]``; keys whose value is None are dropped.
          add_generation_prompt: end with the header of an assistant turn.
          **kwargs: more template variables (e.g. ``tools``), overriding the special tokens.

        Returns:
          The rendered text; encode it with ``add_special_tokens=False``.

        Raises:
          TokenizerError: the checkpoint has no chat template, or the template rejected the
            conversation (its own message is included).
        """
        if not self.chat_template:
            raise TokenizerError("this checkpoint has no chat template; pass raw text instead of messages.")
        try:
            return render_chat(self.chat_template, messages, add_generation_prompt, {**self.special_tokens, **kwargs})
        except (jinja2.TemplateError, TypeError) as err:
            raise TokenizerError(f"the chat template rejected the conversation: {err}") from None

    # ------------------------------------------------------------------ helpers

    def _special_id(self, name: str) -> int | None:
        text = self.special_tokens.get(name)
        if text is None:
            return None
        token_id = self.backend.token_to_id(text)
        if token_id is None:
            raise TokenizerError(f"{name} {text!r} is not in the vocabulary.")
        return token_id

    def _template_turn_end(self) -> int | None:
        """The special token the chat template writes right after a message's content, if any."""
        if not self.chat_template:
            return None
        chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
        try:
            text = render_chat(self.chat_template, chat, False, self.special_tokens)
        except Exception:  # noqa: BLE001 - a template is arbitrary code; one that cannot render
            return None  # the probe simply contributes no stop token
        if _PROBE not in text:
            return None
        after = text.partition(_PROBE)[2].lstrip()
        specials = [t.content for t in self.backend.get_added_tokens_decoder().values() if t.special]
        matches = [t for t in specials if after.startswith(t)]
        return self.backend.token_to_id(max(matches, key=len)) if matches else None
