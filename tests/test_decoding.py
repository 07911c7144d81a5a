"""The decoding loops: greedy identity, exact sampling distribution, BiLD semantics, T5X parity."""

import functools
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import serialization
from scipy import stats as scipy_stats

from speculative_t5x import decoding
from speculative_t5x import trees
from speculative_t5x import models
from speculative_t5x import network
from conftest import apply, ragged_tokens, random_model, start_decoding, tiny_config

MAX_LEN = 12
NO_EOS = 63  # a token id the tiny models rarely produce; tests that need EOS pick one


@functools.partial(jax.jit, static_argnames=('eos_id', 'spec_kwargs', 'max_decode_steps'))
def _greedy_pair(target_params, draft_params, enc, inputs, eos_id, spec_kwargs,
                 max_decode_steps=None):
  cache, t2l = start_decoding(TARGET[0], target_params, enc, inputs.shape[1])
  draft_cache, d2l = start_decoding(TARGET[0], draft_params, enc, inputs.shape[1])
  base = decoding.temperature_sample(inputs, cache, t2l, eos_id, temperature=0.0,
                                     max_decode_steps=max_decode_steps)
  spec = decoding.speculative_sample(inputs, cache, t2l, draft_cache, d2l, eos_id,
                                     temperature=0.0, return_stats=True,
                                     max_decode_steps=max_decode_steps, **dict(spec_kwargs))
  return base[0][:, 0], spec[0][:, 0], spec[2]


def _decode_both(target, draft, enc, inputs, eos_id, max_decode_steps=None, **spec_kwargs):
  """Greedy target-only and greedy speculative decodes of one batch, jitted together."""
  return _greedy_pair(target[1], draft[1], enc, inputs, eos_id,
                      tuple(sorted(spec_kwargs.items())), max_decode_steps)


CFG = tiny_config()
TARGET = random_model(CFG, seed=0, logit_scale=4.0)
DRAFTS = {
    'same': TARGET,  # alpha = 1
    'unrelated': random_model(CFG, seed=1, logit_scale=4.0),  # alpha ~ 0
    # The target with noise: partial agreement, so acceptance runs of every length occur.
    'noisy': (TARGET[0], jax.tree_util.tree_map(
        lambda x: x + 0.3 * jax.random.normal(jax.random.PRNGKey(9), x.shape), TARGET[1])),
}


@pytest.mark.parametrize('gamma,batch,draft,adaptive', [
    (1, 1, 'noisy', False), (2, 3, 'same', True), (4, 8, 'noisy', True),
    (7, 5, 'unrelated', False), (4, 2, 'unrelated', True), (7, 8, 'noisy', False),
])
def test_greedy_speculative_equals_greedy_target(gamma, batch, draft, adaptive):
  enc = ragged_tokens(jax.random.PRNGKey(batch), batch, 9, CFG.vocab_size)
  inputs = jnp.zeros((batch, MAX_LEN), jnp.int32)
  base, spec, stats = _decode_both(TARGET, DRAFTS[draft], enc, inputs, NO_EOS, gamma=gamma,
                                   adaptive_gamma=adaptive)
  np.testing.assert_array_equal(np.asarray(spec), np.asarray(base))
  alpha = np.asarray(stats.acceptance_rate)
  if draft == 'same':
    np.testing.assert_array_equal(alpha, 1.0)
    assert (np.asarray(stats.target_calls) < MAX_LEN).all()
  if draft == 'unrelated':
    assert alpha.mean() < 0.5
  np.testing.assert_array_equal(np.asarray(stats.emitted)[:, 0], (np.asarray(base) != 0).sum(1))


def test_greedy_identity_with_eos_mid_sequence_and_prompt():
  batch = 4
  enc = ragged_tokens(jax.random.PRNGKey(11), batch, 9, CFG.vocab_size)
  inputs = jnp.zeros((batch, MAX_LEN), jnp.int32)
  base, _, _ = _decode_both(TARGET, DRAFTS['noisy'], enc, inputs, NO_EOS, gamma=3)
  eos = int(base[0, 4])  # an id row 0 emits mid-sequence: it must end there
  # Row 3 gets a 3-token forced prompt (T5X layout: inputs[:, 0] is the BOS slot).
  inputs = inputs.at[3, 1:4].set(jnp.array([5, 6, 7]))
  base, spec, stats = _decode_both(TARGET, DRAFTS['noisy'], enc, inputs, eos, gamma=3)
  base, spec = np.asarray(base), np.asarray(spec)
  np.testing.assert_array_equal(spec, base)
  first_eos = list(base[0]).index(eos)
  assert first_eos <= 4 and (base[0, first_eos + 1:] == 0).all()
  np.testing.assert_array_equal(base[3, :3], [5, 6, 7])


