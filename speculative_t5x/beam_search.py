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

`speculative_beam_search` returns the same beams and scores with fewer target calls: a draft
model proposes a token tree below each live beam, the target scores the whole tree in one call
(tree attention), and `beam_search`'s own step is replayed on those logits, each example of the
batch for as long as its beams stay inside its trees.

Shapes: `batch` examples, `beam` = num_decodes, `vocab` output classes, `length` = max_decode_len,
`total` = length + 1 (the sequences carry a leading BOS slot, as in T5X).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional, Sequence, Tuple

import flax
import jax
import jax.numpy as jnp
from jax import lax

from speculative_t5x.decoding import DecodeStats, DecodingState, cache_map
from speculative_t5x.decoding import match_container
from speculative_t5x.trees import TokenTree, check_tree_caches, token_tree
from speculative_t5x.trees import call_tree as _call_tree

Array = jnp.ndarray
PyTree = Any

# T5X's "effective negative infinity" for beam bookkeeping. It must be this finite value, not
# -inf: scores are shifted by it (x + NEG_INF), and the float32 rounding of those sums decides
# ties exactly as in T5X.
NEG_INF = -1.0e7

@flax.struct.dataclass
class BeamState:
  """The while-loop carry (T5X's `BeamState`, with the loop counter named `step`).

  step:            int32, tokens fed so far; step s feeds live_seqs[:, :, s]. A scalar in
                   `beam_search` (all examples step together, as in T5X); [batch] in
                   `speculative_beam_search`, where each example keeps its own.
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


def _prompt_tokens(inputs: Array, total: int) -> Array:
  """[batch, input_length] inputs -> [batch, total] int32, the token forced at each sequence slot.

  Slot j holds inputs[:, j] (0 = free; slot 0, the BOS slot, is never read). Zero-padded past
  the inputs, where T5X would instead re-read the last input column (index clamping).
  """
  n = min(inputs.shape[1], total)
  return jnp.zeros((inputs.shape[0], total), jnp.int32).at[:, :n].set(
      jnp.asarray(inputs, jnp.int32)[:, :n])


def _initial_state(first_token: Array, cache: PyTree, beam: int, total: int, cache_offset: int,
                   prefilled: bool) -> BeamState:
  """The search's start: every beam holds first_token [batch] in slot 0, and only beam 0 is alive.

  The other beams start as copies of beam 0 and would repeat its candidates, so they begin at
  NEG_INF. The cache's `batch` rows are repeated `beam` times ([batch * beam] rows).
  """
  batch = first_token.shape[0]
  return BeamState(
      step=jnp.array(0, jnp.int32),
      live_logprobs=jnp.tile(jnp.array([0.0] + [NEG_INF] * (beam - 1), jnp.float32),
                             (batch, 1)),
      finished_scores=jnp.full((batch, beam), NEG_INF, jnp.float32),
      live_seqs=jnp.zeros((batch, beam, total), jnp.int32).at[:, :, 0].set(first_token[:, None]),
      finished_seqs=jnp.zeros((batch, beam, total), jnp.int32),
      finished_flags=jnp.zeros((batch, beam), jnp.bool_),
      # A prefilled T5X cache has a [batch] 'cache_index' that needs expanding too.
      cache=cache_map(lambda x: jnp.repeat(x, beam, axis=cache_offset), cache, cache_offset,
                      apply_to_index=prefilled))


class _Candidates(NamedTuple):
  """One step's candidates: the best 2 * beam one-token extensions of an example's live beams.

  seqs:      [batch, 2 * beam, total] int32, the parents' sequences with the new token.
  log_probs: [batch, 2 * beam] float32, raw log-probabilities, descending.
  parent:    [batch, 2 * beam] int32, the live beam each extends.
  finished:  [batch, 2 * beam] bool, the new token is EOS.
  """
  seqs: Array
  log_probs: Array
  parent: Array
  finished: Array


def _top_ascending(scores: Array, k: int) -> Array:
  """scores [batch, n] -> [batch, k], the indices of the k largest, ascending (best last)."""
  _, index = lax.top_k(scores, k)
  return jnp.flip(index, axis=1)


def _grow_beams(log_probs: Array, live_seqs: Array, step: Array, forced: Optional[Array],
                eos_id: int) -> _Candidates:
  """The step's candidates (T5X's `grow_topk`), from every one-token extension's log-prob.

  log_probs: [batch, beam, vocab], each live beam's log-prob plus its next token's.
  live_seqs: [batch, beam, total]. step: [batch], each example's step; its token goes to slot
  step + 1. forced: [batch, total] prompt tokens (0 = free, see `_prompt_tokens`) or None.
  Keeping 2 * beam lets `beam` beams stay alive even if all of the best ones end in EOS.
  """
  batch, beam, vocab = log_probs.shape
  num_candidates = 2 * beam
  cand_log_probs, flat_index = lax.top_k(log_probs.reshape(batch, beam * vocab), num_candidates)
  parent = flat_index // vocab
  token = flat_index % vocab
  if forced is not None:
    # Inside the prompt, the forced token replaces the candidates' tokens, and only the first
    # candidate stays alive, restarted at log-prob 0 (T5X scores only the continuation).
    # Clipped: speculative_beam_search also computes, and discards, steps past an example's end.
    forced_token = jnp.take_along_axis(forced, step[:, None] + 1, axis=1,
                                       mode='clip')  # [batch, 1]
    in_prompt = forced_token != 0
    prompt_log_probs = jnp.where(jnp.arange(num_candidates) == 0, 0.0, NEG_INF)
    cand_log_probs = jnp.where(in_prompt, prompt_log_probs[None, :], cand_log_probs)
    token = jnp.where(in_prompt, forced_token, token)
  seqs = _gather_beams(live_seqs, parent)
  seqs = jnp.where(jnp.arange(live_seqs.shape[2]) == step[:, None, None] + 1, token[:, :, None],
                   seqs)
  return _Candidates(seqs=seqs, log_probs=cand_log_probs, parent=parent, finished=token == eos_id)


def _select_live(candidates: _Candidates, beam: int) -> Tuple[Array, Array, Array]:
  """The new live beams: the best `beam` candidates that did not end in EOS, ascending.

  Returns (live_seqs [batch, beam, total], live_logprobs [batch, beam], parent [batch, beam]:
  the old live beam each extends, whose cache it inherits).
  """
  # Adding NEG_INF (not replacing by it) keeps T5X's order when fewer than `beam` candidates
  # live on.
  log_probs = jnp.where(candidates.finished, candidates.log_probs + NEG_INF, candidates.log_probs)
  keep = _top_ascending(log_probs, beam)
  return (_gather_beams(candidates.seqs, keep), _gather_beams(log_probs, keep),
          _gather_beams(candidates.parent, keep))


def _merge_finished(state: BeamState, candidates: _Candidates, lengths: Array,
                    alpha: float) -> BeamState:
  """`state` with its finished set replaced by the best `beam` of it and the candidates that
  ended in EOS, ascending (T5X's `grow_finished`).

  lengths: [batch, 1], the candidates' sequence lengths (prompt and new token included); a
  candidate's score is its log-prob / brevity_penalty(alpha, length).
  """
  beam = state.finished_scores.shape[1]
  scores = candidates.log_probs / brevity_penalty(alpha, lengths)
  scores = jnp.where(candidates.finished, scores, scores + NEG_INF)
  pooled_scores = jnp.concatenate([state.finished_scores, scores], axis=1)
  best = _top_ascending(pooled_scores, beam)
  return state.replace(
      finished_seqs=_gather_beams(
          jnp.concatenate([state.finished_seqs, candidates.seqs], axis=1), best),
      finished_scores=_gather_beams(pooled_scores, best),
      finished_flags=_gather_beams(
          jnp.concatenate([state.finished_flags, candidates.finished], axis=1), best))


def _search_result(final: BeamState, length: int,
                   prompts: Optional[Array]) -> Tuple[Array, Array]:
  """beam_search's result from its final state: (sequences [batch, beam, length], scores).

  Examples where no beam reached EOS return their live beams, scored by raw log-probability.
  prompts: [batch, input_length] the right-aligned prompts of a prefilled cache, else None.
  """
  any_finished = jnp.any(final.finished_flags, axis=1)
  seqs = jnp.where(any_finished[:, None, None], final.finished_seqs, final.live_seqs)
  scores = jnp.where(any_finished[:, None], final.finished_scores, final.live_logprobs)
  if prompts is None:
    return seqs[:, :, 1:], scores  # drop the BOS slot
  # Slot 0 repeats the prompt's last token: put the whole prompt back in front of the
  # continuation, then left-align (dropping the BOS and padding) and cut to length.
  batch, beam, _ = seqs.shape
  prompts = jnp.broadcast_to(prompts[:, None, :], (batch, beam, prompts.shape[1]))
  full = jnp.concatenate([prompts, seqs[:, :, 1:]], axis=2)
  full = _left_align(full.reshape(batch * beam, -1)).reshape(full.shape)
  return full[:, :, :length], scores


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
                initial_index: Optional[Array] = None,
                loop_fn: Callable = lax.while_loop) -> Tuple[Array, Array]:
  """Beam search, argument for argument and result for result T5X's `decoding.beam_search`.

  Each step scores every one-token extension of the live beams and keeps the best 2 * beam
  candidates, so that `beam` can stay alive even if all of the best ones end in EOS. Candidates
  ending in EOS compete for the finished set with score log_prob / brevity_penalty(alpha,
  length); the best `beam` of the others become the new live beams. The search stops at max
  length, or when no live beam can still beat the worst finished one, or (optionally) after
  `max_decode_step` steps or when every live beam falls below `min_log_prob`. One
  jit-compilable `lax.while_loop`; all shapes are static.

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
    loop_fn: runs the search as `loop_fn(cond_fn, body_fn, initial BeamState) -> final
      BeamState`, `lax.while_loop`'s signature. `body_fn(state, logits=None)` is one step of
      every example (from its own step where `state.step` is [batch]); given the live beams'
      next-token logits [batch * beam, vocab] it uses them instead of calling tokens_to_logits
      and leaves the cache to the caller, only reordering its rows with the beams
      (`speculative_beam_search` replays steps on logits of a verified token tree).
      `cond_fn(state, per_example=True)` gives the stop votes the loop condition combines:
      (at_limit, terminated, below_min), [batch] bool each; the search steps on unless any
      example is at a limit, or all are terminated, or all are below min_log_prob.

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
    prompts = _right_align(inputs)
    # Every beam starts from the last prompt token; the rest of the prompt is in the cache.
    first_token = prompts[:, -1]
    forced = None  # nothing left to force
  else:
    initial_index = jnp.zeros((batch,), jnp.int32)
    first_token = jnp.zeros((batch,), jnp.int32)
    prompts = None
    forced = _prompt_tokens(inputs, total)

  # [batch * beam] per-row position of step 0's token.
  flat_initial_index = jnp.repeat(initial_index, beam)
  min_initial_index = jnp.min(initial_index)
  state0 = _initial_state(first_token, cache, beam, total, cache_offset, prefilled)
  # The smallest penalty any live beam can still get is the one at full length.
  min_brevity_penalty = brevity_penalty(alpha, total)

  def cond_fn(state: BeamState, per_example: bool = False):
    step = jnp.broadcast_to(state.step, (batch,))
    # Step s writes slot s + 1; rows with longer prompts run on (T5X stops on the shortest).
    at_limit = ((step + min_initial_index >= total - 1) |
                ((max_decode_step > 0) & (step >= max_decode_step)))
    best_live = state.live_logprobs[:, -1:] / min_brevity_penalty  # [batch, 1]
    worst_finished = jnp.where(state.finished_flags,
                               jnp.min(state.finished_scores, axis=1, keepdims=True), NEG_INF)
    # No live beam of the example can displace any finished one.
    terminated = jnp.all(worst_finished > best_live, axis=1)
    below_min = (best_live[:, 0] < min_log_prob / min_brevity_penalty) & (step > 0)
    if per_example:
      return at_limit, terminated, below_min
    # T5X's: the examples step together until the result is fixed for all of them.
    return ~jnp.any(at_limit) & ~jnp.all(terminated) & ~jnp.all(below_min)

  def body_fn(state: BeamState, logits: Optional[Array] = None) -> BeamState:
    step = jnp.broadcast_to(state.step, (batch,))  # each example's own (equal in beam_search)
    # Indices are clipped as dynamic slices clip them (speculative_beam_search also computes,
    # and discards, steps of examples that are past their end).
    cur_token = jnp.take_along_axis(state.live_seqs, step[:, None, None], axis=2,
                                    mode='clip')  # [batch, beam, 1]
    decoding_state = DecodingState(
        cur_index=flat_initial_index + jnp.repeat(step, beam),
        sequences=state.live_seqs.reshape(batch * beam, total),
        cur_token=cur_token.reshape(batch * beam, 1),
        cache=state.cache)
    flat_logits, new_cache = (tokens_to_logits(decoding_state) if logits is None else
                              (logits, state.cache))
    new_cache = match_container(new_cache, state.cache)
    logits = _last_token_logits(flat_logits).astype(jnp.float32)
    # [batch, beam, vocab] log-probabilities of every one-token extension.
    log_probs = (jax.nn.log_softmax(logits).reshape(batch, beam, logits.shape[-1]) +
                 state.live_logprobs[:, :, None])

    candidates = _grow_beams(log_probs, state.live_seqs, step, forced, eos_id)
    live_seqs, live_logprobs, parent = _select_live(candidates, beam)
    # The surviving beams' caches are their parents' caches, written this step.
    flat_parent = (jnp.arange(batch)[:, None] * beam + parent).reshape(batch * beam)
    new_cache = cache_map(lambda x: jnp.take(x, flat_parent, axis=cache_offset), new_cache,
                          cache_offset, apply_to_index=prefilled)
    # Sequence length counts the prompt (initial_index) and the token just chosen.
    lengths = initial_index[:, None] + (step[:, None] + 1)  # [batch, 1]
    return _merge_finished(state, candidates, lengths, alpha).replace(
        step=state.step + 1, live_logprobs=live_logprobs, live_seqs=live_seqs, cache=new_cache)

  return _search_result(loop_fn(cond_fn, body_fn, state0), length, prompts)


# ------------------------------------------------------------------------------------------------
# Speculative beam search: the same search, several steps per target call.


@flax.struct.dataclass
class _TreeCursor:
  """Where each live beam is in the verified tree during a replay, [batch * beam] int32 each.

  Stands in for the cache while steps are replayed, so `body_fn` reorders it with the beams.
  root: the row whose tree holds the beam. node: the node whose logits the step used.
  """
  root: Array
  node: Array


@flax.struct.dataclass
class _Votes:
  """What is known of beam_search's stop decision while the examples are at different steps.

  beam_search steps on from step s unless the examples are at a limit, or every example votes
  `terminated` at s, or every example votes `below_min` at s (`cond_fn(state, per_example=True)`).
  An example's votes are recorded at each step it reaches; a settled example's later votes are
  implied by its present ones (see `_settled`).

  terminated, below_min: [batch, total] bool, column s: the example's votes after s steps.
  settled: [batch] bool, the example no longer steps: no later step of beam_search can change its
           result, its later `terminated` votes are all True, and so are its later `below_min`
           votes where its present one is.
  woken:   [batch] bool, a settled example resumed because its later `below_min` votes (unknown
           while its present one is False) may decide the stop; it never settles again.
  """
  terminated: Array
  below_min: Array
  settled: Array
  woken: Array


@flax.struct.dataclass
class SpeculativeBeamState:
  """The carry of `speculative_beam_search`'s loop: one iteration (round) per target call.

  beams:        the `BeamState` of the search, with a [batch] step (its cache is the target's).
  draft_cache:  the draft's cache, [batch * beam] rows like the target's.
  draft_behind: [batch * beam] bool, the draft's cache lacks the token before the live beam's
                last one (a path through a leaf of the tree, which the draft never fed).
  stats:        `DecodeStats` per example ([batch]).
  votes:        `_Votes`, the examples' stop votes.
  progressed:   scalar bool, the last round moved an example (a guard: rounds always do).
  """
  beams: BeamState
  draft_cache: PyTree
  draft_behind: Array
  stats: DecodeStats
  votes: _Votes
  progressed: Array


def _draft_tree(tree: TokenTree, branching: Tuple[int, ...], draft_fn: Callable,
                draft_cache: PyTree, root: Array, previous: Array, behind: Array,
                index: Array, sequences: Array, forced: Optional[Array], eos_id: int
                ) -> Tuple[Array, PyTree]:
  """The draft's tree below each row's last token: tokens [rows, nodes], and the draft cache.

  Node children are the draft's most likely next tokens other than EOS (the forced token
  inside a prompt).
  One draft call per level above the leaves; the first also feeds the token the draft is behind
  by. root, previous: [rows] the live beam's last token and the one before; index: [rows] the
  root's position; forced: [rows, levels] prompt tokens of levels 1.. (0 = free) or None.
  """
  rows = root.shape[0]
  behind_i = behind.astype(jnp.int32)
  # Rows that are behind feed (previous, root) from index - 1; the others (root, root) from
  # index, where the second copy lands in a slot the tree overwrites or never reads.
  first = jnp.stack([jnp.where(behind, previous, root), root], axis=1)
  logits, draft_cache = _call_tree(draft_fn, first, index - behind_i, draft_cache, sequences)
  node_logits = logits[jnp.arange(rows), behind_i][:, None, :]  # [rows, 1, vocab]
  levels = [root[:, None]]
  for depth, width in enumerate(branching):
    if depth:
      node_logits, draft_cache = _call_tree(draft_fn, levels[-1], index, draft_cache, sequences,
                                            tree, tree.level_starts[depth + 1])
    # A live beam never ends in EOS (such candidates go to the finished set, which needs no
    # logits), so EOS children would waste the node.
    children = lax.top_k(node_logits.at[..., eos_id].set(-jnp.inf), width)[1].reshape(rows, -1)
    if forced is not None:
      children = jnp.where(forced[:, depth:depth + 1] != 0, forced[:, depth:depth + 1], children)
    levels.append(children.astype(jnp.int32))
  return jnp.concatenate(levels, axis=1), draft_cache


def _tree_child(tree: TokenTree, tokens: Array, node: Array, token: Array) -> Array:
  """The child of node [rows] holding token [rows] in trees tokens [rows, nodes]; -1 if none."""
  ids = jnp.asarray(tree.children)[node]  # [rows, max_branch]
  child_tokens = jnp.take_along_axis(tokens, jnp.maximum(ids, 0), axis=1)
  match = (ids >= 0) & (child_tokens == token[:, None])
  first = jnp.argmax(match, axis=1)
  return jnp.where(jnp.any(match, axis=1), jnp.take_along_axis(ids, first[:, None], axis=1)[:, 0],
                   -1)


# Relative slack on the settling bound: the brevity penalties it divides by are computed in
# other shapes than body_fn's and might round differently in the last bits.
_SETTLE_MARGIN = 1e-5


def _settled(state: BeamState, terminated: Array, initial_index: Array, last_step: Array,
             forced: Optional[Array], alpha: float) -> Array:
  """Whether no later step of beam_search can change each example's result, [batch] bool.

  The result is the finished set once every slot holds an EOS-ended beam. A later candidate's
  log-prob is at most the best live beam's (log-probs only fall while no prompt token is left to
  force: `forced` [batch, total] or None), so its score is at most that over the brevity penalty
  of a length it can still reach (steps step..last_step - 1, `last_step` a scalar, lengths
  initial_index [batch] + step + 1); below the worst finished score it never enters the set.
  Finished scores must be distinct too: re-ranking an unchanged set swaps tied entries. And
  T5X's own vote `terminated` [batch] must hold: it then holds at every later step as well.
  """
  step = state.step
  later = jnp.arange(state.live_seqs.shape[2])[None, :]  # more steps than a search takes
  reachable = (later >= step[:, None]) & (later < last_step)
  penalty = brevity_penalty(alpha, initial_index[:, None] + later + 1)
  bound = jnp.max(jnp.where(reachable, state.live_logprobs[:, -1:] / penalty, -jnp.inf), axis=1)
  scores = state.finished_scores
  settled = (terminated & jnp.all(state.finished_flags, axis=1) &
             jnp.all(scores[:, 1:] > scores[:, :-1], axis=1) &
             (scores[:, 0] > bound * (1.0 - _SETTLE_MARGIN)))  # bound <= 0
  if forced is not None:
    settled &= ~jnp.any((forced != 0) & (later > step[:, None]), axis=1)
  return settled


def _proven(votes: _Votes, step: Array, at_limit: Array) -> Tuple[Array, Array]:
  """Whether beam_search is known to step on, or known to stop, from each example's own step.

  step, at_limit: [batch] (at_limit: `cond_fn`'s vote at that step). Another example's votes at
  that step are known if it has reached the step or is settled. Returns (go, stop), [batch]
  bool; both False while the decision waits for an example that is behind.
  """
  reached = step[None, :] >= step[:, None]  # [example, other]: other has reached example's step
  settled = votes.settled[None, :]
  below_now = jnp.take_along_axis(votes.below_min, step[:, None], axis=1)[:, 0]
  # [example, other]: other's votes at example's step, True where only implied by settling.
  terminated = jnp.where(reached, votes.terminated[:, step].T, True)
  below_min = jnp.where(reached, votes.below_min[:, step].T, True)
  terminated_known = reached | settled
  below_known = reached | (settled & below_now[None, :])
  go = (~at_limit & jnp.any(terminated_known & ~terminated, axis=1) &
        jnp.any(below_known & ~below_min, axis=1))
  stop = (at_limit | jnp.all(terminated_known & terminated, axis=1) |
          jnp.all(below_known & below_min, axis=1))
  return go, stop


def _open(state: BeamState, votes: _Votes, cond_fn: Callable) -> Array:
  """[batch] bool: the example may still step (not settled, not known to have stopped)."""
  _, stop = _proven(votes, state.step, cond_fn(state, per_example=True)[0])
  return ~votes.settled & ~stop


def _record_votes(votes: _Votes, state: BeamState, went: Array, cond_fn: Callable,
                  settle_fn: Callable) -> _Votes:
  """`votes` with the votes of the examples that went [batch] a step recorded at their new
  step; those whose result is then final settle (unless woken before)."""
  _, terminated, below_min = cond_fn(state, per_example=True)
  column = went[:, None] & (jnp.arange(votes.terminated.shape[1])[None, :] == state.step[:, None])
  return votes.replace(
      terminated=jnp.where(column, terminated[:, None], votes.terminated),
      below_min=jnp.where(column, below_min[:, None], votes.below_min),
      settled=votes.settled | (went & ~votes.woken & settle_fn(state, terminated)))


def _wake(votes: _Votes, state: BeamState, cond_fn: Callable) -> _Votes:
  """Resumes settled examples whose later `below_min` votes are unknown (their present one is
  False) if an open example votes below_min: beam_search's stop may then wait on them."""
  below_now = jnp.take_along_axis(votes.below_min, state.step[:, None], axis=1)[:, 0]
  waiting = jnp.any(_open(state, votes, cond_fn) & below_now)
  wake = votes.settled & ~below_now & waiting
  return votes.replace(settled=votes.settled & ~wake, woken=votes.woken | wake)


def _where_examples(go: Array, new: PyTree, old: PyTree) -> PyTree:
  """`new` for the examples where go [batch], else `old`; leaves [batch, ...] or [rows, ...]."""

  def pick(a, b):
    mask = jnp.repeat(go, a.shape[0] // go.shape[0])
    return jnp.where(mask.reshape(mask.shape + (1,) * (a.ndim - 1)), a, b)

  return jax.tree_util.tree_map(pick, new, old)


def _replay(body_fn: Callable, cond_fn: Callable, settle_fn: Callable, tree: TokenTree,
            tokens: Array, logits: Array, state: BeamState, votes: _Votes
            ) -> Tuple[BeamState, _Votes, Array]:
  """Replays beam_search's steps on verified trees, each example as far as it may and can.

  An example steps while beam_search is known to step on from its step (`_proven`) and its
  live beams are nodes of its trees; one that waits for a vote of an example behind goes on
  when that one catches up, in this round or a later one. Stepping one example never ends
  another's replay.
  state: `BeamState` with step [batch] and a `_TreeCursor` at the roots for cache; tokens
  [rows, nodes] the trees, logits [rows, nodes, vocab] their nodes' next-token logits.
  Returns (state, votes, in_tree [batch]: no beam of the example has left its tree).
  """
  batch, rows = state.step.shape[0], tokens.shape[0]
  beam = rows // batch

  def may_step(replayed, in_tree, votes):
    go, _ = _proven(votes, replayed.step, cond_fn(replayed, per_example=True)[0])
    return go & in_tree & ~votes.settled

  def step(carry):
    replayed, node, in_tree, votes, go = carry
    cursor = replayed.cache.replace(node=node)
    stepped = body_fn(replayed.replace(cache=cursor), logits=logits[cursor.root, node])
    replayed = _where_examples(go, stepped, replayed)
    cursor = replayed.cache  # the new beams' parents' cursors
    new_token = jnp.take_along_axis(replayed.live_seqs.reshape(rows, -1),
                                    jnp.repeat(replayed.step, beam)[:, None], axis=1,
                                    mode='clip')[:, 0]
    child = _tree_child(tree, tokens[cursor.root], cursor.node, new_token)
    in_tree = jnp.where(go, jnp.all(child.reshape(batch, beam) >= 0, axis=1), in_tree)
    node = jnp.where(jnp.repeat(go, beam), child, node)
    votes = _record_votes(votes, replayed, go, cond_fn, settle_fn)
    return replayed, node, in_tree, votes, may_step(replayed, in_tree, votes)

  in_tree = jnp.ones((batch,), jnp.bool_)
  init = (state, jnp.zeros((rows,), jnp.int32), in_tree, votes, may_step(state, in_tree, votes))
  replayed, _, in_tree, votes, _ = lax.while_loop(lambda c: jnp.any(c[-1]), step, init)
  return replayed, votes, in_tree


def _count_round(stats: DecodeStats, took_part: Array, steps: Array, in_tree: Array,
                 tree: TokenTree) -> DecodeStats:
  """`stats` [batch] after a round that the examples with took_part [batch] took part in, each
  taking steps [batch] beam steps; in_tree [batch] as `_replay` returns it."""
  part = took_part.astype(jnp.int32)
  max_depth = tree.max_depth
  return DecodeStats(
      target_calls=stats.target_calls + part,
      draft_calls=stats.draft_calls + max_depth * part,
      proposed=stats.proposed + (tree.nodes - 1) * part,
      accepted=stats.accepted + jnp.maximum(steps - 1, 0),
      accepted_at=stats.accepted_at + (jnp.arange(max_depth)[None, :] <
                                       steps[:, None] - 1).astype(jnp.int32),
      emitted=stats.emitted + steps,
      fallbacks=stats.fallbacks,
      rollbacks=stats.rollbacks + (took_part & ~in_tree & (steps <= max_depth)).astype(jnp.int32))


def speculative_beam_search(inputs: Array,
                            cache: PyTree,
                            tokens_to_logits: Callable[[DecodingState], Tuple[Array, PyTree]],
                            draft_cache: PyTree,
                            draft_tokens_to_logits: Callable[[DecodingState],
                                                             Tuple[Array, PyTree]],
                            eos_id: int,
                            num_decodes: int = 4,
                            alpha: float = 0.6,
                            max_decode_len: Optional[int] = None,
                            max_decode_step: int = -1,
                            min_log_prob: float = NEG_INF,
                            decode_rng: Optional[Array] = None,
                            cache_offset: int = 0,
                            initial_index: Optional[Array] = None,
                            branching: Sequence[int] = (8,),
                            return_stats: bool = False):
  """`beam_search`'s beams and scores, with several search steps per target call.

  Each iteration (a round):
    1. draft: below every live beam's last token the draft model grows a token tree, each node at
       depth d getting the draft's branching[d] most likely next tokens (one draft call per level);
    2. verify: one target call scores every tree node (`network.Decoder.tree_step`: each node
       attends to its row's cache and its own ancestors), giving each node the target's exact
       next-token logits;
    3. replay: beam_search's own step (`body_fn`) runs on those logits, step after step, for each
       example while every one of its new live beams is a node of its trees (finished beams need
       no further logits); at the latest the step after the leaves leaves the trees. Each beam's
       cache row becomes its tree's row with the beam's path kept (`DecoderCache.keep_tree_path`).
  Every step is beam_search's arithmetic on the target's log-probabilities, so the result is
  beam_search's on the target (to float rounding of the logits: a tree call and a one-token call
  sum in different orders, which can only matter for candidates tied to ~1e-6). What changes is
  the number of target calls: one per round instead of one per step.

  Rounds are per example: each keeps its own step (the next round's trees start there), and an
  example whose beams leave its trees stops for the round without stopping the others. The
  examples' steps are independent except for beam_search's stop decision, which is shared: it
  steps every example on until all vote to stop at the same step. So an example steps on only
  where that decision is known (`_Votes`: from the votes at that step of the examples that have
  reached it), and every example ends at beam_search's last step, except one that settles before
  (`_settled`: all its beams finished and no later step can change them), which stops there.

  Arguments and results are `beam_search`'s, plus:
    draft_cache / draft_tokens_to_logits: the draft model's, as in `decoding.speculative_sample`.
      Both models' callables must accept `TreeDecodingState` (`models.make_tokens_to_logits`)
      and both caches must be `network.DecoderCache`s (cache_offset 0); the draft and the
      target share the vocabulary and EOS id.
    branching: children per node at each depth; the tree has 1 + b0 + b0 b1 + ... nodes per
      live beam and a round replays at most len(branching) + 1 steps of an example.
    return_stats: also return a `DecodeStats` ([batch, beam], equal over beams), per example:
      target_calls the rounds it took part in (it had not settled or stopped when the round
      began; a round in which it waited for an example behind counts, with no step), draft_calls
      the draft calls and proposed the tree nodes below the roots of those rounds, emitted the
      beam steps it took, accepted its steps beyond the first of each round
      (accepted_at[:, :, d]: its rounds that replayed past depth d), and rollbacks its rounds
      ended by a beam outside its tree before the leaves (not by the tree's depth, a wait or
      the search's end). `tokens_per_target_call` is then the example's beam steps per target
      call.
  """
  branching = tuple(int(b) for b in branching)
  tree = token_tree(branching)
  check_tree_caches('speculative_beam_search', cache, draft_cache, cache_offset)
  beam = num_decodes
  batch, input_length = inputs.shape
  length = input_length if max_decode_len is None else max_decode_len
  total = length + 1
  rows = batch * beam
  max_depth = tree.max_depth
  example_index = (jnp.zeros((batch,), jnp.int32) if initial_index is None else
                   jnp.asarray(initial_index, jnp.int32))
  flat_index = jnp.repeat(example_index, beam)
  forced = forced_rows = None
  if initial_index is None:
    # As beam_search forces them. Padded so that the levels below the last slot read 0.
    forced = _prompt_tokens(inputs, total)
    forced_rows = jnp.repeat(jnp.pad(forced, ((0, 0), (0, max_depth + 1))), beam, axis=0)
  # Steps are taken from step s while s + min(initial_index) < total - 1 (and s < max_decode_step).
  last_step = total - 1 - jnp.min(example_index)
  last_step = jnp.where(max_decode_step > 0, jnp.minimum(last_step, max_decode_step), last_step)
  settle_fn = functools.partial(_settled, initial_index=example_index, last_step=last_step,
                                forced=forced, alpha=alpha)
  # The tree's slots start at the root's position: room for them past the last position.
  cache = cache.extend(tree.nodes)
  draft_cache = cache_map(lambda x: jnp.repeat(x, beam, axis=0), draft_cache.extend(tree.nodes))
  final_stats = []

  def round_fn(cond_fn: Callable, body_fn: Callable,
               carry: SpeculativeBeamState) -> SpeculativeBeamState:
    state, votes = carry.beams, carry.votes
    took_part = _open(state, votes, cond_fn)
    row_step = jnp.repeat(state.step, beam)
    index = flat_index + row_step  # [rows] the live beams' last tokens' positions
    sequences = state.live_seqs.reshape(rows, total)
    root = jnp.take_along_axis(sequences, row_step[:, None], axis=1)[:, 0]
    previous = jnp.take_along_axis(sequences, jnp.maximum(row_step - 1, 0)[:, None], axis=1)[:, 0]
    level_forced = None
    if forced_rows is not None:
      level_forced = jnp.take_along_axis(forced_rows, row_step[:, None] + 1 + jnp.arange(max_depth),
                                         axis=1)
    tokens, draft_cache = _draft_tree(tree, branching, draft_tokens_to_logits, carry.draft_cache,
                                      root, previous, carry.draft_behind, index, sequences,
                                      level_forced, eos_id)
    logits, target_cache = _call_tree(tokens_to_logits, tokens, index, state.cache, sequences,
                                      tree, tree.nodes)  # [rows, nodes, vocab]
    start = state.replace(cache=_TreeCursor(root=jnp.arange(rows),
                                            node=jnp.zeros((rows,), jnp.int32)))
    replayed, new_votes, in_tree = _replay(body_fn, cond_fn, settle_fn, tree, tokens, logits,
                                           start, votes)
    steps = replayed.step - state.step  # [batch]
    row_steps = jnp.repeat(steps, beam)
    cursor = replayed.cache
    # Each beam's row: its tree's row (same example, so the same cross-attention entries) with
    # the path down to the node its last step used (depth steps - 1; nothing kept without a
    # step). The target fed all of it, the draft all but the leaves.
    path = jnp.asarray(tree.paths)[cursor.node]
    target_cache = target_cache.with_index(index).keep_tree_path(path, row_steps, cursor.root)
    draft_cache = draft_cache.with_index(index).keep_tree_path(
        path, jnp.minimum(row_steps, max_depth), cursor.root)
    beams = replayed.replace(cache=target_cache)
    new_votes = _wake(new_votes, beams, cond_fn)
    return SpeculativeBeamState(
        beams=beams, draft_cache=draft_cache, draft_behind=row_steps > max_depth,
        stats=_count_round(carry.stats, took_part, steps, in_tree, tree), votes=new_votes,
        progressed=jnp.any(steps > 0) | jnp.any(new_votes.woken & ~votes.woken))

  def loop_fn(cond_fn: Callable, body_fn: Callable, state0: BeamState) -> BeamState:
    state0 = state0.replace(step=jnp.zeros((batch,), jnp.int32))
    _, terminated, below_min = cond_fn(state0, per_example=True)
    no = jnp.zeros((batch, total), jnp.bool_)
    votes = _Votes(terminated=no.at[:, 0].set(terminated), below_min=no.at[:, 0].set(below_min),
                   settled=no[:, 0], woken=no[:, 0])
    init = SpeculativeBeamState(beams=state0, draft_cache=draft_cache,
                                draft_behind=jnp.zeros((rows,), jnp.bool_),
                                stats=DecodeStats.zeros(batch, max_depth), votes=votes,
                                progressed=jnp.array(True))
    final = lax.while_loop(lambda c: jnp.any(_open(c.beams, c.votes, cond_fn)) & c.progressed,
                           functools.partial(round_fn, cond_fn, body_fn), init)
    final_stats.append(final.stats)  # read back below, in the same trace
    return final.beams

  decodes, scores = beam_search(
      inputs, cache, tokens_to_logits, eos_id, num_decodes=num_decodes, alpha=alpha,
      max_decode_len=max_decode_len, max_decode_step=max_decode_step, min_log_prob=min_log_prob,
      decode_rng=decode_rng, cache_offset=cache_offset, initial_index=initial_index,
      loop_fn=loop_fn)
  if not return_stats:
    return decodes, scores
  stats = jax.tree_util.tree_map(lambda x: jnp.repeat(x[:, None], beam, axis=1), final_stats[0])
  return decodes, scores, stats
