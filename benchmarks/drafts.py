"""Draft models for one target compared: alpha, c, BLEU and measured speedup, in one process.

  python -m benchmarks.drafts \
      --drafts shipped=speculative_t5x/pretrained/multi30k_de_en_draft.msgpack,new=runs/a.msgpack \
      --sentences 1:80,8:160 --gammas 1,2,3 --sampling_gammas 1 --rounds 5

Per draft: its own greedy BLEU on test_2016_flickr (the draft decoding alone; the first
--bleu_sentences sentences, 0: all), c_hat (FLOPs per token relative to the target) and, per
batch size, c = one cached draft step / one target step (timed as the loops run them,
harness.step_times_ms). Per batch size, draft and gamma: speculative decoding of the first N
test sentences (greedy at every --gammas value, temperature 1 at every --sampling_gammas value),
its alpha, whether greedy outputs equal the target alone's (they must, 100%), and its speedup
over target-only decoding at the same temperature. All configurations of a batch size, every
draft's, are timed round-robin (see benchmarks.harness), so the drafts are compared on the same
machine state.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from benchmarks import harness
from benchmarks.harness import Setting
from speculative_t5x import data
from speculative_t5x import evaluation
from speculative_t5x import pipeline
from speculative_t5x import policy

NAME = 'drafts'
Key = Tuple[Optional[str], Setting]  # (draft name, or None for the target alone; setting)


def add_pair_flags(p: Any) -> None:
  """--drafts (name=weights pairs) and --target, shared with benchmarks.draft_acceptance."""
  p.add_argument('--drafts', default=f'shipped={pipeline.EMBEDDED_DRAFT}',
                 help='name=weights_file pairs, comma-separated')
  p.add_argument('--target', default=str(pipeline.EMBEDDED_TARGET))


def parse_drafts(spec: str) -> Dict[str, str]:
  """'a=x.msgpack,b=y.msgpack' -> {name: path}; exits with one line on bad input."""
  try:
    return dict(pair.split('=', 1) for pair in spec.split(','))
  except ValueError:
    raise SystemExit(f'error: --drafts wants name=path pairs, got {spec!r}') from None


def parse_args(argv: Optional[Sequence[str]]) -> Tuple[Any, Dict[str, str]]:
  p = harness.parser(__doc__, sentences='1:80,8:160', gammas='1,2,3', rounds=5,
                     needs=[harness.BLEU])
  add_pair_flags(p)
  p.add_argument('--sampling_gammas', default='1', help='gammas at temperature 1 (empty: none)')
  p.add_argument('--bleu_sentences', type=int, default=0,
                 help="test sentences for each draft's own BLEU (0: all)")
  args = p.parse_args(argv)
  return args, parse_drafts(args.drafts)


def load_drafts(target: str, drafts: Mapping[str, str], sources: Sequence[str],
                references: Sequence[str]) -> Tuple[Dict[str, pipeline.Pair], Dict[str, Any]]:
  """({name: pair}, {name: path, params, c_hat, bleu_alone}) of every draft with the target."""
  pairs, info = {}, {}
  for name, path in drafts.items():
    pairs[name] = pair = harness.load_pair(target, path)
    if pair.draft_config.vocab_size != pair.target_config.vocab_size:
      raise SystemExit(f'error: draft {name} ({path}) has vocab_size '
                       f'{pair.draft_config.vocab_size}, the target '
                       f'{pair.target_config.vocab_size}.')
    reads = None if pair.draft_config.has_encoder else (pair.target_config,
                                                          pair.params['target'])
    outputs = evaluation.translate(
        pair.draft_config, pair.params['draft'], data.encode(sources, harness.INPUT_LENGTH),
        harness.INPUT_LENGTH, harness.OUTPUT_LENGTH, encoder=reads)
    info[name] = {
        'path': path, 'params': harness.param_count(pair.params['draft']),
        'c_hat': (pair.draft_config.decode_flops_per_token() /
                  pair.target_config.decode_flops_per_token()),
        'bleu_alone': data.corpus_bleu([pair.vocabulary.decode(o) for o in outputs], references),
        'bleu_sentences': len(sources)}
    print(f"draft {name}: BLEU alone {info[name]['bleu_alone']:.2f}", flush=True)
  return pairs, info


def configurations(drafts: Sequence[str], greedy: Sequence[int],
                   sampling: Sequence[int]) -> List[Key]:
  """The target alone at each temperature in use, then every draft at every gamma."""
  keys = [(None, Setting('baseline', t)) for t, gammas in ((0.0, greedy), (1.0, sampling))
          if gammas]
  keys += [(name, Setting('speculative', t, g)) for name in drafts
           for t, gammas in ((0.0, greedy), (1.0, sampling)) for g in gammas]
  return keys


def batch_block(pairs: Mapping[str, pipeline.Pair], info: Mapping[str, Any], batch_size: int,
                sources: Sequence[str], references: Sequence[str], args: Any,
                keys: Sequence[Key]) -> Dict[str, Any]:
  """Every draft and gamma on the first len(sources) sentences: the block's rows."""
  count, first = len(sources), next(iter(pairs.values()))
  batches = harness.make_batches(data.encode(sources, harness.INPUT_LENGTH), batch_size,
                                 args.input_length_step)
  compiled = {(d, s): harness.compile_setting(s, pairs[d] if d else first, batches)
              for d, s in keys}
  outputs = harness.warm({k: c.one_pass for k, c in compiled.items()})
  times = policy.round_robin({k: c.one_pass for k, c in compiled.items()}, args.rounds)
  target_steps = harness.step_times_ms(first, 'target', batch_size,
                                       harness.verify_sizes([s for _, s in keys]))
  steps = {d: {'target': target_steps,
               'draft': harness.step_times_ms(pairs[d], 'draft', batch_size, (1, 2))}
           for d in pairs}
  base = {s: (None, s) for _, s in keys if s.method == 'baseline'}
  rows = []
  for d, s in keys:
    speedup = harness.speedups(times, base[s.baseline])[d, s]
    run = {**harness.collect(outputs[d, s], count), **compiled[d, s].info(), **speedup,
           'ms_per_sentence': harness.ms_per(times[d, s], count)}
    row = harness.summarize(s, run, harness.collect(outputs[base[s.baseline]], count)['decodes'],
                            steps[d or next(iter(pairs))], info[d]['c_hat'] if d else 0.0,
                            references, first.vocabulary)
    row.pop('totals', None)
    rows.append({'draft': d, **row})
    print(f"batch {batch_size} {d or ''} {row['name']}: {row['ms_per_sentence']:.1f} "
          f"ms/sentence, {row['speedup']:.2f}x ({row['speedup_min']:.2f}-"
          f"{row['speedup_max']:.2f}), alpha {harness.fmt(row.get('alpha'), '.3f')}, "
          f"c {harness.fmt(row.get('c'), '.3f')}, BLEU {row['bleu']:.2f}", flush=True)
  return {'num_sentences': count, 'rows': rows}


