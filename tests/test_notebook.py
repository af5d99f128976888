"""The demo notebook: committed clean and in sync with its builder, and it runs top to bottom.

The run (slow) executes ``notebooks/treespark_demo.ipynb`` headlessly with nbclient in a Python 3
kernel of this environment, with ``TREESPARK_NOTEBOOK_SMALL=1`` (small sizes) and its outputs
in a temporary folder; any cell error fails the test. The notebook writes each plot as a PNG with
a JSON of what it plotted next to it, which is checked here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from scripts import load_script

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "treespark_demo.ipynb"
CELL_TIMEOUT_S = 1200

nbformat = pytest.importorskip("nbformat")


def _builder():
    return load_script("notebooks/build_demo_notebook.py")


def test_committed_notebook_is_clean_and_matches_its_builder():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, "commit the notebook without outputs"
    assert NOTEBOOK.read_text() == _builder().render(), (
        "notebooks/treespark_demo.ipynb differs from what notebooks/build_demo_notebook.py writes; re-run the builder")


def test_notebook_names_the_runtime_switch_and_the_field_terms():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    first_code = next(c.source for c in nb.cells if c.cell_type == "code")
    assert first_code.startswith('RUNTIME = "cpu"  # or "gpu" / "tpu"') and "REPO_URL = " in first_code
    text = " ".join(c.source for c in nb.cells if c.cell_type == "markdown").lower()
    for term in ("target", "drafter", "anchor", "draft tree", "budget", "τ", "bonus token", "verification"):
        assert term in text, f"the notebook's text never explains {term!r}"


def _png(path: Path):
    import matplotlib.image as mpimg

    assert path.is_file() and path.stat().st_size > 5_000, f"{path} missing or nearly empty"
    image = mpimg.imread(path)
    assert image.ndim == 3 and image.shape[2] in (3, 4), image.shape
    height, width = image.shape[:2]
    assert 200 <= height <= 4000 and 300 <= width <= 6000, (height, width)
    assert image[..., :3].std() > 0.01, "the image is blank"


@pytest.mark.slow
@pytest.mark.notebook
def test_notebook_runs_top_to_bottom(tmp_path, monkeypatch, smollm2_gguf):
    from nbclient import NotebookClient

    out = tmp_path / "out"
    monkeypatch.setenv("TREESPARK_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("TREESPARK_NOTEBOOK_OUT", str(out))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, kernel_name="python3", timeout=CELL_TIMEOUT_S,
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()  # raises on a cell error
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "identical greedy output: " in printed  # False only at a float32 near-tie (DESIGN.md §1.3)
    assert "treespark_jax is importable: True" in printed

    _png(out / "draft_tree.png")
    tree = json.loads((out / "draft_tree.json").read_text())
    assert tree["xlabel"] == "depth (tokens after the anchor)" and tree["anchor"]
    nodes = {n["index"]: n for n in tree["nodes"]}
    assert nodes and any(n["verified"] for n in nodes.values())
    for n in nodes.values():
        assert n["text"] and (n["parent"] == -1 or n["parent"] in nodes) and n["depth"] >= 1
        assert n["depth"] == (1 if n["parent"] == -1 else nodes[n["parent"]]["depth"] + 1)
        assert not n["accepted"] or n["verified"]
    path = tree["accepted_path"]
    assert path == [i for i, n in nodes.items() if n["accepted"]]
    assert [nodes[i]["parent"] for i in path] == ([-1] + path)[:len(path)], "accepted nodes must form one path"

    _png(out / "budget_sweep.png")
    sweep = json.loads((out / "budget_sweep.json").read_text())
    assert [(a["xlabel"], a["ylabel"]) for a in sweep["axes"]] == [("budget", "τ"), ("budget", "speedup vs AR")]
    tau, speed = sweep["axes"]
    assert tau["x"] == speed["x"] == [2.0, 4.0]  # the small settings' budgets
    assert all(t >= 1.0 for t in tau["y"]) and all(s > 0 for s in speed["y"])
    assert {r["method"] for r in sweep["rows"]} == {"ar", "treespark"}
    assert all(r["greedy_equal"] is not False or all(d["near_tie"] for d in r["divergences"]) for r in sweep["rows"])

    run = next(out.glob("dspark-*steps"))
    assert (run / "drafter" / "drafter.json").is_file()
    assert "dspark with the drafter trained above: τ = " in printed
