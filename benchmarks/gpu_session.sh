#!/usr/bin/env bash
# Everything issues #18 and #21 ask of a lent GPU, as two device calls of under 10 minutes each
# (a session is lent 15 minutes of device time, start-up included; see README, "On a GPU").
# Run from the repository root on the GPU machine, whose python3 holds torch, triton, numpy,
# pandas, pytest and hypothesis (nothing is installed: the project runs from PYTHONPATH):
#
#   benchmarks/gpu_session.sh engine OUT    # ~8 min on an H100: the CUDA tests (graph capture,
#                                           # weight updates under graphs, lossless SD on CUDA,
#                                           # two GRPO steps in bf16 over fp32 master weights),
#                                           # then bench_gpu_engine.py --quick
#   benchmarks/gpu_session.sh profile OUT   # ~5 min: a random-weight Qwen2.5-1.5B-shape target
#                                           # and drafter, tltrun profile --device cuda (bf16),
#                                           # then bench_kernels.py
#   benchmarks/gpu_session.sh targets OUT   # ~9 min: issue #18's target cells only
#                                           # (bench_gpu_engine.py --targets), RUNS (3) times
#                                           # with fresh seeds, each a fresh process, then
#                                           # their medians (benchmarks/gpu_targets.py), then
#                                           # the GPU training recipe test; TOTAL_S as for all;
#                                           # SECTIONS=decode / =pool, RUN_S, RECIPE=0 split it.
#                                           # The pool's captures took ~105 s a run on an H200
#                                           # (session 23), so one call holds three runs of
#                                           # one section: `SECTIONS=decode TOTAL_S=560` (the
#                                           # roofline and graphs targets, then the recipe in
#                                           # what is left). A session's 15 device minutes,
#                                           # ~3 of them the machine's start, hold one such
#                                           # call: `SECTIONS=pool RECIPE=0 RUN_S=140
#                                           # TOTAL_S=480` is the next lent session's
#   benchmarks/gpu_session.sh all OUT       # both stages in one call of TOTAL_S seconds
#                                           # (default 520): each step gets at most its own
#                                           # limit and never more than is left, the engine
#                                           # benchmark a smaller budget; OUT ends as
#                                           # steps.txt, the profile and results.tgz (the rest)
#
# OUT gets each stage's logs and result files (at most 8, two folders deep: what a device call
# brings back). Each command has its own time limit, so one that hangs costs only its share and
# the stage still writes what the others measured. Afterwards, on any machine with the project:
#   tltsim profile-info OUT/profile_qwen1.5b.csv
#   tltsim calibrate OUT/profile_qwen1.5b.csv --hardware H100-SXM --model Qwen2.5-1.5B --out h100.json
# Without CUDA every step says so and exits 0; `SMOKE=1` runs the steps on a tiny model on the
# CPU (tests/test_gpu_session.py), a check of the script and not a measurement.
set -uo pipefail
if [ $# -ne 2 ] || { [ "$1" != engine ] && [ "$1" != profile ] && [ "$1" != all ] &&
  [ "$1" != targets ]; }; then
  echo "usage: benchmarks/gpu_session.sh engine|profile|all|targets OUT" >&2
  exit 2
fi
STAGE=$1
OUT=$2
PY=${PYTHON:-python3}
SMOKE=${SMOKE:-0}
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT" || exit 2
# tracebacks newer than this mark are this session's (others may sit in /tmp from earlier runs)
start_mark=$(mktemp)
failed=()
# stage all: one deadline for every step; RESERVE seconds stay for packing OUT
RESERVE=15
DEADLINE=$((SECONDS + ${TOTAL_S:-520}))

limit_left() {  # limit_left SECONDS: that limit, or less where the deadline comes first
  local left=$((DEADLINE - SECONDS - RESERVE))
  [ "$STAGE" != engine ] && [ "$STAGE" != profile ] && [ "$left" -lt "$1" ] &&
    { echo "$left"; return; }
  echo "$1"
}

step() {  # step NAME SECONDS COMMAND...: run it under a time limit, its output in OUT/NAME.log
  local name=$1 limit
  limit=$(limit_left "$2")
  shift 2
  if [ "$limit" -lt 10 ]; then
    echo "$name: skipped, no time left (stage all)" | tee -a "$OUT/steps.txt"
    failed+=("$name")
    return
  fi
  local started=$SECONDS
  # SIGINT first: pytest then prints the failures so far, a benchmark writes what it has
  timeout -s INT --kill-after=15 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - started)) s (limit $limit s)" | tee -a "$OUT/steps.txt"
  [ $rc -eq 0 ] || failed+=("$name")
}

{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
  "$PY" -c "import torch, triton, numpy; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available()); print('triton', triton.__version__, 'numpy', numpy.__version__)"
  git rev-parse HEAD 2>/dev/null
} >"$OUT/steps.txt" 2>&1

