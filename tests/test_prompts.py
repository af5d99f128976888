"""Prompt sets: parsing, the fixed train/eval split, JSONL files, chat ids, self-generated turns."""

from __future__ import annotations

import dataclasses
import gzip
import json
from types import SimpleNamespace

import jax.numpy as jnp
import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from treespark_jax import assets
from treespark_jax.models.tokenizer import Tokenizer
from treespark_jax.prompts import sets as prompt_sets
from treespark_jax.prompts.chat import messages, prompt_ids, user_turn_prefix
from treespark_jax.prompts.load import DEFAULT_EVAL_SIZE, load_prompts, split_eval_ids
from treespark_jax.prompts.self_generated import self_generated_prompts
from treespark_jax.prompts.sets import PROMPT_SETS, WRAPPERS, PromptRecord

# Evaluation ids of the default split (seed 0, 32 per set). The split must never move: a change
# here means drafters trained before it may have seen today's evaluation prompts.
GOLDEN_EVAL = {
    "humaneval": [0, 4, 6, 7, 21, 31, 33, 44, 56, 59, 60, 67, 69, 73, 74, 75, 95, 98, 107, 108, 109,
                  110, 112, 116, 121, 123, 129, 133, 143, 144, 145, 163],
    "gsm8k": [16, 41, 82, 83, 90, 132, 181, 237, 271, 334, 419, 442, 518, 546, 553, 594, 691, 731,
              738, 770, 823, 875, 890, 923, 952, 1033, 1070, 1102, 1114, 1145, 1303, 1306],
    "mtbench": [81, 82, 84, 88, 89, 91, 93, 95, 97, 99, 101, 104, 105, 107, 108, 115, 120, 121, 124,
                125, 126, 127, 128, 132, 136, 143, 145, 146, 152, 155, 157, 158],
}
ALL_IDS = {
    "humaneval": [f"HumanEval/{i}" for i in range(164)],
    "gsm8k": [f"gsm8k/{i}" for i in range(1319)],
    "mtbench": [f"mtbench/{i}" for i in range(81, 161)],
}


def golden_ids(name: str) -> set[str]:
    prefix = ALL_IDS[name][0].rpartition("/")[0]
    return {f"{prefix}/{i}" for i in GOLDEN_EVAL[name]}


# ---------------------------------------------------------------------- fake pinned files


def write_fake_sets(tmp_path, n: int = 40) -> dict[str, object]:
    """Small files in each set's real format, ``n`` records each."""
    humaneval = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(humaneval, "wt", encoding="utf-8") as f:
        for i in range(n):
            f.write(json.dumps({"task_id": f"HumanEval/{i}", "entry_point": f"f{i}",
                                "prompt": f"def f{i}(x):\n    \"\"\"Return x + {i}.\"\"\"\n",
                                "canonical_solution": "", "test": ""}) + "\n")
    gsm8k = tmp_path / "gsm8k-test.jsonl"
    gsm8k.write_text("".join(
        json.dumps({"question": f"Tom has {i} apples. How many? ", "answer": f"He has {i}.\n#### {i}"}) + "\n"
        for i in range(n)) + "\n")
    mtbench = tmp_path / "question.jsonl"
    mtbench.write_text("".join(
        json.dumps({"question_id": 81 + i, "category": "writing", "turns": [f"Write poem {i}.", "Shorter."],
                    **({"reference": ["r1", "r2"]} if i == 0 else {})}) + "\n"
        for i in range(n)))
    return {"humaneval": humaneval, "gsm8k": gsm8k, "mtbench": mtbench}


@pytest.fixture
def fake_sets(tmp_path, monkeypatch):
    """Points every set at a 40-record fake file; fails if anything tries a real download."""
    files = write_fake_sets(tmp_path)
    for name in files:
        monkeypatch.setitem(PROMPT_SETS, name, dataclasses.replace(PROMPT_SETS[name], count=40))
    monkeypatch.setattr(assets, "fetch", lambda asset, **_: files[asset.name])
    return files


