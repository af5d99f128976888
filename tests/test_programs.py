"""The bound on live decode programs: released least recently used, freeing their mapped memory."""

import pytest

from treespark_jax.config import TreeConfig
from treespark_jax.decode import programs
from treespark_jax.decode.engine import Engine
from treespark_jax.decode.plan import Speculation
from treespark_jax.testing.random_proposer import RandomProposer

from specs import spec
from tiny import SPEC_PROMPTS, tiny_decoder

BUDGETS = (2, 3, 4, 5, 6)


@pytest.fixture(scope="module")
def engine(x64):
    return Engine(tiny_decoder("qwen3", seed=1), stop_ids=[])


def _spec(budget: int) -> Speculation:
    return spec(RandomProposer(97, 6, 16, 4), TreeConfig(budget=budget, max_depth=6, branch=2,
                                                         builder="parent_conditioned"))


def _release_all() -> None:
    while programs.release_oldest():
        pass
    assert programs.live() == 0


def test_settings_emptied_by_jax_clear_caches_do_not_stop_the_release(engine):
    """``jax.clear_caches`` (the test suite calls it between modules) empties settings that stay
    listed; releasing must go past them to the settings compiled since."""
    import jax

    engine.generate(SPEC_PROMPTS, 8, spec=_spec(BUDGETS[0]))
    jax.clear_caches()
    engine.generate(SPEC_PROMPTS, 8, spec=_spec(BUDGETS[1]))
    assert programs.live() == 2
    _release_all()


@pytest.mark.skipif(programs.mapped_regions() is None, reason="counts memory regions in /proc/self/maps")
def test_releasing_programs_frees_their_memory_regions(engine, monkeypatch):
    monkeypatch.setattr(programs, "region_limit", lambda: None)  # nothing released on its own
    _release_all()
    before = programs.mapped_regions()
    for b in BUDGETS:
        engine.generate(SPEC_PROMPTS, 8, spec=_spec(b))
    assert programs.live() == 2 * len(BUDGETS)  # a prefill and a round program per budget
    grown = programs.mapped_regions() - before
    assert grown > 20 * len(BUDGETS), grown
    _release_all()
    assert programs.live() == 0
    assert programs.mapped_regions() - before < grown / 4, (programs.mapped_regions() - before, grown)


def test_past_the_limit_the_least_recently_used_are_released_and_output_is_unchanged(engine, monkeypatch):
    budgets = BUDGETS[:3]
    ar, _ = engine.generate(SPEC_PROMPTS, 20)
    want = [engine.generate(SPEC_PROMPTS, 20, spec=_spec(b))[0] for b in budgets]
    assert all(w == ar for w in want)
    _release_all()
    compiled = programs.compiled()
    monkeypatch.setattr(programs, "region_limit", lambda: 0)  # always over: keep only the newest program
    for _ in range(2):  # every call compiles again what the previous ones released
        for b, w in zip(budgets, want):
            ids, _ = engine.generate(SPEC_PROMPTS, 20, spec=_spec(b))
            assert ids == w
            assert programs.live() == 1  # the round program just compiled; its prefill was released
    assert programs.compiled() == compiled + 2 * 2 * len(budgets)


def test_within_the_limit_nothing_is_released(engine):
    _release_all()
    for b in BUDGETS[:2]:
        engine.generate(SPEC_PROMPTS, 8, spec=_spec(b))
    engine.generate(SPEC_PROMPTS, 8, spec=_spec(BUDGETS[0]))
    assert programs.live() == 4
    _, stats = engine.generate(SPEC_PROMPTS, 8, spec=_spec(BUDGETS[1]))
    assert stats.compiles == 0
