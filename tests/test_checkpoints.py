"""Tests of speculative_t5x.checkpoints: T5X's parameter tree, checkpoint formats and errors.

Tests marked by the `t5x_data` fixture need the shared data folder (`../shared/data` next to the
repository, or $SPECULATIVE_T5X_DATA) and skip without it.
"""

import json
import os
import re
from pathlib import Path

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from conftest import shared_files
from speculative_t5x import checkpoints
from speculative_t5x import network

# T5X's tiny test model (t5x/test_utils.get_t5_test_model, t5x/testdata/test_t5_tiny.checkpoint_0).
TINY = network.T5Config(vocab_size=32128, emb_dim=8, num_heads=4, head_dim=3, mlp_dim=16,
                        num_encoder_layers=2, num_decoder_layers=2,
                        mlp_activations=('gelu', 'linear'), dropout_rate=0.0)
# Small enough that writing and reading checkpoints of it takes milliseconds.
SMALL = network.T5Config(vocab_size=40, emb_dim=6, num_heads=2, head_dim=4, mlp_dim=10,
                         num_encoder_layers=1, num_decoder_layers=2,
                         mlp_activations=('gelu', 'linear'))




def _flat(tree):
  return {'/'.join(k): v for k, v in traverse_util.flatten_dict(tree).items()}


def _assert_trees_equal(a, b):
  fa, fb = _flat(a), _flat(b)
  assert sorted(fa) == sorted(fb)
  for name in fa:
    assert np.asarray(fa[name]).dtype == np.asarray(fb[name]).dtype, name
    np.testing.assert_array_equal(np.asarray(fa[name]), np.asarray(fb[name]), err_msg=name)


@pytest.fixture(scope='module')
def small_params():
  """Random parameters in SMALL's tree (random so that any mix-up of leaves shows)."""
  shapes, _ = jax.eval_shape(lambda: network.init_params(SMALL))
  rng = np.random.default_rng(0)
  return jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32), shapes)


# ------------------------------------------------------------------------------------------------
# The parameter tree is T5X's (t5x_interfaces.md §3.2, §3.3).


def _t5x_tree(vocab, emb, hd, heads, mlp, n_enc, n_dec, wi_names, logits_dense):
  """{name: (shape, axes)} as listed in t5x_interfaces.md §3.2; hd = num_heads * head_dim."""
  scale = ((emb,), ('embed',))
  qkv = ((emb, hd), ('embed', 'joined_kv'))
  out = ((hd, emb), ('joined_kv', 'embed'))
  tree = {
      'token_embedder/embedding': ((vocab, emb), ('vocab', 'embed')),
      'encoder/relpos_bias/rel_embedding': ((heads, 32), ('heads', 'relpos_buckets')),
      'encoder/encoder_norm/scale': scale,
      'decoder/relpos_bias/rel_embedding': ((heads, 32), ('heads', 'relpos_buckets')),
      'decoder/decoder_norm/scale': scale,
  }
  mlp_params = {f'mlp/{wi}/kernel': ((emb, mlp), ('embed', 'mlp')) for wi in wi_names}
  mlp_params['mlp/wo/kernel'] = ((mlp, emb), ('mlp', 'embed'))
  for i in range(n_enc):
    layer = {'pre_attention_layer_norm/scale': scale, 'pre_mlp_layer_norm/scale': scale,
             'attention/query/kernel': qkv, 'attention/key/kernel': qkv,
             'attention/value/kernel': qkv, 'attention/out/kernel': out, **mlp_params}
    tree.update({f'encoder/layers_{i}/{k}': v for k, v in layer.items()})
  for i in range(n_dec):
    layer = {'pre_self_attention_layer_norm/scale': scale,
             'pre_cross_attention_layer_norm/scale': scale, 'pre_mlp_layer_norm/scale': scale,
             **mlp_params}
    for attention in ('self_attention', 'encoder_decoder_attention'):
      layer.update({f'{attention}/{p}/kernel': qkv for p in ('query', 'key', 'value')})
      layer[f'{attention}/out/kernel'] = out
    tree.update({f'decoder/layers_{i}/{k}': v for k, v in layer.items()})
  if logits_dense:
    tree['decoder/logits_dense/kernel'] = ((emb, vocab), ('embed', 'vocab'))
  return tree


