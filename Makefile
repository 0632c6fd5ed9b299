# Two commands a newcomer runs: `make demo` (the main job) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# The demo needs the package alone: no test extras, no torch (transformers only tokenizes here).
$(VENV)/.demo-installed: pyproject.toml | $(PY)
	@echo "installing specjax and its dependencies into $(VENV) (first run only)"
	$(PY) -m pip install --progress-bar on -e .
	touch $@

# The tests add torch (CPU; the reference they compare against), the notebook runner and matplotlib.
$(VENV)/.test-installed: pyproject.toml | $(PY)
	@echo "installing specjax with its test extras into $(VENV) (first run only)"
	$(PY) -m pip install --progress-bar on -e ".[test]"
	touch $@

.PHONY: demo test
demo: $(VENV)/.demo-installed
	$(PY) -m specjax.demo

# Two workers (CI has two cores; a test mostly compiles, on one core), a file each at a time so that module
# fixtures are built once; the slowest tests are listed at the end.
test: $(VENV)/.test-installed
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=25 tests
