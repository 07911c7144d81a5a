"""A decoder-only draft that reads the target's encoder output (`T5Config.encoded_width`)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from speculative_t5x import beam_search
from speculative_t5x import checkpoints
from speculative_t5x import decoding
from speculative_t5x import hf
from speculative_t5x import models
from speculative_t5x import network
from speculative_t5x import trees
from conftest import ragged_tokens, random_model, tiny_config

MAX_LEN = 10
TARGET_CFG = tiny_config()
TARGET = random_model(TARGET_CFG, seed=0, logit_scale=4.0)
# The target's own decoder as a decoder-only model: over the target's encoder output its
# distributions are the target's, so a draft built from it must have every token accepted.
MIRROR_CFG = dataclasses.replace(TARGET_CFG, num_encoder_layers=0,
                                 encoded_width=TARGET_CFG.emb_dim)
MIRROR = {k: v for k, v in TARGET[1].items() if k != 'encoder'}
# A narrower decoder-only draft: partial agreement at best.
SMALL_CFG = tiny_config(emb_dim=8, num_heads=1, num_decoder_layers=1, num_encoder_layers=0,
                        encoded_width=TARGET_CFG.emb_dim)
SMALL = random_model(SMALL_CFG, seed=3, logit_scale=4.0)[1]


def _batch(rows: int, seed: int = 1):
  enc = ragged_tokens(jax.random.PRNGKey(seed), rows, 9, TARGET_CFG.vocab_size)
  return {'encoder_input_tokens': enc,
          'decoder_input_tokens': jnp.zeros((rows, MAX_LEN), jnp.int32)}


def _predict(draft_cfg, draft_params, decode_fn, rng=None, **kwargs):
  model = models.EncoderDecoderModel(TARGET_CFG, draft_cfg, decode_fn=decode_fn,
                                     decode_kwargs=kwargs, eos_id=63)
  params = {'target': TARGET[1], 'draft': draft_params}
  return jax.jit(model.predict_batch_with_aux)(params, _batch(4), rng)


def test_a_decoder_only_config_has_no_encoder_and_reads_the_target_width():
  params, _ = network.init_params(SMALL_CFG)
  assert 'encoder' not in params
  layer = params['decoder']['layers_0']['encoder_decoder_attention']
  assert layer['key']['kernel'].shape == (TARGET_CFG.emb_dim, 1 * 8)
  assert layer['query']['kernel'].shape == (SMALL_CFG.emb_dim, 1 * 8)
  network.validate_params(params, SMALL_CFG)
  with pytest.raises(ValueError, match='set num_encoder_layers to 0, not 1'):
    tiny_config(encoded_width=16)
  with pytest.raises(ValueError, match='has no encoder: pass the encoder output'):
    network.Transformer(SMALL_CFG).apply({'params': params}, jnp.ones((1, 3), jnp.int32),
                                         method=network.Transformer.encode)
  with pytest.raises(ValueError, match='no Hugging Face T5 form'):
    hf.hf_config_from(SMALL_CFG)


def test_the_target_decoder_as_draft_is_always_accepted():
  """Only a draft that reads the target's encoder output can agree with it everywhere."""
  greedy, aux = _predict(MIRROR_CFG, MIRROR, decoding.speculative_sample, gamma=3,
                         temperature=0.0)
  target, _ = _predict(MIRROR_CFG, MIRROR, decoding.temperature_sample, temperature=0.0)
  np.testing.assert_array_equal(np.asarray(greedy), np.asarray(target))
  np.testing.assert_array_equal(np.asarray(aux['stats']['rollbacks']), 0)
  _, aux = _predict(MIRROR_CFG, MIRROR, decoding.speculative_sample, jax.random.PRNGKey(0),
                    gamma=3, temperature=1.0)
  np.testing.assert_array_equal(np.asarray(aux['stats']['rollbacks']), 0)
  assert (np.asarray(aux['stats']['accepted']) > 0).all()


