"""Block verification: exact by enumeration of one call, and through the decoder by chi-square.

One call's exactness is checked with no sampling noise: for autoregressive p and q given by
tables over every prefix of a 3-token vocabulary, every draft x_1..x_gamma is enumerated with its
probability under q, each stop tau with its probability from `block_stops`, and each emitted
token with its residual's; followed by the target's own continuation, the call must give every
sequence of gamma + 1 tokens exactly its probability under p. Two deliberately broken variants
(the running weight not carried, the stop probability not renormalised) must fail the same check.
The decoder's block verification is then checked by chi-square against the enumerated target,
as test_guarantees checks token verification.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from speculative_t5x import decoding
from speculative_t5x import trees
from conftest import start_decoding
from test_decoding import NUM_SAMPLES, SMALL_EOS, SMALL_LEN, _chi_square_p_value
from test_guarantees import DRAFT, ENC, SAME, TARGET, _p_value, _sample

VOCAB = 3


def _tables(seed, gamma, temperature, topk, topp, draft_cut):
  """{prefix tuple: (p, q)} for every prefix of 0..gamma tokens: sampling distributions [VOCAB]
  of a random target and a draft that differs from it (draft_cut: token 2 never proposed)."""
  rng = np.random.default_rng(seed)
  prefixes = [t for n in range(gamma + 1) for t in itertools.product(range(VOCAB), repeat=n)]
  target = rng.normal(size=(len(prefixes), VOCAB)) * 2.0
  draft = target + rng.normal(size=target.shape) * 1.5
  if draft_cut:
    draft[:, 2] = decoding.NEG_INF
  dist = lambda logits: np.exp(np.asarray(decoding.sampling_log_probs(
      jnp.asarray(logits, jnp.float32), temperature, topk, topp), np.float64))
  return dict(zip(prefixes, zip(dist(target), dist(draft))))


def _one_call_distribution(tables, gamma):
  """(P [VOCAB ** (gamma + 1)] of one block-verification call then target sampling, expected
  tokens per call, the same for token-by-token verification)."""
  drafts = list(itertools.product(range(VOCAB), repeat=gamma))
  p = np.stack([[tables[x[:i]][0] for i in range(gamma + 1)] for x in drafts])
  q = np.stack([[tables[x[:i]][1] for i in range(gamma)] for x in drafts])
  tokens = np.asarray(drafts, np.int32).reshape(len(drafts), gamma)
  h, residual = decoding.block_stops(jnp.asarray(p, jnp.float32), jnp.asarray(q, jnp.float32),
                                     jnp.asarray(tokens), jnp.full((len(drafts),), gamma))
  h, residual = np.asarray(h, np.float64), np.asarray(residual, np.float64)
  target_p = lambda s: np.prod([tables[s[:i]][0][s[i]] for i in range(len(s))])
  out = np.zeros([VOCAB] * (gamma + 1))
  block_tokens = token_tokens = 0.0
  for d, x in enumerate(drafts):
    q_x = np.prod([q[d, i, x[i]] for i in range(gamma)])
    if q_x == 0:
      continue
    # tau = max{i : u_i <= h_i}: P(tau = j) = h_j * prod_{i > j} (1 - h_i).
    stop = [h[d, j] * np.prod(1.0 - h[d, j + 1:]) for j in range(gamma + 1)]
    for j, p_stop in enumerate(stop):
      res = residual[d, j] / max(residual[d, j].sum(), 1e-300)
      block_tokens += q_x * p_stop * (j + 1)
      for y in range(VOCAB):
        head = x[:j] + (y,)
        for tail in itertools.product(range(VOCAB), repeat=gamma - j):
          seq = head + tail
          # The continuation after the call is the target's own sampling.
          cont = target_p(seq) / max(target_p(head), 1e-300)
          out[seq] += q_x * p_stop * res[y] * cont
    kept = np.cumprod([min(1.0, p[d, i, x[i]] / q[d, i, x[i]]) for i in range(gamma)])
    token_tokens += q_x * (1.0 + kept.sum())
  want = np.array([target_p(s) for s in itertools.product(range(VOCAB), repeat=gamma + 1)])
  return out.reshape(-1), want, block_tokens, token_tokens


BLOCK_SETTINGS = {
    'gamma_1': dict(gamma=1, temperature=1.0),
    'gamma_2': dict(gamma=2, temperature=1.0),
    'gamma_3_temperature_0.6': dict(gamma=3, temperature=0.6),
    'gamma_4_temperature_1.5': dict(gamma=4, temperature=1.5),
    'gamma_3_top_k_2': dict(gamma=3, temperature=1.0, topk=2),
    'gamma_3_top_p_0.7': dict(gamma=3, temperature=1.0, topp=0.7),
    # The draft never proposes token 2, which the target emits: the residual must bring it back.
    'gamma_3_draft_cut': dict(gamma=3, temperature=1.0, draft_cut=True),
}


@pytest.mark.parametrize('setting', list(BLOCK_SETTINGS))
def test_one_block_call_is_exactly_the_target_and_keeps_at_least_token_verification(setting):
  kwargs = {'topk': 0, 'topp': 0.0, 'draft_cut': False, **BLOCK_SETTINGS[setting]}
  gamma = kwargs.pop('gamma')
  for seed in range(3):
    got, want, block, token = _one_call_distribution(_tables(seed, gamma, **kwargs), gamma)
    np.testing.assert_allclose(got, want, atol=2e-6)
    assert block >= token - 1e-6, (block, token)
  print(f'{setting}: tokens per call block {block:.4f} vs token {token:.4f}')


def _weights_not_carried(ratio):
  return jnp.concatenate([jnp.ones_like(ratio[:, :1]), jnp.minimum(1.0, ratio)], axis=1)


def _stop_not_renormalised(residual_mass, weight):
  return jnp.minimum(residual_mass, 1.0)


@pytest.mark.parametrize('name, patch', [('_running_weights', _weights_not_carried),
                                         ('_stop_probability', _stop_not_renormalised)])
def test_broken_block_variants_fail_the_exact_check(monkeypatch, name, patch):
  monkeypatch.setattr(decoding, name, patch)
  got, want, _, _ = _one_call_distribution(_tables(0, 3, 1.0, 0, 0.0, False), 3)
  error = np.abs(got - want).max()
  print(f'{name} broken: max error {error:.3g}')
  assert error > 1e-2


def test_a_shorter_draft_is_judged_as_its_own_block():
  """Positions beyond num_proposed change nothing: gamma 4 with n = 2 is the gamma 2 block."""
  rng = np.random.default_rng(1)
  p = jnp.asarray(rng.dirichlet(np.ones(VOCAB), size=(8, 5)), jnp.float32)
  q = jnp.asarray(rng.dirichlet(np.ones(VOCAB), size=(8, 4)), jnp.float32)
  tokens = jnp.asarray(rng.integers(0, VOCAB, size=(8, 4)), jnp.int32)
  h4, res4 = decoding.block_stops(p, q, tokens, jnp.full((8,), 2))
  # The gamma 2 block: its bonus distribution is p after two tokens.
  h2, res2 = decoding.block_stops(p[:, :3], q[:, :2], tokens[:, :2], jnp.full((8,), 2))
  np.testing.assert_allclose(np.asarray(h4[:, :3]), np.asarray(h2), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(res4[:, :3]), np.asarray(res2), rtol=1e-6)
  assert np.all(np.asarray(h4[:, 3:]) == 0)


# ------------------------------------------------------------------------------------------------
# Through the decoder.

# Each setting is one compiled decoder: the settings merge what the exact one-call check above
# covers one by one (gamma, temperature, top-k/p, a cut draft), so that the decoder's plumbing
# of each (per-row temperatures, the shorter final block, the draft's cut logits) is exercised.
DECODER_SETTINGS = {
    'gamma_3_per_row_temperature': dict(gamma=3, temperature=(0.6, 1.0, 1.5, 0.0)),
    'gamma_4_top_k_3': dict(gamma=4, temperature=1.0, topk=3),
    'gamma_2_top_p_0.8_draft_cut': dict(gamma=2, temperature=1.0, topp=0.8,
                                        draft_vocabulary=np.arange(4)),
}


@functools.lru_cache(maxsize=None)
def _distribution(temperature, topk, topp):
  from test_decoding import _exact_distribution
  return _exact_distribution(TARGET, ENC, temperature, topk, topp)


def _assert_samples_the_target(decoder, label, **kwargs):
  """Chi-square of NUM_SAMPLES decodes against the enumerated target, per row temperature (a
  tuple of temperatures is spread over the rows; rows at 0 must be greedy)."""
  temperatures = np.atleast_1d(np.asarray(kwargs['temperature'], np.float32))
  row_temperatures = np.resize(temperatures, NUM_SAMPLES)
  if isinstance(kwargs['temperature'], tuple):
    kwargs['temperature'] = jnp.asarray(row_temperatures)
  samples, stats = _sample(decoder, **kwargs)
  dists = {float(t): _distribution(float(t), kwargs.get('topk', 0), kwargs.get('topp', 0.0))
           for t in temperatures}
  p_value = _chi_square_p_value(samples, dists, row_temperatures)
  alpha = stats.accepted / (stats.accepted + stats.rollbacks)
  print(f'{label}: p={p_value:.3g}, alpha={alpha:.3f}, '
        f'tokens per call {stats.emitted / stats.target_calls:.3f}')
  assert p_value > SAME, f'{label} is not the target\'s sampler'
  assert 0.2 < alpha < 0.95  # rejections happen: the test has teeth


@pytest.mark.parametrize('setting', list(DECODER_SETTINGS))
def test_block_verification_samples_the_target(setting):
  _assert_samples_the_target(decoding.speculative_sample, f'block, {setting}',
                             verification='block', **DECODER_SETTINGS[setting])


def test_block_with_weights_not_carried_is_caught_by_the_decoder_test(monkeypatch):
  monkeypatch.setattr(decoding, '_running_weights', _weights_not_carried)
  samples, _ = _sample(decoding.speculative_sample, verification='block', gamma=2,
                       temperature=1.0)
  p_value = _p_value(samples, 1.0)
  print(f'block with weights not carried: p={p_value:.3g}')
  assert p_value < 1e-6


def _greedy_rows(rows=64):
  """(the pair's decoder arguments for `rows` random inputs, the target's greedy decodes)."""
  encs = jax.random.randint(jax.random.PRNGKey(3), (rows, 4), 2, 6).astype(jnp.int32)
  cache, t2l = start_decoding(*TARGET, encs, SMALL_LEN)
  draft_cache, d2l = start_decoding(*DRAFT, encs, SMALL_LEN)
  inputs = jnp.zeros((rows, SMALL_LEN), jnp.int32)
  greedy = decoding.temperature_sample(inputs, cache, t2l, SMALL_EOS, temperature=0.0)[0]
  return (inputs, cache, t2l, draft_cache, d2l, SMALL_EOS), greedy


def test_block_verification_at_temperature_zero_is_greedy():
  """Per-row temperatures of 0 take the sampled branch on one-hot distributions: block verdicts
  must give the target's greedy tokens, as the static greedy branch does."""
  args, greedy = _greedy_rows()
  block, _, stats = decoding.speculative_sample(
      *args, gamma=3, verification='block', temperature=jnp.zeros((len(greedy),)),
      return_stats=True)
  np.testing.assert_array_equal(np.asarray(block), np.asarray(greedy))
  assert 0 < int(np.asarray(stats.rollbacks).sum())  # the draft disagrees somewhere


