# make demo / make test create .venv on first use; PYTHON picks the interpreter that builds it.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo demo-up screenshot test lint bench bench-full clean FORCE

# strict editable installs link each file: a file added or removed needs a reinstall, so the
# stamp also depends on the list of package files (rewritten only when that list changes).
LISTING := $(shell find shared sidecar emulator middleware bench -name '*.py' -o -name py.typed -o -path '*/dashboard/*' | sort | tr '\n' ' ')
FILES := $(VENV)/.files

$(FILES): FORCE
	@mkdir -p $(VENV)
	@echo '$(LISTING)' | cmp -s - $@ || echo '$(LISTING)' > $@

# A venv whose python has no pip (a `venv` that failed half-way, e.g. without python3-venv) is
# made again: `test -x` took it for a good one and every later run failed on pip. The listing
# is written again with it: gone with the old venv, the next make took it for a change.
$(STAMP): pyproject.toml $(FILES)
	$(BIN)/python -m pip --version >/dev/null 2>&1 || { rm -rf $(VENV); \
	  $(PYTHON) -m venv $(VENV) || { echo "python3 -m venv failed: on Debian, apt-get install python3-venv"; exit 1; }; \
	  echo '$(LISTING)' > $(FILES); }
	$(BIN)/python -m pip install -q --upgrade pip
	# strict editable mode: mypy cannot follow setuptools' default finder for mapped packages
	$(BIN)/python -m pip install -q -e '.[all,dev]' --config-settings editable_mode=strict
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python demo/main.py

# the demo, then its cluster stays up with the dashboard open until Ctrl-C
demo-up: $(STAMP)
	$(BIN)/python demo/main.py --keep-up

# the dashboard's browser test, keeping its screenshot where the README shows it
screenshot: $(STAMP)
	CI=true PROMPTLB_SCREENSHOT=docs/dashboard.png $(BIN)/python -m pytest -q tests/ops/test_dashboard.py

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# make bench: quick (a few minutes on 2 cores). Every run writes under bench/results/quick/ so
# that it never replaces the full runs' committed numbers.
bench: $(STAMP)
	$(BIN)/python bench/snapshot_bench.py --quick
	$(BIN)/python bench/pick_bench.py --quick
	$(BIN)/python bench/proxy_bench.py --quick
	$(BIN)/python bench/affinity_bench.py --quick
	$(BIN)/python bench/degrade_bench.py --warm 5 --outage 10 --hits 200 --out bench/results/quick/degrade.json
	$(BIN)/promptlb-bench sim seed-3am --out bench/results/quick
	$(BIN)/promptlb-bench sim hetero-8 --out bench/results/quick
	$(BIN)/promptlb-bench sim uniform-4 --out bench/results/quick
	$(BIN)/promptlb-bench sim burst --out bench/results/quick
	$(BIN)/promptlb-bench sim mixed-class --out bench/results/quick
	$(BIN)/promptlb-bench sim multi-tenant-chat --out bench/results/quick
	$(BIN)/promptlb-bench sim shared-system-prompt --out bench/results/quick
	$(BIN)/promptlb-bench sim rag --out bench/results/quick
	$(BIN)/promptlb-bench cluster uniform-4 --duration 15s --peers none --out bench/results/quick
	$(BIN)/promptlb-bench faults --quick

# make bench-full: everything, the live cluster runs with the peers (nginx, LiteLLM) that are
# installed; a missing peer is reported as missing and the rest still runs. About 90 minutes.
bench-full: $(STAMP)
	$(BIN)/python bench/snapshot_bench.py
	$(BIN)/python bench/pick_bench.py
	$(BIN)/python bench/proxy_bench.py
	$(BIN)/python bench/affinity_bench.py
	$(BIN)/python bench/degrade_bench.py
	$(BIN)/promptlb-bench sim seed-3am
	$(BIN)/promptlb-bench sim hetero-8
	$(BIN)/promptlb-bench sim uniform-4
	$(BIN)/promptlb-bench sim burst
	$(BIN)/promptlb-bench sim mixed-class
	$(BIN)/promptlb-bench sim multi-tenant-chat
	$(BIN)/promptlb-bench sim shared-system-prompt
	$(BIN)/promptlb-bench sim rag
	$(BIN)/promptlb-bench sim hetero-8 --nodes 1000 --replicas 50 --out bench/results
	$(BIN)/promptlb-bench cluster uniform-4
	$(BIN)/promptlb-bench cluster burst
	$(BIN)/promptlb-bench cluster seed-3am
	$(BIN)/promptlb-bench cluster hetero-8
	$(BIN)/promptlb-bench cluster mixed-class
	$(BIN)/promptlb-bench cluster multi-tenant-chat
	$(BIN)/promptlb-bench cluster shared-system-prompt
	$(BIN)/promptlb-bench cluster rag
	$(BIN)/promptlb-bench faults

clean:
	rm -rf $(VENV) build dist *.egg-info .mypy_cache .ruff_cache .pytest_cache
