#!/usr/bin/env bash
# One accelerator session, budgeted: the embedded pair's decoders timed on the machine's own
# accelerator (greedy, T=1 with token and block verification, BiLD), then the T5 1.1 XL step and
# loop check beside its roofline, then the cost-model calibration. Each part runs under its own
# time limit and writes as it goes, so a part cut short keeps what it finished.
#
#   OUT=/tmp/gpu scripts/device_run.sh          # on a GPU machine, JAX installed
#   OUT=/tmp/cpu TINY=1 scripts/device_run.sh   # its smallest setting, on any machine
#
# Results: $OUT/results.tar.gz (speed/, verifiers/, accelerator/, calibration/) and $OUT/log.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:?set OUT to a folder}"; mkdir -p "$out/r"
py="${PYTHON:-python3}"
if [[ -n "${TINY:-}" ]]; then
  sent='1:4,8:8'; bs='1,8'; gam='1,2'; sgam='1'; acc=(--tiny --machine cpu); lim=300
else
  sent='1:64,8:128,32:256'; bs='1,8,32'; gam='1,2,3,4,5'; sgam='1,2,4'; acc=(--sizes xl --batches 1,8); lim=0
fi
part() {  # part NAME SECONDS COMMAND...: run under a limit, log its status
  local name=$1 secs=$2; shift 2
  echo "== $name (limit ${secs}s) $(date +%T)"
  timeout "$secs" "$@"; echo "== $name: exit $? $(date +%T)"
}
"$py" -c 'import jax, flax; print("jax", jax.__version__, "flax", flax.__version__, jax.devices())'
part speed $(( lim ? lim : 190 )) "$py" -m benchmarks.speed --machine gpu --out_dir "$out/r/speed" \
  --sentences "$sent" --gammas "$gam" --sampling_gammas "$sgam" --bild 0.4:5 --rounds 3
part verifiers $(( lim ? lim : 110 )) "$py" -m benchmarks.verifiers --machine gpu \
  --out_dir "$out/r/verifiers" --count_sentences 0 --greedy_sentences 0 --sentences "$sent" \
  --speed_gammas 2,4 --speed_trees '2;3,1' --rounds 3
part accelerator $(( lim ? lim : 130 )) "$py" -m benchmarks.accelerator --out_dir "$out/r/accelerator" \
  --rounds 3 "${acc[@]}"
part calibrate $(( lim ? lim : 140 )) "$py" -m speculative_t5x.calibrate --check \
  --batch_sizes "$bs" --output_dir "$out/r/calibration"
tar -czf "$out/results.tar.gz" -C "$out/r" .