@pytest.mark.parametrize('config,wi_names,logits_dense', [
    (TINY, ('wi_0', 'wi_1'), True),
    # T5 1.0 layout: one activation is named 'wi'; logits via the embedding, no logits_dense.
    (network.T5Config(vocab_size=32128, emb_dim=8, num_heads=4, head_dim=3, mlp_dim=16,
                      num_encoder_layers=2, num_decoder_layers=2, mlp_activations=('relu',),
                      logits_via_embedding=True), ('wi',), False),
], ids=['t5_1_1_tiny', 't5_1_0_tiny'])
def test_param_tree_names_shapes_and_axes_are_t5x(config, wi_names, logits_dense):
  params, axes = jax.eval_shape(lambda: network.init_params(config))
  expected = _t5x_tree(config.vocab_size, config.emb_dim, config.num_heads * config.head_dim,
                       config.num_heads, config.mlp_dim, config.num_encoder_layers,
                       config.num_decoder_layers, wi_names, logits_dense)
  assert {k: tuple(v.shape) for k, v in _flat(params).items()} == {
      k: shape for k, (shape, _) in expected.items()}
  assert all(v.dtype == jnp.float32 for v in jax.tree.leaves(params))
  # params_axes mirrors the tree with an '_axes' suffix on the leaf name.
  assert {k: tuple(v.names) for k, v in _flat(axes).items()} == {
      f'{k}_axes': names for k, (_, names) in expected.items()}


def test_t5_1_1_small_parameter_count_is_t5x():
  config = network.T5Config(vocab_size=32128, emb_dim=512, num_heads=6, head_dim=64, mlp_dim=1024,
                            num_encoder_layers=8, num_decoder_layers=8,
                            mlp_activations=('gelu', 'linear'))
  params, _ = jax.eval_shape(lambda: network.init_params(config))
  assert sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params)) == 76_961_152


# ------------------------------------------------------------------------------------------------
# T5X's own tiny checkpoint and T5X's outputs on it.


def test_tiny_t5x_checkpoint_loads_as_stored(t5x_data):
  path = t5x_data / 'test_t5_tiny.checkpoint_0'
  params = checkpoints.load_t5x_checkpoint(str(path), config=TINY)
  raw = flax.serialization.msgpack_restore(path.read_bytes())['optimizer']['target']
  _assert_trees_equal(params, raw)


def test_tiny_t5x_checkpoint_reproduces_t5x_outputs(t5x_data):
  ref = np.load(t5x_data / 'test_t5_tiny_reference.npz')
  config = network.T5Config(**json.loads(str(ref['config'])))
  assert config == TINY
  params = checkpoints.load_t5x_checkpoint(t5x_data / 'test_t5_tiny.checkpoint_0', config)
  logits = jax.jit(network.Transformer(config).apply)(
      {'params': params}, ref['encoder_input_tokens'], ref['decoder_input_tokens'],
      ref['decoder_target_tokens'])
  logits = np.asarray(logits, np.float64)
  assert np.abs(logits[:2, :6] - ref['logits_first2']).max() < 1e-4
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  at_targets = np.take_along_axis(log_probs, ref['decoder_target_tokens'][..., None], -1)[..., 0]
  np.testing.assert_allclose(at_targets, ref['log_softmax_at_targets'], rtol=1e-5, atol=1e-4)
  score = (at_targets * ref['decoder_loss_weights']).sum(-1)
  np.testing.assert_allclose(score, ref['score_batch'], rtol=1e-5, atol=1e-4)


# ------------------------------------------------------------------------------------------------
# Checkpoints written by a real T5X install (shared data `t5x/orbax`, `t5x/legacy_zarr`): the same
# parameters as `test_t5_tiny.checkpoint_0`, with Adafactor slots beside them.


