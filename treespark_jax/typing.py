"""Shape legend and jaxtyping aliases shared by the whole package.

Dimension letters (used in jaxtyping annotations and einsum strings):

===  =========================================================
B    batch rows
T    query tokens of one model call
S    cache (key) slots
D    model width
F    MLP width
H    query heads
K    key/value heads
E    head dim
V    vocabulary
L    decoder layers
N    draft-tree nodes (the budget, anchor not counted)
P    drafter block slots (the block size γ)
M    candidate pool per depth
R    Markov-head rank
===  =========================================================
"""

from __future__ import annotations

from jaxtyping import Array, Bool, Float, Int, Key, PRNGKeyArray

__all__ = ["Array", "Bool", "Float", "Int", "Key", "PRNGKeyArray"]
