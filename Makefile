# The two set-up commands of the README: `make run` and `make test`.
VENV ?= $(HOME)/.cache/pipejob/venv
export PIPEJOB_VENV := $(VENV)

.PHONY: setup run test lint

setup:
	@scripts/setup.sh

run: setup
	$(VENV)/bin/pipejob run examples/resnet50-pipeline.yaml

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(VENV)/bin/pytest
