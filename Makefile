# Two entry points: `make demo` (set up, then run the main job) and `make test` (set up, then run
# the test suite). Both create .venv on first use and reinstall when the build files change.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# Where nvcc exists, the CUDA extension must build: a compile error fails `make test` (and CI).
NVCC := $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
export SPECTRAL_OPS_REQUIRE_CUDA ?= $(if $(NVCC),1,0)

.PHONY: demo test test-avx2 bench clean

$(STAMP): requirements-test.txt pyproject.toml setup.py CMakeLists.txt $(wildcard csrc/*)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements-test.txt
	$(PY) -m pip install --quiet --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m spectral_ops
	$(PY) -m spectral_ops.train demo

# The benchmarks run once each, untimed, as a smoke test.
test: $(STAMP)
	$(PY) -m pytest tests bench -q --benchmark-disable

# The suite with the kernels an AVX2-only CPU runs (bf16 emulated, MKL's AVX2 GEMM), on a CPU with
# AVX-512: run both before you stop (docs/testing.md).
test-avx2: $(STAMP)
	ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 $(PY) -m pytest tests bench -q --benchmark-disable

# Timed benchmarks, then the markdown report.
bench: $(STAMP)
	$(PY) -m pytest bench -q --benchmark-only --benchmark-save-data --benchmark-json=bench-results.json
	$(PY) bench/report.py bench-results.json --out bench-results.md

clean:
	rm -rf $(VENV) build dist *.egg-info spectral_ops/_C*.so spectral_ops/_build_info.json
