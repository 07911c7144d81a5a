"""Where decode time goes: step costs, a kernel breakdown, the loop's own overhead, one iteration.

  python -m benchmarks.profile                                   # all four parts
  python -m benchmarks.profile --parts steps,iteration --sentences 1:40,8:96 --gammas 1,2

steps: per batch size, the embedded target's cached decode step appending k tokens per row
  (--steps) and the draft's (k = 1, 2), timed as the loops run them (harness.step_times_ms),
  against the machine's weight-streaming floor (memory bandwidth) and compute floor (matmul
  peak) of the same step.
kernels: runs one cached target step (each --trace_steps k, jitted alone) and whole decodes
  (target-only greedy, and greedy speculative at the largest --gammas value, over the batch's
  sentences at one encoder width) under `jax.profiler`, and joins the trace's per-kernel events
  (XLA:CPU emits one per thunk: a fusion, a library matmul, a copy, ...) with the compiled HLO,
  so each kernel is named by what it computes: time by kernel kind and the matmuls by output
  shape, per call (steps) or per sentence (decodes). The profiler adds some overhead per kernel:
  read the shares, not the absolute times.
overhead: the engine's own costs on a random fp32 T5-small-sized model (no trained weights):
  a cached step appending k = 1, 4, 8 tokens per row at batch 1, jitted alone and dispatched
  (the price of a verify call relative to one autoregressive step), and per batch size the
  time per generated token of target-only greedy decoding vs greedy speculative decoding with
  gamma = 4 and the draft = the target (alpha = 1; nothing stops early). With c = 1 the
  analytic speedup is (gamma + 1) / (gamma + 1) = 1, so the gap to 1x is the loop's own cost.
iteration: per batch size, greedy target-only and greedy speculative decoding (each --gammas)
  of the first test sentences, each compiled twice: decoding the whole output, and stopping
  after one loop iteration (`max_decode_steps=1`). The difference of the two, divided by the
  iterations the whole decode ran beyond the first (the slowest row's target calls, from
  `DecodeStats`), is the cost of one iteration as the loop really pays it: draft calls, verify
  call and bookkeeping together. The one-iteration pass is what the batch pays besides: the
  encoders, the caches and one iteration. Unlike single-step timings these include everything
  in the compiled loop; they cannot say which part of an iteration costs what.

All timed passes of a part run round-robin (see benchmarks.harness).
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import re
import tempfile
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from benchmarks.harness import Setting
from speculative_t5x import data
from speculative_t5x import network
from speculative_t5x import partitioning
from speculative_t5x import pipeline
from speculative_t5x import policy

NAME = 'profile'
PARTS = ('steps', 'kernels', 'overhead', 'iteration')
TRACE_RUNS = 30  # traced calls of a single step (one pass for a decode)
OVERHEAD_CONFIG = network.T5Config(
    vocab_size=32128, emb_dim=512, num_heads=6, head_dim=64, num_encoder_layers=8,
    num_decoder_layers=8, mlp_dim=1024, mlp_activations=('gelu', 'linear'), dropout_rate=0.0)
OVERHEAD_INPUT_LENGTH = 32
OVERHEAD_GAMMA = 4


def parse_args(argv: Optional[Sequence[str]]) -> Any:
  p = harness.parser(__doc__, sentences='1:40,8:96', gammas='1,2,3', rounds=5)
  p.add_argument('--parts', default=','.join(PARTS), help=f'any of {",".join(PARTS)}')
  p.add_argument('--steps', default='1,2,3,4,5,6,7,8,9,11',
                 help='tokens per row of the timed target steps (steps part)')
  p.add_argument('--trace_steps', default='1,5',
                 help='tokens per row of the profiled target steps (kernels part)')
  args = p.parse_args(argv)
  args.parts = [part for part in args.parts.split(',') if part]
  unknown = set(args.parts) - set(PARTS)
  if unknown or not args.parts:
    raise SystemExit(f'error: unknown --parts {sorted(unknown)}; any of {",".join(PARTS)}')
  args.gammas = harness.parse_gammas(args.gammas, auto=False)
  args.steps = harness.parse_ints(args.steps, '--steps')
  args.trace_steps = harness.parse_ints(args.trace_steps, '--trace_steps')
  return args


# ------------------------------------------------------------------------------------------------
# steps


def step_costs(pair: pipeline.Pair, sizes: Mapping[int, int], chunk_sizes: Sequence[int]
               ) -> Dict[str, Any]:
  """The machine's floors and, per batch size, target and draft step times against them."""
  probes = harness.probe_machine(pair)
  out = {'probes': probes, 'batches': {}}
  for batch in sizes:
    target = harness.step_times_ms(pair, 'target', batch, chunk_sizes)
    out['batches'][batch] = {
        'target_ms': target, 'draft_ms': harness.step_times_ms(pair, 'draft', batch, (1, 2)),
        'compute_floor_ms': {k: harness.compute_floor_ms(pair.target_config, batch, k,
                                                         probes['matmul_gflops'])
                             for k in target}}
    print(f'steps, batch {batch}: target ' + ', '.join(f'k={k}: {v:.2f} ms'
                                                        for k, v in target.items()), flush=True)
  return out


