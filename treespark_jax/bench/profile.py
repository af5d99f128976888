"""Latency of one target forward and of one round's drafting, and the cost-model profiler.

``profile_cost`` is what ``treespark profile`` runs: verify latency per ladder rung and context
length, draft latency per context length, fitted into a ``CostModel`` (DESIGN.md §1.5).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from treespark_jax.config import (DrafterConfig, TreeConfig, VerifyRule, check_budget, default_ladder,
                                  default_layer_ids)
from treespark_jax.decode.ar import decode_mask
from treespark_jax.decode.buckets import cache_capacity
from treespark_jax.decode.cost_model import CostModel
from treespark_jax.decode.cost_store import current_device_kind
from treespark_jax.drafter.block_proposer import BlockProposer
from treespark_jax.drafter.model import BlockDrafter
from treespark_jax.drafter.proposer import Committed
from treespark_jax.methods import TREE_BRANCH, drafter_config
from treespark_jax.models.decoder import Decoder
from treespark_jax.models.kv_cache import KVCache
from treespark_jax.tree.builders import build_tree


def forward_program() -> Callable:
    """A new jitted target forward ``(graphdef, weights, tokens, cache) → (logits, cache)``: the
    new rows attend to the committed slots and to each other, the cache is donated. Its own
    compilation cache, so a caller can trace it under other settings than ``forward_call``'s."""
    @functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
    def forward(graphdef, weights, tokens, cache):
        model = nnx.merge(graphdef, weights)
        t = tokens.shape[1]
        positions = cache.lengths[:, None] + jnp.arange(t)[None, :]
        mask = decode_mask(cache.lengths, cache.capacity) | (
            jnp.arange(cache.capacity)[None, None, :] < cache.lengths[:, None, None] + t)
        out = model(tokens, positions, mask, cache)
        return model.logits(out.hidden), out.cache

    return forward


_forward = forward_program()


def forward_call(model: Decoder, rows: int, context: int, capacity: int,
                 program: Callable | None = None) -> Callable[[], jax.Array]:
    """A zero-argument jitted target call on ``rows`` tokens after ``context`` cached ones, in a
    cache of ``capacity`` positions (batch 1); it returns the logits ``[1, rows, V]``.

    The cache is donated and written in place, as in a decode loop (a call that kept its input
    cache would copy all of it first, a cost that grows with the capacity and no round pays).
    ``program`` is a ``forward_program()`` to run instead of the shared one.
    """
    graphdef, weights = nnx.split(model)
    cache = [KVCache.zeros(model.cfg, 1, capacity, model.dtype).replace(lengths=jnp.asarray([context], jnp.int32))]
    tokens = jnp.zeros((1, rows), jnp.int32)
    program = program or _forward

    def call():
        logits, cache[0] = program(graphdef, weights, tokens, cache[0])
        return logits

    return call


# ------------------------------------------------------------------------ cost model profiling


@functools.partial(jax.jit, static_argnames=("proposer", "tree"))
def _draft_round(state, anchor, committed, *, proposer, tree):
    proposal = proposer.propose(state, anchor, None)
    built = build_tree(proposal, anchor, tree, rule=VerifyRule.GREEDY)
    # Only the context: returning the whole state would copy the weights it carries (the
    # target's embedding among them) on every call, which a real round never does.
    return built, proposer.update(state, committed).context


def interleaved_seconds(calls: Sequence[Callable[[], Any]], repeats: int, progress: bool = False) -> np.ndarray:
    """Wall seconds of each call, ``repeats`` times, in interleaved sweeps over all calls.

    Every call runs once first (compilation and warm-up, not timed). Interleaving spreads a
    burst of load from other processes over all the calls instead of one measurement, which is
    what lets neighbouring cells of a profile be compared on a shared machine.

    Returns:
      ``[len(calls), repeats]`` float seconds.
    """
    bar = tqdm(total=len(calls) * (repeats + 1), desc="profiling", unit="call", disable=not progress)
    for call in calls:
        jax.block_until_ready(call())
        bar.update()
    times = np.zeros((len(calls), repeats))
    for r in range(repeats):
        for i, call in enumerate(calls):
            t0 = time.perf_counter()
            jax.block_until_ready(call())
            times[i, r] = time.perf_counter() - t0
            bar.update()
    bar.close()
    return times


