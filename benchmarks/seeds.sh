#!/usr/bin/env bash
# Issues #16 and #20 over several seeds: per seed, bench_spec.py fine-tunes its own target and
# trains its own drafter (fresh seeds for everything trained), then bench_train.py runs the GRPO
# contenders (2 workers, 20 steps, alternating in chunks); bench_history.py --grpo then reads the
# runs back and prints each contender's median and range over the seeds (results.json in
# OUT/grpo). About 30 minutes per seed on 2 otherwise idle CPU cores; run nothing beside it.
#
#   benchmarks/seeds.sh OUT SEED [SEED ...]
#   TASK='reasoning-gym:tower_of_hanoi?min_disks=3&max_disks=3&max_pegs=3' RUNS=nospec,tlt-spot \
#     SPEC_ARGS='--num-layers 8 --hidden-size 256 --num-heads 4 --num-kv-heads 2 \
#       --intermediate-size 704 --sft-steps 600 --sft-batch-tokens 8192 --sft-lr 0.001' \
#     TRAIN_ARGS='--max-new-tokens 256 --dtype bfloat16 --tlt-buckets spec' benchmarks/seeds.sh OUT 1 2 3
# (an SFT recipe that learns hanoi, benchmarks/RESULTS.md; bench_spec fine-tunes at --num-threads,
# default 1: a target made beforehand by `tltrun sft` in OUT/spec-seedS/target is reused)
# SFT_ARGS, when set, makes that target first: `tltrun sft --out OUT/spec-seedS/target --seed S
# $SFT_ARGS` (all threads), e.g. a 4 x 128 model that learns the built-in task (greedy accuracy
# ~0.55 after 5 minutes here), with an RL-sized batch per worker:
#   SFT_ARGS='--num-steps 1500 --batch-tokens 4096 --num-layers 4 --hidden-size 128 \
#     --num-heads 4 --num-kv-heads 2 --intermediate-size 352 --lr 3e-3' \
#   SPEC_ARGS='--num-layers 4 --hidden-size 128 --num-heads 4 --num-kv-heads 2 \
#     --intermediate-size 352' RUNS=nospec,tltbase,tlt-spot,tlt-mix \
#   TRAIN_ARGS='--max-new-tokens 512 --prompts-per-step 32 --group-size 8' benchmarks/seeds.sh OUT 1 2 3
#
# PYTHON (default: python) runs the scripts, TLTRUN (default: tltrun) the SFT; a seed whose runs
# finished is not run again.
# TRAIN_ARGS goes to bench_train.py and bench_history.py alike, so only flags both take
# (--max-new-tokens, --num-steps, --dtype, --prompts-per-step, --group-size, --tlt-*; see
# bench_history.py --help): checked before the first run.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: benchmarks/seeds.sh OUT SEED [SEED ...]" >&2
  exit 2
fi
OUT=$1
shift
PY=${PYTHON:-python}
TASK=${TASK:-builtin}
RUNS=${RUNS:-nospec,tltbase,tlt-frozen,tlt-spot,tlt-mix}  # bench_history.py's GRPO_RUNS
# bench_spec's measurement only sets TLT's threshold here: the batches a worker runs (<= 8),
# sampled as the GRPO runs sample (their temperature 1.0; a greedy profile overstates SD)
MEAS="--batch-sizes 1,4,8 --repeats 2 --strategies 2_1_2,4_1_4 --max-new-tokens 64 --temperature 1.0"
# ...and in the rollouts' dtype (TRAIN_ARGS' --dtype): an fp32 profile set the threshold and
# buckets of bf16 runs, where a batch-8 verify is no longer compute-bound
DTYPE=$(sed -n 's/.*--dtype[ =]\([a-z0-9]*\).*/\1/p' <<< "${TRAIN_ARGS:-}")
DTYPE=${DTYPE:-float32}
if [ "$DTYPE" = float32 ]; then RESULTS=results.json; else RESULTS=results-$DTYPE.json; fi
# shellcheck disable=SC2086  # a word list
$PY benchmarks/bench_history.py --grpo --parse-only --runs "$RUNS" ${TRAIN_ARGS:-}
works=()
for SEED in "$@"; do
  W=$OUT/spec-seed$SEED
  if [ -n "${SFT_ARGS:-}" ] && [ ! -f "$W/target/config.json" ]; then
    # shellcheck disable=SC2086  # SFT_ARGS is a word list
    ${TLTRUN:-tltrun} sft --out "$W/target" --seed "$SEED" $SFT_ARGS
  fi
  if [ ! -f "$W/$RESULTS" ]; then
    # shellcheck disable=SC2086  # MEAS and SPEC_ARGS are word lists
    $PY benchmarks/bench_spec.py --seed "$SEED" --task "$TASK" --work-dir "$W" \
      --num-train-prompts 256 $MEAS --dtype "$DTYPE" ${SPEC_ARGS:-}
  fi
  # shellcheck disable=SC2086
  $PY benchmarks/bench_train.py --seed "$SEED" --task "$TASK" --runs "$RUNS" --reuse-runs \
    --model-dir "$W/target" --drafter-dir "$W/drafter" --spec-results "$W/$RESULTS" \
    --out "$OUT/grpo/seed$SEED" ${TRAIN_ARGS:-}
  works+=("$W")
done
# shellcheck disable=SC2086
$PY benchmarks/bench_history.py --grpo --reuse-runs --task "$TASK" --runs "$RUNS" ${TRAIN_ARGS:-} \
  --work-dirs "$(IFS=,; echo "${works[*]}")" --seeds "$(IFS=,; echo "$*")" --out "$OUT/grpo"
