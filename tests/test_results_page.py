"""experiments/results.py's modules: the reproduction check's verdicts and the page it renders, from rows on disk."""

import argparse
import json
import re

import pytest
from scripts import load_script


@pytest.fixture(scope="module")
def measuring():
    return load_script("experiments/results_measure.py")


@pytest.fixture(scope="module")
def page():
    return load_script("experiments/results_page.py")


@pytest.fixture(scope="module")
def tables():
    return load_script("experiments/results_tables.py")


@pytest.fixture(scope="module")
def ablation():
    return load_script("experiments/results_loss_ablation.py")


@pytest.fixture(scope="module")
def iterate():
    return load_script("experiments/results_iterate.py")


def _row(method, budget, tau, speedup, iqr):
    return {"method": method, "budget": budget, "temp": 0.0, "tau": tau, "tau_per_depth": [0.5],
            "speedup": speedup, "speedup_iqr": iqr, "tokens_per_s": 30.0, "greedy_equal": True, "divergences": []}


def test_compare_runs_applies_the_stated_noise(measuring):
    page = [_row("ar", None, 1.0, 1.0, 0.0), _row("treespark", 4, 1.90, 1.10, 0.20), _row("dspark", 4, 1.80, 1.05, 0.05)]
    fresh = [_row("ar", None, 1.0, 1.0, 0.0), _row("treespark", 4, 1.90, 0.95, 0.10), _row("dspark", 4, 1.80, 1.15, 0.04)]
    rows = {r["method"]: r for r in measuring.compare_runs("gsm8k", 0.0, page, fresh)}
    assert rows["treespark"]["reproduced"] and rows["treespark"]["noise"] == pytest.approx(0.20)
    assert not rows["dspark"]["reproduced"]  # moved 0.10 against an IQR of 0.05
    assert rows["ar"]["reproduced"]
    shifted = measuring.compare_runs("gsm8k", 0.0, page, [_row("treespark", 4, 1.80, 1.10, 0.20)])
    assert not shifted[0]["reproduced"]  # τ moved by 0.10 > TAU_TOL


def test_others_share_subtracts_own_cpu_time(measuring):
    start, end = (100.0, 5.0, 0.0), (118.0, 13.0, 10.0)  # 18 busy s, 8 own s, 10 wall s
    cores = measuring.os.cpu_count()
    assert measuring.others_share(start, end) == pytest.approx(10.0 / (10.0 * cores))
    assert measuring.others_share(None, end) is None


def _measured_page(tmp_path):
    """A measured gsm8k temp-0 table (budget 4) under ``tmp_path/results``; returns its rows."""
    out = tmp_path / "results"
    out.mkdir()
    rows = [_row("ar", None, 1.0, 1.0, 0.0), _row("dspark", 4, 1.7, 1.05, 0.1), _row("ddtree", 4, 1.95, 0.9, 0.1),
            _row("treespark", 4, 1.9, 1.2, 0.1) | {"skipped": 0.25, "skip": True}]
    (out / "bench-gsm8k-t0.json").write_text(json.dumps(rows))
    args = {"sets": "gsm8k", "temps": "0", "limit": 4, "max_new_tokens": 64, "budgets": "4", "repeats": 1}
    (out / "meta.json").write_text(json.dumps({"minutes": 3.0, "machine": "cpu (x86_64, 2 cores)", "args": args,
                                               "others_cpu": [0.02]}))
    return rows


