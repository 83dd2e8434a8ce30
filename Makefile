# converge — the two commands are `make run` and `make test` (see README.md).
GO      ?= go
BIN     := bin/converge
# Debian's packages that provide the PostgreSQL server binaries and redis-server.
PG_PKG  ?= postgresql-15

.PHONY: run test deps build vet bench clean

## run: the whole pipeline on embedded defaults (PostgreSQL, kfake, Redis), until Ctrl-C.
run: deps build
	./$(BIN) dev

## test: every test against real PostgreSQL, kfake and redis-server.
test: deps
	$(GO) vet ./...
	$(GO) test -count=1 -timeout 14m ./...

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

vet:
	$(GO) vet ./...

clean:
	rm -rf bin .converge
