"""Decoding loops: T5X's temperature sampling, exact speculative sampling and the Big Little Decoder.

All three are one loop, `_draft_verify_loop`, a `lax.while_loop` whose iteration is

  1. draft:  the small model proposes up to `gamma` tokens per row, one call per token, stopping a
             row early at its adaptive length, at EOS, or when its top probability is below a
             confidence threshold (an inner `lax.while_loop`);
  2. verify: the target scores the row's last token and all proposals in one call, at the row's
             own cache position;
  3. accept: a `VerifyRule` decides, left to right, which proposals stand; one more token is
             drawn from the rule's correction distribution at the first rejection (or after the
             last proposal: the bonus token);
  4. commit: the accepted tokens and the extra one are written, EOS and length limits applied
             per row, statistics counted.

With `gamma = 0` there is no draft and step 3 draws from the target alone: T5X's temperature
sampling. The speculative rule (Leviathan et al. 2023) accepts x with probability
min(1, p(x)/q(x)) and corrects from norm(max(0, p - q)), which makes the output distribution the
target's. The BiLD rule (Kim et al. 2023) accepts while the target's cross-entropy of the small
model's token stays under a threshold and corrects from the target's own distribution.

Rows never wait for each other: each has its own length, and every model call receives each row's
position (`DecodingState.cur_index`). A row is rolled back simply by giving it an earlier position
on the next call: the caches never read entries at or after a row's position, and overwrite them
(see `network.DecoderCache`). Finished rows keep riding along in the fixed-shape batch but their
state no longer changes.

Greedy decoding (temperature <= MIN_TEMPERATURE) is the same rule on one-hot distributions:
p(x)/q(x) is 1 when the draft's argmax equals the target's and 0 otherwise, and the residual is the
target's argmax, so greedy speculative output is the target's greedy output token for token. The
loop runs it as its own branch (`_verify_greedy`, `VerifyRule.greedy_accept`): argmaxes compared,
no distributions over the vocabulary built, no random numbers drawn. That branch is chosen at
trace time, for a temperature given as a Python number; a temperature given as an array (a traced
scalar, or one per row) runs the sampled branch, where a row at temperature 0 has one-hot
distributions and so decodes greedily too, and changing the value needs no recompilation.

Sequence layout, as in T5X: `sequences[:, 0]` is the BOS slot (token 0) and `sequences[:, j]` is
output token j-1; `inputs[:, j] != 0` forces (teacher-forces) output token j-1, a prompt. A
prompt already in the caches (T5X's `initial_index`) starts its row at a later position instead.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional, Tuple, Union

import flax
import jax
import jax.numpy as jnp
import numpy as np

Array = jnp.ndarray
PyTree = Any

MIN_TEMPERATURE = 1e-4
# How speculative sampling judges a draft (`speculative_sample`'s `verification`); 'auto' picks
# one of them per compiled loop (`resolve_verification`).
VERIFICATIONS = ('token', 'block')
AUTO_VERIFICATION = 'auto'
VERIFICATION_CHOICES = VERIFICATIONS + (AUTO_VERIFICATION,)  # what `verification` accepts
# 'auto' verifies blocks from this gamma on when sampling. Block verification never keeps fewer
# tokens per call in expectation (Sun et al. 2025) and keeps the same at gamma 1; its verdict
# reads every position's residual, which cost at most 0.7% of a target call at batch 1-32 on
# the project's CPU, against +0.6 / 2.2 / 2.9 / 6.3% tokens per call at gamma 2-5, T=1
# (a recorded study of the verdict's cost, in git history).
BLOCK_FROM_GAMMA = 2
# What temperature_sample, speculative_sample and trees.tree_speculative_sample take alike: a
# job that switches among them (a gamma or tree per batch size) keeps these and so samples the
# same distribution.
SAMPLING_ARGUMENTS = ('temperature', 'topk', 'topp', 'rescale_log_probs', 'max_decode_steps')
# Logit given to masked tokens (T5X's value): finite, so no inf - inf in the arithmetic.
NEG_INF = -1e7


@flax.struct.dataclass
class DecodingState:
  """The argument of `tokens_to_logits`, field for field T5X's `decoding.DecodingState`.

  cur_index: [batch] int32, the position of `cur_token[:, 0]` in each row.
  sequences: [batch, length] int32, the tokens so far (position 0 is the BOS slot).
  cur_token: [batch, k] int32, the tokens to feed at positions cur_index + 0..k-1 (k = 1 in T5X).
  cache:     the model's cache (a `network.DecoderCache`, or T5X's flax 'cache' collection).
  logits_at: optional [batch] int32 (not in T5X): only token logits_at[b]'s logits are needed,
             so a tokens_to_logits may return [batch, 1, vocab]; one that ignores it returns all.
  features:  optional (not in T5X), a feature draft's input: the target's hidden states it
             reads [batch, max_length, width] (`network.DecoderCache.features`), each token reading
             the row of its position - 1.
  """
  cur_index: Array
  sequences: Array
  cur_token: Array
  cache: Any
  logits_at: Any = None
  features: Any = None


@flax.struct.dataclass
class TreeDecodingState(DecodingState):
  """A `DecodingState` whose tokens are nodes of a token tree (`network.Decoder.tree_step`).

  The tree's nodes sit at cache slots cur_index[b] + 0..nodes-1 (the root at cur_index); cur_token
  [batch, k] are its last k nodes (the others were fed earlier). Each node is positioned at
  cur_index + its depth and attends to the cache below cur_index and to its own ancestors:

  tree_depths: [nodes] int32, each node's depth (root 0).
  tree_mask:   [k, nodes] bool, tree_mask[i, m]: node m is node (nodes - k + i) or an ancestor.

  A tokens_to_logits that supports trees (`models.make_tokens_to_logits`) returns every node's
  next-token logits [batch, k, vocab] and a cache whose index has not moved.
  """
  tree_depths: Any = None
  tree_mask: Any = None


# tokens_to_logits(DecodingState) -> (logits [batch, k, vocab] (or [batch, vocab] when k == 1,
# as T5X returns), new_cache). A callable over a `DecoderCache` writes at `cur_index`, which is
# how the loop moves rows back. T5X's own callables (cache index inside the cache) work with the
# target-only loop, which feeds one token per row per call.
TokensToLogits = Callable[[DecodingState], Tuple[Array, Any]]


@flax.struct.dataclass
class DecodeStats:
  """Per-row counters of one decode (every field [batch], `accepted_at` [batch, max(gamma, 1)]).

  target_calls: verify (or plain decode) calls of the target that advanced this row.
  draft_calls:  draft model calls made while this row was drafting.
  proposed / accepted: draft tokens proposed to / accepted by the target.
  accepted_at:  how often draft position i was accepted.
  emitted:      output tokens produced (forced prompt tokens included; after-EOS padding and a
                prompt prefilled in the caches (initial_index) not).
  fallbacks:    BiLD: drafting stopped because the small model was not confident.
  rollbacks:    a proposal was rejected (BiLD's rollback, speculative's rejection).
  """
  target_calls: Array
  draft_calls: Array
  proposed: Array
  accepted: Array
  accepted_at: Array
  emitted: Array
  fallbacks: Array
  rollbacks: Array

  @classmethod
  def zeros(cls, batch: int, gamma: int) -> 'DecodeStats':
    z = jnp.zeros((batch,), jnp.int32)
    return cls(z, z, z, z, jnp.zeros((batch, max(gamma, 1)), jnp.int32), z, z, z)

  @property
  def acceptance_rate(self) -> Array:
    """alpha: accepted / proposed draft tokens, [batch]."""
    return self.accepted / jnp.maximum(self.proposed, 1)

  @property
  def tokens_per_target_call(self) -> Array:
    """Output tokens per target call, [batch] (1 for target-only decoding)."""
    return self.emitted / jnp.maximum(self.target_calls, 1)

  @property
  def accepted_per_target_call(self) -> Array:
    """Mean accepted draft tokens per target call, [batch]."""
    return self.accepted / jnp.maximum(self.target_calls, 1)


# ------------------------------------------------------------------------------------------------
# Distributions: the same processing for target and draft keeps speculative sampling exact.


# A temperature is either static, a Python number (compiled in; 0.0 selects the greedy branch),
# or an operand: a traced or concrete jax/numpy array, a scalar or one value per row ([batch]).
Temperature = Union[float, Array]


def is_static(value: Union[float, Array]) -> bool:
  """True for a Python (or numpy scalar) number, which the loops specialise on at trace time;
  False for an operand (a jax/numpy array, traced or not). For temperature and topp."""
  return isinstance(value, (int, float, np.number)) and not isinstance(value, bool)


def _per_row(values: Array, ndim: int) -> Array:
  """A scalar or [batch] operand shaped to broadcast against [batch, ...] of rank ndim."""
  values = jnp.asarray(values, jnp.float32)
  return values.reshape(values.shape + (1,) * (ndim - values.ndim))


def _mask_top(scaled: Array, topk: int, topp: Union[float, Array]) -> Array:
  """T5X's top-k or top-p mask on scaled logits [..., vocab] (masked entries set to NEG_INF).

  `topk` is a Python int (lax.top_k needs a static k); `topp` a Python number or a traced
  scalar (then the mask applies where topp > 0, with no recompilation when it changes).
  """
  if topk:
    kth = jax.lax.top_k(scaled, topk)[0][..., -1:]
    scaled = jnp.where(scaled < kth, NEG_INF, scaled)
  static_topp = is_static(topp)
  if not static_topp or topp:
    # Keep the most probable tokens until their mass reaches topp (the crossing token included).
    desc = -jnp.sort(-scaled, axis=-1)
    probs = jax.nn.softmax(desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    num_kept = jnp.sum(mass_before < topp, axis=-1, keepdims=True)
    threshold = jnp.take_along_axis(desc, jnp.maximum(num_kept - 1, 0), axis=-1)
    masked = jnp.where(scaled < threshold, NEG_INF, scaled)
    scaled = masked if static_topp else jnp.where(topp > 0, masked, scaled)
  return scaled


def sampling_logits(logits: Array, temperature: Temperature = 1.0, topk: int = 0,
                    topp: float = 0.0) -> Array:
  """Unnormalised log-weights of the distribution a token is drawn from, [batch, ..., vocab].

  As T5X's temperature_sample: logits / temperature, then a top-k or top-p mask; where the
  temperature is <= MIN_TEMPERATURE, the one-hot (0 / NEG_INF) of the argmax, top-k/top-p
  ignored. `temperature` is a Python number, a traced scalar, or a [batch] array applied to the
  leading axis of `logits` (each row its own temperature; rows at 0 are greedy).
  """
  logits = logits.astype(jnp.float32)
  if topk and is_static(topp) and topp:
    raise ValueError(f'At most one of topk ({topk}) and topp ({topp}) may be non-zero.')
  if is_static(temperature):
    if temperature <= MIN_TEMPERATURE:
      return _one_hot_log_probs(argmax(logits), logits.shape[-1])
    return _mask_top(logits / temperature, topk, topp)
  t = _per_row(temperature, logits.ndim)
  # The division by max(t, MIN) only keeps greedy rows finite; `where` discards them.
  scaled = _mask_top(logits / jnp.maximum(t, MIN_TEMPERATURE), topk, topp)
  return jnp.where(t > MIN_TEMPERATURE, scaled,
                   _one_hot_log_probs(argmax(logits), logits.shape[-1]))


def sampling_log_probs(logits: Array, temperature: Temperature = 1.0, topk: int = 0,
                       topp: float = 0.0) -> Array:
  """Log-probabilities of the distribution a token is sampled from, [batch, ..., vocab] float32.

  `sampling_logits`, normalised. A static temperature <= MIN_TEMPERATURE gives the one-hot of
  the argmax directly.
  """
  weights = sampling_logits(logits, temperature, topk, topp)
  if is_static(temperature) and temperature <= MIN_TEMPERATURE:
    return weights
  return jax.nn.log_softmax(weights, axis=-1)


def _one_hot_log_probs(tokens: Array, vocab_size: int) -> Array:
  return jnp.where(jax.nn.one_hot(tokens, vocab_size, dtype=jnp.bool_), 0.0, NEG_INF)


def _force(log_probs: Array, forced: Array) -> Array:
  """Replaces distributions by the one-hot of the prompt token where `forced` [...] is non-zero."""
  return jnp.where((forced > 0)[..., None], _one_hot_log_probs(forced, log_probs.shape[-1]),
                   log_probs)


def categorical(rng: Array, logits: Array, noise_period: int = 0) -> Array:
  """`jax.random.categorical(rng, logits, axis=-1)`, draw for draw: [..., vocab] -> [...] int32.

  The same Gumbel noise and maximum, taken with `argmax`: XLA:CPU's variadic argmax was most of
  the cost of a draw over the vocabulary (measured: 3.1 ms -> 0.9 ms for [8, 8064]).
  noise_period > 0 (logits [rows, vocab]): noise is drawn for that many rows only and row r uses
  noise row r % noise_period. With 1 this is T5X's draw for a per-row temperature array, which
  vmaps `categorical` over rows with one key, so all rows share one noise vector per step.
  """
  if not noise_period:
    return argmax(jax.random.gumbel(rng, logits.shape, logits.dtype) + logits)
  rows, vocab = logits.shape
  noise = jax.random.gumbel(rng, (noise_period, vocab), logits.dtype)
  return argmax(jnp.tile(noise, (rows // noise_period, 1)) + logits)


def _sample(rng: Array, weights: Array) -> Array:
  """Draws from unnormalised non-negative weights [..., vocab] -> [...] int32."""
  return categorical(rng, jnp.log(weights))


# ------------------------------------------------------------------------------------------------
# Verification rules.


class VerifyRule(NamedTuple):
  """How the target judges draft tokens.

  accept_prob(p, q, p_raw, x) -> [...] probability of accepting draft token x [...], given the
    target's and the draft's sampling distributions p, q [..., vocab] at x's position and the
    target's plain softmax p_raw (temperature 1, no masks).
  correction(p, q) -> [..., vocab] unnormalised distribution of the token emitted at the first
    rejection; after the last proposal (the bonus token) it is called with q = 0.
  greedy_accept(logits, target_argmax, x) -> [...] bool, the same decision at temperature 0
    from the target's raw logits [..., vocab] and argmax [...], without building distributions;
    the correction is then always the target's argmax. None: greedy decoding takes the general
    path on one-hot distributions.
  """
  accept_prob: Callable[[Array, Array, Array, Array], Array]
  correction: Callable[[Array, Array], Array]
  greedy_accept: Optional[Callable[[Array, Array, Array], Array]] = None


def _at(dist: Array, tokens: Array) -> Array:
  return jnp.take_along_axis(dist, tokens[..., None], axis=-1)[..., 0]


def argmax(logits: Array) -> Array:
  """First index of the maximum over the last axis, [...] int32 (= jnp.argmax on finite input).

  Two plain reductions instead of XLA's variadic (value, index) reduce, which XLA:CPU runs about
  twice as slowly over a vocabulary.
  """
  vocab = logits.shape[-1]
  is_max = logits == jnp.max(logits, axis=-1, keepdims=True)
  index = jnp.min(jnp.where(is_max, jax.lax.broadcasted_iota(jnp.int32, logits.shape,
                                                             logits.ndim - 1), vocab), axis=-1)
  return jnp.minimum(index, vocab - 1)  # all-NaN rows


def _raw_log_prob(logits: Array, tokens: Array) -> Array:
  """log softmax(logits)[tokens] without materialising the distribution: [...] float32."""
  return _at(logits, tokens) - jax.nn.logsumexp(logits, axis=-1)


def speculative_rule(lenience: float = 1.0, greedy: bool = False) -> VerifyRule:
  """Leviathan et al.'s rule: accept with min(1, p(x) / (l q(x))), correct from max(0, p - q).

  l = 1 is exact. l < 1 (the paper's Appendix A.5) accepts more and changes the output
  distribution: in sampling it accepts when l q(x) <= p(x); at temperature 0 it accepts x when
  p(x) >= l max p (p the target's plain softmax).
  """
  if not 0.0 < lenience <= 1.0:
    raise ValueError(f'lenience must be in (0, 1], got {lenience}.')

  def accept_prob(p, q, p_raw, x):
    if greedy and lenience < 1.0:
      return (_at(p_raw, x) >= lenience * jnp.max(p_raw, axis=-1)).astype(jnp.float32)
    q_x = _at(q, x)
    return jnp.minimum(1.0, _at(p, x) / jnp.maximum(lenience * q_x, 1e-30))

  def greedy_accept(logits, target_argmax, x):
    if lenience == 1.0:
      return x == target_argmax
    # p(x) >= l max p  <=>  logit(x) - max logit >= log l: no normaliser needed.
    return _at(logits, x) - jnp.max(logits, axis=-1) >= np.log(lenience)

  return VerifyRule(accept_prob, lambda p, q: jnp.maximum(p - q, 0.0), greedy_accept)


def bild_rule(rollback_threshold: float = 5.0) -> VerifyRule:
  """BiLD's rollback: keep the small model's token while -log p_large(x) <= threshold.

  A token that is the large model's own argmax is always kept (BiLD skips such rollbacks). The
  replacement comes from the large model's own distribution (its argmax when greedy).
  """
  min_prob = float(np.exp(-rollback_threshold))

  def accept_prob(p, q, p_raw, x):
    del p, q
    agrees = x == argmax(p_raw)
    return ((_at(p_raw, x) >= min_prob) | agrees).astype(jnp.float32)

  def greedy_accept(logits, target_argmax, x):
    return (jnp.exp(_raw_log_prob(logits, x)) >= min_prob) | (x == target_argmax)

  return VerifyRule(accept_prob, lambda p, q: p, greedy_accept)


# ------------------------------------------------------------------------------------------------
# The loop.


@flax.struct.dataclass
class LoopState:
  """State of `_draft_verify_loop`.

  sequences: [batch, L + gamma + 2] int32, BOS slot then output tokens (room for one overshoot).
  length:    [batch] int32, output tokens committed; `sequences[:, length]` is the next to feed.
  ended:     [batch] bool.
  gamma:     [batch] int32, each row's current draft length (adaptive).
  log_prob:  [batch] float32, log-probability of the committed sampled tokens.
  """
  sequences: Array
  length: Array
  ended: Array
  target_cache: Any
  draft_cache: Any
  gamma: Array
  log_prob: Array
  rng: Array
  stats: DecodeStats


@flax.struct.dataclass
class Draft:
  """The draft phase's carry and result.

  tokens:       [batch, gamma] int32 proposals (garbage beyond num_proposed).
  probs:        [batch, gamma, vocab] the draft's sampling distribution q of each proposal, zero
                beyond num_proposed; None when greedy (q is then the one-hot of the token).
  num_proposed: [batch] int32.
  drafting:     [batch] bool, the row is still proposing.
  steps:        [batch] int32, draft calls made while the row was drafting.
  unconfident:  [batch] bool, drafting stopped below the confidence threshold.
  """
  tokens: Array
  probs: Optional[Array]
  num_proposed: Array
  drafting: Array
  steps: Array
  unconfident: Array


class Verdict(NamedTuple):
  """The target's judgement of one draft (every field per row).

  accepted_at:  [batch, max(gamma, 1)] int32, 1 where proposal i and all before it stand.
  num_accepted: [batch] int32.
  extra:        [batch] int32, the correction at the first rejection, or the bonus token.
  token_log_probs: [batch, gamma + 1] float32, log-probability (for the score) of the tokens the
                commit may emit: the accepted proposals, then the extra token.
  """
  accepted_at: Array
  num_accepted: Array
  extra: Array
  token_log_probs: Array


def _call(fn: TokensToLogits, tokens: Array, index: Array, cache: Any, sequences: Array,
          logits_at: Optional[Array] = None, features: Optional[Array] = None
          ) -> Tuple[Array, Any]:
  """fn on tokens [batch, k] at index [batch] -> (logits [batch, k, vocab] float32, cache);
  with logits_at [batch], the logits of token logits_at[b] only: [batch, 1, vocab]."""
  logits, new_cache = fn(DecodingState(cur_index=index, sequences=sequences, cur_token=tokens,
                                       cache=cache, logits_at=logits_at, features=features))
  cache = match_container(new_cache, cache)
  if logits.ndim == 2:
    logits = logits[:, None, :]
  if logits_at is not None and logits.shape[1] != 1:
    logits = jnp.take_along_axis(logits, logits_at[:, None, None], axis=1)
  return logits.astype(jnp.float32), cache


class _LoopConfig(NamedTuple):
  """The loop's settings. `temperature` is static (a Python number) or an operand: a traced
  scalar, or [rows] float32 with one value per (num_decodes-expanded) row. noise_period: see
  `categorical`; 0 (independent noise per row) except in T5X's per-row-temperature draw."""
  gamma: int
  rule: VerifyRule
  temperature: Temperature
  topk: int
  topp: float
  rescale_log_probs: bool
  confidence_threshold: float
  adaptive_gamma: bool
  eos_id: int
  noise_period: int = 0
  block: bool = False  # block verification (speculative rule, lenience 1) instead of per token
  unroll_draft: bool = False  # the draft's gamma calls as straight-line code, no inner loop

  @property
  def greedy(self) -> bool:
    """A static temperature 0 with a rule that decides from argmaxes: no distributions, no
    sampling. Operand temperatures take the sampled branch, whose zero rows are one-hot."""
    return (is_static(self.temperature) and self.temperature <= MIN_TEMPERATURE and
            self.rule.greedy_accept is not None)


def target_features(target_cache: Any) -> Optional[Array]:
  """The target's hidden states [batch, max_length, width] that a feature draft reads, or
  None: a cache that keeps them (`network.DecoderCache.features`, made for a feature draft)
  has them written by every target call, so they travel through every loop's state."""
  return getattr(target_cache, 'features', None)


def _draft_phase(cfg: _LoopConfig, state: LoopState, draft_fn: TokensToLogits, forced: Array,
                 limit: Array, rng: Array) -> Tuple[Draft, Any]:
  """Up to cfg.gamma autoregressive draft calls; rows stop individually, the loop when all have.

  Returns the draft and the draft model's new cache.
  """
  batch = state.length.shape[0]
  rows = jnp.arange(batch)

  def propose(i, logits, draft, rng):
    """Draft token i of every row from logits [batch, vocab]."""
    forced_i = forced[rows, state.length + 1 + i]
    probs = draft.probs
    if cfg.greedy:
      token = jnp.where(forced_i > 0, forced_i, argmax(logits))
    else:
      rng, sample_rng = jax.random.split(rng)
      log_q = _force(sampling_log_probs(logits, cfg.temperature, cfg.topk, cfg.topp), forced_i)
      token = categorical(sample_rng, log_q)
    keep = draft.drafting
    if cfg.confidence_threshold > 0:
      top_prob = jnp.exp(jnp.max(logits, axis=-1) - jax.nn.logsumexp(logits, axis=-1))
      keep &= (forced_i > 0) | (top_prob >= cfg.confidence_threshold)
    if probs is not None:
      q = jnp.where(keep[:, None], jnp.exp(log_q), 0.0)
      probs = jax.lax.dynamic_update_slice_in_dim(probs, q[:, None], i, axis=1)
    drafting = (keep & (i + 1 < state.gamma) & (state.length + i + 2 <= limit) &
                ((token != cfg.eos_id) | (forced_i > 0)))
    return Draft(tokens=jax.lax.dynamic_update_slice_in_dim(draft.tokens, token[:, None], i, 1),
                 probs=probs, num_proposed=draft.num_proposed + keep, drafting=drafting,
                 steps=draft.steps + draft.drafting,
                 unconfident=draft.unconfident | (draft.drafting & ~keep)), rng

  # The draft cache may lack the previous iteration's last accepted proposal (when all were
  # accepted), so the first call re-feeds the previous token as well: rewriting an existing
  # entry with the same token is a no-op. A feature draft (`target_features`) re-feeds every
  # position it drafted on its own features, up to gamma + 1 back, on the target's.
  features = target_features(state.target_cache)
  back = 1 if features is None else cfg.gamma
  start = jnp.maximum(state.length - back, 0)
  first_tokens = jnp.take_along_axis(state.sequences, start[:, None] + jnp.arange(back + 1)[None],
                                     axis=1)
  logits, cache = _call(draft_fn, first_tokens, start, state.draft_cache, state.sequences,
                        logits_at=state.length - start, features=features)
  zeros = jnp.zeros((batch,), jnp.int32)
  draft = Draft(
      tokens=jnp.zeros((batch, cfg.gamma), jnp.int32),
      probs=None if cfg.greedy else jnp.zeros((batch, cfg.gamma, logits.shape[-1]), jnp.float32),
      num_proposed=zeros, drafting=~state.ended & (state.gamma > 0) & (state.length < limit),
      steps=zeros, unconfident=jnp.zeros((batch,), jnp.bool_))
  draft, rng = propose(0, logits[:, 0], draft, rng)

  def cond(loop):
    i, _, draft, _ = loop
    return (i < cfg.gamma) & jnp.any(draft.drafting)

  def body(loop):
    i, cache, draft, rng = loop
    previous = jax.lax.dynamic_slice_in_dim(draft.tokens, i - 1, 1, axis=1)
    logits, cache = _call(draft_fn, previous, state.length + i, cache, state.sequences)
    draft, rng = propose(i, logits[:, 0], draft, rng)
    return i + 1, cache, draft, rng

  loop = (jnp.array(1), cache, draft, rng)
  if cfg.unroll_draft:
    # Every call runs: a row that stopped proposes nothing more (`drafting` masks it) and its
    # cache entries past the proposals are overwritten before they are read.
    for _ in range(1, cfg.gamma):
      loop = body(loop)
  else:
    loop = jax.lax.while_loop(cond, body, loop)
  _, cache, draft, _ = loop
  return draft, cache


def _verify_greedy(cfg: _LoopConfig, logits: Array, forced_chunk: Array, draft: Optional[Draft]
                   ) -> Verdict:
  """Temperature-0 verification from argmaxes: logits [batch, gamma + 1, vocab].

  Equal, decision for decision, to the general path on one-hot distributions: a proposal stands
  when the rule accepts it (or it is a forced prompt token), and the token after the accepted
  ones is the target's argmax (the residual of two different one-hots is the target's one).
  """
  batch, k, _ = logits.shape
  rows = jnp.arange(batch)
  target_tokens = jnp.where(forced_chunk > 0, forced_chunk, argmax(logits))  # [batch, k]
  if draft is None:
    accepted_at = jnp.zeros((batch, 1), jnp.int32)
    num_accepted = jnp.zeros((batch,), jnp.int32)
  else:
    accept = jnp.where(forced_chunk[:, :-1] > 0, draft.tokens == forced_chunk[:, :-1],
                       cfg.rule.greedy_accept(logits[:, :-1], target_tokens[:, :-1],
                                              draft.tokens))
    in_proposal = jnp.arange(k - 1)[None] < draft.num_proposed[:, None]
    accepted_at = jnp.cumprod((accept & in_proposal).astype(jnp.int32), axis=1)
    num_accepted = jnp.sum(accepted_at, axis=1)
  extra = target_tokens[rows, num_accepted]
  if cfg.rescale_log_probs:
    # The one-hot sampling distribution gives every emitted token log-probability 0.
    token_log_probs = jnp.zeros((batch, k), jnp.float32)
  else:
    emitted = target_tokens if draft is None else jnp.concatenate(
        [draft.tokens, jnp.zeros((batch, 1), jnp.int32)], axis=1)
    emitted = jnp.where(jnp.arange(k)[None] == num_accepted[:, None], extra[:, None], emitted)
    token_log_probs = _raw_log_prob(logits, emitted)
  return Verdict(accepted_at, num_accepted, extra, token_log_probs)


def _verify_sampled(cfg: _LoopConfig, logits: Array, forced_chunk: Array, draft: Optional[Draft],
                    accept_rng: Array, extra_rng: Array) -> Verdict:
  """The rule's acceptance test and correction on distributions: logits [batch, gamma + 1, vocab]."""
  batch, k, _ = logits.shape
  rows = jnp.arange(batch)
  weights_p = _force(sampling_logits(logits, cfg.temperature, cfg.topk, cfg.topp), forced_chunk)
  log_p = jax.nn.log_softmax(weights_p, axis=-1)
  log_probs = log_p if cfg.rescale_log_probs else jax.nn.log_softmax(logits)
  if draft is None:
    # Target alone: the correction after no proposal is p itself, drawn as T5X draws it (from
    # the scaled logits, with T5X's noise layout) so that a given key gives T5X's tokens.
    extra = categorical(extra_rng, weights_p[:, 0], cfg.noise_period)
    return Verdict(jnp.zeros((batch, 1), jnp.int32), jnp.zeros((batch,), jnp.int32), extra,
                   _at(log_probs, extra[:, None]))
  p = jnp.exp(log_p)
  gamma = k - 1
  if cfg.block:
    num_accepted, weights = _block_verdict(p, draft, jax.random.uniform(accept_rng, (batch, k)))
    p_next = p[rows, num_accepted]
  else:
    p_raw = jnp.exp(_force(jax.nn.log_softmax(logits), forced_chunk))
    in_proposal = jnp.arange(gamma)[None] < draft.num_proposed[:, None]
    accept = cfg.rule.accept_prob(p[:, :gamma], draft.probs, p_raw[:, :gamma], draft.tokens)
    uniform = jax.random.uniform(accept_rng, (batch, gamma))
    num_accepted = jnp.sum(
        jnp.cumprod(((uniform < accept) & in_proposal).astype(jnp.int32), axis=1), axis=1)
    q_next = jnp.where((num_accepted < draft.num_proposed)[:, None],
                       draft.probs[rows, jnp.minimum(num_accepted, gamma - 1)], 0.0)
    p_next = p[rows, num_accepted]
    weights = cfg.rule.correction(p_next, q_next)
  accepted_at = (jnp.arange(gamma)[None] < num_accepted[:, None]).astype(jnp.int32)
  emitted = jnp.concatenate([draft.tokens, jnp.zeros((batch, 1), jnp.int32)], axis=1)
  # p == q exactly leaves no residual but then nothing can be rejected; guard the 0/0 anyway.
  weights = jnp.where(jnp.sum(weights, axis=-1, keepdims=True) > 0, weights, p_next)
  extra = _sample(extra_rng, weights)
  emitted = jnp.where(jnp.arange(k)[None] == num_accepted[:, None], extra[:, None], emitted)
  return Verdict(accepted_at, num_accepted, extra, _at(log_probs, emitted))


def _running_weights(ratio: Array) -> Array:
  """w_0 = 1, w_i = min(1, w_{i-1} ratio_i): [batch, gamma] -> [batch, gamma + 1]."""
  weights = [jnp.ones(ratio.shape[:1], jnp.float32)]
  for i in range(ratio.shape[1]):  # gamma is static and small: the clipped product, unrolled
    weights.append(jnp.minimum(1.0, weights[-1] * ratio[:, i]))
  return jnp.stack(weights, axis=1)


def _stop_probability(residual_mass: Array, weight: Array) -> Array:
  """h = r / (r + 1 - w); 0 where r = 0 and w = 1 (p = q there: stopping has nothing to emit)."""
  denominator = residual_mass + 1.0 - weight
  safe = jnp.where(denominator > 0, denominator, 1.0)
  return jnp.where(denominator > 0, residual_mass / safe, 0.0)


def block_stops(p: Array, q: Array, tokens: Array, num_proposed: Array) -> Tuple[Array, Array]:
  """Block verification's stop probabilities and residuals (Sun et al., ICLR 2025).

  p [batch, gamma + 1, vocab]: the target's sampling distributions after 0..gamma draft tokens;
  q [batch, gamma, vocab]: the draft's, tokens [batch, gamma] its proposals x_1..x_gamma, of
  which the first num_proposed [batch] count (n). From the running weight w_0 = 1,
  w_i = min(1, w_{i-1} p_i(x_i) / q_i(x_i)) and the residual after i tokens,
  max(w_i p_{i+1} - q_{i+1}, 0) (q_{n+1} = 0, so its mass r_n is w_n), the stop probability is
  h_i = r_i / (r_i + 1 - w_i) for 0 < i <= n, h_0 = 1, 0 beyond n.
  Returns (h [batch, gamma + 1], residual [batch, gamma + 1, vocab], unnormalised).
  """
  k = p.shape[1]
  q = jnp.concatenate([q, jnp.zeros_like(p[:, :1])], axis=1)
  position = jnp.arange(k)[None]
  q = jnp.where((position < num_proposed[:, None])[..., None], q, 0.0)
  ratio = _at(p[:, :-1], tokens) / jnp.maximum(_at(q[:, :-1], tokens), 1e-30)
  w = _running_weights(ratio)
  residual = jnp.maximum(w[..., None] * p - q, 0.0)
  h = _stop_probability(jnp.sum(residual, axis=-1), w)
  h = jnp.where(position == 0, 1.0, jnp.where(position <= num_proposed[:, None], h, 0.0))
  return h, residual


def _block_verdict(p: Array, draft: Draft, uniform: Array) -> Tuple[Array, Array]:
  """Block verification: (num_accepted [batch], correction weights [batch, vocab]).

  The row keeps x_1..x_tau, tau = max{i : u_i <= h_i} (`block_stops`; uniform [batch,
  gamma + 1]), and emits a token from its residual max(w_tau p_{tau+1} - q_{tau+1}, 0): a late
  high ratio can rescue an early low one, and the output is the target's distribution. With
  one-hot (greedy) p and q, w_i is 1 up to the first mismatch and 0 after: the greedy rule.
  A row that stopped drafting early (n < gamma) is judged as the block of a draft that proposes
  from p itself after its stop (ratios 1, no residual there): the same verdict, so the stop,
  which depends on the proposals only, keeps the guarantee.
  """
  h, residual = block_stops(p, draft.probs, draft.tokens, draft.num_proposed)
  position = jnp.arange(h.shape[1])[None]
  num_accepted = jnp.max(jnp.where(uniform <= h, position, 0), axis=1)
  return num_accepted, residual[jnp.arange(h.shape[0]), num_accepted]


def _commit(cfg: _LoopConfig, state: LoopState, verdict: Verdict, proposals: Array,
            forced_chunk: Array, limit: Array) -> Tuple[Array, Array, Array, Array, Array]:
  """Writes the accepted proposals and the extra token, cut at a sampled EOS and the row limit.

  Returns (sequences, new length, ended, count [batch] tokens written, log-prob increment).
  """
  batch = state.length.shape[0]
  rows = jnp.arange(batch)
  offsets = jnp.arange(forced_chunk.shape[1])
  length, num_accepted = state.length, verdict.num_accepted
  padded = jnp.concatenate([proposals, jnp.zeros((batch, 1), jnp.int32)], axis=1)
  emitted = jnp.where(offsets < num_accepted[:, None], padded,
                      jnp.where(offsets == num_accepted[:, None], verdict.extra[:, None], 0))
  count = num_accepted + 1
  is_eos = (emitted == cfg.eos_id) & (forced_chunk == 0) & (offsets < count[:, None])
  hit_eos = jnp.any(is_eos, axis=1)
  count = jnp.where(hit_eos, jnp.argmax(is_eos, axis=1) + 1, count)
  active = ~state.ended
  count = jnp.where(active, jnp.minimum(count, limit - length), 0)
  valid = offsets < count[:, None]
  sequences = state.sequences.at[rows[:, None], length[:, None] + 1 + offsets].set(
      jnp.where(valid, emitted, 0), mode='drop')
  log_prob = jnp.sum(jnp.where(valid & (forced_chunk == 0), verdict.token_log_probs, 0.0), axis=1)
  new_length = length + count
  ended = state.ended | (active & hit_eos) | (new_length >= limit)
  return sequences, new_length, ended, count, log_prob


def _count(stats: DecodeStats, active: Array, draft: Optional[Draft], verdict: Verdict,
           count: Array) -> DecodeStats:
  """Adds one iteration to the per-row statistics (rows that were already done add nothing)."""
  on = active.astype(jnp.int32)
  if draft is None:
    return stats.replace(target_calls=stats.target_calls + on, emitted=stats.emitted + count)
  rejected = verdict.num_accepted < draft.num_proposed
  return DecodeStats(
      target_calls=stats.target_calls + on,
      draft_calls=stats.draft_calls + draft.steps * on,
      proposed=stats.proposed + draft.num_proposed * on,
      accepted=stats.accepted + verdict.num_accepted * on,
      accepted_at=stats.accepted_at + verdict.accepted_at * on[:, None],
      emitted=stats.emitted + count,
      fallbacks=stats.fallbacks + (draft.unconfident & active),
      rollbacks=stats.rollbacks + (rejected & active))


def _iteration(cfg: _LoopConfig, target_fn: TokensToLogits, draft_fn: Optional[TokensToLogits],
               forced: Array, limit: Array, state: LoopState) -> LoopState:
  """One draft-verify iteration: draft up to cfg.gamma tokens, verify them in one target call,
  commit. forced [batch, L + gamma + 2] and limit [batch] are `start_loop`'s."""
  batch = state.length.shape[0]
  rows = jnp.arange(batch)
  gamma = cfg.gamma
  offsets = jnp.arange(gamma + 1)
  rng = state.rng
  draft_rng = accept_rng = extra_rng = None
  if not cfg.greedy and gamma:
    rng, draft_rng, accept_rng, extra_rng = jax.random.split(rng, 4)
  elif not cfg.greedy:
    # T5X's key stream: one split a step, the first key draws, the second is carried.
    extra_rng, rng = jax.random.split(rng)
  draft, draft_cache = None, state.draft_cache
  proposals = jnp.zeros((batch, 0), jnp.int32)
  if gamma:
    draft, draft_cache = _draft_phase(cfg, state, draft_fn, forced, limit,
                                      None if cfg.greedy else draft_rng)
    proposals = draft.tokens

  # Verify: the row's last token and its proposals, in one call at the row's position.
  chunk = jnp.concatenate([state.sequences[rows, state.length][:, None], proposals], axis=1)
  logits, target_cache = _call(target_fn, chunk, state.length, state.target_cache,
                               state.sequences)
  forced_chunk = forced[rows[:, None], state.length[:, None] + 1 + offsets]  # [batch, gamma + 1]
  if cfg.greedy:
    verdict = _verify_greedy(cfg, logits, forced_chunk, draft)
  else:
    verdict = _verify_sampled(cfg, logits, forced_chunk, draft, accept_rng, extra_rng)

  sequences, length, ended, count, log_prob = _commit(cfg, state, verdict, proposals,
                                                      forced_chunk, limit)
  new_gamma = state.gamma
  if cfg.adaptive_gamma:
    # HF's heuristic: lengthen after a fully accepted draft, shorten after a rejection.
    rejected = verdict.num_accepted < draft.num_proposed
    new_gamma = jnp.where(rejected, jnp.maximum(state.gamma - 1, 1),
                          jnp.minimum(state.gamma + 2, gamma))
    new_gamma = jnp.where(state.ended, state.gamma, new_gamma)
  return LoopState(sequences=sequences, length=length, ended=ended, target_cache=target_cache,
                   draft_cache=draft_cache, gamma=new_gamma,
                   log_prob=state.log_prob + log_prob, rng=rng,
                   stats=_count(state.stats, ~state.ended, draft, verdict, count))


def _draft_verify_loop(cfg: _LoopConfig, inputs: Array, target_cache: Any,
                       target_fn: TokensToLogits, draft_cache: Any,
                       draft_fn: Optional[TokensToLogits], rng: Array,
                       max_decode_steps: Optional[Union[int, Array]],
                       initial_index: Optional[Array] = None
                       ) -> Tuple[Array, Array, DecodeStats]:
  """Runs the decode; returns (decodes [batch, L], log_prob [batch], stats). See module doc.

  initial_index: optional [batch] int32, rows whose caches (target and draft) already hold
  positions 0..initial_index - 1; such a row starts by feeding inputs[:, initial_index] there.
  """
  max_len = inputs.shape[1]
  init, forced, limit = start_loop(inputs, target_cache, draft_cache, rng, cfg.gamma,
                                   max_decode_steps, initial_index)
  body = functools.partial(_iteration, cfg, target_fn, draft_fn, forced, limit)
  final = jax.lax.while_loop(lambda s: ~jnp.all(s.ended), body, init)
  return final.sequences[:, 1:max_len + 1], final.log_prob, final.stats


def start_loop(inputs: Array, target_cache: Any, draft_cache: Any, rng: Array, gamma: int,
               max_decode_steps: Optional[Union[int, Array]],
               initial_index: Optional[Array]) -> Tuple[LoopState, Array, Array]:
  """A draft-verify loop's first state, forced tokens [batch, L + gamma + 2] and row limits.

  gamma: the most tokens a call proposes (a tree's depth); the sequences have room for them.
  """
  batch, max_len = inputs.shape
  seq_len = max_len + gamma + 2
  forced = jnp.zeros((batch, seq_len), jnp.int32).at[:, 1:max_len].set(inputs[:, 1:])
  limit = jnp.full((batch,), max_len, jnp.int32)
  if max_decode_steps is not None:
    limit = jnp.minimum(limit, jnp.sum(inputs != 0, axis=1) + max_decode_steps)
  sequences = jnp.zeros((batch, seq_len), jnp.int32)
  length = jnp.zeros((batch,), jnp.int32)
  if initial_index is not None:
    # A prefilled row resumes as if it had committed its prompt up to initial_index: the next
    # call feeds sequences[:, initial_index] at that position.
    length = jnp.asarray(initial_index, jnp.int32)
    in_cache = jnp.arange(max_len)[None] <= length[:, None]
    sequences = sequences.at[:, :max_len].set(jnp.where(in_cache, inputs, 0))
  init = LoopState(
      sequences=sequences, length=length,
      ended=length >= limit, target_cache=target_cache, draft_cache=draft_cache,
      gamma=jnp.full((batch,), gamma, jnp.int32), log_prob=jnp.zeros((batch,), jnp.float32),
      rng=rng, stats=DecodeStats.zeros(batch, gamma))
  return init, forced, limit


# ------------------------------------------------------------------------------------------------
# Batch expansion for num_decodes, and the public decoders.

# Leaves of a T5X flax cache that have no batch axis: the shared relative-position bias and the
# absolute position embedder's scalar index. T5X's `cache_map` leaves them alone, so do we.
_LEAVES_WITHOUT_BATCH = ('cached_bias', 'position_embedder_index')
# T5X's per-layer decode position: a scalar (shared by the batch) unless the cache was
# prefilled, when it is a [batch] vector that must be expanded like the other leaves.
_CACHE_INDEX_LEAF = 'cache_index'


def _leaf_name(path: Tuple[Any, ...]) -> Optional[str]:
  """The last dict key or attribute name on a pytree path (None for a sequence index)."""
  if not path:
    return None
  key = path[-1]
  if isinstance(key, jax.tree_util.DictKey):
    return str(key.key)
  if isinstance(key, jax.tree_util.GetAttrKey):
    return key.name
  return None


def cache_map(fn: Callable[[Array], Array], cache: PyTree, batch_axis: int = 0,
              apply_to_index: bool = False) -> PyTree:
  """Applies `fn` to every cache leaf that has a batch axis; other leaves pass through.

  Skipped, as in T5X's `cache_map`: leaves named 'cached_bias' or 'position_embedder_index',
  leaves named 'cache_index' unless `apply_to_index`, and leaves with no axis `batch_axis`
  (scalars). Works on any pytree (a `DecoderCache`, a dict or FrozenDict).
  """

  def maybe_apply(path, x):
    name = _leaf_name(path)
    if name in _LEAVES_WITHOUT_BATCH or (name == _CACHE_INDEX_LEAF and not apply_to_index):
      return x
    if jnp.ndim(x) <= batch_axis:
      return x
    return fn(x)

  return jax.tree_util.tree_map_with_path(maybe_apply, cache)


def match_container(new_cache: PyTree, like: PyTree) -> PyTree:
  """Returns `new_cache` frozen or unfrozen like `like`, so the loop carry keeps one structure.

  A flax `apply(..., mutable=['cache'])` may hand back a dict for a FrozenDict input (or the
  reverse, depending on the flax version); lax.while_loop needs the carry's treedef unchanged.
  """
  if isinstance(like, flax.core.FrozenDict) and not isinstance(new_cache, flax.core.FrozenDict):
    return flax.core.freeze(new_cache)
  if (isinstance(like, dict) and not isinstance(like, flax.core.FrozenDict) and
      isinstance(new_cache, flax.core.FrozenDict)):
    return flax.core.unfreeze(new_cache)
  return new_cache


def flat_batch_beam_expand(x: Array, beam_size: int, offset: int = 0) -> Array:
  """[..., batch, ...] -> [..., batch * beam_size, ...], each row repeated in place (T5X's)."""
  return jnp.repeat(x, beam_size, axis=offset)


def expand_cache(cache: Any, beam_size: int, offset: int = 0,
                 apply_to_index: bool = False) -> Any:
  """Repeats every batch row of a cache `beam_size` times (DecoderCache or T5X flax cache).

  apply_to_index: also expand T5X's 'cache_index' leaves, which are [batch] (not scalars) in a
  prefilled cache.
  """
  if beam_size == 1 or cache is None:
    return cache
  return cache_map(lambda x: flat_batch_beam_expand(x, beam_size, offset), cache,
                   batch_axis=offset, apply_to_index=apply_to_index)


def _check_temperature(temperature: Temperature, batch: int) -> Temperature:
  """A static temperature as a Python float; an operand as float32, a scalar or [batch]."""
  if is_static(temperature):
    return float(temperature)
  temperature = jnp.asarray(temperature, jnp.float32)
  if temperature.ndim > 1 or (temperature.ndim == 1 and temperature.shape[0] != batch):
    raise ValueError(f'temperature must be a scalar or have shape [batch] = [{batch}]; got '
                     f'shape {temperature.shape}.')
  return temperature


def _check_initial_index(initial_index: Optional[Array], inputs: Array) -> Optional[Array]:
  if initial_index is None:
    return None
  initial_index = jnp.asarray(initial_index, jnp.int32)
  if initial_index.shape != inputs.shape[:1]:
    raise ValueError(f'initial_index must have shape [batch] = [{inputs.shape[0]}]; got shape '
                     f'{initial_index.shape}.')
  return initial_index


def _decode(cfg: _LoopConfig, inputs: Array, cache: Any, tokens_to_logits: TokensToLogits,
            draft_cache: Any, draft_tokens_to_logits: Optional[TokensToLogits],
            decode_rng: Optional[Array], num_decodes: int, cache_offset: int,
            max_decode_steps: Optional[Union[int, Array]], return_stats: bool,
            initial_index: Optional[Array] = None, loop: Optional[Callable] = None):
  """Expands for num_decodes, runs the loop, sorts by log-prob ascending (best last).

  loop: `_draft_verify_loop` (the default) or another with its arguments and results (the
  token-tree loop of `trees.tree_speculative_sample`).

  Everything per row (a [batch] temperature, initial_index, max_decode_steps, the caches) is
  repeated in place for the num_decodes samples of each example.
  """
  if isinstance(max_decode_steps, int) and max_decode_steps > inputs.shape[1]:
    raise ValueError(f'max_decode_steps ({max_decode_steps}) exceeds the sequence length '
                     f'({inputs.shape[1]}).')
  batch = inputs.shape[0]
  rng = jax.random.PRNGKey(0) if decode_rng is None else decode_rng
  expand = lambda x: flat_batch_beam_expand(x, num_decodes)
  if max_decode_steps is not None and jnp.ndim(max_decode_steps) == 1:  # per-row, as T5X allows
    max_decode_steps = expand(max_decode_steps)
  temperature = _check_temperature(cfg.temperature, batch)
  if not is_static(temperature) and temperature.ndim == 1:
    temperature = expand(temperature)
  cfg = cfg._replace(temperature=temperature)
  initial_index = _check_initial_index(initial_index, inputs)
  prefilled = initial_index is not None
  decodes, log_prob, stats = (loop or _draft_verify_loop)(
      cfg, expand(inputs), expand_cache(cache, num_decodes, cache_offset, prefilled),
      tokens_to_logits, expand_cache(draft_cache, num_decodes, 0, prefilled),
      draft_tokens_to_logits, rng, max_decode_steps,
      expand(initial_index) if prefilled else None)
  unflatten = lambda x: x.reshape((batch, num_decodes) + x.shape[1:])
  order = jnp.argsort(unflatten(log_prob), axis=1)

  def sort(x):
    x = unflatten(x)
    return jnp.take_along_axis(x, order.reshape(order.shape + (1,) * (x.ndim - 2)), axis=1)

  decodes, log_prob = sort(decodes), sort(log_prob)
  if return_stats:
    return decodes, log_prob, jax.tree_util.tree_map(sort, stats)
  return decodes, log_prob


# The decode_fn contract's prompt and temperature arguments, shared by the public decoders:
#
# inputs: [batch, length] int32 decoder prompts in T5X's layout, [0 (BOS), p_1..p_n, 0, ...];
#   non-zero entries after position 0 are forced as those output tokens (teacher forcing).
# initial_index: optional [batch] int32, T5X's prefilled prompts. Row b's caches already hold
#   positions 0..n-1 (n = initial_index[b]: BOS, p_1..p_{n-1}), and its decoding starts by feeding
#   inputs[b, n] (p_n, or BOS when n = 0) at position n. Rows may differ. Outputs keep the prompt,
#   [p_1..p_n, continuation], as without initial_index. T5X computes it as
#   sum(inputs != 0, axis=1) and prefills the cache with the prompt.
# temperature: a Python number, compiled in (0.0 selects the greedy branch, argmaxes only), or an
#   operand: a traced scalar or a [batch] array of per-row temperatures, which can change without
#   recompiling. Rows at temperature <= MIN_TEMPERATURE decode greedily (T5X's rule).


def temperature_sample(inputs: Array, cache: Any, tokens_to_logits: TokensToLogits, eos_id: int,
                       decode_rng: Optional[Array] = None, num_decodes: int = 1,
                       temperature: Temperature = 1.0, topk: int = 1, topp: float = 0.0,
                       cache_offset: int = 0, initial_index: Optional[Array] = None,
                       max_decode_steps: Optional[Union[int, Array]] = None,
                       max_decode_steps_hard_limit: Optional[int] = None,
                       rescale_log_probs: bool = True, return_stats: bool = False):
  """Target-only sampling, keyword-compatible with T5X's `decoding.temperature_sample`.

  inputs [batch, length], initial_index [batch] and temperature (static, scalar or [batch]):
  see the comment above. Draws are T5X's for a given `decode_rng`: one key split per step, and
  with a [batch] temperature one Gumbel noise vector per step shared by all rows, as T5X's
  vmapped draw does; here the num_decodes samples of an example get distinct noise (T5X gives
  them the same noise, so they are identical).
  Returns (decodes [batch, num_decodes, length], log_probs [batch, num_decodes]) sorted ascending
  by log-probability (best last); with return_stats also the `DecodeStats` ([batch, num_decodes]).
  Defaults are T5X's, including topk=1 (greedy unless topk is set to 0 or topp is used).
  """
  if max_decode_steps is not None and max_decode_steps_hard_limit:
    max_decode_steps = jnp.minimum(max_decode_steps, max_decode_steps_hard_limit)
  per_row = not is_static(temperature) and jnp.ndim(temperature) == 1
  cfg = _LoopConfig(gamma=0, rule=speculative_rule(), temperature=temperature,
                    topk=topk, topp=topp, rescale_log_probs=rescale_log_probs,
                    confidence_threshold=0.0, adaptive_gamma=False, eos_id=eos_id,
                    noise_period=num_decodes if per_row else 0)
  return _decode(cfg, inputs, cache, tokens_to_logits, None, None, decode_rng, num_decodes,
                 cache_offset, max_decode_steps, return_stats, initial_index)


def resolve_verification(verification: str, gamma: int, temperature: Temperature,
                         lenience: float = 1.0, rule: Optional[VerifyRule] = None) -> str:
  """The verifier a loop runs: 'token' or 'block' as given; for 'auto', 'block' where it keeps
  more for what it costs (the exact rule sampling at gamma >= BLOCK_FROM_GAMMA; an operand
  temperature counts as sampling, its zero rows verify as greedy either way), else 'token'
  (a static temperature 0 and gamma 1 give the same verdicts either way; a lenience or a custom
  rule has no block form). Raises ValueError naming the accepted values."""
  if verification == AUTO_VERIFICATION:
    greedy = is_static(temperature) and temperature <= MIN_TEMPERATURE
    exact = rule is None and lenience == 1.0
    return 'block' if exact and not greedy and gamma >= BLOCK_FROM_GAMMA else 'token'
  if verification not in VERIFICATIONS:
    raise ValueError(f'verification must be one of {VERIFICATION_CHOICES}, '
                     f'got {verification!r}.')
  return verification


def speculative_sample(inputs: Array, cache: Any, tokens_to_logits: TokensToLogits,
                       draft_cache: Any, draft_tokens_to_logits: TokensToLogits, eos_id: int,
                       decode_rng: Optional[Array] = None, num_decodes: int = 1, gamma: int = 4,
                       temperature: Temperature = 1.0, topk: int = 0, topp: float = 0.0,
                       lenience: float = 1.0, adaptive_gamma: bool = False,
                       draft_confidence_threshold: float = 0.0, cache_offset: int = 0,
                       initial_index: Optional[Array] = None,
                       max_decode_steps: Optional[Union[int, Array]] = None,
                       rescale_log_probs: bool = True, return_stats: bool = False,
                       rule: Optional[VerifyRule] = None, verification: str = 'auto',
                       unroll_draft: bool = False):
  """Speculative sampling (Leviathan, Kalman, Matias 2023): the target's distribution, faster.

  `cache`/`tokens_to_logits` are the target's, `draft_cache`/`draft_tokens_to_logits` the
  draft's; both callables must write at `DecodingState.cur_index` (the project's DecoderCache).
  gamma: the (static) maximum number of draft tokens per target call ('auto' in a model's
    decode_kwargs or gin is chosen per batch by `policy`, before this is called); 0 decodes
    with the target alone, as `temperature_sample` with the same temperature, topk and topp
    (the draft and its cache go unused).
  adaptive_gamma: per row, gamma grows by 2 after a fully accepted draft and shrinks by 1 after a
    rejection, within [1, gamma]. draft_confidence_threshold: a row stops drafting when the
    draft's top probability falls below it (the unconfident token is not proposed). Both only
    change how many tokens are proposed, so the output distribution is unchanged.
  verification: 'token' (Leviathan et al.: left to right, stop at the first rejection),
    'block' (Sun et al. 2025, `_block_verdict`: the draft judged as a whole, never fewer tokens
    per call in expectation; exact, lenience 1 only) or 'auto' (the default: block when
    sampling at gamma >= 2, `resolve_verification`). Both are the same greedy rule at
    temperature 0, where the block form adds no work.
  lenience: 1 is exact; below 1 accepts more and is lossy (see `speculative_rule`). Its greedy
    form (accept when p(x) >= lenience max p) needs a static temperature 0.0; greedy rows of an
    operand temperature accept exactly the target's argmax.
  temperature/topk/topp are applied identically to target and draft, per row for a [batch]
  temperature (T5X's semantics; note the default topk=0 here, full sampling, where T5X's
  temperature_sample defaults to topk=1). Each row draws its own noise.
  initial_index: prefilled prompts (see the comment above `temperature_sample`); the target and
    the draft caches must both hold positions 0..initial_index - 1.
  unroll_draft: the draft's gamma calls as straight-line code instead of an inner while loop:
    always gamma calls, but no loop condition between them (on a GPU, a device-to-host sync
    per draft call unless XLA captures while loops in command buffers). Same outputs.
  Returns as `temperature_sample`.
  """
  if gamma == 'auto':
    raise ValueError("gamma='auto' is resolved per batch outside the jitted decoder "
                     '(`policy`: the infer job and the translate command do it); give '
                     'speculative_sample an int.')
  if gamma < 0:
    raise ValueError(f'gamma must be >= 0, got {gamma}.')
  block = resolve_verification(verification, gamma, temperature, lenience, rule) == 'block'
  if gamma == 0:  # the target alone: a calibrated choice where speculation does not pay
    return temperature_sample(inputs, cache, tokens_to_logits, eos_id, decode_rng, num_decodes,
                              temperature, topk, topp, cache_offset, initial_index,
                              max_decode_steps, rescale_log_probs=rescale_log_probs,
                              return_stats=return_stats)
  if block and (rule is not None or lenience != 1.0):
    raise ValueError("verification='block' is the exact rule: it takes no `rule` and "
                     f'lenience 1 only (got lenience {lenience}).')
  greedy = is_static(temperature) and temperature <= MIN_TEMPERATURE
  cfg = _LoopConfig(gamma=gamma, rule=rule or speculative_rule(lenience, greedy),
                    temperature=temperature, topk=topk, topp=topp,
                    rescale_log_probs=rescale_log_probs,
                    confidence_threshold=draft_confidence_threshold,
                    adaptive_gamma=adaptive_gamma, eos_id=eos_id, block=block,
                    unroll_draft=unroll_draft)
  return _decode(cfg, inputs, cache, tokens_to_logits, draft_cache, draft_tokens_to_logits,
                 decode_rng, num_decodes, cache_offset, max_decode_steps, return_stats,
                 initial_index)


def bild_decode(inputs: Array, cache: Any, tokens_to_logits: TokensToLogits, draft_cache: Any,
                draft_tokens_to_logits: TokensToLogits, eos_id: int,
                decode_rng: Optional[Array] = None, num_decodes: int = 1,
                fallback_threshold: float = 0.6, rollback_threshold: float = 5.0,
                max_small_steps: int = 10, temperature: Temperature = 0.0, topk: int = 0,
                topp: float = 0.0, cache_offset: int = 0, initial_index: Optional[Array] = None,
                max_decode_steps: Optional[Union[int, Array]] = None,
                rescale_log_probs: bool = True, return_stats: bool = False):
  """Big Little Decoder (Kim et al. 2023): lossy, the small model leads while confident.

  The small (draft) model decodes alone until its top probability is below `fallback_threshold`
  (that token is dropped) or it has made `max_small_steps` tokens; then the large model scores
  them all in one call and keeps them up to the first whose -log p_large exceeds
  `rollback_threshold`, where it substitutes its own prediction (otherwise it appends its own
  next token). Greedy by default (the paper's setting); temperature > 0 samples both models,
  with the same (per-row, for a [batch] array) temperature. initial_index: as in
  `speculative_sample`.
  Returns as `temperature_sample`; `DecodeStats.fallbacks`/`rollbacks` count the two events.
  """
  if max_small_steps < 1:
    raise ValueError(f'max_small_steps must be >= 1, got {max_small_steps}.')
  cfg = _LoopConfig(gamma=max_small_steps, rule=bild_rule(rollback_threshold),
                    temperature=temperature, topk=topk, topp=topp,
                    rescale_log_probs=rescale_log_probs, confidence_threshold=fallback_threshold,
                    adaptive_gamma=False, eos_id=eos_id)
  return _decode(cfg, inputs, cache, tokens_to_logits, draft_cache, draft_tokens_to_logits,
                 decode_rng, num_decodes, cache_offset, max_decode_steps, return_stats,
                 initial_index)


def loop_iteration(state: LoopState, forced: Array, limit: Array,
                   tokens_to_logits: TokensToLogits,
                   draft_tokens_to_logits: Optional[TokensToLogits], eos_id: int, gamma: int,
                   temperature: float = 0.0, verification: str = 'auto') -> LoopState:
  """One iteration of `speculative_sample`'s loop (gamma 0: `temperature_sample`'s) from
  `start_loop`'s (state, forced, limit), the draft unrolled to its gamma calls: a program with
  no loop, for compiled-cost analysis (XLA counts a while body once, and XLA:TPU gives no time
  estimate for a program that holds a loop). Exact settings only: no prompt, lenience 1.
  """
  block = gamma > 0 and resolve_verification(verification, gamma, temperature) == 'block'
  greedy = temperature <= MIN_TEMPERATURE
  cfg = _LoopConfig(gamma=gamma, rule=speculative_rule(1.0, greedy), temperature=temperature,
                    topk=0, topp=0.0, rescale_log_probs=True, confidence_threshold=0.0,
                    adaptive_gamma=False, eos_id=eos_id, block=block, unroll_draft=True)
  return _iteration(cfg, tokens_to_logits, draft_tokens_to_logits, forced, limit, state)
