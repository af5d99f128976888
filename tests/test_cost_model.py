"""The cost model of the cost-aware stop: fit, interpolation (numpy and jitted), storage, profiler, CLI."""

import dataclasses
import itertools
import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treespark_jax.bench.profile import check_profile_args, profile_cost, profile_rows
from treespark_jax.cli import main
from treespark_jax.config import TreeConfig
from treespark_jax.drafter.prompt_lookup import PromptLookup
from treespark_jax.decode import cost_store
from treespark_jax.decode.cost_fit import fit_monotone_convex, pool_adjacent_violators
from treespark_jax.decode.cost_model import CostModel
from treespark_jax.decode.cost_store import cost_model_for, load_cost_model, profile_path, save_cost_model, target_id
from treespark_jax.decode.plan import Speculation, plan_round

from tiny import tiny_decoder


def slopes(x, y):
    return np.diff(y) / np.diff(x)


def brute_force_fit(x, y):
    """Least squares over every support of the hinge coefficients; the best feasible one wins."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    cols = [x - x[0]] + [np.maximum(0, x - k) for k in x[1:-1]]
    best, best_res = None, np.inf
    for support in itertools.product([False, True], repeat=len(cols)):
        a = np.stack([np.ones_like(x)] + [c for c, s in zip(cols, support) if s], axis=1)
        coef = np.linalg.lstsq(a, y, rcond=None)[0]
        if (coef[1:] < -1e-12).any():
            continue
        res = np.sum((a @ coef - y) ** 2)
        if res < best_res:
            best, best_res = a @ coef, res
    return best


# ------------------------------------------------------------------------------------------ fit


def test_fit_is_monotone_convex_and_the_least_squares_projection():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = rng.integers(2, 7)
        x = np.sort(rng.choice(np.arange(1, 200), n, replace=False)).astype(float)
        y = rng.normal(20, 10, n)
        f = fit_monotone_convex(x, y)
        s = slopes(x, f)
        assert (s >= -1e-9).all() and (np.diff(s) >= -1e-9).all()
        np.testing.assert_allclose(f, brute_force_fit(x, y), rtol=1e-7, atol=1e-7)


def test_fit_returns_data_that_is_already_monotone_convex():
    rng = np.random.default_rng(1)
    for _ in range(50):
        x = np.sort(rng.choice(np.arange(1, 100), 5, replace=False)).astype(float)
        s = np.sort(rng.uniform(0, 3, 4))  # non-decreasing non-negative slopes
        y = 15 + np.concatenate([[0], np.cumsum(s * np.diff(x))])
        np.testing.assert_allclose(fit_monotone_convex(x, y), y, rtol=1e-10)
    assert fit_monotone_convex([4], [7.5]).tolist() == [7.5]
    np.testing.assert_allclose(fit_monotone_convex([1, 2], [5.0, 3.0]), [4.0, 4.0])


def test_fit_rejects_bad_input():
    with pytest.raises(ValueError, match="strictly ascending"):
        fit_monotone_convex([1, 1, 2], [1, 2, 3])
    with pytest.raises(ValueError, match="finite"):
        fit_monotone_convex([1, 2], [1, np.nan])


def test_pool_adjacent_violators_is_isotonic_and_keeps_convexity():
    np.testing.assert_allclose(pool_adjacent_violators([1.0, 3.0, 2.0, 2.0, 5.0]), [1, 7 / 3, 7 / 3, 7 / 3, 5])
    table = np.array([[10, 12, 20], [9, 11, 19], [14, 18, 30], [13, 20, 29]], float)
    out = pool_adjacent_violators(table)
    assert (np.diff(out, axis=0) >= 0).all()
    assert all((np.diff(np.diff(r)) >= 0).all() and (np.diff(r) >= 0).all() for r in out)


def test_cost_model_fit_is_monotone_in_both_axes_and_convex_in_rows():
    rng = np.random.default_rng(2)
    rows, contexts = (1, 5, 9, 17, 33), (64, 256, 1024)
    measured = 20 + rng.uniform(0, 1, (3, 5)).cumsum(1) * 10 + rng.normal(0, 3, (3, 5))
    cost = CostModel.fit(contexts, rows, measured, [5.0, 4.0, 6.0], device="cpu", target="t", budget=32)
    v = np.asarray(cost.verify_ms)
    assert (np.diff(v, axis=0) >= -1e-9).all() and (np.diff(v, axis=1) >= -1e-9).all()
    assert all((np.diff(slopes(rows, r)) >= -1e-9).all() for r in v)
    np.testing.assert_allclose(cost.draft_ms, [4.5, 4.5, 6.0])
    assert cost.measured_verify_ms == tuple(map(tuple, measured.tolist()))


# -------------------------------------------------------------------------------- interpolation

HAND = CostModel(contexts=(100, 300), rows=(1, 5, 9), verify_ms=((10, 12, 20), (14, 18, 30)),
                 draft_ms=(3.0, 5.0), device="cpu", target="hand", budget=8)


@pytest.mark.parametrize("nodes, context, expected", [
    ((0, 2, 4, 8), 100, [10, 11, 12, 20]),  # on the context grid, interpolated in rows
    ((2,), 200, [13.5]),                    # between both grids: bilinear
    ((2,), 50, [11]),                       # below the first context: flat
    ((2,), 500, [21]),                      # above the last context: the last slope continues
    ((12,), 100, [28]),                     # beyond the last row: the last slope continues (2 ms/row)
])
def test_verify_cost_is_bilinear_flat_below_and_extrapolated_above(nodes, context, expected):
    np.testing.assert_allclose(HAND.verify_cost(nodes, context), expected)


def test_jitted_verify_cost_with_a_traced_context_matches_numpy_and_compiles_once():
    ladder = (1, 2, 4, 8, 16)

    @jax.jit
    def costs(context):
        return HAND.verify_cost(ladder, context), HAND.draft_cost(context)

    for c in (1, 60, 100, 171, 300, 999):
        got_v, got_d = costs(jnp.asarray(c, jnp.int32))
        np.testing.assert_allclose(got_v, HAND.verify_cost(ladder, c), rtol=1e-6)
        np.testing.assert_allclose(got_d, HAND.draft_cost(c), rtol=1e-6)
    assert costs._cache_size() == 1
    np.testing.assert_allclose(HAND.draft_cost(200), 4.0)


def test_cost_model_is_hashable_and_its_raw_measurements_count_in_equality():
    a = CostModel.fit((64,), (1, 5), [[10.0, 12.0]], [2.0], target="t")
    same = CostModel.fit((64,), (1, 5), [[10.0, 12.0]], [2.0], target="t")
    b = CostModel(contexts=a.contexts, rows=a.rows, verify_ms=a.verify_ms, draft_ms=a.draft_ms, target="t")
    assert b.measured_verify_ms is None and a.measured_verify_ms is not None
    assert a == same and hash(a) == hash(same)
    assert a != b  # the stop and the skip controller price rounds with the raw medians: another program


def test_measured_verify_cost_reads_the_raw_medians_where_the_fit_smooths_them():
    # concave over the small rungs, as on CPU: the convex fit lifts 2 rows above its median
    contexts, rows = (64, 256), (2, 3, 5, 9)
    measured = [[41.0, 48.0, 61.0, 70.0], [48.0, 51.0, 66.0, 72.0]]
    cost = CostModel.fit(contexts, rows, measured, [12.0, 10.0])
    ladder = (8, 4, 2, 1)
    assert cost.verify_cost(ladder, 64)[-1] > 41.0 + 1
    np.testing.assert_allclose(cost.measured_verify_cost(ladder, 64), [70, 61, 48, 41])
    np.testing.assert_allclose(cost.measured_verify_cost((1,), 160), [(41 + 48) / 2])
    traced = jax.jit(lambda c: cost.measured_verify_cost(ladder, c))(jnp.asarray(256, jnp.int32))
    np.testing.assert_allclose(traced, [72, 66, 51, 48], rtol=1e-6)
    bare = CostModel(contexts=contexts, rows=rows, verify_ms=cost.verify_ms, draft_ms=cost.draft_ms)
    np.testing.assert_allclose(bare.measured_verify_cost(ladder, 64), cost.verify_cost(ladder, 64))


def test_measured_verify_cost_never_falls_where_noisy_medians_do():
    # a dip in rows and a longer context measured faster: extrapolated raw, 4,096 would go negative
    cost = CostModel.fit((64, 256), (2, 3, 5), [[5.1, 5.3, 5.0], [4.9, 5.2, 5.4]], [1.2, 1.0])
    # rows (5.1, 5.15, 5.15), then the contexts pooled with (4.9, 5.2, 5.4)
    np.testing.assert_allclose(cost.monotone_verify_ms(), [[5.0, 5.175, 5.275]] * 2)
    far = cost.measured_verify_cost((1, 2, 4), 4096)
    assert np.all(far > 0) and np.all(np.diff(far) >= 0)
    np.testing.assert_allclose(far, cost.measured_verify_cost((1, 2, 4), 64))


@pytest.mark.parametrize("fields, message", [
    (dict(contexts=(), rows=(1,), verify_ms=(), draft_ms=()), "contexts"),
    (dict(contexts=(64,), rows=(5, 1), verify_ms=((1, 2),), draft_ms=(1,)), "rows"),
    (dict(contexts=(64,), rows=(1, 5), verify_ms=((1,),), draft_ms=(1,)), "verify_ms"),
    (dict(contexts=(64,), rows=(1,), verify_ms=((-1,),), draft_ms=(1,)), "verify_ms"),
    (dict(contexts=(64, 128), rows=(1,), verify_ms=((1,), (2,)), draft_ms=(1,)), "draft_ms"),
    (dict(contexts=(64, 128), rows=(1,), verify_ms=((1,), (2,)), draft_ms=(1, 1), step_ms=(1,)), "step_ms"),
])
def test_malformed_cost_model_is_one_sentence(fields, message):
    with pytest.raises(ValueError, match=message):
        CostModel(**fields)


# -------------------------------------------------------------------------------------- storage


def test_json_round_trip_is_atomic_and_keeps_the_measurements(tmp_path):
    cost = CostModel.fit((64, 256), (1, 3), [[10.0, 11.0], [12.0, 15.0]], [2.0, 3.0], device="cpu",
                         target="x.float32", budget=2)
    path = save_cost_model(cost, tmp_path / "sub" / "p.json")
    assert [p.name for p in path.parent.iterdir()] == ["p.json"]  # no partial file left behind
    back = load_cost_model(path)
    assert back == cost and back.measured_verify_ms == cost.measured_verify_ms
    assert back.measured_draft_ms == cost.measured_draft_ms and back.budget == 2
    assert back.step_ms is None
    with pytest.raises(ValueError, match="no one-row step cost"):
        back.step_cost(64)
    stepped = CostModel.fit((64, 256), (1, 3), [[10.0, 11.0], [12.0, 15.0]], [2.0, 3.0], [9.0, 8.0])
    assert stepped.step_ms == (8.5, 8.5)  # pooled: non-decreasing in context
    assert load_cost_model(save_cost_model(stepped, tmp_path / "s.json")).step_ms == (8.5, 8.5)
    np.testing.assert_allclose(stepped.step_cost(100), 8.5)
    assert stepped != cost  # the step cost changes decisions: it is part of equality


def test_corrupt_or_foreign_files_are_refused(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot be read as JSON"):
        load_cost_model(bad)
    bad.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError, match="is not a treespark-cost-model"):
        load_cost_model(bad)
    data = HAND.to_json()
    data["rows"] = [1]
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="malformed"):
        load_cost_model(bad)
    with pytest.raises(ValueError, match="does not exist"):
        load_cost_model(tmp_path / "missing.json")


def test_lookup_returns_the_stored_profile_else_the_shipped_default(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TREESPARK_CACHE", str(tmp_path))
    default = cost_store.default_cost_model()
    assert default == cost_store.DEFAULT_CPU_COST and default.device == "cpu"
    assert default.target == "smollm2-135m.float32"
    assert cost_model_for("cpu", "nothing.float32") == default
    with caplog.at_level(logging.WARNING):
        assert cost_model_for("NVIDIA H200", "nothing.bfloat16") == default
    assert "treespark profile" in caplog.text
    save_cost_model(HAND, profile_path("NVIDIA H200", "mine.bfloat16"))
    assert profile_path("NVIDIA H200", "mine.bfloat16") == tmp_path / "profiles" / "nvidia-h200" / "mine.bfloat16.json"
    assert cost_model_for("NVIDIA H200", "mine.bfloat16") == HAND
    assert target_id("/some/dir/My Model.gguf", "bfloat16") == "my-model.gguf.bfloat16"
    assert target_id("smollm2-135m") == "smollm2-135m.float32"


def test_shipped_default_is_a_fitted_profile_covering_the_cpu_budgets():
    cost = cost_store.DEFAULT_CPU_COST
    assert cost.rows == (2, 3, 5, 9, 17, 33) and len(cost.contexts) >= 2
    v = np.asarray(cost.verify_ms)
    assert (np.diff(v, axis=1) >= 0).all() and (np.diff(v, axis=0) >= 0).all()
    assert all((np.diff(slopes(cost.rows, r)) >= -1e-9).all() for r in v)
    # with the CPU kernels a one-row step and a two-row verify cost the same within the machine's
    # noise (22.3 and 22.7 ms at context 64, 23.0 and 22.7 at 256), so the step may exceed it by a little
    assert cost.step_ms is not None and all(0 < s < 1.1 * row[0] for s, row in zip(cost.step_ms, v))


# ------------------------------------------------------------------------------ profiler and CLI


def test_profile_rows_and_contexts_checks():
    assert profile_rows(32) == (2, 3, 5, 9, 17, 33) and profile_rows(1) == (2,)
    assert profile_rows(12) == (2, 3, 4, 7, 13)  # rungs of 12, 6, 3 and 1
    check_profile_args(16, (64, 256), 1)
    for bad, words in (((), "at least one context"), ((256, 64), "ascending"), ((8, 8), "ascending"),
                       ((0, 8), "contexts=0,8 must each be at least 1")):
        with pytest.raises(ValueError, match=words):
            check_profile_args(16, bad, 1)


def test_profile_contexts_are_committed_tokens_with_room_for_the_verify_rows():
    check_profile_args(16, (1, 8175), 1, 8192)  # 8175 + 17 rows = 8192 positions
    with pytest.raises(ValueError, match="contexts=1,8176 reach 8176 tokens, which with the 17 verify rows of "
                                         "budget 16 pass the model's 8192 positions"):
        check_profile_args(16, (1, 8176), 1, 8192)
    with pytest.raises(ValueError, match="contexts=0,64 must each be at least 1"):
        check_profile_args(16, (0, 64), 1)


def test_profile_cost_on_a_tiny_target_writes_a_loadable_profile(tmp_path):
    model = tiny_decoder("llama", dtype=jnp.float32)
    cost = profile_cost(model, target="tiny.float32", budget=1, contexts=(16,), repeats=1)
    assert cost.rows == (2,) and cost.contexts == (16,) and cost.budget == 1
    assert cost.device == jax.devices()[0].device_kind and all(d > 0 for d in cost.draft_ms)
    assert len(cost.step_ms) == 1 and cost.step_ms[0] > 0
    assert load_cost_model(save_cost_model(cost, tmp_path / "tiny.json")) == cost


def test_profile_command_writes_the_profile_and_prints_the_table(tmp_path, monkeypatch, capsys):
    from treespark_jax.models import load

    model = tiny_decoder("llama", dtype=jnp.float32)
    monkeypatch.setattr(load, "load_target", lambda name, dtype: load.Target(
        name=name, path=tmp_path, cfg=model.cfg, model=model, tokenizer=None))
    monkeypatch.setenv("TREESPARK_CACHE", str(tmp_path))
    assert main(["profile", "--target", str(tmp_path / "tiny"), "--budget", "1", "--contexts", "12",
                 "--repeats", "1"]) == 0
    out = capsys.readouterr()
    assert "ctx 12" in out.out and "draft" in out.out and "1 row" in out.out
    stored = load_cost_model(profile_path(jax.devices()[0].device_kind, "tiny.float32"))
    assert stored.target == "tiny.float32" and stored.rows == (2,) and str(tmp_path) in out.err


def test_profile_command_times_the_drafter_it_is_given(tmp_path, monkeypatch):
    """--drafter PATH times that drafter's round; 'random' and a target without a shipped
    drafter time ``profile_drafter`` (``drafter=None``)."""
    from flax import nnx

    from treespark_jax.bench import profile as prof
    from treespark_jax.config import DrafterConfig
    from treespark_jax.drafter import checkpoint
    from treespark_jax.drafter.model import BlockDrafter
    from treespark_jax.models import load

    model = tiny_decoder("llama", dtype=jnp.float32)
    monkeypatch.setattr(load, "load_target", lambda name, dtype: load.Target(
        name=name, path=tmp_path, cfg=model.cfg, model=model, tokenizer=None))
    drafter = BlockDrafter(DrafterConfig(target_layer_ids=(0, 2), block_size=4, pool_size=16, markov_rank=4,
                                         edge_head=True, draft_vocab=32), model.cfg, rngs=nnx.Rngs(0),
                           dtype=model.dtype)
    loaded = []
    monkeypatch.setattr(checkpoint, "load_drafter", lambda path, target, dtype: loaded.append(path) or (drafter, None))
    timed, real = [], prof.profile_cost
    monkeypatch.setattr(prof, "profile_cost", lambda *a, **k: timed.append(k["drafter"]) or real(*a, **k))
    monkeypatch.setenv("TREESPARK_CACHE", str(tmp_path))
    args = ["profile", "--target", str(tmp_path / "tiny"), "--budget", "1", "--contexts", "12", "--repeats", "1"]
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "drafter.json").write_text("{}")  # marks our format for formats.detect; the load is stubbed
    assert main(args + ["--drafter", str(tmp_path / "mine")]) == 0
    assert loaded == [str(tmp_path / "mine")] and timed[0] is drafter
    assert main(args + ["--drafter", "random"]) == 0 and main(args) == 0
    assert timed[1:] == [None, None] and len(loaded) == 1


@pytest.mark.parametrize("flags, message", [
    (["--contexts", "64,x"], "--contexts '64,x' must be comma-separated integers"),
    (["--contexts", "64,,256"], "--contexts '64,,256' has an empty entry"),
    (["--contexts", "256,64"], "--contexts 256,64 must be in strictly ascending order"),
    (["--contexts", "0,64"], "--contexts 0,64 must each be at least 1 committed token"),
    (["--budget", "0"], "--budget 0 must be a whole number of drafted nodes between 1 and 1024"),
    (["--repeats", "0"], "--repeats 0 must be at least 1"),
    (["--json-out", "/nonexistent-folder/x.json"], "--json-out /nonexistent-folder/x.json: its folder does not exist"),
    (["--json-out", "."], "--json-out . is a directory; give a file path"),
])
def test_profile_bad_input_is_one_sentence_and_exit_2(capsys, flags, message):
    assert main(["profile"] + flags) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("treespark profile: error: ") and message in err and "\n" not in err


def test_the_stop_reads_the_raw_medians_for_deterministic_trees_and_the_fit_for_sampled_ones():
    cost = CostModel.fit((64, 256), (2, 3, 5, 9), [[41.0, 48.0, 61.0, 70.0], [48.0, 51.0, 66.0, 72.0]], [12.0, 10.0])
    spec = Speculation(PromptLookup(vocab_size=16), TreeConfig(budget=8, max_depth=4, branch=2), verify="rejection",
                       cost_aware_stop=True, skip_drafting=False)
    assert plan_round(spec, False, cost).ladder == (1, 2, 4, 8)
    raw, fit = [41.0, 48.0, 61.0, 70.0], cost.verify_cost((1, 2, 4, 8), 64)
    assert not np.allclose(raw, fit)
    np.testing.assert_allclose(plan_round(spec, True, cost).stop_verify_cost(64), raw)
    match = dataclasses.replace(spec, verify="match")  # deterministic children at temperature > 0
    np.testing.assert_allclose(plan_round(match, False, cost).stop_verify_cost(64), raw)
    np.testing.assert_allclose(plan_round(spec, False, cost).stop_verify_cost(64), fit)
