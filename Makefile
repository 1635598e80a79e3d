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

.PHONY: test lint demo bench docs install clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e ".[test]"
	touch $@

install: $(STAMP)

test: $(STAMP) lint
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q

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
	rm -rf $(VENV) .pytest_cache
