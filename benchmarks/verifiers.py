"""Verifiers that keep more of a draft: token vs block verification, chains vs token trees.

  python -m benchmarks.verifiers --count_sentences 1000 --gammas 1,2,3,4,5 \
      --trees '2;3;4;2,1;3,1;4,1;2,2;3,1,1;2,1,1,1' \
      --sentences 1:64,8:192,32:320 --speed_gammas 1,2 --speed_trees '2;3,1' --rounds 3

Acceptance (hardware-free): the first --count_sentences test captions decoded once per
(sampling setting, gamma, verification) at batch --count_batch, the same seeds for both
verifiers (their draft tokens agree until the first call whose verdicts differ). Per row: alpha
(accepted / (accepted + rejections)), accepted draft tokens and emitted tokens per target call.
Settings: T=1, T=0.7 and T=1 with top-p 0.9. Token trees (`trees.tree_speculative_sample`,
--trees, ';' between shapes) at T=1, against the chain of the same depth and the chain
of as many verified rows (tree nodes = gamma + 1).

Greedy identity: the first --greedy_sentences test captions decoded by the target alone at
T=0 and by block verification (each of --greedy_gammas) and token trees (each of
--greedy_trees) at a [batch] temperature operand of zeros (the sampled loops' greedy rows: a
tree's children there are the one-hot draft's argmax, then untried tokens), and the trees again
at a static temperature 0 (children: the draft's top-k); the fraction of outputs
token-identical to the target's, and tokens per call.

Speed: for each --sentences pair, target-only sampling at T=1 against speculative sampling at
each --speed_gammas with both verifiers and the --speed_trees, timed round-robin as `benchmarks.speed` times them
(its `batch_block`). On this CPU a verify call over more than ~9 rows (batch x (gamma + 1)) is
arithmetic-bound; the table says which rows are.

Verdict cost: for each --verdict_batches size and --verdict_gammas gamma, the ms of token and of
block verification's verdict alone (distributions of the embedded vocabulary's width in, the
number accepted and the next token out), many verdicts in one compiled loop so that no
dispatch is counted: what block verification adds to a loop iteration, beside the ms per
target call of the speed part; and the bytes one compiled verdict accesses at
--verdict_bytes_vocab (XLA's cost analysis): what it adds where a step is bound by reading memory.

Writes verifiers.json (after every part) and verifiers.md.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import compiled
from benchmarks import harness
from benchmarks import speed
from benchmarks.harness import Setting
from speculative_t5x import data
from speculative_t5x import decoding
from speculative_t5x import pipeline
from speculative_t5x import policy
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
  p.add_argument('--greedy_sentences', type=int, default=1000,
                 help='test captions of the greedy identity check (0: skip it)')
  p.add_argument('--greedy_gammas', default='2,4',
                 help='gammas of block verification in the greedy identity check')
  p.add_argument('--greedy_trees', default='2,1,1;3,1',
                 help="tree shapes of the greedy identity check, ';' between shapes")
  p.add_argument('--speed_gammas', default='1,2',
                 help='gammas timed against target-only sampling (empty: none)')
  p.add_argument('--speed_trees', default='2;3,1', help="tree shapes timed (empty: none)")
  p.add_argument('--verdict_batches', default='',
                 help='batch sizes of the verdict cost part (empty: none)')
  p.add_argument('--verdict_gammas', default='',
                 help='gammas of the verdict cost part (empty: --speed_gammas)')
  p.add_argument('--verdict_bytes_vocab', type=int, default=0,
                 help="vocabulary of the verdicts whose bytes are counted (0: the pair's; "
                      "T5's is 32128)")
  p.add_argument('--target', default=str(pipeline.EMBEDDED_TARGET))
  p.add_argument('--draft', default=str(pipeline.EMBEDDED_DRAFT))
  args = p.parse_args(argv)
  args.gamma_list = harness.parse_ints(args.gammas, '--gammas')
  args.speed_gamma_list = harness.parse_ints(args.speed_gammas, '--speed_gammas')
  args.tree_list = parse_trees(args.trees, '--trees')
  args.greedy_gamma_list = harness.parse_ints(args.greedy_gammas, '--greedy_gammas')
  args.greedy_tree_list = parse_trees(args.greedy_trees, '--greedy_trees')
  try:
    args.sampling_list = [tuple(float(v) for v in pair.split(':'))
                          for pair in args.sampling.split(',') if pair]
    assert all(len(pair) == 2 for pair in args.sampling_list)
  except (ValueError, AssertionError):
    raise SystemExit(f"error: --sampling wants temperature:top-p pairs like 1:0,1:0.9, got "
                     f"{args.sampling!r}") from None
  args.speed_tree_list = parse_trees(args.speed_trees, '--speed_trees')
  args.verdict_batch_list = harness.parse_ints(args.verdict_batches, '--verdict_batches')
  args.verdict_gamma_list = (harness.parse_ints(args.verdict_gammas, '--verdict_gammas') or
                             args.speed_gamma_list)
  # benchmarks.speed.batch_block's flags: no HF rows and no calibration here; each pass draws
  # its own samples, as the speed command's default.
  args.hf, args.hf_gammas, args.hf_threads, args.calibration = False, '', 1, None
  args.same_samples = False
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


def acceptance_grid(pair: pipeline.Pair, sources: Sequence[str], settings: Sequence[Setting],
                    batch_size: int, written: Callable[[List[Dict[str, Any]]], Any]
                    ) -> List[Dict[str, Any]]:
  """One row per setting: counts from one pass over `sources` (the same seeds for all);
  `written(rows)` after every row, so that a killed run keeps what it counted."""
  batches = harness.make_batches(data.encode(sources, harness.INPUT_LENGTH), batch_size,
                                 width=harness.INPUT_LENGTH)
  rows = []
  for setting in settings:
    run = harness.collect(harness.compile_setting(setting, pair, batches).one_pass(),
                          len(sources))
    counts = harness.acceptance(run['stats'])
    rows.append({'name': setting.name, **setting._asdict(),
                 **{k: counts[k] for k in ('alpha', 'accepted_per_call', 'tokens_per_call',
                                           'accepted_fraction')}})
    print(f"{setting.name}: alpha {counts['alpha']:.3f}, "
          f"{counts['tokens_per_call']:.3f} tokens per call", flush=True)
    written(rows)
  return rows


def greedy_identity(pair: pipeline.Pair, sources: Sequence[str], batch_size: int,
                    gammas: Sequence[int], tree_shapes: Sequence[str],
                    written: Callable[[List[Dict[str, Any]]], Any]) -> List[Dict[str, Any]]:
  """Per verifier and temperature path: the fraction of `sources` whose output is the target's
  greedy output, token for token (module docstring, "Greedy identity")."""
  batches = harness.make_batches(data.encode(sources, harness.INPUT_LENGTH), batch_size,
                                 width=harness.INPUT_LENGTH)
  decode = lambda setting, overrides=None: harness.collect(harness.compile_setting(
      setting, pair, batches, decode_overrides=overrides).one_pass(), len(sources))
  greedy = decode(Setting('baseline', 0.0))['decodes']
  zeros = {'temperature': np.zeros(batch_size, np.float32)}
  rows = []
  runs = ([(Setting('speculative', 0.0, g, verification='block'), 'operand') for g in gammas] +
          [(Setting('tree', 0.0, branching=b), path) for path in ('operand', 'static')
           for b in tree_shapes])
  for setting, path in runs:
    run = decode(setting, zeros if path == 'operand' else None)
    rows.append({'name': setting.name, **setting._asdict(), 'temperature_path': path,
                 'identical': float(np.mean(np.all(run['decodes'] == greedy, axis=1))),
                 'tokens_per_call': harness.acceptance(run['stats'])['tokens_per_call']})
    print(f"{setting.name} ({path} 0): {rows[-1]['identical']:.1%} identical to the target's "
          'greedy', flush=True)
    written(rows)
  return rows


def speed_settings(gammas: Sequence[int], tree_shapes: Sequence[str]) -> List[Setting]:
  return ([Setting('baseline', 1.0)] +
          [Setting('speculative', 1.0, g, verification=v) for g in gammas
           for v in decoding.VERIFICATIONS] +
          [Setting('tree', 1.0, branching=b) for b in tree_shapes])


VERDICTS_PER_CALL = 32


def _verdict(batch: int, gamma: int, verification: str) -> Callable[..., Any]:
  """One sampled verdict at T=1, as the loop calls it: (target logits [batch, gamma + 1, vocab],
  draft distributions [batch, gamma, vocab], proposals [batch, gamma], key) -> (number
  accepted, next token) [batch] each."""
  cfg = decoding._LoopConfig(  # the loop's own verdict, as _draft_verify_loop calls it
      gamma=gamma, rule=decoding.speculative_rule(), temperature=1.0, topk=0, topp=0.0,
      rescale_log_probs=True, confidence_threshold=0.0, adaptive_gamma=False, eos_id=1,
      block=verification == 'block')
  full = jnp.full((batch,), gamma, jnp.int32)

  def verdict(logits, q, tokens, rng):
    draft = decoding.Draft(tokens, q, full, jnp.ones((batch,), bool), full,
                           jnp.zeros((batch,), bool))
    accept_rng, extra_rng = jax.random.split(rng)
    out = decoding._verify_sampled(cfg, logits, jnp.zeros((batch, gamma + 1), jnp.int32), draft,
                                   accept_rng, extra_rng)
    return out.num_accepted, out.extra
  return verdict


def _verdicts(batch: int, gamma: int, vocab: int, verification: str) -> Callable[[], Any]:
  """VERDICTS_PER_CALL verdicts of one verifier over random target and draft distributions,
  compiled as one loop (each depends on the last)."""
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  logits = 3.0 * jax.random.normal(keys[0], (batch, gamma + 1, vocab))
  q = jax.nn.softmax(logits[:, :gamma] + jax.random.normal(keys[1], (batch, gamma, vocab)), -1)
  tokens = jax.random.randint(keys[2], (batch, gamma), 0, vocab)
  verdict = _verdict(batch, gamma, verification)

  @jax.jit
  def run(logits, rng):
    def body(i, carry):
      accepted, extra = verdict(logits + 1e-9 * carry[:, None, None], q, tokens,
                                jax.random.fold_in(rng, i))
      return carry + accepted + extra
    return jax.lax.fori_loop(0, VERDICTS_PER_CALL, body, jnp.zeros((batch,), jnp.int32))

  return lambda: run(logits, keys[0])


def verdict_bytes(batch: int, gamma: int, vocab: int, verification: str) -> float:
  """Bytes one compiled verdict accesses (XLA's cost analysis): what it adds to a call where a
  step is bound by reading memory."""
  shapes = (jax.ShapeDtypeStruct((batch, gamma + 1, vocab), jnp.float32),
            jax.ShapeDtypeStruct((batch, gamma, vocab), jnp.float32),
            jax.ShapeDtypeStruct((batch, gamma), jnp.int32), jax.random.PRNGKey(0))
  return compiled.cost(jax.jit(_verdict(batch, gamma, verification)).lower(*shapes).compile()
                       )['bytes_accessed']


def verdict_costs(batch_sizes: Sequence[int], gammas: Sequence[int], vocab: int,
                  rounds: int, bytes_vocab: int = 0) -> List[Dict[str, Any]]:
  """Per (batch, gamma): ms of one verdict of each verifier (module docstring), round-robin,
  and the bytes each accesses at `bytes_vocab` (0: `vocab`)."""
  rows = []
  for batch in batch_sizes:
    for gamma in gammas:
      passes = {v: _verdicts(batch, gamma, vocab, v) for v in decoding.VERIFICATIONS}
      times = policy.round_robin(passes, rounds + 1)  # the first round compiles
      ms = {v: 1e3 * float(np.median(t[1:])) / VERDICTS_PER_CALL for v, t in times.items()}
      rows.append({'batch': batch, 'gamma': gamma, **{f'{v}_ms': ms[v] for v in ms},
                   'block_extra_ms': ms['block'] - ms['token'],
                   **{f'{v}_bytes': verdict_bytes(batch, gamma, bytes_vocab or vocab, v)
                      for v in decoding.VERIFICATIONS}})
      print(f"verdict at batch {batch}, gamma {gamma}: token {ms['token']:.3f} ms, block "
            f"{ms['block']:.3f} ms", flush=True)
  return rows


def verify_rows(setting: Mapping[str, Any]) -> int:
  """Tokens a verify call scores per row: gamma + 1, or the tree's nodes (0: target alone)."""
  if setting['method'] == 'tree':
    return trees.token_tree([int(b) for b in setting['branching'].split(',')]).nodes
  return int(setting['gamma']) + 1 if setting['method'] == 'speculative' else 0


def markdown(results: Mapping[str, Any]) -> str:
  lines = harness.heading(f"Verifiers: {results['meta']['description']}", results)
  rows = results.get('acceptance', [])
  if rows:
    lines += [f"## Acceptance ({results['meta']['count_sentences']} test captions, batch "
              f"{results['meta']['count_batch']})", '',
              'alpha: accepted / (accepted + rejections); block / token: tokens per call of '
              'block verification over token verification of the same setting.', '']
    by_key = {(r['temperature'], r['topp'], r['gamma'], r['verification']): r for r in rows}
    table = []
    for (t, topp, g, v), r in by_key.items():
      if v != 'token' or (t, topp, g, 'block') not in by_key:
        continue
      b = by_key[(t, topp, g, 'block')]
      table.append([f'T={t:g}' + (f' top-p={topp:g}' if topp else ''), str(g),
                    f"{r['alpha']:.3f}", f"{b['alpha']:.3f}", f"{r['tokens_per_call']:.3f}",
                    f"{b['tokens_per_call']:.3f}",
                    f"{b['tokens_per_call'] / r['tokens_per_call']:.3f}"])
    lines += harness.table(('sampling', 'gamma', 'alpha token', 'alpha block',
                            'tokens/call token', 'tokens/call block', 'block / token'), table)
    lines += ['', 'Token trees against chains (token verification) of the same setting: '
              'tokens per call over the chain of the same depth and over the chain that '
              'verifies as many rows (nodes = gamma + 1).', '']
    table = []
    for r in rows:
      if r['method'] != 'tree':
        continue
      depth, nodes = len(r['branching'].split(',')), verify_rows(r)
      chain = lambda g: by_key.get((r['temperature'], r['topp'], g, 'token'))
      ratio = lambda c: f"{r['tokens_per_call'] / c['tokens_per_call']:.3f}" if c else ''
      table.append([f"T={r['temperature']:g}" + (f" top-p={r['topp']:g}" if r['topp'] else ''),
                    f"({r['branching']})", str(depth), str(nodes), f"{r['alpha']:.3f}",
                    f"{r['tokens_per_call']:.3f}",
                    f"{r['tokens_per_call'] / nodes:.3f}", ratio(chain(depth)),
                    ratio(chain(nodes - 1))])
    lines += harness.table(('sampling', 'tree', 'depth', 'nodes', 'alpha', 'tokens/call',
                            'tokens/call per row', 'vs chain, same depth',
                            'vs chain, same rows'), table) + ['']
  if results.get('greedy'):
    lines += [f"## Greedy identity ({results['meta']['greedy_sentences']} test captions, "
              f"batch {results['meta']['count_batch']})", '']
    lines += harness.table(
        ('verifier', 'temperature 0 as', 'identical to the target greedy', 'tokens/call'), [
            [r['name'], {'operand': 'a [batch] operand', 'static': 'static'}[
                r.get('temperature_path', 'operand')], f"{r['identical']:.1%}",
             f"{r['tokens_per_call']:.3f}"] for r in results['greedy']]) + ['']
  for batch_size, block in results.get('batches', {}).items():
    lines += [f"## Speed at batch {batch_size} ({block['num_sentences']} sentences, T=1; "
              f"median of {results['meta']['rounds']} interleaved rounds)", '',
              'Each configuration samples its own outputs: per output token, their lengths '
              '(a few % apart) do not count as speed. ms/target call: a loop iteration (draft '
              'phase, verify call, verdict), what two verifiers of the same gamma compare on.',
              '']
    table = []
    for r in block['rows']:
      rows_per_call = int(batch_size) * verify_rows(r)
      regime = ('arithmetic-bound' if rows_per_call > ARITHMETIC_BOUND_ROWS else
                'bandwidth-bound') if rows_per_call else ''
      table.append([r['name'], f"{r['ms_per_sentence']:.1f}", f"{r['speedup']:.2f}x",
                    f"{r['speedup_min']:.2f}-{r['speedup_max']:.2f}",
                    harness.fmt(r.get('speedup_per_token'), '.3f'),
                    harness.fmt(r.get('ms_per_call'), '.2f'), harness.fmt(r.get('alpha'), '.3f'),
                    harness.fmt(r.get('tokens_per_call'), '.2f'),
                    str(rows_per_call or ''), regime])
    lines += harness.table(('configuration', 'ms/sentence', 'speedup', 'range',
                            'speedup per output token', 'ms/target call', 'alpha',
                            'tokens/call', 'verify rows', 'regime on this CPU'), table) + ['']
  if results.get('verdicts'):
    lines += verdict_table(results)
  return '\n'.join(lines)


def verdict_table(results: Mapping[str, Any]) -> List[str]:
  """The verdict costs, each beside the ms per target call of the same batch and gamma's
  token-verification loop when the speed part measured it."""
  calls = {(int(b), r['gamma']): r['ms_per_call'] for b, block in results['batches'].items()
           for r in block['rows'] if r.get('verification') == 'token' and 'ms_per_call' in r}
  lines = [f"## Verdict cost (T=1, vocabulary {results['meta']['vocab']}; median of "
           f"{results['meta']['rounds']} rounds of {VERDICTS_PER_CALL} verdicts in one "
           "compiled loop)", '']
  table = []
  for r in results['verdicts']:
    call = calls.get((r['batch'], r['gamma']))
    share = f"{r['block_extra_ms'] / call:.2%}" if call else ''
    mb = lambda v: harness.fmt(r.get(f'{v}_bytes', 0) / 1e6 or None, '.1f')
    table.append([str(r['batch']), str(r['gamma']), f"{r['token_ms']:.3f}",
                  f"{r['block_ms']:.3f}", f"{r['block_extra_ms']:+.3f}",
                  harness.fmt(call, '.2f'), share, mb('token'), mb('block')])
  vocab = results['meta'].get('verdict_bytes_vocab', results['meta']['vocab'])
  return lines + harness.table(('batch', 'gamma', 'token verdict ms', 'block verdict ms',
                                'block extra ms', 'ms/target call (token loop)',
                                'extra / call', f'token MB (vocabulary {vocab})',
                                f'block MB (vocabulary {vocab})'), table) + ['']


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
  args = parse_args(argv)
  sources, references = harness.test_split(args.data_dir)
  pair = harness.load_pair(args.target, args.draft)
  flops = {name: config.decode_flops_per_token() for name, config in pair.configs.items()}
  results = {'meta': harness.meta(NAME, argv, args, description='chains (token and block '
                                  'verification) and token trees, embedded Multi30k pair, '
                                  'test_2016_flickr',
                                  count_sentences=args.count_sentences,
                                  count_batch=args.count_batch,
                                  greedy_sentences=args.greedy_sentences,
                                  vocab=pair.configs['target'].vocab_size), 'batches': {}}

  def written(part):
    def write(rows):
      results[part] = rows
      return harness.write_results(args, NAME, results, markdown)
    return write

  paths = []
  if args.count_sentences:
    acceptance_grid(pair, sources[:args.count_sentences],
                    grid_settings(args.sampling_list, args.gamma_list, args.tree_list),
                    args.count_batch, written('acceptance'))
    paths = harness.write_results(args, NAME, results, markdown)
  if args.greedy_sentences:
    greedy_identity(pair, sources[:args.greedy_sentences], args.count_batch,
                    args.greedy_gamma_list, args.greedy_tree_list, written('greedy'))
    paths = harness.write_results(args, NAME, results, markdown)
  if args.speed_gamma_list or args.speed_tree_list:
    settings = speed_settings(args.speed_gamma_list, args.speed_tree_list)
    for batch_size, count in harness.parse_sentences(args.sentences).items():
      count = min(count, len(sources))
      results['batches'][str(batch_size)] = speed.batch_block(
          pair, settings, batch_size, sources[:count], references[:count], args,
          flops['draft'] / flops['target'])
      paths = harness.write_results(args, NAME, results, markdown)
  if args.verdict_batch_list:
    results['verdicts'] = verdict_costs(args.verdict_batch_list, args.verdict_gamma_list,
                                        pair.configs['target'].vocab_size, args.rounds,
                                        args.verdict_bytes_vocab)
    results['meta']['verdict_bytes_vocab'] = (args.verdict_bytes_vocab or
                                              pair.configs['target'].vocab_size)
    paths = harness.write_results(args, NAME, results, markdown)
  print('wrote', *paths)
  return results


if __name__ == '__main__':
  main()
