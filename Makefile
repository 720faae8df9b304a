# The two commands of the README: `make demo` and `make test`. Both set everything up first.
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test lint typecheck unit integration bench clean

setup:
	@scripts/setup.sh

# `make demo DASHBOARD=1` serves the web dashboard beside the run (the URL is printed) and keeps it up after the
# run ends, until Ctrl-C.
demo: setup
	$(BIN)/coordinator launch $(if $(DASHBOARD),--dashboard --keep-dashboard)

# The suite runs in TEST_WORKERS processes (pytest-xdist), each test file whole in one of them (--dist loadfile:
# a file's module-scoped beds and runs are made once). An integration test leaves the cores idle while it waits
# (SSH round trips, heartbeat and stall windows, a run's pacing); a second worker uses that time.
# Files go out in collection order (--no-loadscope-reorder), the long integration files first and the many short
# unit files last, so that no long file is left to run alone at the end. TEST_WORKERS=0 runs everything in this
# one process. --durations=25: CI prints where the time goes.
# The suite starts hundreds of coordinator and worker processes from this tree. Where PYTHONDONTWRITEBYTECODE is
# set (this project's VMs set it) none of them may write its bytecode, so each compiled the modules it imports again
# (about 0.3 s of CPU for the imports of a `launch`: 1.80 against 1.51 s, measured); compiled once here, every
# one of them reads it.
TEST_WORKERS ?= 2

test: setup lint typecheck
	$(BIN)/python -m compileall -q coordinator worker tests
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		--durations=25 tests

lint:
	$(BIN)/ruff check coordinator worker tests benchmarks

typecheck:
	$(BIN)/mypy --strict coordinator worker

unit: setup
	$(BIN)/python -m pytest -q tests/unit

integration: setup
	$(BIN)/python -m pytest -q tests/integration

bench: setup
	$(BIN)/python -m pip install -q -e ".[bench]"
	$(BIN)/python benchmarks/bench_preflight.py
	$(BIN)/python benchmarks/bench_hash.py

clean:
	rm -rf runs .pytest_cache .mypy_cache .ruff_cache
