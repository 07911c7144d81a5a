#!/usr/bin/env bash
# Does a draft distilled by `python -m t5x.train` match the shipped one? Trains the embedded
# draft's last stage (gin_configs/train/multi30k_draft_decoder_only_2layers.gin) in T5X with
# t5x_adapter.DistillationEncoderDecoderModel: the same start (the stage's step 0, written by
# speculative-t5x-train), the same data (each training caption with its reference and with the
# target's greedy output, gin_configs/t5x/multi30k_distill_teacher.gin), the same recipe and
# STEPS steps (the stage ran 3,537); then alpha and tokens per call of both drafts
# (benchmarks.drafts) into OUT.
#
#   T5X_PYTHON=/path/to/t5x-venv/bin/python scripts/t5x_distill_check.sh [OUT]
#
# OUT defaults to results/cpu/t5x_distill; WORK (default: a new temporary folder) keeps the
# T5X run, which resumes from its last checkpoint if the script is run again with the same WORK.
# Needs T5X installed apart (docs/t5x.md) and the data folder ($SPECULATIVE_T5X_DATA).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-results/cpu/t5x_distill}"
steps="${STEPS:-3537}"
if [[ -z "${T5X_PYTHON:-}" ]]; then
  echo "error: set T5X_PYTHON to the python of a T5X install (docs/t5x.md)" >&2
  exit 1
fi
work="${WORK:-$(mktemp -d)}"
mkdir -p "$out" "$work"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
shipped=speculative_t5x/pretrained/multi30k_de_en_draft_decoder_only.msgpack

if [[ ! -e "$work/pair" ]]; then
  echo "== the stage's step 0 and the target's greedy outputs" >&2
  python -m speculative_t5x.train \
    --gin_file=gin_configs/train/multi30k_draft_decoder_only_2layers.gin \
    "--gin.train.model_dir='$work/step0'" "--gin.train.export_path='$work/step0.msgpack'" \
    "--gin.train.distillation_cache='$work/target_greedy_train.npz'" \
    --gin.train.num_train_steps=0 --gin.train.eval_every=0 --gin.train.final_eval_splits=[] \
    > "$work/step0.log" 2>&1
  python - "$work" <<'PY'
import json, sys
import numpy as np
from speculative_t5x import data
work = sys.argv[1]
cache = np.load(f'{work}/target_greedy_train.npz')
outputs = data.decode([row[:n - 1] for row, n in zip(cache['tokens'], cache['lengths'])])
sources, _ = data.load_split('train')
with open(f'{work}/target_greedy_train.jsonl', 'w') as f:  # JSONL: a caption may hold a tab
  f.writelines(json.dumps({'inputs': s, 'targets': t}) + '\n' for s, t in zip(sources, outputs))
PY
  "$T5X_PYTHON" -m speculative_t5x.t5x_adapter --output_dir="$work/pair" \
    --draft="$work/step0.msgpack" >/dev/null
fi

t5x_command=("$T5X_PYTHON" -m t5x.train
  --gin_file=t5x/configs/runs/finetune.gin
  --gin_file=speculative_t5x/gin_configs/t5x/multi30k_distill.gin
  --gin_file=speculative_t5x/gin_configs/t5x/multi30k_task.gin
  --gin_file=speculative_t5x/gin_configs/t5x/multi30k_distill_teacher.gin
  "--gin.TEACHER_OUTPUTS='$work/target_greedy_train.jsonl'"
  "--gin.INITIAL_CHECKPOINT_PATH='$work/pair/checkpoint_0'"
  "--gin.MODEL_DIR='$work/t5x'" "--gin.TRAIN_STEPS=$steps" --gin.train.gc_period=100
  --gin.RANDOM_SEED=0 --gin.USE_CACHED_TASKS=False --gin.utils.SaveCheckpointConfig.period=500 --gin.utils.SaveCheckpointConfig.keep=2
  --gin.train.infer_eval_dataset_cfg=None --gin.train.train_eval_dataset_cfg=None)
echo "== t5x.train, $steps steps" >&2
"${t5x_command[@]}" >> "$work/t5x.log" 2>&1

echo "== alpha of both drafts" >&2
python - "$work" "$shipped" <<'PY'
import sys
from speculative_t5x import checkpoints, data
work, shipped = sys.argv[1:]
config, _ = checkpoints.load_model(shipped)
draft = checkpoints.load_checkpoint(f'{work}/t5x')['draft']
checkpoints.export_weights(draft, config, f'{work}/t5x_draft.msgpack', {'source': 't5x.train'})
checkpoints.write_draft_vocabulary(f'{work}/t5x_draft.msgpack', data.caption_vocabulary(),
                                   data.CAPTION_VOCABULARY_SOURCE)
PY
python -m benchmarks.drafts --drafts "shipped=$shipped,t5x_train=$work/t5x_draft.msgpack" \
  --gammas 4 --temperatures 0,1 --out_dir "$work/drafts" > "$work/drafts.log" 2>&1
for f in drafts.md drafts.json; do
  sed -e "s|$work|\$WORK|g" -e "s|${T5X_PYTHON}|\$T5X_PYTHON|g" "$work/drafts/$f" > "$out/$f"
done
grep -E 'collection=train .*loss=' "$work/t5x.log" | sed "s|$work|\$WORK|g" > "$out/t5x_train.log" || true
printf '%s\n' "${t5x_command[*]}" | sed -e "s|$work|\$WORK|g" -e "s|${T5X_PYTHON}|\$T5X_PYTHON|g" \
  > "$out/command.txt"
python - "$out" "$steps" <<'PY'
import pathlib, sys
out, steps = pathlib.Path(sys.argv[1]), sys.argv[2]
rows = [l for l in (out / 'drafts.md').read_text().splitlines() if l.startswith('|')]
header = next(i for i, l in enumerate(rows) if '| alpha |' in l)
acceptance = rows[header:header + 2] + [l for l in rows if '| test (' in l or '| validation (' in l]
(out / 't5x_distill.md').write_text(
    '# A draft distilled by python -m t5x.train against the shipped draft\n\n'
    'Written by scripts/t5x_distill_check.sh (T5X installed apart, docs/t5x.md): the shipped '
    "draft's last stage (gin_configs/train/multi30k_draft_decoder_only_2layers.gin) trained "
    f'in T5X for {steps} steps from the same step 0, on each training caption with its '
    "reference and with the target's greedy output. $WORK: the script's working folder.\n\n"
    f"`{(out / 'command.txt').read_text().strip()}`\n\n"
    'Acceptance of both drafts, token verification at gamma 4 (drafts.md: the command, the '
    'drafts alone and the 100 longest inputs; t5x_train.log: the loss every 100 steps):\n\n'
    + '\n'.join(acceptance) + '\n')
PY
echo "Written: $out (the T5X run stays in $work)" >&2
