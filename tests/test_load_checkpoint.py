"""`checkpoints.load_checkpoint`: one entry point that detects every supported format."""

import dataclasses

import numpy as np
import pytest
from flax import traverse_util

from speculative_t5x import checkpoints
from conftest import tiny_config
from fast_params import random_params


def _assert_same(a, b):
  fa, fb = traverse_util.flatten_dict(a), traverse_util.flatten_dict(b)
  assert fa.keys() == fb.keys()
  for k in fa:
    np.testing.assert_array_equal(np.asarray(fa[k], np.float32), np.asarray(fb[k], np.float32))


@pytest.fixture(scope='module')
def params():
  return random_params(tiny_config(), 0)


def test_every_format_round_trips_through_one_loader(tmp_path, params):
  cfg = tiny_config()
  legacy = checkpoints.save_t5x_legacy_checkpoint(tmp_path / 'legacy', params, step=3)
  inline = checkpoints.save_t5x_legacy_checkpoint(tmp_path / 'inline', params, use_zarr=False)
  orbax = checkpoints.save_t5x_orbax_checkpoint(tmp_path / 'orbax', params, step=5)
  own = checkpoints.save_params(tmp_path / 'own', params)
  for path in (legacy, tmp_path / 'legacy', inline / 'checkpoint', orbax, tmp_path / 'orbax', own):
    _assert_same(checkpoints.load_checkpoint(path, cfg), params)
  # project -> T5X legacy -> Orbax -> project, values unchanged.
  again = checkpoints.load_checkpoint(
      checkpoints.save_t5x_orbax_checkpoint(
          tmp_path / 'chain', checkpoints.load_checkpoint(legacy, cfg), step=1), cfg)
  _assert_same(again, params)


def test_exported_weights_file(tmp_path, params):
  cfg = tiny_config()
  path = tmp_path / 'model.msgpack'
  checkpoints.export_weights(params, cfg, path)
  loaded = checkpoints.load_checkpoint(path, cfg, dtype='float32')
  # The export is bfloat16: equal to the bf16-rounded parameters.
  import ml_dtypes
  rounded = traverse_util.unflatten_dict({
      k: np.asarray(v).astype(ml_dtypes.bfloat16).astype(np.float32)
      for k, v in traverse_util.flatten_dict(params).items()})
  _assert_same(loaded, rounded)
  assert {v.dtype for v in traverse_util.flatten_dict(loaded).values()} == {np.dtype(np.float32)}
  # A config whose shapes agree but whose meaning differs is caught from the stored config.
  other = dataclasses.replace(cfg, mlp_activations=('silu', 'linear'))
  with pytest.raises(ValueError, match="mlp_activations .*'gelu', 'linear'.* in the checkpoint"):
    checkpoints.load_checkpoint(path, other)
  with pytest.raises(ValueError, match='does not match T5Config'):
    checkpoints.load_checkpoint(path, dataclasses.replace(cfg, num_decoder_layers=3))


def test_missing_and_garbage(tmp_path):
  with pytest.raises(FileNotFoundError):
    checkpoints.load_checkpoint(tmp_path / 'nope')
  junk = tmp_path / 'junk.bin'
  junk.write_bytes(b'\x00\x01garbage')
  with pytest.raises(ValueError, match='not a T5X checkpoint'):
    checkpoints.load_checkpoint(junk)
