"""Beam search with the semantics and keyword interface of T5X's `decoding.beam_search`.

A drop-in `decode_fn` for `EncoderDecoderModel`: same arguments, same result
(`[batch, beam, max_decode_len]` sequences and `[batch, beam]` scores, ascending, best last), same
arithmetic, so on the same model it returns T5X's beams token for token. What differs is how it
talks to the model. `tokens_to_logits` receives a `DecodingState` whose `cur_index` is a per-row
`[batch * beam]` vector of write positions (the project's contract, see `decoding.py`), and the
cache is any pytree whose leaves carry the batch on axis `cache_offset` (a `network.DecoderCache`,
or T5X's flax 'cache' collection). Beams are kept flattened into the batch, `[batch * beam, ...]`
with row `b * beam + j` for beam j of example b (T5X's `flat_batch_beam_expand` order), so the
cache is reordered by one gather per step and never reshaped.

Shapes: `batch` examples, `beam` = num_decodes, `vocab` output classes, `length` = max_decode_len,
`total` = length + 1 (the sequences carry a leading BOS slot, as in T5X).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import flax
import jax
import jax.numpy as jnp
from jax import lax

from speculative_t5x.decoding import DecodingState, cache_map, match_container

Array = jnp.ndarray
PyTree = Any

# T5X's "effective negative infinity" for beam bookkeeping. It must be this finite value, not
# -inf: scores are shifted by it (x + NEG_INF), and the float32 rounding of those sums decides
# ties exactly as in T5X.
NEG_INF = -1.0e7

@flax.struct.dataclass
class BeamState:
  """The while-loop carry (T5X's `BeamState`, with the scalar loop counter named `step`).

  step:            scalar int32, tokens fed so far; step s feeds live_seqs[:, :, s].
  live_logprobs:   [batch, beam] float32, raw log-probabilities of the live beams, ascending.
  finished_scores: [batch, beam] float32, length-normalised scores of finished beams, ascending.
  live_seqs:       [batch, beam, total] int32.
  finished_seqs:   [batch, beam, total] int32.
  finished_flags:  [batch, beam] bool, which finished slots hold a real (EOS-ended) sequence.
  cache:           the model cache, batch axis of size batch * beam.
  """
  step: Array
  live_logprobs: Array
  finished_scores: Array
  live_seqs: Array
  finished_seqs: Array
  finished_flags: Array
  cache: PyTree


def brevity_penalty(alpha: float, length: Any) -> Array:
  """GNMT's length normalisation ((5 + length) / 6) ** alpha, as T5X computes it (float32)."""
  return jnp.power((5.0 + length) / 6.0, alpha)


def _gather_beams(x: Array, beam_indices: Array) -> Array:
  """x [batch, old_beam, ...] and beam_indices [batch, new_beam] -> [batch, new_beam, ...].

  A true gather rather than T5X's one-hot contraction: it is exact for every dtype and value
  (a one-hot matmul turns inf into nan and may run at reduced precision on TPU).
  """
  idx = beam_indices.reshape(beam_indices.shape + (1,) * (x.ndim - 2))
  return jnp.take_along_axis(x, idx, axis=1)


def _last_token_logits(logits: Array) -> Array:
  """[rows, 1, vocab] (project contract) or [rows, vocab] (T5X's) -> [rows, vocab]."""
  if logits.ndim == 3:
    if logits.shape[1] != 1:
      raise ValueError(f'beam_search feeds one token per row; got logits {logits.shape}.')
    return logits[:, 0]
  if logits.ndim != 2:
    raise ValueError(f'Expected logits [rows, vocab] or [rows, 1, vocab]; got {logits.shape}.')
  return logits


def _right_align(tokens: Array) -> Array:
  """Shifts each row of [batch, length] right so that its last non-zero token is at the end.

  An all-zero row is shifted by length - 1 (its first entry lands at the end), as T5X does.
  """
  length = tokens.shape[1]
  positions = jnp.arange(length)
  last = jnp.max(jnp.where(tokens != 0, positions[None, :], 0), axis=1)  # [batch]
  source = positions[None, :] - (length - 1 - last)[:, None]
  shifted = jnp.take_along_axis(tokens, jnp.clip(source, 0, length - 1), axis=1)
  return jnp.where(source >= 0, shifted, 0)


def _left_align(tokens: Array) -> Array:
  """Shifts each row of [rows, length] left so that it starts at its first non-zero token."""
  length = tokens.shape[1]
  positions = jnp.arange(length)
  # An all-zero row has no first token and stays where it is.
  first = jnp.min(jnp.where(tokens != 0, positions[None, :], length), axis=1)
  first = jnp.where(first == length, 0, first)
  source = positions[None, :] + first[:, None]
  shifted = jnp.take_along_axis(tokens, jnp.clip(source, 0, length - 1), axis=1)
  return jnp.where(source < length, shifted, 0)


def beam_search(inputs: Array,
                cache: PyTree,
                tokens_to_logits: Callable[[DecodingState], Tuple[Array, PyTree]],
                eos_id: int,
                num_decodes: int = 4,
                alpha: float = 0.6,
                max_decode_len: Optional[int] = None,
                max_decode_step: int = -1,
                min_log_prob: float = NEG_INF,
                decode_rng: Optional[Array] = None,
                cache_offset: int = 0,
                initial_index: Optional[Array] = None) -> Tuple[Array, Array]:
  """Beam search, argument for argument and result for result T5X's `decoding.beam_search`.

  Each step scores every one-token extension of the live beams and keeps the best 2 * beam
  candidates, so that `beam` can stay alive even if all of the best ones end in EOS. Candidates
  ending in EOS compete for the finished set with score log_prob / brevity_penalty(alpha,
  length); the best `beam` of the others become the new live beams. The search stops at max length, or when no live beam can still beat the worst
  finished one, or (optionally) after `max_decode_step` steps or when every live beam falls below
  `min_log_prob`. One jit-compilable `lax.while_loop`; all shapes are static.

  Args:
    inputs: [batch, input_length] int32. Without `initial_index`: `inputs[:, 0]` is the BOS slot
      (ignored) and non-zero `inputs[:, j]` (j >= 1) are forced as output token j - 1 (teacher
      forcing of a prompt; the forced beam restarts from log-prob 0, as in T5X). With
      `initial_index`: the decoder prompts, whose cache was prefilled (see below).
    cache: the model cache for `batch` rows (expanded here to batch * beam), every leaf with the
      batch on axis `cache_offset` (leaves T5X's `cache_map` skips are skipped).
    tokens_to_logits: DecodingState(cur_index [batch * beam] write positions, sequences
      [batch * beam, total], cur_token [batch * beam, 1], cache) -> (logits [batch * beam, vocab]
      or [batch * beam, 1, vocab], new cache of the same structure).
    eos_id: end-of-sequence id.
    num_decodes: beam size; also the number of sequences returned per example.
    alpha: brevity-penalty exponent.
    max_decode_len: output length; defaults to inputs.shape[1].
    max_decode_step: if > 0, stop after this many steps.
    min_log_prob: stop once every live beam's raw log-prob is below this (after step 0).
    decode_rng: unused (beam search is deterministic); accepted for the decode_fn interface.
    cache_offset: the batch axis of the cache leaves (1 for layer-scanned T5X caches).
    initial_index: optional [batch] int32, the prompt lengths when the cache already holds
      positions 0..initial_index[b]-1 (BOS plus all but the last prompt token). The last prompt
      token, inputs[b, initial_index[b]], is fed first at position initial_index[b]; outputs are
      the prompt followed by the continuation, left-aligned and cut to max_decode_len (T5X's
      convention; rows with longer prompts may be truncated). As in T5X the loop runs until the
      row with the shortest prompt is full, so rows with longer prompts decode past the output
      length (those tokens are cut but still rank the beams): to reproduce T5X's scores and
      beam order, the cache needs max_decode_len + max(initial_index) - min(initial_index)
      positions; a smaller `DecoderCache` drops the writes past its end.

  Returns:
    (sequences [batch, beam, max_decode_len] int32, scores [batch, beam] float32), sorted by
    score ascending (best last). Finished sequences end in EOS followed by zeros. For examples
    where no beam finished, the live beams are returned with their raw log-probabilities.
  """
  del decode_rng
  beam = num_decodes
  batch, input_length = inputs.shape
  length = input_length if max_decode_len is None else max_decode_len
  total = length + 1  # the leading BOS (or last prompt token) slot
  inputs = jnp.asarray(inputs, jnp.int32)
  prefilled = initial_index is not None

  if prefilled:
    initial_index = jnp.asarray(initial_index, jnp.int32)
    right_aligned = _right_align(inputs)
    # Every beam starts from the last prompt token; the rest of the prompt is in the cache.
    first_token = right_aligned[:, -1]
    live_seqs0 = jnp.zeros((batch, beam, total), jnp.int32).at[:, :, 0].set(first_token[:, None])
    forced = None  # nothing left to force
  else:
    initial_index = jnp.zeros((batch,), jnp.int32)
    live_seqs0 = jnp.zeros((batch, beam, total), jnp.int32)
    # forced[:, j] is the prompt token for sequence slot j (0 = free). Zero-padded past the
    # inputs, where T5X would instead re-read the last input column (index clamping).
    n = min(input_length, total)
    forced = jnp.zeros((batch, total), jnp.int32).at[:, :n].set(inputs[:, :n])

  # [batch * beam] per-row position of step 0's token.
  flat_initial_index = jnp.repeat(initial_index, beam)
  min_initial_index = jnp.min(initial_index)

  state0 = BeamState(
      step=jnp.array(0, jnp.int32),
      # Only beam 0 is alive at first: the others are copies and would repeat its candidates.
      live_logprobs=jnp.tile(jnp.array([0.0] + [NEG_INF] * (beam - 1), jnp.float32),
                             (batch, 1)),
      finished_scores=jnp.full((batch, beam), NEG_INF, jnp.float32),
      live_seqs=live_seqs0,
      finished_seqs=jnp.zeros((batch, beam, total), jnp.int32),
      finished_flags=jnp.zeros((batch, beam), jnp.bool_),
      # A prefilled T5X cache has a [batch] 'cache_index' that needs expanding too.
      cache=cache_map(lambda x: jnp.repeat(x, beam, axis=cache_offset), cache, cache_offset,
                      apply_to_index=prefilled))

  # The smallest penalty any live beam can still get is the one at full length.
  min_brevity_penalty = brevity_penalty(alpha, total)

  def cond_fn(state: BeamState) -> Array:
    # Step s writes slot s + 1; rows with longer prompts run on (T5X stops on the shortest).
    not_at_end = state.step + min_initial_index < total - 1
    best_live = state.live_logprobs[:, -1:] / min_brevity_penalty  # [batch, 1]
    worst_finished = jnp.where(state.finished_flags,
                               jnp.min(state.finished_scores, axis=1, keepdims=True), NEG_INF)
    # No live beam can displace any finished one in any example: the result is fixed.
    search_terminated = jnp.all(worst_finished > best_live)
    all_below_min = jnp.all(best_live < min_log_prob / min_brevity_penalty) & (state.step > 0)
    out_of_steps = (max_decode_step > 0) & (state.step >= max_decode_step)
    return not_at_end & ~search_terminated & ~all_below_min & ~out_of_steps

  def body_fn(state: BeamState) -> BeamState:
    step = state.step
    cur_token = lax.dynamic_slice_in_dim(state.live_seqs, step, 1, axis=2)  # [batch, beam, 1]
    decoding_state = DecodingState(
        cur_index=flat_initial_index + step,
        sequences=state.live_seqs.reshape(batch * beam, total),
        cur_token=cur_token.reshape(batch * beam, 1),
        cache=state.cache)
    flat_logits, new_cache = tokens_to_logits(decoding_state)
    new_cache = match_container(new_cache, state.cache)
    logits = _last_token_logits(flat_logits).astype(jnp.float32)
    vocab = logits.shape[-1]
    # [batch, beam, vocab] log-probabilities of every one-token extension.
    log_probs = (jax.nn.log_softmax(logits).reshape(batch, beam, vocab) +
                 state.live_logprobs[:, :, None])

    # The best 2 * beam extensions over all beams: [batch, 2 * beam] each.
    num_candidates = 2 * beam
    cand_log_probs, flat_index = lax.top_k(log_probs.reshape(batch, beam * vocab), num_candidates)
    cand_parent = flat_index // vocab
    cand_token = flat_index % vocab

    if forced is not None:
      # Inside the prompt, the forced token replaces the candidates' tokens, and only the first
      # candidate stays alive, restarted at log-prob 0 (T5X scores only the continuation).
      forced_token = lax.dynamic_slice_in_dim(forced, step + 1, 1, axis=1)  # [batch, 1]
      in_prompt = forced_token != 0
      prompt_log_probs = jnp.where(jnp.arange(num_candidates) == 0, 0.0, NEG_INF)
      cand_log_probs = jnp.where(in_prompt, prompt_log_probs[None, :], cand_log_probs)
      cand_token = jnp.where(in_prompt, forced_token, cand_token)

    # [batch, 2 * beam, total]: parents' sequences extended by the candidate tokens.
    cand_seqs = _gather_beams(state.live_seqs, cand_parent)
    cand_seqs = lax.dynamic_update_slice_in_dim(cand_seqs, cand_token[:, :, None], step + 1,
                                                axis=2)
    cand_finished = cand_token == eos_id

    # Live set: the best `beam` candidates that did not end, ascending (best last). Adding
    # NEG_INF (not replacing by it) keeps T5X's order when fewer than `beam` candidates live on.
    live_candidate_log_probs = jnp.where(cand_finished, cand_log_probs + NEG_INF, cand_log_probs)
    _, keep = lax.top_k(live_candidate_log_probs, beam)
    keep = jnp.flip(keep, axis=1)
    live_seqs = _gather_beams(cand_seqs, keep)
    live_logprobs = _gather_beams(live_candidate_log_probs, keep)
    # The surviving beams' caches are their parents' caches, written this step.
    parent = _gather_beams(cand_parent, keep)  # [batch, beam]
    flat_parent = (jnp.arange(batch)[:, None] * beam + parent).reshape(batch * beam)
    new_cache = cache_map(lambda x: jnp.take(x, flat_parent, axis=cache_offset), new_cache,
                          cache_offset, apply_to_index=prefilled)

    # Finished set: the best `beam` of the old finished and the newly ended candidates.
    # Sequence length counts the prompt (initial_index) and the token just chosen.
    lengths = initial_index[:, None] + (step + 1)  # [batch, 1]
    cand_scores = cand_log_probs / brevity_penalty(alpha, lengths)
    cand_scores = jnp.where(cand_finished, cand_scores, cand_scores + NEG_INF)
    pooled_scores = jnp.concatenate([state.finished_scores, cand_scores], axis=1)
    _, best = lax.top_k(pooled_scores, beam)
    best = jnp.flip(best, axis=1)
    finished_seqs = _gather_beams(jnp.concatenate([state.finished_seqs, cand_seqs], axis=1), best)
    finished_scores = _gather_beams(pooled_scores, best)
    finished_flags = _gather_beams(
        jnp.concatenate([state.finished_flags, cand_finished], axis=1), best)

    return BeamState(step=step + 1, live_logprobs=live_logprobs,
                     finished_scores=finished_scores, live_seqs=live_seqs,
                     finished_seqs=finished_seqs, finished_flags=finished_flags, cache=new_cache)

  final = lax.while_loop(cond_fn, body_fn, state0)

  # Examples where no beam reached EOS return their live beams, scored by raw log-probability.
  any_finished = jnp.any(final.finished_flags, axis=1)
  seqs = jnp.where(any_finished[:, None, None], final.finished_seqs, final.live_seqs)
  scores = jnp.where(any_finished[:, None], final.finished_scores, final.live_logprobs)

  if not prefilled:
    return seqs[:, :, 1:], scores  # drop the BOS slot

  # Slot 0 repeats the prompt's last token: put the whole prompt back in front of the
  # continuation, then left-align (dropping the BOS and padding) and cut to length.
  prompts = jnp.broadcast_to(right_aligned[:, None, :], (batch, beam, input_length))
  full = jnp.concatenate([prompts, seqs[:, :, 1:]], axis=2)
  full = _left_align(full.reshape(batch * beam, -1)).reshape(full.shape)
  return full[:, :, :length], scores