@pytest.mark.parametrize('kwargs, message', [
    (dict(verification='tree'), 'verification must be one of'),
    (dict(verification='block', lenience=0.5), 'lenience 1 only'),
])
def test_bad_verification_settings_are_one_line(kwargs, message):
  with pytest.raises(ValueError, match=message):
    decoding.speculative_sample(jnp.zeros((1, 3), jnp.int32), None, None, None, None, 1,
                                **kwargs)


def test_auto_verification_is_block_where_sampling_gives_it_something_to_keep():
  """'auto' (the default) resolves to block verification when sampling at gamma >= 2 with the
  exact rule, and to token verification where the two give the same verdicts (gamma 1, a
  static temperature 0) or block has no form (a lenience, a custom rule); through the decoder,
  the default draws exactly the samples of the verifier it resolves to."""
  resolve = decoding.resolve_verification
  assert resolve('auto', 2, 1.0) == resolve('auto', 4, jnp.zeros((3,))) == 'block'
  assert resolve('auto', 1, 1.0) == resolve('auto', 4, 0.0) == 'token'
  assert resolve('auto', 4, 1.0, lenience=0.5) == 'token'
  assert resolve('auto', 4, 1.0, rule=decoding.speculative_rule()) == 'token'
  assert resolve('token', 4, 1.0) == 'token' and resolve('block', 1, 0.0) == 'block'
  args, _ = _greedy_rows(rows=16)
  draw = lambda gamma, verification: np.asarray(decoding.speculative_sample(
      *args, gamma=gamma, temperature=1.0, decode_rng=jax.random.PRNGKey(5),
      verification=verification)[0])
  np.testing.assert_array_equal(draw(3, 'auto'), draw(3, 'block'))
  assert not np.array_equal(draw(3, 'auto'), draw(3, 'token'))  # the check can tell them apart
  np.testing.assert_array_equal(draw(1, 'auto'), draw(1, 'token'))


