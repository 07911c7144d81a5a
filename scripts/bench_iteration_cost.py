"""What one loop iteration costs inside a whole decode, and what a batch pays besides.

  python scripts/bench_iteration_cost.py [--sentences 1:40,8:96] [--gammas 1,2] [--rounds 5]

Per batch size: greedy target-only and greedy speculative decoding (each --gammas) of the first
test_2016_flickr sentences (encoder width rounded up as in scripts/benchmark.py), each compiled
twice: decoding the whole output, and stopping after one loop iteration (`max_decode_steps=1`).
All passes run round-robin for --rounds rounds (medians). The difference of the two, divided by
the iterations the whole decode ran beyond the first (the slowest row's target calls, from
`DecodeStats`), is the cost of one iteration as the loop really pays it: draft calls, verify
call and bookkeeping together. The one-iteration pass is what the batch pays besides: the
encoders, the caches and one iteration. Unlike single-step timings these include everything in
the compiled loop; they cannot say which part of an iteration costs what.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import numpy as np

from speculative_t5x import data

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchmark  # pylint: disable=g-import-not-at-top,wrong-import-position


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--sentences', default='1:40,8:96', help='batch_size:count pairs')
  parser.add_argument('--gammas', default='1,2', help='greedy speculative gammas')
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--data_dir', default=None)
  args = parser.parse_args()
  configs, _, prepared = benchmark.load_pair()
  sources, _ = data.load_split('test', data_dir=args.data_dir)
  settings = [benchmark.Setting('baseline')] + [
      benchmark.Setting('speculative', gamma=int(g)) for g in args.gammas.split(',') if g]
  for batch_size, count in benchmark.parse_sentences(args.sentences).items():
    batches = benchmark.make_batches(data.encode(sources[:count], benchmark.INPUT_LENGTH),
                                     batch_size)
    passes, iterations = {}, {}
    for setting in settings:
      for steps in (None, 1):
        one_pass = benchmark.compile_setting(
            setting, configs, prepared, batches,
            decoder_params=None if steps is None else {'max_decode_steps': steps})[0]
        outputs = jax.block_until_ready(one_pass())
        if steps is None:
          iterations[setting] = sum(int(np.asarray(aux['stats']['target_calls']).max())
                                    for _, aux in outputs)
        passes[setting, steps] = one_pass
    times = {k: float(np.median(t)) for k, t in benchmark.round_robin(passes, args.rounds).items()}
    # Seconds of one loop iteration beyond each batch's first.
    iteration = {s: (times[s, None] - times[s, 1]) / (iterations[s] - len(batches))
                 for s in settings}
    base = settings[0]
    print(f'batch {batch_size}, {count} sentences, {len(batches)} batches:')
    for setting in settings:
      print(f'  {setting.name:26s} {1e3 * times[setting, None] / len(batches):6.1f} ms a batch; '
            f'one iteration {1e3 * iteration[setting]:.2f} ms '
            f'({iteration[setting] / iteration[base]:.2f}x the target-only step), '
            f'{iterations[setting] / len(batches):.2f} iterations a batch; one-iteration pass '
            f'{1e3 * times[setting, 1] / len(batches):.1f} ms; '
            f'speedup {times[base, None] / times[setting, None]:.2f}x')


if __name__ == '__main__':
  main()
