#!/usr/bin/env bash
# Idempotent set-up of the one virtual environment every run reuses (outside the clone, so
# fresh clones and CI runs on the same machine reuse it). What it installs depends on the
# mode (the Makefile passes it):
#   run   pipejob editable with the trainer extra: torch + torchvision, pyyaml, prometheus-client
#         (all `pipejob run` imports; the operator extra, kopf and kubernetes, is not needed)
#   lint  pipejob editable with the dev extra (ruff), no torch
#   test  pipejob editable with the operator, trainer and dev extras, and the static-check
#         tools (scripts/install-tools.sh); the default
# Quick and silent but for one line when everything is there: a step prints a line only when
# it installs something. pip's output goes to a log that is shown only when pip fails.
set -euo pipefail
cd "$(dirname "$0")/.."

MODE=${1:-test}
case "$MODE" in
  run) EXTRAS=trainer TOOLS=no ;;
  lint) EXTRAS=dev TOOLS=no ;;
  test) EXTRAS=operator,trainer,dev TOOLS=yes ;;
  *) echo "usage: scripts/setup.sh [run|lint|test]" >&2; exit 2 ;;
esac
VENV=${PIPEJOB_VENV:-$HOME/.cache/pipejob/venv}
TORCH=(torch==2.13.0 torchvision==0.28.0)

say() { echo "setup: $*"; }

# pip_quietly PIP ARGS...: run pip with its output in a log; on failure show the log's end
# (without this machine's "Location ... is ignored" noise from its pip config's local
# indexes). The log has pip's normal verbosity, so the error comes with its context.
pip_quietly() {
  local log status=0
  log=$(mktemp)
  "$@" --disable-pip-version-check >"$log" 2>&1 || status=$?
  if [ "$status" -ne 0 ]; then
    echo "setup: pip failed (exit $status); the end of its log:" >&2
    grep -v "^WARNING: Location '" "$log" | tail -n 40 >&2
  else
    # pip reports a broken dependency set with ERROR lines and exit status 0: keep those.
    grep "^ERROR:" "$log" >&2 || true
  fi
  rm -f "$log"
  return "$status"
}

has() { [[ ",$2," == *",$1,"* ]]; }  # has EXTRA LIST: LIST (comma-separated) names EXTRA

python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
  || { echo "setup: pipejob needs Python 3.11 as python3" >&2; exit 1; }

if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  python3 -m venv "$VENV"
fi

# This machine's pip config points at a local CPU-only torch wheel (2.13.0+cpu) that has no
# matching torchvision (torchvision from the registry then fails with "operator
# torchvision::nms does not exist"). Ignore that config for the torch pair so both come from
# the registry together. The pair is fine when both have the pinned versions with the same
# local label (none from the registry); reading their metadata is quick, importing torch not.
if has trainer "$EXTRAS" && ! "$VENV/bin/python" - <<'PY' 2>/dev/null
from importlib.metadata import version
torch, vision = version("torch").partition("+"), version("torchvision").partition("+")
assert (torch[0], vision[0], torch[2]) == ("2.13.0", "0.28.0", vision[2])
PY
then
  say "installing ${TORCH[*]} from the registry (first time only, about a minute, ~5 GB)"
  PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS="" pip_quietly "$VENV/bin/pip" install "${TORCH[@]}"
  "$VENV/bin/python" -c 'import torch, torchvision' \
    || { echo "setup: torch and torchvision do not import together" >&2; exit 1; }
fi

# Reinstall the project only when its metadata or location changed, or when this mode needs
# an extra the last install did not have. The stamp holds "KEY EXTRAS".
key=$(cat pyproject.toml <(pwd) | sha256sum | cut -c1-16)
stamp="$VENV/.pipejob-setup"
stamped_key="" stamped_extras=""
if [ -f "$stamp" ]; then
  read -r stamped_key stamped_extras <"$stamp" || true
fi
union=$EXTRAS
if [ "$stamped_key" = "$key" ]; then  # keep what is installed and current in the stamp
  union+=",$stamped_extras"
fi
wanted=""
for extra in operator trainer dev; do
  if has "$extra" "$union"; then wanted+="${wanted:+,}$extra"; fi
done
covered=yes
for extra in ${EXTRAS//,/ }; do
  if [ "$stamped_key" != "$key" ] || ! has "$extra" "$stamped_extras"; then covered=no; fi
done
# The stamp says what was installed, not what is: another checkout's install into the same
# venv (or an uninstall) since then is seen by where pipejob imports from.
here=$(cd "$(pwd)/operator" && pwd -P)
there=$(cd / && "$VENV/bin/python" -c 'import os, pipejob; print(os.path.dirname(os.path.dirname(os.path.realpath(pipejob.__file__))))' 2>/dev/null || true)
if [ "$there" != "$here" ]; then covered=no; fi
if [ "$covered" = no ]; then
  say "installing pipejob (editable) with the extras $wanted"
  pip_quietly "$VENV/bin/pip" install -e ".[$wanted]"
  imports=pipejob.cli.main
  has operator "$wanted" && imports+=",kopf,kubernetes"
  has trainer "$wanted" && imports+=",pipejob.trainer,torch,torchvision"
  has dev "$wanted" && imports+=",pytest,kmock,ruff"
  "$VENV/bin/python" -c "import $imports" \
    || { echo "setup: install failed: cannot import $imports" >&2; exit 1; }
  rm -f "$VENV"/.pipejob-*  # this stamp and those of older set-ups
  echo "$key $wanted" >"$stamp"
fi

# The mallocs of the allocator lever, found by its own rule (pipejob.core.tuning_levers): tcmalloc,
# every training process's default, and jemalloc. Debian's packages where this runs as root
# with apt; elsewhere one line says what is missing, and the processes use glibc's malloc.
missing_mallocs() {
  "$VENV/bin/python" -c 'from pipejob.core.tuning_levers import MALLOCS, library_file
print(" ".join(m.package for m in MALLOCS.values() if m.library and not library_file(m.library)))'
}
if has trainer "$EXTRAS"; then
  missing=$(missing_mallocs)
  if [ -n "$missing" ] && [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
    say "installing $missing (Debian's mallocs for pipejob's processes)"
    log=$(mktemp)
    # shellcheck disable=SC2086  # a list of packages
    { apt-get install -y --no-install-recommends $missing \
      || { apt-get update && apt-get install -y --no-install-recommends $missing; }; } \
      >"$log" 2>&1 || { echo "setup: apt-get failed; its log's end:" >&2; tail -n 20 "$log" >&2; }
    rm -f "$log"
    missing=$(missing_mallocs)
  fi
  if [ -n "$missing" ]; then
    say "no $missing here (apt-get install $missing, as root): a process whose malloc is missing runs with glibc's, slower or holding more memory"
  fi
fi

if [ "$TOOLS" = yes ]; then
  scripts/install-tools.sh
fi
say "ready ($MODE: venv $VENV)"
