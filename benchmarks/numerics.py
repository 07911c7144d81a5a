"""bfloat16 numerics: greedy speculative vs target-only greedy, and float32 output logits.

  python -m benchmarks.numerics --sentences 512 --out_dir results/cpu

Greedy speculative decoding is token-identical to target-only greedy in float32. In bfloat16
(the infer job's dtype off CPU: parameters and activations in bf16) the k-token verify call and
the 1-token calls of target-only greedy are different programs whose bf16 roundings differ, so
they can order a near-tie of the target's top two logits differently. This command decodes the first --sentences sentences of
test_2016_flickr (the embedded pair, --batch_size rows per batch, encoder width each batch's
longest input rounded up to --input_length_step, at most 64 output tokens) with

  * float32 target-only greedy (the reference),
  * bf16 target-only greedy and bf16 greedy speculative at each of --gammas,
  * the same bf16 decoders with `network.T5Config.float32_logits` set on both models,

and reports (a) rows of each speculative decode identical to target-only greedy of the same
numerics, (b) rows of every bf16 decode identical to float32 target-only, (c) for each row that
differs, its first differing position and the float32 target's logits there, teacher-forced on
the common prefix: the gap between its top two logits and between the two tokens chosen, and
(d) what float32_logits costs: bf16 speculative with over without it, the passes timed
round-robin (`policy.round_robin`) for --rounds rounds in this process (median and range over
rounds of the time ratio within a round). The cost is a figure of the machine it ran on.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from benchmarks.harness import Setting
from speculative_t5x import data
from speculative_t5x import network
from speculative_t5x import pipeline
from speculative_t5x import policy

NAME = 'numerics'
FP32, BF16, BF16_F32_LOGITS = 'float32', 'bfloat16', 'bfloat16 + float32_logits'
# Teacher-forced rows per call of the float32 target (one compilation for all of them).
PROBE_BATCH = 16
# Top-2 logit gaps the fraction of all positions below which is reported, for scale.
GAP_THRESHOLDS = (0.01, 0.03, 0.06, 0.1)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument('--sentences', type=int, default=512, help='the first N test sentences')
  p.add_argument('--batch_size', type=int, default=32, help='rows per batch')
  p.add_argument('--gammas', default='2,4', help='greedy speculative gammas')
  p.add_argument('--rounds', type=int, default=15,
                 help='timed round-robin rounds of the float32_logits cost (0: not timed)')
  harness.output_flags(p)
  p.add_argument('--data_dir', default=None, help='folder holding multi30k/ (default: '
                 f'${data.DATA_ENV_VAR} or ../shared/data)')
  p.add_argument('--input_length_step', type=int, default=harness.INPUT_LENGTH_STEP,
                 help="encoder width: each batch's longest input rounded up to a multiple of "
                      'this (0: 64)')
  return p.parse_args(argv)


def bf16_pair(float32_logits: bool) -> pipeline.Pair:
  """The embedded pair as the infer job runs it with dtype=bfloat16: parameters cast to bf16 and
  both configs computing in bf16 (`pipeline.load_pair(dtype=...)` casts the parameters only)."""
  configs, params = {}, {}
  for name, path in (('target', pipeline.EMBEDDED_TARGET), ('draft', pipeline.EMBEDDED_DRAFT)):
    config, params[name] = pipeline.load_model(path, dtype=jnp.bfloat16)
    configs[name] = dataclasses.replace(config, dtype=jnp.bfloat16,
                                        float32_logits=float32_logits)
  return harness.make_pair(configs['target'], configs['draft'], params)


def first_difference(a: np.ndarray, b: np.ndarray) -> int:
  """The first position where token rows a and b differ (they must differ somewhere)."""
  return int(np.flatnonzero(a != b)[0])


def teacher_forced_logits(pair: pipeline.Pair, inputs: Sequence[Sequence[int]],
                          targets: Sequence[Sequence[int]]) -> Iterator[np.ndarray]:
  """The float32 target's teacher-forced logits [len(targets[i]), vocab] of each input row
  inputs[i] with decoder targets targets[i] (non-zero tokens), in order."""
  module = network.Transformer(pair.target_config)
  forward = jax.jit(lambda p, b: module.apply({'params': p}, b['encoder_input_tokens'],
                                              b['decoder_input_tokens'],
                                              b['decoder_target_tokens']))
  for start in range(0, len(targets), PROBE_BATCH):
    chunk = targets[start:start + PROBE_BATCH]
    batch = data.pad_batch(inputs[start:start + PROBE_BATCH], chunk, harness.INPUT_LENGTH,
                           harness.OUTPUT_LENGTH, PROBE_BATCH)
    logits = np.asarray(forward(pair.params['target'], batch), np.float32)
    for i, row in enumerate(chunk):
      yield logits[i, :len(row)]


def teacher_forced_gaps(pair: pipeline.Pair, inputs: Sequence[Sequence[int]],
                        probes: Sequence[Dict[str, Any]]) -> None:
  """Adds the float32 target's view of each probe's first differing position, in place.

  A probe names a row, its common prefix `prefix` and the two tokens chosen after it; the target
  reads the row's input and the prefix in one teacher-forced pass (float32), and its logits at
  the next position give top1/top2 (tokens and logits), top2_gap, and chosen_gap: the gap
  between the logits of the two tokens the decoders chose.
  """
  # The 1 after the prefix only marks that position as a real token (targets > 0).
  logits = teacher_forced_logits(pair, [inputs[p['row']] for p in probes],
                                 [p['prefix'] + [1] for p in probes])
  for probe, row_logits in zip(probes, logits):
    row = row_logits[-1]
    top2 = np.argsort(row)[::-1][:2]
    chosen = [row[t] for t in probe['tokens']]
    probe.update(top1=int(top2[0]), top2=int(top2[1]), top1_logit=float(row[top2[0]]),
                 top2_logit=float(row[top2[1]]), top2_gap=float(row[top2[0]] - row[top2[1]]),
                 chosen_gap=float(abs(chosen[0] - chosen[1])))


def all_position_gaps(pair: pipeline.Pair, inputs: Sequence[Sequence[int]],
                      decodes: np.ndarray) -> Dict[str, Any]:
  """For scale: the float32 target's top-2 logit gap at every position of its own greedy decodes
  (EOS included): how many positions, the median gap, and the fraction below a few gaps."""
  targets = [[int(t) for t in row if t > 0] for row in decodes]
  gaps = np.concatenate([np.diff(np.sort(logits, axis=-1)[:, -2:], axis=-1)[:, 0]
                         for logits in teacher_forced_logits(pair, inputs, targets)])
  return {'positions': int(gaps.size), 'median_gap': float(np.median(gaps)),
          'fraction_below': {str(g): float(np.mean(gaps < g)) for g in GAP_THRESHOLDS}}


def compare(decodes: np.ndarray, reference: np.ndarray, names: Sequence[str]
            ) -> Dict[str, Any]:
  """Identical rows of decodes vs reference, and a probe per differing row (its first
  differing position, the common prefix, the two tokens there: decodes' first)."""
  same = np.all(decodes == reference, axis=1)
  probes = []
  for row in np.flatnonzero(~same):
    position = first_difference(decodes[row], reference[row])
    probes.append({'row': int(row), 'position': position,
                   'prefix': [int(t) for t in decodes[row, :position]],
                   'tokens': [int(decodes[row, position]), int(reference[row, position])],
                   'token_names': names})
  return {'identical': int(same.sum()), 'rows': int(len(same)), 'differing': probes}


def timed_cost(compiled: Mapping[Any, harness.Compiled], gammas: Sequence[int], rounds: int,
               count: int) -> List[Dict[str, Any]]:
  """bf16 speculative with float32_logits over without, per gamma, timed round-robin."""
  passes = {(numerics, g): compiled[numerics, g].one_pass
            for g in gammas for numerics in (BF16, BF16_F32_LOGITS)}
  times = policy.round_robin(passes, rounds)
  out = []
  for g in gammas:
    without, with_ = np.asarray(times[BF16, g]), np.asarray(times[BF16_F32_LOGITS, g])
    ratios = with_ / without
    out.append({'gamma': g, 'ms_per_sentence_without': harness.ms_per(without, count),
                'ms_per_sentence_with': harness.ms_per(with_, count),
                'cost_ratio': float(np.median(ratios)), 'cost_ratio_min': float(ratios.min()),
                'cost_ratio_max': float(ratios.max()), 'rounds': rounds})
  return out


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
  args = parse_args(argv)
  gammas = harness.parse_gammas(args.gammas, auto=False)
  sources, _ = harness.test_split(args.data_dir)
  sources = sources[:args.sentences]
  count = len(sources)
  inputs = data.encode(sources, harness.INPUT_LENGTH)
  batches = harness.make_batches(inputs, args.batch_size, args.input_length_step)
  results = {'meta': harness.meta(NAME, argv, args, sentences=count,
                                  batch_size=args.batch_size, gammas=gammas)}
  pairs = {FP32: harness.load_pair(), BF16: bf16_pair(False),
           BF16_F32_LOGITS: bf16_pair(True)}
  settings = {(FP32, 0): Setting('baseline')}
  for numerics in (BF16, BF16_F32_LOGITS):
    settings[numerics, 0] = Setting('baseline')
    settings.update({(numerics, g): Setting('speculative', gamma=g) for g in gammas})
  compiled, decodes, seconds = {}, {}, {}
  for key, setting in settings.items():
    start = time.perf_counter()
    compiled[key] = harness.compile_setting(setting, pairs[key[0]], batches)
    outputs = jax.block_until_ready(compiled[key].one_pass())
    decodes[key] = harness.collect(outputs, count)['decodes']
    seconds[key] = time.perf_counter() - start
    print(f'{key[0]} {setting.name}: compiled and decoded in {seconds[key]:.0f} s', flush=True)

  reference = decodes[FP32, 0]
  rows = []
  for (numerics, g), tokens in decodes.items():
    if numerics == FP32:
      continue
    row = {'numerics': numerics, 'gamma': g, 'decoder': settings[numerics, g].name,
           'compile_and_decode_s': seconds[numerics, g],
           'vs_fp32_target': compare(tokens, reference, (numerics, FP32))}
    if g:
      row['vs_target'] = compare(tokens, decodes[numerics, 0], ('speculative', 'target-only'))
    rows.append(row)
  probes = [p for r in rows for c in ('vs_target', 'vs_fp32_target') for p in
            r.get(c, {}).get('differing', [])]
  teacher_forced_gaps(pairs[FP32], inputs, probes)
  results['rows'] = rows
  results['all_positions'] = all_position_gaps(pairs[FP32], inputs, reference)
  paths = harness.write_results(args, NAME, results, markdown)
  for r in rows:
    line = (f"{r['numerics']} {r['decoder']}: identical to fp32 target-only "
            f"{r['vs_fp32_target']['identical']}/{count}")
    if 'vs_target' in r:
      line += f", to its target-only {r['vs_target']['identical']}/{count}"
    print(line, flush=True)

  if args.rounds:
    results['cost'] = timed_cost(compiled, gammas, args.rounds, count)
    for c in results['cost']:
      print(f"gamma {c['gamma']}: float32_logits cost x{c['cost_ratio']:.3f} "
            f"({c['cost_ratio_min']:.3f}-{c['cost_ratio_max']:.3f})", flush=True)
    paths = harness.write_results(args, NAME, results, markdown)
  print('wrote', *paths)
  return results


def bf16_spacing(value: float) -> float:
  """The gap between adjacent bfloat16 numbers at |value| (8 significant bits)."""
  return 2.0 ** (np.floor(np.log2(abs(value))) - 7)


def markdown(results: Mapping[str, Any]) -> str:
  meta = results['meta']
  n = meta['sentences']
  lines = harness.heading('bfloat16 numerics: greedy speculative vs target-only greedy', results)
  lines += [f"{n} sentences of test_2016_flickr, batch {meta['batch_size']}, encoder width "
            f"rounded up to {meta['input_length_step']}, at most {meta['output_length']} output "
            'tokens; the embedded pair. bfloat16: parameters and activations (the infer job\'s '
            'dtype=bfloat16); float32_logits (the final norm and the logits in float32) set '
            'on both models.', '',
            '## Rows identical', '']
  lines += harness.table(
      ('numerics', 'decoder', 'identical to target-only greedy (same numerics)',
       'identical to float32 target-only greedy'),
      [[r['numerics'], r['decoder'],
        f"{r['vs_target']['identical']}/{n}" if 'vs_target' in r else '(itself)',
        f"{r['vs_fp32_target']['identical']}/{n}"] for r in results['rows']]) + ['']
  lines += ['## Speculative rows that differ from target-only greedy (same numerics)', '',
            'The float32 target, teacher-forced on the common prefix, at the first differing '
            'position: its top two tokens, the gap between their logits, the gap between the '
            'logits of the two tokens the decoders chose there, and its top logit with the '
            'spacing of bfloat16 numbers at that magnitude (a bf16 logit can only tell apart '
            'logits about that far apart).', '']
  detail = [[r['numerics'], r['decoder'], p['row'], p['position'],
             f"{p['tokens'][0]} vs {p['tokens'][1]}", f"{p['top1']}, {p['top2']}",
             f"{p['top2_gap']:.4f}", f"{p['chosen_gap']:.4f}",
             f"{p['top1_logit']:.2f} ({bf16_spacing(p['top1_logit']):.4f})"]
            for r in results['rows'] for p in r.get('vs_target', {}).get('differing', [])]
  lines += harness.table(('numerics', 'decoder', 'row', 'position',
                          'tokens (speculative vs target-only)', 'float32 top-2 tokens',
                          'top-2 gap', 'chosen gap', 'top logit (bf16 spacing)'),
                         detail) + [''] if detail else ['None.', '']
  scale = results.get('all_positions')
  if scale:
    below = ', '.join(f'{float(g):g}: {f:.2%}' for g, f in scale['fraction_below'].items())
    lines += [f"For scale, over all {scale['positions']} positions of float32 target-only "
              f"greedy (teacher-forced): median top-2 gap {scale['median_gap']:.3f}; fraction "
              f'of positions with a top-2 gap below {below}.', '']
  lines += ['## Rows that differ from float32 target-only greedy', '',
            'The same view of each row that differs from float32 target-only greedy: how often '
            "the bf16 decode's token was the float32 target's second choice, and the gaps "
            'between the logits of the two tokens chosen (per row in the JSON).', '']
  summary = []
  for r in results['rows']:
    probes = r['vs_fp32_target']['differing']
    gaps = np.asarray([p['chosen_gap'] for p in probes])
    second = sum(p['tokens'][0] == p['top2'] for p in probes)
    summary.append([r['numerics'], r['decoder'], len(probes), f'{second}/{len(probes)}',
                    f'{np.median(gaps):.4f}' if len(gaps) else '',
                    f'{gaps.max():.4f}' if len(gaps) else ''])
  lines += harness.table(('numerics', 'decoder', 'differing rows', 'bf16 token = fp32 2nd choice',
                          'chosen gap: median', 'max'), summary) + ['']
  if 'cost' in results:
    lines += ['## Cost of float32_logits (bfloat16 speculative, with over without)', '',
              f"{results['cost'][0]['rounds']} rounds, the passes round-robin in one process; "
              f"a figure of this machine ({meta['machine']}), not of an accelerator.", '']
    lines += harness.table(
        ('gamma', 'ms/sentence without', 'ms/sentence with', 'time with / without (median, '
         'range over rounds)'),
        [[c['gamma'], f"{c['ms_per_sentence_without']:.2f}", f"{c['ms_per_sentence_with']:.2f}",
          f"{c['cost_ratio']:.3f} ({c['cost_ratio_min']:.3f}-{c['cost_ratio_max']:.3f})"]
         for c in results['cost']]) + ['']
  return '\n'.join(lines)


if __name__ == '__main__':
  main()
