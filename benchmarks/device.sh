#!/usr/bin/env bash
# benchmarks/device.sh: pipejob proven on a GPU machine (one GPU, 16 CPU cores) in one command
# that ends within 10 minutes and writes everything to one folder.
#
#   benchmarks/device.sh            on the GPU machine: the steps below, full size
#   benchmarks/device.sh --cpu      the same steps, small, on a CPU machine (a rehearsal, so
#                                   the GPU run works the first time; tests/test_device.py)
#
# Steps, in order; each has its own time limit and log, and a failed one does not stop the
# others:
#   install     pipejob from this checkout into a folder put first on PYTHONPATH (pip, as the
#               machine's own torch stays; where pip cannot build it, a link tree of the sources)
#   gpu-tests   every `gpu` test (tests/test_gpu.py)
#   gpu-bench   benchmarks/gpu.py: pipejob against one process on the same GPU (ResNet-50 at
#               224 and 64 px, batch 256; the 12x768 transformer, batch 32), 2 and 4 stages
#   hybrid      a HybridJob with one trainer on the GPU (gpusPerTrainer: 1), trained to the end
#   transfer    benchmarks/rpc_transfer.py: a 100 MB tensor between two processes over RPC, as
#               stages send activations (CUDA tensors through CUDA IPC or host memory; CPU ones)
#   profile     one pipeline step of each gpu-bench workload (2 stages) profiled on the GPU: CPU
#               and CUDA activity of every process, and the master's parts of the step (on the
#               engine auto chooses: rpc where the stages share the GPU, pipelining on CPUs)
#   overhead    benchmarks/overhead.py on the machine's CPUs (GPU hidden): each engine's fixed
#               and per-micro-batch costs a step against torch's schedules on a tiny model, 2
#               and 4 stages (the costs issue 44 takes down, measured on quiet fast cores)
#   cores       benchmarks/compare.py on 16 cores, GPU hidden: pipejob (the rpc engine) at
#               each micro-batch count, the pipelining engine's 1F1B (pipejob-1f1b), `auto`,
#               torch.distributed.pipelining's GPipe and 1F1B, one process on 16 threads, 3
#               interleaved repeats
# and one more, run only when --only names it:
#   cores-levers  on 16 cores, one repeat at 1 and 2 micro-batches: pipejob, pipejob with all
#               the cores a stage (waiting passively, or spinning as OpenMP's default), GPipe,
#               1F1B and one process (where the time goes at 16 cores)
#
# Time on an H100 machine (2026-11-26, this script's first call): install 11 s, gpu-tests
# 119 s, gpu-bench 197 s, hybrid 35 s, transfer 13 s, profile 23 s (one workload; about 70
# s for the three now), cores 114 s a repeat (a pipejob run on 16 cores takes about 24 s,
# start-up and shutdown included), cores-levers about 190 s (8 runs). With 15 minutes of
# device time (a start included): `--only gpu-tests,gpu-bench,hybrid,profile,overhead,cores
# --cores-repeats 1 --budget 565` (overhead not yet timed there: about a minute expected), then at once on the warm machine `--only cores-levers
# --budget 280` (or, to settle the 16-core figure, `--only cores --cores-repeats 2`).
#
# Options: --out DIR (default $OUT where the device tool sets it, else device-results/),
# --only a,b (run only these steps, install always first), --budget SECONDS (the whole run's
# limit; default 570), --cores-repeats N (the cores sweep's interleaved repeats; default 3).
# Env: PYTHON (default python3).
# What it leaves in DIR: summary.txt (each step's verdict and time, and the figures that
# matter) and logs.tar.gz (every step's whole log and what it wrote: profiles, JSON).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

MODE=gpu
DIR=${OUT:-device-results}
ONLY=""
BUDGET=570
CORES_REPEATS=3
while [[ $# -gt 0 ]]; do
  case $1 in
    --cpu) MODE=cpu ;;
    --out) DIR=$2; shift ;;
    --only) ONLY=$2; shift ;;
    --budget) BUDGET=$2; shift ;;
    --cores-repeats) CORES_REPEATS=$2; shift ;;
    *) echo "device.sh: unknown argument $1 (see the comment at the top)" >&2; exit 2 ;;
  esac
  shift
