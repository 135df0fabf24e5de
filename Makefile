# The two commands a fresh clone needs: `make demo` and `make test`. Each sets up everything itself:
# the virtual environment (.venv/), the package and its dependencies, and the demo model assets.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ASSETS := .assets
PYTEST_ARGS ?=

.PHONY: demo test assets venv serve clean redis nginx lint mutation

demo: assets
	$(PY) -m warmup_tools demo

test: assets redis nginx lint
	$(PY) -m pytest $(PYTEST_ARGS)
	@! pgrep -a -f 'bin/[t]ritonserver|[t]riton_python_backend_stub' || \
		{ echo "error: a tritonserver or stub outlived the tests"; exit 1; }

serve: assets
	$(PY) -m warmup_tools serve

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[local,load,test]'
	touch $(STAMP)

assets: $(STAMP)
	$(PY) -m warmup_tools assets --out $(ASSETS)
	$(PY) -m warmup_tools stanzas --tokenizer $(ASSETS)/lm

# ruff (configured in pyproject.toml) before the tests: a lint failure fails `make test`.
lint: $(STAMP)
	$(VENV)/bin/ruff check .

# Mutation testing of the security-critical modules (docs/mutation.md); not part of `make test`.
# MUTATE= names a subset (source paths), e.g. `make mutation MUTATE=warmup_tools/kv/hashing.py`.
MUTATE ?=
mutation: assets
	$(PY) scripts/mutation.py $(MUTATE)

# The shared-tier tests run a real redis-server (started and stopped by the tests themselves).
redis:
	@command -v redis-server >/dev/null || { echo "installing redis-server (Debian package)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; }

# The gateway and direct-access proxy tests run a real nginx (Debian's nginx-light), started and stopped by the tests.
nginx:
	@command -v nginx >/dev/null || test -x /usr/sbin/nginx || { echo "installing nginx-light (Debian package)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light >/dev/null; }

clean:
	rm -rf $(VENV) $(ASSETS) .build .pytest_cache mutants
