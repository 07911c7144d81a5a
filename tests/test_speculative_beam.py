"""Speculative beam search: beam_search's beams and scores from fewer target calls; tree attention."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from speculative_t5x import beam_search as bs
from speculative_t5x import decoding
from speculative_t5x import models
from speculative_t5x import network
from conftest import ragged_tokens, tiny_config
from fast_params import random_params

EOS = 1
MAX_LEN = 10
CFG = tiny_config()
MODULE = network.Transformer(CFG)


def _sharpened(seed, scale=4.0):
  params = random_params(CFG, seed)
  params['decoder']['logits_dense']['kernel'] = params['decoder']['logits_dense']['kernel'] * scale
  return jax.tree_util.tree_map(jnp.asarray, params)


TARGET = _sharpened(0)
DRAFTS = {
    'same': TARGET,  # every beam the draft proposes is the target's
    'noisy': jax.tree_util.tree_map(  # partial agreement: rounds of every length
        lambda x: x + 0.03 * jax.random.normal(jax.random.PRNGKey(9), x.shape), TARGET),
    'unrelated': _sharpened(1),  # the target leaves the tree almost at once
}
# Added to the EOS logit of both models: early EOS, the models' own, never.
EOS_BIAS = {'early': 6.0, 'natural': 0.0, 'never': -1e4}
BATCH = 4  # per-example rounds: the examples of a batch end at different steps


def _biased(params, enc, eos_bias):
  """(cache, tokens_to_logits) of the tiny model with eos_bias added to the EOS logit: a scalar,
  or one per example ([batch], the rows of a call being the examples' beams in order)."""
  encoded = MODULE.apply({'params': params}, enc, method=network.Transformer.encode)
  # Room past MAX_LEN: rows with prefilled prompts decode beyond it (beam_search drops cache
  # writes past the cache's end, where the tree's spare slots would not).
  cache = MODULE.apply({'params': params}, encoded, enc, MAX_LEN + 4,
                       method=network.Transformer.init_cache)
  fn = models.make_tokens_to_logits(MODULE, params)

  def tokens_to_logits(state):
    logits, new_cache = fn(state)
    bias = jnp.asarray(eos_bias, jnp.float32)
    if bias.ndim:
      bias = jnp.repeat(bias, logits.shape[0] // bias.shape[0])
      bias = bias.reshape(bias.shape + (1,) * (logits.ndim - 2))
    return logits.at[..., EOS].add(bias), new_cache

  return cache, tokens_to_logits


@functools.partial(jax.jit, static_argnames=('beam', 'branching'))
def _both(target, draft, enc, inputs, alpha, eos_bias, beam, branching, initial_index=None,
          **limits):
  """(beam_search decodes, scores), (speculative decodes, scores, stats): one compile per shape.

  With initial_index, both caches are first prefilled with inputs[:, :initial_index]. limits:
  min_log_prob and max_decode_step for both searches.
  """
  cache, t2l = _biased(target, enc, eos_bias)
  draft_cache, d2l = _biased(draft, enc, eos_bias)
  if initial_index is not None:
    prefill = lambda fn, c: fn(decoding.DecodingState(
        cur_index=jnp.zeros_like(initial_index), sequences=None, cur_token=inputs,
        cache=c))[1].with_index(initial_index)
    cache, draft_cache = prefill(t2l, cache), prefill(d2l, draft_cache)
  base = bs.beam_search(inputs, cache, t2l, EOS, num_decodes=beam, alpha=alpha,
                        initial_index=initial_index, **limits)
  spec = bs.speculative_beam_search(inputs, cache, t2l, draft_cache, d2l, EOS, num_decodes=beam,
                                    alpha=alpha, branching=branching, return_stats=True,
                                    initial_index=initial_index, **limits)
  return base, spec


def _check(base, spec):
  np.testing.assert_array_equal(np.asarray(spec[0]), np.asarray(base[0]))
  np.testing.assert_allclose(np.asarray(spec[1]), np.asarray(base[1]), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize('beam,branching', [(1, (2, 1)), (2, (2, 2)), (4, (4, 2))])
def test_equals_beam_search(beam, branching):
  batch = 2
  enc = ragged_tokens(jax.random.PRNGKey(beam), batch, 7, CFG.vocab_size)
  inputs = jnp.zeros((batch, MAX_LEN), jnp.int32)
  calls, stats = {}, {}
  eos_at = set()  # where the best beam's EOS is (MAX_LEN: none)
  for draft in DRAFTS:
    for eos in EOS_BIAS:
      for alpha in (0.0, 0.6):
        base, spec = _both(TARGET, DRAFTS[draft], enc, inputs, alpha, EOS_BIAS[eos], beam,
                           branching)
        _check(base, spec)
        stats[draft, eos, alpha] = s = jax.tree_util.tree_map(lambda x: np.asarray(x)[0, 0],
                                                              spec[2])
        calls[draft, eos, alpha] = int(s.target_calls)
        # A round replays at most one step per tree level plus one (none if the example waits).
        assert 1 <= s.target_calls and s.emitted <= (len(branching) + 1) * s.target_calls
        best = np.asarray(base[0])[:, -1]
        eos_at.update(np.where((best == EOS).any(1), (best == EOS).argmax(1), MAX_LEN).tolist())
  # The EOS biases do produce early EOS and none.
  assert min(eos_at) <= 2 and max(eos_at) == MAX_LEN
  # A draft equal to the target saves target calls; no EOS: all MAX_LEN steps are taken.
  assert calls['same', 'never', 0.6] < MAX_LEN
  assert calls['same', 'never', 0.6] <= calls['unrelated', 'never', 0.6]
  # The noisy draft exercises rounds that end inside the tree as well as deeper ones.
  noisy = [s for key, s in stats.items() if key[0] == 'noisy']
  assert any(s.accepted > 0 for s in noisy) and any(s.rollbacks > 0 for s in noisy)


def test_prompt_and_forced_tokens():
  """Teacher-forced prompts (non-zero inputs) are replayed exactly (the draft forces them too)."""
  enc = ragged_tokens(jax.random.PRNGKey(5), 2, 7, CFG.vocab_size)
  inputs = jnp.zeros((2, MAX_LEN), jnp.int32).at[0, 1:4].set(jnp.array([7, 9, 11]))
  base, spec = _both(TARGET, DRAFTS['noisy'], enc, inputs, 0.6, 0.0, 2, (2, 2))
  _check(base, spec)
  np.testing.assert_array_equal(np.asarray(spec[0])[0, :, :3], [[7, 9, 11]] * 2)


def test_prefilled_prompts():
  """initial_index: prompts of different lengths already in both caches (rows with longer ones
  decode past the output length); examples ending at different steps."""
  enc = ragged_tokens(jax.random.PRNGKey(6), BATCH, 7, CFG.vocab_size)
  inputs = jnp.zeros((BATCH, MAX_LEN), jnp.int32).at[0, 1:4].set(jnp.array([7, 9, 11]))
  inputs = inputs.at[1, 1].set(5).at[2, 1:3].set(jnp.array([4, 8])).at[3, 1].set(3)
  for eos_bias in ((0.0,) * BATCH, (0.0, 6.0, -1e4, 3.0)):
    base, spec = _both(TARGET, DRAFTS['noisy'], enc, inputs, 0.6, jnp.array(eos_bias), 2, (2, 2),
                       initial_index=jnp.array([3, 1, 2, 1], jnp.int32))
    _check(base, spec)
    assert int(spec[2].target_calls[0, 0]) < int(spec[2].emitted[0, 0])


def _per_example(target, draft, enc, inputs, alpha, eos_bias, min_log_prob=bs.NEG_INF,
                 max_decode_step=-1):
  """`_both` at batch BATCH, beam 4, branching (2, 2), eos_bias [BATCH] and traced limits: one
  compilation for every call."""
  return _both(target, draft, enc, inputs, alpha, jnp.asarray(eos_bias, jnp.float32), 4, (2, 2),
               min_log_prob=jnp.float32(min_log_prob), max_decode_step=jnp.int32(max_decode_step))


def test_per_example_rounds_equal_beam_search():
  """Examples that end at different steps (encoder inputs and forced prompts of different
  lengths, EOS at different depths), each stepping on its own: beam_search's beams and scores,
  with every stop rule (full length, max_decode_step, min_log_prob)."""
  enc = ragged_tokens(jax.random.PRNGKey(3), BATCH, 7, CFG.vocab_size)
  free = jnp.zeros((BATCH, MAX_LEN), jnp.int32)
  prompted = free.at[1, 1:3].set(jnp.array([7, 9])).at[3, 1:5].set(jnp.array([5, 6, 7, 8]))
  eos_at, emitted = set(), set()
  for draft, eos_bias, inputs, alpha, limits in itertools.product(
      ('same', 'noisy'), ((0.0, 1.0, 2.0, 3.0), (-1e4, 0.0, 3.0, 6.0)), (free, prompted),
      (0.0, 0.6), ({}, {'min_log_prob': -3.0}, {'max_decode_step': 6})):
    base, spec = _per_example(TARGET, DRAFTS[draft], enc, inputs, alpha, eos_bias, **limits)
    _check(base, spec)
    best = np.asarray(base[0])[:, -1]
    eos_at.add(tuple(np.where((best == EOS).any(1), (best == EOS).argmax(1), MAX_LEN)))
    emitted.add(tuple(np.asarray(spec[2].emitted[:, 0])))
  # The best beams end at different depths within a batch; some examples stop stepping early
  # (their results final) while the others step on.
  assert any(len(set(depths)) == BATCH for depths in eos_at)
  assert any(min(steps) < max(steps) == MAX_LEN for steps in emitted)
  # Two examples end early and stop stepping while the other two fall below min_log_prob:
  # beam_search stops only when all four do, so the early ones have to step on again.
  target = _sharpened(0, 2.0)
  enc = ragged_tokens(jax.random.PRNGKey(1), BATCH, 7, CFG.vocab_size)
  _check(*_per_example(target, target, enc, free, 0.6, (-1e4, -1e4, 5.0, 6.0), min_log_prob=-8.0))


def test_rounds_are_per_example():
  """Draft equal to the target: each example replays as many steps per round as its own trees
  hold. In lockstep (a round ends when any example's beams leave its trees) this batch takes one
  beam step per target call."""
  target = _sharpened(0, 2.0)  # flatter: beams often leave a (2, 2) tree
  enc = ragged_tokens(jax.random.PRNGKey(3), BATCH, 7, CFG.vocab_size)
  inputs = jnp.zeros((BATCH, MAX_LEN), jnp.int32)
  base, spec = _per_example(target, target, enc, inputs, 0.6, (0.0, 1.0, 2.0, 3.0))
  _check(base, spec)
  stats = jax.tree_util.tree_map(lambda x: np.asarray(x)[:, 0], spec[2])
  steps_per_call = stats.emitted / stats.target_calls
  assert np.all(steps_per_call > 1.3), steps_per_call
  # An example whose result was final early stopped taking part; the others went on.
  assert stats.emitted.min() < MAX_LEN and stats.target_calls.min() < stats.target_calls.max()


def test_model_decode_fn():
  """As `decode_fn` of EncoderDecoderModel: draft used, stats returned, beam_search's output."""
  enc = ragged_tokens(jax.random.PRNGKey(3), 2, 7, CFG.vocab_size)
  batch = {'encoder_input_tokens': enc,
           'decoder_input_tokens': jnp.zeros((2, MAX_LEN), jnp.int32),
           'decoder_target_tokens': jnp.zeros((2, MAX_LEN), jnp.int32)}
  params = {'target': TARGET, 'draft': DRAFTS['noisy']}
  spec = models.EncoderDecoderModel(
      CFG, CFG, decode_fn=functools.partial(bs.speculative_beam_search, branching=(2, 2)),
      eos_id=EOS)
  base = models.EncoderDecoderModel(CFG, None, decode_fn=bs.beam_search, eos_id=EOS)
  assert spec.uses_draft and not base.uses_draft
  kwargs = dict(num_decodes=2, return_all_decodes=True)
  spec_decodes, spec_aux = jax.jit(functools.partial(spec.predict_batch_with_aux, **kwargs))(
      params, batch)
  base_decodes, base_aux = jax.jit(functools.partial(base.predict_batch_with_aux, **kwargs))(
      params, batch)
  _check((base_decodes, base_aux['scores']), (spec_decodes, spec_aux['scores']))
  assert spec_aux['stats']['target_calls'].shape == (2, 2)


def test_tree_attention_equals_paths():
  """Every node of a tree scored in one call gets the logits of feeding its path alone, and a
  kept path leaves the cache as feeding that path would."""
  tree = bs.token_tree((2, 3))
  batch, prefix = 2, 3
  enc = ragged_tokens(jax.random.PRNGKey(0), batch, 7, CFG.vocab_size)
  rng = np.random.default_rng(0)
  prefix_tokens = jnp.asarray(rng.integers(2, CFG.vocab_size, (batch, prefix)), jnp.int32)
  tokens = jnp.asarray(rng.integers(2, CFG.vocab_size, (batch, tree.nodes)), jnp.int32)
  # Rows at different positions: row 1 has one prefix token fewer.
  index = jnp.array([prefix, prefix - 1], jnp.int32)
  node_on_path = 7  # depth 2
  path = tree.paths[node_on_path]

  @jax.jit
  def run(params):
    cache, t2l = _biased(params, enc, 0.0)
    _, cache = t2l(decoding.DecodingState(cur_index=jnp.zeros((batch,), jnp.int32),
                                          sequences=None, cur_token=prefix_tokens, cache=cache))
    tree_logits, tree_cache = bs._call_tree(t2l, tokens, index, cache, None, tree, tree.nodes)
    # Each node's path fed as a chain, one call per node.
    path_logits = []
    for n in range(tree.nodes):
      chain = tokens[:, tree.paths[n][:tree.depths[n] + 1]]
      logits, _ = t2l(decoding.DecodingState(cur_index=index, sequences=None, cur_token=chain,
                                             cache=cache))
      path_logits.append(logits[:, -1])
    kept = tree_cache.keep_tree_path(jnp.broadcast_to(path, (batch, len(path))),
                                     jnp.full((batch,), 3, jnp.int32))
    probe = jnp.full((batch, 1), 5, jnp.int32)
    after_kept, _ = t2l(decoding.DecodingState(cur_index=kept.index, sequences=None,
                                               cur_token=probe, cache=kept))
    chain = tokens[:, path]
    after_chain, _ = t2l(decoding.DecodingState(
        cur_index=index, sequences=None, cur_token=jnp.concatenate([chain, probe], axis=1),
        cache=cache))
    return tree_logits, jnp.stack(path_logits, axis=1), after_kept[:, 0], after_chain[:, -1]

  tree_logits, path_logits, after_kept, after_chain = run(TARGET)
  np.testing.assert_allclose(np.asarray(tree_logits), np.asarray(path_logits), atol=1e-5)
  np.testing.assert_allclose(np.asarray(after_kept), np.asarray(after_chain), atol=1e-5)
  # The check has teeth: siblings' logits differ.
  assert np.abs(np.asarray(tree_logits[:, 1] - tree_logits[:, 2])).max() > 1e-2


def test_token_tree():
  tree = bs.token_tree((2, 2))
  assert tree.level_starts == (0, 1, 3, 7)
  np.testing.assert_array_equal(tree.children[:3], [[1, 2], [3, 4], [5, 6]])
  np.testing.assert_array_equal(tree.paths[6], [0, 2, 6])
  np.testing.assert_array_equal(np.nonzero(tree.ancestors[4])[0], [0, 1, 4])
  with pytest.raises(ValueError):
    bs.token_tree(())
