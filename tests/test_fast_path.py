"""The decode hot path: the greedy branch equals the general one, decode-time layouts equal params."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from speculative_t5x import decoding
from speculative_t5x import models
from speculative_t5x import network
from conftest import apply, ragged_tokens, random_model, start_decoding, tiny_config

MAX_LEN = 12
CFG = tiny_config()
TARGET = random_model(CFG, seed=0, logit_scale=4.0)
NOISY = (TARGET[0], jax.tree_util.tree_map(
    lambda x: x + 0.3 * jax.random.normal(jax.random.PRNGKey(9), x.shape), TARGET[1]))
UNRELATED = random_model(CFG, seed=1, logit_scale=4.0)

# (rule, gamma, draft, confidence threshold, adaptive gamma, rescale_log_probs)
CASES = {
    'target_only': (decoding.speculative_rule(), 0, None, 0.0, False, True),
    'speculative_gamma1': (decoding.speculative_rule(), 1, NOISY, 0.0, False, True),
    'speculative_gamma3_raw_scores': (decoding.speculative_rule(), 3, NOISY, 0.0, False, False),
    'speculative_gamma7_unrelated': (decoding.speculative_rule(), 7, UNRELATED, 0.0, False, True),
    'speculative_adaptive_confidence': (decoding.speculative_rule(), 5, NOISY, 0.5, True, True),
    'lenient': (decoding.speculative_rule(0.3, greedy=True), 4, UNRELATED, 0.0, False, True),
    'bild': (decoding.bild_rule(2.0), 6, NOISY, 0.6, False, True),
}


@functools.partial(jax.jit, static_argnames=('case', 'general'))
def _decode(enc, inputs, case, general, eos_id):
  rule, gamma, draft, confidence, adaptive, rescale = CASES[case]
  if general:  # without greedy_accept the loop runs on one-hot distributions
    rule = decoding.VerifyRule(rule.accept_prob, rule.correction)
  cfg = decoding._LoopConfig(gamma=gamma, rule=rule, temperature=0.0, topk=0, topp=0.0,
                             rescale_log_probs=rescale, confidence_threshold=confidence,
                             adaptive_gamma=adaptive, eos_id=eos_id)
  assert cfg.greedy != general
  cache, t2l = start_decoding(*TARGET, enc, MAX_LEN)
  draft_cache, d2l = start_decoding(*draft, enc, MAX_LEN) if draft else (None, None)
  return decoding._decode(cfg, inputs, cache, t2l, draft_cache, d2l, jax.random.PRNGKey(3),
                          num_decodes=1, cache_offset=0, max_decode_steps=None,
                          return_stats=True)


@pytest.mark.parametrize('case', list(CASES))
def test_greedy_fast_path_equals_general_path(case):
  batch = 3
  enc = ragged_tokens(jax.random.PRNGKey(2), batch, 9, CFG.vocab_size)
  inputs = jnp.zeros((batch, MAX_LEN), jnp.int32)
  eos = _decode(enc, inputs, case, False, 63)[0][0, 0, 4]  # emitted mid-sequence by row 0
  inputs = inputs.at[batch - 1, 1:4].set(jnp.array([5, 6, 7]))  # a forced prompt in one row
  fast = _decode(enc, inputs, case, False, eos)
  general = _decode(enc, inputs, case, True, eos)
  np.testing.assert_array_equal(np.asarray(fast[0]), np.asarray(general[0]))
  np.testing.assert_allclose(np.asarray(fast[1]), np.asarray(general[1]), rtol=1e-5, atol=1e-5)
  for field in decoding.DecodeStats.__dataclass_fields__:
    np.testing.assert_array_equal(np.asarray(getattr(fast[2], field)),
                                  np.asarray(getattr(general[2], field)), err_msg=field)
  decodes = np.asarray(fast[0])[:, 0]
  assert (decodes[0, 5:] == 0).all()  # row 0 stopped at its EOS
  np.testing.assert_array_equal(decodes[-1, :3], [5, 6, 7])


def test_argmax_matches_jnp_argmax_with_ties():
  logits = jax.random.normal(jax.random.PRNGKey(0), (6, 3, 50))
  logits = logits.at[0, 0, 7].set(9.0).at[0, 0, 3].set(9.0)  # a tie: the first index wins
  logits = logits.at[1].set(0.0)  # all equal
  np.testing.assert_array_equal(np.asarray(decoding.argmax(logits)),
                                np.asarray(jnp.argmax(logits, axis=-1)))


TIED = tiny_config(logits_via_embedding=True, mlp_activations=('relu',))


@pytest.mark.parametrize('config', [CFG, TIED], ids=['untied', 'tied'])
def test_decode_variables_give_the_same_logits(config):
  module, params = random_model(config, seed=4)
  variables = network.decode_variables(config, params, fuse=True)
  assert ('logits_kernel' in variables['decoder']) == config.logits_via_embedding
  assert 'qkv_kernel' in variables['decoder']['layers_0']['self_attention']  # stacked
  enc = ragged_tokens(jax.random.PRNGKey(5), 3, 7, config.vocab_size)
  encoded = apply(module, {'params': params}, enc, method=network.Transformer.encode)
  cache = apply(module, {'params': params}, encoded, enc, MAX_LEN,
                method=network.Transformer.init_cache).with_index(jnp.array([0, 2, 5]))
  tokens = jax.random.randint(jax.random.PRNGKey(6), (3, 4), 2, config.vocab_size)
  step = jax.jit(lambda v: module.apply(v, tokens, cache, method=network.Transformer.decode_step))
  plain, plain_cache = step({'params': params})
  fast, fast_cache = step({'params': params, network.DECODE_COLLECTION: variables})
  np.testing.assert_allclose(np.asarray(fast), np.asarray(plain), rtol=1e-5, atol=1e-5)
  for a, b in zip(jax.tree_util.tree_leaves(fast_cache), jax.tree_util.tree_leaves(plain_cache)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_predict_with_hoisted_decode_variables():
  draft_cfg = tiny_config(logits_via_embedding=True, num_decoder_layers=1)
  model = models.EncoderDecoderModel(TIED, draft_cfg, decode_fn=decoding.speculative_sample,
                                     decode_kwargs={'gamma': 3, 'temperature': 0.0})
  params = {'target': random_model(TIED, seed=7)[1],
            'draft': random_model(draft_cfg, seed=8)[1]}
  batch = {'encoder_input_tokens': ragged_tokens(jax.random.PRNGKey(9), 4, 9, TIED.vocab_size),
           'decoder_input_tokens': jnp.zeros((4, MAX_LEN), jnp.int32)}
  prepared = jax.jit(model.with_decode_variables)(params)
  assert set(prepared['decode']) == {'target', 'draft'}
  predict = jax.jit(model.predict_batch_with_aux)
  decodes, aux = predict(params, batch)
  hoisted, hoisted_aux = predict(prepared, batch)
  np.testing.assert_array_equal(np.asarray(hoisted), np.asarray(decodes))
  np.testing.assert_array_equal(np.asarray(hoisted_aux['stats']['accepted']),
                                np.asarray(aux['stats']['accepted']))


def test_categorical_draws_as_jax_random_categorical():
  logits = jax.random.normal(jax.random.PRNGKey(0), (4, 3, 50)) * 3
  logits = logits.at[:, :, 10:20].set(decoding.NEG_INF).at[0, 0, 30].set(-jnp.inf)
  for seed in range(5):
    rng = jax.random.PRNGKey(seed)
    np.testing.assert_array_equal(np.asarray(decoding.categorical(rng, logits)),
                                  np.asarray(jax.random.categorical(rng, logits, axis=-1)))
