"""Ahead of time: a pair's decode programs compiled for devices this machine does not have.

Nothing is allocated and nothing runs: parameters and caches are `jax.eval_shape` structures,
and each program is lowered with the shardings a job gives it and compiled. On a CPU machine
with libtpu installed (`pip install 'jax[tpu]==<jax version>'`, best in a venv of its own),
`topology_devices('v5e:2x4')` gives a TPU topology's devices and XLA:TPU compiles for them;
its cost analysis carries `optimal_seconds`, the compiler's estimate of a program's time on an
idle chip (a lower bound, not a timing).

XLA counts a while loop's body once, and XLA:TPU gives no time estimate for a program that
holds a loop, so a decode is read from its straight-line parts: one cached step of k tokens
per row (`step_program`), the prefill a batch runs once (`prefill_program`: encoder and
caches) and one iteration of the decode loop with the draft unrolled (`iteration_program`,
`decoding.loop_iteration`). `step_costs` turns them into the `costs.StepCosts` a calibration
writes: the schedule of a job before it gets its chips.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable, Dict, List, Mapping, Sequence, Tuple

from flax.linen import partitioning as nn_partitioning
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from speculative_t5x import costs
from speculative_t5x import decoding
from speculative_t5x import models
from speculative_t5x import network
from speculative_t5x import partitioning

# HBM per chip, GiB (Cloud TPU's published figures); the TensorCores of a chip that JAX shows
# as separate devices (v4's two) share it.
HBM_GIB = {'TPU v4': 32, 'TPU v5 lite': 16, 'TPU v5': 95, 'TPU v6 lite': 32}
REPLICATED = partitioning.DRAFT_REPLICATED


def topology_devices(name: str) -> List[Any]:
  """The TPU devices of topology `name` ('v5e:2x4'); SystemExit with one line when libtpu is
  missing or does not know it. A topology smaller than libtpu's default host (2x2x1) is
  described as a host of its own size."""
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  # libtpu takes a lock file that keeps a second process off the chips; compiling touches no
  # chip, so two compiling processes (a sweep and the tests) may share this machine.
  os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
  describe = functools.partial(topologies.get_topology_desc, topology_name=name, platform='tpu')
  try:
    try:
      return list(describe().devices)
    except Exception as error:  # pylint: disable=broad-except
      if 'not divisible' not in str(error):
        raise
      dims = tuple(int(d) for d in name.split(':')[1].split('x'))
      return list(describe(chips_per_host_bounds=(dims + (1, 1, 1))[:3]).devices)
  except Exception as error:  # pylint: disable=broad-except
    message = str(error).splitlines()[0] if str(error) else type(error).__name__
    raise SystemExit(f'error: XLA:TPU cannot describe topology {name!r} ({message}); it needs '
                     f"libtpu (pip install 'jax[tpu]=={jax.__version__}') and a topology it "
                     'knows: v4:2x2x1, v5e:2x4, v5p:2x2x1, v6e:2x4, ...') from None


class DoesNotFit(Exception):
  """XLA:TPU refused a program: it needs more HBM than a device has (the message says how
  much, in XLA's words)."""


def compile_program(build: Callable[[], Any]) -> Any:
  """build() (a lowering and compile); DoesNotFit with XLA's one line when the program does
  not fit the device's memory."""
  try:
    return build()
  except Exception as error:  # pylint: disable=broad-except  (jax's JaxRuntimeError)
    if 'RESOURCE_EXHAUSTED' not in str(error):
      raise
    line = next((l for l in str(error).splitlines() if 'RESOURCE_EXHAUSTED' in l), str(error))
    raise DoesNotFit(line.split('RESOURCE_EXHAUSTED: ')[-1].strip()) from None


def hbm_bytes(devices: Sequence[Any]) -> int:
  """HBM one device may use: its chip's, split among the chip's devices."""
  kind = devices[0].device_kind
  if kind not in HBM_GIB:
    raise SystemExit(f'error: no HBM figure for {kind!r}; known: {", ".join(HBM_GIB)}.')
  chips = {tuple(d.coords) for d in devices}
  return HBM_GIB[kind] * 2**30 * len(chips) // len(devices)


def fit(program: Any, devices: Sequence[Any]) -> Dict[str, Any]:
  """Bytes a device needs for a compiled program (arguments, outputs and temporaries, less the
  outputs that alias arguments) and, for TPU devices, whether their chip's HBM holds them."""
  m = program.memory_analysis()
  need = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes -
          m.alias_size_in_bytes)
  if devices[0].platform != 'tpu':
    return {'bytes': need}
  hbm = hbm_bytes(devices)
  return {'bytes': need, 'hbm': hbm, 'fits': need <= hbm, 'short_by': max(need - hbm, 0)}


