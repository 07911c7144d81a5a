"""Hugging Face T5 folders <-> T5Config + params, compared logit for logit with transformers."""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from speculative_t5x import checkpoints
from speculative_t5x import decoding
from speculative_t5x import hf
from speculative_t5x import models
from speculative_t5x import network
from conftest import apply

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
  ours = apply(network.Transformer(config), {'params': params}, jnp.asarray(enc, jnp.int32),
               jnp.asarray(dec_in, jnp.int32), jnp.asarray(tgt, jnp.int32))
  with torch.no_grad():
    theirs = model.float()(input_ids=torch.tensor(enc), attention_mask=torch.tensor(enc > 0),
                           decoder_input_ids=torch.tensor(dec_in)).logits.numpy()
  # float32 agreement, relative to the logits' scale (summation orders differ). On this
  # project's current CPUs (jax 0.10.2) the tied relu variant's padded row differs by up to
  # 3.2e-5 of the scale (also on the code before the decode hot-path changes); a swapped or
  # transposed tensor differs by O(1).
  np.testing.assert_allclose(np.asarray(ours), theirs, atol=5e-5 * np.abs(theirs).max(), rtol=0)
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


# ------------------------------------------------------------------------------------------------
# T5X -> Hugging Face.

_EXPORT_BASE = dict(vocab_size=64, emb_dim=16, num_heads=2, head_dim=8, num_encoder_layers=2,
                    num_decoder_layers=3, mlp_dim=32, mlp_activations=('gelu', 'linear'),
                    dropout_rate=0.0)
_EXPORT_VARIANTS = {
    't5_1_1_untied': {},
    't5_1_0_tied_relu': dict(mlp_activations=('relu',), logits_via_embedding=True),
    'heads_times_head_dim_ne_emb': dict(num_heads=3, head_dim=4,
                                        mlp_activations=('silu', 'linear')),
}


def _random_params(config, seed=0, spread=4.0):
  """network.init_params with the embedding (and logits kernel) times `spread`.

  Sharper output distributions than the init's, so a transposed or swapped tensor shows and
  greedy choices have clear margins. Scaling every parameter instead makes the random network
  so ill-conditioned that float32 itself (HF's as much as ours) drifts ~5e-5 from float64.
  """
  params, _ = network.init_params(config, jax.random.PRNGKey(seed))
  params['token_embedder']['embedding'] = params['token_embedder']['embedding'] * spread
  if not config.logits_via_embedding:
    params['decoder']['logits_dense']['kernel'] = params['decoder']['logits_dense']['kernel'] * (
        spread)
  return params


def test_hf_config_from():
  untied = network.T5Config(**_EXPORT_BASE)
  cfg = hf.hf_config_from(untied)
  assert cfg['feed_forward_proj'] == 'gated-gelu' and cfg['dense_act_fn'] == 'gelu_new'
  assert (cfg['num_layers'], cfg['num_decoder_layers'], cfg['d_kv'], cfg['d_ff']) == (2, 3, 8, 32)
  assert not cfg['tie_word_embeddings'] and not cfg['scale_decoder_outputs']
  tied = network.T5Config(**{**_EXPORT_BASE, 'mlp_activations': ('relu',),
                             'logits_via_embedding': True})
  cfg = hf.hf_config_from(tied)
  assert cfg['feed_forward_proj'] == 'relu'
  assert cfg['tie_word_embeddings'] and cfg['scale_decoder_outputs']
  # transformers reads the dict back as the same model (its >= 5 T5Config always ties and
  # takes the output scaling from scale_decoder_outputs), and so does config_from_hf.
  for config in (untied, tied):
    hf_config = transformers.T5Config(**hf.hf_config_from(config))
    assert hf_config.scale_decoder_outputs == config.logits_via_embedding
    assert hf.config_from_hf(hf_config.to_dict(),
                             separate_lm_head=not config.logits_via_embedding) == config
  with pytest.raises(ValueError, match=r"mlp_activations \('gelu',\) have no Hugging Face"):
    hf.hf_config_from(network.T5Config(**{**_EXPORT_BASE, 'mlp_activations': ('gelu',)}))


def test_hf_state_dict_from_any_dtype_and_bad_params():
  config = network.T5Config(**_EXPORT_BASE)
  params = _random_params(config)
  as_bf16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
  state = hf.hf_state_dict_from(config, as_bf16)
  assert all(v.dtype == np.float32 and v.flags.c_contiguous for v in state.values())
  kernel = params['decoder']['logits_dense']['kernel']
  np.testing.assert_array_equal(state['lm_head.weight'],
                                np.asarray(kernel.astype(jnp.bfloat16), np.float32).T)
  assert state['encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight'].shape == (
      network.RELPOS_NUM_BUCKETS, 2)
  del params['decoder']['layers_2']
  with pytest.raises(ValueError, match="parameter 'decoder/layers_2/.*' is missing"):
    hf.hf_state_dict_from(config, params)


