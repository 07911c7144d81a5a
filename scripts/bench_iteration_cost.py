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
import functools
import sys
from pathlib import Path

import jax
import numpy as np

from speculative_t5x import data
from speculative_t5x import models

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
  rng = jax.random.PRNGKey(0)
  for batch_size, count in benchmark.parse_sentences(args.sentences).items():
    batches = benchmark.make_batches(data.encode(sources[:count], benchmark.INPUT_LENGTH),
                                     batch_size)
    passes, iterations = {}, {}
    for setting in settings:
      decode_fn, kwargs = setting.decoder()
      model = models.EncoderDecoderModel(configs['target'], configs['draft'],
                                         decode_fn=decode_fn, decode_kwargs=kwargs,
                                         eos_id=data.EOS_ID)
      for steps in (None, 1):
        decoder_params = None if steps is None else {'max_decode_steps': steps}
        predict = benchmark.compile_per_width(jax.jit(functools.partial(
            model.predict_batch_with_aux, decoder_params=decoder_params)), prepared, batches, rng)
        one_pass = lambda predict=predict: [predict(prepared, b, rng) for b in batches]
        outputs = jax.block_until_ready(one_pass())
        if steps is None:
          iterations[setting] = sum(int(np.asarray(aux['stats']['target_calls']).max())
                                    for _, aux in outputs)
        passes[setting, steps] = one_pass
    times = {k: float(np.median(t)) for k, t in benchmark.round_robin(passes, args.rounds).items()}
    print(f'batch {batch_size}, {count} sentences, {len(batches)} batches:')
    base = settings[0]
    base_iteration = None
    for setting in settings:
      whole, first = times[setting, None], times[setting, 1]
      iteration = (whole - first) / (iterations[setting] - len(batches))
      base_iteration = base_iteration or iteration
      print(f'  {setting.name:26s} {1e3 * whole / len(batches):6.1f} ms a batch; one iteration '
            f'{1e3 * iteration:.2f} ms ({iteration / base_iteration:.2f}x the target-only step), '
            f'{iterations[setting] / len(batches):.2f} iterations a batch; one-iteration pass '
            f'{1e3 * first / len(batches):.1f} ms; speedup {times[base, None] / whole:.2f}x')


if __name__ == '__main__':
  main()
