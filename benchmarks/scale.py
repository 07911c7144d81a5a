"""T5 1.1 large/XL/XXL targets with the T5 1.1 small draft, read from the compiled programs.

  python -m benchmarks.scale                                  # the full sweep (hours on 2 cores)
  python -m benchmarks.scale --sizes large --meshes 1x8 --batches 8 --output_lengths 128

No weight is allocated: parameters are `jax.eval_shape` structures, and every program is lowered
and compiled (never run) for 8 fake CPU devices (`--xla_force_host_platform_device_count=8`, set
here before JAX starts) with `partitioning.partition_predict` on each (data, model) mesh. Per
(size, mesh, batch, output length) it reports, per device:

  - parameter and cache bytes (from the shardings), and XLA's memory analysis (arguments,
    temporaries) of each predict program: target-only greedy (`decoding.temperature_sample`)
    and greedy speculative (`decoding.speculative_sample`) at each --gammas, with the draft
    sharded like the target and replicated (`partitioning.draft_logical_axis_rules`);
  - the collectives of one iteration of each program's while loop (kind, count, result bytes),
    read from the compiled HLO: the outer loop's body and the draft loop nested in it, which
    runs up to gamma - 1 times per iteration;
  - copies of at least one cache layer inside a loop body (there should be none);
  - flops, bytes accessed and collectives of the step programs a loop runs (the target at 1,
    gamma + 1 and --projection_gamma + 1 tokens per row; the draft at 1 and 2), compiled alone
    with the loop's shardings. XLA's cost analysis counts a while body once, not times its trip
    count (`compiled.while_cost_is_per_body`, recorded in the meta), so per-token figures come
    from these step programs: target-only spends one 1-token target step per token, a
    speculative iteration gamma draft steps and one (gamma + 1)-token target step;
  - compile seconds.

--t5x_python runs the same shapes through T5X's own `EncoderDecoderModel.predict_batch` with
`t5x.decoding.temperature_sample` (greedy) in a separate process (`benchmarks.scale_t5x`, T5X's
environment); without T5X that part is skipped. `benchmarks.roofline` projects the figures onto
TPU v4, TPU v5e and H100 into the markdown. Writes scale.json and .md after every block, so a
killed sweep keeps what it measured (recorded: results/scale/scale.md).
"""

from __future__ import annotations

import os
import sys

if 'jax' not in sys.modules:  # the device count must be set before JAX starts
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                             ' --xla_force_host_platform_device_count=8').strip()

import argparse  # pylint: disable=g-import-not-at-top,wrong-import-position
import json
import subprocess
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import compiled as xla
from benchmarks import harness
from benchmarks import roofline
from speculative_t5x import aot
from speculative_t5x import decoding
from speculative_t5x import gin_utils
from speculative_t5x import models
from speculative_t5x import network
from speculative_t5x import partitioning

NAME = 'scale'
DEVICES = 8
INPUT_LENGTH = 512
DRAFT = 'small'
# The smallest configs that still split heads, MLP and vocabulary 8 ways (--tiny, the tests).
TINY = {'target': dict(vocab_size=128, emb_dim=32, num_heads=8, head_dim=4, num_encoder_layers=1,
                       num_decoder_layers=2, mlp_dim=64, mlp_activations=('gelu', 'linear'),
                       dropout_rate=0.0, dtype='bfloat16'),
        'draft': dict(vocab_size=128, emb_dim=16, num_heads=2, head_dim=4, num_encoder_layers=1,
                      num_decoder_layers=1, mlp_dim=16, mlp_activations=('gelu', 'linear'),
                      dropout_rate=0.0, dtype='bfloat16')}
PLACEMENTS = (partitioning.DRAFT_SHARDED, partitioning.DRAFT_REPLICATED)


def model_config(size: str) -> network.T5Config:
  """The shipped gin config of T5 1.1 `size` ('tiny' / 'tiny_draft': the test configs)."""
  if size.startswith('tiny'):
    return network.T5Config(**TINY['draft' if size.endswith('draft') else 'target'])
  path = gin_utils.resolve_path(f'gin_configs/models/t5_1_1/{size}.gin')
  return network.T5Config(**xla.config_values(Path(path)))


