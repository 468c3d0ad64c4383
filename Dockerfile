# syntax=docker/dockerfile:1
# Two images from one file (docs/images.md):
#   docker build --target operator -t ghcr.io/pipejob/operator:0.1.0 .  # kopf operator, no torch
#   docker build --target trainer  -t ghcr.io/pipejob/trainer:0.1.0 .   # torch + torchvision (CUDA)
#
# The base is pinned by tag. Pin it by digest too when you publish images:
#   docker buildx imagetools inspect python:3.11.14-slim-bookworm
# and build with --build-arg PYTHON_IMAGE=python:3.11.14-slim-bookworm@sha256:<digest>.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS base
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.vendor="pipejob" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}"
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# A fixed numeric uid, so Kubernetes can verify runAsNonRoot without reading /etc/passwd.
RUN groupadd --gid 10001 pipejob \
 && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin pipejob
WORKDIR /src
# Only the project metadata: the dependency layers below are rebuilt when pyproject.toml
# changes, not when the code does. pip resolves `.[extra]` from a placeholder project: an
# empty README.md and an empty __init__.py in the folder of every package pyproject.toml
# lists ([tool.setuptools] packages, placed by its package-dir), read from pyproject.toml so
# that a new package needs no change here.
COPY pyproject.toml ./
RUN touch README.md \
 && python -c 'import pathlib, tomllib; \
config = tomllib.load(open("pyproject.toml", "rb"))["tool"]["setuptools"]; \
dirs = {"": ".", **config.get("package-dir", {})}; \
root = lambda name: max((d for d in dirs if d in ("", name) or name.startswith(d + ".")), key=len); \
folder = lambda name: pathlib.Path(dirs[root(name)], *filter(None, name[len(root(name)):].split("."))); \
[(folder(n).mkdir(parents=True, exist_ok=True), (folder(n) / "__init__.py").touch()) \
 for n in config["packages"]]'

FROM base AS operator
LABEL org.opencontainers.image.title="pipejob-operator" \
      org.opencontainers.image.description="pipejob Kubernetes operator (kopf), no torch"
# The versions are pinned where they are declared: the extras in pyproject.toml.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[operator]" && pip uninstall --yes pipejob
# Only the torch-free code (operator/: pipejob.core, .operator, .runner, .cli). The trainer's
# packages stay the empty placeholders of the base stage: no trainer code in this image.
COPY README.md ./
COPY operator/ operator/
RUN pip install --no-cache-dir --no-deps . && rm -rf /src/*
WORKDIR /home/pipejob
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["pipejob", "operator"]

FROM base AS trainer
LABEL org.opencontainers.image.title="pipejob-trainer" \
      org.opencontainers.image.description="pipejob trainer: torch + torchvision with CUDA"
# torch and torchvision wheels from PyPI bundle the CUDA runtime (nvidia-* wheels); the
# node's NVIDIA driver is all a GPU pod needs besides. The biggest layer, so it goes first.
# TORCH_INDEX_URL may name an extra index with smaller CPU-only builds of the same pinned
# versions (the kind suite uses one); empty, the image is CUDA-capable.
ARG TORCH_INDEX_URL=""
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} \
        ".[trainer]" \
 && pip uninstall --yes pipejob
COPY README.md ./
COPY operator/ operator/
COPY trainer/ trainer/
RUN pip install --no-cache-dir --no-deps . && rm -rf /src/*
WORKDIR /home/pipejob
USER 10001:10001
ENTRYPOINT ["python", "-m", "pipejob.trainer"]
