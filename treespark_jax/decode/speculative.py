"""The speculative round (propose → build → verify ladder → accept → commit) and its loop.

Everything runs on device: one ``lax.while_loop`` over rounds with per-row ``done`` flags and
cache lengths, so the host sees results once per call. The round is one compiled program per
maximum budget ``N``: the verify ladder picks one of a few static sizes inside it, and
draft skipping (``decode/skip.py``) an inner ``lax.while_loop`` of target steps after a drafted
round. Neither is a ``lax.cond``/``lax.switch``: a conditional whose branches write the KV cache
makes XLA copy the whole cache (on CPU a ``lax.cond`` between the two kinds of round measured
4 ms slower per skipped round, 39 against 35 ms, and a ``lax.switch`` over the ladder put eight
cache copies in the round program), while a while loop updates its carry in place. So the ladder
runs as one while loop per rung, each taken at most once (``_run_in_place``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from treespark_jax.decode.ar import target_step
from treespark_jax.decode.commit import commit_path
from treespark_jax.decode.plan import RoundPlan
from treespark_jax.decode.skip import SkipState, after_draft, after_skip
from treespark_jax.decode.state import GenState, Requests, append_tokens
from treespark_jax.decode.tree_log import TreeLog
from treespark_jax.drafter.proposer import Committed, Proposer
from treespark_jax.models.decoder import Decoder
from treespark_jax.models.kv_cache import KVCache
from treespark_jax.pytree import pytree_dataclass
from treespark_jax.tree.accept import Acceptance, accept
from treespark_jax.tree.arrays import DraftTree
from treespark_jax.tree.builders import build_tree
from treespark_jax.tree.masks import verify_inputs
from treespark_jax.tree.proposal import Proposal
from treespark_jax.tree.verify_size import choose_verify_size, expected_accepted
from treespark_jax.typing import Array, Int


@pytree_dataclass
class SpecStats:
    """Per-row counters of a speculative generation.

    Attributes:
      rounds: ``[B]`` int32 verify rounds the row took part in.
      accepted: ``[B]`` int32 drafted tokens accepted (τ per round = accepted / rounds + 1).
      depth_reached: ``[B, depth]`` int32 rounds whose path reached depth ``j`` (column ``j``), i.e.
        where a depth ``j + 1`` draft could be accepted.
      depth_accepted: ``[B, depth]`` int32 rounds where the depth ``j + 1`` draft was accepted.
      rung_rounds: ``[rungs]`` int32 rounds that verified each ladder rung.
      skipped: ``[B]`` int32 rounds the row took part in without drafting (draft skipping);
        not counted in ``rounds``.
      skipped_steps: ``[]`` int32 target calls of the batch that skipped drafting (the
        decision is one per batch, so each is a round of every row still active).
    """

    rounds: Int[Array, "B"]
    accepted: Int[Array, "B"]
    depth_reached: Int[Array, "B depth"]
    depth_accepted: Int[Array, "B depth"]
    rung_rounds: Int[Array, "rungs"]
    skipped: Int[Array, "B"]
    skipped_steps: Int[Array, ""]

    @classmethod
    def zeros(cls, batch: int, max_depth: int, rungs: int) -> "SpecStats":
        z = functools.partial(jnp.zeros, dtype=jnp.int32)
        return cls(rounds=z((batch,)), accepted=z((batch,)), depth_reached=z((batch, max_depth)),
                   depth_accepted=z((batch, max_depth)), rung_rounds=z((rungs,)), skipped=z((batch,)),
                   skipped_steps=z(()))


@pytree_dataclass
class SpecState:
    """Loop carry: generation state, the proposer's state, the statistics, the tree log
    (``None`` unless ``RoundPlan.log_trees``) and the draft-skipping controller (``None``
    unless ``RoundPlan.skip_drafting``)."""

    gen: GenState
    proposer: Any
    stats: SpecStats
    log: TreeLog | None = None
    skip: SkipState | None = None


def _verify(model: Decoder, proposer: Proposer, plan: RoundPlan, n: int, cache: KVCache, tree: DraftTree,
            proposal: Proposal, gen: GenState, requests: Requests, keys) -> tuple:
    """Verifies the first ``n`` nodes of ``tree`` (static ``n``) against ``cache`` and accepts a
    path; returns ``(cache, acc, features, hidden)``."""
    tcfg = plan.tree
    sub = jax.tree.map(lambda a: a[:, :n], tree)
    tokens, positions, mask = verify_inputs(sub, gen.anchor, cache.lengths, cache.capacity, tcfg.max_depth)
    out = model(tokens, positions, mask, cache, proposer.layer_ids)
    acc = accept(sub, model.logits(out.hidden), rule=plan.rule, max_depth=tcfg.max_depth, keys=keys,
                 temperature=requests.temperature, top_p=requests.top_p, proposal=proposal, anchor=gen.anchor,
                 branch=tcfg.branch)
    acc = acc.replace(accepted=jnp.pad(acc.accepted, ((0, 0), (0, tcfg.budget - n))))
    hidden = jnp.pad(out.hidden, ((0, 0), (0, tcfg.budget - n), (0, 0))) if plan.log_trees else None
    features = None
    if proposer.layer_ids:
        rows = jnp.concatenate([jnp.zeros_like(acc.path[:, :1]), acc.path + 1], axis=1)  # -1 → anchor row
        features = jnp.take_along_axis(out.features, rows[:, :, None], axis=1)
    return out.cache, acc, features, hidden


def skipped_round(model: Decoder, proposer: Proposer, plan: RoundPlan, state: SpecState,
                  requests: Requests) -> SpecState:
    """A round without drafting: the target reads the anchor alone and emits its next token
    (``decode.ar.target_step``), and the proposer's context gains the anchor."""
    gen = state.gen
    active = ~gen.done
    new_gen, output, token, _ = target_step(model, gen, requests, plan.greedy, proposer.layer_ids)
    pad = plan.tree.max_depth  # Committed rows beyond the anchor
    features = None if output.features is None else jnp.pad(output.features, ((0, 0), (0, pad), (0, 0)))
    committed = Committed(tokens=jnp.pad(gen.anchor[:, None], ((0, 0), (0, pad))), n=active.astype(jnp.int32),
                          bonus=token, features=features)
    return state.replace(gen=new_gen, proposer=proposer.update(state.proposer, committed),
                         stats=state.stats.replace(skipped=state.stats.skipped + active,
                                                   skipped_steps=state.stats.skipped_steps + jnp.any(active)),
                         skip=after_skip(state.skip))


