"""The jitted decode programs: pure functions over ``(graphdef, weights, ...)``, one ``Program`` each.

``nnx.split`` happens once on the host (``Engine``), ``nnx.merge`` inside ``jax.jit`` (Flax
performance guide), so weights are traced as inputs, not baked-in constants. With a mesh
``layout`` (a static argument; ``None`` on one device) every program pins the layout of the
state it returns and of its loop carry, so one program's output is a valid input of the next.

- ``prefill_program`` / ``ar_program``: autoregressive prefill, then the decode loop.
- ``logged_ar_program``: both in one, logging every token's target features (rollouts).
- ``spec_prefill_program`` / ``spec_program``: prefill with the proposer's context, then the
  speculative round loop of a ``RoundPlan``.
"""

from __future__ import annotations

from flax import nnx

from treespark_jax.decode import programs
from treespark_jax.decode.ar import ar_loop, logged_ar_loop
from treespark_jax.decode.feature_log import FeatureLog
from treespark_jax.decode.plan import RoundPlan
from treespark_jax.decode.prefill import prefill
from treespark_jax.decode.programs import Program
from treespark_jax.decode.skip import SkipState
from treespark_jax.decode.speculative import SpecState, SpecStats, spec_loop
from treespark_jax.decode.state import GenState
from treespark_jax.decode.tree_log import TreeLog
from treespark_jax.sharding import Partitioner


def _pin(layout: Partitioner | None, tree):
    """``tree`` constrained to the mesh layout (unchanged without a mesh)."""
    return tree if layout is None else layout.constrain(tree)


def _prefill(graphdef, weights, tokens, prompt_lens, active, requests, *, capacity, out_size, greedy,
             layout=None) -> GenState:
    model = nnx.merge(graphdef, weights)
    state, _, _ = prefill(model, tokens, prompt_lens, active, requests, capacity=capacity,
                       out_size=out_size, greedy=greedy)
    return _pin(layout, state)


def _ar(graphdef, weights, state, requests, stop_after, *, greedy, layout=None) -> GenState:
    return ar_loop(nnx.merge(graphdef, weights), state, requests, stop_after, greedy,
                   constrain=None if layout is None else layout.constrain)


def _logged_ar(graphdef, weights, tokens, prompt_lens, active, requests, *, capacity, out_size, greedy, layer_ids,
               layout=None) -> tuple[GenState, FeatureLog]:
    model = nnx.merge(graphdef, weights)
    state, out, logits = prefill(model, tokens, prompt_lens, active, requests, capacity=capacity,
                                 out_size=out_size, greedy=greedy, layer_ids=layer_ids)
    carry = _pin(layout, (state, FeatureLog.of_prefill(out, logits, prompt_lens, capacity)))
    return logged_ar_loop(model, *carry, requests, greedy, layer_ids,
                          constrain=None if layout is None else layout.constrain,
                          compact=layout is None or layout.axis_size("data") == 1)


def _spec_prefill(graphdef, weights, tokens, prompt_lens, active, requests, proposer_weights,
                  *, proposer, plan: RoundPlan, capacity, out_size, layout=None) -> SpecState:
    model = nnx.merge(graphdef, weights)
    gen, out, _ = prefill(model, tokens, prompt_lens, active, requests, capacity=capacity,
                       out_size=out_size, greedy=plan.greedy, layer_ids=proposer.layer_ids)
    pstate = proposer.init(proposer_weights, tokens, prompt_lens, gen.anchor, out.features, capacity)
    b = tokens.shape[0]
    stats = SpecStats.zeros(b, plan.tree.max_depth, len(plan.ladder))
    log = (TreeLog.zeros(b, out_size, plan.tree.budget, model.cfg.d_model, model.dtype)
           if plan.log_trees else None)  # a round emits at least one token: ≤ out_size rounds
    skip = SkipState.start() if plan.skip_drafting else None
    return _pin(layout, SpecState(gen=gen, proposer=pstate, stats=stats, log=log, skip=skip))


def _spec(graphdef, weights, state, requests, stop_after, *, proposer, plan, layout=None) -> SpecState:
    return spec_loop(nnx.merge(graphdef, weights), proposer, plan, state, requests, stop_after,
                     constrain=None if layout is None else layout.constrain)


prefill_program = Program(_prefill, ("graphdef", "capacity", "out_size", "greedy", "layout"))
ar_program = Program(_ar, ("graphdef", "greedy", "layout"), donate_argnames=("state",))
logged_ar_program = Program(_logged_ar, ("graphdef", "capacity", "out_size", "greedy", "layer_ids", "layout"))
spec_prefill_program = Program(_spec_prefill, ("graphdef", "proposer", "plan", "capacity", "out_size", "layout"))
spec_program = Program(_spec, ("graphdef", "proposer", "plan", "layout"), donate_argnames=("state",))


def compiled_programs() -> int:
    """Executables the decode programs compiled (or loaded from the persistent compilation
    cache) so far in this process, released ones included (``decode/programs.py``)."""
    return programs.compiled()