# ------------------------------------------------------------------------------------------------
# kernels


def kernel_descriptions(hlo_text: str) -> Dict[str, Tuple[str, str]]:
  """{instruction name: (kind, output shape)} for every instruction of a compiled HLO module.

  kind is the fusion's name stem (XLA names fusions after their ops, e.g. 'copy_bitcast_fusion')
  or the op itself; '(matmul)' is appended when a fusion's computation contains a dot.
  """
  computations, current = {}, None
  for line in hlo_text.splitlines():
    header = re.match(r'^(?:ENTRY )?%?([\w.\-]+) .*\{$', line)
    if header and not line.startswith(' '):
      current = header.group(1)
      computations[current] = []
    elif current and line.strip() not in ('', '}'):
      computations[current].append(line.strip())
  out = {}
  for lines in computations.values():
    for line in lines:
      m = re.match(r'(?:ROOT )?%?([\w.\-]+) = (\S+) ([\w\-]+)\(', line)
      if not m:
        continue
      name, shape, op = m.groups()
      kind = name.rsplit('.', 1)[0] if op == 'fusion' else op
      called = re.search(r'calls=%?([\w.\-]+)', line)
      if op == 'dot' or (called and any(' dot(' in x for x in
                                        computations.get(called.group(1), []))):
        kind += ' (matmul)'
      out[name] = (kind, shape.split('{')[0])
  return out


def trace_kernels(fn: Callable[[], Any], hlo_text: str, runs: int, per: float
                  ) -> Dict[str, Any]:
  """Traces `runs` calls of fn (warm) and returns the kernel breakdown divided by `per`: wall
  ms, kernel ms and count, and the top kinds and matmul output shapes (us, share, count)."""
  described = kernel_descriptions(hlo_text)
  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir)
    seconds = policy.round_robin({'traced': fn}, runs)['traced']
    jax.profiler.stop_trace()
    trace = sorted(glob.glob(f'{trace_dir}/plugins/profile/*/*.trace.json.gz'))[-1]
    with gzip.open(trace) as f:
      events = [e for e in json.load(f)['traceEvents']
                if e.get('ph') == 'X' and e['name'] in described]
  us, count = collections.Counter(), collections.Counter()
  shape_us, shape_count = collections.Counter(), collections.Counter()
  for e in events:
    kind, shape = described[e['name']]
    us[kind] += e['dur'] / per
    count[kind] += 1 / per
    if 'matmul' in kind or kind.startswith('ynn_fusion'):
      shape_us[shape] += e['dur'] / per
      shape_count[shape] += 1 / per
  total = sum(us.values())
  table = lambda times, counts, n: [{'name': k, 'us': v, 'share': v / total, 'count': counts[k]}
                                    for k, v in times.most_common(n)]
  return {'wall_ms': 1e3 * sum(seconds) / per, 'kernel_ms': total / 1e3,
          'kernels': sum(count.values()), 'by_kind': table(us, count, 15),
          'by_shape': table(shape_us, shape_count, 12)}