def test_render_writes_tables_verdicts_and_reproduction(measuring, page, tables, ablation, tmp_path):
    out = tmp_path / "results"
    rows = _measured_page(tmp_path)
    rep = {"date": "2026-11-30", "machine": "cpu", "others_cpu": [0.01],
           "rows": measuring.compare_runs("gsm8k", 0.0, rows, rows)}
    (out / "reproduction.json").write_text(json.dumps(rep))
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{page.README_START}\nold\n{page.README_END}\noutro\n")
    md = page.render(["gsm8k"], [0.0], out, tmp_path / "data", tmp_path / "RESULTS.md", readme)
    assert (tmp_path / "RESULTS.md").read_text() == md
    assert (tmp_path / "results_tau_speedup.png").stat().st_size > 0
    assert "treespark τ > dspark τ at budgets [4] of [4]" in md
    assert "treespark τ > ddtree τ at budgets none of [4]" in md
    assert "1.20 ± 0.10 at budget 4 (above 1 by more than half its IQR)" in md
    assert "fastest row" not in md  # treespark is the fastest here
    assert "[TAU_EQUAL_BUDGET.md](TAU_EQUAL_BUDGET.md)" in md  # where τ at equal budget is
    faster = tables.verdicts(rows + [_row("dspark", 8, 1.7, 1.3, 0.2)], [4, 8])
    assert faster[-1] == "fastest row: dspark at budget 8, 1.30 ± 0.20"
    assert "draft skipping off" not in md
    unskipped = tables.verdicts([dict(r, skip=False) for r in rows], [4])
    assert unskipped[-1] == "measured with draft skipping off, before it became the default of every drafting method"
    assert "| treespark | 4 | 1.90 | 1.20 ± 0.10 | 30.0 | 25% |" in md and "| ar | — | 1.00 | 1.00 ± 0.00 | 30.0 | — |" in md
    assert "4 of 4 rows reproduced within the stated noise" in md
    assert "other processes used 2 % of the" in md
    assert ablation.LOSS_ABLATION_NOT_RUN in md  # no ablation runs under tmp_path
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith("outro\n") and "old" not in text
    # a table of the page's protocol not measured yet says so and how to add it
    md = page.render(["gsm8k", "mtbench"], [0.0], out, tmp_path / "data", tmp_path / "RESULTS.md")
    assert ("## mtbench, temp 0\n\nNot measured yet at this page's protocol (or the run was stopped before it). "
            "`python experiments/results.py --sets mtbench --temps 0` with the page's other flags adds it.") in md
    assert "| treespark | 4 | 1.90 | 1.20 ± 0.10 |" in text
    assert "[TAU_EQUAL_BUDGET.md](experiments/TAU_EQUAL_BUDGET.md)" in text


def test_loss_ablation_names_the_changed_weights_and_steps(ablation, tmp_path):
    ev = {"chain_tau": 1.6, "tree_tau": 2.1, "budget": 16, "alpha": [0.5, 0.4, 0.3, 0.2]}
    runs = (("start", None, 0), ("shipped", {}, 600), ("shipped_no_tree_terms", {"tree_edge": 0.0}, 600),
            ("full", {}, 100), ("node_terms", {"tree_tv": 0.09, "tree_coverage": 0.1}, 100))
    for name, config, steps in runs:
        d = tmp_path / f"ablate-{name}"
        d.mkdir()
        (d / "eval.json").write_text(json.dumps(ev))
        if config is not None:
            run = {"loss_config": {**ablation.TREE_TERMS, **config}, "train": {"steps": steps}}
            (tmp_path / ("treespark" if name == "shipped" else f"ablate-{name}")).mkdir(exist_ok=True)
            (tmp_path / ("treespark" if name == "shipped" else f"ablate-{name}") / "run.json").write_text(
                json.dumps(run))
    table = ablation.loss_ablation(tmp_path)
    assert "| start | (the dspark drafter itself) | 0 | 1.600 | 2.100 (16) | 0.50 0.40 0.30 |" in table
    assert "| shipped | — (the run exported as the shipped drafter) | 600 |" in table
    assert "| shipped_no_tree_terms | tree_edge=0 | 600 |" in table
    assert "| full | — | 100 |" in table and "| node_terms | tree_tv=0.09, tree_coverage=0.1 | 100 |" in table
    assert "- node_terms against start: chain τ 1.600 → 1.600, tree τ 2.100 → 2.100" in table
    assert ablation.loss_ablation(tmp_path / "missing") is None