# XLA:TPU's cost analysis counts each of these custom calls as -1 s: a concatenation of
# asynchronously prefetched slices, a bitcast that moves no data (checked: a step program's
# optimal_seconds is its positive estimate minus exactly their count, at every size and batch).
UNPRICED_CALLS = ('ConcatBitcast',)


def optimal_seconds(program: Any) -> float:
  """XLA:TPU's estimate of a compiled program's time, each `UNPRICED_CALLS` priced at 0 (NaN
  from a backend without an estimate; XLA:TPU's is negative for a program with a loop)."""
  analysis = program.cost_analysis()
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0] if analysis else {}
  text = program.as_text()
  unpriced = sum(text.count(f'custom_call_target="{name}"') for name in UNPRICED_CALLS)
  return float(analysis.get('optimal_seconds', float('nan'))) + unpriced


def abstract_params(target: network.T5Config, draft: network.T5Config, dtype: str) -> Any:
  """{'target', 'draft', 'decode'} as ShapeDtypeStructs in `dtype` (nothing allocated)."""
  model = models.EncoderDecoderModel(target, draft)
  params = jax.eval_shape(lambda: {'target': network.init_params(target)[0],
                                   'draft': network.init_params(draft)[0]})
  # As an accelerator prepares them: no stacked projections (their default on a CPU backend
  # would add copies an accelerator job does not make).
  params = jax.eval_shape(functools.partial(model.with_decode_variables, fuse=False), params)
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.dtype(dtype)), params)


def abstract_caches(model: models.EncoderDecoderModel, params: Any, batch: int,
                    input_length: int, output_length: int) -> Tuple[Any, Any]:
  """The (target, draft) DecoderCaches a decode of these shapes starts from, abstractly."""
  tokens = jax.ShapeDtypeStruct((batch, input_length), jnp.int32)
  return jax.eval_shape(lambda p, t: model.init_caches(p, t, output_length), params, tokens)


def step_program(config: network.T5Config, params: Any, decode_vars: Any,
                 cache: network.DecoderCache, mesh: Mesh,
                 rules: partitioning.LogicalAxisRules, k: int) -> Any:
  """One cached decoder step of k tokens per row, compiled as the greedy loop uses it (logits
  reduced to argmaxes, the cache updated in place), with the loop's shardings."""
  module = network.Transformer(config)
  data = NamedSharding(mesh, PartitionSpec('data'))
  cache_shardings = partitioning.cache_shardings(cache, mesh, rules)
  in_shardings = (
      partitioning.params_shardings(params, partitioning.params_logical_axes(config), mesh,
                                    rules),
      partitioning.params_shardings(decode_vars, network.decode_variables_logical_axes(config),
                                    mesh, rules), data, cache_shardings)

  def step(p, d, tokens, c):
    logits, new_cache = module.apply({'params': p, network.DECODE_COLLECTION: d}, tokens, c,
                                     method=network.Transformer.decode_step)
    return jnp.argmax(logits, axis=-1), new_cache

  fn = jax.jit(step, in_shardings=in_shardings, out_shardings=(data, cache_shardings),
               donate_argnums=3)
  tokens = jax.ShapeDtypeStruct((cache.index.shape[0], k), jnp.int32)
  return fn.lower(params, decode_vars, tokens, cache).compile()


def _state_shardings(state: decoding.LoopState, mesh: Mesh, rules: Mapping[str, Any]) -> Any:
  """A LoopState's shardings: rows over 'data', caches by their rules, the key replicated."""
  data = NamedSharding(mesh, PartitionSpec('data'))
  rows = jax.tree.map(lambda _: data, state.replace(target_cache=None, draft_cache=None,
                                                    rng=None))
  return rows.replace(
      target_cache=partitioning.cache_shardings(state.target_cache, mesh, rules['target']),
      draft_cache=partitioning.cache_shardings(state.draft_cache, mesh, rules['draft']),
      rng=NamedSharding(mesh, PartitionSpec()))