@pytest.fixture(scope='module')
def t5x_written(t5x_data) -> Path:
  shared_files('t5x/orbax/checkpoint_0/state', 't5x/legacy_zarr/checkpoint_0/checkpoint')
  return t5x_data


@pytest.fixture(scope='module')
def tiny_params(t5x_data):
  return checkpoints.load_t5x_checkpoint(t5x_data / 'test_t5_tiny.checkpoint_0', TINY)


# What T5X users pass: the step directory (with or without a trailing slash), the model directory
# above it, or the item itself (Orbax `state/`, the legacy msgpack file).
_T5X_FORMS = {
    'step_dir': lambda d: d / 'checkpoint_0',
    'step_dir_slash': lambda d: f"{d / 'checkpoint_0'}/",
    'model_dir': lambda d: d,
    'item': lambda d: d / 'checkpoint_0' / ('state' if d.name == 'orbax' else 'checkpoint'),
}


@pytest.mark.parametrize('form', sorted(_T5X_FORMS))
@pytest.mark.parametrize('layout', ['orbax', 'legacy_zarr'])
@pytest.mark.parametrize('load', [checkpoints.load_checkpoint, checkpoints.load_t5x_checkpoint],
                         ids=['load_checkpoint', 'load_t5x_checkpoint'])
def test_checkpoints_written_by_t5x_load_exactly(t5x_written, tiny_params, layout, form, load):
  path = _T5X_FORMS[form](t5x_written / layout)
  loaded = load(path, TINY)
  # Same tree, dtypes and shapes, max abs diff 0; no optimizer slot leaks into the params.
  _assert_trees_equal(loaded, tiny_params)
  assert len(_flat(loaded)) == 52


def test_t5x_orbax_checkpoint_loads_without_orbax_warnings(t5x_written, caplog):
  # T5X keeps Orbax's step metadata beside `state/`; reading `state/` must not complain that
  # there is none inside it.
  with caplog.at_level('WARNING'):
    checkpoints.load_t5x_checkpoint(t5x_written / 'orbax' / 'checkpoint_0')
  assert not [r for r in caplog.records if r.levelname == 'WARNING'], caplog.text


def _spec_leaves(tree):
  return _flat(traverse_util.unflatten_dict(traverse_util.flatten_dict(
      tree, is_leaf=lambda _, v: isinstance(v, dict) and 'driver' in v)))


def test_legacy_writer_reproduces_t5x_layout(t5x_written, tiny_params, tmp_path):
  real = t5x_written / 'legacy_zarr' / 'checkpoint_0'
  ours = checkpoints.save_t5x_legacy_checkpoint(tmp_path, tiny_params)
  real_msgpack = flax.serialization.msgpack_restore((real / 'checkpoint').read_bytes())
  our_msgpack = flax.serialization.msgpack_restore((ours / 'checkpoint').read_bytes())
  assert our_msgpack['version'] == real_msgpack['version'] == 3
  real_step = real_msgpack['optimizer']['state']['step']
  our_step = our_msgpack['optimizer']['state']['step']
  assert our_step.dtype == real_step.dtype and our_step == real_step
  # Every target leaf is the same TensorStore spec, relative path included.
  assert _spec_leaves(our_msgpack['optimizer']['target']) == _spec_leaves(
      real_msgpack['optimizer']['target'])
  # The same zarr folders (T5X also writes `state.param_states.*` ones, which are not params),
  # with byte-identical .zarray metadata.
  folders = sorted(p.name for p in ours.iterdir() if p.is_dir())
  assert folders == sorted(p.name for p in real.iterdir() if p.name.startswith('target.'))
  for folder in folders:
    assert (ours / folder / '.zarray').read_text() == (real / folder / '.zarray').read_text()
    assert sorted(os.listdir(ours / folder)) == sorted(os.listdir(real / folder))