def test_a_checkout_without_the_ablation_runs_keeps_the_pages_loss_table_marked_as_carried_over(page, ablation,
                                                                                                 tmp_path):
    _measured_page(tmp_path)
    results_md = tmp_path / "RESULTS.md"

    def render():
        return page.render(["gsm8k"], [0.0], tmp_path / "results", tmp_path / "data", results_md)

    assert ablation.LOSS_ABLATION_NOT_RUN in render()  # no table anywhere yet
    table = "| variant | steps |\n|---|---|\n| start | 0 |"
    results_md.write_text(results_md.read_text().replace(ablation.LOSS_ABLATION_NOT_RUN, table))
    carried = f"{ablation.LOSS_ABLATION_HEAD}\n\n{ablation.CARRIED_OVER}\n\n{table}\n\n## Iterated"
    assert carried in render()
    assert carried in render()  # rendered again, it is marked once
    results_md.write_text(results_md.read_text().replace(ablation.CARRIED_OVER, "Carried over from an older wording."))
    assert carried in render()  # an older mark is replaced, not stacked
    assert ablation.LOSS_ABLATION_NOT_RUN not in results_md.read_text()


def test_a_check_of_one_table_keeps_the_other_tables_verdicts(measuring, tables, tmp_path, monkeypatch):
    out = tmp_path / "results"
    (out / "check").mkdir(parents=True)
    shown = [_row("ar", None, 1.0, 1.0, 0.0), _row("treespark", 4, 1.9, 1.2, 0.1)]
    for name in ("bench-gsm8k-t0.json", "bench-gsm8k-t1.json"):
        (out / name).write_text(json.dumps(shown))
    args = {"sets": "gsm8k", "temps": "0,1", "limit": 4, "max_new_tokens": 64, "budgets": "4", "repeats": 1,
            "methods": ",".join(measuring.DRAFTING)}
    (out / "meta.json").write_text(json.dumps({"minutes": 1.0, "args": args}))
    old = {"date": "2026-11-30", "machine": "cpu", "others_cpu": [0.01],  # the format before per-row dates
           "rows": [*measuring.compare_runs("gsm8k", 0.0, shown, shown),
                    *measuring.compare_runs("gsm8k", 1.0, shown, shown)]}
    (out / "reproduction.json").write_text(json.dumps(old))
    slower = [_row("ar", None, 1.0, 1.0, 0.0), _row("treespark", 4, 1.9, 0.8, 0.1)]
    monkeypatch.setattr(measuring, "run_jobs", lambda a, jobs, where: (where / "bench-gsm8k-t1.json").write_text(
        json.dumps(slower)))
    monkeypatch.setattr(measuring.time, "strftime", lambda fmt: "2026-12-01")
    measuring.check(argparse.Namespace(**args), ["gsm8k"], [1.0], out)
    rows = {(r["temp"], r["method"]): r for r in json.loads((out / "reproduction.json").read_text())["rows"]}
    assert len(rows) == 4
    assert rows[(0.0, "treespark")]["reproduced"] and rows[(0.0, "treespark")]["date"] == "2026-11-30"
    assert not rows[(1.0, "treespark")]["reproduced"] and rows[(1.0, "treespark")]["date"] == "2026-12-01"
    summary = tables.reproduction(measuring.checked_rows(out))
    assert summary["when"] == "gsm8k temp 0 on 2026-11-30 and gsm8k temp 1 on 2026-12-01"
    assert (summary["reproduced"], summary["checked"]) == (3, 4)
    assert summary["max_tau_change"] == 0.0 and summary["median_speedup_change"] == 0.0
    assert summary["max_speedup_change"] == pytest.approx(0.4)

    # measuring a table for the page again drops its now stale verdicts, and keeps the others
    monkeypatch.setattr(measuring, "run_jobs", lambda a, jobs, where: dict.fromkeys(jobs, 2.0))
    measuring.measure(argparse.Namespace(**args | {"sets": "gsm8k", "temps": "1"}), ["gsm8k"], [1.0], out)
    assert {r["temp"] for r in json.loads((out / "reproduction.json").read_text())["rows"]} == {0.0}
    # the page's time counts each table once: measured again, a table's minutes replace its old ones
    meta = json.loads((out / "meta.json").read_text())
    assert meta["jobs"] == {"bench:gsm8k:1": 2.0, "builders:gsm8k": 2.0} and meta["minutes"] == 4.0
    measuring.measure(argparse.Namespace(**args | {"sets": "gsm8k", "temps": "0"}), ["gsm8k"], [0.0], out)
    assert json.loads((out / "meta.json").read_text())["minutes"] == 6.0


