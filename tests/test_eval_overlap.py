"""experiments/eval_overlap.py: the n-gram check of self-generated prompts against a set's eval questions."""

from __future__ import annotations

from scripts import load_script

from treespark_jax.prompts.sets import WRAPPERS, PromptRecord


def _gsm8k(i: int, question: str) -> PromptRecord:  # as prompts.sets.parse_gsm8k stores a question
    return PromptRecord("gsm8k", f"gsm8k/{i}", (WRAPPERS["gsm8k"].format(question=question),), {"raw": question})


def test_a_prompt_sharing_a_run_of_words_with_an_eval_question_is_found():
    overlaps = load_script("experiments/eval_overlap.py").overlaps
    held = [_gsm8k(3, "Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning."),
            _gsm8k(7, "A robe takes 2 bolts of blue fiber and half that much white fiber.")]
    own = [PromptRecord("self", "self/0/0", (WRAPPERS["gsm8k"].format(question="Tom has 3 apples."),), {}),
           PromptRecord("self", "self/0/1", (WRAPPERS["gsm8k"].format(
               question="JANET'S ducks lay 16 eggs per day; she sells the rest."),), {}),
           PromptRecord("self", "self/0/2", ("A robe takes 2 bolts of red fiber and half that much white fiber.",), {})]
    hits = overlaps(own, held, 6)
    # case and punctuation do not matter; the wrapper every GSM8K prompt holds is not a match
    assert [(h["id"], h["eval_id"]) for h in hits] == [("self/0/1", "gsm8k/3"), ("self/0/2", "gsm8k/7")]
    assert hits[0]["words"] == "janet s ducks lay 16 eggs"
    assert [h["id"] for h in overlaps(own, held, 8)] == ["self/0/1"]  # "red" breaks the robe's 8-word runs
    assert overlaps(own, held, 13) == []
