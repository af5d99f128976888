"""Chat templates rendered the way ``transformers`` renders them, without ``transformers``.

The template runs in Jinja's immutable sandbox with ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension, and the helpers ``transformers`` provides (``raise_exception``,
``strftime_now``, a non-escaping ``tojson``); keys whose value is None are dropped from the
messages, as ``transformers`` does (templates test for presence, not for None).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["render_chat"]


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


def render_chat(source: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
                variables: Mapping[str, Any]) -> str:
    """Renders ``messages`` with the template ``source`` (compiled once per process).

    Args:
      source: Jinja source of the chat template.
      messages: ``[{"role": ..., "content": ...}, ...]``.
      add_generation_prompt: end with the header of an assistant turn.
      variables: more template variables (special token texts, ``tools``...).

    Raises:
      jinja2.TemplateError: the template rejected the conversation (``raise_exception``), or
        any other template error; TypeError from a template misusing a value.
    """
    chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
    return _compiled(source).render(messages=chat, add_generation_prompt=add_generation_prompt,
                                    **{"tools": None, "documents": None, **variables})
