"""The decode_fn contract against T5X itself: prefilled prompts (initial_index), per-row temperature.

References: `t5x/test_t5_tiny_reference_prompts.npz` (see its .json), computed by a real T5X
install on T5X's tiny test checkpoint. The arrays without a prefix call `t5x.decoding` with
`initial_index` and prefilled caches; the `pbwa_*` arrays come from T5X's
`predict_batch_with_aux(prompt_with_targets=True)`, which teacher-forces the prompt instead.
"""

import json

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from speculative_t5x import beam_search
from speculative_t5x import decoding
from speculative_t5x import models
from speculative_t5x import network
from conftest import apply, shared_files

EOS_ID = 1
LENGTH = 10
# Enough cache for the longest-prompt row to run on while the shortest fills its output (beam
# search; see the json's "beam_overflow"): 10 + max(initial_index) - min(initial_index).
BEAM_CACHE_LENGTH = 17


@pytest.fixture(scope='module')
def tiny():
  """(module, params, reference arrays) for T5X's tiny checkpoint."""
  files = shared_files('t5x/test_t5_tiny.checkpoint_0', 't5x/test_t5_tiny_reference_prompts.npz')
  ref = dict(np.load(files[1]))
  config = network.T5Config(**json.loads(str(ref['config'])))
  params = flax.serialization.msgpack_restore(files[0].read_bytes())['optimizer']['target']
  return network.Transformer(config), params, ref


def _prefilled_cache(module, params, encoder_tokens, prompts, cache_length):
  """A `DecoderCache` holding each row's positions 0..n-1 (BOS, p_1..p_{n-1}), and n [batch].

  The whole prompt block is written at once; entries at or after a row's index n are never
  read (and get overwritten), so this is T5X's per-row prefill.
  """
  encoded = apply(module, {'params': params}, encoder_tokens, method=network.Transformer.encode)
  cache = apply(module, {'params': params}, encoded, encoder_tokens, cache_length,
                method=network.Transformer.init_cache)
  lengths = jnp.sum(prompts != 0, axis=1).astype(jnp.int32)
  _, cache = apply(module, {'params': params}, prompts, cache, lengths,
                   method=network.Transformer.decode_step)
  return cache, lengths