def decoder(target: network.T5Config, draft: network.T5Config, gamma: int
            ) -> models.EncoderDecoderModel:
  """Greedy target-only (gamma 0) or greedy speculative decoding at fixed gamma."""
  if gamma == 0:
    return models.EncoderDecoderModel(target, draft, decode_fn=decoding.temperature_sample,
                                      decode_kwargs={'temperature': 0.0, 'topk': 0})
  return models.EncoderDecoderModel(target, draft, decode_fn=decoding.speculative_sample,
                                    decode_kwargs={'temperature': 0.0, 'gamma': gamma})


def abstract_batch(batch: int, input_length: int, output_length: int) -> Dict[str, Any]:
  return {'encoder_input_tokens': jax.ShapeDtypeStruct((batch, input_length), jnp.int32),
          'decoder_input_tokens': jax.ShapeDtypeStruct((batch, output_length), jnp.int32)}


def abstract_cache(config: network.T5Config, params: Any, batch: int, input_length: int,
                   output_length: int) -> network.DecoderCache:
  """The DecoderCache a decode of these shapes starts from, abstractly."""
  module = network.Transformer(config)

  def init(p, tokens):
    encoded = module.apply({'params': p}, tokens, method=network.Transformer.encode)
    return module.apply({'params': p}, encoded, tokens, output_length,
                        method=network.Transformer.init_cache)

  return jax.eval_shape(init, params, jax.ShapeDtypeStruct((batch, input_length), jnp.int32))


def predict_program(model: models.EncoderDecoderModel, mesh: Any, params: Any,
                    batch: Mapping[str, Any], placement: str, big_bytes: int) -> Dict[str, Any]:
  """Memory, whole-program cost, loop collectives and compile seconds of one predict."""
  fn = partitioning.partition_predict(model, mesh, params=params, draft_placement=placement)
  rng = jax.ShapeDtypeStruct((2,), jnp.uint32)
  program, seconds = xla.time_compile(lambda: fn.lower(params, batch, rng).compile())
  loops = xla.loop_report(program.as_text(), big_bytes)
  return {'compile_s': seconds, 'memory': xla.memory(program), 'cost': xla.cost(program),
          'loops': xla.summarize_loops(loops),
          'big_copies': [c for l in loops for c in l['big_copies']]}


def step_program(config: network.T5Config, params: Any, decode_vars: Any,
                 cache: network.DecoderCache, mesh: Any, rules: partitioning.LogicalAxisRules,
                 k: int) -> Dict[str, Any]:
  """Cost, op count and collectives of one cached decoder step of k tokens per row
  (`aot.step_program`), with the shardings the loop gives params and cache."""
  program, seconds = xla.time_compile(
      lambda: aot.step_program(config, params, decode_vars, cache, mesh, rules, k))
  module_text = xla.Module.parse(program.as_text())
  return {'compile_s': seconds, **xla.cost(program), 'ops': xla.entry_ops(module_text),
          'collectives': xla.collectives(module_text.instructions(module_text.entry,
                                                                  into_loops=True))}


def step_ks(gammas: Sequence[int], projection_gammas: Sequence[int]) -> List[int]:
  """Target step widths a block compiles: 1 (target-only) and every verify call, gamma + 1."""
  return sorted({1} | {g + 1 for g in list(gammas) + list(projection_gammas)})


def per_device_bytes(model: models.EncoderDecoderModel, mesh: Any, params: Any,
                     caches: Mapping[str, network.DecoderCache]) -> Dict[str, Any]:
  """Parameter and cache bytes one device holds, the draft's under each placement."""
  out = {'params': {}, 'cache': {}}
  for placement in PLACEMENTS:
    shardings = partitioning.pair_shardings(model, mesh, params=params,
                                            draft_placement=placement)
    rules = partitioning.model_rules(model, mesh, draft_placement=placement)
    for name in ('target', 'draft'):
      key = name if name == 'target' else f'draft_{placement}'
      out['params'][key] = (xla.sharded_bytes(params[name], shardings[name]) +
                            xla.sharded_bytes(params['decode'][name], shardings['decode'][name]))
      out['cache'][key] = xla.sharded_bytes(
          caches[name], partitioning.cache_shardings(caches[name], mesh, rules[name]))
  out['params_total'] = {name: xla.tree_bytes(params[name]) for name in ('target', 'draft')}
  out['cache_total'] = {name: xla.tree_bytes(caches[name]) for name in ('target', 'draft')}
  return out


