#!/usr/bin/env bash
# Reruns the benchmarks behind the README's results table on this machine, one after another:
#
#   scripts/reproduce_results.sh [OUT]     # OUT defaults to results/cpu
#
# Needs the data folder ($SPECULATIVE_T5X_DATA, default ../shared/data) and the [bench] extra:
#   pip install -e '.[bench]'
# About 6 hours on a 2-core CPU in all; each run writes its files into OUT/<name> as it goes (the
# calibrations first: the speed runs start 'auto' from them). ONLY="speed_greedy verifiers" runs
# the named ones (a speed run reads its calibration from OUT). DRY_RUN=1 prints the commands
# instead of running them. Nothing else may run on the machine meanwhile:
# every figure is a ratio of passes timed in one process, and a second process skews it.
# The T5X column (benchmarks.vs_t5x) needs a private T5X install: see docs/t5x.md.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-results/cpu}"

# name: the module and the flags of the run the README reports; each run writes to OUT/<name>
# ({OUT} in the flags: OUT, so that a job reads the calibration an earlier run wrote).
declare -A RUNS=(
  # Calibrations for the table's 'auto' (greedy, T=1, beam 4), on the test captions.
  [calibrate_greedy]="speculative_t5x.calibrate --batch_sizes 1,8,32 --sentences 96 --check"
  [calibrate_t1]="speculative_t5x.calibrate --batch_sizes 1,8,32 --sentences 96 --check --temperature 1"
  [calibrate_beam4]="speculative_t5x.calibrate --batch_sizes 1,8,32 --sentences 64 --beam_size 4"
  # The table's greedy, T=1 and beam columns: fresh 192-sentence jobs against every fixed choice
  # (T=1: each round its own draw; at batch 32 a draw decides a 6-batch job, hence 32 rounds).
  [speed_greedy]="benchmarks.speed --sentences 1:192,8:192,32:192 --gammas 1,2,3,4,auto --calibration {OUT}/calibrate_greedy/calibration.json --rounds 16"
  [speed_t1]="benchmarks.speed --sentences 1:192,8:192 --gammas= --sampling_gammas 1,2,3,4,auto --calibration {OUT}/calibrate_t1/calibration.json --rounds 12"
  [speed_t1_b32]="benchmarks.speed --sentences 32:192 --gammas= --sampling_gammas 1,2,3,4,auto --calibration {OUT}/calibrate_t1/calibration.json --rounds 64"
  [speed_beam4]="benchmarks.speed --sentences 1:192,8:192,32:192 --gammas= --beams 4:1,4:auto --calibration {OUT}/calibrate_beam4/calibration.json --rounds 4"
  # The verifiers line: tokens per call on the 1000 test captions, then speed at T=1.
  [verifiers]="benchmarks.verifiers --count_sentences 1000 --gammas 2,4 --trees 2;2,1;3,1;2,1,1,1 --sentences 1:64,8:192,32:320 --speed_gammas 1,2 --speed_trees 2;3,1 --rounds 3"
  # The CTranslate2 column: both engines on the test captions, alternating processes.
  [vs_ctranslate2]="benchmarks.vs_ctranslate2 --sentences 1:64,8:192,32:320 --rounds 3"
  # The drafts' agreement with the target, hardware-free: alpha and tokens per call.
  [drafts]="benchmarks.drafts --drafts embedded=speculative_t5x/pretrained/multi30k_de_en_draft_decoder_only.msgpack,separate=speculative_t5x/pretrained/multi30k_de_en_draft.msgpack --gammas 1,2,3,4,5 --temperatures 0,0.7,1"
  # The feature draft beside the embedded one: needs runs/feature_draft.msgpack (its gin file,
  # gin_configs/train/multi30k_feature_draft.gin, or stage 9 of scripts/train_pair.sh).
  [feature_draft]="benchmarks.drafts --drafts feature=runs/feature_draft.msgpack,embedded=speculative_t5x/pretrained/multi30k_de_en_draft_decoder_only.msgpack --gammas 1,2,3,4,5,6,7,8 --temperatures 0,0.7,1 --sweep_temperature 0"
  [feature_draft_speed]="benchmarks.drafts --drafts feature=runs/feature_draft.msgpack,embedded=speculative_t5x/pretrained/multi30k_de_en_draft_decoder_only.msgpack --temperatures= --sentences 1:96,8:96,32:96 --gammas 1,2,4,6 --sampling_gammas 4 --rounds 5"
  # bfloat16 greedy identity (the 'same as greedy' column; one round: its times are not the point).
  [numerics]="benchmarks.speed --dtype bfloat16 --sentences 32:512 --gammas 2,4 --rounds 1"
  # 'auto' in simulated jobs against every fixed choice (no decoders, seconds).
  [policy_sim]="benchmarks.policy_sim --seeds 30"
  [policy_sim_calibrated]="benchmarks.policy_sim --seeds 30 --model_error 0.05"
  # The T5X column: in T5X's own venv (T5X_PYTHON=/path/to/t5x-venv/bin/python; docs/t5x.md).
  [vs_t5x]="benchmarks.vs_t5x --sentences 1:40,8:80 --gammas 1,2,3,auto --rounds 5"
)
ORDER=(calibrate_greedy calibrate_t1 calibrate_beam4 speed_greedy speed_t1 speed_t1_b32 speed_beam4
       verifiers vs_ctranslate2 drafts feature_draft feature_draft_speed numerics policy_sim
       policy_sim_calibrated vs_t5x)

for name in ${ONLY:-${ORDER[@]}}; do
  [[ -v "RUNS[$name]" ]] || { echo "error: ONLY names '$name'; known: ${ORDER[*]}" >&2; exit 1; }
  read -r -a words <<< "${RUNS[$name]//\{OUT\}/$out}"
  flag=--out_dir
  [[ "${words[0]}" == benchmarks.* ]] || flag=--output_dir  # (the calibrate command's)
  python="${PYTHON:-python}"
  if [[ "$name" == vs_t5x ]]; then
    [[ -n "${T5X_PYTHON:-}" ]] || { echo "== vs_t5x skipped: set T5X_PYTHON (docs/t5x.md)" >&2; continue; }
    python="$T5X_PYTHON"
  fi
  command=(env "PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}" "$python" -m "${words[@]}" "$flag" "$out/$name")
  if [[ -n "${DRY_RUN:-}" ]]; then
    printf '%q ' "${command[@]}"
    echo
  else
    echo "== ${command[*]}"
    "${command[@]}"
  fi
done
