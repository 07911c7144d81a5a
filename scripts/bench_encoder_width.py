"""Encoder width: every batch padded to 64 vs each batch's longest input rounded up to 16 (what
`scripts/benchmark.py` and `speculative-t5x-translate` do), on the embedded pair.

  python scripts/bench_encoder_width.py [--sentences 1:80,8:160,32:256] [--gamma 2] [--rounds 5]

Per batch size: greedy target-only and greedy speculative decoding (--gamma) of the first
test_2016_flickr sentences at both widths, every pass compiled first, then --rounds rounds
round-robin. Prints each pass's median ms per sentence, the per-round speedups of the rounded
width over width 64 (for each decoder) and of speculative over target-only (at each width), and
whether all four produce the same tokens.
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
  parser.add_argument('--sentences', default='1:80,8:160,32:256', help='batch_size:count pairs')
  parser.add_argument('--gamma', type=int, default=2)
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--data_dir', default=None)
  args = parser.parse_args()
  configs, _, prepared = benchmark.load_pair()
  sources, _ = data.load_split('test', data_dir=args.data_dir)
  settings = {'target-only': benchmark.Setting('baseline'),
              'speculative': benchmark.Setting('speculative', gamma=args.gamma)}
  widths = {'64': 0, 'rounded': benchmark.INPUT_LENGTH_STEP}
  for batch_size, count in benchmark.parse_sentences(args.sentences).items():
    rows = data.encode(sources[:count], benchmark.INPUT_LENGTH)
    passes, decodes = {}, {}
    for width, step in widths.items():
      batches = benchmark.make_batches(rows, batch_size, step)
      for name, setting in settings.items():
        one_pass = benchmark.compile_setting(setting, configs, prepared, batches)[0]
        passes[name, width] = one_pass
        decodes[name, width] = benchmark.collect(jax.block_until_ready(one_pass()),
                                                 count)['decodes']
    times = benchmark.round_robin(passes, args.rounds)
    print(f'batch {batch_size}, {count} sentences:')
    for key, seconds in times.items():
      print(f'  {key[0]:12s} width {key[1]:8s} {1e3 * np.median(seconds) / count:6.2f} '
            'ms/sentence')
    for name in settings:
      s = benchmark.speedup_over_rounds(times[name, '64'], times[name, 'rounded'])
      print(f"  {name}: rounded width / width 64: {s['speedup']:.3f}x "
            f"({s['speedup_min']:.2f}-{s['speedup_max']:.2f})")
    for width in widths:
      s = benchmark.speedup_over_rounds(times['target-only', width], times['speculative', width])
      print(f"  width {width}: speculative over target-only {s['speedup']:.3f}x "
            f"({s['speedup_min']:.2f}-{s['speedup_max']:.2f})")
    reference = decodes['target-only', '64']
    same = all(np.array_equal(d, reference) for d in decodes.values())
    print(f'  outputs identical across widths and decoders: {same}', flush=True)


if __name__ == '__main__':
  main()
