# dtjob — every target installs what it needs, and running it twice does no work twice.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Build and binary cache, shared by every checkout of this machine (see devcluster/versions.env).
export DTJOB_CACHE ?= $(HOME)/.cache/dtjob
PYTEST_ARGS ?=

.PHONY: venv binaries prometheus-in-background test test-quick test-floor lint crds demo bench bench-scale bench-peers chaos gpu-check devcluster-up devcluster-down clean

venv: $(STAMP)
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $@

binaries:
	@bash devcluster/build-binaries.sh >/dev/null

# Prometheus for tests/e2e/test_prometheus.py (`dtjob devcluster up --prometheus`) builds while
# the tests before it run (a cold build: see devcluster/README.md); that test's `up` waits for it
# (build-prometheus.sh holds a lock) or, if it failed, builds it again and shows why. Cached: a no-op.
prometheus-in-background:
	@mkdir -p $(DTJOB_CACHE) && (nice -n 10 bash devcluster/build-prometheus.sh \
		>$(DTJOB_CACHE)/build-prometheus.log 2>&1 &)

# Everything CI runs: lint first (seconds, before any cluster build), then unit, trainer and e2e
# tests, each under a per-test timeout (tests/timeouts.py); the e2e session fixture starts the
# devcluster when none is up and stops it again at the end.
test: venv
	$(MAKE) lint
	$(MAKE) binaries
	$(MAKE) prometheus-in-background
	$(PY) -m pytest $(PYTEST_ARGS)
	$(MAKE) test-floor

# The trainer's quick tests again at the floor of pyproject's torch range (#41): torch 2.11, the
# GPU machine's (bench/gpu_check.py). Its own venv, without --system-site-packages (2.15 must not
# leak in) and without the project installed: the sources on PYTHONPATH as on the GPU machine, and
# transformers (as there), no pydantic or kopf. Built once: 2.5 minutes (6 on a busy machine) and 3.8 GB, 4.7 GB once the
# tests wrote their bytecode (PyPI's Linux wheel is the CUDA build, whose nvidia-* libraries
# `import torch` loads even on a CPU-only machine). The tests: 1.3-2 minutes.
FLOOR_VENV := .venv-floor
FLOOR_TORCH := 2.11.0
FLOOR_STAMP := $(FLOOR_VENV)/.installed-torch-$(FLOOR_TORCH)-transformers
FLOOR_TESTS := tests/trainer tests/unit/test_launcher_units.py tests/unit/test_fence.py
$(FLOOR_STAMP):
	rm -rf $(FLOOR_VENV)
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(FLOOR_VENV)/bin/python -m pip install --quiet torch==$(FLOOR_TORCH) 'numpy>=1.26' \
		'prometheus-client>=0.20' 'setproctitle>=1.3' 'pytest>=8' 'pytest-timeout>=2.3' 'hypothesis>=6.100' \
		'transformers>=5'
	touch $@

test-floor: $(FLOOR_STAMP)
	PYTHONPATH=operator:trainer_image:devcluster:. $(FLOOR_VENV)/bin/python -m pytest -p no:cacheprovider \
		-m "not e2e and not slow" $(FLOOR_TESTS) $(PYTEST_ARGS)

# The quick loop (about a minute): every test that needs neither the cluster nor several
# processes training (markers e2e and slow); `make test` runs those too.
test-quick: venv
	$(PY) -m pytest -m "not e2e and not slow" $(PYTEST_ARGS)

lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

crds: venv
	$(VENV)/bin/dtjob crd > crds/training.dtjob.io_distributedtrainingjobs.yaml
	cp crds/training.dtjob.io_distributedtrainingjobs.yaml helm/dtjob/crds/

demo: venv binaries
	$(PY) -m dtjob.demo

bench: venv
	$(PY) bench/collectives.py
	$(PY) bench/training.py

# The operator on 128 KWOK nodes: 64-1,024 workers, 50-500 jobs, 3 repeats each (about 1.5 hours
# here); a devcluster of simulated nodes only, brought up (KWOK built on first use) and down again.
bench-scale: venv binaries
	$(PY) bench/scale.py

# Not part of `make test`: dtjob and Kubeflow's PyTorchJob (training-operator, built from the Go
# module proxy) on the devcluster, same trainer and faults (bench/peers/): one run of
# BENCH_PEERS_REPEATS repeats of each, then the table merged over every run so far. The devcluster
# is shared by everyone on the machine: the run holds its lock and takes the cluster down.
BENCH_PEERS_REPEATS ?= 5
DEVCLUSTER_LOCK ?= /tmp/dtjob-e2e.lock
bench-peers: venv binaries
	flock $(DEVCLUSTER_LOCK) $(PY) -m bench.peers run --repeats $(BENCH_PEERS_REPEATS) --down
	$(PY) -m bench.peers report

# The chaos soak (not in `make test`, which runs one fault of each kind): tests/chaos with 3 faults
# of each kind, writing bench/results/chaos.json (the table in bench/README.md).
chaos: venv binaries
	DTJOB_CHAOS_ROUNDS=3 DTJOB_CHAOS_RESULTS=bench/results/chaos.json $(PY) -m pytest -s tests/chaos $(PYTEST_ARGS)
	$(PY) -m tests.chaos.report bench/results/chaos.json

# On a machine with a GPU (not part of `make test`; CI has none): bench/gpu_check.py's table. No
# venv and no pip: the GPU machine has torch but no network (#41); the sources go on PYTHONPATH.
gpu-check:
	PYTHONPATH=operator:trainer_image:devcluster $(PYTHON) bench/gpu_check.py

devcluster-up: venv binaries
	$(VENV)/bin/dtjob devcluster up

devcluster-down: venv
	$(VENV)/bin/dtjob devcluster down

clean: devcluster-down
	rm -rf $(VENV) $(FLOOR_VENV) .pytest_cache .mypy_cache .ruff_cache
