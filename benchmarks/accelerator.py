"""Step and loop times at T5 1.1 large/XL shapes on an accelerator: does speculation pay there?

  python -m benchmarks.accelerator --out_dir results/gpu  # a GPU machine
  python -m benchmarks.accelerator --tiny --machine cpu  # tiny configs on any machine (tests)

Random weights (nothing to download), the shipped T5 1.1 configs (target --sizes, draft small),
--input_length / --output_length, parameters in --param_dtype, one device. Per (size, batch):
the target's 1- and (gamma + 1)-token steps and the draft's 1- and 2-token steps, timed inside
a jitted loop (`harness.step_times_ms`), each beside XLA's flops and bytes accessed of the step
compiled alone, the GB/s those bytes take at the measured time (against the chip's HBM
bandwidth: how far a step is from streaming its weights) and on a TPU XLA:TPU's estimate; then
the loops whole (target-only greedy, speculative at each --gammas; no EOS: every row decodes
every position), round-robin over --rounds, each beside the time its measured steps predict and
the cache-sized copies and dtype conversions in its compiled loop bodies. Random weights accept
few draft tokens: --alpha A makes the speculative loops accept each draft token with
probability A (`fixed_acceptance_rule` at T=1, for benchmarks only), so that `verdict` says
whether a loop at a real pair's acceptance pays, against the paper's formula at the measured c.
--unroll_draft adds each speculative loop with its draft calls unrolled (no draft while loop).
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import compiled as xla
from benchmarks import harness
from benchmarks.harness import Setting
from benchmarks import scale
from speculative_t5x import aot
from speculative_t5x import costs
from speculative_t5x import decoding
from speculative_t5x import network
from speculative_t5x import partitioning
from speculative_t5x import policy

NAME = 'accelerator'
TINY_SHAPES = (16, 8)  # input, output length under --tiny


def fixed_acceptance_rule(alpha: float) -> decoding.VerifyRule:
  """FOR BENCHMARKS ONLY: accepts each draft token with probability alpha whatever the models
  say, and draws the correction from the target. The output is not the target's distribution;
  it times a loop at a chosen acceptance with random weights."""
  return decoding.VerifyRule(lambda p, q, p_raw, x: jnp.full(x.shape, alpha, jnp.float32),
                             lambda p, q: p)


def random_pair(target: network.T5Config, draft: network.T5Config, dtype: str) -> Any:
  """A harness pair of random weights in `dtype`, initialised on the device."""
  params = {}
  for i, (name, config) in enumerate((('target', target), ('draft', draft))):
    init = jax.jit(lambda key, config=config: network.init_params(config, key)[0])
    params[name] = jax.tree.map(lambda x: x.astype(dtype), init(jax.random.PRNGKey(i)))
  return harness.make_pair(target, draft, params)


def step_costs(pair: Any, batch: int, ks: Mapping[str, Sequence[int]], shapes: Sequence[int]
               ) -> Dict[str, Any]:
  """Per model and k: flops, bytes accessed and ops of one cached decoder step compiled alone on
  this backend (`aot.step_program`, one device), and XLA:TPU's estimate on a TPU."""
  mesh = partitioning.create_mesh((1, 1), devices=jax.devices()[:1])
  rules = partitioning.standard_logical_axis_rules()
  caches = dict(zip(('target', 'draft'),
                    aot.abstract_caches(pair.model(), pair.params, batch, *shapes)))
  out = {}
  for name, widths in ks.items():
    out[name] = {}
    for k in widths:
      program = aot.step_program(pair.configs[name], pair.params[name],
                                 pair.params['decode'][name], caches[name], mesh, rules, k)
      cost = xla.cost(program)
      if 'optimal_seconds' in cost:  # XLA:TPU's estimate, its unpriced calls corrected
        cost['optimal_seconds'] = aot.optimal_seconds(program)
      out[name][str(k)] = {**cost, 'ops': xla.entry_ops(xla.Module.parse(program.as_text()))}
  return out


def loop_settings(gammas: Sequence[int], alpha: Optional[float], unroll: bool
                  ) -> Dict[str, Tuple[Setting, Dict[str, Any]]]:
  """{name: (setting, decode overrides)}: target-only greedy, then speculative at each gamma
  (greedy; with alpha, the benchmark-only fixed-acceptance rule at T=1), then unrolled."""
  out = {'target-only': (Setting('baseline'), {})}
  for unrolled in (False, True) if unroll else (False,):
    for g in gammas:
      setting = Setting('speculative', gamma=g, temperature=0.0 if alpha is None else 1.0,
                        verification='token')
      overrides = {'unroll_draft': unrolled}
      if alpha is not None:
        overrides['rule'] = fixed_acceptance_rule(alpha)
      name = f'gamma {g}' + (f' alpha {alpha:g}' if alpha is not None else ' greedy')
      out[name + (' unrolled' if unrolled else '')] = (setting, overrides)
  return out


