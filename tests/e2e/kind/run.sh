#!/usr/bin/env bash
# pipejob on a real Kubernetes cluster (kind), end to end, in one command:
#   tests/e2e/kind/run.sh
# Creates a kind cluster, builds both images and loads them into it, installs the Helm
# chart, runs each CPU example to Succeeded, kills a stage pod of a running PipelineJob and
# waits for the whole-world restart and success, deletes the jobs and checks that nothing
# is left, uninstalls the chart and deletes the cluster. Skips (exit 0) with the reason
# where docker, a docker daemon, kind or kubectl is missing. README.md beside this file.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../../.." && pwd)"
CLUSTER="${PIPEJOB_KIND_CLUSTER:-pipejob-e2e}"
KEEP_CLUSTER="${KEEP_CLUSTER:-0}"        # 1: leave the cluster for a look afterwards
TAG="${PIPEJOB_E2E_TAG:-e2e}"
OPERATOR_IMAGE="ghcr.io/pipejob/operator:$TAG"
TRAINER_IMAGE="ghcr.io/pipejob/trainer:$TAG"
# CPU-only torch wheels keep the trainer image small on a CI runner; set it empty to build
# the CUDA-capable image exactly as published.
TRAINER_TORCH_INDEX="${TRAINER_TORCH_INDEX-https://download.pytorch.org/whl/cpu}"
SYSTEM_NS=pipejob-system
JOBS_NS=pipejob-e2e
JOB_TIMEOUT="${JOB_TIMEOUT:-900}"        # seconds for one job to succeed
PIPELINE_EXAMPLE="$ROOT/examples/resnet50-pipeline.yaml"
HYBRID_EXAMPLE="$ROOT/examples/hybrid.yaml"
TOOLS="${PIPEJOB_TOOLS:-$HOME/.cache/pipejob/tools}"

say() { echo "=== kind-e2e: $*"; }
skip() { echo "SKIP kind-e2e: $*"; exit 0; }
fail() { echo "FAIL kind-e2e: $*" >&2; exit 1; }

# --- what this needs ----------------------------------------------------------------------
command -v docker >/dev/null || skip "docker is not installed"
docker info >/dev/null 2>&1 || skip "no docker daemon is reachable (docker info failed)"
command -v kind >/dev/null || skip "kind is not installed (https://kind.sigs.k8s.io)"
KUBECTL="$(command -v kubectl || true)"
[[ -z "$KUBECTL" && -x "$HOME/.cache/pipejob/venv/bin/kubectl" ]] \
    && KUBECTL="$HOME/.cache/pipejob/venv/bin/kubectl"
[[ -n "$KUBECTL" ]] || skip "kubectl is not installed"
HELM="$(command -v helm || true)"
if [[ -z "$HELM" ]]; then
    [[ -x "$TOOLS/bin/helm" ]] || "$ROOT/scripts/install-tools.sh"
    HELM="$TOOLS/bin/helm"
fi
for example in "$PIPELINE_EXAMPLE" "$HYBRID_EXAMPLE"; do
    [[ -f "$example" ]] || fail "missing example $example"
done

CONTEXT="kind-$CLUSTER"
k() { "$KUBECTL" --context "$CONTEXT" "$@"; }

# --- clean-up and diagnostics ---------------------------------------------------------------
diagnose() {
    say "diagnostics"
    k get pipelinejobs,hybridjobs -A -o wide || true
    k get pods,services -n "$JOBS_NS" -o wide --show-labels || true
    k describe pipelinejobs,hybridjobs -n "$JOBS_NS" || true
    k get events -n "$JOBS_NS" --sort-by=.lastTimestamp || true
    k logs -n "$SYSTEM_NS" deployment/pipejob --tail=200 || true
    for pod in $(k get pods -n "$JOBS_NS" -o name 2>/dev/null); do
        echo "--- logs of $pod"; k logs -n "$JOBS_NS" "$pod" --tail=40 || true
    done
}
finish() {
    local rc=$?
    [[ $rc -ne 0 ]] && diagnose
    if [[ "$KEEP_CLUSTER" == 1 ]]; then
        say "keeping cluster $CLUSTER (kind delete cluster --name $CLUSTER)"
    else
        kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
    fi
    [[ $rc -eq 0 ]] && say "PASSED" || echo "FAILED kind-e2e (exit $rc)" >&2
    exit $rc
}
trap finish EXIT

# --- helpers --------------------------------------------------------------------------------
# wait_phase KIND NAME PHASE: until the job's status.phase is PHASE; fail at Failed or timeout.
wait_phase() {
    local kind=$1 name=$2 want=$3 deadline=$((SECONDS + JOB_TIMEOUT)) phase=""
    while ((SECONDS < deadline)); do
        phase="$(k get "$kind" "$name" -n "$JOBS_NS" -o jsonpath='{.status.phase}' 2>/dev/null)"
        [[ "$phase" == "$want" ]] && { say "$kind/$name is $phase"; return 0; }
        if [[ "$phase" == Failed && "$want" != Failed ]]; then
            fail "$kind/$name failed: $(k get "$kind" "$name" -n "$JOBS_NS" \
                -o jsonpath='{.status.conditions[?(@.type=="Failed")].message}')"
        fi
        sleep 3
    done
    fail "$kind/$name did not reach $want within ${JOB_TIMEOUT}s (phase: ${phase:-none})"
}

