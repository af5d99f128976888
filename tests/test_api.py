"""The Python API keeps what a call builds: a second ``generate`` with the same settings compiles
nothing, binds no drafter and places no weights; new settings, a new sampling mode or retrained
drafter weights get their own session."""

from __future__ import annotations

import numpy as np
import pytest

import treespark_jax as ts
from treespark_jax.decode import jitted
from treespark_jax.decode.engine import Engine
from treespark_jax.drafter.block_proposer import BlockProposer

from tiny import write_tiny_hf_target

PROMPT = "abc abc abc"


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    path = write_tiny_hf_target(tmp_path_factory.mktemp("api") / "hf", layers=8, d=48, mlp=80, head_dim=16,
                                max_positions=512)
    return ts.load(str(path))


@pytest.fixture()
def calls(monkeypatch):
    """Counts the drafter bindings (``BlockProposer.create``) and weight placements
    (``Engine.place``) made while a test runs."""
    counts = {"bind": 0, "place": 0}
    create, place = BlockProposer.create.__func__, Engine.place

    def counting_create(cls, *args, **kwargs):
        counts["bind"] += 1
        return create(cls, *args, **kwargs)

    def counting_place(self, weights):
        counts["place"] += 1
        return place(self, weights)

    monkeypatch.setattr(BlockProposer, "create", classmethod(counting_create))
    monkeypatch.setattr(Engine, "place", counting_place)
    return counts


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_second_generate_compiles_nothing_binds_no_drafter_and_places_no_weights(lm, calls, temperature):
    settings = dict(method="dspark", budget=4, drafter="random", max_new_tokens=12, temperature=temperature)
    first = lm.generate(PROMPT, **settings)
    assert calls == {"bind": 1, "place": 1}  # the session's: the drafter bound and placed once
    again = lm.generate(PROMPT, **settings)
    assert again.stats.compiles == 0 and calls == {"bind": 1, "place": 1}
    assert again.token_ids == first.token_ids  # same seed, same output
    streamed = "".join(lm.stream(PROMPT, **settings))  # stream shares generate's session
    assert calls == {"bind": 1, "place": 1} and streamed == first.text


def test_new_settings_or_sampling_mode_get_their_own_session(lm):
    settings = ts.GenerationConfig(method="dspark", budget=4, drafter="random")
    greedy = lm.session(settings)
    assert lm.session(method="dspark", budget=4, drafter="random") is greedy
    assert lm.session(settings, max_new_tokens=7, top_p=0.5, seed=3) is greedy  # not a session's settings
    assert lm.session(settings, temperature=0.7) is not greedy
    assert lm.session(settings, temperature=0.7) is lm.session(settings, temperature=1.3)  # one sampling mode
    assert lm.session(settings, budget=8) is not greedy
    assert lm.session(settings, cost_aware_stop=False) is not greedy
    assert lm.session(method="ar") is lm.session(method="ar") and lm.session(method="ar").spec is None


def test_a_drafter_object_is_bound_again_when_its_weights_change(lm, calls):
    drafter = lm.drafter("dspark", "random")
    session = lm.session(method="dspark", budget=4, drafter=drafter)
    # "random" was bound
    assert lm.session(method="dspark", budget=4, drafter=drafter) is session and calls["bind"] == 0
    drafter.mask_embed[...] = drafter.mask_embed[...] + 1.0  # a new array, as a training step makes
    retrained = lm.session(method="dspark", budget=4, drafter=drafter)
    assert retrained is not session and calls["bind"] == 1
    np.testing.assert_array_equal(retrained.spec.proposer.weights.params["mask_embed"][...], drafter.mask_embed[...])


def test_warmup_from_shapes_leaves_nothing_to_compile(lm):
    session = lm.session(method="dspark", budget=4, drafter="random", temperature=1.0)
    before = jitted.compiled_programs()
    compiled = session.warmup(batch=1, prompt_len=20, max_new_tokens=40)
    assert compiled == jitted.compiled_programs() - before
    result = lm.generate("x" * 17, method="dspark", budget=4, drafter="random", temperature=0.5, max_new_tokens=33)
    assert result.stats.compiles == 0  # same buckets: 1 row, prompt 32, output 64


def test_a_session_refuses_a_temperature_of_the_other_mode(lm):
    with pytest.raises(ValueError, match="temperature 0.5 does not fit this session, which decodes greedily"):
        lm.session(method="ar").generate([[1, 2]], 4, temperature=0.5)