def step_memory(config: network.T5Config, params: Any, shardings: Any,
                cache: network.DecoderCache, cache_sharding: Any, input_length: int,
                data_size: int) -> Dict[str, int]:
  """Per-device bytes a cached decoder step has to read from memory on an accelerator, by part:
  the decoder's weights without the cross-attention key/value kernels (plus the embedding when
  it is tied to the logits), those kernels (applied once here, on every step by T5X's
  network), the self- and cross-attention caches (read whole: static length), and the encoder
  output [batch / data, input_length, emb] in the activation dtype (what T5X's step reads
  instead of a cross-attention cache). XLA:CPU's own `bytes accessed` is far larger: it counts
  the float32 copies its bfloat16 dots make, which an accelerator does not."""
  parts = {'weights': 0, 'cross_kv_weights': 0}
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  for (path, leaf), sharding in zip(flat, jax.tree.leaves(shardings)):
    names = [getattr(k, 'key', '') for k in path]
    if names[0] != 'decoder' and not (config.logits_via_embedding and
                                      names[0] == 'token_embedder'):
      continue
    part = ('cross_kv_weights' if 'encoder_decoder_attention' in names and
            ('key' in names or 'value' in names) else 'weights')
    parts[part] += xla.sharded_bytes(leaf, sharding)
  for field in ('self', 'cross'):
    leaves = getattr(cache, f'{field}_key') + getattr(cache, f'{field}_value')
    shards = getattr(cache_sharding, f'{field}_key') + getattr(cache_sharding, f'{field}_value')
    parts[f'{field}_cache'] = xla.sharded_bytes(leaves, shards)
  batch = cache.index.shape[0] // data_size
  parts['encoded'] = batch * input_length * config.emb_dim * np.dtype(config.dtype).itemsize
  return parts


def step_memories(b: Mapping[str, Any], draft: str, input_length: int, dtype: str
                  ) -> Dict[str, Dict[str, int]]:
  """`step_memory` of the target and of the draft under each placement of block `b`."""
  target, draft_config = model_config(b['size']), model_config(draft)
  params = aot.abstract_params(target, draft_config, dtype)
  mesh = partitioning.create_mesh(tuple(b['mesh']))
  model = decoder(target, draft_config, 0)
  out = {}
  for placement in PLACEMENTS:
    shardings = partitioning.pair_shardings(model, mesh, params=params,
                                            draft_placement=placement)
    rules = partitioning.model_rules(model, mesh, draft_placement=placement)
    for name, config in (('target', target), ('draft', draft_config)):
      cache = abstract_cache(config, params[name], b['batch'], input_length, b['output_length'])
      key = name if name == 'target' else f'draft_{placement}'
      out[key] = step_memory(config, params[name], shardings[name], cache,
                             partitioning.cache_shardings(cache, mesh, rules[name]),
                             input_length, b['mesh'][0])
  return out


def layer_cache_bytes(caches: Mapping[str, network.DecoderCache], mesh: Any,
                      all_rules: Mapping[str, Any]) -> int:
  """The smallest per-device shard of one cache layer (K of self-attention) of either model: a
  copy this large inside a loop body is a cache-sized copy."""
  sizes = []
  for name, cache in caches.items():
    shardings = partitioning.cache_shardings(cache, mesh, all_rules[name])
    sizes.append(xla.sharded_bytes(cache.self_key[0], shardings.self_key[0]))
  return min(sizes)