def markdown(results: Mapping[str, Any]) -> str:
  lines = harness.heading('Draft models compared', results)
  lines += harness.table(
      ('draft', 'path', 'params', 'c_hat', 'BLEU alone'),
      [[name, d['path'], f"{d['params']:,}", f"{d['c_hat']:.3f}",
        f"{d['bleu_alone']:.2f} ({d['bleu_sentences']} sentences)"]
       for name, d in results['drafts'].items()]) + ['']
  for batch_size, block in results['batches'].items():
    lines += [f"## Batch {batch_size} ({block['num_sentences']} sentences)", '']
    lines += harness.table(
        ('draft', 'configuration', 'ms/sentence', 'speedup', 'range over rounds', 'alpha', 'c',
         'BLEU', 'same as greedy'),
        [[r['draft'] or '', r['name'], f"{r['ms_per_sentence']:.1f}", f"{r['speedup']:.2f}x",
          f"{r['speedup_min']:.2f}-{r['speedup_max']:.2f}", harness.fmt(r.get('alpha'), '.3f'),
          harness.fmt(r.get('c'), '.3f'), f"{r['bleu']:.2f}",
          f"{r['same_as_baseline']:.0%}" if r['temperature'] == 0 else '']
         for r in block['rows']]) + ['']
  return '\n'.join(lines)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
  args, drafts = parse_args(argv)
  sizes = harness.parse_sentences(args.sentences)
  keys = configurations(list(drafts), harness.parse_gammas(args.gammas, auto=False),
                        harness.parse_gammas(args.sampling_gammas, False, '--sampling_gammas'))
  sources, references = harness.test_split(args.data_dir)
  bleu_count = args.bleu_sentences or len(sources)
  pairs, info = load_drafts(args.target, drafts, sources[:bleu_count], references[:bleu_count])
  results = {'meta': harness.meta(NAME, argv, args, target=harness.repo_path(args.target)),
             'drafts': info, 'batches': {}}
  for batch_size, count in sizes.items():
    count = min(count, len(sources))
    results['batches'][str(batch_size)] = batch_block(
        pairs, info, batch_size, sources[:count], references[:count], args, keys)
    paths = harness.write_results(args, NAME, results, markdown)
  print('wrote', *paths)
  return results


if __name__ == '__main__':
  main()
