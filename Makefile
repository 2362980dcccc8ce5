# l2l: two commands on a fresh machine.
#   make train   set up .venv and train the default model on the default corpus
#   make test    set up .venv (with test extras) and run every test
# Everything installs itself; see README "Setup" for what each step needs.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# CPU machines get the CPU build of torch (a local wheel here); with an NVIDIA
# driver present pip resolves the pyproject range to a CUDA build.
TORCH  ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 'torch>=2.4,<3' || echo 'torch==2.13.0')
RUN    ?= runs/train-$(shell date +%Y%m%d-%H%M%S)
PYTEST_ARGS ?=

.PHONY: setup setup-test train test bench clean

$(BIN)/python:
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 10), "Python >= 3.10 needed"' \
	  || { echo "make: need Python 3.10+ as $(PYTHON) (set PYTHON=...)"; exit 1; }
	@$(PYTHON) -m venv $(VENV) 2>/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && apt-get install -y -qq python3-venv && $(PYTHON) -m venv $(VENV); \
	  else echo "make: '$(PYTHON) -m venv' failed: install python3-venv (Debian: apt-get install python3-venv)"; exit 1; fi; }
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.setup: pyproject.toml | $(BIN)/python
	$(BIN)/python -c 'import torch' 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e '.[hf]'
	touch $@

$(VENV)/.setup-test: $(VENV)/.setup
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.setup
setup-test: $(VENV)/.setup-test

train: setup
	$(BIN)/l2l train --out $(RUN) $(ARGS)

test: setup-test
	$(BIN)/python -m pytest -q -n 2 $(PYTEST_ARGS)

bench: setup
	$(BIN)/l2l bench relay $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
