"""``treespark bench`` on a tiny random target: rows, greedy equality, compile counts, errors."""

import json
from pathlib import Path

import pytest

from treespark_jax.cli import main

from tiny import CHATML, write_tiny_hf_target

PROMPTS = ["Add 2 and 3.", "Name a tree, any tree you like best.", "Count to 4."]  # different lengths


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_tiny_hf_target(tmp_path_factory.mktemp("tiny") / "hf", layers=8, d=48, mlp=80, head_dim=16,
                                max_positions=512, chat_template=CHATML)


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def _bench(tiny_dir, prompt_file, out, *flags):
    return main(["bench", "--target", str(tiny_dir), "--prompts", str(prompt_file), "--max-new-tokens", "10",
                 "--repeats", "2", "--json-out", str(out), *flags])


def test_bench_rows_are_greedy_equal_and_compile_once_per_budget(tiny_dir, prompt_file, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert _bench(tiny_dir, prompt_file, out, "--methods", "ar,prompt_lookup,treespark,ddtree",
                  "--budgets", "2,6", "--drafter", "treespark=random", "--drafter", "ddtree=random") == 0
    table = capsys.readouterr().out
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["method"], r["budget"]) for r in rows] == [
        ("ar", None), ("prompt_lookup", 2), ("prompt_lookup", 6), ("treespark", 2), ("treespark", 6),
        ("ddtree", 2), ("ddtree", 6)]
    assert result["protocol"]["n_prompts"] == 3 and result["protocol"]["repeats"] == 2
    for r in rows:
        assert r["greedy_equal"] is True and r["divergences"] == [], r
        assert 1.0 <= r["tau"] <= 1 + (r["budget"] or 0), r  # a round commits at most its budget + the bonus
        assert r["speedup"] > 0 and r["speedup_iqr"] >= 0 and r["tokens_per_s"] > 0
        # Three prompt lengths, two repeats: every program is compiled in the first pass.
        assert r["compiles"] >= 1 and r["late_compiles"] == 0, r
        assert r["method"] in table
    assert rows[0]["tau"] == 1.0 and rows[0]["speedup"] == 1.0 and rows[0]["tau_per_depth"] == []
    depth = rows[3]["tau_per_depth"]
    assert depth and all(a is None or 0.0 <= a <= 1.0 for a in depth)


@pytest.mark.parametrize("flags, skip_drafting, cost_aware_stop", [((), True, True),
                                                                  (("--no-skip-drafting",), False, True),
                                                                  (("--no-cost-aware-stop",), True, False)])
def test_bench_sampled_rows_have_no_greedy_check(tiny_dir, prompt_file, tmp_path, flags, skip_drafting,
                                                 cost_aware_stop):
    out = tmp_path / "bench.json"
    assert _bench(tiny_dir, prompt_file, out, "--methods", "ar,dspark", "--budgets", "4", "--temperature", "1",
                  "--drafter", "dspark=random", "--builder", "treespark", "--limit", "1", *flags) == 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [r["greedy_equal"] for r in rows] == [None, None] and rows[1]["temperature"] == 1.0
    assert report["protocol"]["temperature"] == 1.0
    assert (rows[1]["builder"], rows[1]["verify"], rows[1]["cost_aware_stop"]) == ("treespark", "rejection",
                                                                               cost_aware_stop)
    assert rows[1]["skip_drafting"] is skip_drafting and report["protocol"]["skip_drafting"] is skip_drafting
    assert report["protocol"]["cost_aware_stop"] is (None if cost_aware_stop else False)
    assert 0.0 <= rows[1]["skipped"] <= (1.0 if skip_drafting else 0.0) and rows[0]["skipped"] == 0.0


@pytest.mark.parametrize("flags, message", [
    (["--methods", "ar,fast"], "--methods 'fast' is unknown; choose from ar,"),
    (["--methods", "ar", "--builder", "chain"], "method 'ar' drafts nothing; drop --builder."),
    (["--methods", "ar,prompt_lookup", "--drafter", "treespark=random"],
     "--drafter treespark=random is for treespark, which --methods ar,prompt_lookup does not run"),
    (["--budgets", "4,x"], "--budgets '4,x' must be comma-separated integers"),
    (["--budgets", "4,,8"], "--budgets '4,,8' has an empty entry"),
    (["--budgets", "0"], "--budgets 0 must be a whole number of drafted nodes between 1 and 1024"),
    (["--budgets", "4,100000"], "--budgets 100000 must be a whole number of drafted nodes between 1 and 1024"),
    (["--repeats", "0"], "--repeats 0 must be at least 1"),
    (["--drafter", "ar=/x"], "--drafter 'ar=/x' must be METHOD=PATH"),
    (["--split", "eval"], "--split 'eval' does not apply to the JSONL file"),
    (["--methods", "treespark"], "none ships for target"),
    (["--json-out", "/nonexistent-folder/r.json"], "--json-out /nonexistent-folder/r.json: its folder does not exist"),
    (["--json-out", "."], "--json-out . is a directory; give a file path"),
    (["--seed", "-1"], "seed -1 is outside 0..4294967295"),
    (["--temperature", "-1"], "temperature -1.0 is negative"),
])
def test_bench_bad_input_is_one_sentence(tiny_dir, prompt_file, tmp_path, capsys, flags, message):
    assert _bench(tiny_dir, prompt_file, tmp_path / "x.json", *flags) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "x.json").exists()