if [ "$STAGE" = all ]; then
  # the shares of a 520 s call: CUDA tests 170 (on an H200 the ten engine tests took 93 s in
  # session 13; in session 21 eleven of twelve took 140 s, four of them failing: the GPU
  # training recipe, then the compiled-layers check, come last), engine benchmark 170, then the
  # checkpoint, the profile and the kernels get what the first two leave
  engine_limits=(170 170)
else
  engine_limits=(150 400)
fi
if [ "$STAGE" = targets ]; then
  # the target cells RUNS times, seeds 0..RUNS-1, each run a fresh process with its own time
  # limit (RUN_S, or less where the deadline comes first) and a budget inside it
  runs=${RUNS:-3}
  run_s=${RUN_S:-150}
  dirs=()
  for ((seed = 0; seed < runs; seed++)); do
    limit=$(limit_left "$run_s")
    if [ "$SMOKE" = 1 ]; then
      bench=(--device cpu --smoke --targets --budget-s 60)
    else
      bench=(--targets --budget-s $((limit > 80 ? limit - 40 : limit / 2)))
    fi
    # SECTIONS=decode or =pool splits the runs over two device calls (default: both)
    [ -n "${SECTIONS:-}" ] && bench+=(--sections "$SECTIONS")
    step "targets_seed_$seed" "$limit" "$PY" benchmarks/bench_gpu_engine.py "${bench[@]}" \
      --seed "$seed" --out_dir "$OUT/targets/seed_$seed"
    dirs+=("$OUT/targets/seed_$seed")
  done
  step targets_summary 30 "$PY" benchmarks/gpu_targets.py "${dirs[@]}" --out "$OUT/targets.json"
  # the CUDA tests that have not passed on a GPU: the training recipe (session 23: torch 2.11's
  # LaunchConfig), RMSNorm's rounding through CUDA's fused kernel, and compiled layers under
  # graphs since they write the KV cache themselves (session 25), the spot trainer beside a
  # CUDA engine and the generator left as it was by a capture (session 37); RECIPE=0 leaves
  # them out (a second call of a session that has run them)
  [ "${RECIPE:-1}" = 1 ] && step pytest_recipe 150 "$PY" -m pytest -q -p no:cacheprovider \
    -m gpu -rfEs --tb=short tests/test_train_data.py tests/test_model.py \
    tests/test_compiled_layers.py tests/test_drafter.py \
    tests/test_graphs.py::test_capturing_the_pool_leaves_the_sampling_generator_as_it_was
fi
if [ "$STAGE" = engine ] || [ "$STAGE" = all ]; then
  # without CUDA these are collected and skipped (each with its reason). Where pytest-xdist is
  # installed (the GPU machines' image has it), four processes share the GPU: the tests' time
  # is mostly torch.compile on the host (12 tests took over 140 s in one process on an H200)
  parallel=()
  "$PY" -c "import xdist" 2>/dev/null && parallel=(-n 4)
  step pytest_gpu "${engine_limits[0]}" "$PY" -m pytest -q -p no:cacheprovider -m gpu -rfEs \
    --tb=short "${parallel[@]}" \
    tests/test_graphs.py tests/test_static_decode.py tests/test_static_verify.py \
    tests/test_draft_graphs.py tests/test_kernels.py tests/test_train_data.py \
    tests/test_compiled_layers.py tests/test_model.py tests/test_drafter.py
  limit=$(limit_left "${engine_limits[1]}")
  # the benchmark's own budget ends 70 s before its limit: the configuration in flight, the
  # sections after it and the JSON still fit
  if [ "$SMOKE" = 1 ]; then
    bench=(--device cpu --smoke --budget-s 60)
  else
    # never measured on a GPU first (pool, SD rows), then the decode table (session 21 has one)
    bench=(--quick --budget-s $((limit > 100 ? limit - 70 : 30))
      --sections "${SECTIONS:-pool,sd,decode,where,hf}")
  fi
  step bench_gpu_engine "$limit" "$PY" benchmarks/bench_gpu_engine.py "${bench[@]}" \
    --out_dir "$OUT/gpu_engine"