@pytest.mark.parametrize('decoder', ['speculative', 'block', 'tree', 'beam', 'bild'])
def test_every_draft_decoder_is_exact_with_a_decoder_only_draft(decoder):
  if decoder == 'beam':
    ours, _ = _predict(SMALL_CFG, SMALL, beam_search.speculative_beam_search, num_decodes=3,
                       branching=(4, 2))
    theirs, _ = _predict(SMALL_CFG, SMALL, beam_search.beam_search, num_decodes=3)
  else:
    fn, kwargs = {
        'speculative': (decoding.speculative_sample, {'gamma': 3}),
        'block': (decoding.speculative_sample, {'gamma': 3, 'verification': 'block'}),
        'tree': (trees.tree_speculative_sample, {'branching': (2, 1)}),
        # Rollback at any cross-entropy above 0: every draft token is replaced by the
        # target's argmax unless it is that argmax, which is greedy decoding of the target.
        'bild': (decoding.bild_decode, {'rollback_threshold': 0.0}),
    }[decoder]
    ours, aux = _predict(SMALL_CFG, SMALL, fn, temperature=0.0, **kwargs)
    theirs, _ = _predict(SMALL_CFG, SMALL, decoding.temperature_sample, temperature=0.0)
    assert (np.asarray(aux['stats']['target_calls']) > 0).all()
  np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


def test_a_draft_of_the_wrong_width_is_one_line():
  wrong = dataclasses.replace(SMALL_CFG, encoded_width=24)
  with pytest.raises(ValueError, match='width 24, but the encoder it reads has emb_dim 16'):
    models.EncoderDecoderModel(TARGET_CFG, wrong)
  with pytest.raises(ValueError, match='target is decoder-only'):
    models.EncoderDecoderModel(SMALL_CFG)


def test_decoding_alone_over_a_given_encoder(tmp_path):
  """The draft alone (its BLEU, the training job's evaluation) reads `encoder_config`'s model;
  its weights file keeps the config."""
  path = tmp_path / 'draft.msgpack'
  checkpoints.export_weights(MIRROR, MIRROR_CFG, path)
  config, params = checkpoints.load_model(path)
  assert config == MIRROR_CFG
  alone = models.EncoderDecoderModel(config, decode_fn=decoding.temperature_sample,
                                     decode_kwargs={'temperature': 0.0},
                                     encoder_config=TARGET_CFG, eos_id=63)
  rounded = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), TARGET[1])
  ours = alone.predict_batch({'target': params, 'encoder': rounded}, _batch(3))
  theirs = models.EncoderDecoderModel(
      TARGET_CFG, decode_fn=decoding.temperature_sample, decode_kwargs={'temperature': 0.0},
      eos_id=63).predict_batch({'target': rounded}, _batch(3))
  np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


def test_a_pair_loads_and_decodes_with_a_decoder_only_draft(tmp_path):
  """pipeline.load_pair reads a decoder-only draft's weights file; the Pipeline decodes with it
  (here the target's own decoder: every proposal is kept, the output is the target's)."""
  from speculative_t5x import data, pipeline  # pylint: disable=g-import-not-at-top
  config = tiny_config(vocab_size=data.padded_vocab_size(), logits_via_embedding=True)
  target, _ = network.init_params(config, jax.random.PRNGKey(7))
  reader_config = dataclasses.replace(config, num_encoder_layers=0, encoded_width=config.emb_dim)
  checkpoints.export_weights(target, config, tmp_path / 'target.msgpack')
  checkpoints.export_weights({k: v for k, v in target.items() if k != 'encoder'}, reader_config,
                             tmp_path / 'draft.msgpack')
  pair = pipeline.load_pair(tmp_path / 'target.msgpack', tmp_path / 'draft.msgpack')
  assert pair.draft_config == reader_config
  pipe = pipeline.Pipeline(pair, batch_size=2, max_output_length=8)
  texts = ['Ein Hund rennt.', 'Zwei Kinder spielen im Park.']
  ours = pipe.decode(texts, gamma=2)
  np.testing.assert_array_equal(ours.tokens, pipe.decode(texts, 'target').tokens)
  np.testing.assert_array_equal(ours.stats['rollbacks'], 0)
