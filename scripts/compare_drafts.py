"""Compares draft models for the embedded target: alpha, c, BLEU and measured speedup, one process.

  python scripts/compare_drafts.py \
      --drafts shipped=speculative_t5x/pretrained/multi30k_de_en_draft.msgpack,new=runs/new.msgpack \
      --sentences 1:80,8:160 --gammas 1,2,3 --sampling_gammas 1 --repeats 5 \
      --out results/cpu/drafts.json

Per draft: its own greedy BLEU on all of test_2016_flickr (the draft decoding alone), c = one
cached draft step / one target step (dispatched single calls, as scripts/benchmark.py times
them) and c_hat (FLOPs per token). Per batch size, draft and gamma: speculative decoding of the
first N test sentences (greedy at every --gammas value, temperature 1 at every --sampling_gammas
value), its alpha, whether greedy outputs equal the target alone's (they must, 100%), and its
speedup over target-only decoding at the same temperature. All configurations of a batch size,
every draft's, are timed round-robin for --repeats rounds after one untimed pass each; a speedup
is the median over rounds of the baseline's pass time over the configuration's in the same
round, so the drafts are compared on the same machine state.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import List

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchmark  # pylint: disable=g-import-not-at-top,wrong-import-position

from speculative_t5x import data  # pylint: disable=wrong-import-position
from speculative_t5x import models  # pylint: disable=wrong-import-position
from speculative_t5x import train  # pylint: disable=wrong-import-position


def draft_bleu(config, params, sources: List[str], references: List[str]) -> float:
  """Corpus BLEU of the draft's own greedy translations of `sources`."""
  outputs = train.greedy_translate(config, params, data.encode(sources, benchmark.INPUT_LENGTH),
                                   benchmark.INPUT_LENGTH, benchmark.OUTPUT_LENGTH)
  return data.corpus_bleu(data.decode(outputs), references)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--drafts', required=True, help='name=weights_file pairs, comma-separated')
  parser.add_argument('--target', default=str(benchmark.PRETRAINED /
                                               'multi30k_de_en_target.msgpack'))
  parser.add_argument('--sentences', default='1:80,8:160', help='batch_size:count pairs')
  parser.add_argument('--gammas', default='1,2,3', help='greedy speculative gammas')
  parser.add_argument('--sampling_gammas', default='1', help='gammas at temperature 1')
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--data_dir', default=None)
  parser.add_argument('--out', default='results/cpu/drafts.json')
  args = parser.parse_args()
  try:
    drafts = dict(pair.split('=', 1) for pair in args.drafts.split(','))
    greedy = [int(g) for g in args.gammas.split(',') if g]
    sampling = [int(g) for g in args.sampling_gammas.split(',') if g]
  except ValueError:
    raise SystemExit('error: --drafts wants name=path pairs; --gammas and --sampling_gammas '
                     'integers like 1,2,3') from None
  sizes = benchmark.parse_sentences(args.sentences)
  sources, references = data.load_split('test', data_dir=args.data_dir)

  target_config, target_params, _ = train.load_weights(args.target)
  pairs = {}  # draft name -> (configs, prepared decode params)
  results = {'command': 'python scripts/compare_drafts.py ' + ' '.join(sys.argv[1:]),
             'drafts': {}, 'batches': {}}
  for name, path in drafts.items():
    draft_config, draft_params, _ = train.load_weights(path)
    if draft_config.vocab_size != target_config.vocab_size:
      raise SystemExit(f'error: draft {name} ({path}) has vocab_size {draft_config.vocab_size}, '
                       f'the target {target_config.vocab_size}.')
    configs = {'target': target_config, 'draft': draft_config}
    params = {'target': target_params, 'draft': draft_params}
    pairs[name] = configs, jax.jit(models.EncoderDecoderModel(
        target_config, draft_config).with_decode_variables)(params)
    start = time.perf_counter()
    results['drafts'][name] = {
        'path': path, 'params': int(sum(x.size for x in jax.tree_util.tree_leaves(draft_params))),
        'c_hat': draft_config.decode_flops_per_token() / target_config.decode_flops_per_token(),
        'bleu_alone': draft_bleu(draft_config, draft_params, sources, references)}
    print(f"draft {name}: BLEU alone {results['drafts'][name]['bleu_alone']:.2f} "
          f'({time.perf_counter() - start:.0f}s)', flush=True)

  out = Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  for batch_size, count in sizes.items():
    batches = benchmark.make_batches(data.encode(sources[:count], benchmark.INPUT_LENGTH),
                                     batch_size)
    target_steps = benchmark.step_times_ms(target_config, target_params, batch_size,
                                          sorted({1, 2} | {g + 1 for g in greedy + sampling}))
    baselines = [benchmark.Setting('baseline', t) for t in (0.0, 1.0) if (greedy, sampling)[int(t)]]
    runs = [(None, s) for s in baselines]
    runs += [(name, benchmark.Setting('speculative', t, g)) for name in drafts
             for t, gammas in ((0.0, greedy), (1.0, sampling)) for g in gammas]
    first = next(iter(pairs.values()))
    passes, outputs = {}, {}
    for key in runs:
      configs, prepared = pairs[key[0]] if key[0] else first
      passes[key] = benchmark.compile_setting(key[1], configs, prepared, batches)[0]
      outputs[key] = jax.block_until_ready(passes[key]())
    times = benchmark.round_robin(passes, args.repeats)
    steps = {name: {'target': target_steps, 'draft': benchmark.step_times_ms(
        pairs[name][0]['draft'], pairs[name][1]['draft'], batch_size, (1, 2))} for name in drafts}

    def run(key):
      return {**benchmark.collect(outputs[key], count), 'compile_s': 0.0,
              'ms_per_sentence': 1e3 * float(np.median(times[key])) / count}

    rows = []
    for key in runs:
      name, setting = key
      base_key = (None, setting.baseline)
      row = benchmark.summarize(setting, run(key), run(base_key),
                                steps[name] if name else steps[next(iter(drafts))],
                                results['drafts'][name]['c_hat'] if name else 0.0,
                                references[:count])
      row.update(draft=name, **benchmark.speedup_over_rounds(times[base_key], times[key]))
      row.pop('totals', None)
      rows.append(row)
      print(f"batch {batch_size} {name or ''} {row['name']}: {row['ms_per_sentence']:.1f} "
            f"ms/sentence, {row['speedup']:.2f}x (rounds {row['speedup_min']:.2f}-"
            f"{row['speedup_max']:.2f}), alpha {benchmark.fmt(row.get('alpha'), '.3f')}, "
            f"c {benchmark.fmt(row.get('c'), '.3f')}, BLEU {row['bleu']:.2f}" +
            (f", same as greedy {row['same_as_baseline']:.0%}" if setting.temperature == 0 else ''),
            flush=True)
    results['batches'][str(batch_size)] = {'num_sentences': count, 'rows': rows}
    out.write_text(json.dumps(results, indent=1))
  print('wrote', out)


if __name__ == '__main__':
  main()
