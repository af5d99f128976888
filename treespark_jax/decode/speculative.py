"""The speculative round (propose → build → verify ladder → accept → commit) and its loop.

Everything runs on device: one ``lax.while_loop`` over rounds with per-row ``done`` flags and
cache lengths, so the host sees results once per call. The round is one compiled program per
maximum budget ``N``: the verify ladder is a ``lax.switch`` over static sizes inside it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from treespark_jax.config import TreeConfig
from treespark_jax.decode.commit import commit_path
from treespark_jax.decode.cost_model import DEFAULT_CPU_COST, CostModel
from treespark_jax.decode.state import GenState, Requests, append_tokens
from treespark_jax.decode.tree_log import TreeLog
from treespark_jax.drafter.proposer import Committed, Proposer
from treespark_jax.models.decoder import Decoder
from treespark_jax.tree.accept import Acceptance, accept
from treespark_jax.tree.arrays import DraftTree
from treespark_jax.tree.builders import build_tree
from treespark_jax.tree.masks import verify_inputs
from treespark_jax.tree.proposal import Proposal
from treespark_jax.tree.verify_size import choose_verify_size, expected_accepted
from treespark_jax.typing import Array, Int


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Static settings of a speculative program (one compiled program per value).

    Attributes:
      tree: tree shape and builder; ``tree.budget`` is the maximum budget N.
      greedy: temperature 0 (greedy acceptance, deterministic children).
      cost: cost model for the cost-aware stop (``tree.stop``).
      log_trees: keep every round's verified tree in the state (on-policy rollouts).
    """

    tree: TreeConfig
    greedy: bool
    cost: CostModel = DEFAULT_CPU_COST
    log_trees: bool = False

    @property
    def sampled_children(self) -> bool:
        """Children are drawn without replacement (recursive rejection at temp > 0)."""
        return not self.greedy and self.tree.verify == "rejection"

    @property
    def ladder(self) -> tuple[int, ...]:
        """Verify sizes the round chooses from: the ladder with the cost-aware stop, else just N."""
        return self.tree.ladder if self.tree.stop else (self.tree.budget,)


@struct.dataclass
class SpecStats:
    """Per-row counters of a speculative generation.

    Attributes:
      rounds: ``[B]`` int32 verify rounds the row took part in.
      accepted: ``[B]`` int32 drafted tokens accepted (τ per round = accepted / rounds + 1).
      depth_reached: ``[B, D]`` int32 rounds whose path reached depth ``j`` (column ``j``), i.e.
        where a depth ``j + 1`` draft could be accepted.
      depth_accepted: ``[B, D]`` int32 rounds where the depth ``j + 1`` draft was accepted.
      rung_rounds: ``[R]`` int32 rounds that verified each ladder rung.
    """

    rounds: Int[Array, "B"]
    accepted: Int[Array, "B"]
    depth_reached: Int[Array, "B D"]
    depth_accepted: Int[Array, "B D"]
    rung_rounds: Int[Array, "R"]

    @classmethod
    def zeros(cls, batch: int, max_depth: int, rungs: int) -> "SpecStats":
        z = functools.partial(jnp.zeros, dtype=jnp.int32)
        return cls(rounds=z((batch,)), accepted=z((batch,)), depth_reached=z((batch, max_depth)),
                   depth_accepted=z((batch, max_depth)), rung_rounds=z((rungs,)))


@struct.dataclass
class SpecState:
    """Loop carry: generation state, the proposer's state, the statistics and the tree log
    (``None`` unless ``SpecConfig.log_trees``)."""

    gen: GenState
    proposer: Any
    stats: SpecStats
    log: TreeLog | None = None


