# converge — the two commands are `make run` and `make test` (see README.md).
GO      ?= go
BIN     := bin/converge
# Debian's packages that provide the PostgreSQL server binaries and redis-server.
PG_PKG  ?= postgresql-15

.PHONY: run test deps build vet bench soak clean rules-test promtool

## run: the whole pipeline on embedded defaults (PostgreSQL, kfake, Redis), until Ctrl-C.
run: deps build
	./$(BIN) dev

## test: every test against real PostgreSQL, kfake and redis-server, and the
## Prometheus rule tests. The shared corpus (CONVERGE_CORPUS_DIR, default
## ../shared/corpus) adds its cases when it is there; CONVERGE_REQUIRE_CORPUS=1
## (.ci/run) makes its absence fail.
CORPUS_DIR = $(or $(CONVERGE_CORPUS_DIR),../shared/corpus)
test: deps rules-test
	@if [ ! -d "$(CORPUS_DIR)" ]; then \
	  if [ "$$CONVERGE_REQUIRE_CORPUS" = 1 ]; then \
	    echo "corpus not found at $(CORPUS_DIR) and CONVERGE_REQUIRE_CORPUS=1: failing" >&2; exit 1; \
	  fi; \
	  echo "corpus not found at $(CORPUS_DIR): the corpus tests are SKIPPED (the project's own cases still run; set CONVERGE_CORPUS_DIR to run them)"; \
	fi
	$(GO) vet ./...
	$(GO) test -count=1 -timeout 14m ./...

## bench: each stage against its physical limit on a fresh local PostgreSQL
## (fsync on), median of 3 runs; see BENCHMARKS.md. BENCH_ARGS=--quick runs
## small sizes in a few minutes. Results: bench-results/ (JSON, markdown
## table, CPU profiles).
BENCH_ARGS ?=
bench: deps build
	@mkdir -p bench-results
	./$(BIN) bench --out bench-results/results.json --markdown bench-results/results.md \
	  --profile-dir bench-results/profiles $(BENCH_ARGS)

## soak: the ab stage with this build on both sides, 20 rounds of 10,000
## tasks each (6-9 minutes on 2 cores): fails when any task does not complete.
## A correctness run under load, not a measurement (BENCHMARKS.md).
SOAK_ARGS ?=
soak: deps build
	@mkdir -p bench-results
	./$(BIN) bench --stages ab --ab-binaries $(BIN),$(BIN) --runs 20 --peer-tasks 10000 \
	  --out bench-results/soak.json $(SOAK_ARGS)

## build: the converge binary in bin/.
build:
	$(GO) build -o $(BIN) ./cmd/converge

## deps: install the PostgreSQL server and redis-server with apt when missing (as root).
deps:
	@if ! command -v redis-server >/dev/null 2>&1 || ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing $(PG_PKG) and redis-server with apt-get"; \
	    apt-get update -q >/dev/null && \
	    (DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(PG_PKG) redis-server >/dev/null || \
	     DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql redis-server >/dev/null); \
	  else \
	    echo "converge needs the PostgreSQL server binaries and redis-server." >&2; \
	    echo "Install them with: sudo apt-get install $(PG_PKG) redis-server" >&2; exit 1; \
	  fi; \
	fi

## rules-test: promtool checks deploy/prometheus (config, alert rules) and runs
## the alert rules' unit tests (alerts_test.yml). promtool comes from Debian's
## prometheus package, installed with apt when missing and we are root. Under
## CI=true a missing promtool fails; elsewhere the rule tests are skipped with
## the apt-get line to run.
rules-test: promtool
	@if command -v promtool >/dev/null 2>&1; then \
	  set -e; \
	  promtool check rules deploy/prometheus/alerts.yml; \
	  promtool test rules deploy/prometheus/alerts_test.yml; \
	  (cd deploy/prometheus && promtool check config --syntax-only prometheus.yml); \
	elif [ "$$CI" = true ]; then \
	  echo "promtool is missing (CI=true: failing). Install it with: sudo apt-get install prometheus" >&2; exit 1; \
	else \
	  echo "promtool is missing: Prometheus rule tests SKIPPED. Install it with: sudo apt-get install prometheus" >&2; \
	fi

promtool:
	@if ! command -v promtool >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing prometheus (promtool) with apt-get"; \
	  apt-get update -q >/dev/null && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus >/dev/null || true; \
	fi

vet:
	$(GO) vet ./...

clean:
	rm -rf bin .converge