def test_orbax_writer_reproduces_t5x_layout(t5x_written, tiny_params, tmp_path):
  real = t5x_written / 'orbax' / 'checkpoint_0'
  ours = checkpoints.save_t5x_orbax_checkpoint(tmp_path, tiny_params)
  # T5X also writes an (empty) `dataset` item; there is no input pipeline state here.
  assert sorted(os.listdir(ours)) == sorted(set(os.listdir(real)) - {'dataset'})
  assert sorted(os.listdir(ours / 'state')) == sorted(os.listdir(real / 'state'))
  handlers = json.loads((ours / '_CHECKPOINT_METADATA').read_text())['item_handlers']
  assert handlers['state'] == json.loads(
      (real / '_CHECKPOINT_METADATA').read_text())['item_handlers']['state']
  real_tree = json.loads((real / 'state' / '_METADATA').read_text())['tree_metadata']
  our_tree = json.loads((ours / 'state' / '_METADATA').read_text())['tree_metadata']
  real_kept = {k: v for k, v in real_tree.items() if 'param_states' not in k}
  assert sorted(our_tree) == sorted(real_kept)
  for key, value in real_kept.items():
    assert our_tree[key]['value_metadata'] == value['value_metadata'], key


def test_t5x_step_dir_without_params_is_a_one_line_error(tmp_path):
  # What an interrupted or foreign job leaves: a step directory holding only T5X's dataset item.
  step_dir = tmp_path / 'model' / 'checkpoint_100'
  (step_dir / 'dataset').mkdir(parents=True)
  for path in (step_dir, tmp_path / 'model'):
    for load in (checkpoints.load_checkpoint, checkpoints.load_t5x_checkpoint):
      with pytest.raises(ValueError) as err:
        load(path)
      text = str(err.value)
      assert text.startswith(f'{step_dir} is not a T5X checkpoint') and '\n' not in text, text
  with pytest.raises(ValueError, match='only local checkpoint paths'):
    checkpoints.load_checkpoint('gs://bucket/model/checkpoint_100')


# ------------------------------------------------------------------------------------------------
# Writing and reading T5X's legacy and Orbax layouts and the project's format.


def test_legacy_zarr_layout_is_t5x(tmp_path, small_params):
  step_dir = checkpoints.save_t5x_legacy_checkpoint(tmp_path, small_params, step=7)
  assert step_dir == tmp_path / 'checkpoint_7'
  contents = flax.serialization.msgpack_restore((step_dir / 'checkpoint').read_bytes())
  assert contents['version'] == 3 and int(contents['optimizer']['state']['step']) == 7
  spec = contents['optimizer']['target']['encoder']['layers_0']['attention']['query']['kernel']
  assert spec['driver'] == 'zarr'
  assert spec['kvstore'] == {'driver': 'file',
                             'path': 'target.encoder.layers_0.attention.query.kernel/'}
  assert spec['metadata']['shape'] == [6, 8]
  zarray = json.loads(
      (step_dir / 'target.encoder.layers_0.attention.query.kernel' / '.zarray').read_text())
  assert zarray['zarr_format'] == 2 and zarray['dtype'] == '<f4'
  assert zarray['compressor'] == {'id': 'gzip', 'level': 1}
  assert zarray['dimension_separator'] == '.'
  assert (step_dir / 'target.encoder.layers_0.attention.query.kernel' / '0.0').is_file()
  # Nothing half-written is left behind.
  assert [p.name for p in tmp_path.iterdir()] == ['checkpoint_7']


def test_orbax_layout_is_t5x(tmp_path, small_params):
  step_dir = checkpoints.save_t5x_orbax_checkpoint(tmp_path, small_params, step=3)
  assert step_dir == tmp_path / 'checkpoint_3'
  assert (step_dir / 'state' / '_METADATA').is_file()
  assert (step_dir / 'state' / 'manifest.ocdbt').is_file()
  keys = set(json.loads((step_dir / 'state' / '_METADATA').read_text())['tree_metadata'])
  expected = {str(('target',) + k) for k in traverse_util.flatten_dict(small_params)}
  assert keys == expected | {"('state', 'step')"}


