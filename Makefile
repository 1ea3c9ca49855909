# The two commands a newcomer needs: `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup run test app bench model clean

setup: $(STAMP)

# llama-cpp-python (the test oracle) builds from source once (~8 min); pip caches the wheel.
# PyInstaller is installed too: a test builds the bundle and runs its --self-test.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e ".[test,oracle,app]"
	touch $(STAMP)

model: setup
	$(VENV)/bin/strata models fetch-default --if-missing

run: model
	$(VENV)/bin/strata-app

# pytest exits 5 when it collects nothing: that is a broken setup, not a pass.
test: model
	QT_QPA_PLATFORM=offscreen $(PY) -m pytest tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: the setup is broken" >&2; exit 1; fi; \
	exit $$rc

app: setup
	$(PY) -m pip install -e ".[app]"
	$(VENV)/bin/pyinstaller --noconfirm --clean packaging/strata.spec

bench: model
	$(PY) bench/engine.py
	$(PY) bench/cache.py
	$(PY) bench/cvec.py

clean:
	rm -rf $(VENV) build dist
