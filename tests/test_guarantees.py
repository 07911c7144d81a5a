"""Distribution guarantees under sampling, by a chi-square test against the enumerated target.

BiLD whose small model always falls back is the target's sampler (at any temperature); at its
default thresholds it is not. Speculative sampling with lenience 1 is the target's sampler; with
lenience < 1 it is not. The enumeration and the test are test_decoding's (its exactness test of
speculative sampling): a 6-token vocabulary, outputs of at most 3 tokens, 20,000 samples.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from speculative_t5x import decoding
from speculative_t5x import models
from speculative_t5x import network
from speculative_t5x import policy
from conftest import random_model, start_decoding
from test_decoding import (NUM_SAMPLES, SMALL, SMALL_EOS, SMALL_LEN, _chi_square_p_value,
                           _exact_distribution)

# test_decoding's pair: the target, and a perturbed copy as the draft/small model (alpha ~ 0.4).
TARGET = random_model(SMALL, seed=20, logit_scale=3.0)
DRAFT = (TARGET[0], jax.tree_util.tree_map(
    lambda x: x + jax.random.normal(jax.random.PRNGKey(7), x.shape), TARGET[1]))
ENC = jnp.array([[3, 4, 5, 1]], jnp.int32)
# Above any top probability: BiLD's small model is never confident, so every step falls back.
ALWAYS_FALL_BACK = 1.5
SAME = 1e-3     # a p-value above this: no evidence against the target's distribution
DIFFERENT = 1e-6  # a p-value below this: the distribution is not the target's


@functools.lru_cache(maxsize=None)
def _target_distribution(temperature):
  return _exact_distribution(TARGET, ENC, temperature, 0, 0.0)


def _sample(decoder, draft_vocabulary=None, **kwargs):
  """NUM_SAMPLES decodes of ENC, one row each, fixed seed: (outputs [rows, length], stats).
  draft_vocabulary: token ids the draft may propose (`network.decode_variables`)."""

  @jax.jit
  def run(rng):
    encs = jnp.repeat(ENC, NUM_SAMPLES, axis=0)
    cache, t2l = start_decoding(*TARGET, encs, SMALL_LEN)
    draft_cache, d2l = start_decoding(*DRAFT, encs, SMALL_LEN)
    if draft_vocabulary is not None:
      d2l = models.make_tokens_to_logits(*DRAFT, network.decode_variables(
          SMALL, DRAFT[1], fuse=False, vocabulary_ids=draft_vocabulary))
    inputs = jnp.zeros((NUM_SAMPLES, SMALL_LEN), jnp.int32)
    return decoder(inputs, cache, t2l, draft_cache, d2l, SMALL_EOS, decode_rng=rng,
                   return_stats=True, **kwargs)

  decodes, _, stats = run(jax.random.PRNGKey(0))
  stats = jax.tree_util.tree_map(lambda x: np.asarray(x).sum(), stats)
  return np.asarray(decodes[:, 0]), stats


def _p_value(samples, temperature):
  return _chi_square_p_value(samples, {temperature: _target_distribution(temperature)})


@pytest.mark.parametrize('temperature', [1.0, 0.7])
def test_bild_always_falling_back_samples_the_target(temperature):
  samples, stats = _sample(decoding.bild_decode, temperature=temperature,
                           fallback_threshold=ALWAYS_FALL_BACK)
  p_value = _p_value(samples, temperature)
  print(f'BiLD always falling back, temperature {temperature}: p={p_value:.3g}, '
        f'proposed={stats.proposed}, fallbacks={stats.fallbacks}')
  assert p_value > SAME, 'BiLD falling back at every step is not the target\'s sampler'
  # The setting does what it says: the small model proposed nothing, and every row fell back.
  assert stats.proposed == 0 and stats.fallbacks >= NUM_SAMPLES


def test_bild_default_thresholds_are_lossy():
  samples, stats = _sample(decoding.bild_decode, temperature=1.0)
  p_value = _p_value(samples, 1.0)
  accepted = stats.accepted / stats.proposed
  print(f'BiLD at default thresholds: p={p_value:.3g}, accepted {accepted:.3f} of '
        f'{stats.proposed} proposals')
  assert p_value < DIFFERENT, 'BiLD at default thresholds looks lossless: the test lacks power'
  assert accepted > 0.5  # the small model's tokens make most of the output


@pytest.mark.parametrize('lenience', [0.5, 1.0])
def test_lenience_below_one_is_lossy_and_one_is_exact(lenience):
  samples, stats = _sample(decoding.speculative_sample, temperature=1.0, gamma=2,
                           lenience=lenience, verification='token')
  p_value = _p_value(samples, 1.0)
  alpha = stats.accepted / stats.proposed
  print(f'speculative sampling, lenience {lenience}: p={p_value:.3g}, alpha={alpha:.3f}')
  if lenience == 1.0:
    assert p_value > SAME, 'speculative sampling at lenience 1 is not the target\'s sampler'
    assert 0.2 < alpha < 0.8  # a draft that differs from the target, so the test has teeth
  else:
    assert p_value < DIFFERENT, f'lenience {lenience} gives the target\'s distribution'


@pytest.mark.parametrize('verification', ['token', 'auto'])
def test_a_draft_with_a_cut_vocabulary_samples_the_target(verification):
  """A draft restricted to tokens 0-3 of 6 never proposes 4 or 5, which the target emits on its
  own: speculative sampling stays the target's sampler (the acceptance uses the distribution
  the draft sampled from), by token verification and by the default (block, at gamma 2)."""
  samples, stats = _sample(decoding.speculative_sample, draft_vocabulary=np.arange(4),
                           temperature=1.0, gamma=2, verification=verification)
  p_value = _p_value(samples, 1.0)
  print(f'speculative sampling, draft vocabulary 0-3: p={p_value:.3g}, '
        f'alpha={stats.accepted / stats.proposed:.3f}')
  assert p_value > SAME, 'a draft with a cut vocabulary changes the output distribution'
  assert np.isin(samples, [4, 5]).any()  # the tokens the draft cannot propose still come out


def test_sampling_through_the_policy_samples_the_target():
  """gamma='auto' at temperature 1: batches of one job run different gammas (the target alone
  included), as the policy picks them from an injected clock; together they are still the
  target's samples."""
  rows = NUM_SAMPLES // 4

  @functools.partial(jax.jit, static_argnums=0)
  def run(gamma, rng):
    encs = jnp.repeat(ENC, rows, axis=0)
    cache, t2l = start_decoding(*TARGET, encs, SMALL_LEN)
    inputs = jnp.zeros((rows, SMALL_LEN), jnp.int32)
    if gamma == 0:
      return decoding.temperature_sample(inputs, cache, t2l, SMALL_EOS, decode_rng=rng,
                                         temperature=1.0, topk=0)[0][:, 0]
    draft_cache, d2l = start_decoding(*DRAFT, encs, SMALL_LEN)
    return decoding.speculative_sample(inputs, cache, t2l, draft_cache, d2l, SMALL_EOS,
                                       decode_rng=rng, temperature=1.0, gamma=gamma)[0][:, 0]

  clock = [0.0]
  costs = {0: 1.2, 1: 1.0, 2: 0.9}  # ms per output position: the search visits 1, 0, then 2
  decoding_policy = policy.DecodingPolicy((0, 1, 2), 'gamma', 1, clock=lambda: clock[0])

  def batch(gamma, b):
    decodes = run(gamma, jax.random.PRNGKey(b))
    clock[0] += costs[gamma] * policy.output_positions(decodes) / 1e3
    return decodes, {}

  chosen, samples = [], []
  for b in range(4):
    gamma, (decodes, _) = decoding_policy.decode(functools.partial(batch, b=b))
    chosen.append(gamma)
    samples.append(np.asarray(decodes))
  p_value = _p_value(np.concatenate(samples), 1.0)
  print(f'speculative sampling through the policy, gammas {chosen}: p={p_value:.3g}')
  assert chosen == [1, 0, 1, 2]  # (an exploration follows a batch of the running choice)
  assert p_value > SAME, 'sampling through the policy is not the target\'s sampler'
