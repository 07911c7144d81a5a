"""Verifiers that keep more of a draft: token vs block verification, chains vs token trees.

  python -m benchmarks.verifiers --count_sentences 1000 --gammas 1,2,3,4,5 \
      --trees '2;3;4;2,1;3,1;4,1;2,2;3,1,1;2,1,1,1' \
      --sentences 1:64,8:192,32:320 --speed_gammas 1,2 --speed_trees '2;3,1' --rounds 3

Acceptance (hardware-free): the first --count_sentences test captions decoded once per
(sampling setting, gamma, verification) at batch --count_batch, the same seeds for both
verifiers: alpha (accepted / (accepted + rejections)), accepted draft tokens and emitted tokens
per target call, per --sampling setting (T=1, T=0.7, T=1 with top-p 0.9); token trees
(--trees, ';' between shapes) at the first, against the chain of the same depth and the chain
of as many verified rows (tree nodes = gamma + 1).

Speed: per --sentences pair, target-only sampling at T=1 against speculative sampling at each
--speed_gammas with both verifiers and the --speed_trees (`benchmarks.speed`'s `batch_block`);
the table marks the rows whose verify call (batch x (gamma + 1) rows) is arithmetic-bound on
this CPU (more than ~9). Writes verifiers.json and verifiers.md.
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from benchmarks import harness
from benchmarks import speed
from benchmarks.harness import Setting
from speculative_t5x import decoding
from speculative_t5x import pipeline
from speculative_t5x import trees

NAME = 'verifiers'
# Rows per verify call above which this CPU's step is arithmetic-bound (docs/engine.md).
ARITHMETIC_BOUND_ROWS = 9


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  p = harness.parser(__doc__, sentences='1:64,8:192,32:320', gammas='1,2,3,4,5')
  p.add_argument('--count_sentences', type=int, default=1000,
                 help='test captions of the acceptance grid (0: skip it)')
  p.add_argument('--count_batch', type=int, default=32, help='batch size of the acceptance grid')
  p.add_argument('--sampling', default='1:0,0.7:0,1:0.9',
                 help='temperature:top-p settings of the acceptance grid (trees at the first)')
  p.add_argument('--trees', default='2;3;4;2,1;3,1;4,1;2,2;3,1,1;2,1,1,1',
                 help="token tree shapes of the acceptance grid, ';' between shapes")
  p.add_argument('--speed_gammas', default='1,2',
                 help='gammas timed against target-only sampling (empty: none)')
  p.add_argument('--speed_trees', default='2;3,1', help="tree shapes timed (empty: none)")
  p.add_argument('--target', default=str(pipeline.EMBEDDED_TARGET))
  p.add_argument('--draft', default=str(pipeline.EMBEDDED_DRAFT))
  args = p.parse_args(argv)
  args.gamma_list = harness.parse_ints(args.gammas, '--gammas')
  args.speed_gamma_list = harness.parse_ints(args.speed_gammas, '--speed_gammas')
  args.tree_list = parse_trees(args.trees, '--trees')
  args.speed_tree_list = parse_trees(args.speed_trees, '--speed_trees')
  try:
    args.sampling_list = [tuple(float(v) for v in pair.split(':'))
                          for pair in args.sampling.split(',') if pair]
    assert all(len(pair) == 2 for pair in args.sampling_list)
  except (ValueError, AssertionError):
    raise SystemExit(f"error: --sampling wants temperature:top-p pairs like 1:0,1:0.9, got "
                     f"{args.sampling!r}") from None
  return args


def parse_trees(spec: str, flag: str) -> List[str]:
  """'2;3,1' -> ['2', '3,1'] (each shape checked); exits naming `flag` on bad input."""
  shapes = [shape.strip() for shape in spec.split(';') if shape.strip()]
  try:
    for shape in shapes:
      trees.token_tree([int(b) for b in shape.split(',')])
  except ValueError:
    raise SystemExit(f"error: {flag} wants tree shapes like '2;3,1' (children per depth, "
                     f"';' between shapes), got {spec!r}") from None
  return shapes


def grid_settings(sampling: Sequence[Tuple[float, float]], gammas: Sequence[int],
                  tree_shapes: Sequence[str]) -> List[Setting]:
  """The acceptance grid: every (temperature, top-p)'s chains (both verifiers); trees at the
  first (T=1 by default, the setting of the paper's headline)."""
  settings = []
  for temperature, topp in sampling:
    settings += [Setting('speculative', temperature, g, topp=topp, verification=v)
                 for g in gammas for v in decoding.VERIFICATIONS]
    if (temperature, topp) == tuple(sampling[0]):
      settings += [Setting('tree', temperature, topp=topp, branching=b) for b in tree_shapes]
  return settings


def speed_settings(gammas: Sequence[int], tree_shapes: Sequence[str]) -> List[Setting]:
  return ([Setting('baseline', 1.0)] +
          [Setting('speculative', 1.0, g, verification=v) for g in gammas
           for v in decoding.VERIFICATIONS] +
          [Setting('tree', 1.0, branching=b) for b in tree_shapes])


def verify_rows(setting: Mapping[str, Any]) -> int:
  """Tokens a verify call scores per row: gamma + 1, or the tree's nodes (0: target alone)."""
  if setting['method'] == 'tree':
    return trees.token_tree([int(b) for b in setting['branching'].split(',')]).nodes
  return int(setting['gamma']) + 1 if setting['method'] == 'speculative' else 0


def sampling_name(r: Mapping[str, Any]) -> str:
  return f"T={r['temperature']:g}" + (f" top-p={r['topp']:g}" if r['topp'] else '')


def acceptance_lines(results: Mapping[str, Any]) -> List[str]:
  """Block against token verification per (sampling, gamma); trees against chains."""
  rows = results['acceptance']
  by_key = {(r['temperature'], r['topp'], r['gamma'], r['verification']): r for r in rows}
  chains = []
  for (t, topp, g, v), r in by_key.items():
    b = by_key.get((t, topp, g, 'block'))
    if v == 'token' and b:
      chains.append([sampling_name(r), str(g), f"{r['alpha']:.3f}", f"{b['alpha']:.3f}",
                     f"{r['tokens_per_call']:.3f}", f"{b['tokens_per_call']:.3f}",
                     f"{b['tokens_per_call'] / r['tokens_per_call']:.3f}"])
  shapes = []
  for r in rows:
    if r['method'] != 'tree':
      continue
    depth, nodes = len(r['branching'].split(',')), verify_rows(r)
    chain = lambda g: by_key.get((r['temperature'], r['topp'], g, 'token'))
    ratio = lambda c: f"{r['tokens_per_call'] / c['tokens_per_call']:.3f}" if c else ''
    shapes.append([sampling_name(r), f"({r['branching']})", str(depth), str(nodes),
                   f"{r['alpha']:.3f}", f"{r['tokens_per_call']:.3f}",
                   f"{r['tokens_per_call'] / nodes:.3f}", ratio(chain(depth)),
                   ratio(chain(nodes - 1))])
  return ([f"## Acceptance ({results['meta']['count_sentences']} test captions, batch "
           f"{results['meta']['count_batch']})", '',
           'alpha: accepted / (accepted + rejections); block / token: tokens per call of '
           'block verification over token verification of the same setting.', ''] +
          harness.table(('sampling', 'gamma', 'alpha token', 'alpha block', 'tokens/call token',
                         'tokens/call block', 'block / token'), chains) +
          ['', 'Token trees against chains (token verification) of the same setting: tokens '
           'per call over the chain of the same depth and over the chain that verifies as many '
           'rows (nodes = gamma + 1).', ''] +
          harness.table(('sampling', 'tree', 'depth', 'nodes', 'alpha', 'tokens/call',
                         'tokens/call per row', 'vs chain, same depth', 'vs chain, same rows'),
                        shapes) + [''])


def speed_lines(batch_size: str, block: Mapping[str, Any], rounds: int) -> List[str]:
  """One batch size's timed rows, each with its verify rows per call and their regime."""
  table = []
  for r in block['rows']:
    rows_per_call = int(batch_size) * verify_rows(r)
    regime = ('arithmetic-bound' if rows_per_call > ARITHMETIC_BOUND_ROWS else
              'bandwidth-bound') if rows_per_call else ''
    table.append([r['name'], f"{r['ms_per_sentence']:.1f}", f"{r['speedup']:.2f}x",
                  f"{r['speedup_min']:.2f}-{r['speedup_max']:.2f}",
                  harness.fmt(r.get('speedup_per_token'), '.3f'),
                  harness.fmt(r.get('ms_per_call'), '.2f'), harness.fmt(r.get('alpha'), '.3f'),
                  harness.fmt(r.get('tokens_per_call'), '.2f'), str(rows_per_call or ''), regime])
  return ([f"## Speed at batch {batch_size} ({block['num_sentences']} sentences, T=1; median "
           f'of {rounds} interleaved rounds)', '',
           'Each configuration samples its own outputs: per output token, their lengths (a few '
           '% apart) do not count as speed. ms/target call: a loop iteration (draft phase, '
           'verify call, verdict), what two verifiers of the same gamma compare on.', ''] +
          harness.table(('configuration', 'ms/sentence', 'speedup', 'range',
                         'speedup per output token', 'ms/target call', 'alpha', 'tokens/call',
                         'verify rows', 'regime on this CPU'), table) + [''])


def markdown(results: Mapping[str, Any]) -> str:
  lines = harness.heading(f"Verifiers: {results['meta']['description']}", results)
  if results.get('acceptance'):
    lines += acceptance_lines(results)
  for batch_size, block in results.get('batches', {}).items():
    lines += speed_lines(batch_size, block, results['meta']['rounds'])
  return '\n'.join(lines)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
  args = parse_args(argv)
  sources, references = harness.test_split(args.data_dir)
  pair = harness.load_pair(args.target, args.draft)
  flops = {name: config.decode_flops_per_token() for name, config in pair.configs.items()}
  results = {'meta': harness.meta(NAME, argv, args, description='chains (token and block '
                                  'verification) and token trees, embedded Multi30k pair, '
                                  'test_2016_flickr', count_sentences=args.count_sentences,
                                  count_batch=args.count_batch), 'batches': {}}
  write = lambda: harness.write_results(args, NAME, results, markdown)
  paths = []
  if args.count_sentences:
    results['acceptance'] = []
    harness.count_acceptance(
        pair, sources[:args.count_sentences],
        grid_settings(args.sampling_list, args.gamma_list, args.tree_list), args.count_batch,
        lambda rows: (results.update(acceptance=rows), write()))
    paths = write()
  if args.speed_gamma_list or args.speed_tree_list:
    settings = speed_settings(args.speed_gamma_list, args.speed_tree_list)
    for batch_size, count in harness.parse_sentences(args.sentences).items():
      count = min(count, len(sources))
      results['batches'][str(batch_size)] = speed.batch_block(
          pair, settings, batch_size, sources[:count], references[:count], args,
          flops['draft'] / flops['target'])
      paths = write()
  print('wrote', *paths)
  return results


if __name__ == '__main__':
  main()