def block(size: str, mesh_shape: Tuple[int, int], batch: int, output_length: int,
          args: argparse.Namespace) -> Dict[str, Any]:
  """Every figure of one (size, mesh, batch, output length)."""
  target, draft = model_config(size), model_config(args.draft)
  params = aot.abstract_params(target, draft, args.param_dtype)
  mesh = partitioning.create_mesh(mesh_shape)
  base = decoder(target, draft, 0)
  caches = {name: abstract_cache(config, params[name], batch, args.input_length, output_length)
            for name, config in (('target', target), ('draft', draft))}
  rules = {p: partitioning.model_rules(base, mesh, draft_placement=p) for p in PLACEMENTS}
  big = layer_cache_bytes(caches, mesh, rules[partitioning.DRAFT_REPLICATED])
  shapes = abstract_batch(batch, args.input_length, output_length)
  programs = {'target-only': predict_program(base, mesh, params, shapes,
                                             partitioning.DRAFT_SHARDED, big)}
  # On a mesh without a 'model' axis both placements are the same program: compiled once.
  placements = args.placements if mesh_shape[1] > 1 else args.placements[:1]
  for gamma in args.gammas:
    for placement in placements:
      programs[f'gamma={gamma} draft={placement}'] = predict_program(
          decoder(target, draft, gamma), mesh, params, shapes, placement, big)
  steps = {'target': {str(k): step_program(target, params['target'], params['decode']['target'],
                                           caches['target'], mesh, rules[PLACEMENTS[0]]['target'],
                                           k)
                      for k in step_ks(args.gammas, args.projection_gammas)}}
  for placement in placements:
    steps[f'draft_{placement}'] = {
        str(k): step_program(draft, params['draft'], params['decode']['draft'], caches['draft'],
                             mesh, rules[placement]['draft'], k) for k in (1, 2)}
  return {'size': size, 'mesh': list(mesh_shape), 'batch': batch, 'output_length': output_length,
          'per_device': per_device_bytes(base, mesh, params, caches), 'cache_layer_bytes': big,
          'programs': programs, 'steps': steps}


def block_key(size: str, mesh: Tuple[int, int], batch: int, output_length: int) -> str:
  return f'{size} {mesh[0]}x{mesh[1]} b{batch} out{output_length}'


def sweep(args: argparse.Namespace) -> List[Tuple[str, Tuple[int, int], int, int]]:
  """(size, mesh, batch, output length) in run order: the first output length at every batch
  (batches outermost: every size and mesh at the first batch before the next), then the short
  outputs at --short_batches. A mesh whose 'data' size does not divide the batch is skipped."""
  out = []
  for index, length in enumerate(args.output_lengths):
    for batch in args.batches if index == 0 else args.short_batches:
      out += [(size, mesh, batch, length) for size in args.sizes for mesh in args.meshes
              if batch % mesh[0] == 0]
  return out


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  p = harness.parser(__doc__, sentences='', rounds=0)
  p.set_defaults(machine=NAME)
  p.add_argument('--sizes', default='large,xl,xxl', help='T5 1.1 target sizes (or tiny)')
  p.add_argument('--draft', default=DRAFT, help='T5 1.1 draft size (tiny_draft with tiny)')
  p.add_argument('--meshes', default='1x8,2x4,8x1', help='(data)x(model) meshes of 8 devices')
  p.add_argument('--batches', default='8,1,32', help='batch sizes, run in this order')
  p.add_argument('--input_length', type=int, default=INPUT_LENGTH)
  p.add_argument('--output_lengths', default='128,32',
                 help='decoder lengths; the ones after the first only at --short_batches')
  p.add_argument('--short_batches', default='8')
  p.add_argument('--gammas', default=None,
                 help='greedy speculative gammas compiled (default 3,5; with --platform tpu the '
                      'iterations compiled, default 2,4,7)')
  p.add_argument('--projection_gammas', default='3,5,7', help='gammas of the projection')
  p.add_argument('--placements', default=','.join(PLACEMENTS),
                 help='draft placements of the speculative programs')
  p.add_argument('--param_dtype', default=None,
                 help="parameters' dtype (default float32 as T5X keeps them, activations "
                      'bfloat16; with --platform tpu bfloat16, as a TPU job serves them)')
  p.add_argument('--t5x_python', default=None,
                 help="python of an environment with T5X: adds T5X's temperature_sample")
  p.add_argument('--t5x_pythonpath', default='', help='extra PYTHONPATH entries for it')
  p.add_argument('--resume', action='store_true', help='keep the blocks already in the JSON')
  p.add_argument('--platform', default='cpu', choices=('cpu', 'tpu'),
                 help='cpu: 8 fake CPU devices; tpu: XLA:TPU programs for --topology '
                      '(needs libtpu; benchmarks.tpu)')
  p.add_argument('--topology', default='v4:1x1x1,v5e:2x4,v5p:2x2x1,v6e:2x4',
                 help='TPU topologies, with --platform tpu')
  p.add_argument('--drafts', default='small,small-dec2',
                 help='with --platform tpu: the drafts (benchmarks.tpu.DRAFTS)')
  p.add_argument('--gamma', type=int, default=4,
                 help="with --platform tpu: the predict programs' gamma, and the loop's own "
                      'work is read at it')
  p.add_argument('--tpu_meshes', default='model',
                 help="with --platform tpu: 'model' (1 x n), 'both' (2 x n/2), 'data' (n x 1)")
  p.add_argument('--tiny', action='store_true',
                 help='tiny target and draft, input 16 / output 8 (seconds; the tests)')
  args = p.parse_args(argv)
  if args.tiny:
    args.sizes, args.draft, args.input_length = 'tiny', 'tiny_draft', 16
    args.output_lengths = '8' if args.output_lengths == '128,32' else args.output_lengths
  args.sizes = [s for s in args.sizes.split(',') if s]
  args.meshes = [tuple(int(x) for x in m.split('x')) for m in args.meshes.split(',') if m]
  args.batches = harness.parse_ints(args.batches, '--batches')
  args.output_lengths = harness.parse_ints(args.output_lengths, '--output_lengths')
  args.short_batches = harness.parse_ints(args.short_batches, '--short_batches')
  args.gammas = harness.parse_ints(args.gammas or ('2,4,7' if args.platform == 'tpu' else '3,5'),
                                   '--gammas')
  args.projection_gammas = harness.parse_ints(args.projection_gammas, '--projection_gammas')
  args.placements = [p for p in args.placements.split(',') if p]
  args.param_dtype = args.param_dtype or ('bfloat16' if args.platform == 'tpu' else 'float32')
  return args


