"""Tokenizer, chat template and stop tokens, from a Hugging Face directory or GGUF metadata.

:class:`Tokenizer` wraps a ``tokenizers.Tokenizer`` (the Rust library; no ``transformers`` at
run time) and adds what generation needs: the chat template rendered the way ``transformers``
renders it, BOS/EOS/EOT ids, and ``stop_ids``, the end-of-sequence set merged from every place a
checkpoint may declare one.

GGUF files carry no ``tokenizer.json``; :meth:`Tokenizer.from_gguf` rebuilds a byte-level BPE
tokenizer from ``tokenizer.ggml.*`` metadata the way ``transformers``' GGUF conversion does
(vocabulary, merges, control tokens as special tokens, user-defined tokens as added tokens,
pre-tokenizer chosen by ``tokenizer.ggml.pre``). One deliberate difference: for ``pre = "smollm"``
``transformers`` falls back to the plain GPT-2 split, while llama.cpp and SmolLM2's own
``tokenizer.json`` split every digit off first; we follow the latter, which the model was trained
with. The two differ only where whitespace directly precedes a digit (``"x  1"``).

:class:`StreamDecoder` turns ids arriving a few at a time into text, emitting only complete
UTF-8 characters.
"""

from __future__ import annotations

import functools
import json
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import gguf
import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
_GGUF_SPECIAL_IDS = ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")  # same order
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4  # llama.cpp token types
_PROBE = "TREESPARK-END-OF-TURN-PROBE"

# Split regexes of the pre-tokenizers, as transformers' GGUF conversion and llama.cpp define them.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class TokenizerError(ValueError):
    """A tokenizer cannot be built from the given files, or a chat cannot be rendered."""


def _gpt2_split() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2_split() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), _gpt2_split()]
    )


def _regex_split(pattern: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    def build() -> pre_tokenizers.PreTokenizer:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])

    return build


# ``tokenizer.ggml.pre`` → pre-tokenizer. Covers the Llama (SmolLM2, Llama 3) and Qwen2/Qwen3
# families; an unknown value is an error rather than a silently different tokenization.
_GGUF_PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "default": _gpt2_split,
    "gpt2": _gpt2_split,
    "smollm": _digits_then_gpt2_split,
    "llama3": _regex_split(_LLAMA3_SPLIT),
    "llama-v3": _regex_split(_LLAMA3_SPLIT),
    "llama-bpe": _regex_split(_LLAMA3_SPLIT),
    "qwen2": _regex_split(_QWEN2_SPLIT),
    "deepseek-r1-qwen": _regex_split(_QWEN2_SPLIT),
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


