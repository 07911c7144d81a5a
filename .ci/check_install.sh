#!/usr/bin/env bash
# A newcomer's install, checked: build the wheel, install it (not editable) into a fresh venv,
# and run the README's main command and inference job from a folder outside the repository.
#   bash .ci/check_install.sh                (about 3 minutes with a warm pip cache)
# Exits non-zero at the first command that fails or prints something unexpected.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
source "$work/venv/bin/activate"
python -m pip install -q --upgrade pip
echo "== build the wheel"
# From a copy of the sources, as a fresh clone would build: pip builds a folder in place and
# setuptools packs whatever the repository's build/lib already holds, stale files included.
mkdir "$work/src"
tar -C "$repo" --exclude=./.git --exclude=./build --exclude=./dist --exclude='./*venv' \
  --exclude=./runs --exclude=./out --exclude='*.egg-info' --exclude=__pycache__ -cf - . |
  tar -C "$work/src" -xf -
pip wheel -q --no-deps -w "$work/dist" "$work/src"
echo "== pip install speculative_t5x-*.whl (base install, no extras)"
pip install -q "$work"/dist/speculative_t5x-*.whl
cd "$work"  # outside the repository: packaged files only

echo "== the gin configs ship inside the package: by name for the jobs, by package for T5X's gin"
python - <<'EOF'
import importlib.util
from gin import resource_reader
from speculative_t5x import gin_utils
configs = gin_utils.GIN_CONFIGS_DIR
assert configs == gin_utils.PACKAGE_DIR / 'gin_configs', configs
assert gin_utils.resolve_path('gin_configs/runs/infer.gin') == configs / 'runs' / 'infer.gin'
assert resource_reader.system_path_file_exists('speculative_t5x/gin_configs/t5x/multi30k_pair.gin')
assert importlib.util.find_spec('gin_configs') is None, 'a top-level gin_configs was installed'
EOF

echo "== speculative-t5x-translate (no arguments: the bundled caption sample)"
speculative-t5x-translate < /dev/null | tee translate.out
grep -q 'outputs identical to target-only greedy: True' translate.out
grep -q 'A little boy' translate.out

echo "== speculative-t5x-translate on an everyday sentence (out-of-domain notice)"
speculative-t5x-translate "Ich habe heute keine Zeit." | tee ood.out
grep -q 'look out of domain' ood.out

echo "== speculative-t5x-infer, the README's example"
speculative-t5x-infer \
  --gin_file=gin_configs/runs/infer_multi30k.gin \
  --gin_file=gin_configs/decoding/speculative_greedy.gin \
  --gin.INFER_OUTPUT_DIR="'$work/infer'" 2> infer.err | tee infer.out
test -f "$work"/infer/captions_de.txt-predict_with_aux.jsonl-00000-of-00001.COMPLETED
test "$(wc -l < "$work"/infer/captions_de.txt-predict_with_aux.jsonl-00000-of-00001)" = 8

echo "== python -m speculative_t5x.infer, same job (resumes: nothing left to decode)"
python -m speculative_t5x.infer \
  --gin_file=gin_configs/runs/infer_multi30k.gin \
  --gin_file=gin_configs/decoding/speculative_greedy.gin \
  --gin.INFER_OUTPUT_DIR="'$work/infer'" 2>> infer.err

echo "== the seqio test-split job without the data extra: one line naming the extra"
set +e
speculative-t5x-infer \
  --gin_file=gin_configs/runs/infer_multi30k_test.gin \
  --gin_file=gin_configs/decoding/speculative_greedy.gin \
  --gin.INFER_OUTPUT_DIR="'$work/infer_test'" 2> extra.err
status=$?
set -e
cat extra.err
test "$status" = 1
grep -v '^[IW][0-9]\{4\} ' extra.err > extra.lines || true
test "$(wc -l < extra.lines)" = 1
grep -q "^error: seqio tasks need: pip install 'speculative_t5x\[data\]'" extra.lines
echo "== all install checks passed"
