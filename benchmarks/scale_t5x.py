"""T5X's side of `benchmarks.scale`: its own greedy loop at the same shapes and meshes.

  PYTHONPATH=.:<t5 stub> /path/to/t5x-venv/bin/python -m benchmarks.scale_t5x \
      '{"blocks": [["xl", [1, 8], 1, 128]], "input_length": 512, "param_dtype": "bfloat16",
        "topology": "v5e:2x4", "out": "results/tpu/v5e/t5x_tpu.json"}'

Runs in T5X's environment (T5X is never a dependency of this project;
../shared/docs/t5x_private_install.md installs it apart); `benchmarks.scale --platform tpu`
reads the 'out' file in its folder (t5x_tpu.json) into its tables. Blocks: [T5 1.1 size,
(data, model) mesh, batch, output length]; 'configs' may give a size's T5Config fields (default:
the shipped gin file's). Per block it compiles, for 8 fake CPU devices or with 'topology' a TPU
topology's (libtpu in T5X's environment), T5X's `EncoderDecoderModel.predict_batch_with_aux`
over its example network with `temperature_sample` at temperature 0, partitioned by T5X's
`standard_logical_axis_rules` under its `PjittedFnWithContext`, and one step of its loop
(`_compute_logits_from_slice`, its decoder's `tokens_to_logits`), read with
`benchmarks.compiled` as this project's. Writes 'out' after every block; without T5X, why not.
"""

from __future__ import annotations

import os
import sys

if 'jax' not in sys.modules:
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                             ' --xla_force_host_platform_device_count=8').strip()

import dataclasses  # pylint: disable=g-import-not-at-top,wrong-import-position
import functools
import json
from pathlib import Path
from typing import Any, Dict, Mapping, Sequence

import flax
from flax.linen import partitioning as flax_partitioning
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from benchmarks import compiled as xla

EOS_ID = 1


def t5x_modules() -> Any:
  from t5x import decoding  # pylint: disable=g-import-not-at-top
  from t5x import models  # pylint: disable=g-import-not-at-top
  from t5x import partitioning  # pylint: disable=g-import-not-at-top
  from t5x.examples.t5 import network  # pylint: disable=g-import-not-at-top
  return decoding, models, partitioning, network


def t5x_model(t5x: Any, values: Mapping[str, Any]) -> Any:
  """T5X's EncoderDecoderModel over its example network, greedy temperature_sample."""
  decoding, models, _, network = t5x
  fields = {f.name for f in dataclasses.fields(network.T5Config)}
  config = network.T5Config(**{k: (tuple(v) if isinstance(v, list) else v)
                               for k, v in values.items() if k in fields})
  return models.EncoderDecoderModel(
      network.Transformer(config), None, None, None,
      decode_fn=functools.partial(decoding.temperature_sample, temperature=0.0))


def cache_spec(leaf: Any, batch: int, model_size: int) -> PartitionSpec:
  """T5X's cache leaves: [batch, heads, ...] split as this project splits its cache; the rest
  (cache_index) replicated."""
  shape = leaf.shape
  if len(shape) == 4 and shape[0] == batch:
    return PartitionSpec('data', 'model' if shape[1] % model_size == 0 else None)
  return PartitionSpec('data') if shape and shape[0] == batch else PartitionSpec()


def block(t5x: Any, spec: Mapping[str, Any], size: str, mesh_shape: Sequence[int], batch: int,
          output_length: int) -> Dict[str, Any]:
  """Memory, loop collectives and compile seconds of T5X's predict; cost of one step."""
  _, _, partitioning, _ = t5x
  gin = Path(__file__).resolve().parents[1] / f'gin_configs/models/t5_1_1/{size}.gin'
  model = t5x_model(t5x, spec.get('configs', {}).get(size) or xla.config_values(gin))
  shapes = {'encoder_input_tokens': (batch, spec['input_length']),
            'decoder_input_tokens': (batch, output_length)}
  variables = jax.eval_shape(lambda: model.get_initial_variables(
      jax.random.PRNGKey(0), shapes, {k: jnp.int32 for k in shapes}))
  dtype = jnp.dtype(spec['param_dtype'])
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype),
                        flax.core.unfreeze(variables['params']))
  rules = partitioning.standard_logical_axis_rules()
  names = flax_partitioning.get_axis_names(variables['params_axes'])
  mesh = Mesh(device_grid(spec, mesh_shape), ('data', 'model'))
  param_shardings = jax.tree.map(
      lambda n: NamedSharding(mesh, flax_partitioning.logical_to_mesh_axes(tuple(n), rules)),
      flax.core.unfreeze(names), is_leaf=lambda x: isinstance(x, PartitionSpec))
  data = NamedSharding(mesh, PartitionSpec('data'))
  batch_abs = {k: jax.ShapeDtypeStruct(v, jnp.int32) for k, v in shapes.items()}
  predict = partitioning.PjittedFnWithContext(jax.jit(
      functools.partial(model.predict_batch_with_aux, decoder_params={'eos_id': EOS_ID}),
      in_shardings=(param_shardings, data), out_shardings=data), mesh, rules)
  program, seconds = xla.time_compile(lambda: predict.lower(params, batch_abs).compile())
  loops = xla.loop_report(program.as_text(), 1 << 62)
  out = {'program': {'compile_s': seconds, 'memory': xla.memory(program),
                     'optimal_seconds': tpu_seconds(program),
                     'cost': xla.cost(program), 'loops': xla.summarize_loops(loops)},
         'params_bytes': xla.sharded_bytes(params, param_shardings)}
  out['steps'] = {'1': step(t5x, model, params, param_shardings, mesh, rules, batch_abs)}
  return out


