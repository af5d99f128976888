"""Best-first admission of draft-tree nodes under a static budget, as one ``lax.fori_loop``.

The frontier holds, for every node admitted so far (and the anchor), its *next* child slot in
sibling order; each step admits the frontier slot of highest priority and expands the new
node into ``K`` child slots. Because only the next slot of a node is ever a candidate, the
admitted children of a node are always a prefix of its sibling order (for sampled children:
of the draw order), and a slot is admitted from its own priority and the tree built before it.
All arrays have shapes fixed by ``(B, N, K, M)``; there is no host round-trip.

Source: best-first construction over path scores as in DDTree (there with a heap; here with a
fixed-size frontier and an argmax per admission). The per-node offers live in ``tree/children.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from treespark_jax.tree.arrays import DraftTree
from treespark_jax.config import Builder
from treespark_jax.tree.children import offer_children, survival_model
from treespark_jax.tree.proposal import Proposal
from treespark_jax.typing import Array, Float, Int


def best_first(proposal: Proposal, anchor_token: Int[Array, "B"], *, budget: int, max_depth: int,
               branch: int, builder: Builder, temperature: Float[Array, "B"], top_p: Float[Array, "B"],
               gumbel: Float[Array, "B N M"] | None) -> DraftTree:
    """Builds ``[B, N]`` draft trees by best-first admission (traceable; see ``build_tree``).

    Args:
      proposal: the round's Proposal (``block_size ≥ max_depth``).
      anchor_token: ``[B]`` int32 last committed token of each row.
      budget: static N, node slots.
      max_depth: static deepest depth.
      branch: static most children per node.
      builder: static ``Builder``: the survival model (``tree/children.py``).
      temperature, top_p: ``[B]`` float per-row settings.
      gumbel: ``[B, N, M]`` float standard Gumbel noise, row ``n`` reserved for the children of the
        node expanded ``n``-th (0 = the anchor, ``n ≥ 1`` = tree node ``n − 1``), or ``None`` for
        deterministic children.

    Returns:
      A ``DraftTree`` in admission order; valid nodes form a prefix of the slots.
    """
    b, p, m = proposal.pool_ids.shape
    n, k = budget, min(branch, m)
    dtype = jnp.result_type(proposal.pool_logits.dtype, jnp.float32)
    neg_inf = jnp.array(-jnp.inf, dtype)
    survival = survival_model(proposal, builder, temperature, top_p)
    slot_ids = jnp.arange(n + 1)
    rows = jnp.arange(b)

    # Node arrays are indexed by expansion order: 0 = the anchor, i + 1 = tree node i.
    init = dict(
        token=jnp.zeros((b, n + 1), jnp.int32).at[:, 0].set(anchor_token.astype(jnp.int32)),
        depth=jnp.zeros((b, n + 1), jnp.int32),
        score=jnp.full((b, n + 1), -jnp.inf, dtype).at[:, 0].set(0),
        parent=jnp.full((b, n + 1), -1, jnp.int32),
        rank=jnp.zeros((b, n + 1), jnp.int32),
        pool_index=jnp.zeros((b, n + 1), jnp.int32),
        kids=jnp.zeros((b, n + 1, k), jnp.int32),
        # One extra -inf column: a node whose K slots are all admitted offers nothing.
        priority=jnp.full((b, n + 1, k + 1), -jnp.inf, dtype),
        taken=jnp.zeros((b, n + 1), jnp.int32),
    )

    def take(x, idx):
        return jnp.take_along_axis(x, idx[:, None], axis=1)[:, 0]

    def step(i, s):
        # Expand node i (admitted at step i - 1, or the anchor) into its K child slots.
        depth_i, score_i = s["depth"][:, i], s["score"][:, i]
        noise = None if gumbel is None else gumbel[:, i]
        kids, priority = offer_children(proposal, survival, jnp.minimum(depth_i + 1, p), s["token"][:, i],
                                        score_i, temperature, top_p, branch, noise)
        expandable = jnp.isfinite(score_i) & (depth_i < max_depth)
        priority = jnp.where(expandable[:, None], priority, neg_inf)
        s = dict(s)
        s["kids"] = jax.lax.dynamic_update_slice_in_dim(s["kids"], kids[:, None], i, axis=1)
        s["priority"] = jax.lax.dynamic_update_slice(s["priority"], priority[:, None].astype(dtype), (0, i, 0))

        # Admit the best next-child slot over the frontier.
        frontier = jnp.take_along_axis(s["priority"], s["taken"][..., None], axis=2)[..., 0]
        u = jnp.argmax(frontier, axis=1)
        best = take(frontier, u)
        ok = best > neg_inf
        rank = take(s["taken"], u)
        pool_index = s["kids"][rows, u, rank]
        depth = take(s["depth"], u) + 1
        token = proposal.pool_ids[rows, jnp.clip(depth - 1, 0, p - 1), pool_index]
        s["taken"] = s["taken"] + ((slot_ids == u[:, None]) & ok[:, None])

        new = dict(token=jnp.where(ok, token, 0), depth=jnp.where(ok, depth, 0),
                   score=jnp.where(ok, best, neg_inf),
                   parent=jnp.where(ok, u - 1, -1), rank=jnp.where(ok, rank, 0),
                   pool_index=jnp.where(ok, pool_index, 0))
        for name, value in new.items():
            s[name] = jax.lax.dynamic_update_slice_in_dim(
                s[name], value.astype(s[name].dtype)[:, None], i + 1, axis=1)
        return s

    s = jax.lax.fori_loop(0, n, step, init)
    return DraftTree(tokens=s["token"][:, 1:], parents=s["parent"][:, 1:], depths=s["depth"][:, 1:],
                     sibling_rank=s["rank"][:, 1:], pool_index=s["pool_index"][:, 1:],
                     valid=jnp.isfinite(s["score"][:, 1:]), score=s["score"][:, 1:])