def profile_drafter(target: Decoder, seed: int = 0) -> BlockDrafter:
    """A randomly initialised drafter with the ``treespark`` recipe's heads (Markov rank
    ``MARKOV_RANK`` and the edge head, as ``methods.drafter_config``) for ``target``: the default
    feature layers (fewer than five for a target too shallow for them) and a pool no larger than
    the vocabulary. Its cost depends only on its shapes, not on its weight values.

    Raises:
      ValueError: for a target too shallow for even one default feature layer.
    """
    for m in (5, 4, 3, 2, 1):
        try:
            ids = default_layer_ids(target.cfg.n_layers, m)
            break
        except ValueError:
            continue
    else:
        raise ValueError(f"a {target.cfg.n_layers}-layer target is too shallow for a block drafter.")
    cfg = drafter_config("treespark", target.cfg, target_layer_ids=ids,
                         pool_size=min(DrafterConfig.pool_size, target.cfg.vocab_size))
    return BlockDrafter(cfg, target.cfg, rngs=nnx.Rngs(params=seed), dtype=target.dtype)


def _draft_inputs(target: Decoder, proposer: BlockProposer, tree: TreeConfig, context: int, capacity: int):
    """A batch-1 drafter state over ``context`` committed positions in a context cache of
    ``capacity``, an anchor and one round's committed rows (zeros: costs depend on shapes only)."""
    feat = len(proposer.layer_ids) * target.cfg.d_model
    features = jnp.zeros((1, context, feat), target.dtype)
    state = proposer.init(proposer.weights, jnp.zeros((1, context), jnp.int32),
                          jnp.asarray([context], jnp.int32), jnp.zeros((1,), jnp.int32), features, capacity)
    x = tree.max_depth + 1
    committed = Committed(tokens=jnp.zeros((1, x), jnp.int32), n=jnp.ones((1,), jnp.int32),
                          bonus=jnp.zeros((1,), jnp.int32), features=jnp.zeros((1, x, feat), target.dtype))
    return state, jnp.zeros((1,), jnp.int32), committed


def draft_call(target: Decoder, proposer: BlockProposer, tree: TreeConfig, context: int,
               capacity: int) -> Callable[[], Any]:
    """A zero-argument jitted call of one round's drafting at batch 1: the block drafter's
    forward over ``context`` committed positions of a ``capacity``-slot context cache,
    ``build_tree`` (greedy children) and the context update. Its latency is the draft cost
    ``C_d`` of DESIGN.md §1.5."""
    state, anchor, committed = _draft_inputs(target, proposer, tree, context, capacity)
    return lambda: _draft_round(state, anchor, committed, proposer=proposer, tree=tree)


@functools.partial(jax.jit, static_argnames=("proposer",))
def _propose(state, anchor, *, proposer):
    return proposer.propose(state, anchor, None)


@functools.partial(jax.jit, static_argnames=("tree",))
def _build(proposal, anchor, *, tree):
    return build_tree(proposal, anchor, tree, rule=VerifyRule.GREEDY)


def round_part_calls(target: Decoder, proposer: BlockProposer, tree: TreeConfig, context: int
                     ) -> dict[str, Callable[[], Any]]:
    """Zero-argument jitted calls of a round's parts at batch 1 after ``context`` committed
    tokens: ``propose`` (the drafter pass), ``build`` (``build_tree``, greedy children) and
    ``verify`` (the target over ``N + 1`` rows)."""
    rows = tree.budget + 1
    capacity = cache_capacity(context, 0, rows)
    state, anchor, _ = _draft_inputs(target, proposer, tree, context, capacity)
    proposal = _propose(state, anchor, proposer=proposer)
    return {"propose": lambda: _propose(state, anchor, proposer=proposer),
            "build": lambda: _build(proposal, anchor, tree=tree),
            "verify": forward_call(target, rows, context, capacity)}


def check_profile_args(budget: int, contexts: tuple[int, ...], repeats: int, max_positions: int | None = None) -> None:
    """Validates ``profile_cost``'s settings before anything is loaded or compiled.

    Raises:
      ValueError: a budget outside ``1..MAX_BUDGET``, a repeat count below 1, no contexts,
        contexts not in strictly ascending order, a context below 1 token, or a context whose verify
        rows (``budget + 1``) pass the model's ``max_positions``.
    """
    check_budget(budget)
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be at least 1.")
    if not contexts:
        raise ValueError("give at least one context length to profile.")
    given = f"contexts={','.join(map(str, contexts))}"  # as a --contexts flag spells them
    if list(contexts) != sorted(set(contexts)):
        raise ValueError(f"{given} must be in strictly ascending order.")
    if contexts[0] < 1:
        raise ValueError(f"{given} must each be at least 1 committed token.")
    if max_positions is not None and contexts[-1] + budget + 1 > max_positions:
        raise ValueError(f"{given} reach {contexts[-1]} tokens, which with the "
                         f"{budget + 1} verify rows of budget {budget} pass the model's {max_positions} positions.")


