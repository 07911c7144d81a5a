"""What T5 1.1 large/XL/XXL decoding with a small draft compiles to on a mesh: no weights, no TPU.

  python -m benchmarks.scale --platform tpu --topology v4:1x1x1,v5e:2x4,v5p:2x2x1,v6e:2x4
  python -m benchmarks.scale --platform tpu --tiny --topology v5e:2x2     # seconds
  python -m benchmarks.scale --tiny --batches 8 --drafts small            # 8 fake CPU devices
  python -m benchmarks.scale --distill --sizes xxl --batches 32           # training, memory

Parameters are `jax.eval_shape` structures; every program is lowered with NamedShardings over a
(data, model) mesh and compiled, never run: --platform tpu by XLA:TPU for each --topology's
devices (`aot.topology_devices`; libtpu pinned to the installed jax, in a venv of its own:
`pip install 'jax[tpu]==<jax version>' && pip install -e .`), --platform cpu (default) for 8
fake CPU devices (the predict programs only, without estimates; tests/test_scale.py).

Per (topology, target size, batch, mesh) and draft ('small': T5 1.1 small; 'small-dec2': two
decoder layers of its widths reading the target's encoder, the embedded draft's shape):

  - the predict programs (greedy target-only and speculative at --gamma, the draft
    replicated): bytes per device against the chip's HBM, each loop iteration's collectives,
    cache-sized copies and host transfers inside loop bodies;
  - on a TPU, XLA:TPU's `optimal_seconds` (`aot.optimal_seconds`) and the sum of its ops'
    `estimated_cycles` (`compiled.entry_cycles`) for the straight-line programs of
    `aot.decode_programs` (XLA counts a loop body once): the target's step at 1 and gamma + 1
    tokens, the draft's at 1 and 2, the prefill, one iteration at gamma 0 and each --gammas;
  - the loop's own work at --gamma, and the speedup each estimate predicts at the embedded
    pair's acceptance and at the paper's.
  - --distill instead: one distillation step of each draft from the target (`distill_block`).

Writes tpu.json, tpu.md (cpu: scale.*; --distill: distill_*) after every block; --resume keeps
the blocks there. T5X's loop (`benchmarks.scale_t5x`, apart, into t5x_tpu.json) joins the TPU
tables. Estimates are a compiler's, for an idle chip: a lower bound, not timings.
"""

from __future__ import annotations

import os
import sys

if 'jax' not in sys.modules:  # the device count must be set before JAX starts
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                             ' --xla_force_host_platform_device_count=8').strip()

import argparse  # pylint: disable=g-import-not-at-top,wrong-import-position
import json
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from benchmarks import compiled as xla
from benchmarks import harness
from speculative_t5x import aot
from speculative_t5x import costs
from speculative_t5x import decoding
from speculative_t5x import evaluation
from speculative_t5x import gin_utils
from speculative_t5x import models
from speculative_t5x import network
from speculative_t5x import partitioning
from speculative_t5x import train

DEVICES = 8  # --platform cpu
INPUT_LENGTH = 512
DRAFT = 'small'
# The smallest configs that still split heads, MLP and vocabulary 8 ways (--tiny, the tests).
TINY = {'target': dict(vocab_size=128, emb_dim=32, num_heads=8, head_dim=4, num_encoder_layers=1,
                       num_decoder_layers=2, mlp_dim=64, mlp_activations=('gelu', 'linear'),
                       dropout_rate=0.0, dtype='bfloat16'),
        'draft': dict(vocab_size=128, emb_dim=16, num_heads=2, head_dim=4, num_encoder_layers=1,
                      num_decoder_layers=1, mlp_dim=16, mlp_activations=('gelu', 'linear'),
                      dropout_rate=0.0, dtype='bfloat16')}
