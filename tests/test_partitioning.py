"""Logical axis rules, parameter/cache shardings, and sharded decoding equal to one device."""

import json
import os
import pathlib
import subprocess
import sys
import types

import flax.linen as nn
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from speculative_t5x import models
from speculative_t5x import network
from speculative_t5x import partitioning
from conftest import tiny_config

_ALWAYS = (('relpos_buckets', None), ('abspos_buckets', None), ('length', None),
           ('layers', None), ('stack', None), ('mlp_activations', None))


# T5X's lists (t5x/partitioning.py, standard_logical_axis_rules), transcribed per layout. Only
# the 1-D layout has ('embed', None), early; the 2-D layouts put their embed rules last.
_T5X_RULES = {
    (1, 1): (('batch', 'data'), ('vocab', 'model'), ('embed', None), ('mlp', 'model'),
             ('heads', 'model'), ('kv', None), ('joined_kv', 'model')),
    (2, 1): (('batch', 'data'), ('vocab', 'model'), ('mlp', 'model'), ('heads', 'model'),
             ('kv', None), ('joined_kv', 'model'), ('embed', 'model')),
    (1, 2): (('batch', 'data'), ('vocab', 'model'), ('mlp', 'model'), ('heads', 'model'),
             ('kv', None), ('joined_kv', 'model'), ('embed', 'data')),
    (2, 2): (('batch', 'data'), ('vocab', 'model'), ('mlp', 'model'), ('heads', 'model'),
             ('kv', None), ('joined_kv', 'model'), ('embed', 'model'), ('embed', 'data')),
}


@pytest.mark.parametrize('act,par', sorted(_T5X_RULES))
def test_standard_rules_match_t5x(act, par):
  assert partitioning.standard_logical_axis_rules(act, par) == _T5X_RULES[act, par] + _ALWAYS
  extra = (('expert', 'model'), ('embed', 'data'))
  assert partitioning.standard_logical_axis_rules(act, par, additional_rules=list(extra)) == (
      _T5X_RULES[act, par] + _ALWAYS + extra)
  with pytest.raises(ValueError, match='must be 1 or 2'):
    partitioning.standard_logical_axis_rules(3, 1)


def _resolve(names, rules, shape=None):
  # Sizes 8 divide every mesh axis of the fake 2 x 4 mesh, so nothing is replicated for size.
  shape = shape or (8,) * len(names)
  return partitioning._spec_for_shape(names, shape, rules, _fake_mesh(2, 4))


@pytest.mark.parametrize('act,names,additional,t5x_spec', [
    # ('embed', None) is the 1-D layout's third rule: it settles embed as replicated before the
    # appended ('embed', 'data') is reached, so T5X ignores the extra rule (before it was
    # appended here, it made this P('data', 'model')).
    (1, ('embed', 'mlp'), [('embed', 'data')], P(None, 'model')),
    # 2-D activations: ('mlp', 'model') precedes ('embed', 'model'), so mlp takes 'model', the
    # embed rule finds 'model' used, no rule has settled embed, and the appended rule gives it
    # 'data'.
    (2, ('embed', 'mlp'), [('embed', 'data')], P('data', 'model')),
    # ... while an activation [batch, length, embed] has 'model' free: ('embed', 'model') wins
    # and the appended rule never applies ('data' is batch's anyway).
    (2, ('batch', 'length', 'embed'), [('embed', 'data')], P('data', None, 'model')),
    # A name the standard rules do not know: its appended rule comes after ('mlp', 'model'), so
    # mlp keeps 'model' and 'expert' is left replicated (prepended it would take 'model').
    (1, ('expert', 'embed', 'mlp'), [('expert', 'model')], P(None, None, 'model')),
    # ... and where nothing else claims 'model', the appended rule does apply.
    (1, ('expert', 'embed'), [('expert', 'model')], P('model')),
])
def test_additional_rules_resolve_as_t5x(act, names, additional, t5x_spec):
  rules = partitioning.standard_logical_axis_rules(act, 1, additional_rules=additional)
  assert _resolve(names, rules) == t5x_spec
  # The same answer through flax directly, and through a Partitioner given these rules.
  assert nn.logical_to_mesh_axes(names, rules) == P(*t5x_spec, *(None,) * (
      len(names) - len(t5x_spec)))
  assert partitioning.Partitioner(logical_axis_rules=rules).logical_axis_rules == rules


