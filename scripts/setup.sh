#!/usr/bin/env bash
# Idempotent set-up of the one virtual environment every run reuses (outside the clone, so
# fresh clones and CI runs on the same machine reuse it).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${PIPEJOB_VENV:-$HOME/.cache/pipejob/venv}
TORCH=(torch==2.13.0 torchvision==0.28.0)

python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
  || { echo "setup: pipejob needs Python 3.11 as python3" >&2; exit 1; }

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  python3 -m venv "$VENV"
fi

# This machine's pip config points at a local CPU-only torch wheel that has no matching
# torchvision (torchvision from the registry then fails with "operator torchvision::nms does
# not exist"). Ignore that config for the torch pair so both come from the registry together.
if ! "$VENV/bin/python" - <<'PY' 2>/dev/null
import torch, torchvision
assert torch.__version__.split("+")[0] == "2.13.0"
assert torchvision.__version__.split("+")[0] == "0.28.0"
PY
then
  echo "setup: installing ${TORCH[*]} from the registry (first time only, about a minute)"
  PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS="" "$VENV/bin/pip" install --quiet "${TORCH[@]}"
fi

# Reinstall the project only when its metadata or location changed.
stamp="$VENV/.pipejob-$(cat pyproject.toml <(pwd) | sha256sum | cut -c1-16)"
if [ ! -e "$stamp" ]; then
  echo "setup: installing pipejob (editable) with its operator, trainer and dev extras"
  "$VENV/bin/pip" install --quiet -e ".[operator,trainer,dev]" 2>&1 | grep -v "^WARNING: Location" || true
  "$VENV/bin/python" -c 'import pipejob.trainer, kopf, torchvision' \
    || { echo "setup: install failed" >&2; exit 1; }
  rm -f "$VENV"/.pipejob-*
  touch "$stamp"
fi

if [ -x scripts/install-tools.sh ]; then
  scripts/install-tools.sh
fi
