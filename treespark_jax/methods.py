"""The method registry shared by ``generate`` and ``bench``: each recipe = proposer + builder + rule.

Names follow the literature (DESIGN.md §4) so a row means what readers expect:

| method | drafter (training loss) | builder | verify at temperature > 0 | cost-aware stop |
| --- | --- | --- | --- | --- |
| ``ar`` | none | — | — | — |
| ``prompt_lookup`` | n-gram lookup (Saxena 2023) | chain | match | no |
| ``dflash`` | block drafter, ``dflash`` loss, no Markov head | chain | match | no |
| ``dspark`` | block drafter + Markov + confidence, ``dspark`` loss | chain | rejection | yes (confidence) |
| ``ddtree`` | the ``dflash`` drafter | marginal | match | no |
| ``pctree`` | the ``dspark`` drafter | parent_conditioned | match | no |
| ``treespark`` | drafter with edge head, ``treespark`` loss | treespark | rejection | yes (edge head) |

Draft skipping (``decode/skip.py``: plain target steps while recent drafted rounds did not pay)
is on by default for every drafting method (docs/cost_model.md has the measurements). Greedy
decoding (temperature 0) always verifies with the greedy rule. ``builder``, ``verify`` and
``cost_aware_stop`` override a recipe's parts for ablations (the ``treespark`` builder brings its
cost-aware stop unless ``cost_aware_stop=False``); the drafter is passed by the caller
(``api.TreeSpark.drafter`` resolves ``--drafter PATH``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from treespark_jax.config import (Builder, DrafterConfig, ModelConfig, TreeConfig, VerifyRule, check_budget,
                                  parse_enum)

if TYPE_CHECKING:  # the registry itself stays importable without JAX (the CLI's --help)
    from treespark_jax.decode.plan import Speculation
    from treespark_jax.drafter.model import BlockDrafter
    from treespark_jax.models.decoder import Decoder

DEFAULT_BUDGET = 8
TREE_BRANCH = 4  # most children per node for the tree builders (ddtree, pctree, treespark)
MARKOV_RANK = 32  # rank R of the Markov head of the dspark and treespark drafters


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One decoding method.

    Attributes:
      proposer: ``None`` (plain AR), ``"prompt_lookup"`` or ``"block"`` (a learned block drafter).
      builder: tree builder.
      verify: acceptance rule at temperature > 0 (``MATCH`` or ``REJECTION``).
      drafter_loss: the training loss of the recipe's drafter (``dflash``, ``dspark`` or
        ``treespark``), which also fixes its heads (``drafter_config``).
      cost_aware_stop: the round verifies only what the cost-aware stop picks (DESIGN.md §1.5).
    """

    proposer: str | None
    builder: Builder = Builder.CHAIN
    verify: VerifyRule = VerifyRule.MATCH
    drafter_loss: str | None = None
    cost_aware_stop: bool = False


RECIPES: dict[str, Recipe] = {
    "ar": Recipe(None),
    "prompt_lookup": Recipe("prompt_lookup"),
    "dflash": Recipe("block", Builder.CHAIN, VerifyRule.MATCH, "dflash"),
    "dspark": Recipe("block", Builder.CHAIN, VerifyRule.REJECTION, "dspark", cost_aware_stop=True),
    "ddtree": Recipe("block", Builder.MARGINAL, VerifyRule.MATCH, "dflash"),
    "pctree": Recipe("block", Builder.PARENT_CONDITIONED, VerifyRule.MATCH, "dspark"),
    "treespark": Recipe("block", Builder.TREESPARK, VerifyRule.REJECTION, "treespark", cost_aware_stop=True),
}
METHODS: tuple[str, ...] = tuple(RECIPES)
DRAFTER_METHODS: tuple[str, ...] = tuple(m for m, r in RECIPES.items() if r.proposer == "block")


def recipe(method: str) -> Recipe:
    """The recipe of ``method``.

    Raises:
      ValueError: for an unknown method (the message lists the known ones).
    """
    if method not in RECIPES:
        raise ValueError(f"method {method!r} is unknown; choose one of {', '.join(METHODS)}.")
    return RECIPES[method]


def drafter_config(loss: str, target: ModelConfig, **fields) -> DrafterConfig:
    """The drafter architecture trained with ``loss`` for ``target`` (heads follow the loss).

    ``dflash``: backbone only; ``dspark``: Markov head (rank ``MARKOV_RANK``) and confidence
    head; ``treespark``: Markov head and edge head. ``fields`` override any of them.

    Raises:
      ValueError: for an unknown loss name.
    """
    heads = {"dflash": dict(markov_rank=0),
             "dspark": dict(markov_rank=MARKOV_RANK, confidence_head=True),
             "treespark": dict(markov_rank=MARKOV_RANK, edge_head=True)}
    if loss not in heads:
        raise ValueError(f"drafter loss {loss!r} is unknown; choose one of {', '.join(heads)}.")
    return DrafterConfig.for_target(target, **{**heads[loss], **fields})