DRAFTS = ('small', 'small-dec2')
SETTINGS = {'greedy': 0.0, 't1': 1.0}
# Acceptance the predictions use, (greedy, T=1): the embedded pair's measured, the paper's.
ALPHAS = {'embedded pair': (0.90, 0.86), 'paper': (0.75, 0.62)}
PAPER = {'greedy': 3.4, 't1': 2.6}  # the paper's walltime speedups: T5-XXL, T5-small, one TPU v4
MEASURES = ('optimal_seconds', 'cycles')
NAME = 'scale'


def model_config(size: str) -> network.T5Config:
  """The shipped gin config of T5 1.1 `size` ('tiny' / 'tiny_draft': the test configs)."""
  if size.startswith('tiny'):
    return network.T5Config(**TINY['draft' if size.endswith('draft') else 'target'])
  path = gin_utils.resolve_path(f'gin_configs/models/t5_1_1/{size}.gin')
  return network.T5Config(**xla.config_values(Path(path)))


def draft_config(name: str, target: network.T5Config) -> network.T5Config:
  """'small' (T5 1.1 small) or 'small-dec2' (its widths, 2 decoder layers, no encoder: reads
  the target's encoder output); the tiny draft's under --tiny."""
  tiny = target.vocab_size == TINY['target']['vocab_size']
  base = model_config('tiny_draft' if tiny else DRAFT)
  if name == 'small':
    return base
  return network.T5Config(**{**base.__dict__, 'num_encoder_layers': 0,
                             'num_decoder_layers': 2, 'encoded_width': target.emb_dim})


def decoder(target: network.T5Config, draft: network.T5Config, gamma: int
            ) -> models.EncoderDecoderModel:
  """Greedy target-only (gamma 0) or greedy speculative decoding at fixed gamma."""
  if gamma == 0:
    return models.EncoderDecoderModel(target, draft, decode_fn=decoding.temperature_sample,
                                      decode_kwargs={'temperature': 0.0, 'topk': 0})
  return models.EncoderDecoderModel(target, draft, decode_fn=decoding.speculative_sample,
                                    decode_kwargs={'temperature': 0.0, 'gamma': gamma})


def predict_program(model: models.EncoderDecoderModel, mesh: Any, params: Any, batch: int,
                    lengths: Tuple[int, int], placement: str, big_bytes: int
                    ) -> Dict[str, Any]:
  """Memory and its fit (`aot.fit`), whole-program cost, loop collectives, cache-sized copies
  (count and bytes) and compile seconds of one predict program for [batch, lengths[0]] inputs,
  lengths[1] outputs."""
  fn = partitioning.partition_predict(model, mesh, params=params, draft_placement=placement)
  shapes = {'encoder_input_tokens': jax.ShapeDtypeStruct((batch, lengths[0]), jnp.int32),
            'decoder_input_tokens': jax.ShapeDtypeStruct((batch, lengths[1]), jnp.int32)}
  rng = jax.ShapeDtypeStruct((2,), jnp.uint32)
  program, seconds = xla.time_compile(lambda: fn.lower(params, shapes, rng).compile())
  loops = xla.loop_report(program.as_text(), big_bytes)
  copies = [c for l in loops for c in l['big_copies']]
  return {'compile_s': seconds, 'memory': xla.memory(program), 'cost': xla.cost(program),
          'fit': aot.fit(program, list(mesh.devices.flat)),
          'loops': xla.summarize_loops(loops),
          'big_copies': {'count': len(copies), 'bytes': sum(c['bytes'] for c in copies)}}


def layer_cache_bytes(caches: Mapping[str, network.DecoderCache], mesh: Any,
                      all_rules: Mapping[str, Any]) -> int:
  """The smallest per-device shard of one cache layer (K of self-attention) of either model: a
  copy this large inside a loop body is a cache-sized copy."""
  sizes = []
  for name, cache in caches.items():
    shardings = partitioning.cache_shardings(cache, mesh, all_rules[name])
    sizes.append(xla.sharded_bytes(cache.self_key[0], shardings.self_key[0]))
  return min(sizes)