def drafted_round(model: Decoder, proposer: Proposer, plan: RoundPlan, state: SpecState,
                  requests: Requests) -> SpecState:
    """One round for every row: draft a tree, verify it, accept, commit, update the proposer
    (and, with draft skipping, the controller).

    Randomness: per-row keys ``fold_in(request_key, n_out)`` (the row's progress), from which the
    builder and the acceptance rules fold their own purposes; rows never share a stream.
    """
    gen, tcfg = state.gen, plan.tree
    active = ~gen.done
    keys = jax.vmap(jax.random.fold_in)(requests.keys, gen.n_out)
    proposal = proposer.propose(state.proposer, gen.anchor, keys)
    tree = build_tree(proposal, gen.anchor, tcfg, rule=plan.rule, temperature=requests.temperature,
                      top_p=requests.top_p, keys=keys)

    ladder = plan.ladder
    rung = jnp.zeros((), jnp.int32)
    # Attention covers the longest row's committed slots (``Decoder.__call__``), so the costs are
    # read at that traced length.
    context = jnp.max(gen.cache.lengths)
    if len(ladder) > 1:
        survival = expected_accepted(tree) * active[:, None]
        rung = choose_verify_size(survival, ladder, plan.stop_verify_cost(context), plan.cost.draft_cost(context),
                                  non_anticipating=plan.sampled_children)
    branches = [functools.partial(_verify, model, proposer, plan, n) for n in ladder]
    operands = (tree, proposal, gen, requests, keys)
    if len(branches) == 1:
        cache, acc, features, hidden = branches[0](gen.cache, *operands)
    else:
        cache, acc, features, hidden = _run_in_place(rung, branches, gen.cache, *operands)
    log = state.log
    if plan.log_trees:
        log = log.record(active, gen.cache.lengths, tree, jnp.asarray(ladder)[rung], acc, hidden)

    d = tcfg.max_depth
    j = jnp.arange(d + 1)[None, :]
    path_tokens = jnp.pad(acc.path_tokens, ((0, 0), (0, 1)))
    emitted = jnp.where(j < acc.n_accepted[:, None], path_tokens,
                        jnp.where(j == acc.n_accepted[:, None], acc.bonus[:, None], 0))
    new_gen, _ = append_tokens(gen, emitted, acc.n_accepted + 1, requests)
    new_gen = new_gen.replace(cache=commit_path(cache, acc.path, acc.n_accepted, active),
                              anchor=jnp.where(active, acc.bonus, gen.anchor), steps=gen.steps + 1)
    committed = Committed(tokens=jnp.concatenate([gen.anchor[:, None], jnp.maximum(acc.path_tokens, 0)], 1),
                          n=jnp.where(active, acc.n_accepted + 1, 0), bonus=acc.bonus, features=features)
    skip = state.skip
    if plan.skip_drafting:
        tokens = jnp.sum(jnp.where(active, acc.n_accepted + 1, 0)) / jnp.maximum(jnp.sum(active), 1)
        round_ms = jnp.asarray(plan.cost.measured_verify_cost(ladder, context))[rung] + plan.cost.draft_cost(context)
        skip = after_draft(skip, tokens, round_ms, plan.cost.step_cost(context))
    return SpecState(gen=new_gen, proposer=proposer.update(state.proposer, committed),
                     stats=_count(state.stats, acc, active, rung, d), log=log, skip=skip)