def test_runs_over_other_tables_add_up_and_keep_the_builder_ablation(measuring, tmp_path, monkeypatch):
    out = tmp_path / "results"
    out.mkdir()
    ran = []
    monkeypatch.setattr(measuring, "run_jobs", lambda a, jobs, where: ran.append(jobs) or dict.fromkeys(jobs, 1.0))
    protocol = {"limit": 16, "max_new_tokens": 128, "budgets": "4,8", "repeats": 1, "methods": ",".join(measuring.DRAFTING)}

    def measure(sets, temps, **changed):
        args = argparse.Namespace(**protocol | changed | {"sets": sets, "temps": temps})
        measuring.measure(args, sets.split(","), [float(t) for t in temps.split(",")], out)
        return ran[-1]

    assert measure("gsm8k", "0") == ["bench:gsm8k:0", "builders:gsm8k"]
    (out / "ablation-builders.json").write_text(json.dumps({"set": "gsm8k", "rows": []}))
    assert measure("humaneval,mtbench", "0") == ["bench:humaneval:0", "bench:mtbench:0"]
    assert measure("gsm8k", "1") == ["bench:gsm8k:1"]  # the ablation is a temp-0 measurement
    assert measure("gsm8k", "0") == ["bench:gsm8k:0", "builders:gsm8k"]  # measured again with its table
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["args"]["sets"], meta["args"]["temps"]) == ("gsm8k,humaneval,mtbench", "0,1")
    assert meta["minutes"] == 5.0  # four tables and the ablation, each counted once
    # another protocol starts another page, which measures its own ablation
    assert measure("humaneval", "0", limit=4) == ["bench:humaneval:0", "builders:humaneval"]
    assert json.loads((out / "meta.json").read_text())["args"]["sets"] == "humaneval"


