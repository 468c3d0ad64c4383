#!/usr/bin/env bash
# standin-base.sh TAG: build a stand-in for the Dockerfile's base image (python:3.11.x-slim-
# bookworm) from Debian's own packages, for machines that reach Debian's archive and PyPI but
# no image registry. Debian bookworm's python3 is 3.11, as the real base's is. What differs
# from the real base is in docs/images.md. Needs root and debootstrap; takes about a minute.
#   - debootstrap --variant=minbase bookworm with python3, venv, pip and ca-certificates
#   - `python` and `pip` in /usr/local/bin, as the python image has them
#   - this machine's CA bundle inside, so that pip in a build trusts what the host trusts
#   - PIP_BREAK_SYSTEM_PACKAGES=1: pip installs into the system python, as in the real base
set -euo pipefail

TAG=${1:?usage: scripts/standin-base.sh TAG}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}

[[ $(id -u) -eq 0 ]] || { echo "standin-base: needs root (debootstrap)" >&2; exit 1; }
command -v debootstrap >/dev/null \
  || { echo "standin-base: needs debootstrap (apt-get install debootstrap)" >&2; exit 1; }

ROOT=$(mktemp -d /tmp/pipejob-standin.XXXXXX)
trap 'rm -rf "$ROOT"' EXIT
log="$ROOT.log"
if ! debootstrap --variant=minbase \
    --include=python3,python3-venv,python3-pip,ca-certificates \
    bookworm "$ROOT" "$MIRROR" >"$log" 2>&1; then
  echo "standin-base: debootstrap failed; the end of its log:" >&2
  tail -n 20 "$log" >&2
  exit 1
fi
rm -f "$log"
ln -sf /usr/bin/python3 "$ROOT/usr/local/bin/python"
ln -sf /usr/bin/pip3 "$ROOT/usr/local/bin/pip"
if [[ -f $CA_BUNDLE ]]; then
  cp "$CA_BUNDLE" "$ROOT/etc/ssl/certs/ca-certificates.crt"
fi
# What an image does not need: apt's lists and caches, docs (as the slim image drops them).
rm -rf "$ROOT"/var/lib/apt/lists/* "$ROOT"/var/cache/apt/*.bin "$ROOT"/var/cache/apt/archives/*.deb \
  "$ROOT"/usr/share/doc/* "$ROOT"/usr/share/man/* "$ROOT"/usr/share/locale/*

tar -C "$ROOT" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'ENV PIP_BREAK_SYSTEM_PACKAGES=1' \
  --change 'CMD ["python3"]' \
  - "$TAG" >/dev/null
echo "standin-base: built $TAG from Debian bookworm ($(docker run --rm "$TAG" python --version))"