def start_t5x(args: argparse.Namespace, blocks: Sequence[Tuple[str, Tuple[int, int], int, int]]
              ) -> Optional[subprocess.Popen]:
  """T5X's side (`benchmarks.scale_t5x`) in its own process and environment, writing
  <out_dir>/scale_t5x.json; None without --t5x_python."""
  if not args.t5x_python:
    return None
  root = str(harness.REPO)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [root] + [p for p in args.t5x_pythonpath.split(os.pathsep) if p]))
  spec = {'blocks': [[s, list(m), b, o] for s, m, b, o in blocks], 'draft': args.draft,
          'input_length': args.input_length, 'param_dtype': args.param_dtype,
          'ks': [1], 'out': str(harness.out_dir(args) / 'scale_t5x.json'),
          'configs': {s: model_config(s).__dict__ for s in {b[0] for b in blocks}}}
  spec['configs'] = {s: {k: (str(v) if k == 'dtype' else v) for k, v in c.items()}
                     for s, c in spec['configs'].items()}
  log = open(harness.out_dir(args) / 'scale_t5x.log', 'w')
  return subprocess.Popen([args.t5x_python, '-m', 'benchmarks.scale_t5x', json.dumps(spec)],
                          env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT)


def read_t5x(args: argparse.Namespace) -> Dict[str, Any]:
  path = harness.out_dir(args) / 'scale_t5x.json'
  return json.loads(path.read_text()) if path.exists() else {}


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
  args = parse_args(argv)
  if args.platform == 'tpu':
    from benchmarks import tpu  # pylint: disable=g-import-not-at-top
    return tpu.main(args, argv)
  if jax.device_count() < DEVICES:
    raise SystemExit(f'error: benchmarks.scale needs {DEVICES} devices; run it as its own '
                     'process (it sets --xla_force_host_platform_device_count=8 before JAX '
                     'starts).')
  harness.out_dir(args).mkdir(parents=True, exist_ok=True)
  blocks = sweep(args)
  previous = json.loads((harness.out_dir(args) / f'{NAME}.json').read_text()) if (
      args.resume and (harness.out_dir(args) / f'{NAME}.json').exists()) else {}
  results = {'meta': harness.meta(NAME, argv, args, input_length=args.input_length,
                                  output_length=args.output_lengths, draft=args.draft,
                                  param_dtype=args.param_dtype, gammas=args.gammas,
                                  projection_gammas=args.projection_gammas,
                                  while_cost_flops=xla.while_cost_is_per_body()),
             'blocks': previous.get('blocks', {}), 't5x': {}}
  t5x = start_t5x(args, blocks)
  # A T5X side run apart (benchmarks.scale_t5x into the same folder) is merged as well.
  results['t5x'] = read_t5x(args) or {'skipped': 'no --t5x_python given'}
  for size, mesh, batch, length in blocks:
    key = block_key(size, mesh, batch, length)
    if key not in results['blocks']:
      results['blocks'][key] = block(size, mesh, batch, length, args)
    elif 'step_memory' in results['blocks'][key]:
      continue
    results['blocks'][key]['step_memory'] = step_memories(
        results['blocks'][key], args.draft, args.input_length, args.param_dtype)
    print(key, summary_line(results['blocks'][key]), flush=True)
    results['t5x'] = read_t5x(args) or results['t5x']
    paths = harness.write_results(args, NAME, results, markdown)
  if t5x is not None:
    t5x.wait()
    results['t5x'] = read_t5x(args) or {'skipped': f'T5X process ended with {t5x.returncode}; '
                                                  'see scale_t5x.log'}
  paths = harness.write_results(args, NAME, results, markdown)
  print('wrote', *paths)
  return results


