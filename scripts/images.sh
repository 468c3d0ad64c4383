#!/usr/bin/env bash
# images.sh [OPERATOR_TAG] [TRAINER_TAG]: build both targets of the Dockerfile (`make images`)
# and print their sizes. Defaults: pipejob/operator:dev and pipejob/trainer:dev.
# Air-gapped: when the Dockerfile's base image is neither here nor pullable, it says so in one
# line and builds a stand-in base under the same name (scripts/standin-base.sh, Debian
# bookworm's own python3; docs/images.md says what differs), then builds on it.
# Builds use the host's network (`--network host`): pip in a build reaches the same package
# registry this machine does. Each build's output goes to a log shown only when it fails.
# Env: PYTHON_IMAGE (another base), DOCKER_BUILD_ARGS (more `docker build` arguments).
set -euo pipefail
cd "$(dirname "$0")/.."

OPERATOR=${1:-pipejob/operator:dev}
TRAINER=${2:-pipejob/trainer:dev}
BASE=${PYTHON_IMAGE:-$(sed -n 's/^ARG PYTHON_IMAGE=//p' Dockerfile)}

say() { echo "images: $*"; }

if ! docker info >/dev/null 2>&1; then
  echo "images: no docker daemon answers (start dockerd, or see docs/images.md)" >&2
  exit 1
fi

if ! docker image inspect "$BASE" >/dev/null 2>&1 && ! docker pull -q "$BASE" >/dev/null 2>&1; then
  say "cannot pull $BASE (no registry reachable): building a stand-in from Debian bookworm"
  scripts/standin-base.sh "$BASE"
fi

build() {  # build TARGET TAG
  local log status=0 start=$SECONDS
  log=$(mktemp)
  # shellcheck disable=SC2086  # DOCKER_BUILD_ARGS is a list of arguments
  docker build --network host --target "$1" -t "$2" \
    --build-arg PYTHON_IMAGE="$BASE" ${DOCKER_BUILD_ARGS:-} . >"$log" 2>&1 || status=$?
  if [[ $status -ne 0 ]]; then
    echo "images: building $2 (target $1) failed; the end of its log:" >&2
    tail -n 40 "$log" >&2
    rm -f "$log"
    exit "$status"
  fi
  rm -f "$log"
  say "built $2 (target $1) in $((SECONDS - start)) s"
}

build operator "$OPERATOR"
build trainer "$TRAINER"
for tag in "$OPERATOR" "$TRAINER"; do
  size=$(docker image inspect -f '{{.Size}}' "$tag")
  say "$(printf '%-40s %6d MB' "$tag" $((size / 1000000)))"
done