def test_zarr_inline_and_orbax_checkpoints_load_identically(tmp_path, small_params):
  zarr_dir = checkpoints.save_t5x_legacy_checkpoint(tmp_path / 'zarr', small_params, step=5)
  inline_dir = checkpoints.save_t5x_legacy_checkpoint(tmp_path / 'inline', small_params, step=5,
                                                      use_zarr=False)
  orbax_dir = checkpoints.save_t5x_orbax_checkpoint(tmp_path / 'orbax', small_params, step=5)
  paths = [
      tmp_path / 'zarr', zarr_dir, zarr_dir / 'checkpoint',  # model dir, step dir, msgpack file
      tmp_path / 'inline', inline_dir / 'checkpoint',
      tmp_path / 'orbax', orbax_dir, orbax_dir / 'state',
  ]
  for path in paths:
    loaded = checkpoints.load_t5x_checkpoint(str(path), config=SMALL)
    _assert_trees_equal(loaded, small_params)
  # The inline variant really is inline; the zarr one really reads the zarr arrays.
  assert not any(p.is_dir() for p in inline_dir.iterdir())
  (zarr_dir / 'target.decoder.decoder_norm.scale' / '0').write_bytes(b'garbage')
  with pytest.raises(ValueError, match="'decoder/decoder_norm/scale'"):
    checkpoints.load_t5x_checkpoint(zarr_dir)


def test_legacy_reader_takes_chunking_from_the_stored_array(tmp_path, small_params):
  # As in T5X's reader, the spec's chunks/compressor need not match what the .zarray says.
  step_dir = checkpoints.save_t5x_legacy_checkpoint(tmp_path, small_params)
  contents = flax.serialization.msgpack_restore((step_dir / 'checkpoint').read_bytes())
  flat = traverse_util.flatten_dict(contents['optimizer']['target'],
                                    is_leaf=lambda _, v: 'driver' in v)
  for spec in flat.values():
    spec['metadata'].update(chunks=[1] * len(spec['metadata']['shape']),
                            compressor={'id': 'zlib', 'level': 9})
  contents['optimizer']['target'] = traverse_util.unflatten_dict(flat)
  (step_dir / 'checkpoint').write_bytes(flax.serialization.msgpack_serialize(contents))
  _assert_trees_equal(checkpoints.load_t5x_checkpoint(step_dir, SMALL), small_params)


def test_model_dir_reads_highest_step(tmp_path, small_params):
  older = jax.tree.map(lambda x: x + 1.0, small_params)
  checkpoints.save_t5x_legacy_checkpoint(tmp_path, older, step=2)
  checkpoints.save_t5x_orbax_checkpoint(tmp_path, small_params, step=10)
  # Steps compare as numbers, and an unfinished (temporary) checkpoint is ignored.
  checkpoints.save_t5x_legacy_checkpoint(tmp_path, older, step=9)
  (tmp_path / 'checkpoint_20.tmp-123').mkdir()
  _assert_trees_equal(checkpoints.load_t5x_checkpoint(tmp_path), small_params)


@pytest.mark.parametrize('dtype', ['bfloat16', jnp.bfloat16])
def test_dtype_option_casts_every_leaf(tmp_path, small_params, dtype):
  zarr_dir = checkpoints.save_t5x_legacy_checkpoint(tmp_path / 'zarr', small_params)
  orbax_dir = checkpoints.save_t5x_orbax_checkpoint(tmp_path / 'orbax', small_params)
  for path in (zarr_dir, orbax_dir):
    loaded = checkpoints.load_t5x_checkpoint(path, SMALL, dtype=dtype)
    expected = jax.tree.map(lambda x: x.astype(jnp.bfloat16), small_params)
    _assert_trees_equal(loaded, expected)
  with pytest.raises(ValueError, match='floating'):
    checkpoints.load_t5x_checkpoint(zarr_dir, dtype='int32')