def summary_line(b: Mapping[str, Any]) -> str:
  """Progress: compile seconds, temporaries and loop collectives of each program."""
  parts = []
  for name, prog in b['programs'].items():
    loops = prog['loops']
    parts.append(f"{name}: {prog['compile_s']:.0f}s temp "
                 f"{prog['memory']['temp_bytes'] / 2**20:.0f}MiB outer "
                 f"{roofline.collective_text(loops.get('outer', {}))} inner "
                 f"{roofline.collective_text(loops.get('inner', {}))}")
  return '; '.join(parts)


def _mb(value: float) -> str:
  return f'{value / 1e6:.0f}' if value >= 1e6 else f'{value / 1e6:.2f}'


def iteration_collectives(program: Mapping[str, Any], gamma: int) -> Dict[str, Dict[str, int]]:
  """One iteration's collectives: the outer body and the draft loop's body gamma - 1 times
  (every row drafting gamma tokens; the first draft call is in the outer body)."""
  loops = program['loops']
  return roofline.add_collectives(loops.get('outer', {}), loops.get('inner', {}),
                                  times=(1, max(gamma - 1, 0)))


def speculative_names(results: Mapping[str, Any]) -> List[str]:
  """The speculative programs of any block, in first-seen order (a table's columns)."""
  names = {}
  for b in results['blocks'].values():
    names.update((n, None) for n in b['programs'] if n != 'target-only')
  return list(names)


def memory_rows(results: Mapping[str, Any]) -> List[List[str]]:
  t5x = results.get('t5x', {}).get('blocks', {})
  spec = speculative_names(results)
  rows = []
  for key, b in results['blocks'].items():
    d, progs = b['per_device'], b['programs']
    temp = lambda name: _mb(progs[name]['memory']['temp_bytes']) if name in progs else ''
    t = t5x.get(key, {}).get('program', {}).get('memory', {})
    rows.append([key, _mb(d['params']['target']), _mb(d['params'].get('draft_sharded', 0)),
                 _mb(d['params'].get('draft_replicated', 0)), _mb(d['cache']['target']),
                 _mb(d['cache'].get('draft_sharded', 0)),
                 _mb(progs['target-only']['memory']['argument_bytes']), temp('target-only')] +
                [temp(n) for n in spec] +
                [_mb(t['argument_bytes']) if t else '', _mb(t['temp_bytes']) if t else ''])
  return rows


def collective_rows(results: Mapping[str, Any]) -> List[List[str]]:
  t5x = results.get('t5x', {}).get('blocks', {})
  rows = []
  for key, b in results['blocks'].items():
    progs = b['programs']
    cells = [key, roofline.collective_text(progs['target-only']['loops'].get('outer', {}))]
    for name in speculative_names(results):
      prog = progs.get(name)
      if prog is None:
        cells.append('')
        continue
      gamma = int(name.split()[0].split('=')[1])
      loops = prog['loops']
      cells.append(f"{roofline.collective_text(loops.get('outer', {}))} + "
                   f"{gamma - 1} x [{roofline.collective_text(loops.get('inner', {}))}] = "
                   f"{roofline.collective_text(iteration_collectives(prog, gamma))}")
    t = t5x.get(key, {}).get('program', {}).get('loops', {})
    cells.append(roofline.collective_text(t.get('outer', {})) if t else '')
    copies = sum(len(p['big_copies']) for p in progs.values())
    converts = progs['target-only']['loops'].get('big_converts', {}).get('outer', '')
    rows.append(cells + [str(copies), str(converts)])
  return rows


