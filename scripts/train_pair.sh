#!/usr/bin/env bash
# Reproduces every stage of the embedded pair from the data folder, into one output folder:
#
#   scripts/train_pair.sh [OUT]        # OUT defaults to runs/pair
#
# Stages (each a `speculative_t5x.train` job of the named gin file, about 9 hours in all on a
# 2-core CPU):
#   1 target            multi30k_target.gin                 -> OUT/target.msgpack
#   2 undistilled draft multi30k_draft.gin                  -> OUT/draft_undistilled.msgpack
#   3 sequence distill  multi30k_draft_seq_distill.gin      -> OUT/draft_seq_6000.msgpack
#     (6,000 of the target's greedy outputs)
#   4 sequence distill  multi30k_draft_seq_distill_full.gin -> OUT/draft.msgpack
#     (all 29,000; the embedded draft)
#   5 token distill     multi30k_draft_token_distill_mixed.gin -> OUT/draft_token_mixed.msgpack
#     (for sampling: the target's distributions over real and greedy targets)
#   6 decoder-only draft multi30k_draft_decoder_only.gin     -> OUT/draft_decoder_only.msgpack
#     (stage 4's decoder over the target's frozen encoder, token-distilled as stage 5)
#   7 on-policy round   multi30k_draft_decoder_only_on_policy.gin -> OUT/draft_decoder_only_on_policy.msgpack
#     (stage 6's draft on the target's greedy outputs and its own samples)
#   8 two-layer decoder-only draft multi30k_draft_decoder_only_2layers.gin
#                       -> OUT/draft_decoder_only_2layers.msgpack (stage 6 with a second decoder
#     layer, 3,600 s; speculative_t5x/pretrained/multi30k_de_en_draft_decoder_only.msgpack)
#   9 feature draft     multi30k_feature_draft.gin          -> OUT/feature_draft.msgpack
#     (stage 8's draft reading the target's decoder state, with training-time test)
#  10 feature draft, 3 layers multi30k_feature_draft_3layers.gin -> OUT/feature_draft_3layers.msgpack
#     (stage 9 reading the target's layers 2, 4 and 6, EAGLE-3's)
# Then, with stages 8 to 10: the drafts' vocabulary (OUT/<draft>.msgpack.vocabulary.json for
# draft, draft_decoder_only_2layers and the feature drafts: the tokens of train.en; docs/engine.md).
#
# Every path a stage reads or writes is redirected into OUT, so the shipped weights in
# speculative_t5x/pretrained/ are never overwritten. A stage whose weights file exists is
# skipped; a stage that was stopped resumes from its run folder's last checkpoint when the
# script is run again. FIRST=N starts at stage N (its inputs must be in OUT); LAST=N stops
# after stage N. DRY_RUN=1 prints each stage's command instead of running it. The data folder is
# $SPECULATIVE_T5X_DATA (default ../shared/data).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-runs/pair}"
FIRST="${FIRST:-1}"
LAST="${LAST:-10}"
DRY_RUN="${DRY_RUN:-}"
[[ -n "$DRY_RUN" ]] || mkdir -p "$OUT"

stage() {  # stage NUMBER NAME GIN_FILE [--gin.train.X=VALUE ...]
  local number="$1" name="$2" gin_file="$3"
  shift 3
  if (( number < FIRST || number > LAST )); then return; fi
  if [[ -f "$OUT/$name.msgpack" ]]; then
    echo "stage $number ($name): $OUT/$name.msgpack exists, skipped"
    return
  fi
  local command=("${PYTHON:-python}" -m speculative_t5x.train --gin_file="gin_configs/train/$gin_file"
    --gin.train.model_dir="'$OUT/$name'" --gin.train.export_path="'$OUT/$name.msgpack'" "$@")
  if [[ -n "$DRY_RUN" ]]; then
    printf '%q ' "${command[@]}"
    echo
    return
  fi
  echo "stage $number ($name): gin_configs/train/$gin_file, log in $OUT/$name.log"
  # The log keeps everything; the terminal shows the steps, evaluations and the export.
  "${command[@]}" 2>&1 | tee "$OUT/$name.log" |
    grep --line-buffered -E '^(step|Exported|Sequence|Resumed|Training time|  greedy)' || true
  if [[ ! -f "$OUT/$name.msgpack" ]]; then
    echo "stage $number ($name) wrote no weights: see $OUT/$name.log" >&2
    exit 1
  fi
}