def step(t5x: Any, model: Any, params: Any, param_shardings: Any, mesh: Mesh, rules: Any,
         batch_abs: Mapping[str, Any]) -> Dict[str, Any]:
  """One step of T5X's loop: `_compute_logits_from_slice` on a cache of these shapes (its
  cross-attention keys/values are recomputed from the encoder output on every step)."""
  decoding, _, partitioning, _ = t5x
  enc, dec = batch_abs['encoder_input_tokens'], batch_abs['decoder_input_tokens']
  batch, length = dec.shape
  encoded = jax.eval_shape(lambda p, e: model.module.apply(
      {'params': p}, e, enable_dropout=False, method=model.module.encode), params, enc)
  cache = jax.eval_shape(lambda p, x, e, d: model._compute_kv_cache(p, x, e, d)[0],  # pylint: disable=protected-access
                         params, encoded, enc, dec)
  cache_shardings = jax.tree.map(
      lambda leaf: NamedSharding(mesh, cache_spec(leaf, batch, mesh.shape['model'])), cache)
  data = NamedSharding(mesh, PartitionSpec('data'))

  def one_step(p, c, x, e):
    state = decoding.DecodingState(cur_index=jnp.zeros((batch,), jnp.int32),
                                   sequences=jnp.zeros((batch, length), jnp.int32),
                                   cur_token=jnp.zeros((batch, 1), jnp.int32), cache=c)
    logits, new_cache = model._compute_logits_from_slice(state, p, x, e, length)  # pylint: disable=protected-access
    return jnp.argmax(logits, axis=-1), new_cache

  fn = partitioning.PjittedFnWithContext(jax.jit(
      one_step, in_shardings=(param_shardings, cache_shardings, data, data),
      out_shardings=(data, cache_shardings), donate_argnums=1), mesh, rules)
  program, seconds = xla.time_compile(lambda: fn.lower(params, cache, encoded, enc).compile())
  module = xla.Module.parse(program.as_text())
  return {'compile_s': seconds, **xla.cost(program), 'optimal_seconds': tpu_seconds(program),
          'cycles': xla.entry_cycles(program.as_text()) if 'estimated_cycles' in program.as_text()
                    else 0,
          'collectives': xla.collectives(module.instructions(module.entry, into_loops=True))}


def device_grid(spec: Mapping[str, Any], mesh_shape: Sequence[int]) -> Any:
  """The mesh's devices: 8 fake CPU devices, or with spec['topology'] the TPU topology's
  (`aot.topology_devices`, XLA:TPU compiling on this CPU) in their described order."""
  if not spec.get('topology'):
    return mesh_utils.create_device_mesh(tuple(mesh_shape), jax.devices())
  from speculative_t5x import aot  # pylint: disable=g-import-not-at-top
  devices = aot.topology_devices(spec['topology'])
  return np.array(devices[:int(np.prod(mesh_shape))]).reshape(tuple(mesh_shape))


def tpu_seconds(program: Any) -> float:
  """XLA:TPU's estimate (`aot.optimal_seconds`), NaN from another backend."""
  from speculative_t5x import aot  # pylint: disable=g-import-not-at-top
  return aot.optimal_seconds(program)


def main(spec_json: str) -> None:
  spec = json.loads(spec_json)
  out_path = Path(spec['out'])
  try:
    t5x = t5x_modules()
  except ImportError as e:
    out_path.write_text(json.dumps({'skipped': f'T5X not importable: {e}'}) + '\n')
    print('skipped: T5X not importable:', e)
    return
  results = {'blocks': {}, 'machine': f'jax {jax.__version__}, {jax.device_count()} devices'}
  for size, mesh, batch, length in spec['blocks']:
    key = f'{size} {mesh[0]}x{mesh[1]} b{batch} out{length}'
    results['blocks'][key] = block(t5x, spec, size, mesh, batch, length)
    b = results['blocks'][key]
    print(key, f"compile {b['program']['compile_s']:.0f}s temp "
          f"{b['program']['memory']['temp_bytes'] / 2**20:.0f}MiB loop "
          f"{b['program']['loops'].get('outer')} step flops {b['steps']['1']['flops']:.3g}",
          flush=True)
    out_path.write_text(json.dumps(results, indent=1) + '\n')


if __name__ == '__main__':
  main(sys.argv[1])
