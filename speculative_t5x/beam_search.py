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
(tree attention), and `beam_search`'s own step is replayed on those logits for as long as the
search stays inside the tree.

Shapes: `batch` examples, `beam` = num_decodes, `vocab` output classes, `length` = max_decode_len,
`total` = length + 1 (the sequences carry a leading BOS slot, as in T5X).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional, Sequence, Tuple

import flax
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from speculative_t5x.decoding import DecodeStats, DecodingState, TreeDecodingState, cache_map
from speculative_t5x.decoding import match_container

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
                initial_index: Optional[Array] = None,
                loop_fn: Callable = lax.while_loop) -> Tuple[Array, Array]:
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
    loop_fn: runs the search as `loop_fn(cond_fn, body_fn, initial BeamState) -> final
      BeamState`, `lax.while_loop`'s signature. `body_fn(state, logits=None)` is one step; given
      the live beams' next-token logits [batch * beam, vocab] it uses them instead of calling
      tokens_to_logits and leaves the cache to the caller, only reordering its rows with the
      beams (`speculative_beam_search` replays steps on logits of a verified token tree).

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

  def body_fn(state: BeamState, logits: Optional[Array] = None) -> BeamState:
    step = state.step
    cur_token = lax.dynamic_slice_in_dim(state.live_seqs, step, 1, axis=2)  # [batch, beam, 1]
    decoding_state = DecodingState(
        cur_index=flat_initial_index + step,
        sequences=state.live_seqs.reshape(batch * beam, total),
        cur_token=cur_token.reshape(batch * beam, 1),
        cache=state.cache)
    flat_logits, new_cache = (tokens_to_logits(decoding_state) if logits is None else
                              (logits, state.cache))
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

  final = loop_fn(cond_fn, body_fn, state0)

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


# ------------------------------------------------------------------------------------------------
# Speculative beam search: the same search, several steps per target call.


class TokenTree(NamedTuple):
  """The static shape of a draft tree: every node at depth d has branching[d] children.

  Nodes are numbered breadth first (the root is 0, each level follows the previous one, the
  children of a node are contiguous), which is also the order of their cache slots.
  Shapes: `nodes` = 1 + b0 + b0 b1 + ..., `max_depth` = len(branching).

  depths:       [nodes] int32, root 0.
  ancestors:    [nodes, nodes] bool, ancestors[n, m]: m is n or an ancestor of n.
  paths:        [nodes, max_depth + 1] int32, the root-to-node path of n (padded with n).
  children:     [nodes, max(branching)] int32, child ids, -1 where there is none.
  level_starts: the first node of each level, then `nodes` (Python ints, max_depth + 2 of them).
  """
  depths: np.ndarray
  ancestors: np.ndarray
  paths: np.ndarray
  children: np.ndarray
  level_starts: Tuple[int, ...]

  @property
  def nodes(self) -> int:
    return self.level_starts[-1]

  @property
  def max_depth(self) -> int:
    return len(self.level_starts) - 2


def token_tree(branching: Sequence[int]) -> TokenTree:
  """The `TokenTree` in which each node at depth d has branching[d] children."""
  branching = tuple(int(b) for b in branching)
  if not branching or min(branching) < 1:
    raise ValueError(f'branching must be a non-empty sequence of positive ints, got {branching}.')
  parents, depths, level_starts = [-1], [0], [0, 1]
  for depth, width in enumerate(branching):
    for parent in range(level_starts[depth], level_starts[depth + 1]):
      parents += [parent] * width
      depths += [depth + 1] * width
    level_starts.append(len(parents))
  nodes, max_depth = len(parents), len(branching)
  ancestors = np.zeros((nodes, nodes), bool)
  paths = np.zeros((nodes, max_depth + 1), np.int32)
  children = np.full((nodes, max(branching)), -1, np.int32)
  for n in range(nodes):
    m = n
    while m >= 0:
      ancestors[n, m] = True
      paths[n, depths[m]] = m
      m = parents[m]
    paths[n, depths[n] + 1:] = n
  for n in range(1, nodes):
    free = np.argmax(children[parents[n]] < 0)  # children are listed in node order
    children[parents[n], free] = n
  return TokenTree(np.asarray(depths, np.int32), ancestors, paths, children, tuple(level_starts))


