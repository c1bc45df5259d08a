# make test   : create .venv (PYTHON=python3 by default), install jax_cp[test], run the suite
# make train  : same venv, train the tiny model on 8 simulated CPU devices
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.jax_cp-installed
PYTEST_ARGS ?= -n 2

.PHONY: test train install clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) -m pytest -q $(PYTEST_ARGS) tests

train: $(STAMP)
	rm -rf runs/tiny
	JAX_PLATFORMS=cpu $(PY) -m models.train --devices 8 --cp-colossal 2 --cp-ulysses 2 --tp 2 \
		--model tiny --seq-len 256 --batch 8 --steps 300 --lr 3e-3 --warmup 30 \
		--eval-every 50 --checkpoint-every 100 --out runs/tiny

clean:
	rm -rf $(VENV) runs .pytest_cache