# gone NAME: no pod or Service of job NAME is left (garbage collection is asynchronous).
gone() {
    local name=$1 deadline=$((SECONDS + 180)) left=""
    while ((SECONDS < deadline)); do
        left="$(k get pods,services -n "$JOBS_NS" -l "pipejob.dev/job=$name" -o name)"
        [[ -z "$left" ]] && { say "nothing of $name is left"; return 0; }
        sleep 2
    done
    fail "left behind by $name: $left"
}

# --- 1. cluster and images ------------------------------------------------------------------
if kind get clusters | grep -qx "$CLUSTER"; then
    say "reusing kind cluster $CLUSTER"
else
    say "creating kind cluster $CLUSTER"
    kind create cluster --name "$CLUSTER" --wait 180s
fi

say "building $OPERATOR_IMAGE and $TRAINER_IMAGE"
docker build --target operator -t "$OPERATOR_IMAGE" "$ROOT"
docker build --target trainer -t "$TRAINER_IMAGE" \
    --build-arg TORCH_INDEX_URL="$TRAINER_TORCH_INDEX" "$ROOT"
say "loading the images into the cluster"
kind load docker-image --name "$CLUSTER" "$OPERATOR_IMAGE" "$TRAINER_IMAGE"

# --- 2. the chart ---------------------------------------------------------------------------
say "helm install"
"$HELM" install pipejob "$ROOT/charts/pipejob" --kube-context "$CONTEXT" \
    --namespace "$SYSTEM_NS" --create-namespace \
    --set image.tag="$TAG" --set image.pullPolicy=Never \
    --set trainerImage="$TRAINER_IMAGE" \
    --wait --timeout 5m
k -n "$SYSTEM_NS" rollout status deployment/pipejob --timeout=120s
k get crd pipelinejobs.pipejob.dev hybridjobs.pipejob.dev >/dev/null
k create namespace "$JOBS_NS"

# The API server itself refuses a bad spec (the CRD's schema and CEL rules), no pod made.
if k apply -n "$JOBS_NS" -f - <<'EOF' 2>/tmp/pipejob-e2e-refused; then
apiVersion: pipejob.dev/v1alpha1
kind: PipelineJob
metadata: {name: refused}
spec: {batchSize: 30, microBatches: 4}
EOF
    fail "the API server accepted a PipelineJob whose batchSize is not divisible by microBatches"
fi
grep -q "batchSize must be divisible by microBatches" /tmp/pipejob-e2e-refused \
    || fail "unexpected refusal: $(cat /tmp/pipejob-e2e-refused)"
say "a bad spec is refused by the API server"

# --- 3. each CPU example to Succeeded --------------------------------------------------------
for example in "$PIPELINE_EXAMPLE" "$HYBRID_EXAMPLE"; do
    kind_name="$(k create --dry-run=client -f "$example" -o jsonpath='{.kind}')"
    name="$(k create --dry-run=client -f "$example" -o jsonpath='{.metadata.name}')"
    say "applying $(basename "$example") ($kind_name/$name)"
    k apply -n "$JOBS_NS" -f "$example"
    wait_phase "$kind_name" "$name" Succeeded
    k get "$kind_name" "$name" -n "$JOBS_NS"
done

# --- 4. kill a stage pod: the whole world restarts, then succeeds ----------------------------
say "restart test: the pipeline example again, one stage pod killed once all pods run"
k patch --local -f "$PIPELINE_EXAMPLE" --type merge \
    -p '{"metadata": {"name": "restart-test"}, "spec": {"backoffLimit": 2}}' \
    -o yaml | k apply -n "$JOBS_NS" -f -
wait_phase pipelinejob restart-test Running
k delete pod restart-test-stage-0 -n "$JOBS_NS" --grace-period=1 --wait=false
phase="$(k get pipelinejob restart-test -n "$JOBS_NS" -o jsonpath='{.status.phase}')"
[[ "$phase" != Succeeded ]] || fail "restart-test finished before its stage was killed"
wait_phase pipelinejob restart-test Succeeded
restarts="$(k get pipelinejob restart-test -n "$JOBS_NS" -o jsonpath='{.status.restarts}')"
[[ "$restarts" == 1 ]] || fail "restart-test: expected restarts 1, got '$restarts'"
k get events -n "$JOBS_NS" --field-selector involvedObject.name=restart-test,reason=PodDeleted \
    -o name | grep -q . || fail "no PodDeleted Event on restart-test"
say "restart-test restarted once (PodDeleted) and succeeded"

# --- 5. delete the jobs: nothing is left ----------------------------------------------------
for job in $(k get pipelinejobs,hybridjobs -n "$JOBS_NS" -o name); do
    name="${job#*/}"
    k delete -n "$JOBS_NS" "$job" --wait=true
    gone "$name"
done
left="$(k get pods,services -n "$JOBS_NS" -o name)"
[[ -z "$left" ]] || fail "left in $JOBS_NS: $left"
say "no pods or services left in $JOBS_NS"

# --- 6. uninstall ---------------------------------------------------------------------------
"$HELM" uninstall pipejob --kube-context "$CONTEXT" --namespace "$SYSTEM_NS" --wait
if k get deployment pipejob -n "$SYSTEM_NS" >/dev/null 2>&1; then
    fail "the operator Deployment is still there after helm uninstall"
fi
say "helm uninstall removed the operator"
