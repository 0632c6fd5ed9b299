# Two commands a newcomer runs: `make demo` (the main job) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	touch $@

.PHONY: demo test install
install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) -m specjax.demo

test: $(VENV)/.installed
	$(PY) -m pytest -q tests
