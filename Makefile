# Everything a developer or CI runs. `make test` is the one command CI calls.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Tests, benchmarks and the demo run in a private network namespace: the sandbox's pods get
# addresses there that EndpointSlices accept, and no traffic can leave the machine.
ISOLATE := $(VENV)/bin/cacheroute sandbox isolate --

.PHONY: test unit integration lint typecheck bench demo demo-replay crds chart sandbox-deps clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade uv
	$(VENV)/bin/uv pip install -q --python $(PY) -e '.[dev]'
	@touch $(STAMP)

## Lint, type-check, then every test (unit and integration against real servers).
test: $(STAMP) sandbox-deps lint typecheck
	$(ISOLATE) $(VENV)/bin/pytest

unit: $(STAMP)
	$(VENV)/bin/pytest -m "not integration"

integration: $(STAMP) sandbox-deps
	$(ISOLATE) $(VENV)/bin/pytest -m integration

## Style, then the dependency contracts of docs/architecture.md (pyproject.toml [tool.importlinter]).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache

typecheck: $(STAMP)
	$(VENV)/bin/mypy

## Real servers for integration tests: the pinned Kubernetes, kwok, helm and Prometheus builds.
sandbox-deps: $(STAMP)
	$(PY) -m cacheroute.sandbox.binaries ensure

## Generated files: CRDs and their reference (docs/crds.md) from the models; the chart's copies of
## them, its RBAC rules and values schema, and the values table of docs/install.md.
crds: $(STAMP)
	$(VENV)/bin/cacheroute crds --out crds --reference docs/crds.md

chart: crds
	$(VENV)/bin/cacheroute chart --out helm/cacheroute --install-doc docs/install.md

## The capacity benches replay the first 15 minutes of the generated workloads (about 80 minutes in
## all on two cores); `make bench REPLAY_SPAN=` replays the whole hour (several hours).
REPLAY_SPAN ?= --quick
bench: $(STAMP) sandbox-deps
	@mkdir -p bench-results
	@# The router bench's Go load generator and the control bench's promtool are built first, while
	@# the module proxy is reachable.
	$(PY) -c "from tests.bench.bench_router import loadgen_binary; loadgen_binary()"
	$(PY) -m cacheroute.sandbox.binaries ensure promtool
	@set -e; for b in tests/bench/bench_*.py; do n=$$(basename $$b .py); echo "== $$b"; \
	  case $$n in bench_replay|bench_capacity) args="$(REPLAY_SPAN)";; *) args="";; esac; \
	  $(ISOLATE) $(PY) -m tests.bench.$$n $$args; done

## The whole loop on this machine (docs/demo.md): sandbox, helm install, a pool of 8 emulated vLLM
## destinations and an AffinityPlan, real traffic through Envoy and the router, a p2c phase then a
## planned phase; the table on stdout, loop.json and plots in demo/.
demo: $(STAMP) sandbox-deps
	$(ISOLATE) $(VENV)/bin/cacheroute sandbox demo --out demo

## Shadow replay alone of the paper's workload on 30 modelled H100 destinations: table, JSON and plots in demo/.
demo-replay: $(STAMP)
	$(VENV)/bin/cacheroute replay --workload cacheroute-paper --duration 900 --destinations 30 \
	    --policies p2c,prefix-tree,gie-prefix,preble,cacheroute --qps 120,170,200 --out demo

clean:
	rm -rf $(VENV) build dist *.egg-info bench-results demo .mypy_cache .ruff_cache .pytest_cache