def estimate(program: Any) -> Dict[str, Any]:
  """A compiled straight-line program: XLA:TPU's time (corrected), flops, bytes, ops."""
  module = xla.Module.parse(program.as_text())
  return {**xla.cost(program), 'optimal_seconds': aot.optimal_seconds(program),
          'cycles': xla.entry_cycles(program.as_text()), 'ops': xla.entry_ops(module),
          'collectives': xla.collectives(module.instructions(module.entry, into_loops=True))}


def distill_block(topology: str, devices: Sequence[Any], size: str, mesh_shape: Tuple[int, int],
                  batch: int, args: argparse.Namespace) -> Dict[str, Any]:
  """--distill: one training step of each draft distilled from the `size` target (the target
  frozen; `train.compile_step`), compiled for the mesh: bytes per device and fit."""
  partitioner = partitioning.Partitioner(mesh_shape=mesh_shape, devices=devices)
  teacher, drafts = model_config(size), {}
  for draft in args.drafts:
    student = draft_config(draft, teacher)
    objective = evaluation.Objective(student, distillation='token', teacher_config=teacher,
                                     encoder_config=None if student.has_encoder else teacher)
    try:
      drafts[draft] = {'fit': aot.fit(aot.compile_program(lambda: train.compile_step(
          objective, partitioner, batch, (args.input_length, args.output_length),
          args.param_dtype)), devices)}
    except aot.DoesNotFit as error:
      drafts[draft] = {'does_not_fit': str(error)}
  return {'topology': topology, 'size': size, 'mesh': list(mesh_shape), 'batch': batch,
          'drafts': drafts}


def distill_markdown(results: Mapping[str, Any]) -> str:
  meta, rows = results['meta'], [[key, draft, d.get('does_not_fit') or fit_cell(d)]
                                 for key, b in results['blocks'].items()
                                 for draft, d in b['drafts'].items()]
  return '\n'.join(harness.heading(
      f"One distillation step (`train.compile_step`, compile-only): the target frozen in "
      f"{meta['param_dtype']}, the draft trained in float32; inputs {meta['input_length']}, "
      f"targets {meta['output_length']}", results) +
      harness.table(['block', 'draft', 'GiB per device'], rows) + [''])


def draft_figures(size: str, draft: str, mesh: Any, batch: int, args: argparse.Namespace,
                  with_target: bool) -> Dict[str, Any]:
  """One draft's programs at one block; with_target also the target's own (steps, its
  iterations, its predict program), which are the same whichever draft is beside it."""
  target = model_config(size)
  config = draft_config(draft, target)
  gammas = sorted({0, args.gamma} | set(args.gammas))
  programs = {} if args.platform != 'tpu' else aot.decode_programs(
      target, config, mesh, batch, input_length=args.input_length,
      output_length=args.output_length, target_ks=sorted({1} | {g + 1 for g in gammas}),
      iterations=[(g, t) for g in gammas for t in SETTINGS.values()], dtype=args.param_dtype)
  shared = lambda name: name.startswith('target ') or name.startswith('iteration 0 ')
  params = aot.abstract_params(target, config, args.param_dtype)
  model = decoder(target, config, args.gamma)
  caches = aot.abstract_caches(model, params, batch, args.input_length, args.output_length)
  rules = partitioning.model_rules(model, mesh, draft_placement=aot.REPLICATED)
  big = layer_cache_bytes(dict(zip(('target', 'draft'), caches)), mesh, rules)
  out = {'programs': {}}
  predict = lambda m: aot.compile_program(lambda: predict_program(
      m, mesh, params, batch, (args.input_length, args.output_length), aot.REPLICATED, big))
  try:  # the whole predict programs first: one that does not fit ends the block
    if with_target:
      out['target_predict'] = predict(decoder(target, config, 0))
    out['predict'] = predict(model)
    for name, build in programs.items():
      if with_target or not shared(name):
        program, seconds = xla.time_compile(lambda: aot.compile_program(build))
        out['programs'][name] = {'compile_s': seconds, **estimate(program)}
  except aot.DoesNotFit as error:
    out['does_not_fit'] = str(error)
  return out


