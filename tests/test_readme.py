"""Every command in the README is run by this test or by `make demo`.

The README's ```bash blocks are split into commands (backslash continuations and quoted
newlines joined, comments dropped). Each command is one of:

- a command of the Makefile's ``demo`` target, written as the README writes it
  (``$(PY) -m treespark_jax.cli`` → ``treespark``, ``$(PROMPT)`` → its default); the README must
  show every one of them;
- in ``ALLOWED`` with the test or make target that runs it (the entry points ``make demo`` /
  ``make test`` and what needs hardware this suite does not have);
- otherwise run here, in README order, with the ``treespark`` console script of this
  environment on ``PATH``, from a scratch directory (so ``runs/...`` outputs of earlier commands
  feed later ones), and it must exit with status 0.

The ```python blocks are compiled (fast) and run after the commands (slow).

So a command added to the README is either run by ``test_readme_command`` (and must work) or
must be added to ``ALLOWED`` with its reason; a stale allow-list entry fails too. The fast
test checks the bookkeeping; running the commands is slow (the real default model).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
MAKEFILE = REPO / "Makefile"

# Commands not run by this test: normalised command → what runs it.
ALLOWED: dict[str, str] = {
    "make demo": "the Makefile's demo target (its commands are checked against the README by "
                 "test_make_demo_commands_are_in_the_readme; tests/test_cli.py::"
                 "test_default_method_uses_the_shipped_drafter_and_compares_with_ar runs the same generate --compare-ar)",
    "make test": "the Makefile's test target, which runs this test",
    "gcloud compute tpus tpu-vm ssh my-slice --zone us-west4-a --worker=all --command ' "
    "cd treespark-jax && TREESPARK_DISTRIBUTED=1 .venv/bin/treespark train --rollouts /mnt/shared/rollouts/gsm8k "
    "--loss dspark --batch-size 256 --dtype bfloat16 --mesh data=32 --out /mnt/shared/runs/dspark'":
        "needs a TPU pod slice; the multi-host training path (jax.distributed, per-process data, one run "
        "directory) is run by tests/test_sharding.py::test_two_processes_train_as_one_job_and_match_one_process",
    "JAX_COORDINATOR_ADDRESS=10.0.0.2:1234 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=0 treespark train --rollouts "
    "/shared/rollouts --loss dspark --batch-size 128 --dtype bfloat16 --mesh data=8,model=2 --out /shared/runs/dspark":
        "needs two hosts; the same environment variables on two local processes are run by "
        "tests/test_sharding.py::test_two_processes_train_as_one_job_and_match_one_process",
    "treespark generate --target /path/to/Qwen3-8B --dtype bfloat16 --method ddtree --budget 32 --drafter "
    "/path/to/Qwen3-8B-DFlash-b16 --prompt 'def fib(n):' --max-new-tokens 64":
        "needs z-lab's published DFlash drafter (no model hub here); a z-lab DFlash directory made by the dflash "
        "package is decoded by tests/test_formats_decode.py (every builder, and generate(drafter=PATH))",
    "treespark export-drafter --drafter /path/to/Qwen3-8B-DFlash-b16 --target /path/to/Qwen3-8B --format "
    "speculators --out runs/qwen3-dflash-speculators":
        "needs z-lab's published DFlash drafter; tests/test_formats.py exports drafters and loads them with the "
        "dflash and speculators packages, and runs export-drafter's command line on bad input",
}

# Placeholder paths of the README and what this test puts in their place.
PLACEHOLDERS = {"/path/to/Qwen3-8B": "tiny_hf"}  # a tiny random Llama HF directory (tests/tiny.py)

COMMAND_TIMEOUT_S = 900


def _continued(text: str) -> str:
    """One logical line: backslash-newline continuations become spaces."""
    return re.sub(r"\s*\\\n\s*", " ", text)


def readme_commands(text: str | None = None) -> list[str]:
    """The commands of the README's ```bash blocks in order, each as written (continuations kept)."""
    text = README.read_text() if text is None else text
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.M | re.S):
        pending = ""
        for line in block.splitlines():
            if not pending and (not line.strip() or line.lstrip().startswith("#")):
                continue
            pending = f"{pending}\n{line}" if pending else line
            if pending.endswith("\\"):
                continue
            try:
                shlex.split(_continued(pending), comments=True)
            except ValueError:  # a quotation still open: the command goes on
                continue
            commands.append(pending)
            pending = ""
        assert not pending, f"unterminated command in a README bash block: {pending!r}"
    return commands


def normalise(command: str) -> str:
    """The command as one line of shell words, comments dropped, whitespace runs collapsed (for comparing)."""
    return " ".join(shlex.join(shlex.split(_continued(command), comments=True)).split())


def make_demo_commands() -> list[str]:
    """The demo target's recipe as the README writes it."""
    text = MAKEFILE.read_text()
    prompt = re.search(r"^PROMPT \?= (.*)$", text, flags=re.M).group(1).strip()
    recipe = re.search(r"^demo:.*\n((?:\t.*\n)+)", text, flags=re.M).group(1)
    out = []
    for line in recipe.splitlines():
        line = line.strip().replace("$(PY) -m treespark_jax.cli", "treespark").replace("$(PROMPT)", prompt)
        out.append(normalise(line))
    return out


def _env_and_argv(command: str) -> tuple[list[str], list[str]]:
    words = shlex.split(_continued(command), comments=True)
    i = 0
    while i < len(words) and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[i]):
        i += 1
    return words[:i], words[i:]