def test_parsers_apply_the_documented_formats(fake_sets):
    he = load_prompts("humaneval", "all")
    assert [r.id for r in he[:2]] == ["HumanEval/0", "HumanEval/1"] and he[0].set == "humaneval"
    code = 'def f3(x):\n    """Return x + 3."""\n'
    assert he[3].turns == (WRAPPERS["humaneval"].format(code=code.rstrip()),)
    assert he[3].turns[0].startswith("Complete this Python function.") and code.rstrip() in he[3].turns[0]
    assert he[3].meta == {"raw": code, "entry_point": "f3"}

    gsm = load_prompts("gsm8k", "all")
    assert gsm[5].id == "gsm8k/5" and gsm[5].meta == {"raw": "Tom has 5 apples. How many?", "answer": "5"}
    assert gsm[5].turns[0] == WRAPPERS["gsm8k"].format(question="Tom has 5 apples. How many?")
    assert "step by step" in gsm[5].turns[0]

    mt = load_prompts("mtbench", "all")
    assert mt[0].id == "mtbench/81" and mt[0].turns == ("Write poem 0.", "Shorter.")
    assert mt[0].meta == {"raw": "Write poem 0.", "category": "writing", "reference": ("r1", "r2")}
    assert "reference" not in mt[1].meta


def test_split_is_disjoint_complete_and_stable(fake_sets):
    for name in fake_sets:
        train, held, every = (load_prompts(name, s) for s in ("train", "eval", "all"))
        assert len(held) == DEFAULT_EVAL_SIZE and len(train) == 40 - DEFAULT_EVAL_SIZE
        assert not {r.id for r in train} & {r.id for r in held}
        assert {r.id for r in train} | {r.id for r in held} == {r.id for r in every}
        assert held == load_prompts(name, "eval")  # same call, same prompts
        assert [r.id for r in held] == [r.id for r in every if r.id in {h.id for h in held}]  # file order
        other = load_prompts(name, "eval", seed=1)
        assert {r.id for r in other} != {r.id for r in held}


def test_split_golden_ids_and_nesting():
    for name, ids in ALL_IDS.items():
        assert split_eval_ids(name, ids) == golden_ids(name)
        small = split_eval_ids(name, ids, eval_size=8)
        assert small < golden_ids(name) < split_eval_ids(name, ids, eval_size=48)
        # The rank hashes ids, not positions: reordering the file changes nothing.
        assert split_eval_ids(name, ids[::-1]) == golden_ids(name)
    assert split_eval_ids("mtbench", ALL_IDS["mtbench"], eval_size=0) == frozenset()
    assert split_eval_ids("mtbench", ALL_IDS["mtbench"], eval_size=80) == set(ALL_IDS["mtbench"])


def test_split_bad_arguments(fake_sets):
    with pytest.raises(ValueError, match=r"eval_size=41 is outside \[0, 40\]"):
        load_prompts("gsm8k", "train", eval_size=41)
    with pytest.raises(ValueError, match=r"eval_size=-1 is outside"):
        load_prompts("gsm8k", "eval", eval_size=-1)
    with pytest.raises(ValueError, match="split seed -2 must be a non-negative integer"):
        load_prompts("gsm8k", "eval", seed=-2)
    with pytest.raises(ValueError, match="split=None is not one of train, eval, all"):
        load_prompts("gsm8k")
    with pytest.raises(ValueError, match="split='test' is not one of"):
        load_prompts("mtbench", "test")
    with pytest.raises(ValueError, match="duplicate record ids"):
        split_eval_ids("x", ["a", "a"], eval_size=1)


def test_unknown_set_names_the_sets():
    with pytest.raises(ValueError, match=r"unknown prompt set 'alpaca'; choose one of humaneval, gsm8k, "
                                         r"mtbench, or pass the path of a JSONL file"):
        load_prompts("alpaca", "train")
    with pytest.raises(ValueError, match=r"prompt file '/no/such.jsonl' does not exist; pass an existing JSONL file"):
        load_prompts("/no/such.jsonl")