def test_a_run_of_some_methods_replaces_their_rows_and_the_page_names_it(measuring, page, tmp_path, monkeypatch):
    out = tmp_path / "results"
    _measured_page(tmp_path)  # gsm8k temp 0 at budget 4: AR, dspark, ddtree, treespark
    old = json.loads((out / "meta.json").read_text())
    fresh = [_row("ar", None, 1.0, 1.0, 0.0), _row("treespark", 4, 2.4, 1.5, 0.1)]
    rows = measuring.replace_rows(json.loads((out / "bench-gsm8k-t0.json").read_text()), fresh, measuring.METHODS)
    assert [(r["method"], r["tau"]) for r in rows] == [("ar", 1.0), ("dspark", 1.7), ("ddtree", 1.95), ("treespark", 2.4)]
    (out / "bench-gsm8k-t0.json").write_text(json.dumps(rows))
    args = argparse.Namespace(**old["args"], methods="treespark")
    ran = []

    def run_jobs(a, jobs, where):  # as measure_one would: AR measured again, here on a faster machine
        table = where / "bench-gsm8k-t0.json"
        table.write_text(json.dumps([r | {"tokens_per_s": 45.0} if r["method"] == "ar" else r
                                     for r in json.loads(table.read_text())]))
        ran.append(jobs)
        return dict.fromkeys(jobs, 4.0)

    monkeypatch.setattr(measuring, "run_jobs", run_jobs)
    monkeypatch.setattr(measuring.time, "strftime", lambda fmt: "2026-12-08")
    measuring.measure(args, ["gsm8k"], [0.0], out)
    assert ran[-1] == ["bench:gsm8k:0", "builders:gsm8k"]  # the builder ablation measures the treespark drafter
    meta = json.loads((out / "meta.json").read_text())
    assert {k: meta[k] for k in ("minutes", "machine", "args")} == {k: old[k] for k in ("minutes", "machine", "args")}
    assert meta["others_cpu"][0] == 0.02 and len(meta["others_cpu"]) == 2
    md = page.render(["gsm8k"], [0.0], out, tmp_path / "data", tmp_path / "RESULTS.md")
    assert ("- Measured again, with the drafters shipped then: treespark and AR on gsm8k temp 0 and the builder "
            "ablation, by `python experiments/results.py --methods treespark --sets gsm8k --temps 0` with the page's "
            "other flags on 2026-12-08 (8 minutes); each speedup is against the AR of its own run, which ran at 45.0 "
            "against 30.0 tokens/s there (where the two differ, so do the machines' ratios: compare speedups across the "
            "two runs only where AR's speeds agree).") in md
    assert "| treespark | 4 | 2.40 | 1.50 ± 0.10 |" in md and "| dspark | 4 | 1.70 | 1.05 ± 0.10 |" in md
    measuring.measure(argparse.Namespace(**old["args"], methods="dspark"), ["gsm8k"], [0.0], out)
    assert ran[-1] == ["bench:gsm8k:0"]  # no treespark row: the ablation stays
    # a later run of every method on the table makes the notes of its re-measurements moot
    measuring.measure(argparse.Namespace(**old["args"], methods=",".join(measuring.DRAFTING)), ["gsm8k"], [0.0], out)
    assert "remeasured" not in json.loads((out / "meta.json").read_text())
    # refused before anything is measured: an unknown method, a table or protocol not on the page, a partial check
    for sets, temps, changed, message in (
            (["gsm8k"], [0.0], {"methods": "treespark,eagle"}, "--methods 'treespark,eagle' names 'eagle', which is not "
                                                               "one of prompt_lookup, dflash, dspark, ddtree, pctree, "
                                                               "treespark."),
            (["mtbench"], [0.0], {}, "--methods measures some methods again on a measured table only: mtbench at "
                                     "temp 0 is not on the page."),
            (["gsm8k"], [0.0], {"limit": 16}, "--methods measures some methods again on the page's protocol: --limit "
                                              "is 16, the page used 4.")):
        with pytest.raises(SystemExit, match=re.escape(message)):
            measuring.measure(argparse.Namespace(**old["args"] | {"methods": "treespark"} | changed), sets, temps, out)
    with pytest.raises(SystemExit, match="--check repeats every method of a table; --methods 'treespark' names fewer."):
        measuring.check(argparse.Namespace(**old["args"], methods="treespark"), ["gsm8k"], [0.0], out)
    with pytest.raises(SystemExit, match="a measured page: .* does not exist; run every method first."):
        measuring.measure(argparse.Namespace(**old["args"], methods="treespark"), ["gsm8k"], [0.0], tmp_path)
    assert len(ran) == 3


