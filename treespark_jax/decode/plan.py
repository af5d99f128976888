"""What a speculative round does, decided once: a method's ``Speculation`` and the call's ``RoundPlan``.

Two frozen values, each field decided in exactly one place:

- ``Speculation`` (built by ``methods.speculation`` from the method's recipe, the user's
  overrides and the drafter): the proposer, the tree's shape and builder, the verify rule used
  when sampling, and whether the cost-aware stop and draft skipping are asked for.
- ``RoundPlan`` (``plan_round``, called once per ``decode.session.Session``): the same settings
  resolved against what only the session knows (its sampling mode, the device's cost model,
  whether trees are logged): the rule the round verifies with (``GREEDY`` at temperature 0), the verify
  ladder, whether draft skipping runs, whether children are sampled. The speculative program
  (``decode/speculative.py``) reads nothing else; one compiled program per plan.
"""

from __future__ import annotations

import dataclasses

from treespark_jax.config import TreeConfig, VerifyRule, default_ladder, sampling_rule
from treespark_jax.decode.cost_model import CostModel
from treespark_jax.drafter.proposer import Proposer


@dataclasses.dataclass(frozen=True)
class Speculation:
    """A method's speculative settings, independent of any one call.

    Attributes:
      proposer: static proposer (drafter, prompt lookup, random).
      tree: the tree's shape and builder; ``tree.budget`` is the maximum budget N of the round.
      verify: the rule used at temperature > 0, ``VerifyRule.MATCH`` or ``VerifyRule.REJECTION``
        (a rule's name is converted); greedy decoding always verifies with ``GREEDY``.
      cost_aware_stop: verify only as many nodes as the cost-aware stop picks from the ladder
        (DESIGN.md §1.5); off verifies all N nodes every round.
      skip_drafting: plain target steps while recent drafted rounds committed tokens more slowly
        than target steps would (``decode/skip.py``; lossless).

    Raises:
      ValueError: a verify rule other than ``match`` and ``rejection``.
    """

    proposer: Proposer
    tree: TreeConfig
    verify: VerifyRule | str
    cost_aware_stop: bool
    skip_drafting: bool

    def __post_init__(self):
        object.__setattr__(self, "verify", sampling_rule(self.verify))


@dataclasses.dataclass(frozen=True)
class RoundPlan:
    """The resolved, static policy of one speculative program (one compiled program per value).

    Attributes:
      tree: the tree's shape and builder; ``tree.budget`` is the maximum budget N.
      rule: the verify rule of every round: ``GREEDY`` (temperature 0), ``MATCH`` or ``REJECTION``.
      ladder: verify sizes a round chooses from (ascending, the last = N); ``(N,)`` without the
        cost-aware stop.
      skip_drafting: draft skipping runs.
      log_trees: every round's verified tree is kept in the state (on-policy rollouts).
      cost: the device's cost model, read by the cost-aware stop and draft skipping.
    """

    tree: TreeConfig
    rule: VerifyRule
    ladder: tuple[int, ...]
    skip_drafting: bool
    log_trees: bool
    cost: CostModel

    @property
    def greedy(self) -> bool:
        """Rounds verify greedily (temperature 0)."""
        return self.rule is VerifyRule.GREEDY

    @property
    def sampled_children(self) -> bool:
        """The builder draws children without replacement (the rejection rule needs them)."""
        return self.rule is VerifyRule.REJECTION

    @property
    def cost_aware_stop(self) -> bool:
        """A round chooses how many nodes to verify (more than one rung)."""
        return len(self.ladder) > 1

    def stop_verify_cost(self, context):
        """``[len(ladder)]`` verify latency (ms) of each rung at ``context`` as the cost-aware stop
        reads it: the raw medians made non-decreasing (``CostModel.measured_verify_cost``) for
        deterministic children, whose stop compares every rung exactly; the convex fit for
        sampled children, whose stopping-time rule needs it (``tree.verify_size``)."""
        cost = self.cost.verify_cost if self.sampled_children else self.cost.measured_verify_cost
        return cost(self.ladder, context)


def plan_round(spec: Speculation, greedy: bool, cost: CostModel, log_trees: bool = False) -> RoundPlan:
    """The plan of ``spec``'s rounds when decoding greedily (temperature 0) or by sampling.

    - rule: ``GREEDY`` at temperature 0, else ``spec.verify``;
    - ladder: ``config.default_ladder(N)`` with the cost-aware stop (and N > 1), else ``(N,)``;
    - draft skipping: asked for by ``spec``, possible under ``cost`` (it has the one-row step
      cost) and not while logging trees (every logged round is a drafted one).

    Args:
      spec: the method's settings (``methods.speculation``).
      greedy: decoding at temperature 0 (else at a temperature > 0).
      cost: the device's cost model.
      log_trees: keep every verified tree (on-policy rollouts).
    """
    budget = spec.tree.budget
    return RoundPlan(
        tree=spec.tree,
        rule=VerifyRule.GREEDY if greedy else spec.verify,
        ladder=default_ladder(budget) if spec.cost_aware_stop and budget > 1 else (budget,),
        skip_drafting=spec.skip_drafting and cost.step_ms is not None and not log_trees,
        log_trees=log_trees,
        cost=cost)
