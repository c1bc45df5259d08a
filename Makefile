# make test        : create .venv (PYTHON=python3 by default), install jax_cp[test], run the suite
# make test-newest : the same suite on Python 3.12 (PYTHON312, found as .ci/run finds it) in .venv312,
#                    with the newest jax/flax/optax/orbax the index serves (upgraded every time)
# make train       : same venv as make test, train the tiny model on 8 simulated CPU devices
# make generate    : sample from make train's checkpoint (CP prefill + sharded KV cache decode)
# make docs        : same venv, install jax_cp[docs], build the site into build/docs (mkdocs --strict:
#                    warnings are errors; offline)
# make vs-maxtext  : compile jax_cp's and MaxText's Llama 3.1 8B training steps ahead of time for a TPU pod
#                    (benchmarks/vs_maxtext.py; VS_MAXTEXT_ARGS passes it options); MaxText runs in its own
#                    .venv-maxtext (PYTHON312): maxtext[tpu]==0.2.5 with libtpu==0.0.52 (resolves jax 0.12.0.1)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.jax_cp-installed
DOCS_STAMP := $(VENV)/.jax_cp-docs-installed
PYTEST_ARGS ?= -n 2 --dist worksteal --durations=25
PIP_FLAGS ?=
PYTHON312 ?= $(shell .ci/find-python312)

.PHONY: test test-newest train generate install docs clean vs-maxtext

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(PIP_FLAGS) -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) -m pytest -q $(PYTEST_ARGS) tests

test-newest:
	@test -n "$(PYTHON312)" || { echo "no Python 3.12 found: pass PYTHON312=/path/to/python3.12"; exit 2; }
	rm -f .venv312/.jax_cp-installed
	$(MAKE) test PYTHON=$(PYTHON312) VENV=.venv312 PIP_FLAGS='--upgrade --upgrade-strategy eager'
	.venv312/bin/python -c "import jax, flax, optax, orbax.checkpoint as o; print('newest line:', 'jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'orbax', o.__version__)"

train: $(STAMP)
	rm -rf runs/tiny
	JAX_PLATFORMS=cpu $(PY) -m models.train --devices 8 --cp-colossal 2 --cp-ulysses 2 --tp 2 \
		--model tiny --seq-len 256 --batch 8 --steps 300 --lr 3e-3 --warmup 30 \
		--eval-every 50 --checkpoint-every 100 --out runs/tiny

generate: $(STAMP)
	@test -d runs/tiny/checkpoints || { echo "no runs/tiny checkpoint: run make train first"; exit 2; }
	JAX_PLATFORMS=cpu $(PY) -m models.generate --checkpoint runs/tiny --devices 8 --cp-colossal 2 \
		--cp-ulysses 2 --tp 2 --prompt "def " --max-new-tokens 200 --temperature 0.8 --top-k 20

$(DOCS_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(PIP_FLAGS) -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

MAXTEXT_VENV ?= .venv-maxtext
MAXTEXT_STAMP := $(MAXTEXT_VENV)/.maxtext-installed
VS_MAXTEXT_ARGS ?=

# The bare maxtext wheel declares no dependencies: its [tpu] extra carries jax, flax, tokamax and the rest.
$(MAXTEXT_STAMP):
	@test -n "$(PYTHON312)" || { echo "no Python 3.12 found: pass PYTHON312=/path/to/python3.12"; exit 2; }
	test -x $(MAXTEXT_VENV)/bin/python || $(PYTHON312) -m venv $(MAXTEXT_VENV)
	$(MAXTEXT_VENV)/bin/python -m pip install -q --upgrade pip
	$(MAXTEXT_VENV)/bin/python -m pip install -q 'maxtext[tpu]==0.2.5' libtpu==0.0.52
	touch $(MAXTEXT_STAMP)

vs-maxtext: $(STAMP) $(MAXTEXT_STAMP)
	JAX_PLATFORMS=cpu $(PY) benchmarks/vs_maxtext.py $(VS_MAXTEXT_ARGS)

clean:
	rm -rf $(VENV) .venv312 runs .pytest_cache
