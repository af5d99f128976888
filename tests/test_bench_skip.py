"""experiments/bench_skip.py: the monotone stop table it ablates the convex fit with."""

import numpy as np
import pytest

from scripts import load_script
from treespark_jax.decode.cost_model import CostModel


def _script():
    return load_script("experiments/bench_skip.py")


def test_monotone_table_keeps_the_raw_medians_made_non_decreasing():
    measured = [[41.0, 48.0, 46.0, 70.0], [40.0, 51.0, 66.0, 72.0]]  # a dip in rows, a crossing in context
    cost = CostModel.fit((64, 256), (2, 3, 5, 9), measured, [12.0, 10.0])
    table = _script().monotone_table(cost)
    np.testing.assert_allclose(table.verify_ms, [[40.5, 49.0, 56.5, 71.0]] * 2)  # 41, 47, 47, 70 pooled with row 2
    np.testing.assert_allclose(table.draft_ms, [11.0, 11.0])
    assert table.measured_verify_ms == cost.measured_verify_ms and table.step_ms == cost.step_ms
    bare = CostModel(contexts=cost.contexts, rows=cost.rows, verify_ms=cost.verify_ms, draft_ms=cost.draft_ms)
    with pytest.raises(SystemExit, match="no raw verify medians"):
        _script().monotone_table(bare)
