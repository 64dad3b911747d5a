# The project's two commands: `make demo` (set up, serve the demo repository, send it requests)
# and `make test` (set up, run every test; what CI runs). Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Scripts in tools/ that build the demo repository's artifacts, run in this order by `make models`.
MODEL_BUILDERS := build_demo_models.py build_fused_transformer.py build_spec_models.py
DEMO_ARGS ?=

.PHONY: setup models demo test clean prometheus
setup: $(VENV)/.installed models

$(VENV)/.installed: requirements.txt setup.py pyproject.toml $(wildcard cython_ext/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-build-isolation -e .
	touch $@

models: $(VENV)/.installed
	@for builder in $(MODEL_BUILDERS); do $(PY) tools/$$builder || exit 1; done

demo: setup
	$(VENV)/bin/dspark demo $(DEMO_ARGS)

# Debian's Prometheus, which the rollout tests start to scrape a fleet (CI runs as root on Debian).
prometheus:
	@command -v prometheus >/dev/null || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus; }

test: setup prometheus
	$(PY) -m pytest tests -q

clean:
	rm -rf $(VENV) build *.egg-info dspark/_ext/*.so
