"""Speed of the embedded pair: target-only, speculative, BiLD, beam and HF assisted generation.

  python -m benchmarks.speed                      # greedy: target-only against gamma 2
  python -m benchmarks.speed --gammas 1,2,3,4,auto --sentences 1:192,8:192,32:192
  python -m benchmarks.speed --sampling_gammas 1,auto --bild 0.4:5 --beams 4:1,4:auto
  python -m benchmarks.speed --gammas '' --beams '4:8,4:4;2'

The defaults are a short run (81 s on 2 CPU cores, a third of it compiling): greedy target-only
against speculative gamma 2, at batch 1 and 8 (32 and 64 captions). Everything
else is opt-in ('auto' compiles gammas 0-4, one loop each, a minute or more per batch size
here); the runs behind the README's table are scripts/reproduce_results.sh.

For every batch size the same sentences go through target-only decoding (the baseline),
speculative decoding at each --gammas value (gamma='auto': `policy.DecodingPolicy` choosing per
batch from measured batch times, as the infer job does), adaptive
gamma (up to the largest gamma), the same at temperature 1 for --sampling_gammas, BiLD at each
--bild (fallback, rollback) pair, with --beams beam_search against speculative beam search for
each beam:branching pair, and at batch 1 Hugging Face transformers' assisted generation on the
same weights converted to T5ForConditionalGeneration (needs `pip install -e '.[hf]'`; skipped
with a note otherwise). All configurations of a batch size, HF's included, are timed
round-robin for --rounds rounds after one untimed pass each, taking turns every
--piece_batches batches (see benchmarks.harness). Each pass of a sampled configuration draws its
own samples (`harness.pass_keys`; --same_samples: every pass the first's): its speed is then an
expectation over draws, where one draw decides a short job (at batch 32 a batch's loop runs
until its longest row ends).

Per configuration: median wall time per sentence (compilation excluded, reported as
compile_s), speedup over the baseline of the same batch size and temperature (median over
rounds of the per-round ratio, with its range) and per output token (each round's tokens its
own: sampled outputs' lengths differ; also summed over rounds, with a 90% bootstrap
interval: `harness.speedups_per_token`), BLEU, whether greedy outputs equal the target
alone's, alpha, accepted draft tokens and emitted tokens per target call, c = draft step /
target step, the paper's predicted speedup (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)),
efficiency = measured / predicted, a step-cost prediction that charges the verify call its
measured (gamma+1)-token cost, draft-step and verify-step times, and the extra arithmetic per
token of Theorem 3.11, (1 - alpha)(gamma c_hat + gamma + 1) / (1 - alpha^(gamma+1)), with c_hat
the FLOPs ratio. Beam rows: beam steps and tree nodes per target call, and a step-cost
prediction from the one-token beam step, the tree's verify call and its draft levels. Per batch
size also the cached target step by tokens per row against the machine's weight-streaming and
compute floors.

Writes speed.json (after every batch size), speed.md and, with matplotlib,
speed_vs_gamma.png and speed_acceptance.png.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from benchmarks import harness
from benchmarks.harness import Setting
from speculative_t5x import costs
from speculative_t5x import data
from speculative_t5x import pipeline
from speculative_t5x import policy

NAME = 'speed'
BILD_FALLBACKS = (0.4, 0.6, 0.8)
BILD_ROLLBACKS = (2.0, 3.0, 5.0)


def grid(gammas: Sequence[Any], sampling_gammas: Sequence[int],
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
  p.add_argument('--hf', action='store_true',
                 help="add HF assisted generation at batch 1 (needs torch and transformers)")
  p.add_argument('--no_hf', action='store_false', dest='hf', help='no HF rows (the default)')
  p.add_argument('--hf_gammas', default='4', help='constant HF assistant lengths to run')
  p.add_argument('--hf_threads', type=int, default=1,
                 help="PyTorch's intra-op threads for HF generation (0: one per CPU)")
  p.add_argument('--calibration', default=None,
                 help="a calibration.json of speculative-t5x-calibrate: gamma='auto' rows at its "
                      "temperature start at its schedule and follow its model (made with "
                      "--beam_size: branching='auto' rows of that beam size start where it says)")
  p.add_argument('--same_samples', action='store_true',
                 help='every pass of a sampled configuration draws the untimed pass\'s samples '
                      '(default: each pass its own)')
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
  settings = grid(harness.parse_gammas(args.gammas),
                  harness.parse_gammas(args.sampling_gammas, True, '--sampling_gammas'), bild,
                  args.adaptive, beams)
  if not settings:
    raise SystemExit('error: nothing to run (no gammas, BiLD pairs or beams)')
  return args, settings


# ------------------------------------------------------------------------------------------------
# Hugging Face assisted generation (PyTorch, batch 1).


def hf_passes(pair: pipeline.Pair, sentences: Sequence[str], gammas: Sequence[int],
              threads: int = 1) -> Dict[str, Callable[[], np.ndarray]]:
  """{name: one pass} of HF greedy generation without and with `assistant_model`, one sentence
  at a time; each pass returns decodes [n, OUTPUT_LENGTH]. Raises ImportError without HF, a
  ValueError for a draft with no encoder of its own (HF's assistant must be a whole T5).

  threads: PyTorch's intra-op threads. One by default: with two on this 2-core machine while
  other processes ran, generate() took 40x longer (its threads wait on each other), and one
  sentence's small matrices gain little from more.
  """
  if not pair.draft_config.has_encoder:
    raise ValueError('HF assisted generation needs a draft with its own encoder: --draft '
                     f'{pipeline.EMBEDDED_SEPARATE_DRAFT}')
  import torch  # pylint: disable=g-import-not-at-top
  from transformers import cache_utils  # pylint: disable=g-import-not-at-top
  from speculative_t5x import hf  # pylint: disable=g-import-not-at-top

  torch.set_num_threads(threads or os.cpu_count() or 1)
  target = hf.to_hf_model(pair.target_config, pair.params['target'])
  draft = hf.to_hf_model(pair.draft_config, pair.params['draft'])
  inputs = [torch.tensor([ids]) for ids in data.encode(sentences, harness.INPUT_LENGTH)]

  def generate(assistant, schedule, tokens):
    if assistant is not None:
      assistant.generation_config.num_assistant_tokens_schedule = schedule
      assistant.generation_config.num_assistant_tokens = tokens
    decodes = np.zeros((len(inputs), harness.OUTPUT_LENGTH), np.int32)
    with torch.inference_mode():
      for i, ids in enumerate(inputs):
        out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              num_beams=1, max_new_tokens=harness.OUTPUT_LENGTH,
                              assistant_model=assistant,
                              # A lazily grown cache: the one generate() builds has one layer
                              # per *encoder* layer, too few for this deeper decoder.
                              cache=cache_utils.EncoderDecoderCache(cache_utils.DynamicCache(),
                                                                    cache_utils.DynamicCache()))
        out = out[0, 1:harness.OUTPUT_LENGTH + 1].numpy()
        decodes[i, :len(out)] = out
    return decodes

  runs = [('HF greedy (no assistant)', None, None, None),
          ('HF assisted, default schedule', draft, 'heuristic', 20)]
  runs += [(f'HF assisted, constant gamma={g}', draft, 'constant', g) for g in gammas]
  return {name: (lambda a=a, s=s, t=t: generate(a, s, t)) for name, a, s, t in runs}


def hf_rows(outputs: Mapping[str, np.ndarray], times: Mapping[Any, Sequence[float]],
            references: Sequence[str], our_greedy: np.ndarray,
            vocabulary: Any) -> List[Dict[str, Any]]:
  """HF's rows: ms per sentence, speedup over our target-only greedy (same rounds), BLEU and
  whether HF's output equals our greedy decode."""
  speedups = harness.speedups(times, Setting('baseline'))
  rows = []
  for name, decodes in outputs.items():
    texts = [vocabulary.decode(row) for row in decodes]
    rows.append({'name': name, 'method': 'hf', 'batch_size': 1,
                 'ms_per_sentence': harness.ms_per(times[name], len(decodes)), **speedups[name],
                 'bleu': data.corpus_bleu(texts, references),
                 'same_as_baseline': float(np.mean(np.all(decodes == our_greedy, axis=1)))})
  return rows


# ------------------------------------------------------------------------------------------------
# One batch size.


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


def compile_all(pair: pipeline.Pair, settings: Sequence[Setting], batches: List[Any],
                batch_size: int, calibration: Optional[costs.Calibration] = None,
                sampled_passes: int = 1) -> Dict[Setting, harness.Compiled]:
  """Every setting compiled (every gamma of gamma='auto' too) before anything is timed
  (gamma='auto' from `calibration` where it was made at the setting's temperature; sampled
  settings' passes draw sampled_passes draws, `harness.pass_keys`)."""
  compiled = {}
  for s in settings:
    compiled[s] = harness.compile_setting(s, pair, batches, calibration=calibration,
                                          sampled_passes=sampled_passes)
    print(f"batch {batch_size} {s.name}: compiled in {compiled[s].info()['compile_s']:.1f}s",
          flush=True)
  return compiled


def batch_block(pair: pipeline.Pair, settings: Sequence[Setting], batch_size: int,
                sources: Sequence[str], references: Sequence[str], args: Any,
                c_hat: float) -> Dict[str, Any]:
  """Every setting (and at batch 1 HF) on the first len(sources) sentences: the block's rows."""
  count = len(sources)
  batches = harness.make_batches(data.encode(sources, harness.INPUT_LENGTH), batch_size,
                                 args.input_length_step)
  steps = step_probes(pair, batch_size, settings)
  compiled = compile_all(pair, settings, batches, batch_size, args.calibration,
                         1 if args.same_samples else args.rounds + 1)
  passes = {s: functools.partial(c.pieces, args.piece_batches) for s, c in compiled.items()}
  hf = {}
  if batch_size == 1 and args.hf and Setting('baseline') in passes:
    try:
      hf = hf_passes(pair, sources, harness.parse_ints(args.hf_gammas, '--hf_gammas'),
                     args.hf_threads)
    except (ImportError, ValueError) as e:
      print(f'skipping HF assisted generation: {e}', file=sys.stderr)
  outputs = harness.warm({**passes, **hf})
  times = policy.round_robin({**passes, **hf}, args.rounds)
  by_base = {b: harness.speedups(times, b) for b in {s.baseline for s in settings}}
  collected = {s: harness.collect_passes(compiled[s].history, count) for s in settings}
  tokens = {s: run['tokens_per_pass'] for s, run in collected.items()}
  per_token = {b: harness.speedups_per_token({s: times[s] for s in settings}, tokens, b)
               for b in by_base}
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
  block = {'num_sentences': count, 'num_batches': len(batches), 'rows': rows,
           'step_ms': {m: dict(t) for m, t in steps[None].items()}}
  if hf:
    block['hf'] = hf_rows({k: outputs[k] for k in hf}, times, references,
                          runs[Setting('baseline')]['decodes'], pair.vocabulary)
  return block


# ------------------------------------------------------------------------------------------------
# Reporting.


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
  lines += [harness.auto_note(r) for r in block['rows'] if 'gammas_used' in r]
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
  if block.get('hf'):
    lines += ['', 'Hugging Face transformers, PyTorch CPU with '
              f"{meta.get('hf_threads', 1) or 'all'} thread(s), one sentence at a time (timed in "
              'the same rounds):', '']
    lines += harness.table(
        ('configuration', 'ms/sentence', 'speedup vs our target-only', 'BLEU',
         'same as our greedy'),
        [[r['name'], f"{r['ms_per_sentence']:.1f}", f"{r['speedup']:.2f}x", f"{r['bleu']:.2f}",
          f"{r['same_as_baseline']:.0%}"] for r in block['hf']])
  return lines + ['']


def markdown(results: Mapping[str, Any]) -> str:
  lines = harness.heading(f"Speed: {results['meta']['description']}", results)
  lines += [f"Speedups: median over {results['meta']['rounds']} round-robin rounds of the "
            "baseline's pass time over the configuration's in the same round; per token: "
            "each round's time per output token, its tokens the round's own; summed: all "
            "rounds' time over all their tokens, 90% interval by resampling rounds. Sampled passes "
            + ('drew the same samples every round.' if results['meta'].get('same_samples')
               else 'drew their own samples each round.'), '']
  for batch_size, block in results['batches'].items():
    lines += block_markdown(batch_size, block, results['meta'])
  return '\n'.join(lines)


def _fixed(rows: Sequence[Mapping[str, Any]]) -> List[Mapping[str, Any]]:
  return [r for r in rows if r['method'] == 'speculative' and not r['adaptive'] and
          r['gamma'] != policy.AUTO]


def plots(results: Mapping[str, Any], directory: Any) -> List[str]:
  """speed_vs_gamma.png and speed_acceptance.png; [] without matplotlib or without rows of a
  fixed gamma."""
  blocks = results['batches']
  if not any(_fixed(block['rows']) for block in blocks.values()):
    return []
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    print('matplotlib is not installed: no plots (pip install matplotlib)', file=sys.stderr)
    return []
  files = []
  for draw, name in ((_speedup_plot, 'speed_vs_gamma.png'),
                     (_acceptance_plot, 'speed_acceptance.png')):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    draw(ax, blocks)
    ax.legend(fontsize=7)
    fig.tight_layout()
    files.append(str(directory / name))
    fig.savefig(files[-1], dpi=120)
    plt.close(fig)
  return files


def _speedup_plot(ax: Any, blocks: Mapping[str, Any]) -> None:
  for batch_size, block in blocks.items():
    for temperature, style in ((0.0, '-'), (1.0, ':')):
      rows = sorted((r for r in _fixed(block['rows']) if r['temperature'] == temperature),
                    key=lambda r: r['gamma'])
      if not rows:
        continue
      line, = ax.plot([r['gamma'] for r in rows], [r['speedup'] for r in rows], style + 'o',
                      label=f'batch {batch_size}, T={temperature:g}')
      if temperature == 0.0:
        ax.plot([r['gamma'] for r in rows], [r['predicted_speedup'] for r in rows], '--x',
                color=line.get_color(), alpha=0.5, label=f'batch {batch_size}, predicted')
  ax.axhline(1.0, color='gray', lw=0.8)
  ax.set(xlabel='gamma (draft tokens per target call)', ylabel='speedup over target-only',
         title='Speculative decoding on the embedded Multi30k pair')


def _acceptance_plot(ax: Any, blocks: Mapping[str, Any]) -> None:
  for batch_size, block in blocks.items():
    fixed = _fixed(block['rows'])
    for temperature in sorted({r['temperature'] for r in fixed}):
      r = max((r for r in fixed if r['temperature'] == temperature), key=lambda r: r['gamma'])
      # accepted_at[i]: P(positions 0..i all accepted); the ratio conditions on reaching i.
      reached = np.array([1.0] + r['accepted_at'])
      conditional = reached[1:] / np.maximum(reached[:-1], 1e-9)
      ax.plot(range(1, len(conditional) + 1), conditional, 'o-',
              label=f"batch {batch_size}, T={temperature:g}, gamma={r['gamma']} "
                    f"(alpha {r['alpha']:.2f})")
  ax.set(xlabel='draft position i', ylim=(0, 1),
         ylabel='P(accept position i | positions < i accepted)',
         title='Acceptance by draft position')


# ------------------------------------------------------------------------------------------------


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
  args, settings = parse_args(argv)
  sizes = harness.parse_sentences(args.sentences)
  sources, references = harness.test_split(args.data_dir)
  pair = harness.load_pair(args.target, args.draft)
  configs = pair.configs
  flops = {name: config.decode_flops_per_token() for name, config in configs.items()}
  results = {'meta': harness.meta(
      NAME, argv, args, description='embedded Multi30k De->En pair on test_2016_flickr',
      c_hat=flops['draft'] / flops['target'], target_flops_per_token=flops['target'],
      target_params=harness.param_count(pair.params['target']),
      draft_params=harness.param_count(pair.params['draft']), hf_threads=args.hf_threads,
      same_samples=args.same_samples,
      **harness.probe_machine(pair)),
      'batches': {}}
  for batch_size, count in sizes.items():
    count = min(count, len(sources))
    results['batches'][str(batch_size)] = batch_block(
        pair, settings, batch_size, sources[:count], references[:count], args,
        results['meta']['c_hat'])
    paths = harness.write_results(args, NAME, results, markdown)
  files = plots(results, harness.out_dir(args))
  print('wrote', *paths, *files)
  return results


if __name__ == '__main__':
  main()
