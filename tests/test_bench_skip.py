"""experiments/bench_skip.py: the convex stop table it compares the default stop with."""

import numpy as np
import pytest

from scripts import load_script
from treespark_jax.decode.cost_model import CostModel


def _script():
    return load_script("experiments/bench_skip.py")


def test_convex_table_prices_the_stop_and_skipping_with_the_fit():
    measured = [[41.0, 48.0, 46.0, 70.0], [40.0, 51.0, 66.0, 72.0]]  # a dip in rows, a crossing in context
    cost = CostModel.fit((64, 256), (2, 3, 5, 9), measured, [12.0, 10.0], [30.0, 31.0])
    table = _script().convex_table(cost)
    ladder = (1, 2, 4, 8)
    np.testing.assert_allclose(table.measured_verify_cost(ladder, 64), cost.verify_cost(ladder, 64))
    np.testing.assert_allclose(cost.measured_verify_cost(ladder, 64), [40.5, 49.0, 56.5, 71.0])
    assert table.verify_ms == cost.verify_ms and table.step_ms == cost.step_ms and table != cost
    bare = CostModel(contexts=cost.contexts, rows=cost.rows, verify_ms=cost.verify_ms, draft_ms=cost.draft_ms)
    with pytest.raises(SystemExit, match="no raw verify medians"):
        _script().convex_table(bare)
