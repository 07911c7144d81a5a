"""Logical axis rules, parameter/cache shardings, and sharded decoding equal to one device."""

import json
import os
import pathlib
import subprocess
import sys
import types

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


@pytest.mark.parametrize('act,par,embed_rules', [
    (1, 1, []), (2, 1, [('embed', 'model')]), (1, 2, [('embed', 'data')]),
    (2, 2, [('embed', 'model'), ('embed', 'data')])])
def test_standard_rules_match_t5x(act, par, embed_rules):
  expected = ((('batch', 'data'), ('vocab', 'model')) + tuple(embed_rules) +
              (('embed', None), ('mlp', 'model'), ('heads', 'model'), ('kv', None),
               ('joined_kv', 'model')) + _ALWAYS)
  assert partitioning.standard_logical_axis_rules(act, par) == expected


def test_additional_rules_take_precedence():
  rules = partitioning.standard_logical_axis_rules(additional_rules=[('vocab', None)])
  assert rules[0] == ('vocab', None)
  with pytest.raises(ValueError, match='must be 1 or 2'):
    partitioning.standard_logical_axis_rules(3, 1)


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


def test_sharded_decoding_equals_single_device():
  """8 simulated CPU devices in a subprocess (the flag must precede JAX's initialisation)."""
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=8 '
             '--xla_backend_optimization_level=0', JAX_PLATFORMS='cpu')
  worker = pathlib.Path(__file__).with_name('sharding_worker.py')
  proc = subprocess.run([sys.executable, str(worker), '8x1', '4x2', '2x4'], env=env,
                        capture_output=True, text=True, timeout=900)
  lines = [l for l in proc.stdout.splitlines() if l.startswith('RESULT ')]
  assert proc.returncode == 0 and lines, proc.stderr[-3000:]
  report = json.loads(lines[-1][len('RESULT '):])
  assert report['devices'] == 8
  for name, result in report['results'].items():
    # The batch must exercise both acceptance and rejection, or equality proves little.
    assert result['ref_accepted'] > 0 and result['ref_rollbacks'] > 0, (name, result)
    for shape, model_shards in (('8x1', 1), ('4x2', 2), ('2x4', 4)):
      got = result[shape]
      assert got['decodes_equal'] and got['aux_equal'], (name, shape, got)
      assert got['decodes_spec'] == "P('data',)"
      assert got['query_kernel_shards'] == model_shards, (name, shape, got)
