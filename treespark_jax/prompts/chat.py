"""The token ids a target reads for a prompt: its conversation through the chat template.

MT-Bench's second turn is fed after the model's own first answer, so a conversation is assembled
here, at generation time, from the record's user turns and the answers given so far.
"""

from __future__ import annotations

from collections.abc import Sequence

from treespark_jax.prompts.sets import PromptRecord

__all__ = ["messages", "prompt_ids", "user_turn_prefix"]

_SENTINEL = "TREESPARK-USER-TURN-SENTINEL"


def messages(record: PromptRecord, answers: Sequence[str] = ()) -> list[dict[str, str]]:
    """The conversation for the record's next user turn after the model's own ``answers``.

    Args:
      record: the prompt.
      answers: the model's answers to turns ``0..k-1`` (empty for the first turn).

    Returns:
      ``[{"role": "user", ...}, {"role": "assistant", ...}, ..., {"role": "user", ...}]`` ending
      with user turn ``k = len(answers)``.

    Raises:
      ValueError: ``len(answers)`` is not below the number of turns.
    """
    if len(answers) >= len(record.turns):
        raise ValueError(
            f"prompt {record.id!r} has {len(record.turns)} turn(s), so at most {len(record.turns) - 1} "
            f"previous answer(s) can be given, not {len(answers)}.")
    chat = []
    for turn, answer in zip(record.turns, answers):
        chat += [{"role": "user", "content": turn}, {"role": "assistant", "content": answer}]
    chat.append({"role": "user", "content": record.turns[len(answers)]})
    return chat


def prompt_ids(tokenizer, record: PromptRecord, answers: Sequence[str] = (), *,
               chat: bool = True) -> list[int]:
    """Token ids the target reads for the record's next user turn.

    Args:
      tokenizer: the target's :class:`~treespark_jax.models.tokenizer.Tokenizer`.
      record: the prompt.
      answers: the model's own answers to the earlier turns (MT-Bench's second turn is fed after
        the first answer); empty for the first turn.
      chat: render through the chat template ending with the assistant header (as
        ``TreeSpark.generate(chat=True)`` does); False encodes the first turn as raw text (with
        BOS if the checkpoint adds one), for raw-text oracle tests.

    Returns:
      ``[T]`` token ids.

    Raises:
      ValueError: too many answers, answers given with ``chat=False``, or a checkpoint without
        a chat template (``TokenizerError``).
    """
    if not chat:
        if answers:
            raise ValueError("raw-text prompts (chat=False) have one turn, so no answers can be given.")
        return tokenizer.encode(record.turns[0])
    text = tokenizer.apply_chat_template(messages(record, answers), add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def user_turn_prefix(tokenizer, system: str | None = None) -> str:
    """The chat-template text up to where a user's first message begins.

    Renders ``[system?, user: SENTINEL]`` without a generation prompt and cuts before the
    sentinel, so it works for any template that writes the user's text verbatim: ChatML gives
    ``"<|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\n"`` (SmolLM2 and Qwen templates
    insert their default system message themselves), Llama 3 its header tokens.

    Args:
      tokenizer: a tokenizer with a chat template.
      system: an explicit system message, or None for the template's own default (if any).

    Raises:
      ValueError: no chat template, a template that does not write the user text exactly once,
        or one that writes nothing before it.
    """
    chat = ([{"role": "system", "content": system}] if system is not None else [])
    text = tokenizer.apply_chat_template(chat + [{"role": "user", "content": _SENTINEL}],
                                         add_generation_prompt=False)
    if text.count(_SENTINEL) != 1:
        raise ValueError("the chat template does not write the user's text verbatim once, so the "
                         "start of a user turn cannot be found.")
    prefix = text.partition(_SENTINEL)[0]
    if not prefix:
        raise ValueError("the chat template writes nothing before the user's text, so there is no "
                         "user-turn header to generate from.")
    return prefix
