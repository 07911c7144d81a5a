#!/usr/bin/env bash
# The accelerator check, on a GPU or TPU machine, from a clone of this repository:
#
#   scripts/accelerator_check.sh            # installs, then writes results/gpu/ (or results/tpu/)
#
# What it installs: this package with the [bench] extra, and JAX for the machine's accelerator
# (`jax[cuda12]` where nvidia-smi answers, `jax[tpu]` where /dev/accel0 exists; SKIP_INSTALL=1
# keeps the environment as it is). What it writes: results/<machine>/accelerator.json and .md —
# the target's and the draft's step times at T5 1.1 large and XL shapes beside the bytes XLA
# says each step accesses (the GB/s that takes, against the chip's HBM bandwidth), and whole
# greedy loops (target alone, speculative at gamma 3 and 5) beside the time their steps predict
# (random weights: nothing is downloaded); then, unless CALIBRATE=0,
# `speculative-t5x-calibrate --check` on the embedded pair at batch 1, 8 and 32: this machine's
# gamma schedule and the cost model's error on every gamma, in results/<machine>/calibration/
# (needs the Multi30k test captions: SPECULATIVE_T5X_DATA or ../shared/data). About 15 minutes
# on one H100-class GPU. Extra arguments go to `python -m benchmarks.accelerator` (e.g. `--tiny
# --machine cpu` runs its smallest setting on any machine, as the tests do).
set -euo pipefail
cd "$(dirname "$0")/.."
if command -v nvidia-smi > /dev/null && nvidia-smi > /dev/null 2>&1; then
  machine=gpu; jax_extra='jax[cuda12]'
elif [[ -e /dev/accel0 ]]; then
  machine=tpu; jax_extra='jax[tpu]'
else
  machine=cpu; jax_extra=''
fi
if [[ -z "${SKIP_INSTALL:-}" ]]; then
  "${PYTHON:-python}" -m pip install -q -e '.[bench]' ${jax_extra:+"$jax_extra"}
fi
"${PYTHON:-python}" -c 'import jax; print("devices:", jax.devices())'
"${PYTHON:-python}" -m benchmarks.accelerator --machine "$machine" --out_dir "results/$machine" "$@"
if [[ "${CALIBRATE:-1}" != 0 ]]; then
  "${PYTHON:-python}" -m speculative_t5x.calibrate --check --batch_sizes 1,8,32 \
    --output_dir "results/$machine/calibration"
fi
