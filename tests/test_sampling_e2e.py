"""Batched end-to-end sampling exactness: speculative ``Engine.generate`` against the exact law.

The whole decode path runs as a user runs it (prefill, proposer, tree builder, verify ladder,
acceptance rule, commit, length cap) on a tiny float32 target with a 24-token vocabulary, for
``ROWS = 32,768`` independent requests (one seed each, ``CALL_ROWS`` rows per ``generate`` call)
of ``max_new_tokens = 3`` from one fixed prompt. The first generated token comes from prefill in
every path; the speculative machinery decides generated tokens 2 and 3 (the first verify round,
or the first two rounds when the first accepts no draft).

The oracle is exact: ``P(t1)``, ``P(t2 | t1)`` and ``P(t3 | t1, t2)`` come from cache-free
forwards of the same model over every continuation (``1 + V + V²`` sequences), processed with an
independent float64 numpy temperature / nucleus reference; ``t1`` is marginalised out.

Two Pearson chi-square goodness-of-fit tests per case, against the exact law:

- token 2 alone: one cell per token; cells expected below 5 are lumped (df ≤ 23);
- tokens 2 and 3 jointly: the ``PAIR_CELLS`` most probable pairs each get a cell and the rest
  share one (df = 30).

False-alarm rate: each test rejects an exact sampler with probability ``ALPHA = 1e-3`` (so at
most 2e-3 per case and 1.4e-2 for the seven cases; the seeds are fixed, so a pass stays a pass).

Power: for any law of the tested cells at total-variation distance ``TV_ERROR = 0.02`` or more
from the exact one, the chi-square divergence is at least ``4·TV²`` (Cauchy-Schwarz), so the
Pearson statistic is asymptotically noncentral chi-square with ``λ ≥ 4·ROWS·0.02² = 52.4``; the
power ``ncx2.sf(chi2.isf(ALPHA, df), df, λ)`` is 0.958 at df = 23 and 0.927 at df = 30, and the
test asserts it is at least ``MIN_POWER = 0.9`` for the df it actually uses. (TV on the tested
cells: lumping cells can only shrink a distance.)

Besides the statistics, a generated triple the exact law gives probability 0 (a token outside
the nucleus) fails outright, and each speculative case must accept drafts often enough to test
anything (τ well above 1).

Controls: plain autoregressive sampling goes through the same tests at both settings.

Teeth (checked when this test was written, by monkeypatching the library in a throwaway
script; the smaller of a case's two p-values): recursive rejection not removing earlier siblings
from ``q^(j)`` fails the three rejection cases (p < 1e-40), the bonus drawn from ``p`` instead
of the residual fails them (p < 1e-240), rejection reading the neighbouring row's Proposal fails
them at temperature 1 (p ≈ 0), a builder that scores a sampled child by its own token
(anticipating) fails them at temperature 1 (p ≤ 3e-12; at 0.8 / top-p 0.9 it passes, its bias
there below what 32,768 rows resolve), and a match-rule bonus that may repeat a child fails
both match cases (p < 1e-150).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from treespark_jax.config import TreeConfig
from treespark_jax.decode.cost_model import CostModel
from treespark_jax.decode.cost_store import DEFAULT_CPU_COST
from treespark_jax.decode.engine import Engine
from treespark_jax.decode.prefill import prefill_mask
from treespark_jax.drafter.prompt_lookup import PromptLookup
from treespark_jax.models.kv_cache import KVCache
from treespark_jax.testing.random_proposer import RandomProposer

from specs import spec
from tiny import tiny_decoder

# Slow: every speculative case compiles its own prefill and decode programs (5–15 s, the
# treespark verify ladder most) and every case samples 32,768 requests (~10 s); the module takes
# ~85 s on 2 shared CPU cores (up to ~3 min when other jobs load them).
pytestmark = pytest.mark.slow

V = 24  # small enough that the pool (16) covers most of it and drafts are often accepted
# Smaller than tiny.TINY_FIELDS (the batch of 32,768 rows dominates the cost); head dim 24 still
# differs from width / heads = 16, and the Qwen3 q/k norms are on.
MODEL_FIELDS = dict(vocab_size=V, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=24, mlp_dim=48)
PROMPT = [7, 10, 22, 17, 17, 2, 19, 22, 11, 22, 16, 14, 12, 17]  # tokens repeat: prompt lookup drafts
MAX_NEW = 3

ROWS = 32_768
CALL_ROWS = 8_192  # requests per generate call (a power of two: no padded batch rows)
ALPHA = 1e-3
TV_ERROR = 0.02
MIN_POWER = 0.9
MIN_EXPECTED = 5  # Cochran's rule for the chi-square approximation
PAIR_CELLS = 30  # pair cells tested one by one; the rest are lumped (df = PAIR_CELLS)

TREE = dict(budget=8, max_depth=3, branch=3)  # depth 3 > what the cap keeps: truncation is exercised


@dataclasses.dataclass(frozen=True)
class FewProposals(RandomProposer):
    """The ``random`` proposer restricted to a few fixed Proposals, one picked per row and round.

    With a fresh random Proposal per row, pools are uniformly random token sets, and averaged
    over them a broken rule can look exact (a match-rule bonus that may repeat a child, for one,
    averages back to the target); with a few fixed Proposals a broken rule is pulled towards
    their tokens. Rows still get different Proposals (picked from the row's own key, a stream
    no rule reads), so a rule that read another row's Proposal would show too. Children are
    sampled per row by the builder as usual.
    """

    proposal_seeds: tuple[int, ...] = (0,)

    def propose(self, state, anchor, keys):
        n = len(self.proposal_seeds)
        # Purpose 101: a stream of the round key that the builder and the rules never fold in.
        pick = jax.vmap(lambda k: jax.random.randint(jax.random.fold_in(k, 101), (), 0, n))(keys)
        seeds = jnp.asarray(self.proposal_seeds, jnp.uint32)[pick]
        return super().propose(state, anchor, jax.vmap(jax.random.key)(seeds))


# Seeds 65 and 182: the depth-1 draft of each overlaps the target by Σ min(p, q) ≈ 0.4, so most
# rounds exercise acceptances and rejections alike (τ ≈ 1.5 at both settings). Pools of 16 leave 8
# tokens outside each depth's pool, the residual's off-pool lump.
FEW = FewProposals(V, block_size=4, pool_size=16, markov_rank=4, proposal_seeds=(65, 182))

CASES = {  # name: (speculation or None for AR, temperature, top_p)
    "ar": (None, 1.0, 1.0),
    "ar-temp0.8-top_p0.9": (None, 0.8, 0.9),
    "rejection-treespark": (spec(FEW, TreeConfig(**TREE, builder="treespark"), cost_aware_stop=True), 1.0, 1.0),
    "rejection-parent_conditioned": (
        spec(FEW, TreeConfig(**TREE, builder="parent_conditioned")), 1.0, 1.0),
    "rejection-treespark-temp0.8-top_p0.9": (
        spec(FEW, TreeConfig(**TREE, builder="treespark"), cost_aware_stop=True), 0.8, 0.9),
    "match-parent_conditioned": (
        spec(FEW, TreeConfig(**TREE, builder="parent_conditioned"), verify="match"), 1.0, 1.0),
    # Draft skipping where drafting never pays: round 1 drafts, round 2 is a target step, round 3
    # drafts again (a probe), so emitted tokens mix both kinds of round.
    "rejection-treespark-skipping": (spec(FEW, TreeConfig(**TREE, builder="treespark"), cost_aware_stop=True,
                                          skip_drafting=True), 1.0, 1.0),
    "match-prompt_lookup-chain": (
        spec(PromptLookup(V, block_size=4), TreeConfig(budget=3, max_depth=3, branch=1, builder="chain"),
             verify="match"), 1.0, 1.0),
}


NEVER_PAYS = CostModel(contexts=(1, 4096), rows=(2, 3), verify_ms=((1.0, 1.0), (1.0, 1.0)), draft_ms=(1.0, 1.0),
                       step_ms=(1e-3, 1e-3))
COSTS = {"rejection-treespark-skipping": NEVER_PAYS}  # others: the shipped CPU profile


@pytest.fixture(scope="module")
def model():
    return tiny_decoder("qwen3", seed=1, dtype=jnp.float32, **MODEL_FIELDS)


def processed(logits: np.ndarray, temperature: float, top_p: float) -> tuple[np.ndarray, float]:
    """Independent float64 temperature + nucleus reference (Holtzman et al. 2020).

    Returns the probabilities ``[..., V]`` and the smallest distance between ``top_p`` and the
    mass before any token (a token on the nucleus border could flip in float32).
    """
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    if top_p >= 1:
        return p, np.inf
    order = np.argsort(-p, axis=-1, kind="stable")
    sorted_p = np.take_along_axis(p, order, -1)
    before = np.cumsum(sorted_p, -1) - sorted_p
    keep = np.zeros(p.shape, bool)
    np.put_along_axis(keep, order, before < top_p, -1)
    p = np.where(keep, p, 0.0)
    return p / p.sum(-1, keepdims=True), float(np.abs(before - top_p).min())


@pytest.fixture(scope="module")
def logits_tree(model) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Next-token logits, without a KV cache, after the prompt ``[V]``, after every ``t1``
    ``[V, V]`` and after every ``(t1, t2)`` ``[V, V, V]`` (one right-padded batch)."""
    n = len(PROMPT)
    seqs = [PROMPT] + [PROMPT + [a] for a in range(V)] + [PROMPT + [a, b] for a in range(V) for b in range(V)]
    lens = jnp.asarray([len(s) for s in seqs])
    tokens = jnp.asarray([s + [0] * (n + 2 - len(s)) for s in seqs], jnp.int32)
    b, t = tokens.shape
    out = model(tokens, jnp.broadcast_to(jnp.arange(t), (b, t)), prefill_mask(lens, t, t),
                KVCache.zeros(model.cfg, b, t, model.dtype))
    last = np.asarray(model.logits(out.hidden))[np.arange(b), np.asarray(lens) - 1]
    return last[0], last[1: 1 + V], last[1 + V:].reshape(V, V, V)