def kernels(pair: pipeline.Pair, sizes: Mapping[int, int], sources: Sequence[str],
            args: Any) -> Dict[str, Any]:
  """Kernel breakdowns of single target steps and of whole decodes, per batch size."""
  out = {}
  for batch, count in sizes.items():
    module, variables, cache = harness.step_setup(pair, 'target', batch)
    step = jax.jit(lambda v, t, c: module.apply(v, t, c, method=network.Transformer.decode_step))
    for k in args.trace_steps:
      tokens = jnp.full((batch, k), 5, jnp.int32)
      compiled = step.lower(variables, tokens, cache).compile()
      fn = lambda c=compiled, t=tokens: c(variables, t, cache)
      jax.block_until_ready(fn())
      out[f'target step, batch {batch}, {k} token(s) per row (per call)'] = trace_kernels(
          fn, compiled.as_text(), TRACE_RUNS, TRACE_RUNS)
    rows = data.encode(sources[:count], harness.INPUT_LENGTH)
    # One width for all batches: one compiled program to join the trace with.
    width = data.input_width(rows, harness.INPUT_LENGTH, args.input_length_step)
    batches = harness.make_batches(rows, batch, width=width)
    for setting in (Setting('baseline'), Setting('speculative', gamma=max(args.gammas))):
      run = harness.compile_setting(setting, pair, batches)
      hlo = run.predictor.compile(None, batches[0], run.rngs[0]).as_text()
      jax.block_until_ready(run.one_pass())
      title = (f'{setting.name}, batch {batch}, {len(rows)} test sentences, encoder width '
               f'{width} (per sentence: encoders and the whole decode)')
      out[title] = trace_kernels(run.one_pass, hlo, 1, len(rows))
    print(f'kernels, batch {batch}: traced', flush=True)
  return out


# ------------------------------------------------------------------------------------------------
# overhead


def random_batch(batch: int, vocab_size: int) -> Dict[str, jax.Array]:
  """A predict batch of random inputs, OVERHEAD_INPUT_LENGTH tokens wide, on the mesh."""
  tokens = jax.random.randint(jax.random.PRNGKey(2), (batch, OVERHEAD_INPUT_LENGTH), 2,
                              vocab_size)
  return partitioning.shard_batch(
      {'encoder_input_tokens': np.asarray(tokens),
       'decoder_input_tokens': np.zeros((batch, harness.OUTPUT_LENGTH), np.int32)},
      harness.partitioner().mesh)


def overhead(sizes: Mapping[int, int], rounds: int) -> Dict[str, Any]:
  """Dispatched steps and the loop's own cost on a random T5-small-sized model."""
  # Jitted: op by op, initialising even a tiny model takes seconds.
  params = jax.jit(lambda rng: network.init_params(OVERHEAD_CONFIG, rng)[0])(
      jax.random.PRNGKey(0))
  pair = harness.make_pair(OVERHEAD_CONFIG, OVERHEAD_CONFIG, {'target': params, 'draft': params})
  c = OVERHEAD_CONFIG
  out = {'config': f'emb {c.emb_dim}, {c.num_heads}x{c.head_dim} heads, {c.num_encoder_layers}+'
                   f'{c.num_decoder_layers} layers, mlp {c.mlp_dim}, vocab {c.vocab_size}, '
                   f'{c.dtype}',
         'step_ms': harness.dispatched_step_ms(pair, 'target', 1, (1, 4, 8)), 'loop': {}}
  print('overhead: dispatched step, batch 1: ' + ', '.join(
      f'k={k}: {v:.2f} ms' for k, v in out['step_ms'].items()), flush=True)
  settings = {'baseline': Setting('baseline'),
              f'speculative_gamma{OVERHEAD_GAMMA}': Setting('speculative', gamma=OVERHEAD_GAMMA)}
  for batch in sizes:
    batches = [random_batch(batch, OVERHEAD_CONFIG.vocab_size)]
    # EOS = -1: nothing stops early, every row makes OUTPUT_LENGTH tokens.
    compiled = {n: harness.compile_setting(s, pair, batches, eos_id=-1)
                for n, s in settings.items()}
    outputs = harness.warm({n: c.one_pass for n, c in compiled.items()})
    times = policy.round_robin({n: c.one_pass for n, c in compiled.items()}, rounds)
    row = {n: {'ms_per_token': harness.ms_per(times[n], harness.OUTPUT_LENGTH),
               'compile_s': c.info()['compile_s'],
               'target_calls': float(np.mean(outputs[n][0][1]['stats']['target_calls']))}
           for n, c in compiled.items()}
    row['speedup'] = harness.speedups(times, 'baseline')[f'speculative_gamma{OVERHEAD_GAMMA}']
    out['loop'][batch] = row
    print(f"overhead, batch {batch}: speculative/baseline with alpha = 1, c = 1: "
          f"{row['speedup']['speedup']:.2f}x", flush=True)
  return out


