#!/usr/bin/env bash
# Reruns the benchmarks behind the README's results table on this machine, one after another:
#
#   scripts/reproduce_results.sh [OUT]     # OUT defaults to results/cpu
#
# Needs the data folder ($SPECULATIVE_T5X_DATA, default ../shared/data) and the [bench] extra:
#   pip install -e '.[bench]'
# About 3 hours on a 2-core CPU in all (the policy run is most of it); each benchmark writes its
# <name>.json and <name>.md as it goes. ONLY="speed verifiers" runs the named ones. DRY_RUN=1
# prints the commands instead of running them. Nothing else may run on the machine meanwhile:
# every figure is a ratio of passes timed in one process, and a second process skews it.
# The T5X column (benchmarks.vs_t5x) needs a private T5X install: see docs/t5x.md.
set -euo pipefail
cd "$(dirname "$0")/.."
out_args=(--out_dir "${1:-results/cpu}")

# name: the benchmark module, then the flags of the run the README reports.
declare -A RUNS=(
  # The table's greedy, T=1 and beam columns: fresh 192-sentence jobs, 'auto' with its search.
  [speed]="--sentences 1:192,8:192,32:192 --gammas 1,2,3,4,auto --sampling_gammas 1,auto --beams 4:1,4:auto --rounds 3"
  # The verifiers line: tokens per call on the 1000 test captions, then speed at T=1.
  [verifiers]="--count_sentences 1000 --gammas 2,4 --trees 2;2,1;3,1;2,1,1,1 --sentences 1:64,8:192,32:320 --speed_gammas 1,2 --speed_trees 2;3,1 --rounds 3"
  # The CTranslate2 column: both engines on the test captions, alternating processes.
  [vs_ctranslate2]="--sentences 1:64,8:192,32:320 --rounds 3"
)
ORDER=(speed verifiers vs_ctranslate2)

for name in ${ONLY:-${ORDER[@]}}; do
  [[ -v "RUNS[$name]" ]] || { echo "error: ONLY names '$name'; known: ${ORDER[*]}" >&2; exit 1; }
  read -r -a flags <<< "${RUNS[$name]}"
  command=("${PYTHON:-python}" -m "benchmarks.$name" "${flags[@]}" "${out_args[@]}")
  if [[ -n "${DRY_RUN:-}" ]]; then
    printf '%q ' "${command[@]}"
    echo
  else
    echo "== ${command[*]}"
    "${command[@]}"
  fi
done
