"""Encoder width: every batch padded to 64 vs each batch's longest input rounded up.

  python -m benchmarks.encoder_width --sentences 1:80,8:160,32:256 --gammas 2 --rounds 5

Per batch size: greedy target-only and greedy speculative decoding (each --gammas value) of the
first test_2016_flickr sentences at both widths: 64 for every batch, and each batch's longest
input rounded up to --input_length_step (what the other benchmarks, `speculative-t5x-translate`
and the infer job's `input_length_step` do). Every pass is compiled first, then all are timed
round-robin (see benchmarks.harness). Reports each pass's median ms per sentence, the speedup
of the rounded width over width 64 (for each decoder) and of speculative over target-only (at
each width), and whether all of them produce the same tokens.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence

import numpy as np

from benchmarks import harness
from benchmarks.harness import Setting
from speculative_t5x import data
from speculative_t5x import policy

NAME = 'encoder_width'
WIDTHS = ('64', 'rounded')


def batch_block(settings: Sequence[Setting], batch_size: int, sources: Sequence[str],
                args: Any) -> Dict[str, Any]:
  """Every setting at both widths on the first len(sources) sentences."""
  count, pair = len(sources), harness.load_pair()
  rows = data.encode(sources, harness.INPUT_LENGTH)
  steps = {'64': 0, 'rounded': args.input_length_step}
  compiled = {(s.name, w): harness.compile_setting(
      s, pair, harness.make_batches(rows, batch_size, steps[w])) for s in settings for w in WIDTHS}
  passes = {key: c.one_pass for key, c in compiled.items()}
  decodes = {key: harness.collect(outputs, count)['decodes']
             for key, outputs in harness.warm(passes).items()}
  times = policy.round_robin(passes, args.rounds)
  reference = decodes[settings[0].name, '64']
  block = {'num_sentences': count, 'ms_per_sentence': [
      {'decoder': name, 'width': w, 'ms_per_sentence': harness.ms_per(times[name, w], count),
       'compile_s': compiled[name, w].info()['compile_s']} for name, w in passes],
           'rounded_over_64': [], 'speculative_over_target': [],
           'identical_outputs': all(np.array_equal(d, reference) for d in decodes.values())}
  for s in settings:
    s_ = harness.speedups(times, (s.name, '64'))[s.name, 'rounded']
    block['rounded_over_64'].append({'decoder': s.name, **s_})
  for w in WIDTHS:
    base = (settings[0].name, w)
    for s in settings[1:]:
      s_ = harness.speedups(times, base)[s.name, w]
      block['speculative_over_target'].append({'decoder': s.name, 'width': w, **s_})
  for r in block['rounded_over_64'] + block['speculative_over_target']:
    print(f"batch {batch_size} {r['decoder']} {r.get('width', 'rounded over 64')}: "
          f"{r['speedup']:.3f}x ({r['speedup_min']:.2f}-{r['speedup_max']:.2f})", flush=True)
  return block


def markdown(results: Mapping[str, Any]) -> str:
  lines = harness.heading('Encoder width: padded to 64 vs rounded up to '
                          f"{results['meta']['input_length_step']}", results)
  span = lambda r: f"{r['speedup']:.3f}x ({r['speedup_min']:.2f}-{r['speedup_max']:.2f})"
  for batch_size, block in results['batches'].items():
    lines += [f"## Batch {batch_size} ({block['num_sentences']} sentences; outputs identical "
              f"across widths and decoders: {block['identical_outputs']})", '']
    lines += harness.table(('decoder', 'width', 'ms/sentence', 'compile s'), [
        [r['decoder'], r['width'], f"{r['ms_per_sentence']:.2f}", f"{r['compile_s']:.1f}"]
        for r in block['ms_per_sentence']]) + ['']
    lines += harness.table(('speedup', 'median (range over rounds)'), [
        [f"{r['decoder']}: rounded width over width 64", span(r)]
        for r in block['rounded_over_64']] + [
            [f"width {r['width']}: {r['decoder']} over target-only", span(r)]
            for r in block['speculative_over_target']]) + ['']
  return '\n'.join(lines)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
  args = harness.parser(__doc__, sentences='1:80,8:160,32:256', gammas='2',
                        rounds=5).parse_args(argv)
  settings = harness.greedy_settings(args.gammas, auto=False)
  return harness.run_blocks(NAME, argv, args, lambda batch_size, sources: batch_block(
      settings, batch_size, sources, args), markdown)


if __name__ == '__main__':
  main()