done
PY=${PYTHON:-python3}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/pipejob-device-XXXXXX")
LOGS=$WORK/logs
mkdir -p "$LOGS"
trap 'rm -rf "$WORK"' EXIT
export PYTHONUNBUFFERED=1
STARTED=$SECONDS
VERDICTS=()

say() { echo "device.sh [$((SECONDS - STARTED))s]: $*"; }

wanted() {
  case $1 in
    machine | install) return 0 ;;
    cores-levers) [[ ",$ONLY," == *",$1,"* ]] ;;
    *) [[ -z $ONLY || ",$ONLY," == *",$1,"* ]] ;;
  esac
}

# step NAME LIMIT FUNCTION: run FUNCTION with its output in logs/NAME.log (and on stdout), for
# at most LIMIT seconds or what is left of the budget, whichever is less; then stop whatever
# it left running (found by a variable only its processes carry: benchmarks start worlds in
# process groups of their own, which a timeout's signal does not reach).
step() {
  local name=$1 limit=$2 fn=$3 left rc start token
  wanted "$name" || return 0
  left=$((BUDGET - (SECONDS - STARTED)))
  # The limits are the GPU machine's; the CPU rehearsal (a test, beside other tests on 2
  # cores) gets twice as long a step, the budget still bounding the whole.
  [[ $MODE == cpu ]] && limit=$((limit * 2))
  if ((left < 20)); then
    VERDICTS+=("$name: NOT RUN (the ${BUDGET}s budget is spent)")
    say "$name: not run, the budget is spent"
    return 0
  fi
  ((limit > left)) && limit=$left
  say "$name: starting (at most ${limit}s)"
  start=$SECONDS
  token=$name-$$-$RANDOM
  PIPEJOB_DEVICE_STEP=$token timeout --kill-after=10 "$limit" bash -c "$fn" 2>&1 |
    tee "$LOGS/$name.log"
  rc=${PIPESTATUS[0]}
  leftovers "$token"
  case $rc in
    0) VERDICTS+=("$name: ok ($((SECONDS - start))s)") ;;
    124 | 137) VERDICTS+=("$name: TIMED OUT after ${limit}s") ;;
    *) VERDICTS+=("$name: FAILED, exit $rc ($((SECONDS - start))s)") ;;
  esac
  say "${VERDICTS[-1]}"
}

leftovers() {
  local pids
  pids=$(grep -lzx "PIPEJOB_DEVICE_STEP=$1" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3)
  if [[ -n $pids ]]; then
    say "stopping what the step left running: $(echo "$pids" | wc -l) process(es)"
    # shellcheck disable=SC2086  # one pid per word
    kill -9 $pids 2>/dev/null
  fi
  return 0
}