def _run_in_place(index: Int[Array, ""], branches: list[Callable], cache: KVCache, *operands) -> tuple:
    """``branches[index](cache, *operands)``, for branches that return ``(cache, *results)`` alike
    in structure, as one ``lax.while_loop`` per branch that runs at most once: the cache is updated
    in place, where ``lax.switch`` makes XLA copy it (module docstring). The results start as
    zeros of their shapes, replaced by the chosen branch's."""
    results = jax.eval_shape(branches[0], cache, *operands)[1:]
    out = (cache, *jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), results))
    for i, branch in enumerate(branches):
        out = jax.lax.while_loop(lambda c: c[0], lambda c, b=branch: (jnp.zeros_like(c[0]), b(c[1][0], *operands)),
                                 (index == i, out))[1]
    return out


def _count(stats: SpecStats, acc: Acceptance, active, rung, max_depth: int) -> SpecStats:
    depth = jnp.arange(max_depth)[None, :]
    on = active[:, None]
    return stats.replace(
        rounds=stats.rounds + active,
        accepted=stats.accepted + jnp.where(active, acc.n_accepted, 0),
        depth_reached=stats.depth_reached + (on & (acc.n_accepted[:, None] >= depth)),
        depth_accepted=stats.depth_accepted + (on & (acc.n_accepted[:, None] > depth)),
        rung_rounds=stats.rung_rounds.at[rung].add(jnp.any(active).astype(jnp.int32)))


def spec_loop(model: Decoder, proposer: Proposer, plan: RoundPlan, state: SpecState,
              requests: Requests, stop_after: Int[Array, ""],
              constrain: Callable[[SpecState], SpecState] | None = None) -> SpecState:
    """Runs rounds on device until every row is done or ``steps`` reaches ``stop_after``: a
    drafted round, then (with draft skipping) the skipped rounds of the pause it set.

    The loop can be re-entered (a stream advances it a round at a time): a pause left by the
    previous call is finished first, so calling it in pieces runs the same rounds as one call.
    ``constrain`` (a mesh's sharding constraints, ``sharding.Partitioner``) pins the layout of
    the loop carry after every round.
    """
    pin = (lambda s: s) if constrain is None else constrain

    def running(s: SpecState):
        return jnp.any(~s.gen.done) & (s.gen.steps < stop_after)

    def pause(s: SpecState) -> SpecState:
        if not plan.skip_drafting:
            return s
        return jax.lax.while_loop(lambda s: (s.skip.pause > 0) & running(s),
                                  lambda s: pin(skipped_round(model, proposer, plan, s, requests)), s)

    def body(s: SpecState) -> SpecState:
        return pause(pin(drafted_round(model, proposer, plan, s, requests)))

    return jax.lax.while_loop(running, body, pause(state))