fi
if [ "$STAGE" = profile ] || [ "$STAGE" = all ]; then
  CKPT=$(mktemp -d) || exit 2
  if [ "$SMOKE" = 1 ]; then
    name=tiny
    # bf16 as on the GPU (the CPU runs it too): the rehearsal meets the GPU's dtype paths
    shape=(--shape tiny --dtype bfloat16)
    prof=(--device cpu --dtype bfloat16 --batches 1,2 --context-per-seq 16,32
      --strategies 2_1_2 --prefill-batches 1 --prefill-tokens-per-seq 8,16
      --train-batches 1,2 --train-tokens-per-seq 16 --num-repeats 1 --back-to-back-calls 1)
  else
    name=qwen1.5b
    shape=(--shape Qwen2.5-1.5B --dtype bfloat16)
    # the batches where TLT's threshold and strategies are decided (README, #21), two contexts
    # for the KV term; the grid's train ops hold three copies of the target plus AdamW state,
    # hence a 1.5B shape rather than 7B on one 80 GB GPU. About 100 rollout points x 26 calls:
    # well inside the step's limit even at 50 ms a call (a killed profile writes nothing)
    prof=(--device cuda --dtype bfloat16 --batches 1,2,4,8,16,32,64
      --context-per-seq 512,2048 --strategies 2_1_2,4_1_4,8_4_32
      --prefill-batches 1,4,16 --prefill-tokens-per-seq 256,1024
      --train-batches 1,4 --train-tokens-per-seq 256,1024 --num-repeats 3)
    if [ "$STAGE" = all ]; then
      # one call for both stages: every other batch, two strategies, 4 back-to-back calls a
      # sample instead of 8 (about a quarter of the grid's calls)
      prof=(--device cuda --dtype bfloat16 --batches 1,4,16,64 --context-per-seq 512,2048
        --strategies 4_1_4,8_4_32 --prefill-batches 1,16 --prefill-tokens-per-seq 256,1024
        --train-batches 1,4 --train-tokens-per-seq 256 --num-repeats 3 --back-to-back-calls 4)
    fi
  fi
  step checkpoint 90 "$PY" benchmarks/random_checkpoint.py "${shape[@]}" --out "$CKPT"
  # no timing round starts after the budget (the rounds done are kept and written): the
  # round in flight, the train ops' first round and the loading fit in what the limit leaves
  limit=$(limit_left 300)
  prof+=(--time-budget-s $((limit > 150 ? limit - 90 : (limit > 2 ? limit / 2 : 1))))
  step profile "$limit" "$PY" -m tltrun profile --model "$CKPT/target" \
    --drafter "$CKPT/drafter" --out "$OUT/profile_$name.csv" --no-progress-shown "${prof[@]}"
  if [[ " ${failed[*]} " == *" profile "* ]] && [ "$SMOKE" != 1 ] &&
    [ ! -f "$OUT/profile_$name.csv" ]; then
    # the engine's default attention failed before anything was written (a training op's
    # failure keeps the rollout rows): the same grid with the dense masked SDPA
    limit=$(limit_left 300)
    step profile_sdpa "$limit" "$PY" -m tltrun profile --model "$CKPT/target" \
      --drafter "$CKPT/drafter" --out "$OUT/profile_${name}_sdpa.csv" --no-progress-shown \
      "${prof[@]}" --attn-impl sdpa
  fi
  # KERNELS=0 leaves the kernel benchmark out (a second call of a session that has its numbers)
  if [ "${KERNELS:-1}" = 1 ]; then
    step bench_kernels 150 "$PY" benchmarks/bench_kernels.py --out_dir "$OUT/kernels"
  fi
  rm -rf "$CKPT"
fi
# tltrun's CLI writes a failure's full traceback under /tmp: keep this session's with the logs
mapfile -t tracebacks < <(find "${TMPDIR:-/tmp}" -maxdepth 1 -name 'tltrun-traceback-*.txt' \
  -newer "$start_mark")
if [ ${#tracebacks[@]} -gt 0 ]; then
  mkdir -p "$OUT/tracebacks" && cp "${tracebacks[@]}" "$OUT/tracebacks/"
fi
rm -f "$start_mark"
if [ "$STAGE" = all ] || [ "$STAGE" = targets ]; then
  # what a person reads first, on standard output (a device call returns its tail)
  for log in pytest_gpu bench_gpu_engine checkpoint profile profile_sdpa bench_kernels \
    targets_seed_0 targets_summary pytest_recipe; do
    [ -f "$OUT/$log.log" ] && { echo "=== $log"; tail -n 60 "$OUT/$log.log"; }
  done
  for tb in "$OUT"/tracebacks/*.txt; do
    [ -f "$tb" ] && { echo "=== $tb"; tail -n 25 "$tb"; }
  done
  # a device call brings back at most 8 files: the profile and steps.txt stay, the rest is packed
  packed=$(mktemp -u).tgz
  (cd "$OUT" && tar czf "$packed" --exclude=steps.txt --exclude='profile_*' \
    --exclude=targets.json . &&
    find . -mindepth 1 \( -name '*.log' -o -type d \) -prune -exec rm -rf {} + &&
    mv "$packed" results.tgz) &&
    echo "packed the logs and result folders into $OUT/results.tgz" >>"$OUT/steps.txt"
fi
if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu_session $STAGE: failed: ${failed[*]} (their logs in $OUT)" | tee -a "$OUT/steps.txt"
  exit 1
fi
echo "gpu_session $STAGE: every step ended well; results in $OUT" | tee -a "$OUT/steps.txt"