def test_gin_additional_rules_reach_the_partitioner():
  gin = pytest.importorskip('gin')
  from speculative_t5x import infer  # pylint: disable=g-import-not-at-top,unused-import
  gin.clear_config()
  try:
    gin.parse_config([
        'partitioning.Partitioner.logical_axis_rules = '
        '@partitioning.standard_logical_axis_rules()',
        "partitioning.standard_logical_axis_rules.additional_rules = [('expert', 'model')]",
    ])
    rules = gin.get_configurable('partitioning.Partitioner')().logical_axis_rules
  finally:
    gin.clear_config()
  assert rules == _T5X_RULES[1, 1] + _ALWAYS + (('expert', 'model'),)


def test_params_logical_axes_cover_every_parameter():
  cfg = tiny_config()
  params, params_axes = jax.eval_shape(lambda: network.init_params(cfg))
  names = partitioning.params_logical_axes(cfg)
  assert jax.tree.structure(params) == jax.tree.structure(
      names, is_leaf=lambda x: isinstance(x, tuple))
  assert names['decoder']['layers_0']['self_attention']['query']['kernel'] == ('embed', 'joined_kv')
  assert names['token_embedder']['embedding'] == ('vocab', 'embed')
  assert partitioning.axes_to_names(params_axes) == names


def _fake_mesh(data, model):
  # _spec_for_shape only reads mesh.shape, so divisibility can be checked without 8 devices.
  return types.SimpleNamespace(shape={'data': data, 'model': model})


def test_specs_follow_rules_and_replicate_undividable_axes():
  rules = partitioning.standard_logical_axis_rules()
  spec = partitioning._spec_for_shape(('embed', 'joined_kv'), (512, 384), rules, _fake_mesh(2, 4))
  assert spec == P(None, 'model')
  assert partitioning._spec_for_shape(('vocab', 'embed'), (64, 16), rules,
                                      _fake_mesh(2, 4)) == P('model')
  # 6 heads cannot be split 4 ways: replicated rather than an error or a wrong split.
  assert partitioning._spec_for_shape(('heads', 'relpos_buckets'), (6, 32), rules,
                                      _fake_mesh(2, 4)) == P()
  assert partitioning._spec_for_shape(('batch', 'length', 'heads', 'kv'), (8, 10, 4, 4), rules,
                                      _fake_mesh(2, 4)) == P('data', None, 'model')


def test_create_mesh_shapes():
  mesh = partitioning.create_mesh()
  assert mesh.axis_names == ('data', 'model')
  assert mesh.devices.shape == (jax.device_count(), 1)
  assert partitioning.create_mesh((-1, 1)).devices.shape == (jax.device_count(), 1)
  with pytest.raises(ValueError, match='needs 2 devices'):
    partitioning.create_mesh((2, 1), devices=jax.devices()[:1])


def test_create_mesh_on_cpu_is_process_major_id_order():
  # T5X's CPU mesh: no topology, devices in (process, id) order whatever order they come in.
  devices = jax.devices()
  mesh = partitioning.create_mesh(devices=devices[::-1])
  assert [d.id for d in mesh.devices.ravel()] == sorted(d.id for d in devices)


def _fake_tpu_v4(coords_by_id):
  # Just what mesh_utils reads: a megacore TPU v4 chip per device, one slice, one process.
  return [types.SimpleNamespace(id=i, platform='tpu', device_kind='TPU v4', coords=c,
                                core_on_chip=0, process_index=0, slice_index=0)
          for i, c in enumerate(coords_by_id)]


def test_device_grid_puts_model_groups_on_torus_planes():
  # A 2x2x2 slice whose ids run in a scrambled physical order: in plain id order the 'model'
  # groups of a (2, 4) mesh would be [0..3] and [4..7], which are not planes of the torus.
  coords = [(0, 0, 0), (1, 1, 1), (0, 1, 0), (1, 0, 1), (1, 0, 0), (0, 1, 1), (1, 1, 0),
            (0, 0, 1)]
  grid = partitioning.device_grid(_fake_tpu_v4(coords), (2, 4))
  assert grid.shape == (2, 4)
  planes = []
  for row in grid:
    points = np.array([d.coords for d in row])
    fixed = [axis for axis in range(3) if len(set(points[:, axis])) == 1]
    # A full 2x2 plane: one coordinate constant, the four points distinct.
    assert len(fixed) == 1 and len({tuple(p) for p in points}) == 4, points
    planes.append(fixed[0])
  assert planes[0] == planes[1]


def _fake_gpus(hosts, per_host):
  # Listed device-major across hosts, the order least like a good layout.
  return [types.SimpleNamespace(id=h * per_host + i, platform='gpu', device_kind='H100',
                                process_index=h)
          for i in range(per_host) for h in range(hosts)]


