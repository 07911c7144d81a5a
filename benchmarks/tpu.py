"""What XLA:TPU compiles for T5 1.1 large / XL / XXL with a small draft, on this CPU, no TPU.

  python -m benchmarks.scale --platform tpu --topology v4:1x1x1,v5e:2x4,v5p:2x2x1,v6e:2x4
  python -m benchmarks.scale --platform tpu --tiny --topology v5e:2x2     # seconds

Needs libtpu, pinned to the installed jax, best in a venv of its own (it makes every JAX run
there print libtpu warnings): `pip install 'jax[tpu]==<jax version>' && pip install -e .`.
`jax.experimental.topologies` gives the topology's TPU devices; every program is lowered with
NamedShardings over a mesh of them and compiled by XLA:TPU, never run. Per (topology, target
size, batch, mesh) and per draft ('small': T5 1.1 small with its own encoder; 'small-dec2': two
decoder layers of T5 1.1 small's widths reading the target's encoder, the embedded draft's
shape) it reports:

  - the predict programs (greedy target-only, greedy speculative at --gamma, the draft
    replicated): bytes per device against the chip's HBM, the collectives of one iteration of
    each loop, cache-sized copies and host transfers inside loop bodies;
  - XLA:TPU's `optimal_seconds` of the step programs (target at 1 and gamma + 1 tokens, draft at
    1 and 2, the prefill: encoder and caches) and of one iteration of each loop, compiled as a
    program without loops (`decoding.loop_iteration`: a program with a while loop gets a
    negative estimate), greedy and at temperature 1;
  - the loop's own work: an iteration's time, ops and bytes beyond its model calls.

`tpu_speedup.md` (written beside) turns the figures into the speedup XLA:TPU's model predicts.
These are a compiler's estimates of a program's time on an idle chip, not timings.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from typing import Any, Dict, List, Mapping, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import partitioning as nn_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from benchmarks import compiled as xla
from benchmarks import harness
from benchmarks import roofline
from benchmarks import scale
from speculative_t5x import decoding
from speculative_t5x import models
from speculative_t5x import network
from speculative_t5x import partitioning

# HBM per chip, GiB (Cloud TPU's published figures); a chip's TensorCores that JAX shows as
# separate devices (v4 here) share it.
HBM_GIB = {'TPU v4': 32, 'TPU v5 lite': 16, 'TPU v5': 95, 'TPU v6 lite': 32}
DRAFTS = ('small', 'small-dec2')
REPLICATED = partitioning.DRAFT_REPLICATED


def topology_devices(name: str) -> List[Any]:
  """The TPU devices of topology `name` ('v5e:2x4'); one line (SystemExit) when libtpu is
  missing or does not know it. A topology smaller than libtpu's default host (2x2x1) is
  described as a host of its own size."""
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  # libtpu takes a lock file that keeps a second process off the chips; compiling touches no
  # chip, so two sweeps (or a sweep and the tests) may share this machine.
  os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
  try:
    return list(topologies.get_topology_desc(topology_name=name, platform='tpu').devices)
  except Exception as error:  # pylint: disable=broad-except
    message = str(error).splitlines()[0] if str(error) else type(error).__name__
    if 'not divisible' in message:
      dims = tuple(int(d) for d in name.split(':')[1].split('x'))
      bounds = (dims + (1, 1, 1))[:3]
      return list(topologies.get_topology_desc(topology_name=name, platform='tpu',
                                               chips_per_host_bounds=bounds).devices)
    raise SystemExit(f'error: XLA:TPU cannot describe topology {name!r} ({message}); libtpu '
                     "must be installed (pip install 'jax[tpu]==" + jax.__version__ + "') and "
                     'know it (v4:2x2x1, v5e:2x4, v5p:2x2x1, v6e:2x4, ...).') from None


def hbm_bytes(devices: Sequence[Any]) -> int:
  """HBM one device may use: its chip's, split among the chip's devices."""
  kind = devices[0].device_kind
  if kind not in HBM_GIB:
    raise SystemExit(f'error: no HBM figure for {kind!r}; known: {", ".join(HBM_GIB)}.')
  chips = {tuple(d.coords) for d in devices}
  return HBM_GIB[kind] * 2**30 * len(chips) // len(devices)


def draft_config(name: str, target: network.T5Config) -> network.T5Config:
  """'small' (T5 1.1 small) or 'small-dec2' (its widths, 2 decoder layers, no encoder: reads
  the target's encoder output); tiny configs under --tiny."""
  base = scale.model_config('tiny_draft' if target.vocab_size == scale.TINY['target'][
      'vocab_size'] else 'small')
  if name == 'small':
    return base
  return network.T5Config(**{**base.__dict__, 'num_encoder_layers': 0,
                             'num_decoder_layers': 2, 'encoded_width': target.emb_dim})


def estimate(program: Any) -> Dict[str, Any]:
  """XLA:TPU's cost figures of a compiled program and its entry's op count."""
  module = xla.Module.parse(program.as_text())
  return {**xla.cost(program), 'ops': xla.entry_ops(module), 'memory': xla.memory(program),
          'collectives': xla.collectives(module.instructions(module.entry, into_loops=True))}


def state_shardings(state: decoding.LoopState, mesh: Any, rules: Mapping[str, Any]) -> Any:
  """LoopState shardings: rows over 'data', caches by their rules, the key replicated."""
  data = NamedSharding(mesh, PartitionSpec('data'))
  rows = jax.tree.map(lambda _: data, state.replace(target_cache=None, draft_cache=None,
                                                    rng=None))
  return rows.replace(
      target_cache=partitioning.cache_shardings(state.target_cache, mesh, rules['target']),
      draft_cache=partitioning.cache_shardings(state.draft_cache, mesh, rules['draft']),
      rng=NamedSharding(mesh, PartitionSpec()))


def iteration_program(model: models.EncoderDecoderModel, mesh: Any, params: Any,
                      caches: Tuple[Any, Any], output_length: int, gamma: int,
                      temperature: float) -> Dict[str, Any]:
  """`decoding.loop_iteration` compiled with the predict program's shardings."""
  rules = partitioning.standard_logical_axis_rules()
  all_rules = partitioning.model_rules(model, mesh, rules, REPLICATED)
  batch = caches[0].index.shape[0]
  inputs = jax.ShapeDtypeStruct((batch, output_length), jnp.int32)
  start = functools.partial(decoding.start_loop, gamma=gamma, max_decode_steps=None,
                            initial_index=None)
  state, forced, limit = jax.eval_shape(start, inputs, *caches, jax.random.PRNGKey(0))
  data = NamedSharding(mesh, PartitionSpec('data'))
  shardings = state_shardings(state, mesh, all_rules)
  pair = partitioning.pair_shardings(model, mesh, rules, params, REPLICATED)

  def one(p, s, f, l):
    fn = lambda name, module: models.make_tokens_to_logits(module, p[name], p['decode'][name])
    with nn_partitioning.axis_rules(rules):
      return decoding.loop_iteration(s, f, l, fn('target', model.module),
                                     fn('draft', model.draft_module), model.eos_id, gamma,
                                     temperature)

  fn = jax.jit(one, in_shardings=(pair, shardings, data, data), out_shardings=shardings,
               donate_argnums=1)
  program, seconds = xla.time_compile(lambda: fn.lower(params, state, forced, limit).compile())
  return {'compile_s': seconds, **estimate(program)}


def prefill_program(model: models.EncoderDecoderModel, mesh: Any, params: Any, batch: int,
                    input_length: int, output_length: int) -> Dict[str, Any]:
  """The encoder and both caches of one batch (`init_caches`), as a predict runs it once."""
  rules = partitioning.standard_logical_axis_rules()
  pair = partitioning.pair_shardings(model, mesh, rules, params, REPLICATED)
  data = NamedSharding(mesh, PartitionSpec('data'))

  def prefill(p, tokens):
    with nn_partitioning.axis_rules(rules):
      return model.init_caches(p, tokens, output_length)

  tokens = jax.ShapeDtypeStruct((batch, input_length), jnp.int32)
  program, seconds = xla.time_compile(
      lambda: jax.jit(prefill, in_shardings=(pair, data)).lower(params, tokens).compile())
  return {'compile_s': seconds, **estimate(program)}


def fit(memory: Mapping[str, int], hbm: int) -> Dict[str, Any]:
  """Bytes a program needs per device (arguments + outputs + temporaries, aliases once)."""
  need = (memory['argument_bytes'] + memory['output_bytes'] + memory['temp_bytes'] -
          memory['alias_bytes'])
  return {'bytes': need, 'hbm': hbm, 'fits': need <= hbm, 'short_by': max(need - hbm, 0)}


def predict_program(model: models.EncoderDecoderModel, mesh: Any, params: Any, batch: int,
                    input_length: int, output_length: int, hbm: int,
                    big_bytes: int) -> Dict[str, Any]:
  """A whole predict program: its fit in HBM, loop collectives, copies and host transfers."""
  shapes = scale.abstract_batch(batch, input_length, output_length)
  out = scale.predict_program(model, mesh, params, shapes, REPLICATED, big_bytes)
  out['fit'] = fit(out['memory'], hbm)
  return out


def pair_of(size: str, draft: str, dtype: str
            ) -> Tuple[network.T5Config, network.T5Config, Any]:
  """Configs and abstract parameters (with decode variables) of target `size` and `draft`."""
  target = scale.model_config(size)
  config = draft_config(draft, target)
  return target, config, scale.abstract_params(target, config, dtype)


def draft_figures(size: str, draft: str, mesh: Any, batch: int, args: argparse.Namespace,
                  hbm: int, with_target: bool) -> Dict[str, Any]:
  """Every program of one draft (and, with_target, the target's own) at one block."""
  target, config, params = pair_of(size, draft, args.param_dtype)
  model = scale.decoder(target, config, args.gamma)
  caches = jax.eval_shape(lambda p, t: model.init_caches(p, t, args.output_length), params,
                          jax.ShapeDtypeStruct((batch, args.input_length), jnp.int32))
  rules = partitioning.model_rules(model, mesh, draft_placement=REPLICATED)
  big = scale.layer_cache_bytes(dict(zip(('target', 'draft'), caches)), mesh, rules)
  step = lambda name, cfg, cache, k: scale.step_program(
      cfg, params[name], params['decode'][name], cache, mesh, rules[name], k)
  predict = lambda m: predict_program(m, mesh, params, batch, args.input_length,
                                      args.output_length, hbm, big)
  out = {'predict': predict(model), 'prefill': prefill_program(
             model, mesh, params, batch, args.input_length, args.output_length),
         'draft_steps': {str(k): step('draft', config, caches[1], k) for k in (1, 2)},
         'iterations': {}}
  temperatures = {'greedy': 0.0, 't1': 1.0}
  for gamma in args.gammas:
    for name, temperature in temperatures.items():
      out['iterations'][f'{name} {gamma}'] = iteration_program(
          model, mesh, params, caches, args.output_length, gamma, temperature)
  if with_target:
    out['target_predict'] = predict(scale.decoder(target, config, 0))
    ks = sorted({1} | {g + 1 for g in args.gammas})
    out['target_steps'] = {str(k): step('target', target, caches[0], k) for k in ks}
    out['target_iterations'] = {
        name: iteration_program(model, mesh, params, caches, args.output_length, 0, t)
        for name, t in temperatures.items()}
  return out


def block(topology: str, devices: Sequence[Any], size: str, mesh_shape: Tuple[int, int],
          batch: int, args: argparse.Namespace) -> Dict[str, Any]:
  """Both drafts' programs and the target's at one (topology, size, mesh, batch)."""
  mesh = partitioning.create_mesh(mesh_shape, devices=devices)
  hbm = hbm_bytes(devices)
  out = {'topology': topology, 'device_kind': devices[0].device_kind, 'size': size,
         'mesh': list(mesh_shape), 'batch': batch, 'hbm_per_device': hbm, 'drafts': {}}
  for index, draft in enumerate(args.drafts):
    figures = draft_figures(size, draft, mesh, batch, args, hbm, with_target=index == 0)
    for key in ('target_predict', 'target_steps', 'target_iterations'):
      if key in figures:
        out[key] = figures.pop(key)
    out['drafts'][draft] = figures
  return out


def meshes(devices: Sequence[Any], spec: str, batch: int) -> List[Tuple[int, int]]:
  """(data, model) meshes of the topology's devices: 'model' (1 x n), 'data' (n x 1), 'both'
  (2 x n/2); a 'data' size that does not divide the batch is skipped."""
  n = len(devices)
  shapes = {'model': (1, n), 'both': (2, n // 2), 'data': (n, 1)}
  out = []
  for name in spec.split(','):
    shape = shapes[name]
    if shape[0] * shape[1] == n and batch % shape[0] == 0 and shape not in out:
      out.append(shape)
  return out


def block_key(topology: str, size: str, mesh: Tuple[int, int], batch: int) -> str:
  return f'{topology} {size} {mesh[0]}x{mesh[1]} b{batch}'


def run(args: argparse.Namespace, results: Dict[str, Any], write: Any) -> Dict[str, Any]:
  """Every block of the sweep (topologies outermost), written after each; kept blocks skip."""
  for topology in args.topologies:
    devices = topology_devices(topology)
    for batch in args.batches:
      for size in args.sizes:
        for mesh_shape in meshes(devices, args.tpu_meshes, batch):
          key = block_key(topology, size, mesh_shape, batch)
          if key in results['blocks']:
            continue
          results['blocks'][key] = block(topology, devices, size, mesh_shape, batch, args)
          print(key, summary_line(results['blocks'][key]), flush=True)
          write(results)
  return results


def summary_line(b: Mapping[str, Any]) -> str:
  step = b['target_steps']['1'].get('optimal_seconds', 0.0)
  parts = [f"target step {step * 1e6:.0f} us, fits {b['target_predict']['fit']['fits']}"]
  for draft, d in b['drafts'].items():
    parts.append(f"{draft}: draft step {d['draft_steps']['1'].get('optimal_seconds', 0) * 1e6:.0f}"
                 f" us, fits {d['predict']['fit']['fits']}")
  return '; '.join(parts)


# Acceptance figures the predictions use: (greedy, T=1).
ALPHAS = {'embedded pair': (0.90, 0.86), 'paper (T5-small for T5-XXL)': (0.75, 0.62)}
PAPER = {'greedy': 3.4, 't1': 2.6}  # the paper's TPU v4 walltime, T5-XXL, T5-small, batch 1


def expected_tokens(alpha: float, gamma: int) -> float:
  """Tokens per iteration (the paper's Eq. 1)."""
  return float(gamma + 1) if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def _seconds(program: Mapping[str, Any]) -> float:
  return float(program.get('optimal_seconds', float('nan')))


def loop_figures(b: Mapping[str, Any], draft: str, setting: str, gamma: int) -> Dict[str, float]:
  """One speculative iteration against the target-only step: c, the verify call over the step,
  the iteration's own overhead (its time, ops and bytes beyond the model calls), seconds."""
  d = b['drafts'][draft]
  step, verify = b['target_steps']['1'], b['target_steps'][str(gamma + 1)]
  first, later = d['draft_steps']['2'], d['draft_steps']['1']
  it, base = d['iterations'][f'{setting} {gamma}'], b['target_iterations'][setting]
  calls = [verify, first] + [later] * (gamma - 1)
  beyond = lambda key: it[key] - sum(p[key] for p in calls)
  return {'step': _seconds(step), 'c': _seconds(later) / _seconds(step),
          'verify': _seconds(verify) / _seconds(step), 'iteration': _seconds(it),
          'target_iteration': _seconds(base),
          'overhead': (_seconds(it) - sum(_seconds(p) for p in calls)) / _seconds(step),
          'target_overhead': (_seconds(base) - _seconds(step)) / _seconds(step),
          'ops_beyond': beyond('ops'), 'target_ops_beyond': base['ops'] - step['ops'],
          'bytes_beyond': beyond('bytes_accessed'),
          'target_bytes_beyond': base['bytes_accessed'] - step['bytes_accessed']}


def predicted(b: Mapping[str, Any], draft: str, setting: str, alpha: float) -> Tuple[int, float]:
  """(best gamma, speedup) XLA:TPU's estimates predict: expected tokens per iteration times
  the target-only iteration over the speculative one."""
  gammas = sorted(int(k.split()[1]) for k in b['drafts'][draft]['iterations']
                  if k.startswith(setting))
  options = [(expected_tokens(alpha, g) * loop_figures(b, draft, setting, g)['target_iteration'] /
              loop_figures(b, draft, setting, g)['iteration'], g) for g in gammas]
  speedup, gamma = max(options)
  return gamma, speedup


def _gib(n: float) -> str:
  return f'{n / 2**30:.2f}'


def fit_cell(p: Mapping[str, Any]) -> str:
  f = p['fit']
  return (f"{_gib(f['bytes'])} of {_gib(f['hbm'])}" +
          ('' if f['fits'] else f" (short {_gib(f['short_by'])})"))


def loop_cell(p: Mapping[str, Any]) -> str:
  loops = p['loops']
  return (f"{roofline.collective_text(loops.get('outer', {}))}; inner "
          f"{roofline.collective_text(loops.get('inner', {}))}; copies "
          f"{loops.get('big_copies', 0)}; host {loops.get('host_transfers', 0)}")


def markdown(results: Mapping[str, Any]) -> str:
  """The TPU tables: fit and loops, step estimates, the loop's own work, predicted speedups."""
  meta = results['meta']
  lines = harness.heading('XLA:TPU-compiled programs (compile-only, no TPU)', results)
  lines += [f"Inputs {meta['input_length']}, outputs {meta['output_length']}, parameters "
            f"{meta['param_dtype']}, the draft replicated; predict programs greedy at γ "
            f"{meta['gamma']}. Blocks: `topology size mesh(data x model) batch`. Times are "
            "XLA:TPU's `optimal_seconds` (a compiler's estimate for an idle chip, a lower "
            'bound, not a timing).', '']
  blocks = results['blocks']
  if not blocks:
    return '\n'.join(lines)
  rows = []
  for key, b in blocks.items():
    for draft, d in b['drafts'].items():
      rows.append([key, draft, fit_cell(b['target_predict']), fit_cell(d['predict']),
                   loop_cell(b['target_predict']), loop_cell(d['predict'])])
  lines += ['## Fit in HBM (GiB per device) and one iteration of each loop', '',
            'Collectives: the outer loop body; inner: the draft loop body (γ − 1 per iteration). '
            'Copies: cache-sized copies in loop bodies; host: host transfers in loop bodies.', '']
  lines += harness.table(['block', 'draft', 'target-only fits', 'speculative fits',
                                'target-only loop', 'speculative loop'], rows) + ['']
  lines += step_lines(blocks) + loop_lines(blocks) + speedup_lines(blocks)
  return '\n'.join(lines)


def step_lines(blocks: Mapping[str, Any]) -> List[str]:
  rows = []
  for key, b in blocks.items():
    steps = b['target_steps']
    us = lambda p: f'{_seconds(p) * 1e6:.1f}'
    cells = [key, us(steps['1'])] + [f"{us(steps[k])} ({_seconds(steps[k]) / _seconds(steps['1']):.2f}x)"
                                     for k in sorted(steps, key=int) if k != '1']
    for d in b['drafts'].values():
      cells += [f"{us(d['draft_steps']['1'])} (c {_seconds(d['draft_steps']['1']) / _seconds(steps['1']):.3f})",
                us(d['prefill'])]
    rows.append(cells)
  first = next(iter(blocks.values()))
  header = (['block', 'target 1 token'] +
            [f'target {k} tokens (x step)' for k in sorted(first['target_steps'], key=int)
             if k != '1'])
  for draft in first['drafts']:
    header += [f'{draft} step (c)', f'prefill with {draft}']
  return ['## Step programs, µs (XLA:TPU optimal_seconds)', ''] + harness.table(
      header, rows) + ['']


def loop_lines(blocks: Mapping[str, Any]) -> List[str]:
  rows = []
  for key, b in blocks.items():
    for draft, d in b['drafts'].items():
      for name in d['iterations']:
        setting, gamma = name.split()
        f = loop_figures(b, draft, setting, int(gamma))
        rows.append([key, draft, setting, gamma, f"{f['target_iteration'] * 1e6:.1f}",
                     f"{f['target_overhead']:.1%}", f"{f['target_ops_beyond']}",
                     f"{f['iteration'] * 1e6:.1f}", f"{f['overhead']:.1%}",
                     f"{f['ops_beyond']}", f"{f['bytes_beyond'] / 1e6:.2f}"])
  return (['## The loop\'s own work: one iteration beyond its model calls', '',
           'Overheads are the iteration\'s estimate minus its calls\' (target-only: one 1-token '
           'step; speculative: the verify call, the draft\'s 2-token first call and γ − 1 '
           '1-token calls), over a target step. Ops: top-level ops of the compiled programs.',
           ''] +
          harness.table(['block', 'draft', 'setting', 'γ', 'target-only iteration µs',
                               'its overhead', 'its ops beyond', 'speculative iteration µs',
                               'its overhead', 'ops beyond', 'MB beyond'], rows) + [''])


def speedup_lines(blocks: Mapping[str, Any]) -> List[str]:
  rows = []
  for key, b in blocks.items():
    for draft in b['drafts']:
      for label, (greedy, t1) in ALPHAS.items():
        cells = [key, draft, label]
        for setting, alpha in (('greedy', greedy), ('t1', t1)):
          gamma, speedup = predicted(b, draft, setting, alpha)
          cells.append(f'{speedup:.2f}x (γ {gamma})')
        rows.append(cells)
  return (['## Speedup XLA:TPU\'s estimates predict over target-only decoding', '',
           'Expected tokens per iteration (1 − α^(γ+1)) / (1 − α) times the target-only '
           'iteration over the speculative one; best compiled γ. The paper (T5-XXL, T5-small, '
           f"one TPU v4, batch 1): {PAPER['greedy']}x greedy (α 0.75), {PAPER['t1']}x at T=1 "
           '(α 0.62).', ''] +
          harness.table(['block', 'draft', 'α (greedy, T=1)', 'greedy', 'T=1'], rows) +
          [''])


def main(args: argparse.Namespace, argv: Sequence[str]) -> Dict[str, Any]:
  """`benchmarks.scale --platform tpu`: the sweep into <out_dir>/tpu.json and tpu.md."""
  args.topologies = [t for t in args.topology.split(',') if t]
  if not args.topologies:
    raise SystemExit('error: --platform tpu needs --topology, e.g. v5e:2x4,v4:1x1x1.')
  for topology in args.topologies:  # a bad name fails before anything compiles
    topology_devices(topology)
  args.drafts = [d for d in args.drafts.split(',') if d]
  if set(args.drafts) - set(DRAFTS):
    raise SystemExit(f'error: --drafts takes {", ".join(DRAFTS)}; got {args.drafts}.')
  args.output_length = args.output_lengths[0]
  args.gammas = sorted(set(args.gammas) | {args.gamma})
  path = harness.out_dir(args) / 'tpu.json'
  previous = json.loads(path.read_text()) if args.resume and path.exists() else {}
  results = {'meta': harness.meta('scale', argv, args, input_length=args.input_length,
                                  output_length=args.output_length, gamma=args.gamma,
                                  gammas=args.gammas, param_dtype=args.param_dtype,
                                  libtpu=libtpu_version()),
             'blocks': previous.get('blocks', {})}
  write = lambda r: harness.write_results(args, 'tpu', r, markdown)
  run(args, results, write)
  print('wrote', *write(results))
  return results


def libtpu_version() -> str:
  try:
    from importlib import metadata  # pylint: disable=g-import-not-at-top
    return metadata.version('libtpu')
  except Exception:  # pylint: disable=broad-except
    return 'unknown'
