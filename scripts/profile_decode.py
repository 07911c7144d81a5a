"""Where decode time goes: per-op breakdown of one cached target step and of whole decodes.

  python scripts/profile_decode.py                          # batch 1: steps k=1,5; greedy gamma=3
  python scripts/profile_decode.py --batch 8 --gamma 2 --sentences 32

Runs under `jax.profiler` on the embedded pair and joins the trace's per-kernel events (XLA:CPU
emits one per thunk: a fusion, a library matmul, a copy, ...) with the compiled HLO, so each
kernel is named by what it computes. Prints, per program, the time by kernel kind and the
matmuls by output shape, per call (steps) or per sentence (decodes). The profiler adds some
overhead per kernel: read the shares, not the absolute times.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, Tuple

import jax
import jax.numpy as jnp

from speculative_t5x import data
from speculative_t5x import decoding
from speculative_t5x import models
from speculative_t5x import network
from speculative_t5x import train

PRETRAINED = Path(__file__).resolve().parents[1] / 'speculative_t5x' / 'pretrained'
LENGTH = 64


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
      if op == 'dot' or (called and any(' dot(' in x for x in computations.get(called.group(1),
                                                                                 []))):
        kind += ' (matmul)'
      out[name] = (kind, shape.split('{')[0])
  return out


def profile(fn: Callable[[], object], hlo_text: str, runs: int, per: float, title: str) -> None:
  """Traces `runs` calls of fn and prints the kernel breakdown divided by `per`."""
  described = kernel_descriptions(hlo_text)
  jax.block_until_ready(fn())
  with tempfile.TemporaryDirectory() as trace_dir:
    start = time.perf_counter()
    jax.profiler.start_trace(trace_dir)
    for _ in range(runs):
      jax.block_until_ready(fn())
    jax.profiler.stop_trace()
    wall = (time.perf_counter() - start) / per
    trace = sorted(glob.glob(f'{trace_dir}/plugins/profile/*/*.trace.json.gz'))[-1]
    events = [e for e in json.load(gzip.open(trace))['traceEvents']
              if e.get('ph') == 'X' and e['name'] in described]
  by_kind, kind_count = collections.Counter(), collections.Counter()
  by_shape, shape_count = collections.Counter(), collections.Counter()
  for e in events:
    kind, shape = described[e['name']]
    by_kind[kind] += e['dur'] / per
    kind_count[kind] += 1 / per
    if 'matmul' in kind or kind.startswith('ynn_fusion'):
      by_shape[shape] += e['dur'] / per
      shape_count[shape] += 1 / per
  total = sum(by_kind.values())
  print(f'\n## {title}\nwall (traced) {1e3 * wall:.2f} ms, kernels {total / 1e3:.2f} ms in '
        f'{sum(kind_count.values()):.0f} kernels\n')
  print('| kernel kind | us | share | kernels |\n|---|---|---|---|')
  for kind, us in by_kind.most_common(15):
    print(f'| {kind} | {us:.0f} | {us / total:.0%} | {kind_count[kind]:.1f} |')
  print('\n| matmul output shape | us | share | count |\n|---|---|---|---|')
  for shape, us in by_shape.most_common(12):
    print(f'| {shape} | {us:.0f} | {us / total:.0%} | {shape_count[shape]:.1f} |')


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--batch', type=int, default=1)
  parser.add_argument('--steps', default='1,5', help='tokens per row of the profiled steps')
  parser.add_argument('--gamma', type=int, default=3, help='greedy speculative gamma')
  parser.add_argument('--sentences', type=int, default=16, help='test sentences to decode')
  parser.add_argument('--data_dir', default=None, help='folder holding multi30k/')
  parser.add_argument('--input_length_step', type=int, default=16,
                      help='encoder width: the longest input rounded up to this (0: 64)')
  args = parser.parse_args()
  configs, params = {}, {}
  for name in ('target', 'draft'):
    configs[name], params[name], _ = train.load_weights(
        PRETRAINED / f'multi30k_de_en_{name}.msgpack')

  module = network.Transformer(configs['target'])
  variables = {'params': params['target'], network.DECODE_COLLECTION: network.decode_variables(
      configs['target'], params['target'])}
  encoder_tokens = jax.random.randint(jax.random.PRNGKey(1), (args.batch, 20), 3,
                                      configs['target'].vocab_size)
  encoded = module.apply(variables, encoder_tokens, method=network.Transformer.encode)
  cache = module.apply(variables, encoded, encoder_tokens, LENGTH,
                       method=network.Transformer.init_cache)
  cache = cache.with_index(jnp.full((args.batch,), 8, jnp.int32))
  step = jax.jit(lambda v, t, c: module.apply(v, t, c, method=network.Transformer.decode_step))
  for k in (int(k) for k in args.steps.split(',')):
    tokens = jnp.full((args.batch, k), 5, jnp.int32)
    compiled = step.lower(variables, tokens, cache).compile()
    profile(lambda: compiled(variables, tokens, cache), compiled.as_text(), 30, 30,
            f'target step, batch {args.batch}, {k} token(s) per row (per call)')

  try:
    sources, _ = data.load_split('test', data_dir=args.data_dir)
  except FileNotFoundError as e:
    sys.exit(f'error: Multi30k not found ({e}); pass --data_dir or set {data.DATA_ENV_VAR}.')
  rows = data.encode(sources[:args.sentences], LENGTH)
  # One width for all batches (one compiled program to join the trace with), as scripts/
  # benchmark.py rounds each batch's.
  width = data.pad_batch(rows, None, LENGTH, LENGTH, length_step=args.input_length_step)[
      'encoder_input_tokens'].shape[1]
  batches = [{k: jnp.asarray(v) for k, v in data.pad_batch(
      rows[i:i + args.batch], None, width, LENGTH, args.batch).items()}
             for i in range(0, len(rows), args.batch)]
  prepared = jax.jit(models.EncoderDecoderModel(
      configs['target'], configs['draft']).with_decode_variables)(params)
  for title, decode_fn, kwargs in (
      ('target-only greedy', decoding.temperature_sample, {'temperature': 0.0}),
      (f'speculative greedy gamma={args.gamma}', decoding.speculative_sample,
       {'temperature': 0.0, 'gamma': args.gamma})):
    model = models.EncoderDecoderModel(configs['target'], configs['draft'], decode_fn=decode_fn,
                                       decode_kwargs=kwargs, eos_id=data.EOS_ID)
    compiled = jax.jit(model.predict_batch_with_aux).lower(prepared, batches[0]).compile()
    profile(lambda: [compiled(prepared, b) for b in batches], compiled.as_text(), 1, len(rows),
            f'{title}, batch {args.batch}, {len(rows)} test sentences, encoder width {width} '
            '(per sentence: encoders and the whole decode)')


if __name__ == '__main__':
  main()
