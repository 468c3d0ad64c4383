# The two set-up commands of the README: `make run` and `make test`. Each first runs
# scripts/setup.sh in its mode, which installs only what that command needs:
#   run   the venv with pipejob (editable) and its trainer extra (torch + torchvision)
#   test  the same with the operator and dev extras too, and the static-check tools
#   lint  the venv with pipejob's dev extra only (ruff): `make test` without pytest
VENV ?= $(HOME)/.cache/pipejob/venv
export PIPEJOB_VENV := $(VENV)

.PHONY: run test lint

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
	$(VENV)/bin/pytest