def _noisy(params, scale=0.5):
  """A draft that disagrees with the target often enough to exercise rejections."""
  leaves, tree = jax.tree_util.tree_flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(5), len(leaves))
  return jax.tree_util.tree_unflatten(
      tree, [x + scale * jnp.std(x) * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


def test_prefilled_greedy_and_per_row_temperature_sampling(tiny):
  module, params, ref = tiny
  np.testing.assert_array_equal(ref['initial_index'], ref['prompt_lengths'])
  t2l = models.make_tokens_to_logits(module, params)

  @jax.jit
  def run(encoder_tokens, prompts, temperature, rng):
    cache, initial_index = _prefilled_cache(module, params, encoder_tokens, prompts, LENGTH)
    common = dict(inputs=prompts, cache=cache, tokens_to_logits=t2l, eos_id=EOS_ID,
                  initial_index=initial_index)
    greedy = decoding.temperature_sample(**common)  # T5X's defaults: topk=1
    greedy_raw = decoding.temperature_sample(**common, rescale_log_probs=False)
    sampled = decoding.temperature_sample(**common, topk=0, temperature=temperature,
                                          decode_rng=rng)
    return greedy, greedy_raw[1], sampled, initial_index

  greedy, greedy_raw, sampled, initial_index = run(
      ref['encoder_input_tokens'], ref['decoder_input_tokens'], ref['sample_temperature'],
      ref['sample_decode_rng'])
  np.testing.assert_array_equal(initial_index, ref['initial_index'])
  np.testing.assert_array_equal(greedy[0][:, -1], ref['greedy_prompt_decodes'])
  np.testing.assert_array_equal(greedy[1][:, -1], ref['greedy_prompt_scores'])
  np.testing.assert_allclose(greedy_raw[:, -1], ref['greedy_prompt_logprob'], atol=1e-4)
  # Same key, same draws: T5X's key stream and its shared noise for a per-row temperature.
  np.testing.assert_array_equal(sampled[0][:, -1], ref['sample_prompt_decodes'])
  np.testing.assert_allclose(sampled[1][:, -1], ref['sample_prompt_scores'], atol=1e-4)


def test_prefilled_beam_search(tiny):
  module, params, ref = tiny
  t2l = models.make_tokens_to_logits(module, params)

  @jax.jit
  def run(encoder_tokens, uneven, even):
    out = []
    for prompts, cache_length in ((uneven, BEAM_CACHE_LENGTH), (even, LENGTH)):
      cache, initial_index = _prefilled_cache(module, params, encoder_tokens, prompts,
                                              cache_length)
      out.append(beam_search.beam_search(prompts, cache, t2l, EOS_ID, num_decodes=4, alpha=0.6,
                                         initial_index=initial_index))
    return out

  for (decodes, scores), name in zip(
      run(ref['encoder_input_tokens'], ref['decoder_input_tokens'],
          ref['decoder_input_tokens_eq']), ('beam4_prompt', 'beam4_prompt_eq')):
    np.testing.assert_array_equal(decodes, ref[f'{name}_decodes'], err_msg=name)
    np.testing.assert_allclose(scores, ref[f'{name}_scores'], atol=1e-4, err_msg=name)


def test_teacher_forced_prompts_through_the_model(tiny):
  """T5X's predict_batch_with_aux path: prompts forced token by token, no prefill."""
  module, params, ref = tiny
  params = {'target': params}
  batch = {'encoder_input_tokens': ref['encoder_input_tokens'],
           'decoder_input_tokens': ref['decoder_input_tokens']}
  sampler = models.EncoderDecoderModel(module.config, decode_fn=decoding.temperature_sample,
                                       decode_kwargs={'topk': 0})
  beams = models.EncoderDecoderModel(module.config, decode_fn=beam_search.beam_search,
                                     decode_kwargs={'alpha': 0.6})

  @jax.jit
  def run(params, batch, temperature, rng):
    return {
        'pbwa_sample_prompt': sampler.predict_batch_with_aux(
            params, batch, rng, decoder_params={'temperature': temperature},
            prompt_with_targets=True),
        # A scalar temperature draws noise per row, unlike the per-row array.
        'pbwa_sample_noprompt_scalar_t1': sampler.predict_batch_with_aux(
            params, batch, rng, decoder_params={'temperature': 1.0}),
        'pbwa_beam4_prompt': beams.predict_batch_with_aux(
            params, batch, num_decodes=4, return_all_decodes=True, prompt_with_targets=True),
    }

  for name, (decodes, aux) in run(params, batch, ref['sample_temperature'],
                                  ref['sample_decode_rng']).items():
    np.testing.assert_array_equal(decodes, ref[f'{name}_decodes'], err_msg=name)
    np.testing.assert_allclose(aux['scores'], ref[f'{name}_scores'], atol=1e-4, err_msg=name)


def test_speculative_and_bild_with_prefilled_prompts(tiny):
  """Greedy speculative / rollback-0 BiLD with a disagreeing draft reproduce T5X's target."""
  module, params, ref = tiny
  draft_params = _noisy(params)
  t2l = models.make_tokens_to_logits(module, params)
  d2l = models.make_tokens_to_logits(module, draft_params)

  @jax.jit
  def run(encoder_tokens, prompts, zeros):
    cache, initial_index = _prefilled_cache(module, params, encoder_tokens, prompts, LENGTH)
    draft_cache, _ = _prefilled_cache(module, draft_params, encoder_tokens, prompts, LENGTH)
    common = dict(inputs=prompts, cache=cache, tokens_to_logits=t2l, draft_cache=draft_cache,
                  draft_tokens_to_logits=d2l, eos_id=EOS_ID, initial_index=initial_index,
                  return_stats=True)
    return {
        'speculative': decoding.speculative_sample(**common, gamma=3, temperature=0.0),
        # An all-zero temperature operand takes the sampled branch, greedy row by row.
        'speculative_zero_operand': decoding.speculative_sample(**common, gamma=3,
                                                                temperature=zeros),
        # The random tiny model is never confident: without fallback_threshold=0 the small
        # model would propose nothing.
        'bild': decoding.bild_decode(**common, fallback_threshold=0.0, rollback_threshold=0.0,
                                     max_small_steps=3),
    }

  for name, (decodes, _, stats) in run(ref['encoder_input_tokens'], ref['decoder_input_tokens'],
                                       jnp.zeros(4)).items():
    np.testing.assert_array_equal(decodes[:, -1], ref['greedy_prompt_decodes'], err_msg=name)
    assert int(np.sum(stats.rollbacks)) > 0, name  # the draft was overruled
