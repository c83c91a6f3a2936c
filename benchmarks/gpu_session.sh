#!/usr/bin/env bash
# One call on a lent NVIDIA GPU machine (issue 36): the measurements that need a GPU, in
# stages, each under its own time limit, so that one stage that hangs or runs out of
# memory costs only itself. The device tool runs it from the repository root with the
# wheels our dependencies need in .whl (carry .whl; docs/benchmarks.md, "On a GPU"):
#
#   DEADLINE_S=560 bash benchmarks/gpu_session.sh tests gpt2 mfu lm_1b cnn
#   DEADLINE_S=200 bash benchmarks/gpu_session.sh digits lm_tiny
#
# Stages (any order; "tests" starts the CPU test suite in the background, on cores the
# GPU stages leave free, and is waited for at the end):
#   tests    the fast test suite on this machine's Python and JAX (CPU devices, as in CI)
#   cnn      benchmarks/lm_step.py --model cnn: the tutorial CNN, replicator vs jit
#   gpt2     benchmarks/lm_step.py --model gpt2_124m
#   lm_1b    benchmarks/lm_step.py --model lm_1b
#   mfu      benchmarks/lm_mfu.py: configs/lm_1b.py's own step, per setting
#   digits   python -m replicator train --config configs/digits_cnn.py (make train's run)
#   lm_tiny  python -m replicator train --config configs/lm_tiny.py
# $OUT gets session.log (everything, as it ran), tests.log and results.tar.gz (the
# benchmarks' JSON, each stage's log, the test report).
set -u
OUT=${OUT:-/tmp/gpu_session_out}
mkdir -p "$OUT"
LOGS=/tmp/gpu_session_logs
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
ncpu=$(nproc)
if [ "$ncpu" -ge 8 ] && command -v taskset >/dev/null; then         # the GPU stages' host threads apart from the tests'
  GPU_PIN="taskset -c 0-3" TEST_PIN="taskset -c 4-$((ncpu - 1))" TEST_WORKERS=$((ncpu - 4))
else                                # a small machine (a rehearsal on CPU): no pinning
  GPU_PIN="" TEST_PIN="" TEST_WORKERS=2
fi
# SMOKE=1: every stage at a size a CPU runs in seconds (to rehearse this script).
if [ -n "${SMOKE:-}" ]; then
  CNN="--model tiny --rounds 2 --steps 2" GPT2="--model tiny --rounds 2 --steps 2"
  LM1B="--model tiny --rounds 2 --steps 2" MFU="--config configs/lm_1b.py:smoke --timeout 60"
  DIGITS=configs/digits_cnn.py:smoke LMTINY=configs/lm_tiny.py:smoke
else
  CNN="--model cnn --rounds 9 --steps 200" GPT2="--model gpt2_124m --rounds 8 --steps 6"
  LM1B="--model lm_1b --rounds 6 --steps 3" MFU="--config configs/lm_1b.py --timeout 70"
  DIGITS=configs/digits_cnn.py LMTINY=configs/lm_tiny.py
fi
PATHS="compile, TrainState;run, TrainState"

# DEADLINE_S: the whole call's budget; a stage's limit is cut to what is left of it,
# less the minute the tests and the archive may still need.
START_S=$(date +%s)
DEADLINE_S=${DEADLINE_S:-560}
left() { echo $((DEADLINE_S - ($(date +%s) - START_S))); }

say() { echo "$*" | tee -a "$OUT/session.log"; }

install_wheels() {
  if [ -d .whl ] && [ ! -e /tmp/site/.installed ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl >"$LOGS/install.log" 2>&1 || { cat "$LOGS/install.log"; exit 1; }
    touch /tmp/site/.installed
  fi
  export PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks
}

stage() {  # stage NAME LIMIT_S COMMAND...: runs COMMAND on the GPU stages' cores
  local name=$1 limit=$2 start rc
  shift 2
  if [ "$limit" -gt $(($(left) - 25)) ]; then limit=$(($(left) - 25)); fi
  if [ "$limit" -lt 20 ]; then say "=== $name: skipped, no time left"; return; fi
  start=$(date +%s)
  say "=== $name: $* (limit ${limit} s, $(date +%T))"
  timeout -k 10 "$limit" $GPU_PIN "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  grep -v -e '^WARNING: All log messages' -e 'absl::InitializeLog' "$LOGS/$name.log" \
    | tail -n 25 | tee -a "$OUT/session.log"
  say "=== $name: exit $rc after $(($(date +%s) - start)) s"
}

finish() {
  if [ -n "${TESTS_PID:-}" ]; then
    say "=== tests: waiting ($(date +%T))"
    wait "$TESTS_PID"
    say "=== tests: exit $? ($(date +%T)); last lines:"
    tail -n 40 "$OUT/tests.log" | tee -a "$OUT/session.log" >/dev/null
    tail -n 3 "$OUT/tests.log"
  fi
  cp -r benchmarks/results "$LOGS/results" 2>/dev/null
  for run in /tmp/runs/*/; do
    [ -d "$run" ] && mkdir -p "$LOGS/runs/$(basename "$run")" \
      && cp "$run"/*.json* "$run"/log.txt "$LOGS/runs/$(basename "$run")/" 2>/dev/null
  done
  tar -czf "$OUT/results.tar.gz" -C "$LOGS" . 2>/dev/null
}

install_wheels
say "=== machine: $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader \
  | tee -a "$OUT/session.log"
$PY - <<'EOF' 2>&1 | grep -v -e '^WARNING' -e absl | tee -a "$OUT/session.log"
import platform, jax, jaxlib, flax, optax, orbax.checkpoint as ocp
print("python", platform.python_version(), "jax", jax.__version__, "jaxlib", jaxlib.__version__,
      "flax", flax.__version__, "optax", optax.__version__, "orbax", ocp.__version__)
print("devices", jax.devices())
EOF

for s in "$@"; do
  case $s in
    tests)
      say "=== tests: started in the background, $TEST_WORKERS workers ($(date +%T))"
      # The suite's own settings (tests/conftest.py: JAX_PLATFORMS=cpu, fake devices); a
      # worker per core; each test under 300 s; the whole under TEST_LIMIT_S.
      (timeout -k 10 "$(($(left) - 20))" $TEST_PIN \
        $PY -m pytest -n "$TEST_WORKERS" -vv -p no:cacheprovider --timeout 300 -rfEs \
        --durations=20 --junitxml="$LOGS/junit.xml" ${TESTS:-} >"$OUT/tests.log" 2>&1) &
      TESTS_PID=$!
      ;;
    cnn) stage cnn 70 $PY benchmarks/lm_step.py $CNN --labels "$PATHS" ;;
    gpt2) stage gpt2 110 $PY benchmarks/lm_step.py $GPT2 --labels "$PATHS" ;;
    lm_1b) stage lm_1b 140 $PY benchmarks/lm_step.py $LM1B --labels "$PATHS" ;;
    mfu) stage mfu 330 $PY benchmarks/lm_mfu.py $MFU --steps 3 --rounds 3 --variants \
           "remat full;remat none;remat none, bf16 first moment;remat none, no Triton GEMM;remat full, XLA attention" ;;
    digits) stage digits 70 $PY -m replicator train --config $DIGITS --workdir /tmp/runs/digits ;;
    lm_tiny) stage lm_tiny 70 $PY -m replicator train --config $LMTINY --workdir /tmp/runs/lm_tiny ;;
    *) say "unknown stage $s" ;;
  esac
done
finish
