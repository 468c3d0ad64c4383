# The two set-up commands of the README: `make run` and `make test`. Each first runs
# scripts/setup.sh in its mode, which installs only what that command needs:
#   run   the venv with pipejob (editable) and its trainer extra (torch + torchvision)
#   test  the same with the operator and dev extras too, and the static-check tools
#   lint  the venv with pipejob's dev extra only (ruff): `make test` without pytest
# `make images` builds the operator and trainer images (docs/images.md); tags overridable:
#   make images OPERATOR_IMAGE=registry.example.com/pipejob-operator:0.1.0 TRAINER_IMAGE=...
VENV ?= $(HOME)/.cache/pipejob/venv
# Test workers: most tests are worlds of processes that wait on each other as much as they
# compute, so 2 workers finish the suite well before one on 2 cores; the container tests run
# on one worker (tests/conftest.py). TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2
export PIPEJOB_VENV := $(VENV)

OPERATOR_IMAGE ?= pipejob/operator:dev
TRAINER_IMAGE ?= pipejob/trainer:dev

# `make test` leaves out the tests marked `slow` (exhaustive variants of what the default suite
# already proves once: tests/README.md lists them and why); `make test-all` runs everything.
# Each test's seconds go to build/test-durations.txt (tests/conftest.py), the 25 slowest shown.
PYTEST = $(VENV)/bin/pytest -n $(TEST_WORKERS) --dist loadgroup --durations=25

.PHONY: run test test-all lint images

run:
	@scripts/setup.sh run
	$(VENV)/bin/pipejob run examples/resnet50-pipeline.yaml

lint:
	@scripts/setup.sh lint
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test:
	@scripts/setup.sh test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PYTEST) -m "not slow"

test-all:
	@scripts/setup.sh test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PYTEST)

images:
	scripts/images.sh $(OPERATOR_IMAGE) $(TRAINER_IMAGE)
