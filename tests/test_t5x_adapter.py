"""The optional T5X adapter: importable without T5X; with T5X, decodes like the pair model."""

import jax
import numpy as np
import pytest

from speculative_t5x import decoding
from speculative_t5x import models
from speculative_t5x import network
from speculative_t5x import t5x_adapter
from conftest import tiny_config


def test_imports_without_t5x():
  assert isinstance(t5x_adapter.T5X_AVAILABLE, bool)
  assert hasattr(t5x_adapter, 'SpeculativeEncoderDecoderModel') == t5x_adapter.T5X_AVAILABLE


@pytest.mark.skipif(not t5x_adapter.T5X_AVAILABLE, reason='T5X is not installed')
def test_t5x_model_matches_pair_model():
  target_cfg, draft_cfg = tiny_config(), tiny_config(num_decoder_layers=1)
  model = t5x_adapter.SpeculativeEncoderDecoderModel(
      network.Transformer(target_cfg), network.Transformer(draft_cfg), None, None,
      decode_kwargs={'gamma': 2, 'temperature': 0.0})
  shapes = {'encoder_input_tokens': (2, 8), 'decoder_input_tokens': (2, 6)}
  variables = model.get_initial_variables(jax.random.PRNGKey(0), shapes)
  params = flax_unfreeze(variables['params'])
  batch = {'encoder_input_tokens': np.arange(2, 18, dtype=np.int32).reshape(2, 8),
           'decoder_input_tokens': np.zeros((2, 6), np.int32)}
  pair = models.EncoderDecoderModel(target_cfg, draft_cfg, decode_fn=decoding.speculative_sample,
                                    decode_kwargs={'gamma': 2, 'temperature': 0.0}, eos_id=1)
  np.testing.assert_array_equal(model.predict_batch(params, batch),
                                pair.predict_batch(params, batch))


def flax_unfreeze(x):
  import flax
  return flax.core.unfreeze(x)
