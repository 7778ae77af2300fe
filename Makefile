# Every target sets up what it needs: a fresh clone runs `make demo` or `make test` directly.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# Benchmarks run their peers (mosaicml-streaming, litdata, FFCV) from a venv of their own: those
# pin versions the main venv must not take (see pyproject's `bench` extra).
BENCH_VENV := .venv-bench
BENCH_PY := $(BENCH_VENV)/bin/python
BENCH_STAMP := $(BENCH_VENV)/.installed

.PHONY: setup test demo bench bench-setup lint clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt -e '.[test,engines]'
	@command -v java >/dev/null 2>&1 \
		|| echo "No Java runtime: tests/test_engine_writers.py's Spark tests skip; apt install openjdk-17-jre-headless"
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(PY) -m pytest -q

demo: $(STAMP)
	$(PY) examples/demo.py

# FFCV is optional: it builds from source against libturbojpeg and OpenCV, so it is installed
# only where pkg-config finds both, and a failed build leaves the other peers' benchmarks running.
$(BENCH_STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_PY) -m pip install -q --upgrade pip
	$(BENCH_PY) -m pip install -q -c constraints.txt -e '.[test,bench]'
	@if pkg-config --exists libturbojpeg opencv4 2>/dev/null; then \
		$(BENCH_PY) -m pip install -q -c constraints.txt ffcv \
		|| echo "FFCV not installed: its build failed (output above); benchmarks run without it"; \
	else \
		echo "FFCV not installed: needs apt libturbojpeg0-dev libopencv-dev pkg-config"; \
	fi
	@ldconfig -p 2>/dev/null | grep -q 'libavfilter\.so' \
		|| echo "SPDL installed, but its decoder needs FFmpeg's shared libraries: apt libavfilter8 libavformat59 libavdevice59 (its columns say n/a without them)"
	touch $(BENCH_STAMP)

bench-setup: $(BENCH_STAMP)

bench: $(STAMP) $(BENCH_STAMP)
	$(PY) benchmarks/run_all.py

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples

clean:
	rm -rf $(VENV) $(BENCH_VENV) demo-output .pytest_cache
