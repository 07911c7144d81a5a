#!/usr/bin/env bash
# A machine with no data folder, checked: the README's benchmark and calibrate commands run from
# a copy of the sources with no ../shared/data beside it, fetching Multi30k's test captions once
# into an empty cache. The fetch reads a local mirror made from the data folder (CI reaches no
# GitHub), through the URL setting a user would point at a mirror of their own.
#   bash .ci/check_no_data.sh       (in the venv of .ci/run; about 4 minutes on 2 cores)
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
data="${SPECULATIVE_T5X_DATA:-$repo/../shared/data}"
if [ ! -d "$data/multi30k" ]; then
  echo "== skipped: no data folder to mirror Multi30k from ($data)"
  exit 0
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir "$work/src" "$work/mirror"
tar -C "$repo" --exclude=./.git --exclude=./build --exclude=./dist --exclude='./*venv' \
  --exclude=./runs --exclude='*.egg-info' --exclude=__pycache__ -cf - . | tar -C "$work/src" -xf -
for f in test_2016_flickr.de test_2016_flickr.en; do
  gzip -c "$data/multi30k/$f" > "$work/mirror/$f.gz"
done
unset SPECULATIVE_T5X_DATA
export XDG_CACHE_HOME="$work/cache" SPECULATIVE_T5X_MULTI30K_URL="file://$work/mirror/{name}.gz"
cd "$work/src"  # imports this copy: no data folder beside it

echo "== python -m benchmarks.speed (the README's benchmark command)"
python -m benchmarks.speed --out_dir "$work/runs" 2> speed.err | tail -3
grep -q 'fetched Multi30k test_2016_flickr.de' speed.err
test -f "$work/runs/speed.md"

echo "== the calibrate command (the README's short setting), the captions now cached"
python -m speculative_t5x.calibrate --batch_sizes 1,8 --sentences 32 \
  --output_dir "$work/calibration" 2> calibrate.err | tail -2
! grep -q 'fetching Multi30k' calibrate.err
test -f "$work/calibration/t5x_schedule.gin"

echo "== offline, no cache: one line that says what to do"
rm -rf "$work/cache"
export SPECULATIVE_T5X_MULTI30K_URL="http://127.0.0.1:9/{name}.gz"
set +e
python -m speculative_t5x.calibrate --batch_sizes 1 --output_dir "$work/offline" 2> offline.err
status=$?
set -e
test "$status" = 1
grep '^error: ' offline.err
grep -q 'offline?' offline.err
echo "== no-data checks passed"