def exact_law(logits_tree, temperature: float, top_p: float) -> np.ndarray:
    """``[V, V, V]`` float64 exact joint law of the first three generated tokens."""
    laws, margins = zip(*(processed(lg, temperature, top_p) for lg in logits_tree))
    # A token within 1e-5 of the nucleus border could be kept by float32 and dropped in float64.
    assert min(margins) > 1e-5, "pick another prompt: a token sits on the nucleus border"
    p1, p2, p3 = laws
    return p1[:, None, None] * p2[:, :, None] * p3


def lumped_cells(probs: np.ndarray, n: int, max_single: int | None = None) -> np.ndarray:
    """Cell index per category: the most probable categories expected ≥ ``MIN_EXPECTED`` times
    (at most ``max_single``) get a cell each, in order; all others share the last cell, which is
    merged into the smallest single cell if it would be expected fewer than ``MIN_EXPECTED`` times."""
    order = np.argsort(-probs, kind="stable")
    single = int(np.sum(n * probs >= MIN_EXPECTED))
    if max_single is not None:
        single = min(single, max_single)
    cell = np.full(probs.shape, single, np.int64)
    cell[order[:single]] = np.arange(single)
    if n * probs[order[single:]].sum() < MIN_EXPECTED:
        cell[order[single:]] = single - 1
    return cell