def test_max_decode_steps_and_length_limit():
  batch = 3
  enc = ragged_tokens(jax.random.PRNGKey(12), batch, 9, CFG.vocab_size)
  inputs = jnp.zeros((batch, MAX_LEN), jnp.int32).at[1, 1:3].set(jnp.array([4, 9]))
  base, spec, _ = _decode_both(TARGET, DRAFTS['same'], enc, inputs, NO_EOS, gamma=4,
                               max_decode_steps=5)
  np.testing.assert_array_equal(np.asarray(spec), np.asarray(base))
  lengths = (np.asarray(base) != 0).sum(1)
  np.testing.assert_array_equal(lengths, [5, 7, 5])  # prompt + max_decode_steps


# ------------------------------------------------------------------------------------------------
# Prompts already in the caches (T5X's initial_index) and temperature operands.

PROMPT_LENGTHS = (3, 0, 5, 1)


def _prompts(batch_lengths, seed=21):
  """T5X-layout prompts [batch, MAX_LEN], row = [0, p_1..p_n, 0...] with n from batch_lengths."""
  tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(seed),
                                         (len(batch_lengths), MAX_LEN), 2, NO_EOS))
  prompts = np.zeros_like(tokens)
  for row, n in enumerate(batch_lengths):
    prompts[row, 1:n + 1] = tokens[row, :n]
  return jnp.asarray(prompts, jnp.int32)


def _prefill(model, enc, prompts):
  """(cache holding each row's positions 0..n-1, tokens_to_logits, n [batch])."""
  module, params = model
  cache, t2l = start_decoding(module, params, enc, MAX_LEN)
  n = jnp.sum(prompts != 0, axis=1).astype(jnp.int32)
  _, cache = apply(module, {'params': params}, prompts, cache, n,
                   method=network.Transformer.decode_step)
  return cache, t2l, n


@jax.jit
def _forced_and_prefilled(enc, prompts):
  """Each decoder twice: prompts forced token by token, and prompts prefilled (initial_index)."""
  out = {}
  for prefilled in (False, True):
    if prefilled:
      cache, t2l, initial_index = _prefill(TARGET, enc, prompts)
      draft_cache, d2l, _ = _prefill(DRAFTS['noisy'], enc, prompts)
    else:
      cache, t2l = start_decoding(*TARGET, enc, MAX_LEN)
      draft_cache, d2l = start_decoding(*DRAFTS['noisy'], enc, MAX_LEN)
      initial_index = None
    pair = dict(inputs=prompts, cache=cache, tokens_to_logits=t2l, draft_cache=draft_cache,
                draft_tokens_to_logits=d2l, eos_id=NO_EOS, initial_index=initial_index)
    out['target', prefilled], _, stats = decoding.temperature_sample(
        prompts, cache, t2l, NO_EOS, temperature=0.0, num_decodes=2,
        initial_index=initial_index, return_stats=True)
    out['target_calls', prefilled] = stats.target_calls
    out['speculative', prefilled] = decoding.speculative_sample(**pair, gamma=3,
                                                                temperature=0.0)[0]
    # A cap longer than the output: BiLD's chunks then end where the models decide, not at
    # positions that depend on where decoding started.
    out['bild', prefilled] = decoding.bild_decode(**pair, max_small_steps=MAX_LEN)[0]
    out['tree', prefilled] = trees.tree_speculative_sample(**pair, branching=(2, 1),
                                                           temperature=0.0)[0]
  return out


