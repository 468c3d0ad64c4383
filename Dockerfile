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

# The requirements of each extra, read from pyproject.toml. The stages below copy only their
# own list, so their dependency layer is rebuilt when that list changes, not when the code
# does. pipejob itself is built only once its code is there, in a clean tree (it was once
# built from placeholder files first, and their empty copies, left in setuptools' build/
# folder, shipped instead of the code: tests/test_images.py compares every installed file
# with the checkout).
FROM base AS requirements
COPY pyproject.toml ./
RUN python -c 'import tomllib; project = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
[open(f"requirements-{extra}.txt", "w").write("\n".join(project["dependencies"] + deps) + "\n") \
 for extra, deps in project["optional-dependencies"].items()]'

FROM base AS operator
LABEL org.opencontainers.image.title="pipejob-operator" \
      org.opencontainers.image.description="pipejob Kubernetes operator (kopf), no torch"
# The versions are pinned where they are declared: the extras in pyproject.toml.
COPY --from=requirements /src/requirements-operator.txt ./
RUN pip install --no-cache-dir -r requirements-operator.txt
# Only the torch-free code (operator/: pipejob.core, .operator, .runner, .cli). setuptools
# wants every package pyproject.toml lists: the trainer's are made as empty __init__.py
# files, so no trainer code is in this image. `pipejob --help` fails the build if what was
# installed does not run.
COPY pyproject.toml README.md ./
COPY operator/ operator/
RUN python -c 'import tomllib, pathlib; setup = tomllib.load(open("pyproject.toml", "rb"))["tool"]["setuptools"]; \
folder = pathlib.Path(setup["package-dir"]["pipejob.trainer"]); \
[(d.mkdir(parents=True), (d / "__init__.py").touch()) \
 for d in (folder.joinpath(*p.split(".")[2:]) for p in setup["packages"] if p.startswith("pipejob.trainer"))]' \
 && pip install --no-cache-dir --no-deps . \
 && rm -rf /src/* \
 && pipejob --help >/dev/null
WORKDIR /home/pipejob
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["pipejob", "operator"]

FROM base AS trainer
LABEL org.opencontainers.image.title="pipejob-trainer" \
      org.opencontainers.image.description="pipejob trainer: torch + torchvision with CUDA"
# The mallocs of the allocator lever (pipejob.core.tuning_levers), from Debian: tcmalloc, which every
# trainer process runs with by default (the trainer preloads it itself), and jemalloc.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libjemalloc2=5.3.0-1 libtcmalloc-minimal4=2.10-1 \
 && rm -rf /var/lib/apt/lists/*
# torch and torchvision wheels from PyPI bundle the CUDA runtime (nvidia-* wheels); the
# node's NVIDIA driver is all a GPU pod needs besides. The biggest layer, so it goes early.
# TORCH_INDEX_URL may name an extra index with smaller CPU-only builds of the same pinned
# versions (the kind suite uses one); empty, the image is CUDA-capable.
ARG TORCH_INDEX_URL=""
COPY --from=requirements /src/requirements-trainer.txt ./
RUN pip install --no-cache-dir ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} \
        -r requirements-trainer.txt
COPY pyproject.toml README.md ./
COPY operator/ operator/
COPY trainer/ trainer/
# The import checks that what was installed is the code (the build fails otherwise).
RUN pip install --no-cache-dir --no-deps . \
 && rm -rf /src/* \
 && python -c "import pipejob.trainer.__main__, pipejob.trainer.pipeline, pipejob.trainer.hybrid"
WORKDIR /home/pipejob
USER 10001:10001
ENTRYPOINT ["python", "-m", "pipejob.trainer"]