def _verify(model: Decoder, proposer: Proposer, cfg: SpecConfig, n: int, tree: DraftTree,
            proposal: Proposal, gen: GenState, requests: Requests, keys) -> tuple:
    """Verifies the first ``n`` nodes of ``tree`` (static ``n``) and accepts a path."""
    tcfg = cfg.tree
    sub = jax.tree.map(lambda a: a[:, :n], tree)
    cache = gen.cache
    tokens, positions, mask = verify_inputs(sub, gen.anchor, cache.lengths, cache.capacity, tcfg.max_depth)
    out = model(tokens, positions, mask, cache, proposer.layer_ids)
    acc = accept(sub, model.logits(out.hidden), greedy=cfg.greedy, rule=tcfg.verify,
                 max_depth=tcfg.max_depth, sampled=cfg.sampled_children, keys=keys,
                 temp=requests.temp, top_p=requests.top_p, proposal=proposal, anchor=gen.anchor,
                 branch=tcfg.branch)
    acc = acc.replace(accepted=jnp.pad(acc.accepted, ((0, 0), (0, tcfg.budget - n))))
    hidden = jnp.pad(out.hidden, ((0, 0), (0, tcfg.budget - n), (0, 0))) if cfg.log_trees else None
    features = None
    if proposer.layer_ids:
        rows = jnp.concatenate([jnp.zeros_like(acc.path[:, :1]), acc.path + 1], axis=1)  # -1 → anchor row
        features = jnp.take_along_axis(out.features, rows[:, :, None], axis=1)
    return out.cache, acc, features, hidden


def spec_round(model: Decoder, proposer: Proposer, cfg: SpecConfig, state: SpecState,
               requests: Requests) -> SpecState:
    """One round for every row: draft a tree, verify it, accept, commit, update the proposer.

    Randomness: per-row keys ``fold_in(request_key, n_out)`` (the row's progress), from which the
    builder and the acceptance rules fold their own purposes; rows never share a stream.
    """
    gen, tcfg = state.gen, cfg.tree
    active = ~gen.done
    keys = jax.vmap(jax.random.fold_in)(requests.keys, gen.n_out)
    proposal = proposer.propose(state.proposer, gen.anchor, keys)
    temp = jnp.zeros_like(requests.temp) if cfg.greedy else requests.temp
    tree = build_tree(proposal, gen.anchor, tcfg, temp=temp, top_p=requests.top_p,
                      sample=cfg.sampled_children, keys=keys)

    ladder = cfg.ladder
    rung = jnp.zeros((), jnp.int32)
    if len(ladder) > 1:
        survival = expected_accepted(tree) * active[:, None]
        # Attention is dense over the whole cache, so a round pays for the capacity (static),
        # not the committed lengths: the costs are constants of this program.
        context = gen.cache.capacity
        rung = choose_verify_size(survival, ladder, cfg.cost.verify_cost(ladder, context),
                                  cfg.cost.draft_cost(context), non_anticipating=cfg.sampled_children)
    branches = [functools.partial(_verify, model, proposer, cfg, n) for n in ladder]
    cache, acc, features, hidden = jax.lax.switch(rung, branches, tree, proposal, gen, requests, keys)
    log = state.log
    if cfg.log_trees:
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
    return SpecState(gen=new_gen, proposer=proposer.update(state.proposer, committed),
                     stats=_count(state.stats, acc, active, rung, d), log=log)


def _count(stats: SpecStats, acc: Acceptance, active, rung, max_depth: int) -> SpecStats:
    depth = jnp.arange(max_depth)[None, :]
    on = active[:, None]
    return SpecStats(
        rounds=stats.rounds + active,
        accepted=stats.accepted + jnp.where(active, acc.n_accepted, 0),
        depth_reached=stats.depth_reached + (on & (acc.n_accepted[:, None] >= depth)),
        depth_accepted=stats.depth_accepted + (on & (acc.n_accepted[:, None] > depth)),
        rung_rounds=stats.rung_rounds.at[rung].add(jnp.any(active).astype(jnp.int32)))


def spec_loop(model: Decoder, proposer: Proposer, cfg: SpecConfig, state: SpecState,
              requests: Requests, stop_after: Int[Array, ""],
              constrain: Callable[[SpecState], SpecState] | None = None) -> SpecState:
    """Runs rounds on device until every row is done or ``steps`` reaches ``stop_after``.

    ``constrain`` (a mesh's sharding constraints, ``sharding.Partitioner``) pins the layout of
    the loop carry after every round.
    """

    def cond(s: SpecState):
        return jnp.any(~s.gen.done) & (s.gen.steps < stop_after)

    def body(s: SpecState) -> SpecState:
        s = spec_round(model, proposer, cfg, s, requests)
        return s if constrain is None else constrain(s)

    return jax.lax.while_loop(cond, body, state)
