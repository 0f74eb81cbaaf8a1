# einpage: `make demo` runs the main job, `make test` runs the tests.
# Both work on a fresh machine: they create .venv, install the project with the
# extras they need, and install Debian's graphviz (for `dot`) when it is missing.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: demo notebooks test test-gpu gpu-venv lint dot clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# One stamp per set of extras, remade when the package metadata changes.
# `.core` is what the demo needs: the package and its pictures (the viz extra).
$(VENV)/.core: setup.cfg pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[viz]'
	touch $@

$(VENV)/.dev: setup.cfg pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev,test,viz,text,nvrtc,cluster]'
	touch $@ $(VENV)/.core

dot:
	@command -v dot >/dev/null 2>&1 || { \
	  echo "installing Debian's graphviz (for dot)"; \
	  $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq graphviz >/dev/null; }

# Plans the demo MLP under half the memory it needs, runs and checks it, and writes
# pictures under out/demo/ (paths printed).
demo: $(VENV)/.core dot
	$(BIN)/einpage demo

# Executes notebooks/*.py (jupytext sources) and writes notebooks/*.ipynb with outputs.
notebooks: $(VENV)/.dev dot
	$(BIN)/python tests/test_notebooks.py

lint: $(VENV)/.dev
	$(BIN)/ruff check .

# `make test` runs pytest on TEST_WORKERS processes (pytest-xdist: `auto` is one per CPU,
# at most TEST_WORKERS_MAX; `make test TEST_WORKERS=0` runs in this one). `loadgroup`
# hands out tests one by one, but those of one `xdist_group` (the Ray tests, on one
# local instance) all to the same worker. Plain `python -m pytest` runs in one process.
TEST_WORKERS ?= auto
TEST_WORKERS_MAX ?= 4
PYTEST_XDIST := -n $(TEST_WORKERS) --maxprocesses $(TEST_WORKERS_MAX) --dist loadgroup

test: $(VENV)/.dev dot lint
	$(BIN)/python -m pytest $(PYTEST_XDIST); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: that is a failure here"; exit 1; fi; \
	exit $$rc

# GPU tests only (they skip cleanly without CuPy or a GPU). A Python that imports CuPy
# already runs them as it is, with nothing installed (a GPU machine may have no
# network): .venv's if it has CuPy, else $(PYTHON) (`make test-gpu PYTHON=python3.12`),
# with the repository on PYTHONPATH. Otherwise .venv gets CuPy for the CUDA major
# version of the NVIDIA driver (from nvidia-smi; the test extras' CUDA 12 CuPy, there
# for the NVRTC tier, makes way for CUDA 13's); without a driver it is not installed.
test-gpu:
	@export PYTHONPATH="$(CURDIR)"; py=; \
	for candidate in $(BIN)/python $(PYTHON); do \
	  if command -v $$candidate >/dev/null 2>&1 && $$candidate -c "import cupy" 2>/dev/null; then \
	    py=$$candidate; break; fi; \
	done; \
	if [ -z "$$py" ]; then $(MAKE) --no-print-directory gpu-venv || exit $$?; py=$(BIN)/python; \
	else echo "GPU tests with $$py (CuPy $$($$py -c 'import cupy; print(cupy.__version__)'); nothing installed)"; fi; \
	$$py -m pytest tests/gpu -rs; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "no GPU test ran: no usable GPU here (see the skip reasons)"; exit 0; fi; \
	exit $$rc

gpu-venv: $(VENV)/.dev
	@cuda=$$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9]*\).*/\1/p' | head -n 1); \
	if [ -z "$$cuda" ]; then echo "no NVIDIA driver found: the GPU tests will skip"; \
	elif [ "$$cuda" -ge 13 ]; then $(BIN)/python -m pip uninstall --quiet -y cupy-cuda12x; \
	  $(BIN)/python -m pip install --quiet -e '.[gpu-cuda13]'; \
	else $(BIN)/python -m pip install --quiet -e '.[gpu]'; fi

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis .ruff_cache