def chi_square(samples: np.ndarray, probs: np.ndarray, max_single: int | None = None
               ) -> tuple[float, int, float]:
    """Pearson test of category ``samples`` against ``probs`` after lumping: (p-value, df, power)."""
    n = samples.size
    cell = lumped_cells(probs, n, max_single)
    bins = cell.max() + 1
    observed = np.bincount(cell[samples], minlength=bins)
    expected = n * np.bincount(cell, weights=probs, minlength=bins)
    assert expected.min() >= MIN_EXPECTED
    df = bins - 1
    pvalue = stats.chisquare(observed, expected).pvalue
    power = stats.ncx2.sf(stats.chi2.isf(ALPHA, df), df, 4 * n * TV_ERROR**2)
    return pvalue, df, power


def sample(model, spec, temperature, top_p, first_seed, cost=DEFAULT_CPU_COST):
    """``[ROWS, 3]`` generated tokens, one request (and seed) per row, the τ of every call and the
    rounds that skipped drafting."""
    engine = Engine(model, stop_ids=[], cost=cost)
    out, taus, skipped = [], [], 0
    for start in range(0, ROWS, CALL_ROWS):
        seeds = list(range(first_seed + start, first_seed + start + CALL_ROWS))
        ids, gen_stats = engine.generate([PROMPT] * CALL_ROWS, MAX_NEW, temperature=temperature, top_p=top_p,
                                         seed=seeds, spec=spec)
        assert all(len(row) == MAX_NEW for row in ids)
        out.append(np.asarray(ids))
        taus.append(gen_stats.tau)
        skipped += gen_stats.skipped_rounds
    return np.concatenate(out), taus, skipped