COMMANDS = readme_commands()
DEMO = set(make_demo_commands())


def _to_run() -> list[str]:
    return [c for c in COMMANDS if normalise(c) not in ALLOWED and normalise(c) not in DEMO]


def test_readme_commands_are_found():
    assert len(COMMANDS) >= 15
    assert normalise(COMMANDS[0]) == "make demo"
    assert any(_env_and_argv(c)[1][:2] == ["treespark", "train"] and "\\\n" in c for c in COMMANDS)


def test_every_readme_command_is_run_or_allow_listed():
    """What ``test_readme_command`` cannot run (not the ``treespark`` command, or an unfilled
    placeholder path) must be allow-listed; allow-list entries must still be in the README."""
    listed = {normalise(c) for c in COMMANDS}
    stale = [c for c in ALLOWED if c not in listed]
    assert not stale, f"allow-listed commands no longer in README.md: {stale}"
    for command in _to_run():
        argv = _env_and_argv(command)[1]
        assert argv and argv[0] == "treespark", (
            f"README command {normalise(command)!r} is neither run by tests/test_readme.py (it runs the treespark "
            "command) nor in its ALLOWED list with the test or make target that runs it.")
        unfilled = [w for w in argv if "/path/to/" in w and not any(w.startswith(p) for p in PLACEHOLDERS)]
        assert not unfilled, f"README command {normalise(command)!r} has placeholder paths without a substitute: {unfilled}"
    for placeholder in PLACEHOLDERS:
        assert placeholder in README.read_text(), f"placeholder {placeholder} is no longer in README.md"


def test_make_demo_commands_are_in_the_readme():
    """The README shows literally what `make demo` runs."""
    listed = [normalise(c) for c in COMMANDS]
    missing = [c for c in make_demo_commands() if c not in listed]
    assert not missing, f"`make demo` runs commands the README does not show: {missing}"


def test_readme_python_blocks_compile():
    for block in re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.M | re.S):
        compile(block, "README.md", "exec")


def test_parser_joins_continuations_and_open_quotes():
    text = ("```bash\n# a comment\ntreespark a --x 1 \\\n    --y 2   # trailing\n\n"
            "gcloud ssh --command '\n  cd x && run \\\n  --z'\n```\n```python\nprint()\n```\n")
    got = readme_commands(text)
    assert [normalise(c) for c in got] == ["treespark a --x 1 --y 2", "gcloud ssh --command ' cd x && run --z'"]


# ------------------------------------------------------------------ running the commands (slow)

@pytest.fixture(scope="module")
def workspace(tmp_path_factory, smollm2_gguf):
    """A scratch working directory, a cache root that shares the fetched assets (so `profile`
    writes its cost model here, not into the user's cache) and the placeholder targets."""
    root = tmp_path_factory.mktemp("readme")
    work, cache = root / "work", root / "cache"
    work.mkdir()
    cache.mkdir()
    (cache / "assets").symlink_to(Path(smollm2_gguf).parent, target_is_directory=True)
    sys.path.insert(0, str(REPO / "tests"))
    from tiny import CHATML, write_tiny_hf_target

    paths = {"tiny_hf": write_tiny_hf_target(root / "hf-target", layers=8, d=48, mlp=80, head_dim=16,
                                             max_positions=4096, chat_template=CHATML)}
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
                        "TREESPARK_DISTRIBUTED", "TREESPARK_JAX_CACHE")}
    # The compilation cache is on, as for a user, in this run's own directory: commands that
    # compile the same program (the rollouts' and generate's AR loops) share it.
    env.update(TREESPARK_CACHE=str(cache), PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    return {"work": work, "env": env, "paths": paths, "failed": []}


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("command", _to_run(), ids=lambda c: normalise(c)[:90])
def test_readme_command(workspace, command):
    if workspace["failed"]:
        pytest.skip(f"an earlier README command failed: {workspace['failed'][0]}")
    run = _continued(command)
    for placeholder, key in PLACEHOLDERS.items():
        run = run.replace(placeholder, str(workspace["paths"][key]))
    try:
        proc = subprocess.run(["bash", "-c", run], cwd=workspace["work"], env=workspace["env"],
                              capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        workspace["failed"].append(normalise(command))
        raise
    if proc.returncode != 0:
        workspace["failed"].append(normalise(command))
    assert proc.returncode == 0, f"{normalise(command)}\nexit {proc.returncode}\n{proc.stderr[-4000:]}"
    argv = _env_and_argv(command)[1]
    for flag in ("--out", "--json-out"):  # what a command says it writes is there
        if flag in argv and argv[1] != "profile":
            assert (workspace["work"] / argv[argv.index(flag) + 1]).exists(), f"{flag} of {normalise(command)}"
    if argv[1] == "train":
        assert (workspace["work"] / argv[argv.index("--out") + 1] / "drafter" / "drafter.json").is_file()


@pytest.mark.slow
@pytest.mark.e2e
def test_readme_python_blocks_run(workspace):
    """The Python API block runs as written, after the commands (it uses their `runs/treespark`)."""
    if workspace["failed"]:
        pytest.skip(f"an earlier README command failed: {workspace['failed'][0]}")
    for block in re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.M | re.S):
        proc = subprocess.run([sys.executable, "-c", block], cwd=workspace["work"], env=workspace["env"],
                              capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
        assert proc.returncode == 0, f"README python block\n{block}\nexit {proc.returncode}\n{proc.stderr[-4000:]}"
        assert proc.stdout.strip(), "the README python block printed nothing"
