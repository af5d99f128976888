# Two commands: `make demo` and `make test`. Both create the virtual environment if missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= A farmer has 12 cows and buys 3 times as many sheep. How many animals does he have now? Think step by step.

.PHONY: demo test test-fast install install-test clean-venv

$(VENV)/.runtime: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

# Test oracles for the drafter formats (tests/test_formats.py), without their heavy requirement sets;
# what their modules import is in the test extra.
FORMAT_ORACLES := dflash==0.1.0 speculators==0.9.0 hs-connectors==0.9.0

$(VENV)/.test: $(VENV)/.runtime
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps $(FORMAT_ORACLES)
	touch $@

install: $(VENV)/.runtime

install-test: $(VENV)/.test

demo: install
	$(PY) -m treespark_jax.cli models fetch smollm2-135m
	$(PY) -m treespark_jax.cli generate --chat --prompt "$(PROMPT)" --max-new-tokens 128 --compare-ar

# Three pytest runs, so that memory held by one group (real 0.5B weights, hundreds of one-off
# compiled programs) never adds up with another's on a 24 GiB machine. The fast and the slow
# group each run in TEST_WORKERS processes, one test file per worker at a time: compiling is
# single-threaded, so on 2 cores two workers keep both busy (the fast group: 2,098 s with two
# workers, 65 CPU-minutes, where one process took 2,847 s in CI). The parity group (real 0.5B
# weights in JAX and in torch at once) runs alone.
TEST_WORKERS ?= 2
test: test-fast
	$(PY) -m pytest -q -m "slow and parity" $(PYTEST_ARGS)
	$(PY) -m pytest -q -m "slow and not parity" -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test-fast: install-test
	$(PY) -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