@pytest.mark.parametrize("case", list(CASES))
def test_generated_tokens_follow_the_target(model, logits_tree, case):
    spec, temperature, top_p = CASES[case]
    assert_follows_the_target(model, logits_tree, case, spec, temperature, top_p,
                              first_seed=1_000_000 * (list(CASES).index(case) + 1))


@pytest.fixture(scope="module")
def imported_dflash(model, tmp_path_factory):
    """A z-lab DFlash drafter for ``model`` built and saved by the ``dflash`` package (test oracle), imported."""
    from format_oracles import zlab_drafter
    from tiny import TINY_FIELDS

    from treespark_jax.drafter import formats

    path = tmp_path_factory.mktemp("zlab") / "drafter"
    zlab_drafter(path, layer_ids=(0,), block_size=4, fields=dict(TINY_FIELDS, **MODEL_FIELDS))
    return formats.read(path).to_drafter(model.cfg)


@pytest.mark.parity
@pytest.mark.parametrize("builder", ["marginal", "treespark"])
def test_an_imported_dflash_drafter_samples_the_target_under_the_match_rule(model, logits_tree, imported_dflash,
                                                                             builder):
    from treespark_jax.drafter.block_proposer import BlockProposer

    proposer = BlockProposer.create(imported_dflash, model, depth=3)  # a block of 4 drafts 3 (DFlash's anchor)
    assert_follows_the_target(model, logits_tree, f"imported-dflash-{builder}",
                              spec(proposer, TreeConfig(**TREE, builder=builder), verify="match"), 1.0, 1.0,
                              first_seed=50_000_000 + 1_000_000 * (builder == "treespark"))


def assert_follows_the_target(model, logits_tree, case, spec, temperature, top_p, first_seed):
    """Samples ``ROWS`` requests with ``spec`` and tests them against the exact law (module docstring)."""
    law = exact_law(logits_tree, temperature, top_p)
    tokens, taus, skipped = sample(model, spec, temperature, top_p, first_seed=first_seed,
                                   cost=COSTS.get(case, DEFAULT_CPU_COST))
    if case in COSTS:
        assert skipped >= ROWS // 2, skipped  # most rows have a skipped round
    t1, t2, t3 = tokens.T

    impossible = law[t1, t2, t3] == 0
    assert not impossible.any(), f"{impossible.sum()} rows emitted a triple of probability 0"
    if spec is not None:
        # Drafts are accepted in a sizeable share of rounds (τ ≈ 1.1–1.6 here), so the rules'
        # acceptance and rejection branches are both exercised.
        assert min(taus) > 1.05, taus

    pair = law.sum(0)  # [t2, t3], t1 marginalised
    for name, samples, probs, max_single in [("token 2", t2, pair.sum(1), None),
                                             ("tokens 2-3", t2 * V + t3, pair.ravel(), PAIR_CELLS)]:
        pvalue, df, power = chi_square(samples, probs, max_single)
        assert power >= MIN_POWER, (name, df, power)
        assert pvalue > ALPHA, f"{case}, {name}: p = {pvalue:.2e} (df = {df}, τ = {taus})"
