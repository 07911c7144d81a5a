"""How well drafts agree with the target: alpha and tokens per call, by temperature and split.

  python -m benchmarks.draft_acceptance \
      --drafts shipped=speculative_t5x/pretrained/multi30k_de_en_draft.msgpack,new=runs/a.msgpack \
      --gammas 1,2,3,4,5 --temperatures 0,0.7,1

Hardware-free counts only (no timing): per draft, its own greedy BLEU on the test split, and
per (split, temperature, gamma) one speculative pass (token verification, batch --batch_size,
the same seeds for every draft) with alpha = accepted / (accepted + rejections) (the paper's,
independent of gamma) and emitted tokens per target call. Splits: the whole test split
(test_2016_flickr), the validation split, and the --longest test captions with the longest
inputs (difficulty); the --gammas sweep runs on the test split at --sweep_temperature, every
other (split, temperature) at the largest gamma only.

Writes draft_acceptance.json (after every draft) and draft_acceptance.md.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from benchmarks import drafts as drafts_lib
from benchmarks import harness
from benchmarks.harness import Setting
from speculative_t5x import data
from speculative_t5x import pipeline

NAME = 'draft_acceptance'


def parse_args(argv: Optional[Sequence[str]]) -> Tuple[Any, Dict[str, str]]:
  p = harness.parser(__doc__, sentences='32:1000', gammas='1,2,3,4,5', rounds=1,
                     needs=[harness.BLEU])
  drafts_lib.add_pair_flags(p)
  p.add_argument('--temperatures', default='0,0.7,1', help='sampling temperatures')
  p.add_argument('--sweep_temperature', type=float, default=1.0,
                 help='the temperature of the --gammas sweep (the others run the largest gamma)')
  p.add_argument('--batch_size', type=int, default=32)
  p.add_argument('--longest', type=int, default=100,
                 help='test captions with the longest inputs, as a split of their own')
  p.add_argument('--max_sentences', type=int, default=0,
                 help='the first N captions of the test and validation splits (0: all)')
  args = p.parse_args(argv)
  drafts = drafts_lib.parse_drafts(args.drafts)
  try:
    args.temperature_list = [float(t) for t in args.temperatures.split(',') if t]
  except ValueError:
    raise SystemExit(f'error: --temperatures wants numbers like 0,0.7,1, got '
                     f'{args.temperatures!r}') from None
  args.gamma_list = harness.parse_ints(args.gammas, '--gammas')
  if not args.gamma_list or not args.temperature_list:
    raise SystemExit('error: --gammas and --temperatures must each name at least one value')
  return args, drafts


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


def draft_rows(pair: pipeline.Pair, sources: Mapping[str, Sequence[str]],
               temperatures: Sequence[float], gammas: Sequence[int], sweep_temperature: float,
               batch_size: int) -> List[Dict[str, Any]]:
  """One row per (split, temperature, gamma) of one draft."""
  rows = []
  for split, texts in sources.items():
    batches = harness.make_batches(data.encode(texts, harness.INPUT_LENGTH), batch_size,
                                   width=harness.INPUT_LENGTH)
    for temperature in temperatures:
      sweep = split == 'test' and temperature == sweep_temperature
      for gamma in (gammas if sweep else gammas[-1:]):
        setting = Setting('speculative', temperature, gamma, verification='token')
        run = harness.collect(harness.compile_setting(setting, pair, batches).one_pass(),
                              len(texts))
        counts = harness.acceptance(run['stats'])
        rows.append({'split': split, 'sentences': len(texts), 'temperature': temperature,
                     'gamma': gamma, 'alpha': counts['alpha'],
                     'tokens_per_call': counts['tokens_per_call']})
        print(f"{split} T={temperature:g} gamma={gamma}: alpha {counts['alpha']:.3f}, "
              f"{counts['tokens_per_call']:.3f} tokens per call", flush=True)
  return rows


def markdown(results: Mapping[str, Any]) -> str:
  lines = harness.heading(f"Draft acceptance: {results['meta']['description']}", results)
  lines += ['alpha: accepted / (accepted + rejections), the probability that a reached draft '
            'token is kept; tokens/call: emitted tokens per target call (token verification).',
            '']
  lines += harness.table(('draft', 'params', 'BLEU alone (test)'), [
      [name, f"{d['info']['params'] / 1e6:.2f}M", f"{d['info']['bleu_alone']:.2f}"]
      for name, d in results['drafts'].items()]) + ['']
  gammas = results['meta']['gammas']
  header = ['draft', 'split', 'T', 'alpha'] + [f'tokens/call gamma={g}' for g in gammas]
  table = []
  for name, d in results['drafts'].items():
    groups: Dict[Tuple[str, float], Dict[int, Mapping[str, Any]]] = {}
    for r in d['rows']:
      groups.setdefault((r['split'], r['temperature']), {})[r['gamma']] = r
    for (split, temperature), by_gamma in groups.items():
      alpha = by_gamma[max(by_gamma)]['alpha']
      table.append([name, f"{split} ({next(iter(by_gamma.values()))['sentences']})",
                    f'{temperature:g}', f'{alpha:.3f}'] +
                   [f"{by_gamma[g]['tokens_per_call']:.3f}" if g in by_gamma else ''
                    for g in gammas])
  return '\n'.join(lines + harness.table(header, table)) + '\n'


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
  args, drafts = parse_args(argv)
  sources = splits(args.data_dir, args.longest, args.max_sentences)
  references = harness.test_split(args.data_dir)[1][:len(sources['test'])]
  pairs, info = drafts_lib.load_drafts(args.target, drafts, sources['test'], references)
  results = {'meta': harness.meta(NAME, argv, args, description='embedded Multi30k target',
                                  gammas=args.gamma_list), 'drafts': {}}
  for name, pair in pairs.items():
    rows = draft_rows(pair, sources, args.temperature_list, args.gamma_list,
                      args.sweep_temperature, args.batch_size)
    results['drafts'][name] = {'info': info[name], 'rows': rows}
    paths = harness.write_results(args, NAME, results, markdown)
  print('wrote', *paths)
  return results


if __name__ == '__main__':
  main()
