# jddp: `make train` runs the main job, `make test` the test suite. Each sets up .venv itself.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The compile-only CUDA/TPU plugins (installed for the tests) print start-up noise on machines
# without those devices; jddp's own runs here use the CPU backend.
export JAX_PLATFORMS ?= cpu

.PHONY: train test lint docs docs-serve bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# The main job needs the package and the example's extras only.
$(VENV)/.train-deps: pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install -q -e ".[examples]"
	touch $@

# The tests also need the dev tools and the compile-only GPU/TPU compilers (about 350 MB).
$(VENV)/.test-deps: pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install -q -e ".[dev,xla-compile]"
	touch $@

# The docs site's tools (mkdocs, mkdocs-material, mkdocstrings-python).
$(VENV)/.docs-deps: pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install -q -e ".[docs]"
	touch $@

# A real data-parallel training run on 8 simulated CPU devices, with a progress bar and a result.
train: $(VENV)/.train-deps
	mkdir -p out
	$(PY) examples/train_digits.py --devices 8 --json out/digits.json

# Two pytest workers (pytest-xdist): one test mostly keeps one core busy (tracing and compiling),
# so two workers use both cores of a CI machine (worksteal: an idle worker takes queued tests
# from the busy one, so a slow test at the end does not leave a core idle). TEST_WORKERS=0 runs
# in one process.
TEST_WORKERS ?= 2
test: $(VENV)/.test-deps
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal

lint: $(VENV)/.test-deps
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(PY) scripts/module_map.py --check

# The docs site (mkdocs.yml) in site/; --strict: a warning, a broken link or a missing reference
# fails the build. The API pages are rendered from the docstrings.
docs: $(VENV)/.docs-deps
	$(VENV)/bin/mkdocs build --strict

# The docs site served at http://127.0.0.1:8000/ with search, rebuilt on every edit (site/ opened
# as files has no search and lists directories instead of pages).
docs-serve: $(VENV)/.docs-deps
	$(VENV)/bin/mkdocs serve

# Every benchmark: tables on stdout, JSON and PNG under benchmarks/out/ (about 45 minutes on 2
# cores; the GPU overlap report alone takes 3-6, the local SGD convergence runs about 10).
OUT := benchmarks/out
bench: $(VENV)/.test-deps
	$(PY) benchmarks/step_time.py --sweep --json $(OUT)/step_time.json
	$(PY) benchmarks/peers.py --json $(OUT)/peers.json
	$(PY) benchmarks/step_overhead.py --json $(OUT)/step_overhead.json
	$(PY) benchmarks/accumulate.py --json $(OUT)/accumulate.json
	$(PY) benchmarks/hooks.py --json $(OUT)/hooks.json
	$(PY) benchmarks/costmodel_validate.py --json $(OUT)/costmodel_validate.json --png $(OUT)/costmodel_validate.png
	$(PY) benchmarks/scaling_predictions.py --json $(OUT)/scaling_predictions.json --png $(OUT)/scaling_predictions.png
	$(PY) benchmarks/gpu_overlap.py --out $(OUT)
	$(PY) benchmarks/hierarchical.py --json $(OUT)/hierarchical.json
	$(PY) benchmarks/level_bytes.py --json $(OUT)/level_bytes.json
	$(PY) benchmarks/local_sgd_digits.py --json $(OUT)/local_sgd_digits.json --png $(OUT)/local_sgd_digits.png
	$(PY) benchmarks/scaling_hosts.py --json $(OUT)/scaling_hosts.json --png $(OUT)/scaling_hosts.png
	$(PY) benchmarks/compile_depth.py --steady 20 --json $(OUT)/compile_depth.json --png $(OUT)/compile_depth.png

clean:
	rm -rf $(VENV) out site .pytest_cache