install() {
  local target=$WORK/site
  if "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --ignore-requires-python \
    --target "$target" . >"$LOGS/pip.log" 2>&1; then
    echo "installed pipejob into $target (pip)"
  else
    # pip builds with the machine's setuptools, which may predate pyproject.toml's license
    # field: the sources as they are, linked as pyproject.toml's package-dir maps them.
    echo "pip could not install pipejob (the end of its log below); linking the sources instead"
    tail -n 5 "$LOGS/pip.log"
    rm -rf "$target" && mkdir -p "$target/pipejob"
    for entry in operator/pipejob/*; do ln -s "$PWD/$entry" "$target/pipejob/"; done
    ln -s "$PWD/trainer/pipejob/trainer" "$target/pipejob/trainer"
  fi
  export PYTHONPATH=$target${PYTHONPATH:+:$PYTHONPATH}
  (cd / && "$PY" -c "import pipejob.trainer, pipejob.cli, torch, sys
print('pipejob from', pipejob.trainer.__file__.rsplit('/', 2)[0])
print('python', sys.version.split()[0], '| torch', torch.__version__, '| CUDA',
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none')")
}

machine() {
  nproc
  free -g | head -2
  if command -v nvidia-smi >/dev/null; then nvidia-smi -L; fi
}

gpu_tests() {
  local parallel=()
  # The tests are small and each bounds its own time; three at a time fit one GPU.
  if [[ $MODE == gpu ]] && "$PY" -c "import xdist" 2>/dev/null; then parallel=(-n 3); fi
  "$PY" -m pytest -m gpu tests/test_gpu.py -p no:cacheprovider -o addopts=-ra "${parallel[@]}"
}

gpu_bench() {
  if [[ $MODE == gpu ]]; then
    "$PY" benchmarks/gpu.py --steps 10 --warmup 2 --timeout 150 --logs "$LOGS/gpu-bench"
  else
    "$PY" benchmarks/gpu.py --device cpu --small --stages 2 --steps 3 --warmup 1 --timeout 300 \
      --logs "$LOGS/gpu-bench"
  fi
}

# A job manifest: kind, name, spec as JSON (written as YAML, which JSON is).
manifest() {
  printf '{"apiVersion": "pipejob.dev/v1alpha1", "kind": "%s", "metadata": {"name": "%s"}, "spec": %s}\n' \
    "$1" "$2" "$3" >"$WORK/$2.yaml"
  echo "$WORK/$2.yaml"
}

hybrid() {
  local gpus=1 steps=300 file
  [[ $MODE == cpu ]] && gpus=0 steps=40
  file=$(manifest HybridJob device-hybrid "{\"trainers\": 1, \"gpusPerTrainer\": $gpus,
    \"embedding\": {\"numEmbeddings\": 1000, \"dim\": 16, \"mode\": \"sum\"},
    \"dense\": {\"outFeatures\": 8}, \"steps\": $steps, \"batchSize\": 256, \"bagSize\": 10,
    \"datasetSize\": $((steps * 256)), \"seed\": 0, \"logEvery\": 50,
    \"optimizer\": {\"name\": \"sgd\", \"lr\": 0.2, \"momentum\": 0.9},
    \"eval\": {\"everySteps\": $steps}, \"output\": {\"path\": \"$WORK/hybrid-model\"}}")
  "$PY" -m pipejob.cli run "$file" # its master prints the summary: losses, rate, evaluation
}

transfer() {
  if [[ $MODE == gpu ]]; then
    "$PY" benchmarks/rpc_transfer.py
  else
    "$PY" benchmarks/rpc_transfer.py --megabytes 8 --rounds 3
  fi
}

profile() {
  # One step of each gpu-bench workload profiled, at the count `auto` chose there on the H100
  # (2 micro-batches at 224 px, 1 otherwise); its parts on the master recapped at the end.
  local gpus=1 name spec failed=0
  local -A jobs=(
    [resnet50-224]='"model": "resnet50", "imageSize": 224, "batchSize": 256, "microBatches": 2'
    [resnet50-64]='"model": "resnet50", "imageSize": 64, "batchSize": 256, "microBatches": 1'
    [transformer-12x768]='"model": {"transformer": {"vocabSize": 256, "layers": 12, "width": 768,
      "heads": 12, "seqLen": 256}}, "batchSize": 32, "microBatches": 1'
  )
  if [[ $MODE == cpu ]]; then
    gpus=0
    jobs=(
      [resnet50-32]='"model": "resnet50", "imageSize": 32, "batchSize": 16, "microBatches": 2'
      [transformer-2x64]='"model": {"transformer": {"vocabSize": 64, "layers": 2, "width": 64,
        "heads": 4, "seqLen": 16}}, "batchSize": 8, "microBatches": 1'
    )
  fi
  for name in $(printf '%s\n' "${!jobs[@]}" | sort); do
    spec="{${jobs[$name]}, \"stages\": 2, \"gpusPerStage\": $gpus, \"steps\": 4,
      \"logEvery\": 1, \"seed\": 0, \"preflight\": {\"enabled\": false},
      \"optimizer\": {\"name\": \"sgd\", \"lr\": 0.01},
      \"profile\": {\"steps\": [4], \"path\": \"$LOGS/profiles/$name\", \"rowLimit\": 25}}"
    echo "== $name"
    "$PY" -m pipejob.cli run "$(manifest PipelineJob "profile-$name" "$spec")" |
      tee "$WORK/profile-$name.out"
    [[ ${PIPESTATUS[0]} == 0 ]] || failed=1
  done
  echo "== where each profiled step's time went (the master's parts of it), and the stages'"
  for name in $(printf '%s\n' "${!jobs[@]}" | sort); do
    echo "$name:"
    grep -E "its parts:|samples/s, |fwd s/step|^master \|   stage[0-9]" "$WORK/profile-$name.out"
  done
  return $failed
}

overhead() {
  if [[ $MODE == gpu ]]; then
    CUDA_VISIBLE_DEVICES="" "$PY" benchmarks/overhead.py --models tiny --stages 2,4 \
      --micro-batches 1,2,4,8,16 --repeats 2 --steps 4 --timeout 150 --json "$LOGS/overhead.json"
  else
    CUDA_VISIBLE_DEVICES="" "$PY" benchmarks/overhead.py --models tiny --stages 2 \
      --micro-batches 1,2 --systems rpc,gpipe,torch-gpipe --repeats 1 --steps 2 --timeout 200 \
      --json "$LOGS/overhead.json"
  fi
}

cores() {
  if [[ $MODE == gpu ]]; then
    CUDA_VISIBLE_DEVICES="" "$PY" benchmarks/compare.py --cores 16 \
      --systems pipejob,pipejob-1f1b,pipejob-auto,gpipe,1f1b,single-tN --micro-batches 1,2,4 \
      --repeats "$CORES_REPEATS" --timeout 120 --json "$LOGS/cores.json"
  else
    CUDA_VISIBLE_DEVICES="" "$PY" benchmarks/compare.py --cores 2 \
      --systems pipejob,pipejob-1f1b,pipejob-auto,gpipe,1f1b,single-tN --micro-batches 2 --repeats 1 \
      --batches 1 --batch 4 --image 32 --timeout 300 --json "$LOGS/cores.json"
  fi
}

cores_levers() {
  local cores=16 size=(--batch 48 --image 64)
  [[ $MODE == cpu ]] && cores=2 size=(--batch 8 --image 32 --batches 1)
  # pipejob's threads (its share of the cores a stage, waiting passively) against all the
  # cores a stage, waiting passively ("all") and as OpenMP does by default, spinning a while
  # ("all-spin": the threads lever off); at one micro-batch the stages never compute at once.
  # Beside torch.distributed.pipelining and one process on the same cores.
  CUDA_VISIBLE_DEVICES="" "$PY" benchmarks/compare.py --cores "$cores" "${size[@]}" \
    --systems pipejob,gpipe,1f1b,single-tN --micro-batches 1,2 --repeats 1 \
    --pipejob-variant "all:OMP_NUM_THREADS=$cores" \
    --pipejob-variant "all-spin:OMP_NUM_THREADS=$cores" \
    --pipejob-variant "all-spin:PIPEJOB_TUNING=allocator,transport" \
    --timeout 120 --json "$LOGS/cores-levers.json"
}

say "mode $MODE, results in $DIR, budget ${BUDGET}s"
export MODE WORK LOGS PY CORES_REPEATS
export -f install machine gpu_tests gpu_bench manifest hybrid transfer profile overhead cores \
  cores_levers
step machine 20 machine
step install 120 install
# install() ran in a pipeline's subshell: its PYTHONPATH is set here again from what it made.
if [[ -d $WORK/site ]]; then export PYTHONPATH=$WORK/site${PYTHONPATH:+:$PYTHONPATH}; fi
step gpu-tests 170 gpu_tests
step gpu-bench 240 gpu_bench
step hybrid 60 hybrid
step transfer 60 transfer
step profile 120 profile
step overhead 120 overhead
step cores 480 cores
step cores-levers 260 cores_levers

{
  echo "benchmarks/device.sh --$MODE on $(hostname), $(date -u '+%Y-%m-%d %H:%M UTC'), $((SECONDS - STARTED))s"
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with changes)')"
  printf '  %s\n' "${VERDICTS[@]}"
  echo
  for log in "$LOGS"/*.log; do
    [[ $(basename "$log") == pip.log ]] && continue
    echo "== $(basename "$log" .log): its last lines"
    grep -v '^\s*$' "$log" | tail -n 40
  done
} >"$DIR/summary.txt"
tar -C "$WORK" -czf "$DIR/logs.tar.gz" logs
say "done: $DIR/summary.txt and $DIR/logs.tar.gz"
cat "$DIR/summary.txt" | head -n 20
# The verdict: every step that ran passed.
! printf '%s\n' "${VERDICTS[@]}" | grep -qv ': ok ('
