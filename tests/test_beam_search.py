"""Tests of speculative_t5x.beam_search: T5X's own beam search outputs, greedy decoding, prefill."""

import json
import os
from pathlib import Path

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from speculative_t5x import network
from speculative_t5x.beam_search import beam_search
from speculative_t5x.decoding import DecodingState

_DATA_ENV = 'SPECULATIVE_T5X_DATA'
_DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / 'shared' / 'data'
DATA_DIR = Path(os.environ.get(_DATA_ENV, _DEFAULT_DATA))
CHECKPOINT = DATA_DIR / 't5x' / 'test_t5_tiny.checkpoint_0'
REFERENCE = DATA_DIR / 't5x' / 'test_t5_tiny_reference.npz'

EOS_ID = 1
DECODE_LEN = 10


def _tokens_to_logits(module, params):
  """The project's tokens_to_logits: feeds cur_token at each row's cur_index."""

  def fn(state: DecodingState):
    cache = state.cache.with_index(state.cur_index)
    return module.apply({'params': params}, state.cur_token, cache, method=module.decode_step)

  return fn


def _empty_cache(module, params, encoder_tokens, max_length):
  encoded = module.apply({'params': params}, encoder_tokens, method=module.encode)
  return module.apply({'params': params}, encoded, encoder_tokens, max_length,
                      method=module.init_cache)


def _decode_fn(module):
  """(params, encoder_tokens, prompt, eos_id, num_decodes, alpha, ...) -> beam_search outputs."""

  def decode(params, encoder_tokens, prompt, eos_id, num_decodes, alpha, initial_index=None,
             cache=None):
    if cache is None:
      cache = _empty_cache(module, params, encoder_tokens, prompt.shape[1])
    return beam_search(inputs=prompt, cache=cache,
                       tokens_to_logits=_tokens_to_logits(module, params), eos_id=eos_id,
                       num_decodes=num_decodes, alpha=alpha, initial_index=initial_index)

  return decode


def _jit(fn):
  return jax.jit(fn, static_argnames=('num_decodes', 'alpha'))


@pytest.fixture(scope='module')
def t5x_tiny():
  if not (CHECKPOINT.exists() and REFERENCE.exists()):
    pytest.skip(f'T5X reference data not found under {DATA_DIR} (set {_DATA_ENV} to the '
                'shared data folder holding t5x/test_t5_tiny.checkpoint_0).')
  reference = np.load(REFERENCE)
  config = network.T5Config(**json.loads(str(reference['config'])))
  params = flax.serialization.msgpack_restore(CHECKPOINT.read_bytes())['optimizer']['target']
  return network.Transformer(config), params, reference


def _check_against_reference(decodes, scores, reference):
  np.testing.assert_array_equal(np.asarray(decodes), reference['beam4_decodes'])
  np.testing.assert_allclose(np.asarray(scores), reference['beam4_scores'], atol=1e-4, rtol=0)


def test_matches_t5x_beam_search(t5x_tiny):
  module, params, reference = t5x_tiny
  encoder_tokens = jnp.asarray(reference['encoder_input_tokens'])
  prompt = jnp.zeros((encoder_tokens.shape[0], DECODE_LEN), jnp.int32)
  cache = jax.jit(_empty_cache, static_argnums=(0, 3))(module, params, encoder_tokens, DECODE_LEN)
  # beam_search not jitted: its loop compiles on its own, the rest runs op by op.
  decodes, scores = _decode_fn(module)(params, encoder_tokens, prompt, EOS_ID, num_decodes=4,
                                       alpha=0.6, cache=cache)
  assert decodes.shape == (4, 4, DECODE_LEN) and scores.shape == (4, 4)
  _check_against_reference(decodes, scores, reference)


def test_jit_matches_t5x_beam_search(t5x_tiny):
  module, params, reference = t5x_tiny
  encoder_tokens = jnp.asarray(reference['encoder_input_tokens'])
  prompt = jnp.zeros((encoder_tokens.shape[0], DECODE_LEN), jnp.int32)
  decodes, scores = _jit(_decode_fn(module))(params, encoder_tokens, prompt, EOS_ID,
                                             num_decodes=4, alpha=0.6)
  _check_against_reference(decodes, scores, reference)


