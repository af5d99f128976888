"""An imported z-lab DFlash drafter (built and saved by the ``dflash`` package) decodes the tiny
float64 Qwen3 target with every tree builder, greedy output equal to greedy AR."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from format_oracles import zlab_drafter
from rounds import assert_round_accounting
from specs import spec
from tiny import SPEC_PROMPTS, TINY_FIELDS
from treespark_jax.config import TreeConfig
from treespark_jax.decode.engine import Engine
from treespark_jax.drafter import formats
from treespark_jax.drafter.block_proposer import BlockProposer

pytestmark = pytest.mark.parity


@pytest.fixture(scope="module")
def imported(target64, tmp_path_factory):
    path = tmp_path_factory.mktemp("zlab") / "drafter"
    zlab_drafter(path, layer_ids=(0, 1), block_size=5)
    return formats.read(path).to_drafter(target64.cfg, jnp.float64)


@pytest.mark.parametrize("builder, budget, branch", [
    ("chain", 4, 1),  # the dflash method; the tree builders take ~15 s each
    pytest.param("marginal", 8, 3, marks=pytest.mark.slow),  # ddtree
    pytest.param("parent_conditioned", 8, 3, marks=pytest.mark.slow),  # pctree-style
    pytest.param("treespark", 8, 3, marks=pytest.mark.slow),  # Platt-scaled q in place of the absent edge head
])
def test_imported_dflash_drafter_decodes_greedy_equal_to_ar(target64, ar_reference, imported, builder, budget,
                                                            branch):
    assert imported.cfg.depths == 4  # block of 5, the anchor slot does not predict
    tree = TreeConfig(budget=budget, max_depth=4, branch=branch, builder=builder)
    proposer = BlockProposer.create(imported, target64, depth=tree.max_depth)
    ids, stats = Engine(target64, stop_ids=[]).generate(SPEC_PROMPTS, 40, spec=spec(
        proposer, tree, cost_aware_stop=builder == "treespark"))
    assert ids == ar_reference
    assert_round_accounting(ids, stats, tree.max_depth)


@pytest.mark.slow
def test_api_generate_takes_a_dflash_directory_as_drafter(tmp_path):
    from tiny import write_tiny_hf_target
    from treespark_jax.api import load

    target = write_tiny_hf_target(tmp_path / "qwen3", layers=3, d=48, mlp=80, head_dim=16, max_positions=128,
                                  family="qwen3")
    zlab_drafter(tmp_path / "zlab", fields=dict(TINY_FIELDS, vocab_size=259))
    lm = load(str(target))
    ar = lm.generate("abcabc", max_new_tokens=12, method="ar")
    out = lm.generate("abcabc", max_new_tokens=12, method="dflash", drafter=str(tmp_path / "zlab"))
    assert out.token_ids == ar.token_ids and lm.drafter("dflash", str(tmp_path / "zlab")).cfg.mask_token_id == 258


MESH_SCRIPT = """
import json, sys
from treespark_jax.api import load
hf, zlab = sys.argv[1:3]
out = {}
for method in ("dflash", "ddtree"):
    replies = [[r.token_ids for r in load(hf, "float64", mesh=m).generate(
        ["tree", "spark!"], max_new_tokens=12, method=method, budget=6, drafter=zlab)]
               for m in ("data=1", "data=2,model=4")]
    out[method] = [replies[0] == replies[1], replies[0]]
print(json.dumps(out))
"""


@pytest.mark.multidevice
@pytest.mark.slow
def test_imported_drafter_on_a_data2_model4_mesh_equals_one_device(tmp_path):
    import json
    import os
    import subprocess
    import sys

    from tiny import write_tiny_hf_target

    target = write_tiny_hf_target(tmp_path / "qwen3", layers=3, d=48, mlp=80, head_dim=16, max_positions=128,
                                  family="qwen3")
    zlab_drafter(tmp_path / "zlab", fields=dict(TINY_FIELDS, vocab_size=259))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run([sys.executable, "-c", MESH_SCRIPT, str(target), str(tmp_path / "zlab")], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for method, (equal, ids) in report.items():
        assert equal and all(len(row) == 12 for row in ids), (method, ids)