def test_tau_equal_budget_page_compares_tau_per_budget_and_leaves_speed_out():
    page = load_script("experiments/tau_equal_budget.py")
    rows = [_row("ar", None, 1.0, 1.0, 0.0), _row("dspark", 4, 1.7, 1.05, 0.1), _row("ddtree", 4, 1.95, 0.9, 0.1),
            _row("ddtree", 8, 2.3, 0.9, 0.1), _row("treespark", 4, 2.0, 1.3, 0.1), _row("treespark", 8, 2.2, 1.3, 0.1)]
    rows[2] |= {"tau_per_depth": [0.6, 0.5, None, 0.25]}
    data = {"protocol": {"sets": ["gsm8k"], "limit": 4, "max_new_tokens": 64, "budgets": [4, 8], "temp": 0.0,
                         "skip": False, "stop": False},
            "machine": "cpu (x86_64, 2 cores)", "others_cpu": [0.01], "date": "2026-11-30", "minutes": 9.0,
            "rows": {"gsm8k": rows}}
    text = page.render(data, "experiments/page_data/tau-equal-budget.json")
    assert ("`python experiments/tau_equal_budget.py --sets gsm8k --limit 4 --max-new-tokens 64 --budgets 4,8` "
            "on 2026-11-30") in text
    assert "| ddtree | 4 | 1.950 | 0.60 0.50 — 0.25 | yes |" in text and "| ar |" not in text
    assert "`experiments/page_data/tau-equal-budget.json`" in text  # the data the page is rebuilt from
    assert "- treespark τ > dspark τ at budgets [4] of [4, 8]" in text
    assert "- treespark τ > ddtree τ at budgets [4] of [4, 8]" in text
    assert "speedup" not in text.split("## gsm8k")[1] and "1.30" not in text


def test_tau_equal_budget_runs_over_other_sets_add_up_at_the_same_protocol():
    page = load_script("experiments/tau_equal_budget.py")

    def run(sets, tau, limit=16, others=0.01, minutes=30.0):
        return {"protocol": {"sets": sets, "limit": limit, "max_new_tokens": 128, "budgets": [4, 8],
                             "temperature": 0.0, "skip_drafting": False, "cost_aware_stop": False},
                "machine": "cpu", "others_cpu": [others], "date": "2026-12-05", "minutes": minutes,
                "rows": {s: [_row("treespark", 4, tau, 1.3, 0.1)] for s in sets}}

    first = run(["gsm8k", "humaneval"], 2.0)
    merged = page.merge(first, run(["humaneval", "mtbench"], 1.5, others=0.02, minutes=20.0))
    assert merged["protocol"]["sets"] == ["gsm8k", "humaneval", "mtbench"] == list(merged["rows"])
    assert [merged["rows"][s][0]["tau"] for s in merged["rows"]] == [2.0, 1.5, 1.5]  # measured again: new rows
    assert merged["others_cpu"] == [0.01, 0.02] and merged["minutes"] == 50.0
    text = page.render(merged, "tau.json")
    assert "--sets gsm8k,humaneval,mtbench --limit 16" in text and "## gsm8k" in text and "## mtbench" in text
    other = run(["mtbench"], 1.5, limit=4)  # another protocol starts the page again
    assert page.merge(first, other) is other and page.merge(None, first) is first
    assert list(first["rows"]) == ["gsm8k", "humaneval"]  # the old page is not modified