def test_prefilled_prompts_decode_as_forced_prompts():
  batch = len(PROMPT_LENGTHS)
  enc = ragged_tokens(jax.random.PRNGKey(15), batch, 9, CFG.vocab_size)
  prompts = _prompts(PROMPT_LENGTHS)
  out = {k: np.asarray(v) for k, v in _forced_and_prefilled(enc, prompts).items()}
  for method in ('target', 'speculative', 'bild', 'tree'):
    np.testing.assert_array_equal(out[method, True], out[method, False], err_msg=method)
  # The prefilled rows start at their prompt's end: one target call fewer per prompt token.
  np.testing.assert_array_equal(out['target_calls', True],
                                out['target_calls', False] - np.array(PROMPT_LENGTHS)[:, None])
  # Outputs keep the prompt; both num_decodes copies of a greedy decode are the same.
  for row, n in enumerate(PROMPT_LENGTHS):
    np.testing.assert_array_equal(out['target', True][row, :, :n],
                                  np.broadcast_to(prompts[row, 1:n + 1], (2, n)))
  np.testing.assert_array_equal(out['speculative', True][:, 0], out['target', True][:, 0])
  np.testing.assert_array_equal(out['tree', True][:, 0], out['target', True][:, 0])
  # The prompts steer the decodes (else the comparison above would be vacuous).
  unprompted = _forced_and_prefilled(enc, jnp.zeros_like(prompts))['target', True]
  assert (np.asarray(unprompted) != out['target', True]).any()


def test_temperature_operand_one_compile_and_greedy_rows():
  """A [batch] temperature is an operand: new values reuse the compiled loop; rows at 0 are
  greedy (T5X's rule) in every decoder, although the loop runs its sampled branch."""
  batch = len(PROMPT_LENGTHS)
  enc = ragged_tokens(jax.random.PRNGKey(16), batch, 9, CFG.vocab_size)
  traces = []

  @jax.jit
  def run(enc, temperature, rng):
    traces.append(1)
    cache, t2l = start_decoding(*TARGET, enc, MAX_LEN)
    draft_cache, d2l = start_decoding(*DRAFTS['noisy'], enc, MAX_LEN)
    inputs = jnp.zeros((batch, MAX_LEN), jnp.int32)
    pair = dict(inputs=inputs, cache=cache, tokens_to_logits=t2l, draft_cache=draft_cache,
                draft_tokens_to_logits=d2l, eos_id=NO_EOS, temperature=temperature,
                decode_rng=rng)
    return {
        'greedy': decoding.temperature_sample(inputs, cache, t2l, NO_EOS, temperature=0.0)[0],
        'target': decoding.temperature_sample(inputs, cache, t2l, NO_EOS, topk=0,
                                              temperature=temperature, decode_rng=rng)[0],
        'speculative': decoding.speculative_sample(**pair, gamma=3, verification='token')[0],
        'block': decoding.speculative_sample(**pair, gamma=3, verification='block')[0],
        'tree': trees.tree_speculative_sample(**pair, branching=(2, 1))[0],
        # Rollback threshold 0: BiLD's greedy output is the large model's.
        'bild': decoding.bild_decode(**pair, fallback_threshold=0.0, rollback_threshold=0.0)[0],
    }

  first = run(enc, jnp.array([0.0, 1.5, 0.0, 2.0]), jax.random.PRNGKey(0))
  second = run(enc, jnp.array([0.0, 0.0, 0.0, 1e-5]), jax.random.PRNGKey(1))
  assert len(traces) == 1
  greedy = np.asarray(first['greedy'][:, 0])
  for method in ('target', 'speculative', 'block', 'tree', 'bild'):
    np.testing.assert_array_equal(np.asarray(first[method][[0, 2], 0]), greedy[[0, 2]],
                                  err_msg=method)
    np.testing.assert_array_equal(np.asarray(second[method][:, 0]), greedy, err_msg=method)
  # The hot rows did sample.
  assert (np.asarray(first['target'][[1, 3], 0]) != greedy[[1, 3]]).any()
  for method in ('speculative', 'block', 'tree'):
    assert (np.asarray(first[method][[1, 3], 0]) != greedy[[1, 3]]).any(), method


