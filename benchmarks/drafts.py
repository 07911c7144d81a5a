"""How good a draft is for one target: alpha and tokens per call by split, temperature and gamma.

  python -m benchmarks.drafts \
      --drafts shipped=speculative_t5x/pretrained/multi30k_de_en_draft.msgpack,new=runs/a.msgpack \
      --gammas 1,2,3,4,5 --temperatures 0,0.7,1
  python -m benchmarks.drafts --drafts new=runs/a.msgpack --temperatures '' \
      --sentences 1:80,8:160 --gammas 1,2,3 --sampling_gammas 1 --rounds 5      # speed only

Per draft: its own greedy BLEU on test_2016_flickr (the draft alone; the first
--bleu_sentences, 0: all), its parameters and c_hat (FLOPs per token relative to the target).

Acceptance, hardware-free (--temperatures '': none): per (split, temperature, gamma) one
speculative pass (token verification, batch --batch_size, the same seeds for every draft):
alpha = accepted / (accepted + rejections) and emitted tokens per target call. Splits:
test_2016_flickr, the validation split (the first --max_sentences of each, 0: all) and the
--longest test captions with the longest inputs; the --gammas sweep runs on the test split at
--sweep_temperature, every other (split, temperature) at the largest gamma only.

Speed (with --sentences): per batch size and draft, `benchmarks.speed`'s block (--gammas
greedy, --sampling_gammas at T=1), each speedup a ratio within the draft's own rounds: compare
drafts by it. Writes drafts.json and drafts.md.
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from benchmarks import harness
from benchmarks import speed
from benchmarks.harness import Setting
from speculative_t5x import data
from speculative_t5x import evaluation
from speculative_t5x import pipeline

NAME = 'drafts'


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  p = harness.parser(__doc__, sentences='', gammas='1,2,3,4,5', rounds=5,
                     needs=[harness.BLEU])
  p.add_argument('--drafts', default=f'shipped={pipeline.EMBEDDED_DRAFT}',
                 help='name=weights_file pairs, comma-separated')
  p.add_argument('--target', default=str(pipeline.EMBEDDED_TARGET))
  p.add_argument('--temperatures', default='0,0.7,1',
                 help="sampling temperatures of the acceptance part ('': no acceptance part)")
  p.add_argument('--sweep_temperature', type=float, default=1.0,
                 help='the temperature of the --gammas sweep (the others run the largest gamma)')
  p.add_argument('--batch_size', type=int, default=32, help='batch size of the acceptance part')
  p.add_argument('--longest', type=int, default=100,
                 help='test captions with the longest inputs, as a split of their own')
  p.add_argument('--max_sentences', type=int, default=0,
                 help='the first N captions of the test and validation splits (0: all)')
  p.add_argument('--sampling_gammas', default='1',
                 help='speed part: gammas at temperature 1 (empty: none)')
  p.add_argument('--bleu_sentences', type=int, default=0,
                 help="test sentences for each draft's own BLEU (0: all)")
  args = p.parse_args(argv)
  try:
    args.draft_paths = dict(pair.split('=', 1) for pair in args.drafts.split(','))
    args.temperature_list = [float(t) for t in args.temperatures.split(',') if t]
  except ValueError:
    raise SystemExit(f'error: --drafts wants name=path pairs, --temperatures numbers like '
                     f'0,0.7,1; got {args.drafts!r}, {args.temperatures!r}') from None
  args.gamma_list = harness.parse_ints(args.gammas, '--gammas')
  args.sampling_gamma_list = harness.parse_ints(args.sampling_gammas, '--sampling_gammas')
  if not args.gamma_list:
    raise SystemExit('error: --gammas must name at least one gamma')
  return args


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
    reads = None if pair.draft_config.has_encoder else (pair.target_config, pair.params['target'])
    outputs = None if pair.draft_config.feature_width else evaluation.translate(  # (no features)
        pair.draft_config, pair.params['draft'], data.encode(sources, harness.INPUT_LENGTH),
        harness.INPUT_LENGTH, harness.OUTPUT_LENGTH, encoder=reads)
    info[name] = {
        'path': harness.repo_path(path), 'params': harness.param_count(pair.params['draft']),
        'c_hat': (pair.draft_config.decode_flops_per_token() /
                  pair.target_config.decode_flops_per_token()),
        'bleu_alone': outputs and data.corpus_bleu([pair.vocabulary.decode(o) for o in outputs],
                                                   references), 'bleu_sentences': len(sources)}
    print(f"draft {name}: BLEU alone {harness.fmt(info[name]['bleu_alone'], '.2f')}", flush=True)
  return pairs, info


def splits(data_dir: Optional[str], longest: int, max_sentences: int) -> Dict[str, List[str]]:
  """{split name: German sources}: test, validation (the first max_sentences, 0: all) and the
  longest inputs of the whole test split."""
  test, _ = harness.test_split(data_dir)
  validation, _ = data.load_split('validation', data_dir=data_dir)
  lengths = [len(ids) for ids in data.encode(test, harness.INPUT_LENGTH)]
  order = sorted(range(len(test)), key=lambda i: -lengths[i])[:longest]
  first = slice(None, max_sentences or None)
  return {'test': test[first], 'validation': validation[first],
          f'test, {longest} longest inputs': [test[i] for i in sorted(order)]}


def acceptance_rows(pair: pipeline.Pair, sources: Mapping[str, Sequence[str]],
                    args: argparse.Namespace) -> List[Dict[str, Any]]:
  """One row per (split, temperature, gamma) of one draft (`harness.count_acceptance`)."""
  rows = []
  for split, texts in sources.items():
    for temperature in args.temperature_list:
      sweep = split == 'test' and temperature == args.sweep_temperature
      settings = [Setting('speculative', temperature, g, verification='token')
                  for g in (args.gamma_list if sweep else args.gamma_list[-1:])]
      rows += [{'split': split, 'sentences': len(texts), **row}
               for row in harness.count_acceptance(pair, texts, settings, args.batch_size)]
  return rows


def markdown(results: Mapping[str, Any]) -> str:
  lines = harness.heading('Draft models compared', results)
  lines += harness.table(
      ('draft', 'path', 'params', 'c_hat', 'BLEU alone'),
      [[name, d['path'], f"{d['params']:,}", f"{d['c_hat']:.3f}",
        'reads its target' if d['bleu_alone'] is None else
        f"{d['bleu_alone']:.2f} ({d['bleu_sentences']} sentences)"]
       for name, d in results['drafts'].items()]) + ['']
  if results.get('acceptance'):
    gammas = results['meta']['gammas']
    lines += ['## Acceptance', '', 'alpha: accepted / (accepted + rejections), the probability '
              'that a reached draft token is kept; tokens/call: emitted tokens per target call '
              '(token verification).', '']
    table = []
    for name, rows in results['acceptance'].items():
      groups: Dict[Tuple[str, float], Dict[int, Mapping[str, Any]]] = {}
      for r in rows:
        groups.setdefault((r['split'], r['temperature']), {})[r['gamma']] = r
      for (split, temperature), by_gamma in groups.items():
        last = by_gamma[max(by_gamma)]
        table.append([name, f"{split} ({last['sentences']})", f'{temperature:g}',
                      f"{last['alpha']:.3f}"] + [f"{by_gamma[g]['tokens_per_call']:.3f}"
                                                 if g in by_gamma else '' for g in gammas])
    lines += harness.table(['draft', 'split', 'T', 'alpha'] +
                           [f'tokens/call gamma={g}' for g in gammas], table) + ['']
  for batch_size, block in results['batches'].items():
    lines += [f"## Speed at batch {batch_size} ({block['num_sentences']} sentences)", '']
    lines += harness.table(
        ('draft', 'configuration', 'ms/sentence', 'speedup', 'range over rounds', 'alpha', 'c',
         'BLEU', 'same as greedy'),
        [[r['draft'], r['name'], f"{r['ms_per_sentence']:.1f}", f"{r['speedup']:.2f}x",
          f"{r['speedup_min']:.2f}-{r['speedup_max']:.2f}", harness.fmt(r.get('alpha'), '.3f'),
          harness.fmt(r.get('c'), '.3f'), f"{r['bleu']:.2f}",
          f"{r['same_as_baseline']:.0%}" if r['temperature'] == 0 else '']
         for r in block['rows']]) + ['']
  return '\n'.join(lines)


def speed_block(pairs: Mapping[str, pipeline.Pair], info: Mapping[str, Any], batch_size: int,
                sources: Sequence[str], references: Sequence[str],
                args: argparse.Namespace) -> Dict[str, Any]:
  """`speed.batch_block` of every draft at one batch size, its rows named by their draft."""
  settings = speed.grid(args.gamma_list, args.sampling_gamma_list, (), False, ())
  rows = []
  for name, pair in pairs.items():
    block = speed.batch_block(pair, settings, batch_size, sources, references, args,
                              info[name]['c_hat'])
    rows += [{'draft': name, **{k: v for k, v in r.items() if k != 'totals'}}
             for r in block['rows']]
  return {'num_sentences': len(sources), 'rows': rows}


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
  args = parse_args(argv)
  sources, references = harness.test_split(args.data_dir)
  bleu_count = args.bleu_sentences or len(sources)
  pairs, info = load_drafts(args.target, args.draft_paths, sources[:bleu_count],
                            references[:bleu_count])
  results = {'meta': harness.meta(NAME, argv, args, target=harness.repo_path(args.target),
                                  gammas=args.gamma_list),
             'drafts': info, 'acceptance': {}, 'batches': {}}
  write = lambda: harness.write_results(args, NAME, results, markdown)
  paths = write()
  if args.temperature_list:
    texts = splits(args.data_dir, args.longest, args.max_sentences)
    for name, pair in pairs.items():
      results['acceptance'][name] = acceptance_rows(pair, texts, args)
      paths = write()
  for batch_size, count in harness.parse_sentences(args.sentences).items():
    count = min(count, len(sources))
    results['batches'][str(batch_size)] = speed_block(
        pairs, info, batch_size, sources[:count], references[:count], args)
    paths = write()
  print('wrote', *paths)
  return results


if __name__ == '__main__':
  main()