def loops(pair: Any, batch: int, gammas: Sequence[int], shapes: Sequence[int], rounds: int,
          alpha: Optional[float] = None, unroll: bool = False) -> Dict[str, Any]:
  """ms per pass of the `loop_settings` loops over one random batch (no row stops early),
  with each speculative loop's target calls and accepted drafts."""
  rng = np.random.default_rng(0)
  tokens = {'encoder_input_tokens': rng.integers(3, 100, (batch, shapes[0])).astype(np.int32),
            'decoder_input_tokens': np.zeros((batch, shapes[1]), np.int32)}
  batches = [partitioning.shard_batch(tokens, harness.partitioner().mesh)]
  settings = loop_settings(gammas, alpha, unroll)
  compiled = {name: harness.compile_setting(s, pair, batches, eos_id=-1, decode_overrides=o)
              for name, (s, o) in settings.items()}
  outputs = harness.warm({n: c.one_pass for n, c in compiled.items()})
  times = policy.round_robin({n: c.one_pass for n, c in compiled.items()}, rounds)
  # One self-attention cache layer of the target: a copy or conversion this large inside a
  # loop body is a cache-sized one (on XLA:CPU, bfloat16 caches are converted around updates).
  config = pair.configs['target']
  layer = batch * config.num_heads * config.head_dim * shapes[1] * np.dtype(config.dtype).itemsize
  out = {}
  for name, (setting, overrides) in settings.items():
    c = compiled[name]
    text = c.predictor.compile(None, batches[0], c.keys[0][0]).as_text()
    loops_seen = xla.summarize_loops(xla.loop_report(text, layer))
    row = {'ms_per_pass': harness.ms_per(times[name], 1),
           'compile_s': c.info()['compile_s'], 'cache_sized_copies': loops_seen['big_copies'],
           'cache_sized_converts': loops_seen['big_converts']}
    stats = harness.collect(outputs[name], batch)['stats']
    if stats:
      row.update(target_calls=int(np.max(stats['target_calls'])),
                 accepted=int(stats['accepted'].sum()), proposed=int(stats['proposed'].sum()),
                 rejected=int(stats['rollbacks'].sum()), gamma=setting.gamma,
                 unrolled=overrides.get('unroll_draft', False))
    out[name] = row
  return out


def block(size: str, batch: int, args: argparse.Namespace) -> Dict[str, Any]:
  """Steps (timed, with their compiled costs) and loops (timed and predicted from the steps)."""
  target = scale.model_config('tiny' if args.tiny else size)
  draft = scale.model_config('tiny_draft' if args.tiny else scale.DRAFT)
  pair = random_pair(target, draft, args.param_dtype)
  shapes = TINY_SHAPES if args.tiny else (args.input_length, args.output_length)
  ks = {'target': sorted({1} | {g + 1 for g in args.gammas}), 'draft': [1, 2]}
  timed = {name: harness.step_times_ms(pair, name, batch, widths, args.rounds, shapes=shapes)
           for name, widths in ks.items()}
  steps = step_costs(pair, batch, ks, shapes)
  for name, widths in timed.items():
    for k, ms in widths.items():
      step = steps[name][str(k)]
      step.update(measured_ms=ms, achieved_gbs=step['bytes_accessed'] / ms / 1e6)
  loop = loops(pair, batch, args.gammas, shapes, args.rounds, args.alpha, args.unroll_draft)
  c = timed['draft'][1] / timed['target'][1]
  for row in loop.values():
    g = row.get('gamma', 0)
    # Each iteration: a 2-token draft call, g - 1 one-token calls, one verify call (g = 0: one
    # 1-token target step); the rows that decode longest set the number of iterations.
    iteration = timed['target'][g + 1] + (
        timed['draft'][2] + (g - 1) * timed['draft'][1] if g else 0.0)
    row['predicted_ms'] = row.get('target_calls', shapes[1]) * iteration
    row['speedup'] = loop['target-only']['ms_per_pass'] / row['ms_per_pass']
    if g:
      alpha = costs.row_alpha(row['accepted'], row['rejected'])
      row.update(alpha=alpha, c=c, tokens_per_call=shapes[1] / row['target_calls'],
                 verify=timed['target'][g + 1] / timed['target'][1],
                 paper_formula=costs.expected_tokens(alpha, g) / (g * c + 1))
  return {'steps': steps, 'loops': loop, 'shapes': list(shapes)}