def iteration_program(model: models.EncoderDecoderModel, mesh: Mesh, params: Any,
                      caches: Tuple[Any, Any], output_length: int, gamma: int,
                      temperature: float) -> Any:
  """One iteration of the decode loop (`decoding.loop_iteration`; gamma 0: the target alone),
  with the predict program's shardings, the draft replicated."""
  rules = partitioning.standard_logical_axis_rules()
  batch = caches[0].index.shape[0]
  inputs = jax.ShapeDtypeStruct((batch, output_length), jnp.int32)
  start = functools.partial(decoding.start_loop, gamma=gamma, max_decode_steps=None,
                            initial_index=None)
  state, forced, limit = jax.eval_shape(start, inputs, *caches, jax.random.PRNGKey(0))
  data = NamedSharding(mesh, PartitionSpec('data'))
  shardings = _state_shardings(state, mesh, partitioning.model_rules(model, mesh, rules,
                                                                     REPLICATED))
  pair = partitioning.pair_shardings(model, mesh, rules, params, REPLICATED)

  def one(p, s, f, l):
    fn = lambda name, module: models.make_tokens_to_logits(module, p[name], p['decode'][name])
    with nn_partitioning.axis_rules(rules):
      return decoding.loop_iteration(s, f, l, fn('target', model.module),
                                     fn('draft', model.draft_module), model.eos_id, gamma,
                                     temperature)

  fn = jax.jit(one, in_shardings=(pair, shardings, data, data), out_shardings=shardings,
               donate_argnums=1)
  return fn.lower(params, state, forced, limit).compile()


def prefill_program(model: models.EncoderDecoderModel, mesh: Mesh, params: Any, batch: int,
                    input_length: int, output_length: int) -> Any:
  """What a batch runs once: the encoder and both decoder caches (`init_caches`)."""
  rules = partitioning.standard_logical_axis_rules()
  pair = partitioning.pair_shardings(model, mesh, rules, params, REPLICATED)
  data = NamedSharding(mesh, PartitionSpec('data'))

  def prefill(p, tokens):
    with nn_partitioning.axis_rules(rules):
      return model.init_caches(p, tokens, output_length)

  tokens = jax.ShapeDtypeStruct((batch, input_length), jnp.int32)
  return jax.jit(prefill, in_shardings=(pair, data)).lower(params, tokens).compile()


def decode_programs(target: network.T5Config, draft: network.T5Config, mesh: Mesh, batch: int,
                    *, input_length: int, output_length: int, target_ks: Sequence[int],
                    iterations: Sequence[Tuple[int, float]], dtype: str = 'bfloat16'
                    ) -> Dict[str, Callable[[], Any]]:
  """The straight-line programs of one batch size, each compiled when its thunk is called:
  'target k' (each of target_ks tokens per row), 'draft 1', 'draft 2', 'prefill', and
  'iteration {gamma} {temperature}' for each of `iterations` ((gamma, temperature) pairs)."""
  model = models.EncoderDecoderModel(target, draft)
  params = abstract_params(target, draft, dtype)
  caches = abstract_caches(model, params, batch, input_length, output_length)
  rules = partitioning.model_rules(model, mesh, draft_placement=REPLICATED)
  step = lambda name, config, cache, k: lambda: step_program(
      config, params[name], params['decode'][name], cache, mesh, rules[name], k)
  programs = {f'target {k}': step('target', target, caches[0], k) for k in target_ks}
  programs.update({f'draft {k}': step('draft', draft, caches[1], k) for k in (1, 2)})
  programs['prefill'] = lambda: prefill_program(model, mesh, params, batch, input_length,
                                                output_length)
  for gamma, temperature in iterations:
    programs[f'iteration {gamma} {temperature:g}'] = functools.partial(
        iteration_program, model, mesh, params, caches, output_length, gamma, temperature)
  return programs


def step_costs(seconds: Mapping[str, float], batch: int, max_gamma: int,
               temperature: float) -> costs.StepCosts:
  """`costs.StepCosts` (ms) from the estimated seconds of `decode_programs`' programs (target
  steps 1..max_gamma + 1, an iteration at every gamma 0..max_gamma): steps and prefill as
  estimated, and each gamma's prediction corrected to its own iteration's estimate
  (`StepCosts.corrections`). XLA:TPU's estimate is a bound for a whole program, not a sum of
  its calls (a draft's second call costs a fraction of its first), so an iteration is not its
  steps plus an overhead, and no overhead is fitted."""
  ms = {name: 1e3 * value for name, value in seconds.items()}
  steps = costs.StepCosts(batch, {k: ms[f'target {k}'] for k in range(1, max_gamma + 2)},
                          {k: ms[f'draft {k}'] for k in (1, 2)}, batch_ms=ms['prefill'])
  return dataclasses.replace(steps, corrections={
      g: ms[f'iteration {g} {temperature:g}'] / steps.steps_ms(g) for g in range(max_gamma + 1)})
