# The two commands a newcomer needs: `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup run test app bench model oracle-wheel check-qt clean

setup: $(STAMP)

# ---- the llama.cpp test oracle (llama-cpp-python, built from source) --------------------------------
# llama.cpp's default GGML_NATIVE=ON compiles for every instruction set the build CPU *advertises*.
# Some VMs advertise AMX (amx_tile/amx_int8) but do not let a process use the tile registers, and the
# first quantized matmul then dies with SIGILL. So the oracle is built portable: native off, AMX off
# always, AVX2/FMA/F16C on, AVX-512 (and its VNNI/BF16 parts) only where /proc/cpuinfo has them.
LLAMA_CPP_VERSION := 0.3.36
CPUFLAGS := $(shell grep -m1 '^flags' /proc/cpuinfo 2>/dev/null)
has = $(if $(filter $(1),$(CPUFLAGS)),ON,OFF)
ifeq ($(shell uname -m),x86_64)
ORACLE_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
  -DGGML_AVX512=$(call has,avx512f) -DGGML_AVX512_VNNI=$(call has,avx512_vnni) \
  -DGGML_AVX512_BF16=$(call has,avx512_bf16) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
else
ORACLE_CMAKE_ARGS := -DGGML_NATIVE=OFF
endif
# pip caches wheels by version only, so a wheel built with other flags could be reused silently. The
# oracle's wheel lives in its own folder keyed by version + flags, is built with --no-cache-dir, and
# is installed from there alone (--only-binary: pip never rebuilds it from the sdist).
ORACLE_KEY   := $(shell printf '%s %s' '$(LLAMA_CPP_VERSION)' '$(ORACLE_CMAKE_ARGS)' | sha256sum | cut -c1-16)
ORACLE_WHEEL := $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/strata/wheels/llama-cpp-python-$(ORACLE_KEY)

oracle-wheel: $(ORACLE_WHEEL)/.built

$(ORACLE_WHEEL)/.built:
	@echo "building llama-cpp-python $(LLAMA_CPP_VERSION) (~8 min, once) with: $(ORACLE_CMAKE_ARGS)"
	rm -rf $(ORACLE_WHEEL).tmp && mkdir -p $(ORACLE_WHEEL).tmp
	CMAKE_ARGS="$(ORACLE_CMAKE_ARGS)" $(PYTHON) -m pip wheel --no-deps --no-cache-dir \
	  --no-binary llama-cpp-python llama-cpp-python==$(LLAMA_CPP_VERSION) -w $(ORACLE_WHEEL).tmp
	printf '%s\n' '$(ORACLE_CMAKE_ARGS)' > $(ORACLE_WHEEL).tmp/CMAKE_ARGS
	rm -rf $(ORACLE_WHEEL) && mv $(ORACLE_WHEEL).tmp $(ORACLE_WHEEL) && touch $(ORACLE_WHEEL)/.built

# PyInstaller is installed too: a test builds the bundle and runs its --self-test.
$(STAMP): pyproject.toml Makefile $(ORACLE_WHEEL)/.built
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install --find-links $(ORACLE_WHEEL) --only-binary llama-cpp-python -e ".[test,oracle,app]"
	touch $(STAMP)

model: setup
	$(VENV)/bin/strata models fetch-default --if-missing

# Qt's xcb platform plugin needs system libraries a fresh Linux may lack; Qt's own abort names the
# wrong one (xcb-cursor0), so check with ldd and print the one install line.
check-qt: setup
	@$(PY) -m app.qt_deps

run: model check-qt
	$(VENV)/bin/strata-app

# pytest exits 5 when it collects nothing: that is a broken setup, not a pass.
test: model
	QT_QPA_PLATFORM=offscreen $(PY) -m pytest tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: the setup is broken" >&2; exit 1; fi; \
	exit $$rc

app: setup
	$(VENV)/bin/pyinstaller --noconfirm --clean packaging/strata.spec

bench: model
	$(PY) bench/engine.py
	$(PY) bench/cache.py
	$(PY) bench/cvec.py

clean:
	rm -rf $(VENV) build dist