@flax.struct.dataclass
class _TreeCursor:
  """Where each live beam is in the verified tree during a replay, [batch * beam] int32 each.

  Stands in for the cache while steps are replayed, so `body_fn` reorders it with the beams.
  root: the row whose tree holds the beam. node: the node whose logits the step used.
  """
  root: Array
  node: Array


@flax.struct.dataclass
class SpeculativeBeamState:
  """The carry of `speculative_beam_search`'s loop: one iteration per target call.

  beams:        the `BeamState` of the search (its cache is the target's).
  draft_cache:  the draft's cache, [batch * beam] rows like the target's.
  draft_behind: [batch * beam] bool, the draft's cache lacks the token before the live beam's
                last one (a path through a leaf of the tree, which the draft never fed).
  stats:        `DecodeStats` per example ([batch]).
  """
  beams: BeamState
  draft_cache: PyTree
  draft_behind: Array
  stats: DecodeStats


def _call_tree(fn: Callable, tokens: Array, index: Array, cache: PyTree, sequences: Array,
               tree: Optional[TokenTree] = None, end: int = 0) -> Tuple[Array, PyTree]:
  """Feeds the nodes end - k..end-1 of `tree` (tokens [rows, k]) -> (logits [rows, k, vocab]).

  Without a tree, the tokens are a chain at index..index+k-1 (a plain `DecodingState`).
  """
  fields = dict(cur_index=index, sequences=sequences, cur_token=tokens, cache=cache)
  if tree is None:
    state = DecodingState(**fields)
  else:
    start = end - tokens.shape[1]
    state = TreeDecodingState(**fields, tree_depths=jnp.asarray(tree.depths[:end]),
                              tree_mask=jnp.asarray(tree.ancestors[start:end, :end]))
  logits, new_cache = fn(state)
  if logits.ndim == 2:  # [rows, vocab] for one token, as T5X's callables return
    logits = logits[:, None]
  return logits.astype(jnp.float32), match_container(new_cache, cache)


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
    3. replay: beam_search's own step (`body_fn`) runs on those logits, step after step, while
       every new live beam is a tree node (finished beams need no further logits). The first
       step that keeps a beam outside the tree (at the latest the one after the leaves) ends the
       round; each beam's cache row becomes its tree's row with the beam's path kept
       (`DecoderCache.keep_tree_path`).
  Every step is beam_search's arithmetic on the target's log-probabilities, so the result is
  beam_search's on the target (to float rounding of the logits: a tree call and a one-token call
  sum in different orders, which can only matter for candidates tied to ~1e-6). What changes is
  the number of target calls: one per round instead of one per step. Examples of a batch move in
  lockstep (one step counter), so a round ends when any example leaves its trees.

  Arguments and results are `beam_search`'s, plus:
    draft_cache / draft_tokens_to_logits: the draft model's, as in `decoding.speculative_sample`.
      Both models' callables must accept `TreeDecodingState` (`models.make_tokens_to_logits`)
      and both caches must be `network.DecoderCache`s (cache_offset 0); the draft and the
      target share the vocabulary and EOS id.
    branching: children per node at each depth; the tree has 1 + b0 + b0 b1 + ... nodes per
      live beam and a round replays at most len(branching) + 1 steps.
    return_stats: also return a `DecodeStats` ([batch, beam], equal over beams) where
      target_calls counts rounds, draft_calls draft calls, proposed the tree nodes below the
      roots sent to the target, emitted the beam steps taken, accepted the steps beyond the
      first of each round (accepted_at[:, :, d]: rounds that replayed past depth d), and
      rollbacks the rounds ended by a beam outside the tree before the leaves (not by the
      tree's depth or the search's end).
      `tokens_per_target_call` is then beam steps per target call.
  """
  branching = tuple(int(b) for b in branching)
  tree = token_tree(branching)
  if cache_offset != 0 or not hasattr(cache, 'keep_tree_path') or not hasattr(
      draft_cache, 'keep_tree_path'):
    raise ValueError('speculative_beam_search needs network.DecoderCache caches (cache_offset 0) '
                     f'for target and draft; got {type(cache).__name__} and '
                     f'{type(draft_cache).__name__}.')
  beam = num_decodes
  batch, input_length = inputs.shape
  length = input_length if max_decode_len is None else max_decode_len
  total = length + 1
  rows = batch * beam
  max_depth = tree.max_depth
  prefilled = initial_index is not None
  flat_index = jnp.repeat(jnp.zeros((batch,), jnp.int32) if initial_index is None else
                          jnp.asarray(initial_index, jnp.int32), beam)
  forced = None
  if not prefilled:
    # As beam_search forces them: sequence slot j holds inputs[:, j] where non-zero. Padded so
    # that the levels below the last slot read 0.
    n = min(input_length, total)
    forced = jnp.zeros((batch, total + max_depth + 1), jnp.int32).at[:, :n].set(
        jnp.asarray(inputs, jnp.int32)[:, :n])
    forced = jnp.repeat(forced, beam, axis=0)
  # The tree's slots start at the root's position: room for them past the last position.
  cache = cache.extend(tree.nodes)
  draft_cache = cache_map(lambda x: jnp.repeat(x, beam, axis=0), draft_cache.extend(tree.nodes))
  final_stats = []

  def round_fn(cond_fn: Callable, body_fn: Callable,
               carry: SpeculativeBeamState) -> SpeculativeBeamState:
    state = carry.beams
    step = state.step
    index = flat_index + step  # [rows] the live beams' last tokens' positions
    sequences = state.live_seqs.reshape(rows, total)
    root = sequences[:, step]
    previous = sequences[:, jnp.maximum(step - 1, 0)]
    level_forced = None
    if forced is not None:
      level_forced = lax.dynamic_slice_in_dim(forced, step + 1, max_depth, axis=1)
    tokens, draft_cache = _draft_tree(tree, branching, draft_tokens_to_logits, carry.draft_cache,
                                      root, previous, carry.draft_behind, index, sequences,
                                      level_forced, eos_id)
    logits, target_cache = _call_tree(tokens_to_logits, tokens, index, state.cache, sequences,
                                      tree, tree.nodes)  # [rows, nodes, vocab]

    def replay_cond(c):
      replayed, _, in_tree = c
      return in_tree & cond_fn(replayed)

    def replay_body(c):
      replayed, node, _ = c
      cursor = replayed.cache.replace(node=node)
      replayed = body_fn(replayed.replace(cache=cursor), logits=logits[cursor.root, node])
      cursor = replayed.cache  # the new beams' parents' cursors
      new_token = replayed.live_seqs.reshape(rows, total)[:, replayed.step]
      child = _tree_child(tree, tokens[cursor.root], cursor.node, new_token)
      return replayed, child, jnp.all(child >= 0)

    start = state.replace(cache=_TreeCursor(root=jnp.arange(rows),
                                            node=jnp.zeros((rows,), jnp.int32)))
    replayed, _, in_tree = lax.while_loop(replay_cond, replay_body,
                                          (start, jnp.zeros((rows,), jnp.int32), jnp.array(True)))
    cursor = replayed.cache
    depth = jnp.asarray(tree.depths)[cursor.node]  # of the node each beam's last step used
    path = jnp.asarray(tree.paths)[cursor.node]
    # Each beam's row: its tree's row (same example, so the same cross-attention entries) with
    # the path down to that node. The target fed all of it, the draft all but the leaves.
    target_cache = target_cache.with_index(index).keep_tree_path(path, depth + 1, cursor.root)
    draft_cache = draft_cache.with_index(index).keep_tree_path(
        path, jnp.minimum(depth + 1, max_depth), cursor.root)

    steps = replayed.step - step
    stats = carry.stats
    ones = jnp.ones((batch,), jnp.int32)
    stats = DecodeStats(
        target_calls=stats.target_calls + ones,
        draft_calls=stats.draft_calls + max_depth * ones,
        proposed=stats.proposed + (tree.nodes - 1) * ones,
        accepted=stats.accepted + (steps - 1) * ones,
        accepted_at=stats.accepted_at + (jnp.arange(max_depth) < steps - 1)[None, :].astype(
            jnp.int32),
        emitted=stats.emitted + steps * ones,
        fallbacks=stats.fallbacks,
        rollbacks=stats.rollbacks + (~in_tree & (steps <= max_depth)).astype(jnp.int32) * ones)
    return SpeculativeBeamState(beams=replayed.replace(cache=target_cache),
                                draft_cache=draft_cache, draft_behind=depth >= max_depth,
                                stats=stats)

  def loop_fn(cond_fn: Callable, body_fn: Callable, state0: BeamState) -> BeamState:
    init = SpeculativeBeamState(beams=state0, draft_cache=draft_cache,
                                draft_behind=jnp.zeros((rows,), jnp.bool_),
                                stats=DecodeStats.zeros(batch, max_depth))
    final = lax.while_loop(lambda c: cond_fn(c.beams),
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
