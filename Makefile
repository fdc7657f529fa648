# jddp: `make train` runs the main job, `make test` the test suite. Each sets up .venv itself.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.jddp-installed

.PHONY: train test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

# A real data-parallel training run on 8 simulated CPU devices, with a progress bar and a result.
train: $(STAMP)
	mkdir -p out
	$(PY) examples/train_digits.py --devices 8 --json out/digits.json

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check jddp tests examples benchmarks

bench: $(STAMP)
	mkdir -p benchmarks/out
	$(PY) benchmarks/step_time.py --json benchmarks/out/step_time.json

clean:
	rm -rf $(VENV) out .pytest_cache
