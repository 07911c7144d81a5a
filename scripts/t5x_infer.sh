#!/usr/bin/env bash
# Speculative decoding inside T5X's own inference job, on the embedded pair:
#
#   scripts/t5x_infer.sh [OUT]     # OUT defaults to /tmp/t5x_speculative
#
# 1. writes one T5X checkpoint holding both models (OUT/pair/checkpoint_0: target/ and draft/;
#    needs no T5X);
# 2. runs `python -m t5x.infer` with T5X's runs/infer.gin and the shipped gin files: the adapter
#    over the pair, greedy speculative decoding (gamma 4: output identical to the target's own
#    greedy output), the Multi30k test captions as a seqio task (needs the data folder,
#    $SPECULATIVE_T5X_DATA). Predictions go to OUT/infer.
# T5X is on no package registry: install it from its repository first (docs/t5x.md says how it
# was checked). DECODING=bild.gin (any file of gin_configs/t5x/) picks another decoder;
# DRY_RUN=1 prints the two commands.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-/tmp/t5x_speculative}"
DECODING="${DECODING:-speculative_greedy.gin}"
configs=speculative_t5x/gin_configs/t5x
[[ -f "gin_configs/t5x/$DECODING" ]] || { echo "error: DECODING=$DECODING is not one of gin_configs/t5x/*.gin" >&2; exit 1; }
write=("${PYTHON:-python}" -m speculative_t5x.t5x_adapter --output_dir="$OUT/pair")
infer=("${PYTHON:-python}" -m t5x.infer --gin_file=t5x/configs/runs/infer.gin
  --gin_file="$configs/multi30k_pair.gin" --gin_file="$configs/$DECODING"
  --gin_file="$configs/multi30k_task.gin"
  --gin.CHECKPOINT_PATH="'$OUT/pair/checkpoint_0'" --gin.INFER_OUTPUT_DIR="'$OUT/infer'")
if [[ -n "${DRY_RUN:-}" ]]; then
  printf '%q ' "${write[@]}"; echo
  printf '%q ' "${infer[@]}"; echo
  exit 0
fi
if ! "${PYTHON:-python}" -c 'import t5x.infer' > /dev/null 2>&1; then
  echo "error: T5X is not installed in this Python (python -c 'import t5x.infer' fails); install it from github.com/google-research/t5x, then rerun" >&2
  exit 1
fi
"${write[@]}"
"${infer[@]}"
echo "predictions: $OUT/infer"