def test_to_hf_model_without_transformers(monkeypatch):
  monkeypatch.setitem(sys.modules, 'transformers', None)  # makes `import transformers` fail
  config = network.T5Config(**_EXPORT_BASE)
  with pytest.raises(ImportError, match=r"pip install 'speculative_t5x\[hf\]'"):
    hf.to_hf_model(config, {})


@pytest.mark.parametrize('variant', list(_EXPORT_VARIANTS))
def test_export_round_trip(tmp_path, variant):
  config = network.T5Config(**{**_EXPORT_BASE, **_EXPORT_VARIANTS[variant]})
  params = _random_params(config)

  model = hf.to_hf_model(config, params)
  assert not model.training
  assert all(p.dtype == torch.float32 for p in model.parameters())
  assert (model.lm_head.weight is model.shared.weight) == config.logits_via_embedding
  _compare(model, config, params)

  # numpy leaves work as well as jax ones.
  hf.save_hf_t5(tmp_path, config, jax.tree_util.tree_map(np.asarray, params))
  loaded, info = transformers.T5ForConditionalGeneration.from_pretrained(
      tmp_path, output_loading_info=True)
  assert {k: v for k, v in info.items() if v} == {}  # no missing/unexpected/mismatched weights
  assert loaded.dtype == torch.float32
  _compare(loaded.eval(), config, params)

  config_back, params_back = hf.load_hf_t5(tmp_path)
  assert config_back == config
  flat, flat_back = (traverse_util.flatten_dict(p) for p in (params, params_back))
  assert flat_back.keys() == flat.keys()
  for path, value in flat.items():
    np.testing.assert_array_equal(flat_back[path], np.asarray(value), err_msg='/'.join(path))


def test_greedy_generate_matches_transformers():
  # Equal layer counts: transformers 5.x sizes generate()'s decoder cache by num_layers (the
  # encoder's) and fails with an IndexError when the decoder has more layers.
  config = network.T5Config(**{**_EXPORT_BASE, 'vocab_size': 32, 'num_decoder_layers': 2})
  # This seed's decodes vary by row and one row stops at EOS, so the alignment is exercised.
  params = _random_params(config, seed=3)
  rng = np.random.default_rng(0)
  enc = rng.integers(2, 16, (4, 7))
  enc[1, 5:] = 0
  enc[2, 3:] = 0
  length = 8

  model = models.EncoderDecoderModel(config, config, decode_fn=decoding.temperature_sample,
                                     decode_kwargs={'temperature': 0.0}, eos_id=1)
  ours = np.asarray(jax.jit(model.predict_batch)(  # one compile: faster than eager loops
      {'target': params, 'draft': params},
      {'encoder_input_tokens': jnp.asarray(enc, jnp.int32),
       'decoder_input_tokens': jnp.zeros((len(enc), length), jnp.int32)}))

  hf_model = hf.to_hf_model(config, params)
  with torch.no_grad():
    generated = hf_model.generate(torch.tensor(enc), attention_mask=torch.tensor(enc > 0),
                                  max_new_tokens=length, do_sample=False, num_beams=1).numpy()
  # HF starts with decoder_start (0), stops all rows once each has EOS and pads with 0; ours
  # has no start token and zeros after EOS.
  assert (generated[:, 0] == 0).all()
  theirs = np.zeros_like(ours)
  theirs[:, :generated.shape[1] - 1] = generated[:, 1:]
  np.testing.assert_array_equal(ours, theirs)
  assert (ours == 1).any() and len({tuple(r) for r in ours}) > 1  # not a degenerate comparison

  # Greedy choices with clear margins: float32 differences cannot flip them.
  dec_in = np.concatenate([np.zeros((len(ours), 1), ours.dtype), ours[:, :-1]], axis=1)
  # The targets only mask the decoder: all >= 1 keeps every position.
  logits = np.asarray(apply(network.Transformer(config), {'params': params},
                            jnp.asarray(enc, jnp.int32), jnp.asarray(dec_in),
                            jnp.asarray(np.maximum(ours, 1))))
  top2 = np.sort(logits, axis=-1)[..., -2:]
  before_eos = np.cumsum(ours == 1, axis=1) - (ours == 1) == 0
  assert (top2[..., 1] - top2[..., 0])[before_eos].min() > 1e-3