# ------------------------------------------------------------------------------------------------
# iteration


def iteration(pair: pipeline.Pair, sizes: Mapping[int, int], sources: Sequence[str],
              args: Any) -> Dict[str, Any]:
  """Per batch size: what one loop iteration costs inside a whole decode, and the rest."""
  settings = [Setting('baseline')] + [Setting('speculative', gamma=g) for g in args.gammas]
  out = {}
  for batch_size, count in sizes.items():
    batches = harness.make_batches(data.encode(sources[:count], harness.INPUT_LENGTH),
                                   batch_size, args.input_length_step)
    passes, iterations = {}, {}
    for s in settings:
      for steps in (None, 1):
        passes[s, steps] = harness.compile_setting(
            s, pair, batches,
            decode_overrides=None if steps is None else {'max_decode_steps': steps}).one_pass
    outputs = harness.warm(passes)
    for s in settings:
      # Iterations of a batch: its slowest row's target calls.
      iterations[s] = sum(int(np.asarray(aux['stats']['target_calls']).max())
                          for _, aux in outputs[s, None])
    times = {k: float(np.median(t)) for k, t in policy.round_robin(passes, args.rounds).items()}
    out[batch_size] = iteration_rows(settings, times, iterations, len(batches), count)
  return out


def iteration_rows(settings: Sequence[Setting], times: Mapping[Any, float],
                   iterations: Mapping[Setting, int], num_batches: int, count: int
                   ) -> Dict[str, Any]:
  # Seconds of one loop iteration beyond each batch's first.
  one = {s: (times[s, None] - times[s, 1]) / max(iterations[s] - num_batches, 1)
         for s in settings}
  base = settings[0]
  rows = [{'name': s.name, 'ms_per_batch': 1e3 * times[s, None] / num_batches,
           'iteration_ms': 1e3 * one[s], 'iteration_vs_target_only': one[s] / one[base],
           'iterations_per_batch': iterations[s] / num_batches,
           'one_iteration_pass_ms_per_batch': 1e3 * times[s, 1] / num_batches,
           'speedup': times[base, None] / times[s, None]} for s in settings]
  for r in rows:
    print(f"iteration, {r['name']}: {r['ms_per_batch']:.1f} ms a batch; one iteration "
          f"{r['iteration_ms']:.2f} ms ({r['iteration_vs_target_only']:.2f}x target-only's)",
          flush=True)
  return {'num_sentences': count, 'num_batches': num_batches, 'rows': rows}


# ------------------------------------------------------------------------------------------------
# Reporting.


def steps_markdown(part: Mapping[str, Any]) -> List[str]:
  probes = part['probes']
  lines = ['## Step costs (timed as the loops run them)', '',
           f"Memory bandwidth {probes['memory_bandwidth_gbs']:.1f} GB/s (weight-streaming floor "
           f"of a step: target {probes['weight_streaming_floor_ms']['target']:.2f} ms, draft "
           f"{probes['weight_streaming_floor_ms']['draft']:.2f} ms); matmul peak "
           f"{probes['matmul_gflops']:.0f} GFLOP/s (a 1024x1024 matmul).", '']
  for batch, b in part['batches'].items():
    one = b['target_ms']['1']
    lines += [f"Batch {batch}: draft k=1 {b['draft_ms']['1']:.2f} ms, k=2 "
              f"{b['draft_ms']['2']:.2f} ms.", '']
    lines += harness.table(('target k', 'ms', '/ k=1', 'compute floor ms'), [
        [k, f'{v:.2f}', f'{v / one:.2f}x', f"{b['compute_floor_ms'][k]:.2f}"]
        for k, v in b['target_ms'].items()]) + ['']
  return lines