# A small random model: fast, and free to pick EOS ids with known behaviour.
_SMALL = network.T5Config(vocab_size=40, emb_dim=16, num_heads=2, num_encoder_layers=2,
                          num_decoder_layers=2, head_dim=8, mlp_dim=32,
                          mlp_activations=('gelu', 'linear'), dropout_rate=0.0)


@pytest.fixture(scope='module')
def small_model():
  module = network.Transformer(_SMALL)
  # Random parameters from the parameter shapes alone (compiling the initialisers is slow on
  # CPU): N(0, 1/fan_in) kernels and tables, unit norm scales.
  tokens = jnp.ones((1, 4), jnp.int32)
  shapes = jax.eval_shape(module.init, jax.random.PRNGKey(0), tokens, tokens, tokens)['params']
  rng = np.random.default_rng(3)
  params = jax.tree_util.tree_map(
      lambda s: jnp.asarray(rng.normal(size=s.shape) / np.sqrt(s.shape[0])
                            if len(s.shape) > 1 else np.ones(s.shape), jnp.float32), shapes)
  encoder_tokens = rng.integers(2, _SMALL.vocab_size, (3, 7)).astype(np.int32)
  encoder_tokens[1, 5:] = 0  # some padding
  return module, params, jnp.asarray(encoder_tokens), _jit(_decode_fn(module))


def _greedy_path(module, params, encoder_tokens, length):
  """Greedy argmax tokens [batch, length] (never stopping) and log-probs [batch, length, vocab].

  Uses full, uncached forward passes, independent of the cache and of beam_search.
  """
  forward = jax.jit(lambda p, e, d: jax.nn.log_softmax(
      module.apply({'params': p}, e, d, jnp.ones_like(d))))  # all-ones targets: no padding mask
  batch = encoder_tokens.shape[0]
  tokens = np.zeros((batch, length), np.int32)
  for t in range(length):
    decoder_inputs = np.concatenate([np.zeros((batch, 1), np.int32), tokens[:, :-1]], axis=1)
    tokens[:, t] = np.asarray(forward(params, encoder_tokens, decoder_inputs))[:, t].argmax(-1)
  decoder_inputs = np.concatenate([np.zeros((batch, 1), np.int32), tokens[:, :-1]], axis=1)
  return tokens, np.asarray(forward(params, encoder_tokens, decoder_inputs))


def _greedy_with_eos(tokens, log_probs, eos_id):
  """Greedy decodes cut after the first EOS (zeros after it) and their log-probabilities.

  Also says whether beam search of size 1 must return exactly these: true when `eos_id` is never
  the runner-up before a row's EOS (a runner-up EOS would enter the finished set and be returned
  in place of the greedy path, as in T5X).
  """
  batch, length, _ = log_probs.shape
  decodes = np.zeros_like(tokens)
  scores = np.zeros((batch,), np.float64)
  comparable = True
  for b in range(batch):
    for t in range(length):
      ranked = np.argsort(-log_probs[b, t], kind='stable')
      comparable &= ranked[1] != eos_id
      decodes[b, t] = tokens[b, t]
      scores[b] += log_probs[b, t, tokens[b, t]]
      if tokens[b, t] == eos_id:
        break
  return decodes, scores, comparable


def test_beam_size_one_is_greedy(small_model):
  module, params, encoder_tokens, decode = small_model
  batch = encoder_tokens.shape[0]
  tokens, log_probs = _greedy_path(module, params, encoder_tokens, DECODE_LEN)
  cases = {}
  for eos_id in range(1, _SMALL.vocab_size):
    expected, expected_scores, comparable = _greedy_with_eos(tokens, log_probs, eos_id)
    if comparable:
      # 'unused': no row emits EOS (live beams are returned); 'emitted': a row stops mid-way.
      kind = 'emitted' if (tokens[:, 1:-1] == eos_id).any() else 'unused'
      cases.setdefault(kind, (eos_id, expected, expected_scores))
  assert set(cases) == {'unused', 'emitted'}, 'the fixed random model gives no usable EOS id'
  prompt = jnp.zeros((batch, DECODE_LEN), jnp.int32)
  for eos_id, expected, expected_scores in cases.values():
    # alpha = 0: with a length penalty, a longer hypothesis may beat the greedy one.
    decodes, scores = decode(params, encoder_tokens, prompt, jnp.int32(eos_id), num_decodes=1,
                             alpha=0.0)
    assert decodes.shape == (batch, 1, DECODE_LEN) and scores.shape == (batch, 1)
    np.testing.assert_array_equal(np.asarray(decodes[:, 0]), expected, err_msg=f'eos {eos_id}')
    np.testing.assert_allclose(np.asarray(scores[:, 0]), expected_scores, atol=1e-4)


