# dtjob — every target installs what it needs, and running it twice does no work twice.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Build and binary cache, shared by every checkout of this machine (see devcluster/versions.env).
export DTJOB_CACHE ?= $(HOME)/.cache/dtjob
PYTEST_ARGS ?=

.PHONY: venv binaries cluster-tools-in-background floor-venv-in-background test test-e2e test-local test-quick test-floor lint crds demo bench bench-scale bench-peers chaos gpu-check devcluster-up devcluster-down clean

venv: $(STAMP)
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $@

binaries:
	@bash devcluster/build-binaries.sh >/dev/null

# The cluster tools that only some e2e tests start build while the tests before them run, one after
# another and niced: Prometheus (test_prometheus.py, `up --prometheus`), KWOK (test_scale.py,
# `--fake-nodes`) and Volcano (test_volcano.py, `--volcano`). Cold, they take about 21, 7 and 7-17
# minutes on 2 busy cores (devcluster/README.md); KWOK and Volcano used to build inside their test's
# fixture, in series with every test. Each script holds its own lock, so a test's `up` waits for a
# build in flight or, if it failed, builds again and shows why. Cached: no-ops.
cluster-tools-in-background:
	@mkdir -p $(DTJOB_CACHE) && (nice -n 10 bash -c 'bash devcluster/build-prometheus.sh; \
		bash devcluster/build-kwok.sh; bash devcluster/build-binaries.sh --volcano' \
		>$(DTJOB_CACHE)/build-in-background.log 2>&1 &)

# Everything CI runs: lint first (seconds, before any cluster build), then two halves at once
# (make -j2; each half's output is printed whole when it ends), every test under a per-test
# timeout (tests/timeouts.py). In series they took 26 (e2e) and 13 minutes of a 50-minute CI run;
# at once, 44 and 41 of a 47.8-minute one (bench/README.md "CI time"): on 2 cores the e2e pods'
# trainers and the local tests share the CPU, so this saves about 2 minutes, and the floor venv
# installs in the background meanwhile. PYTEST_ARGS go to both halves: to select tests of one
# half, run it.
test: venv
	$(MAKE) lint
	$(MAKE) floor-venv-in-background
	$(MAKE) -j2 --output-sync=target test-e2e test-local

# The devcluster tests (marker e2e, tests/e2e and tests/chaos): the e2e session fixture starts the
# devcluster when none is up and stops it again at the end.
test-e2e: venv
	$(MAKE) binaries
	$(MAKE) cluster-tools-in-background
	$(PY) -m pytest -m e2e $(PYTEST_ARGS)

# Every other test, then the trainer's quick tests again at the floor torch.
test-local: venv
	$(PY) -m pytest -m "not e2e" $(PYTEST_ARGS)
	$(MAKE) test-floor

# The trainer's quick tests again at the floor of pyproject's torch range (#41): torch 2.11, the
# GPU machine's (bench/gpu_check.py). Its own venv, without --system-site-packages (2.15 must not
# leak in) and without the project installed: the sources on PYTHONPATH as on the GPU machine, and
# transformers (as there), no pydantic or kopf. Built once: 2.5 minutes (6 on a busy machine) and 3.8 GB, 4.7 GB once the
# tests wrote their bytecode (PyPI's Linux wheel is the CUDA build, whose nvidia-* libraries
# `import torch` loads even on a CPU-only machine). The tests: 1.3-2 minutes.
# The install holds a lock and skips a venv whose stamp is there: `make test` starts it in the
# background (floor-venv-in-background) and test-floor waits for it or, if it failed, installs
# again and shows why.
FLOOR_VENV := .venv-floor
FLOOR_TORCH := 2.11.0
FLOOR_STAMP := $(FLOOR_VENV)/.installed-torch-$(FLOOR_TORCH)-transformers
FLOOR_TESTS := tests/trainer tests/unit/test_launcher_units.py tests/unit/test_fence.py
FLOOR_PACKAGES := torch==$(FLOOR_TORCH) "numpy>=1.26" "prometheus-client>=0.20" "setproctitle>=1.3" \
	"pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100" "transformers>=5"
FLOOR_INSTALL = flock $(FLOOR_VENV).lock bash -c 'test -e $(FLOOR_STAMP) || { set -ex; rm -rf $(FLOOR_VENV); \
	$(PYTHON) -m venv $(FLOOR_VENV); $(FLOOR_VENV)/bin/python -m pip install --quiet --upgrade pip; \
	$(FLOOR_VENV)/bin/python -m pip install --quiet $(FLOOR_PACKAGES); touch $(FLOOR_STAMP); }'
$(FLOOR_STAMP):
	$(FLOOR_INSTALL)

floor-venv-in-background:
	@(nice -n 10 $(FLOOR_INSTALL) >$(FLOOR_VENV).log 2>&1 &)

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
	rm -rf $(VENV) $(FLOOR_VENV) $(FLOOR_VENV).lock $(FLOOR_VENV).log .pytest_cache .mypy_cache .ruff_cache