def test_tau_equal_budget_a_run_of_some_methods_replaces_only_their_rows(monkeypatch, tmp_path):
    page = load_script("experiments/tau_equal_budget.py")
    monkeypatch.setattr("sys.argv", ["tau_equal_budget.py", "--methods", "treespark,eagle", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--methods 'treespark,eagle' names 'eagle', which is not one of "
                                         "prompt_lookup, dflash, dspark, ddtree, pctree, treespark."):
        page.main()  # refused before the target loads
    everyone = ["ar", *page.DRAFTING]

    def run(sets, methods, tau, date, minutes):
        return {"protocol": {"sets": sets, "limit": 16, "max_new_tokens": 128, "budgets": [4, 8],
                             "temperature": 0.0, "skip_drafting": False, "cost_aware_stop": False},
                "methods": methods, "machine": "cpu", "others_cpu": [0.01], "date": date, "minutes": minutes,
                "rows": {s: [_row(m, None if m == "ar" else b, tau, 1.0, 0.1) for m in ["ar", *methods]
                             for b in ([None] if m == "ar" else [4, 8])] for s in sets}}

    full = run(["gsm8k", "humaneval"], list(page.DRAFTING), 2.0, "2026-12-06", 88.0)
    again = page.merge(full, run(["gsm8k"], ["ddtree", "treespark"], 3.0, "2026-12-08", 12.0))
    taus = {(r["method"], r["budget"]): r["tau"] for r in again["rows"]["gsm8k"]}
    assert [r["method"] for r in again["rows"]["gsm8k"]][::2] == everyone  # the page's order, AR first
    assert {m for (m, _), t in taus.items() if t == 3.0} == {"ar", "ddtree", "treespark"}  # AR's with them
    assert all(r["tau"] == 2.0 for r in again["rows"]["humaneval"]) and full["rows"]["gsm8k"][-1]["tau"] == 2.0
    assert (again["date"], again["minutes"]) == ("2026-12-06", 100.0)  # the full run heads the page
    assert again["remeasured"] == [{"date": "2026-12-08", "sets": ["gsm8k"], "methods": ["ddtree", "treespark"],
                                    "minutes": 12.0}]
    text = page.render(again, "tau.json")
    assert "`python experiments/tau_equal_budget.py --sets gsm8k,humaneval --limit 16 --max-new-tokens 128 " \
           "--budgets 4,8` on 2026-12-06 (88 minutes)" in text
    assert ("- Measured again, with the drafters shipped then: ddtree, treespark on gsm8k, by `python "
            "experiments/tau_equal_budget.py --sets gsm8k --methods ddtree,treespark --limit 16 --max-new-tokens 128 "
            "--budgets 4,8` on 2026-12-08 (12 minutes).") in text
    # a later run of every method on gsm8k makes the note of its re-measurement moot
    fresh = page.merge(again, run(["gsm8k"], list(page.DRAFTING), 2.5, "2026-12-09", 30.0))
    assert "remeasured" not in fresh and fresh["date"] == "2026-12-09"
    alone = page.merge(None, run(["mtbench"], ["treespark"], 1.9, "2026-12-08", 5.0))  # a page begun by some methods
    assert "--sets mtbench --methods treespark --limit 16" in page.render(alone, "t")
    assert {r["tau"] for r in fresh["rows"]["gsm8k"]} == {2.5} and "Measured again" not in page.render(fresh, "t")


def _scored(folder, chain, tree, online, steps=None, replayed=None, init=None):
    folder.mkdir(parents=True)
    calibration = {"count": [[10.0, 10.0]], "predicted": [[2.0, 8.0]], "accepted": [[1.0, 9.0]]}  # ECE 0.1
    ev = {"chain_tau": chain, "tree_tau": tree, "budget": 16, "calibration": calibration}
    if replayed is not None:  # eval.json written before eval-drafter reported it have none
        ev["replayed_tau"] = replayed
    (folder / "eval.json").write_text(json.dumps(ev))
    (folder / "bench.json").write_text(json.dumps({"rows": [_row("ar", None, 1.0, 1.0, 0.0),
                                                            _row("treespark", 16, online, 1.1, 0.1)]}))
    if steps is not None:
        (folder / "run.json").write_text(json.dumps({"train": {"steps": steps}, **({"init": init} if init else {})}))


def test_iterated_loop_table_compares_each_seed_with_its_control(iterate, page, tmp_path):
    data = tmp_path / "data"
    assert iterate.iterate_table(data) is None
    r1 = data / "iter-r1"
    _scored(r1 / "start", 2.0, 2.5, 2.6)
    _scored(r1 / "treespark-s0", 2.1, 2.7, 2.8, steps=600)
    _scored(r1 / "control-s0", 2.0, 2.6, 2.9, steps=600)
    _scored(r1 / "treespark-s1", 2.2, 2.8, 2.7, steps=600)
    _scored(r1 / "control-s1", 2.3, 2.6, 2.6, steps=600)
    (r1 / "onpolicy").mkdir()
    (r1 / "onpolicy" / "manifest.json").write_text(json.dumps({"records": 128, "response_tokens": 24717}))
    _scored(data / "iter-r2" / "treespark-s0", 2.4, 2.9, 3.0, steps=600)  # its control not scored yet
    _scored(data / "iter-t1-r1" / "start", 2.0, 2.5, 2.2)  # ITER_TEMP=1: its own start, online at temperature 1
    _scored(data / "iter-t1-r1" / "control-s0", 2.0, 2.5, 2.1, steps=600,
            init="/work/x/treespark_jax/drafters/smollm2-135m/treespark")  # ITER_START: the shipped drafter
    _scored(data / "iter-t1-r1" / "treespark-s0", 2.0004, 2.5, 2.3, steps=600)  # chain τ +0.0004: equal
    r3 = data / "iter-r3"  # trees replayed along plain rollouts (ITER_TEMP=0, REPLAY=1), eval.json with replayed τ
    for name, tree, replayed in (("treespark-s0", 3.0, 2.6), ("control-s0", 3.1, 2.5)):
        _scored(r3 / name, 2.4, tree, 3.0, steps=600, replayed=replayed)
    for s, records in (("gsm8k", 1287), ("mtbench", 48)):
        (r3 / f"replay-{s}").mkdir()
        (r3 / f"replay-{s}" / "manifest.json").write_text(json.dumps({"records": records, "response_tokens": 1000}))
    table = iterate.iterate_table(data)
    assert "| 0 | 3 | control | 0 | 600 | 2.400 | 3.100 | 2.500 | 3.000 | 0.100 |" in table
    assert ("- Temp 0, round 3 (1335 training rollouts with replayed trees, 2,000 response tokens), tree terms minus "
            "control: offline replayed τ higher in the seed (+0.100; mean +0.100); offline tree τ lower in the seed "
            "(-0.100; mean -0.100); offline chain τ equal in the seed (+0.000; mean +0.000); online τ equal in the "
            "seed (+0.000; mean +0.000).") in table
    assert "| 0 | 1 | start (the treespark stage's drafter) | — | — | 2.000 | 2.500 | — | 2.600 | 0.100 |" in table
    assert "| 0 | 1 | treespark | 1 | 600 | 2.200 | 2.800 | — | 2.700 | 0.100 |" in table
    assert "| 0 | 2 | start (round 1's treespark, seed 0) | — | — | 2.100 | 2.700 | — | 2.800 | 0.100 |" in table
    assert ("| 1 | 1 | start (the shipped `smollm2-135m/treespark` drafter) | — | — | 2.000 | 2.500 | — | 2.200 "
            "| 0.100 |") in table
    assert ("- Temp 0, round 1 (128 on-policy GSM8K rollouts, 24,717 response tokens), tree terms minus control: "
            "offline tree τ higher in every seed (+0.100, +0.200; mean +0.150); offline chain τ mixed (+0.100, "
            "-0.100; mean +0.000); online τ mixed (-0.100, +0.100; mean +0.000).") in table
    assert "- Temp 0, round 2: no seed has both variants scored yet." in table
    assert ("- Temp 1, round 1, tree terms minus control: offline tree τ equal in the seed (+0.000; mean +0.000); "
            "offline chain τ equal in the seed (+0.000; mean +0.000)") in table
    assert "online τ higher in the seed (+0.200; mean +0.200)." in table
    # rendered into the page; a checkout without the runs keeps it, marked as carried over
    _measured_page(tmp_path)
    results_md = tmp_path / "RESULTS.md"
    assert table in page.render(["gsm8k"], [0.0], tmp_path / "results", data, results_md)
    md = page.render(["gsm8k"], [0.0], tmp_path / "results", tmp_path / "elsewhere", results_md)
    assert f"{iterate.ITERATE_HEAD}\n\n{iterate.carried_note('iterate')}\n\nEach round" in md  # the prose kept too
    assert md.count(iterate.carried_note("iterate")) == 1 and f"{table}\n\n## Reproduction" in md
