# Two commands: `make demo` and `make test` (`make test-fast` leaves out the tests marked slow). Both create .venv on first use and reuse it after.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo demo-agent demo-vision test test-fast lint bench clean-venv sandbox-deps

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@# Prefer a CPU build of torch on a machine without an NVIDIA GPU (the wheel is ~10x smaller).
	@if ! $(BIN)/python -c "import torch" 2>/dev/null; then \
	  if command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install "torch>=2.11,<2.15"; \
	  else $(BIN)/pip install "torch==2.13.0" --extra-index-url https://download.pytorch.org/whl/cpu --retries 0 --timeout 10 \
	       || $(BIN)/pip install "torch==2.13.0"; fi; fi
	$(BIN)/pip install -e ".[test]"
	@rm -f $(VENV)/.installed-* && touch $@

demo: $(STAMP)
	$(BIN)/reinforge demo

# a small model learns by GRPO to call a calculator (multi-turn agent loop)
demo-agent: $(STAMP)
	$(BIN)/reinforge demo --agent

# a tiny vision-language model learns by GRPO to count red squares in pictures (SFT with a flaw, then GRPO)
demo-vision: $(STAMP)
	$(BIN)/reinforge demo --vision

# The code sandbox (reinforge/sandbox, tests/sandbox) isolates programs with bubblewrap: install it where
# missing when we can (root on Debian/Ubuntu); otherwise say so, and tests/sandbox skips.
sandbox-deps:
	@command -v bwrap >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap; \
	  else echo "note: bubblewrap (bwrap) is missing, tests/sandbox will be skipped; install it: sudo apt-get install -y bubblewrap"; fi; }

# Each run keeps its files in a folder of its own (pytest's default, /tmp/pytest-of-USER, is shared by every run on
# the machine, and a run there removes the folders of older runs, even of one still going): removed when the run
# passes, kept and named when it fails. pytest exits 5 when it collects nothing; that is not a failure of the code
# under test. Compiled modules are written, even where the environment says PYTHONDONTWRITEBYTECODE, to the
# __pycache__ folders beside their sources (which git ignores): without them every worker, CLI run and Ray member
# compiles reinforge's and the tests' modules again. A folder of the run's own (PYTHONPYCACHEPREFIX) would hide the
# compiled modules pip wrote for the installed packages, and each run would compile torch, transformers and Ray
# again, in each of its first processes at once (3 workers' collection: about 80 s of CPU against 50 s).
PYTEST_RUN = tmp=$$(mktemp -d "$${TMPDIR:-/tmp}/reinforge-tests.XXXXXX") || exit 1; unset PYTHONDONTWRITEBYTECODE;
PYTEST_END = rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; rc=0; fi; \
	if [ $$rc -eq 0 ]; then rm -rf "$$tmp"; else echo "the failed run's files are in $$tmp"; fi; exit $$rc
# Three workers on a 2-core machine: a third of the suite's time goes to tests waiting on the processes they start
# (CLI runs, Ray members, servers, sandboxes), so a third worker keeps both cores busy.
test: $(STAMP) sandbox-deps
	$(PYTEST_RUN) $(BIN)/python -m pytest -q -n 3 --dist loadfile --durations=15 --basetemp="$$tmp/pytest"; $(PYTEST_END)

# the suite without the tests that take more than 5 s each on a 2-core CPU (@pytest.mark.slow)
test-fast: $(STAMP) sandbox-deps
	$(PYTEST_RUN) $(BIN)/python -m pytest -q -n 3 --dist loadfile -m "not slow" --durations=15 --basetemp="$$tmp/pytest"; $(PYTEST_END)

# The standard training table on a GPU: every size in a process of its own, TRL's GRPOTrainer beside each, one
# markdown table printed last; each case's JSON lands in $(BENCH_OUT). In parts, when one sitting is too short for
# every size: make bench BENCH_SIZES=0.5b,1.5b,3b, then make bench BENCH_SIZES=7b, then
# .venv/bin/reinforge bench table bench_out prints one table of both. BENCH_ARGS adds options, e.g. --deadline-s 570.
BENCH_SIZES ?= 0.5b,1.5b,3b,7b
BENCH_OUT ?= bench_out
BENCH_ARGS ?=
bench: $(STAMP)
	@$(BIN)/python -c "import trl, datasets" 2>/dev/null || $(BIN)/pip install -e ".[bench]"
	$(BIN)/reinforge bench train --model $(BENCH_SIZES) --trl --out $(BENCH_OUT) $(BENCH_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check reinforge tests benchmarks

clean-venv:
	rm -rf $(VENV)
