"""Speed of the embedded pair: target-only against speculative, BiLD and beam, in one process.

  python -m benchmarks.speed                      # greedy: target-only against gamma 2
  python -m benchmarks.speed --gammas 1,2,3,4,auto --sentences 1:192,8:192,32:192
  python -m benchmarks.speed --sampling_gammas 1,auto --bild 0.4:5 --beams 4:1,4:auto
  python -m benchmarks.speed --dtype bfloat16 --sentences 32:512 --gammas 2,4 --rounds 3

The defaults are a short run (81 s on 2 CPU cores): greedy target-only against speculative
gamma 2, at batch 1 and 8; the runs behind the README's table: scripts/reproduce_results.sh.

Per batch size the same sentences go through the target alone (the baseline), speculative
decoding at each --gammas ('auto' as the infer job runs it), the same at T=1 for
--sampling_gammas, BiLD per --bild pair and beam_search against speculative beam search per
--beams pair, timed round-robin (benchmarks.harness); a sampled pass draws its own samples.
--dtype bfloat16: 'same as greedy' counts rows equal to bfloat16 target-only greedy.

Per configuration: ms per sentence, the speedup over the baseline of its temperature (median
over rounds; per output token too, with a 90% bootstrap interval), BLEU, greedy identity, alpha,
tokens per target call, c, the paper's predicted speedup and efficiency (`harness.predictions`);
beam rows: beam steps and tree nodes per call; per batch size the target's step by tokens per
row against the weight-streaming and compute floors. Writes speed.json and speed.md.
--baseline_policy FILE runs every 'auto' row again under the policy in FILE, in the same rounds.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
import sys
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from benchmarks import harness
from benchmarks.harness import Setting
from speculative_t5x import costs
from speculative_t5x import data
from speculative_t5x import pipeline
from speculative_t5x import policy

NAME = 'speed'
BILD_FALLBACKS = (0.4, 0.6, 0.8)
BILD_ROLLBACKS = (2.0, 3.0, 5.0)


def grid(gammas: Sequence[Any], sampling_gammas: Sequence[Any],
         bild: Sequence[Tuple[float, float]], adaptive: bool,
         beams: Sequence[Tuple[int, str]]) -> List[Setting]:
  """The configurations: baselines, speculative gammas at T=0 and T=1 (and adaptive gamma up to
  the largest fixed one), BiLD (fallback, rollback), beam_search against speculative beam search
  for each (beam, branching)."""
  settings = []
  for temperature, temperature_gammas in ((0.0, gammas), (1.0, sampling_gammas)):
    if not temperature_gammas:
      continue
    settings.append(Setting('baseline', temperature))
    settings += [Setting('speculative', temperature, g) for g in temperature_gammas]
    fixed = [g for g in temperature_gammas if g != policy.AUTO]
    if adaptive and fixed:
      settings.append(Setting('speculative', temperature, max(fixed), adaptive=True))
  if bild and Setting('baseline') not in settings:
    settings.insert(0, Setting('baseline'))
  settings += [Setting('bild', fallback=f, rollback=r) for f, r in bild]
  for beam in sorted({b for b, _ in beams}):
    settings.append(Setting('beam', beam=beam))
    settings += [Setting('speculative_beam', beam=beam, branching=t) for b, t in beams if b == beam]
  return settings


def parse_args(argv: Optional[Sequence[str]]) -> Tuple[Any, List[Setting]]:
  p = harness.parser(__doc__, sentences='1:32,8:64', gammas='2', needs=[harness.BLEU])
  p.add_argument('--sampling_gammas', default='',
                 help='speculative gammas at temperature 1, e.g. 1,2,auto (empty: none)')
  p.add_argument('--bild', default='',
                 help="BiLD fallback:rollback pairs, e.g. 0.4:5,0.6:5 (empty: none; 'grid': "
                      f'fallbacks {BILD_FALLBACKS} x rollbacks {BILD_ROLLBACKS})')
  p.add_argument('--adaptive', action='store_true',
                 help='add adaptive gamma (up to the largest fixed gamma)')
  p.add_argument('--no_adaptive', action='store_false', dest='adaptive',
                 help='no adaptive gamma (the default)')
  p.add_argument('--beams', default='',
                 help='beam:branching pairs for beam_search vs speculative beam search, e.g. '
                      "'4:8,4:4;2' (branching per depth separated by ';'; empty: none)")
  p.add_argument('--calibration', default=None,
                 help="a calibration.json of speculative-t5x-calibrate: gamma='auto' rows at its "
                      "temperature start at its schedule and follow its model (made with "
                      "--beam_size: branching='auto' rows of that beam size start where it says)")
  p.add_argument('--baseline_policy', default=None, metavar='FILE', help="another policy.py "
                 "(e.g. an older one from git): every 'auto' row again under it, same rounds")
  p.add_argument('--dtype', default=None, choices=('float32', 'bfloat16'),
                 help='parameters and activations (default: as stored, float32)')
  p.add_argument('--target', default=str(pipeline.EMBEDDED_TARGET))
  p.add_argument('--draft', default=str(pipeline.EMBEDDED_DRAFT))
  args = p.parse_args(argv)
  try:
    args.calibration = args.calibration and costs.load_calibration(args.calibration)
  except ValueError as e:
    raise SystemExit(f'error: --calibration: {e}') from None
  try:
    bild = ([(f, r) for f in BILD_FALLBACKS for r in BILD_ROLLBACKS] if args.bild == 'grid' else
            [tuple(float(v) for v in pair.split(':')) for pair in args.bild.split(',') if pair])
    beams = [(int(pair.split(':')[0]), pair.split(':')[1].replace(';', ','))
             for pair in args.beams.split(',') if pair]
  except (ValueError, IndexError):
    raise SystemExit('error: --bild wants fallback:rollback pairs like 0.6:5 and --beams '
                     'beam:branching pairs like 4:8') from None
  settings = grid(harness.parse_ints(args.gammas, '--gammas', auto=True),
                  harness.parse_ints(args.sampling_gammas, '--sampling_gammas', auto=True),
                  bild, args.adaptive, beams)
  if not settings:
    raise SystemExit('error: nothing to run (no gammas, BiLD pairs or beams)')
  if args.baseline_policy:
    args.baseline_policy = load_policy(args.baseline_policy)
    settings += [s._replace(policy='baseline policy') for s in settings
                 if policy.AUTO in (s.gamma, s.branching)]
  return args, settings


def load_policy(path: str) -> Any:
  """The policy module in the file `path` (its `plan` and `DecodingPolicy`)."""
  spec = importlib.util.spec_from_file_location('baseline_policy', path)
  if spec is None or not Path(path).is_file():
    raise SystemExit(f'error: --baseline_policy: no such file {path}')
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # its dataclasses look their module up there
  spec.loader.exec_module(module)
  return module


def step_probes(pair: pipeline.Pair, batch_size: int, settings: Sequence[Setting]
                ) -> Dict[Any, Dict[str, Dict[int, float]]]:
  """{None: the batch's target and draft step times, tree setting: its beam step times}."""
  steps = {None: {'target': harness.step_times_ms(pair, 'target', batch_size,
                                                  harness.verify_sizes(settings)),
                  'draft': harness.step_times_ms(pair, 'draft', batch_size, (1, 2))}}
  for s in settings:
    if s.method == 'speculative_beam':
      steps[s] = harness.beam_steps_ms(pair, batch_size * s.beam, s.tree)
  return steps


def batch_block(pair: pipeline.Pair, settings: Sequence[Setting], batch_size: int,
                sources: Sequence[str], references: Sequence[str], args: Any, c_hat: float,
                calibration: Optional[costs.Calibration] = None) -> Dict[str, Any]:
  """Every setting on the first len(sources) sentences, timed round-robin: the block's rows.
  Reads args.input_length_step, args.rounds and args.piece_batches (`harness.parser`'s); every
  setting is compiled (every gamma of 'auto' too, from `calibration` where it was made at the
  setting's temperature) before anything is timed."""
  count = len(sources)
  batches = harness.make_batches(data.encode(sources, harness.INPUT_LENGTH), batch_size,
                                 args.input_length_step)
  steps = step_probes(pair, batch_size, settings)
  compiled = {}
  for s in settings:
    compiled[s] = harness.compile_setting(
        s, pair, batches, calibration=calibration, sampled_passes=args.rounds + 1,
        policy_module=getattr(args, 'baseline_policy', None) if s.policy else policy)
    print(f"batch {batch_size} {s.name}: compiled in {compiled[s].info()['compile_s']:.1f}s",
          flush=True)
  passes = {s: functools.partial(c.pieces, args.piece_batches) for s, c in compiled.items()}
  harness.warm(passes)
  times = policy.round_robin(passes, args.rounds)
  by_base = {b: harness.speedups(times, b) for b in {s.baseline for s in settings}}
  collected = {s: harness.collect_passes(compiled[s].history, count) for s in settings}
  tokens = {s: run['tokens_per_pass'] for s, run in collected.items()}
  per_token = {b: harness.speedups_per_token(times, tokens, b) for b in by_base}
  runs = {s: {**collected[s], **compiled[s].info(), **by_base[s.baseline][s],
              **per_token[s.baseline][s], 'ms_per_sentence': harness.ms_per(times[s], count),
              'seconds_per_round': times[s]}
          for s in settings}
  rows = []
  for s in settings:
    rows.append(harness.summarize(s, runs[s], runs[s.baseline]['decodes'],
                                  steps.get(s, steps[None]), c_hat, references, pair.vocabulary))
    r = rows[-1]
    print(f"batch {batch_size} {r['name']}: {r['ms_per_sentence']:.1f} ms/sentence, "
          f"{r['speedup']:.2f}x ({r['speedup_min']:.2f}-{r['speedup_max']:.2f}), "
          f"BLEU {r['bleu']:.2f}, alpha {harness.fmt(r.get('alpha'), '.3f')}", flush=True)
  return {'num_sentences': count, 'num_batches': len(batches), 'rows': rows,
          'step_ms': {m: dict(t) for m, t in steps[None].items()}}


MAIN_COLUMNS = ('configuration', 'ms/sentence', 'speedup', 'range over rounds', 'per token',
                'summed per token (90%)', 'BLEU', 'same as greedy', 'alpha', 'accepted/call',
                'tokens/call', 'c', 'predicted', 'efficiency', 'step-cost pred.', 'extra arith.',
                'draft step ms', 'verify step ms', 'compile s')


def main_row(r: Mapping[str, Any]) -> List[str]:
  f = lambda key, spec: harness.fmt(r.get(key), spec)
  return [r['name'], f('ms_per_sentence', '.1f'), f('speedup', '.2f') + 'x',
          f"{r['speedup_min']:.2f}-{r['speedup_max']:.2f}",
          f('speedup_per_token', '.2f') + ('x' if 'speedup_per_token' in r else ''),
          (f"{r['speedup_summed']:.3f}x ({r['speedup_summed_low']:.3f}-"
           f"{r['speedup_summed_high']:.3f})" if 'speedup_summed' in r else ''),
          f('bleu', '.2f'),
          f('same_as_baseline', '.0%') if r['temperature'] == 0 else '', f('alpha', '.3f'),
          f('accepted_per_call', '.2f'), f('tokens_per_call', '.2f'), f('c', '.3f'),
          f('predicted_speedup', '.2f'), f('efficiency', '.2f'), f('step_cost_prediction', '.2f'),
          f('extra_arithmetic', '.2f'), f('draft_step_ms', '.2f'), f('verify_step_ms', '.2f'),
          f('compile_s', '.1f')]


def steps_line(batch_size: str, block: Mapping[str, Any], meta: Mapping[str, Any]) -> str:
  """The cached target step by tokens per row, against the weight-streaming and compute
  floors."""
  target_steps = block['step_ms']['target']
  one = target_steps['1']
  floor = meta['weight_streaming_floor_ms']['target']
  compute = {k: 2e3 * meta['target_flops_per_token'] * int(batch_size) * int(k) /
             (meta['matmul_gflops'] * 1e9) for k in target_steps}
  return ('Cached target step by tokens per row (ms, and / the 1-token step): ' + ', '.join(
      f'k={k}: {v:.2f} ({v / one:.2f}x)' for k, v in target_steps.items()) +
          f". Weight-streaming floor {floor:.2f} ms at {meta['memory_bandwidth_gbs']:.1f} GB/s: "
          f'the 1-token step is {one / floor:.1f}x above it. Compute floor at '
          f"{meta['matmul_gflops']:.0f} GFLOP/s (a 1024x1024 matmul): " +
          ', '.join(f'k={k}: {compute[k]:.2f} ms' for k in ('1', '2', '5') if k in compute) + '.')


def block_markdown(batch_size: str, block: Mapping[str, Any], meta: Mapping[str, Any]
                   ) -> List[str]:
  lines = [f"## Batch {batch_size} ({block['num_sentences']} sentences, target 1-token step "
           f"{block['step_ms']['target']['1']:.2f} ms, draft "
           f"{block['step_ms']['draft']['1']:.2f} ms)", '', steps_line(batch_size, block, meta),
           '']
  lines += harness.table(MAIN_COLUMNS, [main_row(r) for r in block['rows']]) + ['']
  lines += [harness.auto_note(r, block['rows']) for r in block['rows'] if 'gammas_used' in r]
  beams = [r for r in block['rows']
           if r['method'] == 'speculative_beam' and 'steps_per_call' in r]  # ran a tree
  if beams:
    lines += ['', 'Speculative beam search against beam_search (batch x beam decoder rows; '
              '"beam step" is one beam_search target call, "verify" one call over the whole '
              'tree, "draft" the tree\'s draft levels):', '']
    lines += harness.table(
        ('configuration', 'speedup', 'same beams', 'beam steps/call', 'tree nodes/call',
         'beam step ms', 'verify ms', 'draft ms', 'step-cost pred.'),
        [[r['name'], f"{r['speedup']:.2f}x", f"{r['same_as_baseline']:.0%}",
          f"{r['steps_per_call']:.2f}", f"{r['nodes_per_call']:.1f}", f"{r['beam_step_ms']:.2f}",
          f"{r['verify_step_ms']:.2f}", f"{r['draft_step_ms']:.2f}",
          f"{r['step_cost_prediction']:.2f}"] for r in beams])
  return lines + ['']


def markdown(results: Mapping[str, Any]) -> str:
  lines = harness.heading(f"Speed: {results['meta']['description']}", results)
  lines += [f"Speedups: median over {results['meta']['rounds']} round-robin rounds of the "
            "baseline's pass time over the configuration's in the same round; per token: "
            "each round's time per output token, its tokens the round's own; summed: all "
            "rounds' time over all their tokens, 90% interval by resampling rounds. Sampled passes "
            'drew their own samples each round.', '']
  for batch_size, block in results['batches'].items():
    lines += block_markdown(batch_size, block, results['meta'])
  return '\n'.join(lines)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
  args, settings = parse_args(argv)
  sizes = harness.parse_sentences(args.sentences)
  sources, references = harness.test_split(args.data_dir)
  pair = harness.load_pair(args.target, args.draft, args.dtype)
  flops = {name: config.decode_flops_per_token() for name, config in pair.configs.items()}
  results = {'meta': harness.meta(
      NAME, argv, args, description='embedded Multi30k De->En pair on test_2016_flickr',
      c_hat=flops['draft'] / flops['target'], target_flops_per_token=flops['target'],
      target_params=harness.param_count(pair.params['target']),
      draft_params=harness.param_count(pair.params['draft']), dtype=args.dtype or 'as stored',
      **harness.probe_machine(pair)),
      'batches': {}}
  for batch_size, count in sizes.items():
    count = min(count, len(sources))
    results['batches'][str(batch_size)] = batch_block(
        pair, settings, batch_size, sources[:count], references[:count], args,
        results['meta']['c_hat'], args.calibration)
    paths = harness.write_results(args, NAME, results, markdown)
  print('wrote', *paths)
  return results


if __name__ == '__main__':
  main()