def test_prefilled_cache_equals_forced_prompt(small_model):
  """initial_index (prompt already in the cache) gives the same beams as forcing the prompt."""
  module, params, encoder_tokens, decode = small_model
  batch, beam, eos_id = encoder_tokens.shape[0], 3, 2
  prompt_tokens = np.array([[5, 6], [7, 8], [9, 10]], np.int32)
  # BOS slot, then the prompt: [0, p0, p1, 0, ...].
  prompt = np.zeros((batch, DECODE_LEN), np.int32)
  prompt[:, 1:3] = prompt_tokens
  prompt = jnp.asarray(prompt)
  forced_decodes, forced_scores = decode(params, encoder_tokens, prompt, eos_id,
                                         num_decodes=beam, alpha=0.6)

  # Prefill positions 0..1 (BOS, p0); beam search feeds p1 at position 2 itself.
  @jax.jit
  def prefill(params, encoder_tokens, prompt):
    cache = _empty_cache(module, params, encoder_tokens, DECODE_LEN)
    return module.apply({'params': params}, prompt[:, :2], cache, method=module.decode_step)[1]

  cache = prefill(params, encoder_tokens, prompt)
  initial_index = jnp.full((batch,), 2, jnp.int32)
  decodes, scores = decode(params, encoder_tokens, prompt, eos_id, num_decodes=beam, alpha=0.6,
                           initial_index=initial_index, cache=cache)
  np.testing.assert_allclose(np.asarray(scores), np.asarray(forced_scores), atol=1e-5)
  # Unfilled finished slots (score NEG_INF) differ by design, as in T5X: zeros when forcing,
  # the bare prompt when prefilled.
  filled = np.asarray(scores) > -1e6
  assert filled.sum() >= batch + 2  # some rows return several beams
  np.testing.assert_array_equal(np.asarray(decodes)[filled], np.asarray(forced_decodes)[filled])
  np.testing.assert_array_equal(np.asarray(decodes)[:, :, :2],
                                np.broadcast_to(prompt_tokens[:, None, :], (batch, beam, 2)))


def test_dict_cache_with_unbatched_leaves():
  """A T5X-style dict cache: 'cache_index' / 'cached_bias' stay as they are, the rest expand."""
  batch, beam, vocab, length = 2, 3, 6, 5
  table = jax.random.normal(jax.random.PRNGKey(0), (batch, length + 1, vocab))

  def tokens_to_logits(state):
    layer = state.cache['layer']
    assert layer['row'].shape == (batch * beam, 1)
    assert layer['cache_index'].shape == () and layer['cached_bias'].shape == (1, 4, 2)
    # Logits depend on the example, the position and (through the token sum) the history.
    logits = table[layer['row'][:, 0], layer['cache_index']]
    logits += 0.1 * jnp.sum(state.sequences, axis=1, keepdims=True)
    return logits, {'layer': dict(layer, cache_index=layer['cache_index'] + 1)}

  cache = {'layer': {'row': jnp.arange(batch)[:, None], 'cache_index': jnp.array(0),
                     'cached_bias': jnp.zeros((1, 4, 2))}}
  prompt = jnp.zeros((batch, length), jnp.int32)
  decodes, scores = jax.jit(
      lambda c: beam_search(prompt, c, tokens_to_logits, eos_id=1, num_decodes=beam))(cache)
  assert decodes.shape == (batch, beam, length) and scores.shape == (batch, beam)
  assert np.all(np.diff(np.asarray(scores), axis=1) >= 0)  # ascending, best last