teacher="--gin.train.teacher='$OUT/target.msgpack'"
stage 1 target multi30k_target.gin
stage 2 draft_undistilled multi30k_draft.gin
stage 3 draft_seq_6000 multi30k_draft_seq_distill.gin "$teacher" \
  --gin.train.init_from="'$OUT/draft_undistilled.msgpack'" \
  --gin.train.distillation_cache="'$OUT/target_greedy_train.npz'"
stage 4 draft multi30k_draft_seq_distill_full.gin "$teacher" \
  --gin.train.init_from="'$OUT/draft_seq_6000.msgpack'" \
  --gin.train.distillation_cache="'$OUT/target_greedy_train_full.npz'"
stage 5 draft_token_mixed multi30k_draft_token_distill_mixed.gin "$teacher" \
  --gin.train.init_from="'$OUT/draft.msgpack'" \
  --gin.train.distillation_cache="'$OUT/target_greedy_train_full.npz'"
stage 6 draft_decoder_only multi30k_draft_decoder_only.gin "$teacher" \
  --gin.train.encoder="'$OUT/target.msgpack'" \
  --gin.train.init_from="'$OUT/draft.msgpack'" \
  --gin.train.distillation_cache="'$OUT/target_greedy_train_full.npz'"
stage 7 draft_decoder_only_on_policy multi30k_draft_decoder_only_on_policy.gin "$teacher" \
  --gin.train.encoder="'$OUT/target.msgpack'" \
  --gin.train.init_from="'$OUT/draft_decoder_only.msgpack'" \
  --gin.train.distillation_cache="'$OUT/target_greedy_train_full.npz'"
stage 8 draft_decoder_only_2layers multi30k_draft_decoder_only_2layers.gin "$teacher" \
  --gin.train.encoder="'$OUT/target.msgpack'" \
  --gin.train.init_from="'$OUT/draft.msgpack'" \
  --gin.train.distillation_cache="'$OUT/target_greedy_train_full.npz'"
for feature in 9:feature_draft 10:feature_draft_3layers; do
  stage "${feature%%:*}" "${feature#*:}" "multi30k_${feature#*:}.gin" "$teacher" \
    --gin.train.encoder="'$OUT/target.msgpack'" \
    --gin.train.init_from="'$OUT/draft_decoder_only_2layers.msgpack'" \
    --gin.train.distillation_cache="'$OUT/target_greedy_train_full.npz'"
done
if (( LAST >= 8 )); then
  drafts=("$OUT/draft.msgpack" "$OUT/draft_decoder_only_2layers.msgpack")
  (( LAST < 9 )) || drafts+=("$OUT/feature_draft.msgpack")
  (( LAST < 10 )) || drafts+=("$OUT/feature_draft_3layers.msgpack")
  vocabulary=("${PYTHON:-python}" -c 'import sys
from speculative_t5x import checkpoints, data
for path in sys.argv[1:]:
  print(checkpoints.write_draft_vocabulary(path, data.caption_vocabulary(), data.CAPTION_VOCABULARY_SOURCE))' \
    "${drafts[@]}")
  if [[ -n "$DRY_RUN" ]]; then printf '%q ' "${vocabulary[@]}"; echo; else "${vocabulary[@]}"; fi
fi
[[ -n "$DRY_RUN" ]] || echo "The pair is in $OUT: target.msgpack with draft.msgpack (or draft_token_mixed.msgpack, draft_decoder_only.msgpack, draft_decoder_only_on_policy.msgpack, draft_decoder_only_2layers.msgpack, feature_draft.msgpack, feature_draft_3layers.msgpack)."