@pytest.mark.parametrize('mesh_shape', [(4, 2), (2, 4), (8, 1), (1, 8)])
def test_device_grid_keeps_model_groups_inside_a_gpu_host(mesh_shape):
  grid = partitioning.device_grid(_fake_gpus(2, 4), mesh_shape)
  assert grid.shape == mesh_shape
  assert sorted(d.id for d in grid.ravel()) == list(range(8))
  for row in grid:
    hosts = [d.process_index for d in row]
    if mesh_shape[1] <= 4:
      assert len(set(hosts)) == 1, hosts   # NVLink only
    else:
      assert hosts == sorted(hosts)        # one host's block, then the next


def test_device_grid_falls_back_to_plain_order():
  # A TPU subset with a hole is no cuboid: mesh_utils refuses it, the plain order is used.
  devices = _fake_tpu_v4([(0, 0, 0), (1, 1, 0)])
  grid = partitioning.device_grid(devices[::-1], (1, 2))
  assert [d.id for d in grid.ravel()] == [0, 1]


def test_cache_shardings():
  cfg = tiny_config(num_heads=2)
  model = models.EncoderDecoderModel(cfg, tiny_config(num_decoder_layers=1), eos_id=1)
  target = jax.eval_shape(lambda: network.init_params(cfg)[0])
  enc = jax.ShapeDtypeStruct((2, 8), np.int32)
  cache = jax.eval_shape(lambda p, e: model._init_cache(model.module, p, e, 6), target, enc)
  shardings = partitioning.cache_shardings(cache, partitioning.create_mesh())
  assert shardings.self_key[0].spec == P('data', 'model')    # [batch, heads, kv, length]
  assert shardings.cross_value[0].spec == P('data', 'model')  # [batch, heads, length, kv]
  assert shardings.index.spec == P('data')
  assert shardings.encoder_mask.spec == P('data')


def test_decode_variables_are_sharded_like_the_embedding():
  tied = tiny_config(logits_via_embedding=True)
  model = models.EncoderDecoderModel(tied, tiny_config(num_decoder_layers=1), eos_id=1)
  params = jax.eval_shape(lambda: {'target': network.init_params(tied)[0],
                                   'draft': network.init_params(model.draft_config)[0]})
  params = jax.eval_shape(lambda p: model.with_decode_variables(p, fuse=True), params)
  shardings = partitioning.pair_shardings(model, partitioning.create_mesh(), params=params)
  assert shardings['target']['token_embedder']['embedding'].spec == P('model',)  # [vocab, embed]
  assert shardings['decode']['target']['decoder']['logits_kernel'].spec == P(None, 'model')
  # The stacked projections keep each shard's own heads (mlp columns): the stacked axis whole.
  layer = shardings['decode']['draft']['decoder']['layers_0']
  assert layer['self_attention']['qkv_kernel'].spec == P(None, None, 'model')
  assert layer['encoder_decoder_attention']['kv_kernel'].spec == P(None, None, 'model')
  assert 'logits_kernel' not in shardings['decode']['draft']['decoder']  # untied


def test_sharded_decoding_equals_single_device():
  """8 simulated CPU devices in a subprocess (the flag must precede JAX's initialisation)."""
  env = dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS=(
      os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8').strip())
  worker = pathlib.Path(__file__).with_name('sharding_worker.py')
  proc = subprocess.run([sys.executable, str(worker), '8x1', '4x2', '2x4'], env=env,
                        capture_output=True, text=True, timeout=900)
  lines = [l for l in proc.stdout.splitlines() if l.startswith('RESULT ')]
  assert proc.returncode == 0 and lines, proc.stderr[-3000:]
  report = json.loads(lines[-1][len('RESULT '):])
  assert report['devices'] == 8
  assert set(report['results']) == {'speculative', 'bild', 'decoder_only_draft'}
  for name, result in report['results'].items():
    # The batch must exercise both acceptance and rejection, or equality proves little.
    assert result['ref_accepted'] > 0 and result['ref_rollbacks'] > 0, (name, result)
    for shape, model_shards in (('8x1', 1), ('4x2', 2), ('2x4', 4)):
      if name == 'decoder_only_draft' and shape != '2x4':
        continue  # the worker runs it on the last mesh only
      got = result[shape]
      assert got['decodes_equal'] and got['aux_equal'], (name, shape, got)
      assert got['decodes_spec'] == "P('data',)"
      assert got['query_kernel_shards'] == model_shards, (name, shape, got)