def test_a_directory_given_as_the_prompt_file_is_named_as_one(tmp_path):
    with pytest.raises(ValueError, match=r"prompt file '.*' is a directory; pass an existing JSONL file"):
        load_prompts(str(tmp_path) + "/")


def test_pinned_count_mismatch_is_an_error(fake_sets, monkeypatch):
    monkeypatch.setitem(PROMPT_SETS, "gsm8k", dataclasses.replace(PROMPT_SETS["gsm8k"], count=1319))
    with pytest.raises(ValueError, match="has 40 records, but 1319 were pinned"):
        load_prompts("gsm8k", "train")


def test_malformed_set_file(tmp_path, monkeypatch):
    bad = tmp_path / "gsm8k-test.jsonl"
    monkeypatch.setattr(assets, "fetch", lambda asset, **_: bad)
    bad.write_text('{"question": "ok"}\n{"answer": "no question"}\n')
    with pytest.raises(ValueError, match="line 2 of .* lacks a non-empty str field 'question'"):
        load_prompts("gsm8k", "all")
    bad.write_text('{"question": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match="line 2 of .* is not valid JSON"):
        load_prompts("gsm8k", "all")
    bad.write_text('[1, 2]\n')
    with pytest.raises(ValueError, match="line 1 of .* is not a JSON object"):
        load_prompts("gsm8k", "all")


# ---------------------------------------------------------------------- JSONL files


def test_jsonl_file_prompts(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "Hello there"}\n\n{"prompt": "Tell me a joke.", "id": "joke"}\n')
    records = load_prompts(path)
    assert records == [PromptRecord("mine", "mine/0", ("Hello there",)),
                       PromptRecord("mine", "joke", ("Tell me a joke.",))]
    assert load_prompts(str(path), "all") == records


@pytest.mark.parametrize("text, match", [
    ('{"prompt": "a"}\n{"text": "b"}\n', 'line 2 of .* has no non-empty string field "prompt"'),
    ('{"prompt": "   "}\n', 'line 1 of .* has no non-empty string field "prompt"'),
    ('{"prompt": 3}\n', 'line 1 of .* has no non-empty string field "prompt"'),
    ('{"prompt": "a"}\n{"prompt": "b"\n', "line 2 of .* is not valid JSON"),
    ('{"prompt": "a", "id": 1}\n{"prompt": "b", "id": 1}\n', "line 2 of .* repeats the id '1'"),
    ("\n\n", "holds no prompts"),
])
def test_jsonl_file_errors(tmp_path, text, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_prompts(path)


def test_jsonl_file_refuses_a_split(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "Hello"}\n')
    with pytest.raises(ValueError, match="split='train' does not apply to the JSONL file .* used whole"):
        load_prompts(path, "train")


def test_record_needs_a_turn():
    with pytest.raises(ValueError, match="needs at least one non-empty user turn"):
        PromptRecord("x", "x/0", ())
    with pytest.raises(ValueError, match="needs at least one non-empty user turn"):
        PromptRecord("x", "x/0", ("ok", " "))


# ---------------------------------------------------------------------- chat template

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>"]
CHATML = (  # SmolLM2's shape: a default system message when the conversation has none.
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def backend() -> BackendTokenizer:
    """A ~300-token byte-level BPE with the ChatML and Llama 3 special tokens."""
    tok = BackendTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["Write a poem about the sea.", "How many apples does Tom have?"] * 20, trainer)
    return tok


def make_tokenizer(backend, template: str | None = CHATML) -> Tokenizer:
    return Tokenizer(backend, special_tokens={"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"},
                     chat_template=template)


def test_messages_and_prompt_ids_feed_the_models_own_answers(backend):
    tok = make_tokenizer(backend)
    record = PromptRecord("mtbench", "mtbench/81", ("Write a poem.", "Make it shorter."))
    assert messages(record) == [{"role": "user", "content": "Write a poem."}]
    assert messages(record, ["A poem."]) == [
        {"role": "user", "content": "Write a poem."}, {"role": "assistant", "content": "A poem."},
        {"role": "user", "content": "Make it shorter."}]
    second = tok.decode(prompt_ids(tok, record, ["A poem."]))
    assert second == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                      "Write a poem.<|im_end|>\n<|im_start|>assistant\nA poem.<|im_end|>\n"
                      "<|im_start|>user\nMake it shorter.<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(prompt_ids(tok, record)) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "Write a poem.<|im_end|>\n<|im_start|>assistant\n")
    assert prompt_ids(tok, record, chat=False) == tok.encode("Write a poem.")
    with pytest.raises(ValueError, match="has 2 turn\\(s\\), so at most 1 previous answer\\(s\\) can be given, not 2"):
        prompt_ids(tok, record, ["a", "b"])
    with pytest.raises(ValueError, match="chat=False"):
        prompt_ids(tok, record, ["a"], chat=False)


def test_user_turn_prefix_is_found_from_the_template(backend):
    chatml = make_tokenizer(backend, CHATML)
    assert user_turn_prefix(chatml) == "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    assert user_turn_prefix(chatml, system="Be brief.") == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
    llama3 = make_tokenizer(backend, LLAMA3)
    assert user_turn_prefix(llama3) == "<|endoftext|><|start_header_id|>user<|end_header_id|>\n\n"
    with pytest.raises(ValueError, match="does not write the user's text verbatim once"):
        user_turn_prefix(make_tokenizer(backend, "{{ messages[0]['content'] | lower }}"))
    with pytest.raises(ValueError, match="writes nothing before the user's text"):
        user_turn_prefix(make_tokenizer(backend, "{{ messages[0]['content'] }}"))
    with pytest.raises(ValueError, match="has no chat template"):
        user_turn_prefix(make_tokenizer(backend, None))


@pytest.fixture(scope="module")
def tiny_lm(backend):
    """A random tiny Llama whose vocabulary is the BPE's, behind a ChatML template."""
    from tiny import tiny_decoder

    from treespark_jax.decode.engine import Engine

    tok = make_tokenizer(backend)
    model = tiny_decoder("llama", seed=3, dtype=jnp.float32, vocab_size=tok.vocab_size)
    return SimpleNamespace(tokenizer=tok, model=model, engine=Engine(model, tok.stop_ids))


def test_self_generated_prompts_are_seeded_distinct_and_clean(tiny_lm):
    kw = dict(max_new_tokens=12, batch_size=4)
    first = self_generated_prompts(tiny_lm, 6, seed=7, **kw)
    assert first == self_generated_prompts(tiny_lm, 6, seed=7, **kw)
    assert len(first) == 6 and len({r.turns for r in first}) == 6
    for r in first:
        assert r.set == "self" and r.id.startswith("self/7/") and r.turns[0] == r.turns[0].strip() != ""
        assert "<|im_" not in r.turns[0] and r.meta["raw"] == r.turns[0]
    # A smaller n gives a prefix of a larger one; another seed gives other prompts.
    assert self_generated_prompts(tiny_lm, 3, seed=7, **kw) == first[:3]
    assert {r.turns for r in self_generated_prompts(tiny_lm, 6, seed=8, **kw)} != {r.turns for r in first}
    # A target without an engine (e.g. ``Target``) gets one built from its model.
    bare = SimpleNamespace(tokenizer=tiny_lm.tokenizer, model=tiny_lm.model)
    assert self_generated_prompts(bare, 3, seed=7, **kw) == first[:3]


def test_a_user_prefix_starts_every_turn_and_the_target_continues_it(tiny_lm):
    kw = dict(max_new_tokens=12, batch_size=4, seed=7)
    prefix = "Complete this Python function.\n\ndef"
    plain = self_generated_prompts(tiny_lm, 4, **kw)
    steered = self_generated_prompts(tiny_lm, 4, user_prefix=prefix, **kw)
    assert len(steered) == 4 and all(r.turns[0].startswith(prefix) for r in steered)
    assert all(len(r.turns[0]) > len(prefix) for r in steered)  # an empty sample is dropped, not kept as the prefix
    # The prefix is part of what the target conditions on: the samples differ from the unsteered ones.
    assert [r.turns[0][len(prefix):].strip() for r in steered] != [r.turns[0] for r in plain]


def test_starts_vary_the_steer_by_row_and_a_progress_file_keeps_them(tiny_lm, tmp_path, unchecked):
    kw = dict(max_new_tokens=12, batch_size=4, seed=7, user_prefix="Q: ")
    out = self_generated_prompts(tiny_lm, 8, starts=["Tom has", "A bakery", "Ann"], **kw)
    assert len(out) == 8
    for r in out:  # row i (its id's last part) begins with the prefix and start i mod 3
        row = int(r.id.rsplit("/", 1)[1])
        assert r.turns[0].startswith("Q: " + ("Tom has", "A bakery", "Ann")[row % 3])
        assert len(r.turns[0]) > len("Q: " + ("Tom has", "A bakery", "Ann")[row % 3])
    # One empty start is no start; the start is what the target conditions on.
    assert self_generated_prompts(tiny_lm, 4, starts=[""], **kw) == self_generated_prompts(tiny_lm, 4, **kw)
    ann = self_generated_prompts(tiny_lm, 4, starts=["Ann"], **kw)
    plain = self_generated_prompts(tiny_lm, 4, **kw)
    assert [r.turns[0][len("Q: Ann"):].strip() for r in ann] != [r.turns[0][len("Q: "):] for r in plain]
    progress = tmp_path / "p.jsonl.progress"
    assert self_generated_prompts(tiny_lm, 4, starts=["Ann"], progress=progress, **kw) == ann
    for other in (["Bob"], []):  # other starts, or none against some
        with pytest.raises(ValueError, match=r"other settings \(other starts\); repeat them"):
            self_generated_prompts(tiny_lm, 4, starts=other, progress=progress, **kw)
    for bad, match in (("Ann", "must be a sequence of strings"), (["Ann", 3], "must be a sequence of strings"),
                       (["Ann", "x<|im_end|>"], r"starts\[1\] 'x<\|im_end\|>' holds the special token")):
        with pytest.raises(ValueError, match=match):
            self_generated_prompts(tiny_lm, 4, starts=bad, **kw)


def test_the_sampling_temperature_and_top_p_reach_the_target(tiny_lm):
    kw = dict(max_new_tokens=12, batch_size=4, seed=7)
    hot = self_generated_prompts(tiny_lm, 4, **kw)
    assert hot == self_generated_prompts(tiny_lm, 4, temperature=1.0, top_p=1.0, **kw)  # the defaults
    cool = self_generated_prompts(tiny_lm, 4, temperature=0.3, **kw)
    assert len(cool) == 4 and [r.turns for r in cool] != [r.turns for r in hot]
    assert [r.turns for r in self_generated_prompts(tiny_lm, 4, top_p=0.5, **kw)] != [r.turns for r in hot]
    # Near-greedy sampling writes nearly the same turn on every row: fewer distinct ones than rows.
    assert len(self_generated_prompts(tiny_lm, 4, temperature=1e-4, max_rows=8, **kw)) < 4
    for bad, message in (({"temperature": 0.0}, "temperature=0.0 must be above 0"),
                         ({"top_p": 0.0}, "top_p")):
        with pytest.raises(ValueError, match=message):
            self_generated_prompts(tiny_lm, 4, **bad, **kw)


def test_a_turn_cut_inside_a_character_drops_its_partial_bytes(tiny_lm):
    class CutMidCharacter:  # decodes as a byte-level tokenizer does when the last token ends mid-character
        def __getattr__(self, name):
            return getattr(tiny_lm.tokenizer, name)

        def decode(self, ids):
            return tiny_lm.tokenizer.decode(ids) + "\ufffd"

    lm = SimpleNamespace(tokenizer=CutMidCharacter(), model=tiny_lm.model, engine=tiny_lm.engine)
    out = self_generated_prompts(lm, 8, seed=7, max_new_tokens=12, batch_size=4)
    assert {r.meta["finished"] for r in out} == {False, True}  # both kinds are checked
    assert all(r.turns[0].endswith("\ufffd") == r.meta["finished"] for r in out)


def test_an_interrupted_run_resumes_from_its_progress_file(tiny_lm, tmp_path):
    kw = dict(seed=7, max_new_tokens=12, batch_size=4)
    whole = self_generated_prompts(tiny_lm, 10, **kw)
    calls = []

    class Counted:  # counts the batches drawn; stop_at: the call a kill interrupts
        stop_at = 2

        def generate(self, prompts, *args):
            calls.append(len(prompts))
            if len(calls) == self.stop_at:
                raise KeyboardInterrupt
            return tiny_lm.engine.generate(prompts, *args)

    lm = SimpleNamespace(tokenizer=tiny_lm.tokenizer, model=tiny_lm.model, engine=Counted())
    progress = tmp_path / "p.jsonl.progress"
    with pytest.raises(KeyboardInterrupt):
        self_generated_prompts(lm, 10, progress=progress, target={"sha256": "a"}, **kw)
    lines = progress.read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[1])["next_row"] == 4  # the header and the first batch
    with open(progress, "a") as f:
        f.write('{"next_row": 8, "prompts": [{"id"')  # a line cut by a kill
    calls.clear()
    Counted.stop_at = 0
    resumed = self_generated_prompts(lm, 10, progress=progress, target={"sha256": "a"}, **kw)
    assert resumed == whole  # as one uninterrupted run
    rows = [json.loads(line)["next_row"] for line in progress.read_text().splitlines()[1:]]
    assert rows == list(range(4, rows[-1] + 1, 4))  # the cut line was dropped, every batch logged once
    assert len(calls) == len(rows) - 1  # the first batch was read back, not drawn again
    # The progress of a longer run serves a shorter one; a longer one draws on from it.
    assert self_generated_prompts(tiny_lm, 3, progress=progress, target={"sha256": "a"}, **kw) == whole[:3]
    assert (self_generated_prompts(tiny_lm, 14, progress=progress, target={"sha256": "a"}, **kw)
            == self_generated_prompts(tiny_lm, 14, **kw))
    before = progress.read_text()
    with pytest.raises(ValueError, match=r"written with other settings \(seed=7, batch_size=4\); repeat them"):
        self_generated_prompts(tiny_lm, 3, progress=progress, target={"sha256": "a"}, seed=8, max_new_tokens=12,
                               batch_size=2)
    with pytest.raises(ValueError, match=r"other settings \(another target\)"):
        self_generated_prompts(tiny_lm, 3, progress=progress, target={"sha256": "b"}, **kw)
    with pytest.raises(ValueError, match=r"other settings \(temperature=1.0\)"):
        self_generated_prompts(tiny_lm, 3, progress=progress, target={"sha256": "a"}, temperature=0.7, **kw)
    assert progress.read_text() == before
    foreign = tmp_path / "notes.txt"
    foreign.write_text("my notes\nmore")
    with pytest.raises(ValueError, match=r"'.*notes.txt' is not a progress file of self-generated prompts"):
        self_generated_prompts(tiny_lm, 3, progress=foreign, **kw)
    assert foreign.read_text() == "my notes\nmore"  # untouched


def test_a_progress_file_has_one_writer(tiny_lm, tmp_path):
    from treespark_jax.files import hold_file_lock, remove_locked_file

    progress = tmp_path / "p.jsonl.progress"
    release = hold_file_lock(progress, "progress file")
    with pytest.raises(ValueError, match=r"progress file '.*p.jsonl.progress' is being written by another treespark "
                                         r"process; wait for it to finish or choose another file"):
        self_generated_prompts(tiny_lm, 2, max_new_tokens=12, batch_size=4, progress=progress)
    assert not progress.exists()
    release()
    assert len(self_generated_prompts(tiny_lm, 2, max_new_tokens=12, batch_size=4, progress=progress)) == 2
    remove_locked_file(progress)
    assert list(tmp_path.iterdir()) == []


def test_self_generated_prompts_give_up_after_max_rows(tiny_lm, caplog):
    out = self_generated_prompts(tiny_lm, 50, seed=7, max_new_tokens=12, batch_size=4, max_rows=4,
                                 drop_unfinished=True)
    assert len(out) < 50 and all(r.meta["finished"] for r in out)
    assert "gave only" in caplog.text


@pytest.mark.parametrize("kwargs, match", [
    (dict(n=0), "n=0 must be an integer ≥ 1"),
    (dict(n=2, seed=-1), "seed -1 is outside 0..4294967295"),
    (dict(n=2, seed=2 ** 32), "seed 4294967296 is outside 0..4294967295"),
    (dict(n=2, max_new_tokens=0), "max_new_tokens=0 must be"),
    (dict(n=2, batch_size=0), "batch_size=0 must be"),
    (dict(n=2, max_rows=0), "max_rows=0 must be"),
    (dict(n=2, user_prefix=3), "user_prefix=3 must be a string"),
    (dict(n=2, user_prefix="Write code.<|im_end|>"), "holds the special token '<\\|im_end\\|>'"),
])
def test_self_generated_prompts_bad_arguments(tiny_lm, unchecked, kwargs, match):
    with pytest.raises(ValueError, match=match):
        self_generated_prompts(tiny_lm, **kwargs)


# ---------------------------------------------------------------------- real sets and preset


@pytest.mark.slow
def test_real_sets_counts_split_and_formats():
    """Fetches the three pinned files (45 KB–750 KB) and checks the documented split."""
    for name, count in (("humaneval", 164), ("gsm8k", 1319), ("mtbench", 80)):
        every = load_prompts(name, "all")
        train, held = load_prompts(name, "train"), load_prompts(name, "eval")
        assert len(every) == count == prompt_sets.PROMPT_SETS[name].count
        assert [r.id for r in every] == ALL_IDS[name]
        assert (len(train), len(held)) == (count - 32, 32)
        assert {r.id for r in held} == golden_ids(name)
        assert not {r.id for r in train} & {r.id for r in held}
        assert not {r.turns for r in train} & {r.turns for r in held}
        assert len({r.turns[0] for r in every}) == count  # no repeated prompt text
        assert load_prompts(name, "train") == train and load_prompts(name, "eval") == held
    assert all(len(r.turns) == 2 for r in load_prompts("mtbench", "all"))
    assert all(r.meta["answer"] for r in load_prompts("gsm8k", "all"))


@pytest.mark.slow
def test_self_generated_prompts_on_smollm2(smollm2_gguf):
    import treespark_jax as ts

    lm = ts.load("smollm2-135m")
    assert user_turn_prefix(lm.tokenizer).endswith("<|im_end|>\n<|im_start|>user\n")
    first = self_generated_prompts(lm, 4, seed=0, max_new_tokens=48, batch_size=4)
    assert first == self_generated_prompts(lm, 4, seed=0, max_new_tokens=48, batch_size=4)
    assert len(first) == 4 and all(r.turns[0].strip() for r in first)
    assert sum(r.meta["finished"] for r in first) >= 2  # the instruct target ends its turns
