"""A feature draft (EAGLE-style, `T5Config.feature_width`): it reads the target's top hidden
states (or, EAGLE-3's, lower layers' too), which the target's cache keeps
(`DecoderCache.features`) and every loop carries."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from speculative_t5x import beam_search
from speculative_t5x import decoding
from speculative_t5x import models
from speculative_t5x import network
from speculative_t5x import trees
from conftest import apply, ragged_tokens, random_model, tiny_config
from test_decoding import NUM_SAMPLES, SMALL, SMALL_EOS, SMALL_LEN, _chi_square_p_value
from test_guarantees import ENC, SAME, TARGET as SMALL_TARGET, _target_distribution

MAX_LEN = 10
TARGET_CFG = tiny_config()
TARGET = random_model(TARGET_CFG, seed=4, logit_scale=4.0)  # (its greedy outputs vary)
FEATURE_CFG = dataclasses.replace(TARGET_CFG, num_encoder_layers=0,
                                  encoded_width=TARGET_CFG.emb_dim,
                                  feature_width=TARGET_CFG.emb_dim)
TWO_STATES_CFG = dataclasses.replace(FEATURE_CFG, feature_width=2 * TARGET_CFG.emb_dim)


def _feature_mirror(noise: float, config: network.T5Config = FEATURE_CFG):
  """The target's decoder as a feature draft whose input adds noise x a random projection of the
  feature to the embedding: at noise 0 it is the target (every token accepted); at 0.5 it
  agrees on about half (greedy, gamma 1), and what it proposes depends on the features."""
  params = {k: v for k, v in TARGET[1].items() if k != 'encoder'}
  init, _ = network.init_params(config, jax.random.PRNGKey(3))
  emb = TARGET_CFG.emb_dim
  mix = jax.random.normal(jax.random.PRNGKey(5), (emb, emb)) / emb ** 0.5
  params['decoder'] = dict(
      params['decoder'], feature_projection=init['decoder']['feature_projection'],
      input_projection={'kernel': jnp.concatenate([jnp.eye(emb), noise * mix])})
  return params


FEATURE = _feature_mirror(0.5)


def _model(decode_fn, target=(TARGET_CFG, TARGET[1]), draft=(FEATURE_CFG, FEATURE), **kwargs):
  model = models.EncoderDecoderModel(target[0], draft[0], decode_fn=decode_fn,
                                     decode_kwargs=kwargs, eos_id=63)
  return model, {'target': target[1], 'draft': draft[1]}


def _predict(decode_fn, rows=4, rng=None, **kwargs):
  model, params = _model(decode_fn, **kwargs)
  enc = ragged_tokens(jax.random.PRNGKey(1), rows, 9, TARGET_CFG.vocab_size)
  batch = {'encoder_input_tokens': enc,
           'decoder_input_tokens': jnp.zeros((rows, MAX_LEN), jnp.int32)}
  decodes, aux = jax.jit(model.predict_batch_with_aux)(params, batch, rng)
  return enc, np.asarray(decodes), jax.tree_util.tree_map(np.asarray, aux['stats'])


def _shifted(features):
  """Row p of the result is row p - 1 of features [batch, length, width] (zero at p = 0)."""
  return jnp.pad(features, ((0, 0), (1, 0), (0, 0)))[:, :-1]


@functools.partial(jax.jit, static_argnames='count')
def _with_features(params, enc, dec_in, count=1):
  return TARGET[0].apply({'params': params}, enc, dec_in, jnp.ones_like(dec_in),
                         return_features=count)


def _teacher_forced(enc, dec_in):
  """The target's logits and top hidden states, and the draft's logits on the target's features,
  all teacher-forced on decoder inputs dec_in [batch, length]."""
  target_logits, top = _with_features(TARGET[1], enc, dec_in)
  encoded = apply(TARGET[0], {'params': TARGET[1]}, enc, method=network.Transformer.encode)
  draft_logits = apply(network.Transformer(FEATURE_CFG), {'params': FEATURE}, enc, dec_in,
                       jnp.ones_like(dec_in), encoded=encoded, features=_shifted(top))
  return target_logits, top, draft_logits


def test_a_feature_draft_config_reads_the_target_width():
  params, _ = network.init_params(FEATURE_CFG)
  decoder = params['decoder']
  assert decoder['feature_projection']['kernel'].shape == (16, 16)
  assert decoder['input_projection']['kernel'].shape == (32, 16)  # [embedding; feature] -> emb
  network.validate_params(params, FEATURE_CFG)
  with pytest.raises(ValueError, match='set encoded_width'):
    tiny_config(num_encoder_layers=0, feature_width=16)
  with pytest.raises(ValueError, match='feature_width 24 is no multiple of encoded_width 16'):
    dataclasses.replace(FEATURE_CFG, feature_width=24)
  three = dataclasses.replace(FEATURE_CFG, feature_width=48)
  with pytest.raises(ValueError, match='reads 3 hidden states of its target .* has 2 decoder'):
    models.EncoderDecoderModel(TARGET_CFG, three)


def test_the_cached_steps_are_the_teacher_forced_pass():
  """The target's cache keeps its top hidden states; the draft's chunk call over them (each
  token the feature of its position - 1), and its one-token calls on its own hidden states,
  give the teacher-forced logits."""
  enc = ragged_tokens(jax.random.PRNGKey(2), 3, 7, TARGET_CFG.vocab_size)
  dec_in = ragged_tokens(jax.random.PRNGKey(4), 3, 6, TARGET_CFG.vocab_size, min_length=6)
  _, top, draft_logits = _teacher_forced(enc, dec_in)
  target_vars = {'params': TARGET[1]}
  encoded = apply(TARGET[0], target_vars, enc, method=network.Transformer.encode)
  cache = apply(TARGET[0], target_vars, encoded, enc, 8, 1,
                method=network.Transformer.init_cache)
  _, cache = apply(TARGET[0], target_vars, dec_in, cache, method=network.Transformer.decode_step)
  np.testing.assert_allclose(cache.features[:, :6], top, atol=1e-5)
  draft = network.Transformer(FEATURE_CFG)
  draft_vars = {'params': FEATURE}
  empty = apply(draft, draft_vars, encoded, enc, 8, method=network.Transformer.init_cache)
  assert empty.features is None and empty.hidden.shape == (3, 16)
  logits, _ = apply(draft, draft_vars, dec_in, empty, features=cache.features,
                    method=network.Transformer.decode_step)
  np.testing.assert_allclose(logits, draft_logits, atol=1e-4)
  # Token by token on its own features: the first reads the target's (zero at position 0).
  own_cache, steps, hidden = empty, [], []
  for p in range(6):
    step, own_cache = apply(draft, draft_vars, dec_in[:, p:p + 1], own_cache,
                            features=cache.features if p == 0 else None,
                            method=network.Transformer.decode_step)
    steps.append(step[:, 0])
    hidden.append(own_cache.hidden)
  own = _shifted(jnp.stack(hidden, axis=1))
  expected = apply(draft, draft_vars, enc, dec_in, jnp.ones_like(dec_in), encoded=encoded,
                   own_features=own)
  np.testing.assert_allclose(jnp.stack(steps, axis=1), expected, atol=1e-4)


@pytest.mark.parametrize('decoder', ['gamma_1', 'gamma_4', 'adaptive', 'block', 'bild'])
def test_greedy_decoding_with_a_feature_draft_is_the_target_s(decoder):
  fn, kwargs = {
      'gamma_1': (decoding.speculative_sample, {'gamma': 1}),
      'gamma_4': (decoding.speculative_sample, {'gamma': 4}),
      'adaptive': (decoding.speculative_sample, {'gamma': 4, 'adaptive_gamma': True}),
      'block': (decoding.speculative_sample, {'gamma': 3, 'verification': 'block'}),
      # Rollback at any cross-entropy above 0: greedy decoding of the target (BiLD's loop).
      'bild': (decoding.bild_decode, {'rollback_threshold': 0.0}),
  }[decoder]
  _, ours, stats = _predict(fn, temperature=0.0, **kwargs)
  _, theirs, _ = _predict(decoding.temperature_sample, temperature=0.0)
  np.testing.assert_array_equal(ours, theirs)
  assert stats['accepted'].sum() > 0 and stats['rollbacks'].sum() > 0


def test_a_draft_reading_two_layers_gets_the_lower_one_beside_the_top_and_stays_exact():
  """EAGLE-3's reading: the target's cache keeps its first layer's output (after the final
  norm) beside the top hidden state, as its teacher-forced pass gives them, and a draft reading
  both decodes the target's greedy output."""
  assert network.feature_layer_counts(6, 3) == (2, 4, 6)
  assert network.feature_layer_counts(2, 2) == (1, 2) and TWO_STATES_CFG.feature_layers == 2
  enc = ragged_tokens(jax.random.PRNGKey(2), 3, 7, TARGET_CFG.vocab_size)
  dec_in = ragged_tokens(jax.random.PRNGKey(4), 3, 6, TARGET_CFG.vocab_size, min_length=6)
  target_vars = {'params': TARGET[1]}
  _, both = _with_features(TARGET[1], enc, dec_in, count=2)
  _, top = _with_features(TARGET[1], enc, dec_in)
  np.testing.assert_allclose(both[..., 16:], top, atol=1e-6)
  assert np.abs(both[..., :16] - top).max() > 0.1  # (the lower layer's own state)
  encoded = apply(TARGET[0], target_vars, enc, method=network.Transformer.encode)
  cache = apply(TARGET[0], target_vars, encoded, enc, 8, 2, method=network.Transformer.init_cache)
  _, cache = apply(TARGET[0], target_vars, dec_in, cache, method=network.Transformer.decode_step)
  np.testing.assert_allclose(cache.features[:, :6], both, atol=1e-5)
  draft = (TWO_STATES_CFG, _feature_mirror(0.5, TWO_STATES_CFG))
  _, ours, stats = _predict(decoding.speculative_sample, draft=draft, temperature=0.0, gamma=4)
  _, theirs, _ = _predict(decoding.temperature_sample, temperature=0.0)
  np.testing.assert_array_equal(ours, theirs)
  assert stats['accepted'].sum() > 0 and stats['rollbacks'].sum() > 0


