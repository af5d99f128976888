"""How many self-generated prompts share a run of words with a prompt set's held-out (eval) questions.

The target writes the self-generated prompts (``treespark self-prompts``), and it may have seen the
sets' questions in pretraining: a turn started from the first words of a training question
(``--starts``) could come out as an evaluation question nearly word for word, and training on the
target's answer to it would leak the eval split into the drafter. This counts the prompts of a JSONL
file that share ``n`` consecutive words (lower-cased, punctuation dropped) with any eval prompt of
the set, the n-gram test of language-model decontamination (GPT-3 used 13 words; the default 8 is
stricter for GSM8K's short questions), and prints them with the question they share it with.

Usage:
  python experiments/eval_overlap.py PROMPTS.jsonl SET [--n 8] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from treespark_jax.prompts.load import load_prompts
from treespark_jax.prompts.sets import PromptRecord


def words(text: str) -> list[str]:
    """Lower-cased word and number tokens of ``text``."""
    return re.findall(r"[a-z0-9]+", text.lower())


def ngrams(text: str, n: int) -> list[tuple[str, ...]]:
    """Every run of ``n`` consecutive ``words`` of ``text``, in order."""
    w = words(text)
    return [tuple(w[i:i + n]) for i in range(len(w) - n + 1)]


def overlaps(own: list[PromptRecord], held: list[PromptRecord], n: int) -> list[dict]:
    """The prompts of ``own`` that share ``n`` consecutive words with a prompt of ``held``, in ``own``'s order:
    for each, its id, its first shared run of words and the id of a held prompt that has it. A held prompt
    is read without its set's wrapper (``meta["raw"]``, as ``prompts.sets`` stores it), which every prompt
    of the set holds."""
    index = {g: r.id for r in held for text in r.turns for g in ngrams(r.meta.get("raw", text), n)}
    hits = []
    for r in own:
        shared = next((g for g in ngrams(r.turns[0], n) if g in index), None)
        if shared:
            hits.append({"id": r.id, "eval_id": index[shared], "words": " ".join(shared), "prompt": r.turns[0]})
    return hits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompts", help="a JSONL prompt file (treespark self-prompts --json-out)")
    parser.add_argument("set", help="the prompt set whose eval split is checked (gsm8k, humaneval, mtbench)")
    parser.add_argument("--n", type=int, default=8, help="words in a shared run")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    own, held = load_prompts(Path(args.prompts)), load_prompts(args.set, "eval")
    hits = overlaps(own, held, args.n)
    print(f"{len(hits)} of {len(own)} prompts of {args.prompts} share {args.n} consecutive words with one of "
          f"the {len(held)} {args.set} eval prompts")
    for h in hits:
        print(f"  {h['id']} ~ {h['eval_id']}: \"{h['words']}\"")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"n": args.n, "prompts": len(own), "eval": len(held),
                                                   "hits": hits}, indent=1) + "\n")


if __name__ == "__main__":
    main()
