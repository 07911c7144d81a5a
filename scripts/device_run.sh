#!/usr/bin/env bash
# One GPU lease of 15 minutes in all (the machine's start and every compile included), ordered so
# that the first part answers the question: does speculation pay at T5 1.1 XL on this GPU, and
# how close does it come to the paper's formula? Each part runs under its own time limit and
# writes as it goes, so a part cut short keeps what it finished.
#
#   xl:   T5 1.1 XL target (random weights, bf16) and the T5 1.1 small draft, batch 1: the
#         target-only loop, and the speculative loop at gamma 4 accepting each draft token with
#         probability 0.75 (the paper's greedy alpha; `accelerator.fixed_acceptance_rule`, a
#         rule for benchmarks only), its draft calls looped and unrolled; steps timed for c.
#         Then the same under command buffers that capture while loops.
#   pair: the embedded pair's greedy and T=1 decoders at batch 1 on test captions, target alone
#         and gamma 4, under XLA's defaults, then with while loops in command buffers.
#
#   OUT=/tmp/gpu PARTS=xl scripts/device_run.sh       # ~8 min of a lease (one device call)
#   OUT=/tmp/gpu PARTS=pair scripts/device_run.sh     # ~4 min (a second call)
#   OUT=/tmp/cpu TINY=1 scripts/device_run.sh         # every part, tiny, on any machine
#
# Results: $OUT/<part>/ (accelerator.md / speed.md with their JSON) and $OUT/log.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:?set OUT to a folder}"; mkdir -p "$out"
py="${PYTHON:-python3}"
parts="${PARTS:-xl pair}"
# XLA:GPU leaves while loops out of command buffers by default; a draft loop of small kernels
# is launch-bound without them.
while_flags='--xla_gpu_enable_command_buffer=+WHILE --xla_gpu_graph_min_graph_size=1'
if [[ -n "${TINY:-}" ]]; then
  xl=(--tiny --machine cpu --batches 1 --rounds 2); sent='1:4'; lim=(240 240 240 240)
else
  xl=(--sizes xl --batches 1 --rounds 3); sent='1:32'; lim=(300 180 120 120)
fi
part() {  # part NAME SECONDS COMMAND...: run under a limit, log its status
  local name=$1 secs=$2; shift 2
  echo "== $name (limit ${secs}s) $(date +%T)" | tee -a "$out/log"
  timeout "$secs" "$@" 2>&1 | tee -a "$out/log"
  echo "== $name: exit ${PIPESTATUS[0]} $(date +%T)" | tee -a "$out/log"
}
"$py" -c 'import jax; print("jax", jax.__version__, jax.devices())' 2>&1 | tee -a "$out/log"
if [[ " $parts " == *" xl "* ]]; then
  part xl_default "${lim[0]}" "$py" -m benchmarks.accelerator "${xl[@]}" --gammas 4 \
    --alpha 0.75 --unroll_draft --out_dir "$out/xl_default"
  XLA_FLAGS="${XLA_FLAGS:-} $while_flags" part xl_while "${lim[1]}" "$py" -m benchmarks.accelerator \
    "${xl[@]}" --gammas 4 --alpha 0.75 --unroll_draft --out_dir "$out/xl_while"
fi
if [[ " $parts " == *" pair "* ]]; then
  part pair_default "${lim[2]}" "$py" -m benchmarks.speed --machine gpu --sentences "$sent" \
    --gammas 4 --sampling_gammas 4 --rounds 3 --out_dir "$out/pair_default"
  XLA_FLAGS="${XLA_FLAGS:-} $while_flags" part pair_while "${lim[3]}" "$py" -m benchmarks.speed \
    --machine gpu --sentences "$sent" --gammas 4 --sampling_gammas 4 --rounds 3 \
    --out_dir "$out/pair_while"
fi