def test_the_target_s_decoder_as_a_feature_draft_has_every_token_accepted():
  model, params = _model(decoding.speculative_sample, draft=(FEATURE_CFG, _feature_mirror(0.0)),
                         temperature=0.0, gamma=4)
  enc = ragged_tokens(jax.random.PRNGKey(1), 4, 9, TARGET_CFG.vocab_size)
  _, aux = jax.jit(model.predict_batch_with_aux)(
      params, {'encoder_input_tokens': enc,
               'decoder_input_tokens': jnp.zeros((4, MAX_LEN), jnp.int32)})
  stats = jax.tree_util.tree_map(np.asarray, aux['stats'])
  assert stats['proposed'].sum() > 0
  np.testing.assert_array_equal(stats['accepted'], stats['proposed'])


def _simulated_gamma_1(enc, decodes):
  """Per row, (proposed, accepted) of greedy gamma 1 from teacher-forced passes: at each
  committed length l the draft proposes its prediction at l, accepted when it is the target's
  token there (then the bonus token follows)."""
  dec_in = jnp.pad(jnp.asarray(decodes), ((0, 0), (1, 0)))[:, :-1]
  _, _, draft_logits = _teacher_forced(enc, dec_in)
  agree = np.asarray(jnp.argmax(draft_logits, -1)) == decodes
  counts = []
  for row, length in zip(agree, np.count_nonzero(decodes, axis=1)):
    at, proposed, accepted = 0, 0, 0
    while at < length:
      proposed, accepted = proposed + 1, accepted + row[at]
      at += 2 if row[at] else 1
    counts.append((proposed, accepted))
  return np.array(counts)


