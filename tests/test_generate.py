"""Autoregressive generation: greedy equals a cache-free reference, EOS, caps, compiles, errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from treespark_jax.decode import programs
from treespark_jax.decode.buckets import RequestShape, prompt_bucket
from treespark_jax.decode.engine import Engine
from treespark_jax.decode.prefill import prefill_mask
from treespark_jax.models.kv_cache import KVCache

from tiny import tiny_decoder

PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11, 12, 13], [7]]


@pytest.fixture(scope="module")
def model(x64):
    return tiny_decoder("qwen3", seed=1)


@functools.partial(jax.jit, static_argnames="graphdef")
def _next_token(graphdef, weights, tokens, length):
    """The greedy token after the first ``length`` of ``tokens [1, T]``, recomputed from scratch
    over a fresh cache (causal: the padding after ``length`` is never seen)."""
    model, t = nnx.merge(graphdef, weights), tokens.shape[1]
    out = model(tokens, jnp.arange(t)[None], prefill_mask(length[None], t, t), KVCache.zeros(model.cfg, 1, t, model.dtype))
    return jnp.argmax(model.logits(out.hidden)[0, length - 1])


def reference_greedy(model, prompt, n):
    """Greedy decoding that recomputes the whole sequence every step (no KV cache)."""
    graphdef, weights = nnx.split(model)
    toks = np.zeros((1, 32), np.int32)
    toks[0, :len(prompt)] = prompt
    for t in range(len(prompt), len(prompt) + n):
        toks[0, t] = _next_token(graphdef, weights, jnp.asarray(toks), jnp.asarray(t))
    return toks[0, len(prompt):len(prompt) + n].tolist()


def test_greedy_batch_equals_cache_free_reference(model):
    ids, stats = Engine(model, stop_ids=[]).generate(PROMPTS, 12)
    for prompt, got in zip(PROMPTS, ids):
        assert got == reference_greedy(model, prompt, 12)
    assert stats.new_tokens == 36 and stats.target_forwards == 12


def test_eos_ends_only_its_row_and_is_emitted_last(model):
    free, _ = Engine(model, stop_ids=[]).generate(PROMPTS, 12)
    stop = free[0][4]
    assert stop not in free[0][:4]
    ids, stats = Engine(model, stop_ids=[stop]).generate(PROMPTS, 12)
    assert ids[0] == free[0][:5]
    for got, ref in zip(ids[1:], free[1:]):
        cut = ref.index(stop) + 1 if stop in ref else len(ref)
        assert got == ref[:cut]
    assert stats.new_tokens == sum(len(x) for x in ids)


@pytest.mark.parametrize("n", [1, 5, 17])
def test_max_new_tokens_is_exact(model, n):
    ids, _ = Engine(model, stop_ids=[]).generate(PROMPTS, n)
    assert [len(x) for x in ids] == [n] * len(PROMPTS)


def test_decode_loop_compiles_once_for_256_tokens_and_prefill_once_per_bucket(model):
    eng = Engine(model, stop_ids=[])
    eng.generate([[3, 1, 4]], 256)  # warm: one prefill and one loop program for these buckets
    ids, stats = eng.generate([[2, 7, 1, 8, 2, 8]], 256)  # other length, same prompt bucket
    assert len(ids[0]) == 256 and stats.target_forwards == 256
    assert stats.compiles == 0


def test_a_session_compiles_once_per_request_shape_whatever_the_lengths(model):
    """The rule the README states: a session's prefill is compiled once per ``RequestShape``
    (batch, prompt and output buckets, cache capacity) and its decode loop once per
    ``RequestShape.loop``; prompts and ``max_new_tokens`` of shapes already seen compile nothing."""
    while programs.release_oldest():  # start from nothing compiled
        pass
    session = Engine(model, stop_ids=[]).session()
    shapes, loops = set(), set()
    for prompt_len, max_new in [(3, 17), (16, 32), (5, 20), (17, 20), (3, 33), (3, 64), (9, 1), (2, 16), (100, 16)]:
        shape = RequestShape.of(1, prompt_len, max_new)
        ids, stats = session.generate([[1] * prompt_len], max_new)
        want = (shape not in shapes) + (shape.loop not in loops)
        assert len(ids[0]) == max_new and stats.compiles == want, (prompt_len, max_new, want)
        shapes.add(shape)
        loops.add(shape.loop)
    # (prompt, output) buckets 16/32, 32/32, 16/64, 16/16 share a 128-slot cache, whose loop
    # only the output bucket tells apart; the 128-token prompt bucket needs a 256-slot cache.
    assert (len(shapes), len(loops)) == (5, 4)


def test_prompt_buckets_are_powers_of_two_then_half_octaves_above_128():
    """What the README states: a power of two of at least 16, above 128 tokens also three quarters of one."""
    got = {n: prompt_bucket(n) for n in (1, 16, 17, 100, 128, 129, 161, 192, 193, 256, 257, 384, 385, 700)}
    assert got == {1: 16, 16: 16, 17: 32, 100: 128, 128: 128, 129: 192, 161: 192, 192: 192, 193: 256, 256: 256,
                   257: 384, 384: 384, 385: 512, 700: 768}


def test_warmup_compiles_ahead_so_requests_do_not(model):
    eng = Engine(model, stop_ids=[])
    session = eng.session(greedy=False)
    assert session.warmup(batch=2, prompt_len=40, max_new_tokens=30) == 2  # prefill and loop, from shapes
    _, stats = session.generate([[1] * 33, [2] * 50], 30, temperature=0.5)  # same buckets: 2 rows, 64, 32
    assert stats.compiles == 0
    assert session.warmup(batch=2, prompt_len=40, max_new_tokens=30) == 0


def test_sampling_row_does_not_depend_on_its_batch(model):
    eng = Engine(model, stop_ids=[])
    batch, _ = eng.generate(PROMPTS, 10, temperature=1.0, top_p=0.9, seed=[11, 12, 13])
    alone, _ = eng.generate([PROMPTS[1]], 10, temperature=1.0, top_p=0.9, seed=[12])
    assert batch[1] == alone[0]
    other, _ = eng.generate([PROMPTS[1]], 10, temperature=1.0, top_p=0.9, seed=[99])
    assert other[0] != alone[0]


def test_stream_yields_the_same_tokens_as_generate(model):
    eng = Engine(model, stop_ids=[])
    chunks = list(eng.stream(PROMPTS[1], 20))
    assert len(chunks) > 1
    assert sum(chunks, []) == eng.generate([PROMPTS[1]], 20)[0][0]


def test_the_largest_seeds_run_in_a_padded_batch(model):
    eng = Engine(model, stop_ids=[])  # 3 prompts pad to 4 rows; row 3 would have seed 2**32
    outs, _ = eng.generate([[1, 2], [3], [4, 5]], 4, temperature=1.0, seed=2**32 - 3)
    assert [len(o) for o in outs] == [4, 4, 4]


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompts=[[]]), "the prompt is empty"),
    (dict(prompts=[[1, 2], []]), "prompt 1 is empty"),
    (dict(prompts=[[1] * 500]), "more than the model's context of 512 tokens"),
    (dict(max_new_tokens=0), "max_new_tokens=0 must be at least 1"),
    (dict(temperature=-0.5), "temperature -0.5 is negative"),
    (dict(top_p=0.0), "top_p=0.0 is outside (0, 1]"),
    (dict(top_p=1.5), "top_p=1.5 is outside (0, 1]"),
    (dict(seed=-1), "seed -1 is outside 0..4294967295"),
    (dict(prompts=[[1, 2], [3]], seed=2**32 - 1), "seed 4294967296 is outside 0..4294967295"),  # row 1: seed + 1
    (dict(seed=[7, 2**32]), "seed 4294967296 is outside"),
])
def test_bad_requests_raise_one_sentence(model, kwargs, message):
    args = dict(prompts=[[1, 2]], max_new_tokens=20, temperature=0.0, top_p=1.0, seed=0) | kwargs
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Engine(model, stop_ids=[]).generate(**args)
