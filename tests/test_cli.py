"""The command line end to end on the default preset: output, JSON and one-sentence errors."""

import json
import os
import time
from pathlib import Path

import pytest

import treespark_jax
from treespark_jax.cli import main

from tiny import write_tiny_hf_target

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def preset(smollm2_gguf):
    return "smollm2-135m"  # fetched and verified by the fixture


def test_generate_json_has_ids_text_and_stats(preset, capsys):
    assert main(["generate", "--preset", preset, "--prompt", "The capital of France is",
                 "--max-new-tokens", "8", "--json", "--method", "ar"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 8 and out["prompt_ids"] and out["text"] and out["method"] == "ar"
    assert out["stats"]["target_forwards"] == 8 and out["stats"]["tokens_per_s"] > 0
    # One token comes from the prefill alone: no decode step to time, and no rate or speedup made up.
    assert main(["generate", "--preset", preset, "--prompt", "The capital of France is", "--max-new-tokens", "1",
                 "--json", "--compare-ar"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 1 and out["stats"]["tokens_per_s"] is None and out["ar"]["speedup"] is None
    assert out["method"] != "ar" and out["stats"]["rounds"] == 0 and out["stats"]["tau"] is None  # no round: no τ
    assert main(["generate", "--preset", preset, "--prompt", "The capital of France is", "--max-new-tokens", "1",
                 "--method", "ar"]) == 0
    assert "[ar] 1 token, no decode step, τ 1.00, 1 target forward, " in capsys.readouterr().err


def test_default_method_uses_the_shipped_drafter_and_compares_with_ar(preset, capsys):
    """What `make demo` runs: the default method (treespark with the shipped drafter) against AR."""
    from treespark_jax.drafters import default_method, shipped_drafter

    assert shipped_drafter(preset, "treespark") is not None and default_method(preset) == "treespark"
    assert main(["generate", "--preset", preset, "--chat", "--prompt", "What is 12 times 7? Think step by step.",
                 "--max-new-tokens", "32", "--compare-ar", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["method"] == "treespark" and out["ar"]["identical"] is True
    assert out["token_ids"] == out["ar"]["token_ids"]
    # It drafted (draft skipping, on by default, may pause where drafting did not pay), and every
    # target call after prefill was a drafted round or a skipped one.
    stats = out["stats"]
    assert sum(stats["rung_rounds"]) > 0 and stats["rounds"] == sum(stats["rung_rounds"])  # batch 1
    assert stats["target_forwards"] - 1 == stats["rounds"] + stats["skipped_steps"]
    assert out["ar"]["speedup"] > 0 and out["ar"]["stats"]["tau"] == 1.0
    # Both timed decodes come after an untimed warm-up of each, which compiled every program.
    assert out["stats"]["compiles"] == 0 and out["ar"]["stats"]["compiles"] == 0
    # The same request as text (its programs are compiled already): the summary lines on stderr.
    assert main(["generate", "--preset", preset, "--chat", "--prompt", "What is 12 times 7? Think step by step.",
                 "--max-new-tokens", "32", "--compare-ar"]) == 0
    err = capsys.readouterr().err
    assert "speedup of treespark over AR" in err and "greedy output identical to AR: yes" in err
    assert err.count("no program compiled (all were warm)") == 2 and "0 programs" not in err


def test_prompt_lookup_method_matches_greedy_ar(preset, capsys):
    args = ["generate", "--preset", preset, "--prompt", "1, 2, 3, 4, 5, 6, 7, 8,", "--max-new-tokens", "24", "--json"]
    assert main(args) == 0
    ar = json.loads(capsys.readouterr().out)
    assert main(args + ["--method", "prompt_lookup", "--budget", "6"]) == 0
    pl = json.loads(capsys.readouterr().out)
    assert pl["token_ids"] == ar["token_ids"] and pl["stats"]["tau"] > 1.5


def test_drafter_method_with_a_saved_drafter_matches_greedy_ar(tmp_path, capsys):
    """A drafter checkpoint bound to its target, passed with --drafter, through --method treespark
    (on a tiny target: the path's plumbing is under test; the preset runs the shipped drafters)."""
    from flax import nnx

    from treespark_jax.drafter.checkpoint import TargetBinding, save_drafter
    from treespark_jax.drafter.model import BlockDrafter
    from treespark_jax.methods import drafter_config
    from treespark_jax.models.load import load_target

    target_dir = write_tiny_hf_target(tmp_path / "hf", layers=8, d=48, mlp=80, head_dim=16, max_positions=512)
    target = load_target(str(target_dir))
    drafter = BlockDrafter(drafter_config("treespark", target.cfg), target.cfg, rngs=nnx.Rngs(0))
    path = save_drafter(tmp_path / "drafter", drafter, TargetBinding.of(target), training={"loss": "none"})
    args = ["generate", "--target", str(target_dir), "--prompt", "def add(a, b):", "--max-new-tokens", "12", "--json"]
    assert main(args + ["--method", "ar"]) == 0
    ar = json.loads(capsys.readouterr().out)
    assert main(args + ["--method", "treespark", "--drafter", str(path), "--budget", "8", "--no-skip-drafting"]) == 0
    tree = json.loads(capsys.readouterr().out)
    assert tree["token_ids"] == ar["token_ids"]
    assert tree["stats"]["rounds"] == tree["stats"]["target_forwards"] - 1 > 0  # every round drafted
    # A drafter trained for a target of another width is refused in one sentence naming the difference.
    wide = load_target(str(write_tiny_hf_target(tmp_path / "wide", layers=8, d=64, mlp=80, head_dim=16,
                                                max_positions=512)))
    other = save_drafter(tmp_path / "other", BlockDrafter(drafter_config("treespark", wide.cfg), wide.cfg,
                                                          rngs=nnx.Rngs(0)), TargetBinding.of(wide),
                         training={"loss": "none"})
    assert main(args + ["--method", "treespark", "--drafter", str(other)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("treespark generate: error: ") and "d_model" in err and "\n" not in err


def test_drafting_flags_reach_the_round_and_keep_greedy_output(tmp_path, capsys):
    """On a tiny target (the flags' plumbing, not the preset's weights, is under test): the
    builder override, draft skipping by default, --no-skip-drafting and --no-cost-aware-stop."""
    target = write_tiny_hf_target(tmp_path / "hf", layers=8, d=48, mlp=80, head_dim=16, max_positions=512)
    args = ["generate", "--target", str(target), "--prompt", "def add(a, b):", "--max-new-tokens", "12", "--json"]
    assert main(args + ["--method", "ar"]) == 0
    ar = json.loads(capsys.readouterr().out)
    assert main(args + ["--method", "ddtree", "--drafter", "random", "--builder", "chain"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == ar["token_ids"]
    # A random drafter never pays on the shipped CPU costs: by default rounds skip it, the output stays AR's.
    assert main(args + ["--method", "treespark", "--drafter", "random"]) == 0
    skipping = json.loads(capsys.readouterr().out)
    assert skipping["token_ids"] == ar["token_ids"] and skipping["stats"]["skipped_rounds"] > 0
    assert main(args + ["--method", "treespark", "--drafter", "random", "--no-skip-drafting"]) == 0
    drafting = json.loads(capsys.readouterr().out)
    assert drafting["token_ids"] == ar["token_ids"] and drafting["stats"]["skipped_rounds"] == 0
    assert len(drafting["stats"]["rung_rounds"]) > 1  # the cost-aware stop's ladder
    flags = ["--no-skip-drafting", "--no-cost-aware-stop"]
    assert main(args + ["--method", "treespark", "--drafter", "random", *flags]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert whole["token_ids"] == ar["token_ids"] and len(whole["stats"]["rung_rounds"]) == 1


@pytest.mark.parametrize("flags, message", [
    (["--prompt", ""], "the prompt is empty"),
    (["--prompt", " ", "--chat"], "the prompt is empty"),
    (["--prompt", "hi", "--seed", "-1"], "seed -1 is outside 0..4294967295"),
    (["--prompt", "hi " * 9000], "more than the model's context of 8192 tokens"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens 0 must be at least 1"),
    (["--prompt", "hi", "--temperature", "-1"], "--temperature -1.0 is negative"),
    (["--prompt", "hi", "--top-p", "1.5"], "--top-p 1.5 is outside (0, 1]"),
    (["--prompt", "hi", "--top-p", "0.5"], "--top-p 0.5 has no effect at --temperature 0 (greedy decoding); drop it"),
    (["--prompt", "hi", "--budget", "0", "--method", "prompt_lookup"], "--budget 0 must be a whole number of drafted nodes between 1 and 1024"),
    (["--prompt", "hi", "--budget", "100000"], "--budget 100000 must be a whole number of drafted nodes between 1 and 1024"),
    (["--prompt", "hi", "--method", "dflash", "--drafter", "/no/such/drafter"], "/no/such/drafter"),
    (["--prompt", "hi", "--method", "ar", "--drafter", "random"], "method 'ar' uses no block drafter"),
])
def test_bad_input_is_one_sentence_and_exit_2(preset, capsys, flags, message):
    assert main(["generate", "--preset", preset] + flags) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("treespark generate: error: ") and message in err and "\n" not in err


def test_a_corrupt_drafter_is_refused_in_one_line_and_the_process_exits_cleanly(preset, tmp_path):
    """Flipped bytes in a shipped drafter's largest parameter file: named by its checksum before
    Orbax reads it, so no TensorStore callbacks fail at exit."""
    import shutil
    import subprocess
    import sys

    from test_drafter_checkpoint import _flip_bytes

    from treespark_jax.drafters import shipped_drafter

    bad = tmp_path / "treespark"
    shutil.copytree(shipped_drafter(preset, "treespark"), bad)
    _flip_bytes(bad)
    proc = subprocess.run([sys.executable, "-m", "treespark_jax.cli", "generate", "--preset", preset, "--prompt", "Hi",
                           "--max-new-tokens", "2", "--drafter", str(bad)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"treespark generate: error: drafter checkpoint {bad} is corrupt: params/{_largest(bad)} does not match the "
        "sha256 recorded in drafter.json (copy or train it again)."], proc.stderr


def _largest(path) -> str:
    params = path / "params"
    return max((f for f in params.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size).relative_to(params).as_posix()


def test_unknown_preset_and_models_list(capsys):
    assert main(["generate", "--preset", "no-such-model", "--prompt", "hi"]) == 2
    assert "unknown preset 'no-such-model'" in capsys.readouterr().err
    assert main(["generate", "--preset", "no-such-model", "--prompt", "hi", "--temperature", "-1"]) == 2
    assert "temperature -1.0 is negative" in capsys.readouterr().err  # checked before any loading
    assert main(["models", "list"]) == 0
    assert "smollm2-135m" in capsys.readouterr().out
    assert main(["models", "fetch", "no-such-model"]) == 2  # named by the subcommand that refused it
    assert capsys.readouterr().err.startswith("treespark models fetch: error: unknown preset 'no-such-model'")


def test_a_refused_file_system_call_is_one_line_and_exit_1(capsys, monkeypatch):
    from treespark_jax.cli import models

    def refuse(args):
        raise PermissionError(13, "Permission denied", "/root/x.json")

    monkeypatch.setattr(models, "run", refuse)
    assert main(["models", "list"]) == 1
    assert capsys.readouterr().err == "treespark models list: error: cannot access /root/x.json: Permission denied.\n"


def test_api_refuses_prompts_that_are_not_text_or_are_blank_chat_turns(preset, unchecked):
    from treespark_jax.api import load

    lm = load(preset)
    for prompt, chat, message in ((None, False, "a prompt must be text \\(str\\), not NoneType"),
                                  (["a", 3], False, "not int"), ("  ", True, "the prompt is empty")):
        with pytest.raises(ValueError, match=message):
            lm.generate(prompt, chat=chat, max_new_tokens=1)
    with pytest.raises(ValueError, match="not list"):
        next(lm.stream(["a", "b"], max_new_tokens=1))


def test_self_prompts_writes_a_prompt_file_that_rollout_reads(preset, capsys, tmp_path):
    from treespark_jax.prompts.load import load_prompts

    out = tmp_path / "self.jsonl"
    args = ["self-prompts", "--preset", preset, "--limit", "3", "--max-new-tokens", "24", "--batch-size", "4"]
    assert main(args + ["--json-out", str(out)]) == 0
    assert "prompts  3 of 3" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == ["self.jsonl"]  # its progress file and lock are gone
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [set(x) for x in lines] == [{"id", "prompt", "seed", "finished"}] * 3
    records = load_prompts(out)
    assert [r.id for r in records] == [x["id"] for x in lines] and all(r.id.startswith("self/0/") for r in records)
    assert len({r.turns[0] for r in records}) == 3 and all(r.turns[0].strip() for r in records)
    again = tmp_path / "again.jsonl"
    assert main(args + ["--json-out", str(again)]) == 0 and again.read_text() == out.read_text()  # seeded
    starts = tmp_path / "starts.txt"
    starts.write_text("Tom has\nA bakery\n")
    started = tmp_path / "started.jsonl"
    assert main(args + ["--user-prefix", "Q: ", "--starts", str(starts), "--json-out", str(started)]) == 0
    assert [r.turns[0][:9] for r in load_prompts(started)] == ["Q: Tom ha", "Q: A bake", "Q: Tom ha"]
    before = out.read_text()
    assert main(args + ["--json-out", str(out)]) == 2  # never overwritten
    assert "already exists" in capsys.readouterr().err and out.read_text() == before
    none = tmp_path / "none.jsonl"  # 2-token turns that must end at end-of-turn: none is usable
    flags = ["--max-new-tokens", "2", "--batch-size", "4", "--drop-unfinished", "--json-out", str(none)]
    assert main(args[:-4] + flags) == 2
    assert "no usable user turn" in capsys.readouterr().err and not none.exists()
    assert not list(tmp_path.glob("*none*"))  # nor its progress
    special = ["--user-prefix", "Write code.<|im_end|>", "--json-out", str(none)]
    assert main(args + special) == 2  # refused by its flag's name, nothing written
    err = capsys.readouterr().err.strip()
    assert "--user-prefix 'Write code.<|im_end|>' holds the special token" in err and "\n" not in err
    starts.write_text("Tom has\nAnn<|im_end|>\n")
    assert main(args + ["--starts", str(starts), "--json-out", str(none)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"line 2 of --starts {starts} 'Ann<|im_end|>' holds the special token" in err and "\n" not in err
    assert not none.exists() and not list(tmp_path.glob(".*partial"))


@pytest.mark.parametrize("flags, message", [
    (["--limit", "0"], "--limit 0 must be at least 1"),
    (["--limit", "2", "--seed", "-1"], "--seed -1 is outside 0..4294967295"),
    (["--limit", "2", "--seed", str(2 ** 32)], f"--seed {2 ** 32} is outside 0..4294967295"),
    (["--limit", "2", "--batch-size", "0"], "--batch-size 0 must be at least 1"),
    (["--limit", "2", "--temperature", "0"], "--temperature 0.0 must be above 0"),
    (["--limit", "2", "--top-p", "1.5"], "--top-p 1.5"),
    (["--limit", "2", "--starts", "{tmp}/none.txt"], "none.txt cannot be read as UTF-8 text (FileNotFoundError)"),
    (["--limit", "2", "--starts", "{tmp}/empty.txt"], "empty.txt has no lines; give one start per line"),
    (["--limit", "2", "--starts", "{tmp}/blank.txt"], "line 2 of --starts {tmp}/blank.txt is blank"),
    (["--limit", "2", "--starts", "{tmp}/bytes.txt"], "bytes.txt cannot be read as UTF-8 text (UnicodeDecodeError)"),
])
def test_self_prompts_bad_input_is_one_sentence_and_exit_2(capsys, tmp_path, flags, message):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("Tom has\n \nAnn\n")
    (tmp_path / "bytes.txt").write_bytes(b"Tom \xff\n")
    flags, message = [f.format(tmp=tmp_path) for f in flags], message.format(tmp=tmp_path)
    out = tmp_path / "p.jsonl"
    assert main(["self-prompts", "--preset", "no-such-model", *flags, "--json-out", str(out)]) == 2  # before any load
    err = capsys.readouterr().err.strip()
    assert err.startswith("treespark self-prompts: error: ") and message in err and "\n" not in err and not out.exists()


def test_flags_share_one_vocabulary_across_commands(capsys):
    """--temperature, --batch-size, --limit, --mesh where a model runs, --out a directory and
    --json-out a file, --loss with choices; the old spellings are gone."""
    from treespark_jax.cli import _parser

    commands = _parser()._subparsers._group_actions[0].choices  # name → the subcommand's parser
    flags = {name: {o for a in p._actions for o in a.option_strings} for name, p in commands.items()}
    for name in ("generate", "bench", "rollout"):
        assert "--temperature" in flags[name] and "--temp" not in flags[name]
    for name in ("generate", "bench", "rollout", "self-prompts", "train"):
        assert "--mesh" in flags[name], name
    for name in ("rollout", "replay", "self-prompts", "train", "eval-drafter"):
        assert "--batch-size" in flags[name] and "--batch" not in flags[name], name
    assert "--limit" in flags["self-prompts"] and "--n" not in flags["self-prompts"]
    metavars = {(name, a.option_strings[0]): a.metavar for name, p in commands.items() for a in p._actions
                if a.option_strings and a.option_strings[0] in ("--out", "--json-out")}
    assert {k: v for k, v in metavars.items() if k[1] == "--out"} == {("rollout", "--out"): "DIR",
                                                                   ("replay", "--out"): "DIR",
                                                                   ("train", "--out"): "DIR",
                                                                   ("export-drafter", "--out"): "DIR"}
    assert all(v.startswith("FILE") for k, v in metavars.items() if k[1] == "--json-out"), metavars
    assert set(next(a for a in commands["train"]._actions if "--loss" in a.option_strings).choices) == {
        "dflash", "dspark", "treespark"}
    with pytest.raises(SystemExit):
        main(["train", "--rollouts", "x", "--loss", "nope", "--out", "y"])
    err = capsys.readouterr().err  # one line pointing to --help, not argparse's whole usage block
    assert "invalid choice: 'nope'" in err and err.endswith("(see `treespark train --help`).\n")
    assert err.count("\n") == 1 and "usage:" not in err
    # An old spelling is not read as a prefix of the new one (argparse's abbreviations are off).
    for argv, old in ((["generate", "--prompt", "hi", "--temp", "0.7"], "--temp 0.7"),
                      (["generate", "--prompt", "hi", "--skip"], "--skip"),
                      (["train", "--rollouts", "x", "--loss", "dflash", "--out", "y", "--batch", "2"], "--batch 2")):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err  # blamed on the subcommand, whose --help lists the flags
        assert exit_.value.code == 2 and f"treespark {argv[0]}: error: unrecognized arguments: {old} (see" in err


def test_help_shows_the_defaults_it_has(capsys):
    with pytest.raises(SystemExit):
        main(["eval-drafter", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "per rollout (seeded) (default: 32)" in text and "(0: chain τ only) (default: 8)" in text
    assert "(default: None)" not in text and "(default: False)" not in text
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    # --drafter (repeatable, none given) has no default to say; --split's own help says its default
    assert "cap per reply (default: 128)" in text and "(default: [])" not in text and "(default: None)" not in text
    assert "(default: eval, the held-out prompts)" in text
    assert "(default: ar, prompt_lookup, dflash, dspark, ddtree, pctree, treespark)" in text  # wrapped between names
    with pytest.raises(SystemExit):
        main(["self-prompts", "--help"])
    assert "(default: )" not in capsys.readouterr().out  # --user-prefix is empty by default
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(0 = greedy) (default: 0.0)" in text and "for sampling (default: 0)" in text  # a 0 is a default too
    with pytest.raises(SystemExit):
        main(["profile", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "for the default ladders of N, N/2, ... 1 (default: 8)" in text
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"treespark {treespark_jax.__version__}\n"


def test_api_fields_and_paths_are_named_by_their_flags_before_any_work(capsys, tmp_path, no_target_load):
    (tmp_path / "file").write_text("a file")
    folder = tmp_path / "file"
    for argv, line in (
            (["bench", "--budgets", "4,0"],
             "treespark bench: error: --budgets 0 must be a whole number of drafted nodes between 1 and 1024."),
            (["train", "--rollouts", "x", "--loss", "dspark", "--out", str(tmp_path / "r"), "--lr", "-1"],
             "treespark train: error: --lr -1.0 must be positive."),
            (["bench", "--json-out", str(folder / "b.json")],
             f"treespark bench: error: --json-out {folder / 'b.json'}: {folder} is a file, not a folder.")):
        assert main(argv) == 2
        assert capsys.readouterr().err == line + "\n"
    for argv in (["eval-drafter", "--drafter", "", "--rollouts", "x"], ["train", "--rollouts", "x", "--loss", "dspark",
                                                                       "--out", " "], ["bench", "--json-out", ""]):
        with pytest.raises(SystemExit) as refused:  # a blank path would name the current folder
            main(argv)
        err = capsys.readouterr().err
        assert refused.value.code == 2 and "is blank, which would name the current folder; give a path" in err, err
    assert not (tmp_path / "r").exists()


@pytest.fixture
def no_target_load(monkeypatch):
    """Fails the test if a command loads a target: its refusals must come first."""
    import treespark_jax.api

    monkeypatch.setattr(treespark_jax.api, "load", lambda *a, **k: pytest.fail("the target was loaded"))


def test_eval_drafter_names_what_it_was_given_before_the_target_loads(capsys, tmp_path, no_target_load):
    shipped = Path(treespark_jax.__file__).parent / "drafters" / "smollm2-135m"
    (tmp_path / "rollouts.txt").write_text("not a folder")
    for flags, message in (
            (["--drafter", "random", "--rollouts", "x"],
             "--drafter random (an untrained drafter) is for generate and bench; eval-drafter needs a checkpoint "
             f"directory, such as {shipped / 'treespark'}."),
            (["--drafter", str(shipped), "--rollouts", "x"],
             "has no drafter.json (incomplete or not a drafter); it holds the drafters dflash, dspark, treespark: "
             "pass one of them."),
            (["--drafter", str(shipped / "dspark"), "--rollouts", str(tmp_path / "rollouts.txt")],
             "rollouts.txt' is a file, not a directory; pass the folder `treespark rollout --out DIR` wrote.")):
        assert main(["eval-drafter", *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("treespark eval-drafter: error: ") and err.endswith(message) and "\n" not in err


def test_rollout_settings_and_an_unwritable_json_out_are_refused_before_any_work(capsys, tmp_path, no_target_load):
    for flags, message in ((["--seed", "-1"], "--seed -1 is outside 0..4294967295"),
                           (["--top-p", "0"], "--top-p 0.0 is outside (0, 1]"),
                           (["--top-p", "0.9"], "--top-p 0.9 has no effect at --temperature 0"),
                           (["--drafter", "random", "--temperature", "1", "--top-p", "0.9"],
                            "--top-p 0.9 is refused for on-policy rollouts: they log trees for training at top_p=1"),
                           (["--method", "dflash"], "--method dflash set how a drafter speculates; give --drafter"),
                           (["--budget", "8"], "--budget 8 set how a drafter speculates; give --drafter"),
                           (["--drafter", str(tmp_path)], "has neither drafter.json"),
                           (["--layer-ids", ""], "--layer-ids '' lists nothing")):
        assert main(["rollout", "--prompts", "gsm8k", "--out", str(tmp_path / "r"), *flags]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "todo.txt").write_text("mine")
    assert main(["rollout", "--prompts", "gsm8k", "--out", str(foreign)]) == 2
    assert f"--out {str(foreign)!r} holds files but no manifest.json" in capsys.readouterr().err
    assert [p.name for p in foreign.iterdir()] == ["todo.txt"]
    if Path("/sys").is_dir():  # read-only even for root, whom os.access would wave through
        assert main(["bench", "--json-out", "/sys/b.json"]) == 2
        assert "--json-out /sys/b.json: its folder is not writable." in capsys.readouterr().err


def test_generation_config_is_checked_when_made_and_names_unknown_settings(unchecked):
    from treespark_jax.generation import GenerationConfig

    with pytest.raises(ValueError, match="temperature -1 is negative"):
        GenerationConfig(temperature=-1)
    with pytest.raises(ValueError, match="budget=0 must be a whole number of drafted nodes between 1 and 1024"):
        GenerationConfig(budget=0)
    with pytest.raises(ValueError, match="method 'fast' is unknown"):
        GenerationConfig(method="fast")
    with pytest.raises(ValueError, match="budget=4.5 must be a whole number"):
        GenerationConfig(budget=4.5)
    for name, value in (("temperature", "0.7"), ("top_p", None), ("max_new_tokens", 8.0), ("max_new_tokens", True)):
        with pytest.raises(ValueError, match=f"{name}={value!r} must be a"):
            GenerationConfig(**{name: value})
    for seed in ("3", [1, "2"], 1.5):
        with pytest.raises(ValueError, match="must be a whole number or a list of them"):
            GenerationConfig(seed=seed)
    with pytest.raises(ValueError, match="builder 'foo' is unknown"):
        GenerationConfig(builder="foo")
    with pytest.raises(ValueError, match="verify rule 'greedy' is what temperature 0 uses"):
        GenerationConfig(verify="greedy")
    with pytest.raises(ValueError, match="verify='rejection' is a rule for temperature > 0 only"):
        GenerationConfig(verify="rejection")
    GenerationConfig(verify="rejection", temperature=1.0)
    with pytest.raises(ValueError, match="'temp' is not a generation setting; use one of max_new_tokens, temperature"):
        GenerationConfig.of(temp=0.7)
    config = GenerationConfig(method="treespark", builder="chain", temperature=0.5)
    assert config.autoregressive() == GenerationConfig(method="ar", temperature=0.5)
    assert not config.greedy and GenerationConfig.of(config, temperature=0).greedy


def test_generate_refuses_what_it_can_see_before_the_target_loads(capsys, tmp_path, no_target_load):
    for flags, message in ((["--prompt", ""], "the prompt is empty"),
                           (["--prompt", " ", "--chat"], "the prompt is empty"),
                           (["--prompt", "hi", "--drafter", str(tmp_path / "none")],
                            f"--drafter {tmp_path / 'none'} does not exist or is not a"),
                           (["--prompt", "hi", "--drafter", str(tmp_path)], "has neither drafter.json"),
                           (["--prompt", "hi", "--method", "ar", "--drafter", "random"],
                            "method 'ar' uses no block drafter; drop --drafter 'random'."),
                           (["--prompt", "hi", "--method", "ar", "--builder", "chain", "--budget", "8"],
                            "method 'ar' drafts nothing; drop --budget, --builder."),
                           (["--prompt", "hi", "--method", "ar", "--drafter", "random", "--verify", "rejection",
                             "--temperature", "1"], "uses no block drafter"),
                           (["--prompt", "hi", "--verify", "rejection"],
                            "--verify 'rejection' is a rule for temperature > 0 only")):
        assert main(["generate", *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("treespark generate: error: ") and message in err and err.count("\n") == 1, err


def test_train_online_defaults_to_the_default_preset_and_offline_to_the_rollouts_target(capsys, tmp_path,
                                                                                       monkeypatch):
    import treespark_jax.train.loop

    targets = []

    def stub(*args, target=None, **kwargs):  # stands in for the training loop: what target it was given
        targets.append(target)
        raise ValueError("stub")

    monkeypatch.setattr(treespark_jax.train.loop, "train", stub)
    assert main(["train", "--online", "--prompts", "gsm8k", "--loss", "dspark", "--out", str(tmp_path / "a")]) == 2
    assert main(["train", "--rollouts", str(tmp_path), "--loss", "dspark", "--out", str(tmp_path / "b")]) == 2
    assert targets == ["smollm2-135m", None] and capsys.readouterr().err.count("stub") == 2
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "offline training uses the rollouts' target and --online smollm2-135m" in text


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("signum, code, word", [(15, 143, "terminated"), (2, 130, "interrupted")])
def test_sigterm_and_ctrl_c_unwind_the_command_even_when_python_drops_the_first(capsys, monkeypatch, signum, code,
                                                                                  word):
    """The handler's exception is raised where the main thread is; raised inside a garbage-collection
    callback, Python drops it ("Exception ignored") and the command would carry on, so the signal is
    sent again until the command has unwound."""
    import gc
    import signal

    import treespark_jax.cli.models as models_cli

    cleaned = []

    class SignalsWhenCollected:
        def __del__(self):
            os.kill(os.getpid(), signum)
            for _ in range(10_000):  # the handler runs here, inside __del__: its exception is dropped
                pass

    def killed(args):
        try:
            SignalsWhenCollected()
            gc.collect()
            time.sleep(30)  # only the signal sent again ends this
        finally:
            cleaned.append(True)  # the command's cleanup runs

    monkeypatch.setattr(models_cli, "run", killed)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    assert main(["models", "list"]) == code and cleaned == [True]
    assert capsys.readouterr().err.endswith(f"treespark models list: {word}.\n")
    assert {s: signal.getsignal(s) for s in before} == before  # restored for the caller


@pytest.mark.parametrize("code, leaves", [(143, [143]), (130, [130]), (0, []), (2, [])])
def test_the_executable_leaves_at_once_after_an_interrupt(monkeypatch, code, leaves):
    """After Ctrl-C or SIGTERM the process ends without the interpreter's shutdown, which can crash while
    an XLA compile still runs on a worker thread; other statuses exit normally."""
    import treespark_jax.cli as cli

    left = []
    monkeypatch.setattr(cli, "main", lambda: code)
    monkeypatch.setattr(cli.os, "_exit", left.append)
    with pytest.raises(SystemExit) as exit_:
        cli.console()
    assert left == leaves and exit_.value.code == code