def check_method_options(method: str, *, drafter: object = None, budget: int | None = None, builder: str | None = None,
                         verify: str | None = None, skip_drafting: bool | None = None,
                         cost_aware_stop: bool | None = None, name: Callable[[str], str] = str) -> None:
    """Raises ``ValueError`` (one sentence) for speculative options ``method`` cannot use: a drafter for a
    method without a block drafter, or for ``ar`` any drafting option given (a budget, a builder, a rule,
    or draft skipping or the stop turned on); checked before anything loads. ``name`` words an option
    in the error (the CLI's gives its flag)."""
    check_drafter_use(method, drafter, name)
    given = {"budget": budget is not None, "builder": builder is not None, "verify": verify is not None,
             "skip_drafting": bool(skip_drafting), "cost_aware_stop": bool(cost_aware_stop)}
    if recipe(method).proposer is None and any(given.values()):
        raise ValueError(f"method {method!r} drafts nothing; drop {', '.join(name(k) for k, v in given.items() if v)}.")


def check_drafter_use(method: str, drafter: object, name: Callable[[str], str] = str) -> None:
    """Raises ``ValueError`` (one sentence) for a drafter (anything but ``None``) given to a method that
    uses no block drafter (``ar``, ``prompt_lookup``); ``name`` words the option, as in
    ``check_method_options``."""
    if drafter is not None and recipe(method).proposer != "block":
        raise ValueError(f"method {method!r} uses no block drafter; drop {name('drafter')} {drafter!r}.")


def speculation(method: str, target: Decoder, budget: int = DEFAULT_BUDGET, *,
                drafter: BlockDrafter | None = None, builder: str | None = None,
                verify: str | None = None, skip_drafting: bool | None = None,
                cost_aware_stop: bool | None = None) -> Speculation | None:
    """The speculative settings of ``method`` (``None`` for plain autoregressive decoding): the
    one place where a recipe's defaults and the user's overrides become final values
    (``decode/plan.py`` then resolves them against a call's temperature and cost model).

    Args:
      method: one of ``METHODS``.
      target: the target decoder (its embedding and LM head are shared with a block drafter).
      budget: maximum drafted nodes per round N (≥ 1). A chain verifies ``min(N, γ)`` nodes.
      drafter: the block drafter, required by the methods in ``DRAFTER_METHODS``.
      builder: overrides the recipe's builder (``config.BUILDERS``).
      verify: overrides the recipe's verify rule at temperature > 0 (``config.VERIFY_RULES``).
      skip_drafting: draft skipping (``Speculation.skip_drafting``); ``None`` means on for every
        drafting method.
      cost_aware_stop: the cost-aware stop of a block-drafter method (``Speculation.cost_aware_stop``);
        ``None`` keeps the recipe's (on for ``dspark``, and for any method with the ``treespark``
        builder), ``False`` verifies all N nodes every round (τ at equal budget), ``True`` adds the
        stop to any builder (ablations).

    Raises:
      ValueError: unknown method, builder or rule; a budget outside 1..MAX_BUDGET; a drafter method without
        a drafter; overrides (or ``skip_drafting``, or ``cost_aware_stop``) given for ``ar``;
        ``cost_aware_stop=True`` for ``prompt_lookup``, which has no draft probabilities to stop on.
    """
    from treespark_jax.decode.plan import Speculation
    from treespark_jax.drafter.block_proposer import BlockProposer
    from treespark_jax.drafter.prompt_lookup import PromptLookup

    r = recipe(method)
    check_budget(budget)
    check_method_options(method, drafter=drafter, builder=builder, verify=verify, skip_drafting=skip_drafting,
                         cost_aware_stop=cost_aware_stop)
    if r.proposer is None:
        return None
    skip_drafting = True if skip_drafting is None else skip_drafting
    builder, verify = parse_enum(Builder, builder or r.builder, "builder"), verify or r.verify
    if r.proposer == "prompt_lookup":
        if cost_aware_stop:
            raise ValueError("method 'prompt_lookup' has no draft probabilities for the cost-aware stop; "
                             "drop cost_aware_stop (--cost-aware-stop).")
        # Prompt lookup drafts one chain whatever the builder: its proposal has a single candidate.
        return Speculation(PromptLookup(target.cfg.vocab_size, block_size=budget),
                           TreeConfig(budget=budget, max_depth=budget, branch=1, builder=builder),
                           verify=verify, cost_aware_stop=False, skip_drafting=skip_drafting)
    if drafter is None:
        raise ValueError(f"method {method!r} needs a trained block drafter; pass one with --drafter PATH "
                         "(or drafter= in the API).")
    gamma = drafter.cfg.depths
    n = min(budget, gamma) if builder is Builder.CHAIN else budget
    tree = TreeConfig(budget=n, max_depth=min(n, gamma), branch=TREE_BRANCH, builder=builder)
    if cost_aware_stop is None:
        cost_aware_stop = r.cost_aware_stop or builder is Builder.TREESPARK
    return Speculation(BlockProposer.create(drafter, target, depth=tree.max_depth), tree, verify=verify,
                       cost_aware_stop=cost_aware_stop, skip_drafting=skip_drafting)