def test_project_format_round_trips(tmp_path, small_params):
  path = checkpoints.save_params(tmp_path / 'params', small_params, step=42)
  _assert_trees_equal(checkpoints.load_params(path, config=SMALL), small_params)
  _assert_trees_equal(checkpoints.load_t5x_checkpoint(path), small_params)
  as_bf16 = checkpoints.load_params(str(path), dtype='bfloat16')
  assert {x.dtype for x in jax.tree.leaves(as_bf16)} == {jnp.dtype(jnp.bfloat16)}
  # jax arrays save as well as numpy ones; an existing checkpoint is only replaced on request.
  doubled = jax.tree.map(lambda x: jnp.asarray(x) * 2, small_params)
  with pytest.raises(FileExistsError):
    checkpoints.save_params(path, doubled)
  checkpoints.save_params(path, doubled, overwrite=True)
  _assert_trees_equal(checkpoints.load_params(path), jax.tree.map(np.asarray, doubled))


# ------------------------------------------------------------------------------------------------
# Errors.


def test_missing_path_raises_file_not_found(tmp_path):
  missing = tmp_path / 'no' / 'such' / 'checkpoint_1'
  for load in (checkpoints.load_t5x_checkpoint, checkpoints.load_params):
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
      load(missing)


def test_not_a_checkpoint_raises_value_error(tmp_path, small_params):
  cases = {
      'random.bin': np.random.default_rng(1).bytes(1000),
      'notes.txt': b'this is not a checkpoint\n',
      # Starts like a map but is truncated.
      'truncated': flax.serialization.msgpack_serialize({'version': 3})[:-1],
      'no_optimizer': flax.serialization.msgpack_serialize({'version': 3, 'params': small_params}),
      'no_target': flax.serialization.msgpack_serialize({'version': 3, 'optimizer': {'x': 1}}),
  }
  for name, data in cases.items():
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(ValueError, match='is not a T5X checkpoint') as err:
      checkpoints.load_t5x_checkpoint(path)
    assert str(path) in str(err.value)
  (tmp_path / 'empty').mkdir()
  with pytest.raises(ValueError, match='is not a T5X checkpoint'):
    checkpoints.load_t5x_checkpoint(tmp_path / 'empty')
  legacy = checkpoints.save_t5x_legacy_checkpoint(tmp_path / 'legacy', small_params)
  with pytest.raises(ValueError, match='not a speculative_t5x params checkpoint'):
    checkpoints.load_params(legacy)


def _edited(params, edit):
  flat = traverse_util.flatten_dict(params)
  edit(flat)
  return traverse_util.unflatten_dict(flat)


def _drop(flat):
  del flat[('decoder', 'layers_1', 'mlp', 'wo', 'kernel')]


def _add(flat):
  flat[('encoder', 'layers_0', 'mlp', 'wi_2', 'kernel')] = np.zeros((6, 10), np.float32)


def _reshape(flat):
  flat[('decoder', 'layers_0', 'mlp', 'wi_0', 'kernel')] = np.zeros((6, 20), np.float32)


@pytest.mark.parametrize('edit,message', [
    (_drop, "parameter 'decoder/layers_1/mlp/wo/kernel' is missing from the checkpoint"),
    (_add, "parameter 'encoder/layers_0/mlp/wi_2/kernel' is in the checkpoint but not in the "
           'config'),
    (_reshape, "parameter 'decoder/layers_0/mlp/wi_0/kernel' has shape (6, 20) in the checkpoint "
               'but (6, 10) in the config'),
], ids=['missing', 'unexpected', 'misshaped'])
@pytest.mark.parametrize('save', ['legacy', 'orbax'])
def test_tree_mismatch_names_the_parameter(tmp_path, small_params, edit, message, save):
  bad = _edited(small_params, edit)
  if save == 'legacy':
    path = checkpoints.save_t5x_legacy_checkpoint(tmp_path, bad)
  else:
    path = checkpoints.save_t5x_orbax_checkpoint(tmp_path, bad)
  with pytest.raises(ValueError) as err:
    checkpoints.load_t5x_checkpoint(path, config=SMALL)
  text = str(err.value)
  assert text.startswith('checkpoint does not match T5Config: ')
  assert message in text
  assert '\n' not in text
  # Without a config nothing is checked: the edited tree loads as written.
  _assert_trees_equal(checkpoints.load_t5x_checkpoint(path), bad)
