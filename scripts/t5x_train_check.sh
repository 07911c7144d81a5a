#!/usr/bin/env bash
# Does `python -m t5x.train` with t5x_adapter.DistillationEncoderDecoderModel learn as the
# project's own trainer does? Both distil a fresh embedded draft (two decoder layers over the
# target's encoder) from the embedded target for STEPS steps with the same recipe: forward KL on
# the training captions, Adafactor as T5X's, lr 0.25 / sqrt(max(step, 400)), 32 packed rows of
# 64, dropout 0.1; then the loss per target token, averaged over windows of WINDOW steps, side by
# side (their batches differ: seqio's packing against the project's). With INIT (a draft weights
# file, e.g. the step 0 scripts/t5x_distill_check.sh writes) both start from that draft instead,
# so only the batches and dropout draws differ.
#
# PACK=0 trains both on unpacked rows (one example a row): seqio's packing fits fewer target
# tokens into a batch than the project's, so packed steps differ in size.
#
#   T5X_PYTHON=/path/to/t5x-venv/bin/python [INIT=draft.msgpack] [PACK=0] \
#     scripts/t5x_train_check.sh [OUT]
#
# OUT defaults to results/cpu/t5x_train. Needs T5X installed apart (docs/t5x.md), the data folder
# ($SPECULATIVE_T5X_DATA) and this checkout on T5X's Python path.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-results/cpu/t5x_train}"
steps="${STEPS:-300}"
window="${WINDOW:-50}"
if [[ -z "${T5X_PYTHON:-}" ]]; then
  echo "error: set T5X_PYTHON to the python of a T5X install (docs/t5x.md)" >&2
  exit 1
fi
work="$(mktemp -d)"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

init="${INIT:-}"
pack=True; [[ "${PACK:-1}" == 0 ]] && pack=False
if [[ -n "$init" ]]; then
  draft_args=(--draft="$init")
  fresh=()  # T5X restores the draft from the pair; the project's trainer starts from INIT.
  start="--gin.train.init_from='$init'"
else
  draft_args=()
  fresh=(" (r'target/draft/.*', None)")  # T5X starts the draft fresh, as the project's trainer.
  start=--gin.train.init_from=None
fi
"$T5X_PYTHON" -m speculative_t5x.t5x_adapter --output_dir="$work/pair" "${draft_args[@]}" >/dev/null
t5x_command=("$T5X_PYTHON" -m t5x.train
  --gin_file=t5x/configs/runs/finetune.gin
  --gin_file=speculative_t5x/gin_configs/t5x/multi30k_distill.gin
  --gin_file=speculative_t5x/gin_configs/t5x/multi30k_task.gin
  "--gin.INITIAL_CHECKPOINT_PATH='$work/pair/checkpoint_0'"
  "--gin.MODEL_DIR='$work/t5x'" "--gin.TRAIN_STEPS=$steps" "--gin.train.gc_period=$window"
  --gin.RANDOM_SEED=0 --gin.USE_CACHED_TASKS=False
  --gin.train.infer_eval_dataset_cfg=None --gin.train.train_eval_dataset_cfg=None
  "--gin.train/utils.DatasetConfig.pack=$pack"
  "--gin.utils.RestoreCheckpointConfig.assignment_map=((r'state/param_states.*', None),${fresh[*]})")
echo "== t5x.train, $steps steps" >&2
"${t5x_command[@]}" > "$work/t5x.log" 2>&1
# T5X logs its train metrics once an "epoch", here every WINDOW steps (its GC period: without
# evaluations, its eval period does not count).
grep -E 'collection=train .*loss=|Restoring' "$work/t5x.log" | sed "s|$work|\$WORK|g" \
  > "$out/t5x_train.log" || true

project_command=(python -m speculative_t5x.train
  --gin_file=gin_configs/train/multi30k_draft_decoder_only_2layers.gin
  "--gin.train.model_dir='$work/project'" "$start" --gin.train.init_partial=False
  "--gin.train.kd_sequences='data'" "--gin.train.num_train_steps=$steps" "--gin.train.pack=$pack"
  --gin.train.max_train_seconds=None --gin.train.eval_every=0 --gin.train.final_eval_splits=[]
  --gin.train.export_path=None --gin.train.log_every=1)
echo "== speculative-t5x-train, $steps steps" >&2
"${project_command[@]}" > "$work/project.log" 2>&1
cp "$work/project/metrics.jsonl" "$out/project_metrics.jsonl"

python - "$work" "$out" "$window" "${t5x_command[*]}" "${project_command[*]}" "$init" <<'EOF'
import json, os, pathlib, re, sys
work, out, window = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), int(sys.argv[3])
init = sys.argv[6]
# The commands as a reader reruns them: no path of this machine.
commands = [c.replace(str(work), '$WORK').replace(os.environ['T5X_PYTHON'], '$T5X_PYTHON')
            for c in sys.argv[4:6]]
if init:
  commands = [c.replace(init, '$INIT') for c in commands]
# T5X logs each window's mean metrics as "[step] collection=train ... loss=..., ...".
t5x = {int(m.group(1)): float(m.group(2)) for m in re.finditer(
    r'\[(\d+)\] collection=train .*?\bloss=([\d.e+-]+)', (work / 't5x.log').read_text())}
records = [json.loads(l) for l in (work / 'project' / 'metrics.jsonl').read_text().splitlines()]
losses = {r['step']: r['loss'] for r in records if 'loss' in r}
rows = ['| steps | t5x.train | speculative-t5x-train | gap |', '|---|---|---|---|']
for end in sorted(t5x):
  ours = [losses[s] for s in range(end - window + 1, end + 1)]
  mean = sum(ours) / len(ours)
  rows.append(f'| {end - window + 1}-{end} | {t5x[end]:.4f} | {mean:.4f} | '
              f'{(t5x[end] - mean) / mean:+.1%} |')
start = ('the draft $INIT' if init else 'a fresh embedded draft')
restored = ('every target/target and target/draft key from the checkpoint: both trainers start '
            'from $INIT' if init else 'every target/target key from the checkpoint, no '
            'target/draft key: the draft starts fresh')
text = (f'# t5x.train against speculative-t5x-train: {start} distilled from the target\n\n'
        'Written by scripts/t5x_train_check.sh (T5X installed apart, docs/t5x.md). '
        f"t5x_train.log: T5X's restore ({restored}) and its train metrics per window. $WORK: the "
        "script's temporary folder.\n\n"
        f'`{commands[0]}`\n\n`{commands[1]}`\n\nLoss per target token (forward KL), the mean '
        f'of each {window}-step window:\n\n' + '\n'.join(rows) + '\n')
(out / 't5x_train.md').write_text(text)
print(text)
EOF
rm -rf "$work"