# ------------------------------------------------------------------------------------------------
# Token trees: exact with drafts drawn without replacement, greedy trees are greedy.

TREE_SETTINGS = {
    'branching_2_2_per_row_temperature': dict(branching=(2, 2),
                                              temperature=(0.6, 1.0, 1.5, 0.0)),
    'branching_4_1_top_k_3': dict(branching=(4, 1), temperature=1.0, topk=3),
    'branching_2_1_top_p_0.8_draft_cut': dict(branching=(2, 1), temperature=1.0, topp=0.8,
                                              draft_vocabulary=np.arange(4)),
}


@pytest.mark.parametrize('setting', list(TREE_SETTINGS))
def test_tree_sampling_samples_the_target(setting):
  _assert_samples_the_target(trees.tree_speculative_sample, f'tree, {setting}',
                             **TREE_SETTINGS[setting])


def _most_likely_children(rng, log_q, width):
  # The draft's top-k tokens, not a draw: corrected as a draw without replacement, it is biased.
  # (A draw with replacement whose repeats are skipped, as the walk skips them, stays exact.)
  del rng
  return jax.lax.top_k(log_q, width)[1]


def _not_renormalised(weights, fallback):
  return weights


@pytest.mark.parametrize('name, patch', [('_draw_children', _most_likely_children),
                                         ('_normalised', _not_renormalised)])
