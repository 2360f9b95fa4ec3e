# make demo / make test create .venv on first use; PYTHON picks the interpreter that builds it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean FORCE

# strict editable installs link each file: a file added or removed needs a reinstall, so the
# stamp also depends on the list of package files (rewritten only when that list changes).
LISTING := $(shell find shared sidecar emulator middleware -name '*.py' -o -name py.typed | sort | tr '\n' ' ')
FILES := $(VENV)/.files

$(FILES): FORCE
	@mkdir -p $(VENV)
	@echo '$(LISTING)' | cmp -s - $@ || echo '$(LISTING)' > $@

$(STAMP): pyproject.toml $(FILES)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# strict editable mode: mypy cannot follow setuptools' default finder for mapped packages
	$(BIN)/python -m pip install -q -e '.[all,dev]' --config-settings editable_mode=strict
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python demo/main.py

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python bench/snapshot_bench.py
	$(BIN)/python bench/pick_bench.py
	$(BIN)/python bench/proxy_bench.py

clean:
	rm -rf $(VENV) build dist *.egg-info .mypy_cache .ruff_cache .pytest_cache