def test_the_draft_reads_the_feature_of_the_previous_position(monkeypatch):
  """At gamma 1 every proposal is the draft's teacher-forced prediction on the target's
  features, so each row's counts follow from teacher-forced passes; a harness that hands the
  draft the features one position off does not match them."""
  enc, decodes, stats = _predict(decoding.speculative_sample, rows=8, temperature=0.0, gamma=1)
  expected = _simulated_gamma_1(enc, decodes)
  np.testing.assert_array_equal(np.stack([stats['proposed'], stats['accepted']], 1), expected)
  reader = decoding.target_features
  monkeypatch.setattr(decoding, 'target_features',
                      lambda cache: _shifted(reader(cache)))  # (each token reads p - 2)
  enc, off, stats = _predict(decoding.speculative_sample, rows=8, temperature=0.0, gamma=1)
  np.testing.assert_array_equal(off, decodes)  # (still exact: the target decides)
  counts = np.stack([stats['proposed'], stats['accepted']], 1)
  assert (counts != _simulated_gamma_1(enc, off)).any()


def test_trees_and_beams_say_a_feature_draft_drafts_no_trees():
  for fn, kwargs in ((trees.tree_speculative_sample, {'branching': (2, 1)}),
                     (beam_search.speculative_beam_search, {'branching': (2,), 'num_decodes': 2})):
    with pytest.raises(ValueError, match='does not draft token trees'):
      _predict(fn, temperature=0.0, **kwargs) if fn is trees.tree_speculative_sample else (
          _predict(fn, **kwargs))


SMALL_FEATURE_CFG = dataclasses.replace(SMALL, num_encoder_layers=0, encoded_width=SMALL.emb_dim,
                                        feature_width=SMALL.emb_dim)


@pytest.mark.parametrize('verification', ['token', 'block'])
def test_speculative_sampling_with_a_feature_draft_is_exact(verification):
  """Chi-square against the enumerated target (test_decoding's pair and 20,000 samples)."""
  draft = random_model(SMALL_FEATURE_CFG, seed=5, logit_scale=2.0)[1]
  model = models.EncoderDecoderModel(
      SMALL, SMALL_FEATURE_CFG, decode_kwargs={'gamma': 2, 'temperature': 1.0,
                                               'verification': verification}, eos_id=SMALL_EOS)
  batch = {'encoder_input_tokens': jnp.repeat(ENC, NUM_SAMPLES, axis=0),
           'decoder_input_tokens': jnp.zeros((NUM_SAMPLES, SMALL_LEN), jnp.int32)}
  decodes, aux = jax.jit(model.predict_batch_with_aux)(
      {'target': SMALL_TARGET[1], 'draft': draft}, batch, jax.random.PRNGKey(0))
  stats = jax.tree_util.tree_map(lambda x: int(np.asarray(x).sum()), aux['stats'])
  p_value = _chi_square_p_value(np.asarray(decodes), {1.0: _target_distribution(1.0)})
  print(f'feature draft, {verification}: p={p_value:.3g}, accepted {stats["accepted"]} of '
        f'{stats["proposed"]}')
  assert p_value > SAME
  assert 0 < stats['accepted'] < stats['proposed']