def test_broken_tree_variants_are_caught(monkeypatch, name, patch):
  """Children that are not a draw from q, corrected as one; residuals not renormalised."""
  monkeypatch.setattr(trees, name, patch)
  samples, _ = _sample(trees.tree_speculative_sample, branching=(3,), temperature=1.0)
  p_value = _p_value(samples, 1.0)
  print(f'tree with {name} broken: p={p_value:.3g}')
  assert p_value < 1e-6


def test_a_wider_first_level_keeps_more_than_the_chain():
  chain = _sample(trees.tree_speculative_sample, branching=(1, 1), temperature=1.0)[1]
  tree = _sample(trees.tree_speculative_sample, branching=(3, 1), temperature=1.0)[1]
  per_call = lambda s: s.emitted / s.target_calls
  print(f'tokens per call: tree (3, 1) {per_call(tree):.3f}, chain {per_call(chain):.3f}')
  assert per_call(tree) > 1.1 * per_call(chain)


@pytest.mark.parametrize('branching', [(1,), (3,), (2, 2)])
def test_greedy_trees_are_the_targets_greedy_output(branching):
  args, greedy = _greedy_rows()
  out, _, stats = trees.tree_speculative_sample(*args, branching=branching, temperature=0.0,
                                                return_stats=True)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(greedy))
  assert 0 < int(np.asarray(stats.rollbacks).sum())
