# toolreg: one target per habit. `make run` and `make test` do all the set-up.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
DATA_DIR ?= .toolreg/data
PYTEST_ARGS ?=
INIT_SRC := sandbox_runner/init/toolreg_init.c
INIT_BIN := sandbox_runner/init/toolreg-init
INIT_CC ?= gcc
INIT_CFLAGS := -std=c11 -Os -static -s -Wall -Wextra -Werror

.PHONY: help install init proto check check-proto lint typecheck check-k8s check-ts ts-client engine images interop-deps identity-deps conformance-deps postgres haproxy chromium rsyslog unit test run bench reap dist server-image clean

help: ## Show the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP) ## Create .venv and install the project with its dev tools

# The toolchain is used as found when it can link statically; otherwise gcc and libc6-dev
# are installed with apt (Debian + root only, as images/build.sh does), else a message.
$(INIT_BIN): $(INIT_SRC)
	@if ! { command -v $(INIT_CC) >/dev/null 2>&1 && \
	        [[ "$$($(INIT_CC) -print-file-name=libc.a)" == /* ]]; }; then \
	  if [[ "$$(id -u)" != 0 ]] || ! command -v apt-get >/dev/null 2>&1; then \
	    echo "make init: needs $(INIT_CC) and a static libc (Debian: apt-get install gcc libc6-dev)" >&2; \
	    exit 1; \
	  fi; \
	  echo "make init: installing gcc libc6-dev (apt-get) ..."; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get update -qq && apt-get install -y -qq --no-install-recommends gcc libc6-dev >/dev/null; \
	fi
	$(INIT_CC) $(INIT_CFLAGS) -o $@.tmp $<
	@chmod 0755 $@.tmp && mv -f $@.tmp $@  # o+x: containers run it as uid 65534

init: $(INIT_BIN) ## Build the sandbox init (static, from source)

proto: $(STAMP) ## Regenerate registry_server/_proto from proto/
	$(BIN)/python scripts/gen_proto.py

check-proto: $(STAMP) ## Fail when the generated code is stale
	@tmp=$$(mktemp -d) && $(BIN)/python scripts/gen_proto.py $$tmp >/dev/null 2>&1 && \
	  if diff -r -q -x __pycache__ $$tmp registry_server/_proto; then echo "generated code is up to date"; \
	  else echo "registry_server/_proto is stale: run 'make proto'"; rm -rf $$tmp; exit 1; fi; rm -rf $$tmp

lint: $(STAMP)
	$(BIN)/ruff check registry_server sandbox_runner tests scripts bench setup.py
	$(BIN)/buf lint proto

typecheck: $(STAMP)
	$(BIN)/mypy registry_server sandbox_runner bench examples

check-k8s: $(STAMP)
	KUBERNETES_VALIDATE=$(BIN)/kubernetes-validate bash scripts/validate_k8s.sh

# The TypeScript client: generated code in step with proto/, strict types.
check-ts: ts-client
	cd clients/typescript && npm run --silent check-gen && npm run --silent typecheck

check: check-proto lint typecheck check-k8s check-ts check-docs ## Proto drift (Python, TypeScript), lint, type checks, Kubernetes manifests, docs

# The docs site (mkdocs.yml, MkDocs Material): docs/reference/ is generated from
# the code by scripts/gen_docs.py and committed; check-docs fails when it is
# stale, and builds the site strictly (a broken link or anchor, a missing page).
# Never with mkdocs --quiet: it hides the warnings strict mode counts.
# tests/docs/test_docs_site.py runs check-docs on a tampered copy (DOCS_CONFIG,
# DOCS_REFERENCE) to show that it fails.
.PHONY: reference docs check-docs
DOCS_ENV := NO_MKDOCS_2_WARNING=1
DOCS_CONFIG ?= mkdocs.yml
DOCS_REFERENCE ?= docs/reference

reference: $(STAMP) ## Regenerate docs/reference/ from the proto, the CLI, the policy and manifest schemas, the settings
	$(BIN)/python scripts/gen_docs.py >/dev/null

docs: reference ## Build the docs site into site/ (open site/index.html; works offline)
	$(DOCS_ENV) $(BIN)/mkdocs build --strict --site-dir site

check-docs: $(STAMP) ## Fail when docs/reference/ is stale or the docs site has a broken link or page
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	  $(BIN)/python scripts/gen_docs.py "$$tmp/reference" >/dev/null && \
	  if diff -r -q "$$tmp/reference" "$(DOCS_REFERENCE)"; then echo "docs/reference is up to date"; \
	  else echo "docs/reference is stale: run 'make reference'"; exit 1; fi && \
	  if $(DOCS_ENV) $(BIN)/mkdocs build --strict -f "$(DOCS_CONFIG)" --site-dir "$$tmp/site" \
	    >"$$tmp/build.log" 2>&1; \
	  then echo "docs site builds (strict)"; else grep -v '^INFO' "$$tmp/build.log"; exit 1; fi

engine: ## Make sure a Docker engine answers (installs docker.io + runsc on Debian)
	@bash scripts/ensure_docker.sh

images: engine ## Build the local sandbox images (only when missing or changed)
	@bash sandbox_runner/images/build.sh

postgres: ## Start the tests' PostgreSQL (installs Debian's postgresql; not needed by make run)
	@bash scripts/ensure_postgres.sh start

haproxy: ## Install HAProxy for the multi-server tests (each test starts its own)
	@bash scripts/ensure_haproxy.sh >/dev/null

rsyslog: ## Install Debian's rsyslog with its TLS driver for the SIEM export tests (each run starts its own)
	@bash scripts/ensure_rsyslog.sh >/dev/null

chromium: ## Install Debian's headless Chromium and chromedriver for the browser tests (tests/browser)
	@bash scripts/ensure_chromium.sh >/dev/null

ts-client: ## Install and build the TypeScript client (clients/typescript)
	cd clients/typescript && npm ci --no-audit --no-fund --silent && npm run --silent build

interop-deps: ts-client ## Install the Node.js interop test dependencies (tests/interop; they use the TypeScript client)
	cd tests/interop && npm ci --no-audit --no-fund --silent

# oidc-provider wants a newer Node.js than Debian's: the npm registry's own
# `node` package brings one into tests/identity/idp/node_modules (nothing global).
identity-deps: ## Install the identity tests' OpenID Provider (oidc-provider, with its Node.js, from npm)
	cd tests/identity/idp && npm ci --no-audit --no-fund --silent

# The official MCP conformance suite, pinned exactly, with the Node.js it needs
# from npm (as identity-deps): tests/integration/test_mcp_conformance.py runs it.
conformance-deps: ## Install the MCP conformance suite (tests/conformance, from npm)
	cd tests/conformance && npm ci --no-audit --no-fund --silent

# No unit test uses hypothesis or anyio's pytest plugin (which imports trio):
# their start-up is left out here. PYTHONDONTWRITEBYTECODE (set in some
# environments) would also turn off pytest's cache of rewritten test modules:
# rewriting them all again costs about 2 s a run, so it is cleared here.
unit: install ## The unit tier alone: decision logic, no engine, in seconds
	PYTHONDONTWRITEBYTECODE= $(BIN)/pytest tests/unit -q -p no:hypothesispytest -p no:anyio $(PYTEST_ARGS)

# Two parts (scripts/run_tests.py): the tests in parallel (TEST_WORKERS, pytest-xdist,
# whole files per worker), then the `serial` ones alone; one summary with the counts
# and the 25 slowest tests. PYTEST_ARGS go to both parts (paths, -k, -x).
test: install init check-proto images ts-client interop-deps identity-deps conformance-deps postgres haproxy chromium rsyslog ## Set up everything, then run the whole test suite
	$(BIN)/python scripts/run_tests.py $(PYTEST_ARGS)

run: install init images ## Set up everything, then serve the example tools on 127.0.0.1:50051
	$(BIN)/toolreg serve --tools examples/tools --data-dir $(DATA_DIR)

bench: install init images postgres haproxy rsyslog ## Benchmarks (medians, ratios against baselines in the same run)
	$(BIN)/pip install --quiet -e '.[dev,bench]'
	$(BIN)/python -m bench $(BENCH_ARGS)

reap: install ## Remove containers left behind by dead toolreg servers
	$(BIN)/toolreg reap

# The sdist, then the wheel built from it (python -m build's default), as users get them.
dist: install init ## The sdist and the platform wheel (init compiled in) into dist/, checked by twine
	rm -f dist/toolreg-*
	$(BIN)/python -m build --no-isolation --outdir dist .
	$(BIN)/twine check --strict dist/toolreg-*

# The server image from dist/'s wheel on the sandbox images' root (built first when missing);
# its SBOMs and the wheel's go beside the wheel. Nothing is pulled.
server-image: dist engine ## The server image toolreg/server:<version> (and :latest), SBOMs into dist/
	$(BIN)/toolreg images build --server --wheel "$$(ls dist/toolreg-*.whl)" --sbom-dir dist

clean: ## Remove the virtual environment and caches (keeps images and data)
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