_BYTE_ALPHABET = _bytes_to_unicode()


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
        config = _read_json(path / "tokenizer_config.json")
        special = {name: _token_text(config.get(name)) for name in _SPECIAL_NAMES}
        _add_named_specials(backend, special)
        extra = [
            *_id_list(_read_json(path / "config.json").get("eos_token_id")),
            *_id_list(_read_json(path / "generation_config.json").get("eos_token_id")),
        ]
        return cls(backend, special_tokens=special, chat_template=_hf_chat_template(path, config),
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
        meta = _GGUFMeta(source if isinstance(source, gguf.GGUFReader) else gguf.GGUFReader(source))
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise TokenizerError(
                f"GGUF tokenizer model {kind!r} is not supported; only byte-level BPE ('gpt2') is."
            )
        pre = meta.get("tokenizer.ggml.pre", "default")
        if pre not in _GGUF_PRE_TOKENIZERS:
            raise TokenizerError(
                f"GGUF pre-tokenizer {pre!r} is not supported; expected one of {sorted(_GGUF_PRE_TOKENIZERS)}."
            )
        tokens = meta.require("tokenizer.ggml.tokens")
        backend = _byte_level_bpe(tokens, meta.require("tokenizer.ggml.merges"))
        backend.pre_tokenizer = _GGUF_PRE_TOKENIZERS[pre]()
        _add_gguf_added_tokens(backend, tokens, meta.get("tokenizer.ggml.token_type", ()))
        special = {
            name: tokens[i] if (i := meta.get(f"tokenizer.ggml.{key}")) is not None else None
            for name, key in zip(_SPECIAL_NAMES, _GGUF_SPECIAL_IDS)
        }
        _add_named_specials(backend, special)
        _set_bos_eos_processor(
            backend, special,
            bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        )
        eom = meta.get("tokenizer.ggml.eom_token_id")
        return cls(backend, special_tokens=special, chat_template=meta.get("tokenizer.chat_template"),
                   eot=meta.get("tokenizer.ggml.eot_token_id"), extra_stop_ids=[] if eom is None else [eom])

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
            return _render_chat(self.chat_template, messages, add_generation_prompt, {**self.special_tokens, **kwargs})
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
            text = _render_chat(self.chat_template, chat, False, self.special_tokens)
        except Exception:  # noqa: BLE001 - a template is arbitrary code; one that cannot render
            return None  # the probe simply contributes no stop token
        if _PROBE not in text:
            return None
        after = text.partition(_PROBE)[2].lstrip()
        specials = [t.content for t in self.backend.get_added_tokens_decoder().values() if t.special]
        matches = [t for t in specials if after.startswith(t)]
        return self.backend.token_to_id(max(matches, key=len)) if matches else None


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


# ---------------------------------------------------------------------- chat rendering


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compiled(source: str) -> jinja2.Template:
    """Compiles ``source`` once per process in the sandbox ``transformers`` uses."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _render_chat(source: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
                 variables: Mapping[str, Any]) -> str:
    # transformers drops None-valued keys: templates test for presence, not for None.
    chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
    return _compiled(source).render(messages=chat, add_generation_prompt=add_generation_prompt,
                                    **{"tools": None, "documents": None, **variables})


# ---------------------------------------------------------------------- building backends


class _GGUFMeta:
    """Typed access to a GGUF reader's metadata fields."""

    def __init__(self, reader: gguf.GGUFReader):
        self._reader = reader

    def get(self, key: str, default: Any = None) -> Any:
        field = self._reader.get_field(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        field = self._reader.get_field(key)
        if field is None:
            raise TokenizerError(f"GGUF file has no {key} metadata, so it carries no BPE tokenizer.")
        return field.contents()


def _byte_level_bpe(tokens: Sequence[str], merges: Sequence[str]) -> BackendTokenizer:
    """A byte-level BPE backend over the GGUF vocabulary (ids = positions in ``tokens``)."""
    alphabet = set(_BYTE_ALPHABET.values())
    vocab = {
        tok if set(tok) <= alphabet else "".join(_BYTE_ALPHABET[b] for b in tok.encode("utf-8")): i
        for i, tok in enumerate(tokens)
    }
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    backend.decoder = decoders.ByteLevel()
    return backend


def _add_gguf_added_tokens(backend: BackendTokenizer, tokens: Sequence[str], types: Sequence[int]) -> None:
    """CONTROL tokens become special added tokens, USER_DEFINED ones plain added tokens.

    A CONTROL token spelled outside the byte alphabet is a llama.cpp mislabel and is skipped, as
    transformers does (adding it would grow the vocabulary past the model's).
    """
    alphabet = set(_BYTE_ALPHABET.values())
    control = [t for t, k in zip(tokens, types) if k == _GGUF_CONTROL and set(t) <= alphabet]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    vocab = backend.get_vocab(with_added_tokens=True)
    user = [t for t, k in zip(tokens, types) if k == _GGUF_USER_DEFINED and t in vocab]
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])


def _add_named_specials(backend: BackendTokenizer, special: Mapping[str, str | None]) -> None:
    """Makes BOS/EOS/UNK/PAD special added tokens when they are not added tokens yet."""
    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    missing = [t for t in dict.fromkeys(special.values()) if t is not None and t not in added]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in missing])


def _set_bos_eos_processor(backend: BackendTokenizer, special: Mapping[str, str | None],
                           add_bos: bool, add_eos: bool) -> None:
    """Installs the post-processor that adds BOS/EOS (as transformers' ``update_post_processor``)."""
    bos, eos = special.get("bos_token"), special.get("eos_token")
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    used = [t for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(t, backend.token_to_id(t)) for t in used]
    )


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:
        raise TokenizerError(f"{path} is not valid JSON ({err}).") from None


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or a serialized AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def _hf_chat_template(path: Path, config: Mapping[str, Any]) -> str | None:
    """``chat_template.jinja`` if present, else the config's template (the ``default`` one of a list)."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        return named.get("default")
    return template
