"""Tokenizer backends built from checkpoint files: a Hugging Face directory's metadata, or the
byte-level BPE vocabulary of a GGUF file rebuilt from its ``tokenizer.ggml.*`` metadata.

The GGUF rebuild follows ``transformers``' GGUF conversion (vocabulary, merges, control tokens as
special tokens, user-defined tokens as added tokens, pre-tokenizer chosen by
``tokenizer.ggml.pre``). One deliberate difference: for ``pre = "smollm"`` ``transformers``
falls back to the plain GPT-2 split, while llama.cpp and SmolLM2's own ``tokenizer.json`` split
every digit off first; we follow the latter, which the model was trained with. The two differ
only where whitespace directly precedes a digit (``"x  1"``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import gguf
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

__all__ = ["GGUF_PRE_TOKENIZERS", "SPECIAL_NAMES", "TokenizerError", "add_named_specials", "gguf_backend",
           "hf_chat_template", "id_list", "read_json", "token_text"]

SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
_GGUF_SPECIAL_IDS = ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")  # same order
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4  # llama.cpp token types

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
GGUF_PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
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


def add_named_specials(backend: BackendTokenizer, special: Mapping[str, str | None]) -> None:
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


def read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:
        raise TokenizerError(f"{path} is not valid JSON ({err}).") from None


def token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or a serialized AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def hf_chat_template(path: Path, config: Mapping[str, Any]) -> str | None:
    """``chat_template.jinja`` if present, else the config's template (the ``default`` one of a list)."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        return named.get("default")
    return template


def gguf_backend(source: str | Path | gguf.GGUFReader
                 ) -> tuple[BackendTokenizer, dict[str, str | None], dict[str, Any]]:
    """The byte-level BPE backend a GGUF file's metadata describes (``Tokenizer.from_gguf``).

    Args:
      source: the GGUF path, or an open ``gguf.GGUFReader``.

    Returns:
      ``(backend, special_tokens, extra)``: the backend with its added tokens, pre-tokenizer and
      BOS/EOS post-processor; ``bos_token``/``eos_token``/``unk_token``/``pad_token`` → text;
      and ``{"chat_template", "eot", "extra_stop_ids"}`` for the ``Tokenizer``.

    Raises:
      TokenizerError: no tokenizer, a model other than byte-level BPE, an unknown pre-tokenizer.
    """
    meta = _GGUFMeta(source if isinstance(source, gguf.GGUFReader) else gguf.GGUFReader(source))
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise TokenizerError(
            f"GGUF tokenizer model {kind!r} is not supported; only byte-level BPE ('gpt2') is."
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in GGUF_PRE_TOKENIZERS:
        raise TokenizerError(
            f"GGUF pre-tokenizer {pre!r} is not supported; expected one of {sorted(GGUF_PRE_TOKENIZERS)}."
        )
    tokens = meta.require("tokenizer.ggml.tokens")
    backend = _byte_level_bpe(tokens, meta.require("tokenizer.ggml.merges"))
    backend.pre_tokenizer = GGUF_PRE_TOKENIZERS[pre]()
    _add_gguf_added_tokens(backend, tokens, meta.get("tokenizer.ggml.token_type", ()))
    special = {
        name: tokens[i] if (i := meta.get(f"tokenizer.ggml.{key}")) is not None else None
        for name, key in zip(SPECIAL_NAMES, _GGUF_SPECIAL_IDS)
    }
    add_named_specials(backend, special)
    _set_bos_eos_processor(
        backend, special,
        bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    )
    eom = meta.get("tokenizer.ggml.eom_token_id")
    return backend, special, {"chat_template": meta.get("tokenizer.chat_template"),
                              "eot": meta.get("tokenizer.ggml.eot_token_id"),
                              "extra_stop_ids": [] if eom is None else [eom]}