def block(topology: str, devices: Sequence[Any], size: str, mesh_shape: Tuple[int, int],
          batch: int, args: argparse.Namespace) -> Dict[str, Any]:
  """Both drafts' programs and the target's at one (topology, size, mesh, batch)."""
  mesh = partitioning.create_mesh(mesh_shape, devices=devices)
  out = {'topology': topology, 'device_kind': devices[0].device_kind, 'size': size,
         'mesh': list(mesh_shape), 'batch': batch, 'gamma': args.gamma,
         'output_length': args.output_length, 'drafts': {}}
  for index, draft in enumerate(args.drafts):
    figures = draft_figures(size, draft, mesh, batch, args, with_target=index == 0)
    if 'does_not_fit' in figures:  # XLA:TPU's line: needed and available HBM
      out['does_not_fit'] = figures['does_not_fit']
      return out
    if 'target_predict' in figures:
      out['target_predict'] = figures.pop('target_predict')
      out['target'] = {n: p for n, p in figures['programs'].items()
                       if n.startswith('target ') or n.startswith('iteration 0 ')}
    figures['programs'] = {n: p for n, p in figures['programs'].items()
                           if n not in out['target']}
    out['drafts'][draft] = figures
  return out


def meshes(devices: Sequence[Any], spec: str, batch: int) -> List[Tuple[int, int]]:
  """(data, model) meshes of the topology's devices: 'model' (1 x n), 'both' (2 x n/2), 'data'
  (n x 1); a 'data' size that does not divide the batch is skipped."""
  n = len(devices)
  shapes = {'model': (1, n), 'both': (2, n // 2), 'data': (n, 1)}
  out = []
  for name in spec.split(','):
    shape = shapes[name]
    if shape[0] * shape[1] == n and batch % shape[0] == 0 and shape not in out:
      out.append(shape)
  return out


def topology_devices(args: argparse.Namespace, topology: str) -> List[Any]:
  """A TPU topology's devices, or with --platform cpu this process's 8 CPU devices."""
  if args.platform == 'tpu':
    return aot.topology_devices(topology)
  if jax.device_count() < DEVICES:
    raise SystemExit(f'error: benchmarks.scale needs {DEVICES} CPU devices; run it as its own '
                     'process (it sets --xla_force_host_platform_device_count=8 before JAX '
                     'starts).')
  return jax.devices()[:DEVICES]


def run(args: argparse.Namespace, results: Dict[str, Any], write: Callable[[Any], Any]
        ) -> Dict[str, Any]:
  """Every block of the sweep (topologies, then sizes, then batches), written after each;
  blocks already in `results` are kept."""
  for topology in args.topologies:
    devices = topology_devices(args, topology)
    for size in args.sizes:
      for batch in args.batches:
        for mesh_shape in meshes(devices, args.meshes, batch):
          key = f'{topology} {size} {mesh_shape[0]}x{mesh_shape[1]} b{batch}'
          if key not in results['blocks']:
            build = distill_block if args.distill else block
            results['blocks'][key] = build(topology, devices, size, mesh_shape, batch, args)
            print(key, summary_line(results['blocks'][key]), flush=True)
            write(results)
  return results


def _programs(b: Mapping[str, Any], draft: str) -> Dict[str, Any]:
  return {**b['target'], **b['drafts'][draft]['programs']}


def loop_figures(b: Mapping[str, Any], draft: str, setting: str) -> Dict[str, float]:
  """At the block's gamma: c (draft step over target step) and the verify call over the step,
  by each measure; each iteration's own work beyond its model calls, by the additive measure
  (cycles, over a target step's), in ops and in bytes."""
  programs, gamma, temperature = _programs(b, draft), b['gamma'], SETTINGS[setting]
  calls = {0: ['target 1'], gamma: [f'target {gamma + 1}', 'draft 2'] + ['draft 1'] * (gamma - 1)}
  out = {'step_us': 1e6 * programs['target 1']['optimal_seconds']}
  compiled = sorted(int(n.split()[1]) for n in programs if n.startswith('iteration ') and
                    n.endswith(f' {temperature:g}') and n.split()[1] != '0')
  for measure in MEASURES:
    step = programs['target 1'][measure]
    out[f'c {measure}'] = programs['draft 1'][measure] / step
    out[f'verify {measure}'] = programs[f'target {gamma + 1}'][measure] / step
    if len(compiled) >= 2:
      # A draft call inside an iteration: what the two longest drafts' iterations differ by,
      # less their verify calls' difference, per call. A step program alone also pays what an
      # iteration pays once (XLA:TPU's bound is not additive).
      low, high = compiled[-2:]
      at = lambda name: programs[name][measure]
      out[f'c in loop {measure}'] = (
          at(f'iteration {high} {temperature:g}') - at(f'iteration {low} {temperature:g}') -
          at(f'target {high + 1}') + at(f'target {low + 1}')) / (high - low) / step
  for g, names in calls.items():
    iteration = programs[f'iteration {g} {temperature:g}']
    beyond = lambda key: iteration[key] - sum(programs[n][key] for n in names)
    tag = 'target_only' if g == 0 else 'speculative'
    out.update({f'{tag}_us': 1e6 * iteration['optimal_seconds'],
                f'{tag}_overhead': beyond('cycles') / programs['target 1']['cycles'],
                f'{tag}_ops': beyond('ops'), f'{tag}_mb': beyond('bytes_accessed') / 1e6})
  return out


def predicted(b: Mapping[str, Any], draft: str, setting: str, alpha: float, measure: str
              ) -> Tuple[int, float]:
  """(best gamma, speedup over the target alone) at acceptance alpha by one measure: expected
  tokens per iteration times the target-only iteration over the speculative one, the best of
  the compiled gammas."""
  programs, temperature = _programs(b, draft), SETTINGS[setting]
  iteration = lambda g: programs[f'iteration {g} {temperature:g}'][measure]
  gammas = [int(n.split()[1]) for n in programs if n.startswith('iteration ') and
            n.endswith(f' {temperature:g}') and n.split()[1] != '0']
  return max(((g, costs.expected_tokens(alpha, g) * iteration(0) / iteration(g)) for g in gammas),
             key=lambda item: item[1])


def summary_line(b: Mapping[str, Any]) -> str:
  """Progress: each draft's speculative loop (--distill: its step's fit) and, with estimates,
  its predicted speedup."""
  if 'device_kind' not in b:  # --distill
    return '; '.join(f"{k}: {d.get('does_not_fit') or fit_cell(d)}" for k, d in b['drafts'].items())
  if 'does_not_fit' in b:
    return f"does not fit: {b['does_not_fit']}"
  parts = []
  for draft, d in b['drafts'].items():
    parts.append(f"{draft}: needs {fit_cell(d['predict'])} GiB, {loop_cell(d['predict'])}")
    if b['target']:
      gamma, speedup = predicted(b, draft, 'greedy', ALPHAS['paper'][0], 'optimal_seconds')
      parts[-1] += f", greedy at the paper's alpha {speedup:.2f}x (gamma {gamma})"
  return '; '.join(parts)


def _gib(n: float) -> str:
  return f'{n / 2**30:.2f}'


def fit_cell(p: Mapping[str, Any]) -> str:
  f = p['fit']
  if 'hbm' not in f:
    return _gib(f['bytes'])
  return (f"{_gib(f['bytes'])} of {_gib(f['hbm'])}" +
          ('' if f['fits'] else f" (short by {_gib(f['short_by'])})"))


def loop_cell(p: Mapping[str, Any]) -> str:
  loops = p['loops']
  return (f"{xla.collective_text(loops.get('outer', {}))}; inner "
          f"{xla.collective_text(loops.get('inner', {}))}; copies "
          f"{loops.get('big_copies', 0)}; host {loops.get('host_transfers', 0)}")


def markdown(results: Mapping[str, Any]) -> str:
  """The tables: fit and loops; with estimates, steps, the loop's own work, predicted speedups."""
  meta = results['meta']
  tpu = meta.get('platform', 'tpu') == 'tpu'
  lines = harness.heading(f"{'XLA:TPU' if tpu else 'XLA:CPU (8 devices)'}-compiled programs "
                          f"(compile-only{', no TPU' if tpu else ''})", results)
  lines += [(f"libtpu {meta['libtpu']}. " if tpu else '') +
            f"Inputs {meta['input_length']}, outputs {meta['output_length']}, parameters "
            f"{meta['param_dtype']}, the draft replicated, γ {meta['gamma']}. Blocks: `topology "
            'size mesh(data x model) batch`. ' +
            ("Times: XLA:TPU's `optimal_seconds`, a compiler's estimate for an idle chip (a "
             'lower bound, not a timing).' if tpu else 'No estimates: XLA:CPU gives none.'), '']
  rows = [[key, '', f"does not fit: {b['does_not_fit']}", '', '', '']
          for key, b in results['blocks'].items() if 'does_not_fit' in b]
  blocks = {key: b for key, b in results['blocks'].items() if 'does_not_fit' not in b}
  rows += [[key, draft, fit_cell(b['target_predict']), fit_cell(d['predict']),
            loop_cell(b['target_predict']), loop_cell(d['predict'])]
           for key, b in blocks.items() for draft, d in b['drafts'].items()]
  if not rows:
    return '\n'.join(lines)
  lines += [f"## {'Fit in HBM' if tpu else 'Memory'} (GiB per device) and one iteration of "
            'each loop', '',
            'Collectives of the outer loop body; inner: the draft loop body (γ − 1 a '
            'iteration). Copies: cache-sized copies in loop bodies; host: host transfers in '
            'loop bodies.', '']
  lines += harness.table(['block', 'draft', 'target-only needs', 'speculative needs',
                          'target-only loop', 'speculative loop'], rows) + ['']
  blocks = {key: b for key, b in blocks.items() if b['target']}  # with estimates
  if not blocks:
    return '\n'.join(lines)
  return '\n'.join(lines + loop_lines(blocks) + speedup_lines(blocks) +
                   t5x_lines(blocks, results.get('t5x', {})))


def loop_lines(blocks: Mapping[str, Any]) -> List[str]:
  rows = []
  for key, b in blocks.items():
    for draft in b['drafts']:
      for setting in SETTINGS:
        f = loop_figures(b, draft, setting)
        in_loop = lambda m: f" ({f[f'c in loop {m}']:.3f})" if f'c in loop {m}' in f else ''
        rows.append([key, draft, setting, f"{f['step_us']:.1f}",
                     f"{f['c optimal_seconds']:.3f}{in_loop('optimal_seconds')} / "
                     f"{f['c cycles']:.3f}{in_loop('cycles')}",
                     f"{f['verify optimal_seconds']:.2f} / {f['verify cycles']:.2f}",
                     f"{f['target_only_us']:.1f}", f"{f['target_only_overhead']:.1%}",
                     str(f['target_only_ops']), f"{f['speculative_us']:.1f}",
                     f"{f['speculative_overhead']:.1%}", str(f['speculative_ops']),
                     f"{f['speculative_mb']:.1f}"])
  first = next(iter(blocks.values()))
  return (['## Steps and the loop\'s own work', '',
           'Each ratio by `optimal_seconds` / by cycles. c: the draft\'s 1-token step over the '
           'target\'s (in brackets: a draft call inside an iteration, from the two longest '
           'drafts\' iterations less their verify calls); verify: the target\'s γ+1-token '
           f"call over its 1-token step (γ {first['gamma']}); iterations in µs by "
           "optimal_seconds. Overhead: an iteration's cycles beyond its calls' (target-only: one "
           "step; speculative: the verify call, the draft's 2-token first call and γ − 1 1-token "
           "calls), over a target step's; ops and MB (bytes accessed) beyond its calls' "
           'likewise.', ''] +
          harness.table(['block', 'draft', 'setting', 'target step µs', 'c', 'verify / step',
                         'target-only iteration µs', 'overhead', 'ops beyond',
                         'speculative iteration µs', 'overhead', 'ops beyond', 'MB beyond'],
                        rows) + [''])


def speedup_lines(blocks: Mapping[str, Any]) -> List[str]:
  rows = []
  for key, b in blocks.items():
    for draft in b['drafts']:
      for label, alphas in ALPHAS.items():
        cells = [key, draft, f'{label} ({alphas[0]}, {alphas[1]})']
        for setting, alpha in zip(SETTINGS, alphas):
          for measure in MEASURES:
            gamma, speedup = predicted(b, draft, setting, alpha, measure)
            cells.append(f'{speedup:.2f}x (γ {gamma})')
        rows.append(cells)
  return (['## The speedup the estimates predict over the target alone', '',
           'Expected tokens per iteration, (1 − α^(γ+1)) / (1 − α), times the target-only '
           'iteration over the speculative one, best compiled γ; prefill not counted. The paper '
           f"(T5-XXL, T5-small, one TPU v4, batch 1, measured): {PAPER['greedy']}x greedy at α "
           f"0.75, {PAPER['t1']}x at T=1, α 0.62.", ''] +
          harness.table(['block', 'draft', 'α (greedy, T=1)', 'greedy, optimal_seconds',
                         'greedy, cycles', 'T=1, optimal_seconds', 'T=1, cycles'], rows) + [''])


def t5x_lines(blocks: Mapping[str, Any], t5x: Mapping[str, Any]) -> List[str]:
  """T5X's own greedy loop beside ours, where `benchmarks.scale_t5x` compiled it for the
  topology (its step as its loop's iteration; it recomputes cross-attention keys and values
  from the encoder output at every step)."""
  rows = []
  for key, b in blocks.items():
    t = t5x.get('blocks', {}).get(
        f"{b['size']} {b['mesh'][0]}x{b['mesh'][1]} b{b['batch']} out{b['output_length']}")
    if not t:
      continue
    step = t['steps']['1']['optimal_seconds']
    ours = b['target']['iteration 0 0']['optimal_seconds']
    cells = [key, f'{step * 1e6:.1f}', f'{ours * 1e6:.1f}', f'{step / ours:.2f}x']
    for draft in b['drafts']:
      gamma, speedup = predicted(b, draft, 'greedy', ALPHAS['paper'][0], 'optimal_seconds')
      cells.append(f'{speedup * step / ours:.2f}x (γ {gamma})')
    rows.append(cells)
  if not rows:
    return []
  drafts = list(next(iter(blocks.values()))['drafts'])
  return (["## T5X's own greedy loop, compiled the same way (optimal_seconds)", ''] +
          harness.table(['block', "T5X's step µs", 'our target-only iteration µs',
                         'ours over T5X, target alone'] +
                        [f'{d} greedy at α 0.75 over T5X' for d in drafts], rows) + [''])


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument('--platform', default='cpu', choices=('cpu', 'tpu'),
                 help='tpu: XLA:TPU for --topology (needs libtpu); cpu: 8 fake CPU devices')
  p.add_argument('--topology', default='v4:1x1x1,v5e:2x4,v5p:2x2x1,v6e:2x4',
                 help='TPU topologies, with --platform tpu')
  p.add_argument('--sizes', default='large,xl,xxl', help='T5 1.1 target sizes')
  p.add_argument('--drafts', default=','.join(DRAFTS), help=f'any of {", ".join(DRAFTS)}')
  p.add_argument('--batches', default='8,1,32', help='batch sizes, run in this order')
  p.add_argument('--meshes', default='model',
                 help="(data, model) meshes: 'model' (1 x n), 'both' (2 x n/2), 'data' (n x 1)")
  p.add_argument('--input_length', type=int, default=INPUT_LENGTH)
  p.add_argument('--output_length', type=int, default=128)
  p.add_argument('--gamma', type=int, default=4,
                 help="the predict programs' gamma, at which the loop's own work is read")
  p.add_argument('--gammas', default='2,4,7', help='the speculative iterations compiled (TPU)')
  p.add_argument('--param_dtype', default=None,
                 help='default bfloat16 on a TPU (as a job serves them), float32 on the CPU')
  p.add_argument('--tiny', action='store_true',
                 help='tiny target and draft, input 16 / output 8 (seconds; the tests)')
  p.add_argument('--resume', action='store_true', help='keep the blocks already in the JSON')
  p.add_argument('--distill', action='store_true',
                 help='the distillation step instead (distill_block), into distill[_tpu].json')
  harness.output_flags(p)
  p.set_defaults(machine=NAME)
  args = p.parse_args(argv)
  if args.tiny:
    args.sizes, args.input_length, args.output_length = 'tiny', 16, 8
  args.sizes = [s for s in args.sizes.split(',') if s]
  args.batches = harness.parse_ints(args.batches, '--batches')
  args.gammas = harness.parse_ints(args.gammas, '--gammas')
  args.drafts = [d for d in args.drafts.split(',') if d]
  args.topologies = ([t for t in args.topology.split(',') if t] if args.platform == 'tpu'
                     else ['cpu'])
  args.param_dtype = args.param_dtype or ('bfloat16' if args.platform == 'tpu' else 'float32')
  if not args.topologies:
    raise SystemExit('error: --platform tpu needs --topology, e.g. v5e:2x4,v4:1x1x1.')
  if not args.drafts or set(args.drafts) - set(DRAFTS):
    raise SystemExit(f'error: --drafts takes {", ".join(DRAFTS)}; got {args.drafts}.')
  if args.gamma < 1 or min(args.gammas, default=1) < 1:
    raise SystemExit(f'error: --gamma and --gammas must be >= 1, got {args.gamma}, {args.gammas}.')
  if set(args.meshes.split(',')) - {'model', 'both', 'data'}:
    raise SystemExit(f"error: --meshes takes model, both, data; got {args.meshes!r}.")
  return args


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
  """The sweep into <out_dir>/tpu.json and tpu.md (--platform cpu: scale.json and scale.md)."""
  args = parse_args(argv)
  name = ('distill_' if args.distill else '') + ('tpu' if args.platform == 'tpu' else NAME)
  for topology in args.topologies:  # a bad name fails before anything compiles
    topology_devices(args, topology)
  directory = harness.out_dir(args)
  path, t5x_path = directory / f'{name}.json', directory / f't5x_{name}.json'
  previous = json.loads(path.read_text()) if args.resume and path.exists() else {}
  try:
    libtpu = metadata.version('libtpu')
  except metadata.PackageNotFoundError:
    libtpu = 'not installed'
  results = {'meta': {'command': harness.command_line(NAME, argv), **harness.machine(),
                      'platform': args.platform, 'input_length': args.input_length,
                      'output_length': args.output_length, 'gamma': args.gamma,
                      'gammas': args.gammas, 'param_dtype': args.param_dtype, 'libtpu': libtpu,
                      'while_cost_flops': xla.while_cost_is_per_body()},
             'blocks': previous.get('blocks', {})}
  if t5x_path.exists():  # T5X's side, `benchmarks.scale_t5x` run apart
    results['t5x'] = json.loads(t5x_path.read_text())
  write = lambda r: harness.write_results(args, name, r,
                                         distill_markdown if args.distill else markdown)
  run(args, results, write)
  print('wrote', *write(results))
  return results


if __name__ == '__main__':
  main()