def profile_rows(budget: int) -> tuple[int, ...]:
    """Verified rows profiled for ``budget`` N: ``rung + 1`` for every rung of the default ladders
    of N, N/2, N/4, … 1, so one profile also serves the smaller budgets without extrapolation.

    The one-row call (a round that skips drafting) is profiled apart (``CostModel.step_ms``): where
    it runs a matrix-vector kernel much cheaper than the matrix-matrix ones of two or more rows
    (XLA's on the CPU without the packed matmul kernel), that is a kink no convex fit through the
    tree sizes should bend to.
    """
    rungs, n = set(), budget
    while n >= 1:
        rungs.update(default_ladder(n))
        n //= 2
    return tuple(sorted(r + 1 for r in rungs))


def profile_cost(model: Decoder, *, target: str, budget: int, contexts: tuple[int, ...] = (64, 256, 1024),
                 repeats: int = 5, drafter: BlockDrafter | None = None, progress: bool = False) -> CostModel:
    """Measures and fits the round costs of ``model`` on JAX's default device (batch 1).

    For each context length ``S`` (committed tokens, in one cache with room for the longest
    context and the most rows, as a request's) and each of ``profile_rows(budget)``: the verify latency
    (``forward_call``); per context, the draft latency of ``drafter`` (default: a random
    ``profile_drafter``) with the ``treespark`` builder at ``budget`` (``draft_call``), and the
    one-row target call (``CostModel.step_ms``). All
    calls are compiled first, then timed in ``repeats`` interleaved sweeps
    (``interleaved_seconds``); the per-cell medians are fitted by ``CostModel.fit`` (monotone
    convex in rows).

    Args:
      model: the target.
      target: the target's id (``decode.cost_store.target_id``), recorded in the model.
      budget: tree budget N; its default ladder and those of its halvings give the rows.
      contexts: ascending context lengths (tokens).
      repeats: timed calls per measurement (after one warm-up call).
      drafter: the block drafter whose round is timed (its shapes matter: layers, block size,
        draft vocabulary); ``None`` for ``profile_drafter(model)``, which drafts from the whole
        vocabulary and so overstates the draft cost of a drafter with a draft vocabulary.
      progress: show a progress bar.

    Returns:
      The fitted ``CostModel`` (raw medians in its ``measured_*`` fields), milliseconds.

    Raises:
      ValueError: as ``check_profile_args``.
    """
    contexts = tuple(contexts)
    check_profile_args(budget, contexts, repeats, model.cfg.max_positions)
    rows = profile_rows(budget)
    drafter = profile_drafter(model) if drafter is None else drafter
    proposer = BlockProposer.create(drafter, model)
    tree = TreeConfig(budget=budget, max_depth=min(budget, drafter.cfg.depths), branch=TREE_BRANCH,
                      builder="treespark")
    capacity = cache_capacity(contexts[-1], 0, rows[-1])
    calls = [forward_call(model, r, s, capacity) for s in contexts for r in rows]
    calls += [draft_call(model, proposer, tree, s, capacity) for s in contexts]
    calls += [forward_call(model, 1, s, capacity) for s in contexts]
    ms = 1e3 * np.median(interleaved_seconds(calls, repeats, progress), axis=1)
    c = len(contexts)
    verify, draft, step = ms[:-2 * c].reshape(c, len(rows)), ms[-2 * c:-c], ms[-c:]
    return CostModel.fit(contexts, rows, verify, draft, step, device=current_device_kind(), target=target,
                         budget=budget)


def cost_table(cost: CostModel) -> str:
    """The profile as a text table: verify latency per rows × context, measured / fitted (ms),
    the draft latency per context and, when measured, the one-row step (pooled over context)."""
    head = f"{'rows':>6}" + "".join(f"{'ctx ' + str(s):>18}" for s in cost.contexts)
    lines = [f"{cost.target} on {cost.device}, budget {cost.budget}: milliseconds, measured / fitted", head]
    measured = cost.measured_verify_ms or cost.verify_ms
    for j, r in enumerate(cost.rows):
        lines.append(f"{r:>6}" + "".join(f"{measured[i][j]:>9.2f} /{cost.verify_ms[i][j]:>7.2f}"
                                          for i in range(len(cost.contexts))))
    draft = cost.measured_draft_ms or cost.draft_ms
    lines.append(f"{'draft':>6}" + "".join(f"{draft[i]:>9.2f} /{cost.draft_ms[i]:>7.2f}"
                                           for i in range(len(cost.contexts))))
    if cost.step_ms is not None:
        lines.append(f"{'1 row':>6}" + "".join(f"{'':>9}  {v:>7.2f}" for v in cost.step_ms))
    return "\n".join(lines)