def verdict(key: str, b: Mapping[str, Any]) -> str:
  """Whether speculation pays in a block: its fastest speculative loop against the target
  alone, and against the paper's formula at the measured acceptance and c."""
  name, best = max(((n, r) for n, r in b['loops'].items() if r.get('gamma')),
                   key=lambda item: item[1]['speedup'])
  return (f"{key}: {'pays' if best['speedup'] > 1 else 'does not pay'}: {name} runs "
          f"{best['speedup']:.2f}x the target alone (α {best['alpha']:.2f}, "
          f"{best['tokens_per_call']:.2f} tokens per call, c {best['c']:.3f}, verify "
          f"{best['verify']:.2f}x a step); the paper's formula at that α and c: "
          f"{best['paper_formula']:.2f}x, reached {best['speedup'] / best['paper_formula']:.0%}.")


def markdown(results: Mapping[str, Any]) -> str:
  lines = harness.heading('Accelerator: steps and loops at T5 1.1 shapes', results)
  alpha = results['meta'].get('alpha')
  lines += ["Steps: XLA's flops and bytes accessed of each step compiled alone, the GB/s those "
            "bytes take at the measured time (a step reading its weights at the chip's HBM "
            "bandwidth is as fast as it gets), XLA:TPU's estimate on a TPU. " + (
                f'Speculative loops accept each draft token with probability {alpha:g} '
                '(`fixed_acceptance_rule`, benchmarks only).' if alpha is not None else
                'Speculative loops greedy (random weights: few draft tokens accepted).'), '']
  lines += [f'- {verdict(key, b)}' for key, b in results['blocks'].items()] + ['']
  for key, b in results['blocks'].items():
    lines += [f'## {key} (input, output: {b["shapes"]})', '']
    lines += harness.table(
        ('step', 'measured ms', 'GFLOP', 'MB accessed', 'GB/s at the measured time',
         'XLA:TPU estimate ms'),
        [[f'{name} {k} tokens', f"{s['measured_ms']:.3f}", f"{s['flops'] / 1e9:.3f}",
          f"{s['bytes_accessed'] / 1e6:.1f}", f"{s['achieved_gbs']:.0f}",
          harness.fmt(s.get('optimal_seconds', 0) * 1e3 or None, '.4f')]
         for name, widths in b['steps'].items() for k, s in widths.items()]) + ['']
    lines += harness.table(
        ('loop', 'ms per pass', 'predicted from steps ms', 'target calls', 'accepted',
         'compile s', 'cache-sized copies / converts in loop bodies'),
        [[name, f"{r['ms_per_pass']:.1f}", harness.fmt(r.get('predicted_ms'), '.1f'),
          str(r.get('target_calls', '')), str(r.get('accepted', '')), f"{r['compile_s']:.0f}",
          f"{r['cache_sized_copies']} / {r['cache_sized_converts']}"]
         for name, r in b['loops'].items()]) + ['']
  return '\n'.join(lines)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
  p = harness.parser(__doc__, sentences='', rounds=5)
  p.set_defaults(machine='gpu')
  p.add_argument('--sizes', default='large,xl')
  p.add_argument('--batches', default='1,8')
  p.add_argument('--gammas', default='3,5')
  p.add_argument('--input_length', type=int, default=scale.INPUT_LENGTH)
  p.add_argument('--output_length', type=int, default=128)
  p.add_argument('--param_dtype', default='bfloat16')
  p.add_argument('--tiny', action='store_true', help='tiny configs and shapes (any machine)')
  p.add_argument('--alpha', type=float, default=None,
                 help='benchmarks only: accept each draft token with this probability '
                      '(fixed_acceptance_rule; T=1)')
  p.add_argument('--unroll_draft', action='store_true',
                 help='also time each speculative loop with its draft calls unrolled')
  args = p.parse_args(argv)
  args.gammas = harness.parse_ints(args.gammas, '--gammas')
  if args.alpha is not None and not 0 <= args.alpha <= 1:
    raise SystemExit(f'error: --alpha must be in [0, 1], got {args.alpha}')
  results = {'meta': harness.meta(NAME, argv, args, alpha=args.alpha,
                                  param_dtype=args.param_dtype), 'blocks': {}}
  for size in (['tiny'] if args.tiny else args.sizes.split(',')):
    for batch in harness.parse_ints(args.batches, '--batches'):
      results['blocks'][f'{size} b{batch}'] = block(size, batch, args)
      paths = harness.write_results(args, NAME, results, markdown)
      print(verdict(f'{size} b{batch}', results['blocks'][f'{size} b{batch}']), flush=True)
  print('wrote', *paths)
  return results


if __name__ == '__main__':
  main()