def kernels_markdown(part: Mapping[str, Any]) -> List[str]:
  lines = ['## Kernel breakdown (under jax.profiler: read the shares)', '']
  for title, t in part.items():
    lines += [f'### {title}', '', f"wall (traced) {t['wall_ms']:.2f} ms, kernels "
              f"{t['kernel_ms']:.2f} ms in {t['kernels']:.0f} kernels", '']
    for key, column in (('by_kind', 'kernel kind'), ('by_shape', 'matmul output shape')):
      lines += harness.table((column, 'us', 'share', 'count'), [
          [r['name'], f"{r['us']:.0f}", f"{r['share']:.0%}", f"{r['count']:.1f}"]
          for r in t[key]]) + ['']
  return lines


def overhead_markdown(part: Mapping[str, Any]) -> List[str]:
  lines = [f"## Loop overhead (random model: {part['config']})", '',
           'Dispatched cached step, batch 1: ' + ', '.join(
               f'k={k}: {v:.2f} ms' for k, v in part['step_ms'].items()) + '.', '']
  rows = []
  for batch, row in part['loop'].items():
    for name, r in row.items():
      if name != 'speedup':
        rows.append([batch, name, f"{r['ms_per_token']:.2f}", f"{r['target_calls']:.0f}",
                     f"{r['compile_s']:.1f}"])
    rows.append([batch, 'speedup (alpha = 1, c = 1)', f"{row['speedup']['speedup']:.2f}x", '',
                 ''])
  return lines + harness.table(('batch', 'decoder', 'ms/token', 'target calls', 'compile s'),
                               rows) + ['']


def iteration_markdown(part: Mapping[str, Any]) -> List[str]:
  lines = ['## One loop iteration inside a whole decode', '']
  for batch, block in part.items():
    lines += [f"Batch {batch} ({block['num_sentences']} sentences, {block['num_batches']} "
              'batches):', '']
    lines += harness.table(
        ('decoder', 'ms a batch', 'one iteration ms', 'vs target-only', 'iterations a batch',
         'one-iteration pass ms', 'speedup'),
        [[r['name'], f"{r['ms_per_batch']:.1f}", f"{r['iteration_ms']:.2f}",
          f"{r['iteration_vs_target_only']:.2f}x", f"{r['iterations_per_batch']:.2f}",
          f"{r['one_iteration_pass_ms_per_batch']:.1f}", f"{r['speedup']:.2f}x"]
         for r in block['rows']]) + ['']
  return lines


def markdown(results: Mapping[str, Any]) -> str:
  lines = harness.heading('Where decode time goes', results)
  render = {'steps': steps_markdown, 'kernels': kernels_markdown,
            'overhead': overhead_markdown, 'iteration': iteration_markdown}
  for part in PARTS:
    if part in results:
      lines += render[part](results[part])
  return '\n'.join(lines)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
  args = parse_args(argv)
  sizes = harness.parse_sentences(args.sentences)
  sources, _ = harness.test_split(args.data_dir)
  pair = harness.load_pair()
  results = {'meta': harness.meta(NAME, argv, args)}
  run = {'steps': lambda: step_costs(pair, sizes, args.steps),
         'kernels': lambda: kernels(pair, sizes, sources, args),
         'overhead': lambda: overhead(sizes, args.rounds),
         'iteration': lambda: iteration(pair, sizes, sources, args)}
  for part in PARTS:
    if part in args.parts:
      start = time.perf_counter()
      results[part] = run[part]()
      results['meta'][f'{part}_seconds'] = time.perf_counter() - start
      paths = harness.write_results(args, NAME, results, markdown)
  print('wrote', *paths)
  return results


if __name__ == '__main__':
  main()
