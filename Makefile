# `make test` and `make demo` each set up what they need from scratch: a local .venv with torch
# pinned by constraints.txt (the CPU wheel on our dev/CI machines), then shardwise in editable mode.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt
STAMP  := $(VENV)/.installed
NPROC  ?= 2
# DeepSpeed compiles its CPU ops (shm_comm) on first use: cache them once per machine, outside
# any clone, so only the first `make test` on a machine pays the ~2 minutes.
export TORCH_EXTENSIONS_DIR ?= $(HOME)/.cache/torch_extensions

.PHONY: test test-latest lint demo bench docs install clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e ".[test]"
	touch $@

install: $(STAMP)

test: $(STAMP) lint
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q

# The suite against the newest transformers, peft and accelerate the package registry gives (torch
# and the rest pinned by constraints.txt), in a venv of its own: what `pip install` gives a user
# today, before the pins move. CI runs `make test` (the pins); run this before bumping them.
LATEST := .venv-latest
test-latest:
	test -x $(LATEST)/bin/python || $(PYTHON) -m venv $(LATEST)
	grep -vE '^(transformers|peft|accelerate)==' constraints.txt > $(LATEST)/constraints.txt
	$(LATEST)/bin/python -m pip install --quiet --disable-pip-version-check -c $(LATEST)/constraints.txt torch==2.13.0
	$(LATEST)/bin/python -m pip install --quiet --disable-pip-version-check -c $(LATEST)/constraints.txt \
		--upgrade -e ".[test]" transformers peft accelerate
	$(LATEST)/bin/python -m pip list --disable-pip-version-check 2>/dev/null | grep -iE '^(torch|transformers|peft|accelerate) '
	HF_HUB_OFFLINE=1 $(LATEST)/bin/python -m pytest -q

# the checkers, with the settings in pyproject.toml: any finding fails `make test`
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy

demo: $(STAMP)
	$(PY) -m torch.distributed.run --standalone --nproc-per-node $(NPROC) examples/demo.py

bench: $(STAMP)
	$(PY) -m torch.distributed.run --standalone --nproc-per-node $(NPROC) benchmarks/overhead.py

# docs/config.md is generated from the config fields' docstrings (tests/test_docs.py checks it is current)
docs: $(STAMP)
	$(PY) -m shardwise.config.docs > docs/config.md

clean:
	rm -rf $(VENV) $(LATEST) .pytest_cache