def token_rows(results: Mapping[str, Any]) -> List[List[str]]:
  t5x = results.get('t5x', {}).get('blocks', {})
  rows = []
  for key, b in results['blocks'].items():
    steps = b['steps']
    target = steps['target']
    cell = lambda s: f"{s['flops'] / 1e9:.2f} / {s['bytes_accessed'] / 1e6:.0f}"
    t = t5x.get(key, {}).get('steps', {}).get('1')
    rows.append([key, cell(target['1'])] +
                [cell(target[k]) for k in sorted(target, key=int) if k != '1'] +
                [cell(steps[f'draft_{p}']['1']) for p in PLACEMENTS if f'draft_{p}' in steps] +
                [roofline.collective_text(target['1']['collectives']),
                 roofline.collective_text(steps.get('draft_sharded', {}).get('1', {}).get(
                     'collectives', {})),
                 cell(t) if t else '',
                 ' / '.join(f"{p['compile_s']:.0f}" for p in b['programs'].values()),
                 f"{t5x[key]['program']['compile_s']:.0f}" if key in t5x else ''])
  return rows


def markdown(results: Mapping[str, Any]) -> str:
  """The report's tables (per device), the projection and T5X beside."""
  meta = results['meta']
  lines = harness.heading('Scale: T5 1.1 targets with the small draft on 8 devices', results)
  lines += [f"Inputs {meta['input_length']}, outputs {meta['output_length']}, draft "
            f"{meta['draft']}, parameters {meta['param_dtype']} (activations bfloat16). Blocks "
            "are `size mesh(data x model) batch output-length`. All figures per device, from "
            'the compiled programs (nothing run). XLA counts a while body once in cost '
            f"analysis: a fori_loop's flops at trip counts 1 and 16: {meta['while_cost_flops']}.",
            '']
  if not results['blocks']:
    return '\n'.join(lines)
  first = next(iter(results['blocks'].values()))
  spec = speculative_names(results)
  lines += ['## Memory per device (MB)', '']
  lines += harness.table(['block', 'params target', 'params draft sharded',
                          'params draft replicated', 'cache target', 'cache draft',
                          'arguments (target-only)', 'temporaries target-only'] +
                         [f'temporaries {n}' for n in spec] +
                         ["T5X arguments", "T5X temporaries"], memory_rows(results)) + ['']
  lines += ['## Collectives per loop iteration (count, result bytes)', '',
            'Speculative: outer body + (γ - 1) x the draft loop body = one iteration.', '']
  lines += harness.table(['block', 'target-only'] + spec +
                         ["T5X's loop", 'cache-sized copies (all loops)',
                          'cache-sized dtype converts per target-only step'],
                         collective_rows(results)) + ['']
  target_ks = [k for k in sorted(first['steps']['target'], key=int) if k != '1']
  lines += ['## Step programs: GFLOP / MB accessed per device; collectives; compile seconds', '']
  lines += harness.table(['block', 'target 1 token'] + [f'target {k} tokens' for k in target_ks] +
                         [f'draft {p}' for p in PLACEMENTS if f'draft_{p}' in first['steps']] +
                         ['target step collectives', 'draft (sharded) step collectives',
                          'T5X step (1 token)', 'compile s (predict programs)',
                          'compile s T5X'], token_rows(results)) + ['']
  lines += projection_lines(results)
  return '\n'.join(lines)


def projection_lines(results: Mapping[str, Any]) -> List[str]:
  """Roofline tables: greedy (α 0.75) and T=1 (α 0.62), the draft replicated (else sharded)."""
  first = next(iter(results['blocks'].values()))
  placement = next((p for p in reversed(PLACEMENTS) if f'draft_{p}' in first['steps']), None)
  if placement is None:
    return []
  lines = []
  for setting in ('greedy', 'sampling'):
    paper = roofline.PAPER[setting]
    lines += [f"## Projection, {setting} (α = {paper['alpha']}, draft {placement}); the paper: "
              f"{paper['speedup']}x at γ = {paper['gamma']} (T5-XXL, TPU v4)", '']
    lines += harness.table(roofline.HEADER, roofline.table_rows(
        results['blocks'], results.get('t5x', {}), results['meta']['projection_gammas'],
        placement, setting)) + ['']
  return lines


if __name__ == '__main__':
  main()
