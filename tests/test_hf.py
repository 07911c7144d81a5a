"""Hugging Face T5 folders -> T5Config + params, compared logit for logit with transformers."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from speculative_t5x import checkpoints
from speculative_t5x import hf
from speculative_t5x import network

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')


def _save_hf(path, safe=True, bf16=False, **overrides):
  """A randomly initialised HF T5 (no download) saved with save_pretrained; returns the model."""
  values = dict(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=3,
                num_heads=2, feed_forward_proj='gated-gelu', tie_word_embeddings=False,
                dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
  values.update(overrides)
  torch.manual_seed(0)
  model = transformers.T5ForConditionalGeneration(transformers.T5Config(**values)).eval()
  with torch.no_grad():
    # HF's init makes near-uniform logits at this size; spread the weights so that a
    # transposition or a swapped tensor cannot hide in the tolerance.
    for p in model.parameters():
      p.mul_(3.0)
  if bf16:
    model = model.to(torch.bfloat16)
  model.save_pretrained(path, safe_serialization=safe)
  return model


def _tokens():
  rng = np.random.default_rng(0)
  enc = rng.integers(2, 64, (2, 7))
  enc[1, 5:] = 0  # padding
  tgt = rng.integers(2, 64, (2, 6))
  dec_in = np.concatenate([np.zeros((2, 1), np.int64), tgt[:, :-1]], axis=1)
  return enc, dec_in, tgt


def _compare(model, config, params):
  enc, dec_in, tgt = _tokens()
  ours = network.Transformer(config).apply(
      {'params': params}, jnp.asarray(enc, jnp.int32), jnp.asarray(dec_in, jnp.int32),
      jnp.asarray(tgt, jnp.int32))
  with torch.no_grad():
    theirs = model.float()(input_ids=torch.tensor(enc), attention_mask=torch.tensor(enc > 0),
                           decoder_input_ids=torch.tensor(dec_in)).logits.numpy()
  # float32 agreement, relative to the logits' scale (summation orders differ).
  np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-5 * np.abs(theirs).max(), rtol=0)
  assert np.abs(theirs).max() > 1.0  # not a degenerate comparison


@pytest.mark.parametrize('variant', ['t5_1_1_safetensors', 't5_1_1_pytorch_bin',
                                     't5_1_0_tied_relu'])
def test_logits_match_transformers(tmp_path, variant):
  overrides = {}
  if variant == 't5_1_0_tied_relu':
    overrides = dict(feed_forward_proj='relu', tie_word_embeddings=True)
  model = _save_hf(tmp_path, safe=(variant != 't5_1_1_pytorch_bin'), **overrides)
  assert hf.is_hf_checkpoint(tmp_path)
  config, params = hf.load_hf_t5(tmp_path)
  assert (config.emb_dim, config.num_heads, config.head_dim, config.mlp_dim) == (16, 2, 8, 32)
  assert (config.num_encoder_layers, config.num_decoder_layers) == (2, 3)
  if variant == 't5_1_0_tied_relu':
    assert config.mlp_activations == ('relu',) and config.logits_via_embedding
  else:
    assert config.mlp_activations == ('gelu', 'linear') and not config.logits_via_embedding
    assert 'logits_dense' in params['decoder']
  _compare(model, config, params)


def test_load_checkpoint_detects_hf_and_checks_config(tmp_path):
  model = _save_hf(tmp_path)
  config, _ = hf.load_hf_t5(tmp_path)
  params = checkpoints.load_checkpoint(tmp_path, config)
  _compare(model, config, params)
  wrong = network.T5Config(**{**config.__dict__, 'num_heads': 4, 'head_dim': 4})
  with pytest.raises(ValueError, match='checkpoint does not match T5Config: num_heads 2 in the '
                                       'checkpoint but 4 in the config'):
    checkpoints.load_checkpoint(tmp_path, wrong)


def test_bfloat16_safetensors_read_exactly(tmp_path):
  model = _save_hf(tmp_path, bf16=True)
  weights = hf.read_hf_weights(tmp_path)
  ref = model.state_dict()['encoder.block.0.layer.0.SelfAttention.q.weight'].float().numpy()
  got = weights['encoder.block.0.layer.0.SelfAttention.q.weight']
  assert str(got.dtype) == 'bfloat16'
  np.testing.assert_array_equal(got.astype(np.float32), ref)


def test_unsupported_and_incomplete_checkpoints(tmp_path):
  _save_hf(tmp_path)
  cfg = json.loads((tmp_path / 'config.json').read_text())
  (tmp_path / 'config.json').write_text(json.dumps({**cfg, 'relative_attention_num_buckets': 64}))
  with pytest.raises(ValueError, match='relative_attention_num_buckets is 64'):
    hf.load_hf_t5(tmp_path)
  (tmp_path / 'config.json').write_text(json.dumps(cfg))
  config, _ = hf.load_hf_t5(tmp_path)
  weights = hf.read_hf_weights(tmp_path)
  del weights['decoder.block.1.layer.2.DenseReluDense.wo.weight']
  with pytest.raises(ValueError, match='lacks decoder.block.1.layer.2.DenseReluDense.wo.weight'):
    hf.convert_hf_weights(weights, config)
