# Two entry points: `make demo` (set up, then run the main job) and `make test` (set up, then run
# the test suite). Both create .venv on first use and reinstall when the build files change.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# The ends of the supported torch range (spectral_ops/compat.py), each in a venv of its own:
# `make compat` runs the whole suite at the oldest, `make compat TORCH_SET=newest` at the newest, and
# `make test` runs COMPAT_TESTS (the import, ops, optimizers, compile and distributed tests) at the oldest.
TORCH_SET ?= oldest
COMPAT_VENV := .venv-torch-$(TORCH_SET)
COMPAT_PY := $(COMPAT_VENV)/bin/python
COMPAT_STAMP := $(COMPAT_VENV)/.installed
# Of the compiled-step counts (each case compiles for seconds), the default p = 2 step runs there.
COMPAT_TESTS := tests/test_main.py tests/test_compat.py tests/test_ops.py tests/test_plan.py tests/test_decay.py \
	tests/test_compile.py $(filter-out tests/test_optim_compile.py,$(wildcard tests/test_optim_*.py)) \
	"tests/test_optim_compile.py::test_a_compiled_default_step_has_no_more_graphs_or_breaks_than_torchs[adamw-p2-scheduled-lr]"

# Where nvcc exists, the CUDA extension must build: a compile error fails `make test` (and CI).
NVCC := $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
export SPECTRAL_OPS_REQUIRE_CUDA ?= $(if $(NVCC),1,0)
PACKAGE_FILES := pyproject.toml setup.py CMakeLists.txt $(wildcard csrc/*)

.PHONY: demo test test-debian test-avx2 compat bench clean

# A venv in two steps, each with its stamp: its requirements, then the package itself. The editable install
# writes into the working tree (the build record, and the CUDA module where nvcc exists), so `make test`
# does it only while no suite runs; the requirements, the long step, touch nothing outside the venv.
# The requirements go in with uv: it downloads and unpacks in parallel (.venv's from nothing, 2 cores: 66 s,
# against pip's 148 s), and compiles the bytecode that Python would otherwise compile at every import where
# PYTHONDONTWRITEBYTECODE is set. uv reads no pip configuration, so the wheel folders pip is pointed at
# (PIP_FIND_LINKS, find-links in pip's configuration files) are handed on: where a machine keeps torch's CPU
# build in one, it is taken as pip would take it. pip still makes the editable install (below).
UV := uv==0.13.10
PIP_WHEEL_FOLDERS = $(sort $(PIP_FIND_LINKS) $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
# $(1): the venv, $(2): its requirements files besides requirements-test.txt (its torch's first).
define install_requirements
	$(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install --quiet $(UV)
	$(1)/bin/uv pip install --quiet --native-tls --compile-bytecode --python $(1)/bin/python \
		$(foreach folder,$(PIP_WHEEL_FOLDERS),--find-links $(folder)) $(foreach file,$(2),-r $(file)) -r requirements-test.txt
	touch $(1)/.requirements
endef

# The main venv also has the frameworks of docs/integrations.md (tests/test_integrations_*.py).
$(VENV)/.requirements: requirements-torch.txt requirements-integrations.txt requirements-test.txt
	$(call install_requirements,$(VENV),requirements-torch.txt requirements-integrations.txt)

$(COMPAT_VENV)/.requirements: requirements-torch-$(TORCH_SET).txt requirements-test.txt
	$(call install_requirements,$(COMPAT_VENV),requirements-torch-$(TORCH_SET).txt)

%/.installed: %/.requirements $(PACKAGE_FILES)
	$*/bin/python -m pip install --quiet --no-build-isolation -e .
	touch $@

demo: $(STAMP)
	$(PY) -m spectral_ops
	$(PY) -m spectral_ops.train demo

# pytest-xdist: one worker per core (at most 8), each with its share of the cores for torch's threads;
# the modules that share a costly fixture run on one worker each (tests/conftest.py, docs/testing.md).
XDIST := -n auto --maxprocesses 8

# NVIDIA's emerging-optimizers declares Python >= 3.12 and this machine has 3.11: its tests run on Debian's
# Python and Debian's CPU torch (2.14, inside the supported range), in a chroot that debootstrap builds once per
# machine from Debian's packages (root only; about 2 GB and 5 minutes), with a venv of what the tests need from
# PyPI. The registry's Debian is a snapshot whose Release files outlive their Valid-Until: apt is told so. The
# chroot trusts the host's CA bundle, as the host's pip does (the host's wheel folder, PIP_FIND_LINKS, is not
# there). `make test DEBIAN_CHROOT=0` leaves it out. A user who is not root cannot build the chroot: for them it is
# left out by default, and `make test` says so in one line and ends green (CI is root and runs it).
ROOT := $(filter 0,$(shell id -u))
DEBIAN_CHROOT ?= $(if $(ROOT),1,0)
DEBIAN_LEFT_OUT := $(if $(ROOT),DEBIAN_CHROOT=0,its Debian chroot needs root and this is user $(shell id -un): \
	run make test as root to include it)
DEBIAN_SUITE := forky
DEBIAN_ROOT ?= $(HOME)/.cache/spectral_ops/debian-$(DEBIAN_SUITE)
# The host's own Debian mirror, from its apt sources (deb822 first, then the one-line format).
DEBIAN_MIRROR ?= $(shell { sed -n 's/^URIs: //p' /etc/apt/sources.list.d/debian.sources; \
	awk '$$1 == "deb" {print $$2}' /etc/apt/sources.list; } 2>/dev/null | head -1)
DEBIAN_APT := -o Acquire::Check-Valid-Until=false
# Besides the framework's pin (requirements-integrations.txt): the triton Debian's torch 2.14 pairs with (the
# framework imports it), and what the tests import.
DEBIAN_PIP := pytest tqdm triton==3.8.0 "$$(grep '^emerging-optimizers' requirements-integrations.txt)"
DEBIAN_TESTS := tests/test_integrations_emerging_optimizers.py
DEBIAN_STAMP := $(DEBIAN_ROOT)/.installed-$(shell cat requirements-integrations.txt | sha256sum | cut -c1-12)

$(DEBIAN_STAMP):
	@test "$$(id -u)" = 0 || { echo "$(DEBIAN_TESTS) runs in a chroot, which needs root: run as root, or \
	make test DEBIAN_CHROOT=0 to leave it out (docs/testing.md)"; exit 1; }
	@test -n "$(DEBIAN_MIRROR)" || { echo "no Debian mirror in the host's apt sources: set DEBIAN_MIRROR"; exit 1; }
	command -v debootstrap >/dev/null || { apt-get update -qq && apt-get install -y -qq debootstrap; }
	rm -rf --one-file-system "$(DEBIAN_ROOT)"
	debootstrap --variant=minbase --include=python3-venv $(DEBIAN_SUITE) "$(DEBIAN_ROOT)" $(DEBIAN_MIRROR) \
		/usr/share/debootstrap/scripts/sid
	chroot "$(DEBIAN_ROOT)" apt-get $(DEBIAN_APT) update -qq
	chroot "$(DEBIAN_ROOT)" env DEBIAN_FRONTEND=noninteractive apt-get $(DEBIAN_APT) install -y -qq \
		--no-install-recommends python3-torch
	cp "$${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}" "$(DEBIAN_ROOT)/etc/ssl/certs/ca-certificates.crt"
	chroot "$(DEBIAN_ROOT)" python3 -m venv --system-site-packages /venv
	chroot "$(DEBIAN_ROOT)" env -u PIP_FIND_LINKS /venv/bin/pip install --quiet $(DEBIAN_PIP)
	touch "$@"

# The working tree (tracked files and untracked ones git does not ignore), copied in afresh.
test-debian: $(if $(filter 1,$(DEBIAN_CHROOT)),$(DEBIAN_STAMP))
ifeq ($(DEBIAN_CHROOT),1)
	rm -rf --one-file-system "$(DEBIAN_ROOT)/src" && mkdir "$(DEBIAN_ROOT)/src"
	git ls-files -co --exclude-standard -z | xargs -0 tar c | tar x -C "$(DEBIAN_ROOT)/src"
	chroot "$(DEBIAN_ROOT)" sh -c 'cd /src && HOME=/tmp PYTHONPATH=/src SPECTRAL_OPS_REQUIRE_INTEGRATIONS=1 \
		/venv/bin/python -m pytest -q -rfEs -p no:cacheprovider $(DEBIAN_TESTS)'
else
	@echo "$(DEBIAN_TESTS): left out ($(DEBIAN_LEFT_OUT))"
endif

# `make test` in stages, run by make -j3 (test-stages). Each setup alone leaves a core idle (pip installs on
# one, and waits on downloads and the disk; so do debootstrap and apt), and only .venv's is needed before the
# main suite. So .venv's requirements install in the foreground while the oldest torch's venv and the Debian
# chroot build in the background, each into its log under $(BACKGROUND_LOGS); ruff and the main suite start
# once .venv is ready; the oldest torch's subset and the chroot's tests wait for the main suite and their own
# setup. A setup that failed does not stop the
# main suite: the stage that needs it fails, with its log's last lines. make waits for every job it started,
# on a failure too, so nothing goes on running after it exits.
test:
	@$(MAKE) --no-print-directory -j3 test-stages

BACKGROUND_LOGS := build/test-setup

# $(1): the file to make, $(2): its log's name, at the lowest priority (nice 19), so that .venv's setup, which
# the main suite waits for, and then the main suite get the cores first (by Linux's scheduler weights, two
# setups at nice 10 beside two busy workers take a tenth of the machine, at nice 19 under 2%); what a setup
# still has to do when the main suite ends then runs at full speed. The recipe always succeeds; the exit
# status goes to a file that background_result reads.
define make_in_background
	@mkdir -p $(BACKGROUND_LOGS)
	@echo "making $(1) in the background (log: $(BACKGROUND_LOGS)/$(2).log)"
	@+nice -n 19 $(MAKE) --no-print-directory $(1) > $(BACKGROUND_LOGS)/$(2).log 2>&1; echo $$? > $(BACKGROUND_LOGS)/$(2).status
endef

define background_result
	@test "$$(cat $(BACKGROUND_LOGS)/$(2).status)" = 0 || { tail -n 30 $(BACKGROUND_LOGS)/$(2).log; \
		echo "making $(1) failed: above, the end of its log $(BACKGROUND_LOGS)/$(2).log"; exit 1; }
endef

.PHONY: test-stages test-main test-oldest background-oldest background-debian

background-oldest:
	$(call make_in_background,$(COMPAT_VENV)/.requirements,torch-$(TORCH_SET))

background-debian:
ifeq ($(DEBIAN_CHROOT),1)
	$(call make_in_background,$(DEBIAN_STAMP),debian-$(DEBIAN_SUITE))
endif

# Lint first (pyproject.toml's [tool.ruff]); the benchmarks run once each, untimed, as a smoke test (no
# framework of docs/integrations.md may skip: -rfEs adds why any test skipped to the failures).
test-main: $(STAMP)
	$(VENV)/bin/ruff check .
	SPECTRAL_OPS_REQUIRE_INTEGRATIONS=1 $(PY) -m pytest tests bench -q -rfEs --benchmark-disable $(XDIST) \
		$(foreach file,$(DEBIAN_TESTS),--ignore=$(file))

# Then the core of the suite at the oldest torch (the package's editable install only now: see above).
test-oldest: background-oldest | test-main
	$(call background_result,$(COMPAT_VENV)/.requirements,torch-$(TORCH_SET))
	$(MAKE) --no-print-directory $(COMPAT_STAMP)
	$(COMPAT_PY) -m pytest $(COMPAT_TESTS) -q $(XDIST)

# The last stage, once all the others are done: emerging-optimizers' tests in the Debian chroot.
test-stages: test-oldest background-debian
ifeq ($(DEBIAN_CHROOT),1)
	$(call background_result,$(DEBIAN_STAMP),debian-$(DEBIAN_SUITE))
endif
	$(MAKE) --no-print-directory test-debian

# The suite with the kernels an AVX2-only CPU runs (bf16 emulated, MKL's AVX2 GEMM), on a CPU with
# AVX-512: run both before you stop (docs/testing.md).
test-avx2: $(STAMP)
	ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 $(PY) -m pytest tests bench -q --benchmark-disable $(XDIST)

compat: $(COMPAT_STAMP)
	$(COMPAT_PY) -m pytest tests bench -q --benchmark-disable $(XDIST)

# Timed benchmarks, then the markdown report.
bench: $(STAMP)
	$(PY) -m pytest bench -q --benchmark-only --benchmark-save-data --benchmark-json=bench-results.json
	$(PY) bench/report.py bench-results.json --out bench-results.md

clean:
	rm -rf $(VENV) .venv-torch-* build dist *.egg-info spectral_ops/_C*.so spectral_ops/_build_info.json