def test_temperature_sample_reproduces_t5x_greedy(t5x_data):
  raw = serialization.msgpack_restore((t5x_data / 'test_t5_tiny.checkpoint_0').read_bytes())
  ref = np.load(t5x_data / 'test_t5_tiny_reference.npz')
  module = network.Transformer(network.T5Config(**json.loads(str(ref['config']))))
  model = models.EncoderDecoderModel(module.config, decode_fn=decoding.temperature_sample,
                                     decode_kwargs={'temperature': 0.0})
  batch = {k: jnp.asarray(ref[k]) for k in ('encoder_input_tokens', 'decoder_input_tokens',
                                            'decoder_target_tokens', 'decoder_loss_weights')}
  params = {'target': raw['optimizer']['target']}
  decodes, aux = jax.jit(model.predict_batch_with_aux)(params, batch)
  np.testing.assert_array_equal(np.asarray(decodes), ref['greedy_decodes'])
  np.testing.assert_array_equal(np.asarray(aux['scores']), 0.0)  # T5X: rescaled greedy = 0
  np.testing.assert_allclose(np.asarray(model.score_batch(params, batch)), ref['score_batch'],
                             rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# Exactness of speculative sampling, against an enumerated target distribution.

SMALL = tiny_config(vocab_size=6, emb_dim=8, head_dim=4, mlp_dim=16, num_decoder_layers=1)
SMALL_LEN = 3
SMALL_EOS = 1
NUM_SAMPLES = 20_000


def _exact_distribution(model, enc, temperature, topk, topp):
  """{output sequence: probability} for T5X's sampling semantics, by enumeration."""
  module, params = model
  vocab = SMALL.vocab_size
  seqs = np.array(list(itertools.product(range(vocab), repeat=SMALL_LEN)), np.int32)
  dec_in = np.concatenate([np.zeros((len(seqs), 1), np.int32), seqs[:, :-1]], axis=1)
  encs = jnp.repeat(enc, len(seqs), axis=0)
  logits = apply(module, {'params': params}, encs, dec_in, np.ones_like(dec_in))
  log_p = np.asarray(jax.jit(decoding.sampling_log_probs, static_argnums=(1, 2, 3))(
      logits, temperature, topk, topp))
  token_p = np.exp(np.take_along_axis(log_p, seqs[..., None], -1)[..., 0])
  dist = {}
  for seq, probs in zip(seqs, token_p):
    end = next((i + 1 for i, t in enumerate(seq) if t == SMALL_EOS), SMALL_LEN)
    if (seq[end:] != 0).any():
      continue  # after EOS the loop emits padding: count each output once
    dist[tuple(seq)] = float(np.prod(probs[:end]))
  return dist


def _chi_square(samples, dist):
  """Pearson's statistic of samples against {sequence: probability}, and its degrees of freedom."""
  observed = {}
  for seq in map(tuple, samples):
    observed[seq] = observed.get(seq, 0) + 1
  assert set(observed) <= set(dist), 'sampled a sequence of probability 0'
  expected = np.array([dist[s] for s in dist]) * len(samples)
  counts = np.array([observed.get(s, 0) for s in dist])
  big = expected >= 5  # pool rare outcomes into one bin
  exp_bins = np.append(expected[big], expected[~big].sum())
  obs_bins = np.append(counts[big], counts[~big].sum())
  if exp_bins[-1] == 0:
    exp_bins, obs_bins = exp_bins[:-1], obs_bins[:-1]
  statistic = scipy_stats.chisquare(obs_bins, exp_bins * obs_bins.sum() / exp_bins.sum()).statistic
  return statistic, len(obs_bins) - 1


def _chi_square_p_value(samples, dists, row_temperatures=None):
  """p-value of samples [rows, length] against dists {temperature: distribution}.

  With row_temperatures [rows], each temperature's rows are tested against its own distribution
  and the independent statistics are summed; rows at temperature 0 must all be the greedy output.
  """
  if row_temperatures is None:
    row_temperatures = np.full(len(samples), next(iter(dists)))
  statistic = dof = 0
  for temperature, dist in dists.items():
    group = samples[row_temperatures == temperature]
    if temperature == 0:
      greedy = {seq for seq, prob in dist.items() if prob > 0}
      assert len(greedy) == 1 and {tuple(s) for s in group} == greedy, 'a greedy row sampled'
      continue
    stat, df = _chi_square(group, dist)
    statistic, dof = statistic + stat, dof + df
  return scipy_stats.chi2.sf(statistic, dof)


def _residual_from_p():
  rule = decoding.speculative_rule()
  return decoding.VerifyRule(rule.accept_prob, lambda p, q: p)


def _accept_if_p_above_q():
  rule = decoding.speculative_rule()
  accept = lambda p, q, p_raw, x: (decoding._at(p, x) >= decoding._at(q, x)).astype(jnp.float32)
  return decoding.VerifyRule(accept, rule.correction)


SAMPLING_SETTINGS = {
    'temperature_1': dict(temperature=1.0, topk=0, topp=0.0),
    'top_k_3': dict(temperature=1.0, topk=3, topp=0.0),
    'top_p_0.8': dict(temperature=1.0, topk=0, topp=0.8),
    'adaptive_and_confidence_stop': dict(temperature=1.0, topk=0, topp=0.0, adaptive_gamma=True,
                                         draft_confidence_threshold=0.4),
    # A [batch] operand, row r at temperature[r % 4], applied to target and draft alike.
    'per_row_temperature': dict(temperature=(0.7, 1.0, 1.5, 0.0), topk=0, topp=0.0),
}
# The settings whose broken controls are run too (two more compiles each): enough to show that
# the chi-square test has teeth at a scalar and at per-row temperatures.
CONTROLLED = ('temperature_1', 'per_row_temperature')


@pytest.mark.parametrize('setting', list(SAMPLING_SETTINGS))
def test_speculative_sampling_is_exact_and_controls_fail(setting):
  kwargs = dict(SAMPLING_SETTINGS[setting])
  target = random_model(SMALL, seed=20, logit_scale=3.0)
  # A perturbed copy of the target: alpha ~ 0.4, so rejections, corrections and fully accepted
  # drafts with bonus tokens all occur thousands of times.
  draft = (target[0], jax.tree_util.tree_map(
      lambda x: x + jax.random.normal(jax.random.PRNGKey(7), x.shape), target[1]))
  enc = jnp.array([[3, 4, 5, 1]], jnp.int32)
  temperatures = np.atleast_1d(np.asarray(kwargs['temperature'], np.float32))
  dists = {t: _exact_distribution(target, enc, float(t), kwargs['topk'], kwargs['topp'])
           for t in temperatures}
  row_temperatures = np.resize(temperatures, NUM_SAMPLES)
  if isinstance(kwargs['temperature'], tuple):
    kwargs['temperature'] = jnp.asarray(row_temperatures)
  encs = jnp.repeat(enc, NUM_SAMPLES, axis=0)
  inputs = jnp.zeros((NUM_SAMPLES, SMALL_LEN), jnp.int32)

  @functools.partial(jax.jit, static_argnames='rule')
  def sample(rule, rng):
    cache, t2l = start_decoding(*target, encs, SMALL_LEN)
    draft_cache, d2l = start_decoding(*draft, encs, SMALL_LEN)
    return decoding.speculative_sample(inputs, cache, t2l, draft_cache, d2l, SMALL_EOS,
                                       decode_rng=rng, gamma=2, rule=rule,
                                       verification='token', return_stats=True, **kwargs)

  decodes, _, stats = sample(None, jax.random.PRNGKey(0))
  alpha = float(np.asarray(stats.accepted).sum() / np.asarray(stats.proposed).sum())
  p_value = _chi_square_p_value(np.asarray(decodes[:, 0]), dists, row_temperatures)
  controls = {name: _chi_square_p_value(np.asarray(sample(rule, jax.random.PRNGKey(0))[0][:, 0]),
                                        dists, row_temperatures)
              for name, rule in (('correction_from_p', _residual_from_p()),
                                 ('accept_if_p_above_q', _accept_if_p_above_q()))
              if setting in CONTROLLED}
  print(f'{setting}: alpha={alpha:.3f} exact p={p_value:.3g} controls ' +
        ' '.join(f'{k} p={v:.3g}' for k, v in controls.items()))
  assert 0.2 < alpha < 0.8  # a draft that differs from the target, so the test has teeth
  assert p_value > 1e-3
  for name, control_p in controls.items():
    assert control_p < 1e-6, name


def test_traced_topp_masks_as_the_static_one():
  logits = jax.random.normal(jax.random.PRNGKey(3), (4, 2, 50)) * 3.0
  traced = jax.jit(lambda p: decoding.sampling_logits(logits, 0.8, 0, p))
  for topp in (0.3, 0.9, 0.0):
    got = np.asarray(traced(jnp.float32(topp)))
    want = np.asarray(decoding.sampling_logits(logits, 0.8, 0, topp))
    np.testing.assert_array_equal(got <= decoding.NEG_INF / 2, want <= decoding.NEG_INF / 2)
    np.testing.assert_allclose(got, want, rtol=1e-6)  # jit fuses the division: last-ulp noise
  assert traced._cache_size() == 1  # one compilation for every value
  # Masking happened: at 0.3 most entries are NEG_INF, at 0.0 none.
  assert (np.asarray(traced(jnp.float32(0.3))) <= decoding.NEG_INF / 2).mean() > 0.5


def test_acceptance_step_emits_p_in_closed_form():
  rng = np.random.default_rng(0)
  rule = decoding.speculative_rule()
  for vocab in (2, 5, 50):
    p = jnp.asarray(rng.dirichlet(np.ones(vocab) * 0.5, size=16), jnp.float32)
    q = jnp.asarray(rng.dirichlet(np.ones(vocab) * 0.5, size=16), jnp.float32)
    x = jnp.broadcast_to(jnp.arange(vocab), (16, vocab))
    accept = rule.accept_prob(p[:, None], q[:, None], p[:, None], x)  # [16, vocab]
    residual = rule.correction(p, q)
    residual = residual / jnp.sum(residual, -1, keepdims=True)
    reject = 1.0 - jnp.sum(q * accept, -1, keepdims=True)
    emitted = q * accept + reject * residual
    np.testing.assert_allclose(np.asarray(emitted), np.asarray(p), atol=1e-6)


# ------------------------------------------------------------------------------------------------
# BiLD.


def _bild_vs(decoder_model, enc, **kwargs):
  @jax.jit
  def run(enc):
    cache, t2l = start_decoding(*TARGET, enc, MAX_LEN)
    draft_cache, d2l = start_decoding(*DRAFTS['noisy'], enc, MAX_LEN)
    inputs = jnp.zeros((enc.shape[0], MAX_LEN), jnp.int32)
    bild = decoding.bild_decode(inputs, cache, t2l, draft_cache, d2l, NO_EOS, return_stats=True,
                                **kwargs)
    ref_cache, ref_fn = (cache, t2l) if decoder_model == 'large' else (draft_cache, d2l)
    ref = decoding.temperature_sample(inputs, ref_cache, ref_fn, NO_EOS, temperature=0.0)
    return bild[0][:, 0], ref[0][:, 0], bild[2]

  return run(enc)


def test_bild_rollback_zero_is_large_greedy():
  enc = ragged_tokens(jax.random.PRNGKey(13), 5, 9, CFG.vocab_size)
  bild, large, stats = _bild_vs('large', enc, rollback_threshold=0.0)
  np.testing.assert_array_equal(np.asarray(bild), np.asarray(large))
  assert np.asarray(stats.rollbacks).sum() > 0


def test_bild_never_falling_back_is_small_greedy():
  enc = ragged_tokens(jax.random.PRNGKey(14), 5, 9, CFG.vocab_size)
  bild, small, stats = _bild_vs('small', enc, fallback_threshold=0.0, rollback_threshold=np.inf,
                                max_small_steps=MAX_LEN)
  np.testing.assert_array_equal(np.asarray(bild), np.asarray(small))
  np.testing.assert_array_equal(np.asarray(stats.target_calls), 1)
  np.testing.assert_array_equal(np.asarray(stats.fallbacks), 0)


def _table_model(table):
  """A fake model whose logits depend only on the position: table [positions, vocab]."""
  table = jnp.asarray(table, jnp.float32)

  def tokens_to_logits(state):
    positions = state.cur_index[:, None] + jnp.arange(state.cur_token.shape[1])[None]
    return table[jnp.minimum(positions, table.shape[0] - 1)], state.cache

  return tokens_to_logits


def test_bild_fallback_and_rollback_counts_on_a_hand_built_case():
  vocab, length = 8, 6
  small = np.full((length + 4, vocab), -5.0)
  large = np.full((length + 4, vocab), -5.0)
  for pos in range(length + 4):
    small[pos, 2 + pos % 3] = 5.0   # confident (p ~ 0.99)
    large[pos, 2 + pos % 3] = 5.0   # and the large model agrees...
  small[2, 2 + 2 % 3] = 0.0         # ...except: unsure at position 2 -> fallback,
  small[2, 7] = 0.0
  large[2] = -5.0
  large[2, 6] = 5.0                 # where the large model says 6,
  large[4] = -20.0
  large[4, 7] = 5.0                 # and at 4 it gives the small token p ~ e^-25 -> rollback to 7.
  inputs = jnp.zeros((1, length), jnp.int32)
  dummy = jnp.zeros((1, 1))
  decodes, _, stats = decoding.bild_decode(inputs, dummy, _table_model(large), dummy,
                                           _table_model(small), eos_id=1, return_stats=True)
  expected = [2, 3, 6, 2, 7, 4]
  np.testing.assert_array_equal(np.asarray(decodes[0, 0]), expected)
  assert int(stats.fallbacks[0, 0]) == 1
  assert int(stats.rollbacks[0, 0]) == 1
  assert int(stats.target_calls[0, 0]) == 3
  # Proposed: 2 (then fallback) + 3 (4th rejected) + 1; accepted: 2 + 1 + 1.
  assert int(stats.proposed[0, 0]) == 6 and int(stats.accepted[0, 0]) == 4


# ------------------------------------------------------------------------------------------------
# Compile once per shape; the model object.


@pytest.mark.parametrize('temperature', [0.0, 1.0])
def test_unrolled_draft_decodes_as_the_draft_loop(temperature):
  """unroll_draft runs every draft call; the rows that stopped propose nothing more, so the
  tokens, the draws (same key) and the statistics are the loop's."""
  batch = 5
  enc = ragged_tokens(jax.random.PRNGKey(3), batch, 9, CFG.vocab_size)

  @functools.partial(jax.jit, static_argnames='unroll')
  def run(unroll):
    cache, t2l = start_decoding(*TARGET, enc, MAX_LEN)
    draft_cache, d2l = start_decoding(*DRAFTS['noisy'], enc, MAX_LEN)
    inputs = jnp.zeros((batch, MAX_LEN), jnp.int32)
    return decoding.speculative_sample(
        inputs, cache, t2l, draft_cache, d2l, NO_EOS, decode_rng=jax.random.PRNGKey(4), gamma=4,
        temperature=temperature, adaptive_gamma=True, draft_confidence_threshold=0.3,
        return_stats=True, unroll_draft=unroll)

  loop, unrolled = run(False), run(True)
  assert 0 < float(np.asarray(loop[2].accepted).sum()) < float(np.asarray(loop[2].proposed).sum())
  for a, b in zip(jax.tree.leaves(loop), jax.tree.leaves(unrolled)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_loop_iteration_commits_the_decodes_first_tokens():
  """`loop_iteration`, the straight-line program the compiled-cost benchmarks read, is one
  iteration of the decoder: what it commits starts the full decode."""
  batch, gamma = 4, 3
  enc = ragged_tokens(jax.random.PRNGKey(5), batch, 9, CFG.vocab_size)
  inputs = jnp.zeros((batch, MAX_LEN), jnp.int32)

  @functools.partial(jax.jit, static_argnames='draft')
  def run(draft):
    cache, t2l = start_decoding(*TARGET, enc, MAX_LEN)
    draft_cache, d2l = start_decoding(*DRAFTS[draft], enc, MAX_LEN)
    state, forced, limit = decoding.start_loop(inputs, cache, draft_cache, jax.random.PRNGKey(0),
                                               gamma, None, None)
    one = decoding.loop_iteration(state, forced, limit, t2l, d2l, NO_EOS, gamma)
    full = decoding.speculative_sample(inputs, cache, t2l, draft_cache, d2l, NO_EOS,
                                       temperature=0.0, gamma=gamma)[0][:, 0]
    return one, full

  for draft in ('same', 'unrelated'):
    one, full = run(draft)
    length = np.asarray(one.length)
    # The target itself as draft: every proposal and the bonus token; an unrelated one: mostly
    # the target's own token after a rejection.
    if draft == 'same':
      np.testing.assert_array_equal(length, gamma + 1)
    assert (length >= 1).all() and (length <= gamma + 1).all()
    for row in range(batch):
      np.testing.assert_array_equal(np.asarray(one.sequences)[row, 1:length[row] + 1],
                                    np.asarray(full)[row, :length[row]])
    np.testing.assert_array_equal(np.asarray(one.stats.target_calls), 1)


def test_each_loop_compiles_once_per_shape():
  traces = []

  def counting(fn):
    def wrapped(state):
      traces.append(1)
      return fn(state)
    return wrapped

  @functools.partial(jax.jit, static_argnames='method')
  def run(enc, method):
    cache, t2l = start_decoding(*TARGET, enc, MAX_LEN)
    draft_cache, d2l = start_decoding(*DRAFTS['noisy'], enc, MAX_LEN)
    inputs = jnp.zeros((enc.shape[0], MAX_LEN), jnp.int32)
    if method == 'baseline':
      return decoding.temperature_sample(inputs, cache, counting(t2l), NO_EOS)[0]
    fn = decoding.speculative_sample if method == 'speculative' else decoding.bild_decode
    return fn(inputs, cache, counting(t2l), draft_cache, counting(d2l), NO_EOS)[0]

  for method in ('baseline', 'speculative', 'bild'):
    enc = ragged_tokens(jax.random.PRNGKey(1), 2, 9, CFG.vocab_size)
    run(enc, method)
    count = len(traces)
    run(ragged_tokens(jax.random.PRNGKey(2), 2, 9, CFG.vocab_size), method)
    assert len(traces) == count, method


def test_model_predicts_with_stats_and_rejects_mismatched_draft():
  draft_cfg = tiny_config(num_decoder_layers=1)
  model = models.EncoderDecoderModel(CFG, draft_cfg, decode_fn=decoding.speculative_sample,
                                     decode_kwargs={'gamma': 3, 'temperature': 0.0})
  params = {'target': TARGET[1], 'draft': random_model(draft_cfg, seed=5)[1]}
  # Row 1 is all padding (the filler of a fixed-shape last batch): it must decode nothing.
  enc = ragged_tokens(jax.random.PRNGKey(3), 2, 9, CFG.vocab_size).at[1].set(0)
  batch = {'encoder_input_tokens': enc,
           'decoder_input_tokens': jnp.zeros((2, MAX_LEN), jnp.int32),
           'decoder_target_tokens': jnp.zeros((2, MAX_LEN), jnp.int32)}
  decodes, aux = jax.jit(model.predict_batch_with_aux)(params, batch)
  assert decodes.shape == (2, MAX_LEN)
  np.testing.assert_array_equal(np.asarray(aux['stats']['target_calls']) > 0, [True, False])
  np.testing.assert_array_equal(np.asarray(decodes[1]), 0)
  baseline = models.EncoderDecoderModel(CFG, decode_fn=decoding.temperature_sample,
                                        decode_kwargs={'temperature': 0.0})
  np.testing.assert_array_equal(np.asarray(decodes),
                                np.asarray(baseline.predict_batch(params, batch)))

  with pytest.raises(ValueError, match='target vocab_size 64, draft vocab_size 32'):
    models.EncoderDecoderModel(CFG, tiny_config(vocab_size=32))
  with pytest.raises(ValueError, match='target eos_id 1, draft eos_id 2'):
    models.EncoderDecoderModel(CFG, draft_cfg, draft_eos_id=2)


def test_num_decodes_sorted_ascending():
  enc = ragged_tokens(jax.random.PRNGKey(4), 2, 9, CFG.vocab_size)

  @jax.jit
  def run(enc):
    cache, t2l = start_decoding(*TARGET, enc, MAX_LEN)
    draft_cache, d2l = start_decoding(*DRAFTS['noisy'], enc, MAX_LEN)
    inputs = jnp.zeros((2, MAX_LEN), jnp.int32)
    return decoding.speculative_sample(inputs, cache, t2l, draft_cache, d2l, NO_EOS,
                                       num_decodes=5, decode_rng=jax.random.PRNGKey(1))

  decodes, scores = run(enc)
  assert decodes.shape == (2, 5, MAX_LEN) and scores.shape == (2, 5)
  assert (np.diff(np.asarray(scores), axis=1) >= 0).all()
  assert len({tuple(r) for r in np.asarray(decodes[0])}) > 1  # independent samples
