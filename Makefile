# Set-up and entry points. `make demo` and `make test` are the README's quick start.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Installs go through uv, with pip's settings carried over (scripts/install_packages.py; pip does them where uv is
# missing or cannot follow a setting): the same packages, `make venv` 4m34s -> 3m03s (2-core Intel VM, 2026-11-30).
# With bytecode compiled at install time: without it (pip's --no-compile, which made the install 1m45s shorter) the
# processes vLLM spawns, which write no bytecode, compiled vLLM, torch and transformers again at every engine start,
# and the suite's vLLM tests took 2-3x longer (2026-11-26, AMD EPYC).
INSTALL := $(PY) scripts/install_packages.py -q
UV_SPEC ?= uv==0.13.9
TORCH_SPEC ?= torch==2.13.0
DEEPSPEED_SPEC ?= deepspeed==0.19.8
STAMP := $(VENV)/.hpc_rlhf-installed

.PHONY: venv assets demo test test-fast plan clean-venv docs

venv: $(STAMP)

# Debian's Open MPI (mpirun and libmpi, which the `mpi` extra's mpi4py wheel loads): installed with apt when
# missing and this user is root (CI is); elsewhere `make venv` says what to install and goes on without it.
OPENMPI_PACKAGES := openmpi-bin libopenmpi-dev

# Debian's Open MPI first (see above), then torch (the CPU wheel), the pinned libraries, deepspeed built against
# that torch with its CPU communication and CPU Adam (offload) ops precompiled (otherwise every rank compiles
# them on first use), then this package with its `mpi` extra (mpi4py, for launch/mpirun.sh) and its `docs` extra
# (mkdocs, for `make docs` and the suite's strict build of the site). No wheel cache for deepspeed: a cached wheel
# may have been built without these ops. DS_ENABLE_NINJA: deepspeed compiles each op's sources side by side with
# ninja (installed with requirements-cpu.txt) instead of one after the other (2-core VM, 2026-11-28: the deepspeed
# install 5m12s -> 2m55s; CPU Adam's updates bit-identical between the two builds).
$(STAMP): setup.cfg requirements-cpu.txt
	@if command -v mpirun >/dev/null 2>&1 && dpkg -s libopenmpi-dev >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing Debian's Open MPI ($(OPENMPI_PACKAGES))"; \
	  DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(OPENMPI_PACKAGES) >/dev/null; \
	else echo "make venv: Open MPI is missing and this user cannot apt-get it: install $(OPENMPI_PACKAGES) for" \
	  "launch/mpirun.sh and its test (skipped without it; a failure under CI=true)"; fi
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q "$(UV_SPEC)" || echo "make venv: $(UV_SPEC) could not be installed; pip installs the rest (slower)"
	$(INSTALL) "$(TORCH_SPEC)"
	$(INSTALL) -r requirements-cpu.txt
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	DS_ENABLE_NINJA=1 DS_BUILD_OPS=0 DS_BUILD_SHM_COMM=1 DS_BUILD_CPU_ADAM=1 $(INSTALL) --no-build-isolation --no-cache-dir "$(DEEPSPEED_SPEC)"
	$(INSTALL) --no-build-isolation --no-deps -e .
	$(INSTALL) --no-build-isolation -e ".[mpi,docs]"
	touch $(STAMP)

assets: venv
	$(PY) -m hpc_rlhf assets

# The main job on the built-in tiny task.
demo: venv
	$(PY) -m hpc_rlhf demo

# Two pytest processes side by side: the tests that wait for the shared models, and the rest (scripts/run_suite.py).
test: venv
	OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu $(PY) scripts/run_suite.py

test-fast: venv
	OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu $(PY) -m pytest -q -m "not learning and not cluster" tests

clean-venv:
	rm -rf $(VENV)

# The documentation site into site/ (strict: a broken link or a missing page fails; the reference pages are generated
# from the code at each build by scripts/docs_hooks.py). `$(PY) -m mkdocs serve` shows it while it is edited.
docs: venv
	OMP_NUM_THREADS=1 $(PY) -m mkdocs build --strict --site-dir site

.PHONY: bench
# Side-by-side benchmarks against TRL (CPU, ~10-20 min). TRL goes in without dependencies so nothing else moves.
bench: venv
	$(PIP) install -q --no-deps -r benchmarks/requirements.txt
	PY=$(PY) bash benchmarks/run_all.sh
