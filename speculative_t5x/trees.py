"""Token trees: their static shape, tree calls, and exact speculative sampling over a tree.

A `TokenTree` is the static shape of a draft's proposals: every node at depth d has
branching[d] children. The target scores all nodes in one call (tree attention,
`network.Decoder.tree_step`), and one root-to-node path is committed to the caches
(`network.DecoderCache.keep_tree_path`). Speculative beam search (`beam_search.py`) replays beam
steps over such trees; `tree_speculative_sample` samples over them:

  1. draft: below each row's last token the draft grows the tree level by level (one draft call
     per level), each node's children drawn from the draft's q at that node *without
     replacement* (Gumbel top-k: the order of a sequential draw without replacement);
  2. verify: one target call gives every node the target's sampling distribution p;
  3. accept: from the root, recursive rejection sampling (SpecInfer; Hu et al. 2025 for drafts
     without replacement): the node's children are tried in the order drawn, child x with
     probability min(1, p(x) / q'(x)), q' the draft's q with the children already tried removed
     and renormalised; after a rejection p becomes norm(max(p - q', 0)). An accepted child is
     the next node (with its own fresh p); when every child is rejected, or below a leaf, one
     token is drawn from the current p. The output distribution is the target's.
  4. commit: the accepted path and that token, as `decoding`'s loop commits a chain.

A chain, branching (1,) * gamma, is token verification of gamma draft tokens. At temperature 0
(static) children are the draft's top-k tokens and a child stands when it is the target's argmax,
so the output is the target's greedy output.

Shapes: `rows` = batch x num_decodes, `nodes` = 1 + b0 + b0 b1 + ..., `vocab` output classes.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from speculative_t5x import decoding
from speculative_t5x.decoding import DecodingState, TreeDecodingState, match_container

Array = jnp.ndarray
PyTree = Any


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


def check_tree_caches(decoder: str, cache: PyTree, draft_cache: PyTree,
                      cache_offset: int) -> None:
  """Raises ValueError unless both caches can hold a tree (`network.DecoderCache`s, offset 0)
  and the draft is no feature draft."""
  if cache_offset != 0 or not hasattr(cache, 'keep_tree_path') or not hasattr(
      draft_cache, 'keep_tree_path'):
    raise ValueError(f'{decoder} needs network.DecoderCache caches (cache_offset 0) for target '
                     f'and draft; got {type(cache).__name__} and {type(draft_cache).__name__}.')
  if getattr(draft_cache, 'hidden', None) is not None:
    raise ValueError(f'{decoder}: a feature draft does not draft token trees (each node would '
                     "need its parent's own feature); use speculative_sample.")


def call_tree(fn: Callable, tokens: Array, index: Array, cache: PyTree, sequences: Array,
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



# ------------------------------------------------------------------------------------------------
# Exact speculative sampling over a token tree.


class _Walk(NamedTuple):
  """The accepted path of every row: path [rows, depth + 1] node ids (root 0, repeated after the
  last accepted node), num_accepted [rows] (the path's depth), extra [rows] the token after it."""
  path: Array
  num_accepted: Array
  extra: Array


def _draft_tree(cfg: decoding._LoopConfig, tree: TokenTree, branching: Tuple[int, ...],
                state: decoding.LoopState, draft_fn: Callable, forced_chunk: Array,
                rng: Optional[Array]) -> Tuple[Array, Optional[Array], PyTree]:
  """The draft's tree below each row's last token: (tokens [rows, nodes], q [rows, inner nodes,
  vocab] the draft's sampling distribution at every node above the leaves (None when greedy),
  draft cache). One draft call per level; the first re-feeds the token before the root, which
  the cache lacks after a path through a leaf (rewriting an entry with the same token is a
  no-op). forced_chunk [rows, depth + 1]: the prompt token of each depth 1.. (0 = free)."""
  rows = state.length.shape[0]
  start = jnp.maximum(state.length - 1, 0)
  first = jnp.take_along_axis(state.sequences, start[:, None] + jnp.arange(2)[None], axis=1)
  logits, cache = decoding._call(draft_fn, first, start, state.draft_cache, state.sequences,
                                 logits_at=state.length - start)
  levels = [jnp.take_along_axis(state.sequences, state.length[:, None], axis=1)]
  dists = []
  for depth, width in enumerate(branching):
    if depth:
      logits, cache = call_tree(draft_fn, levels[-1], state.length, cache, state.sequences,
                                tree, tree.level_starts[depth + 1])
    forced = forced_chunk[:, depth][:, None]  # [rows, 1] against [rows, level nodes]
    if cfg.greedy:
      children = lax.top_k(logits, width)[1]
    else:
      rng, key = jax.random.split(rng)
      log_q = decoding._force(decoding.sampling_log_probs(logits, cfg.temperature, cfg.topk,
                                                          cfg.topp), jnp.broadcast_to(
                                                              forced, logits.shape[:2]))
      children = _draw_children(key, log_q, width)
      dists.append(jnp.exp(log_q))
    children = jnp.where(forced[..., None] > 0, forced[..., None], children)
    levels.append(children.reshape(rows, -1).astype(jnp.int32))
  q = None if cfg.greedy else jnp.concatenate(dists, axis=1)
  return jnp.concatenate(levels, axis=1), q, cache


def _draw_children(rng: Array, log_q: Array, width: int) -> Array:
  """`width` distinct tokens [..., width] in the order of a draw without replacement from q
  (log_q [..., vocab]): Gumbel top-k (Kool et al. 2019)."""
  return lax.top_k(log_q + jax.random.gumbel(rng, log_q.shape), width)[1]


def _walk_greedy(tree: TokenTree, branching: Tuple[int, ...], target_tokens: Array,
                 tokens: Array) -> _Walk:
  """From the root, the child holding the target's argmax (target_tokens [rows, nodes], prompt
  tokens forced) while there is one; then the argmax itself."""
  rows = tokens.shape[0]
  node = jnp.zeros((rows,), jnp.int32)
  alive = jnp.ones((rows,), jnp.bool_)
  path, num_accepted = [node], jnp.zeros((rows,), jnp.int32)
  for _ in branching:
    child = _child_with(tree, tokens, node, target_tokens[jnp.arange(rows), node])
    alive &= child >= 0
    node = jnp.where(alive, child, node)
    num_accepted += alive
    path.append(node)
  return _Walk(jnp.stack(path, axis=1), num_accepted, target_tokens[jnp.arange(rows), node])


def _child_with(tree: TokenTree, tokens: Array, node: Array, token: Array) -> Array:
  """The first child of node [rows] holding token [rows] in trees tokens [rows, nodes]; -1 if
  none."""
  ids = jnp.asarray(tree.children)[node]  # [rows, max_branch]
  child_tokens = jnp.take_along_axis(tokens, jnp.maximum(ids, 0), axis=1)
  match = (ids >= 0) & (child_tokens == token[:, None])
  first = jnp.take_along_axis(ids, jnp.argmax(match, axis=1)[:, None], axis=1)[:, 0]
  return jnp.where(jnp.any(match, axis=1), first, -1)


def _normalised(weights: Array, fallback: Array) -> Array:
  total = jnp.sum(weights, axis=-1, keepdims=True)
  return jnp.where(total > 0, weights / jnp.where(total > 0, total, 1.0), fallback)


def _try_children(children: Array, tokens: Array, p: Array, q: Array, uniform: Array,
                  alive: Array) -> Tuple[Array, Array]:
  """Recursive rejection sampling at one node per row: (accepted child or -1 [rows], the
  residual p [rows, vocab] after the rejections).

  children [rows, width] node ids (-1: none) in the order drawn; p, q [rows, vocab] the
  target's and the draft's distributions at the node; uniform [rows, width].
  """
  rows = jnp.arange(children.shape[0])
  accepted = jnp.full(children.shape[:1], -1, jnp.int32)
  remaining = q
  for i in range(children.shape[1]):
    x = tokens[rows, jnp.maximum(children[:, i], 0)]
    q_i = _normalised(remaining, jnp.zeros_like(remaining))  # q without the children tried
    q_x = q_i[rows, x]
    trying = alive & (accepted < 0) & (children[:, i] >= 0) & (q_x > 0)
    accept = trying & (uniform[:, i] * q_x < p[rows, x])
    reject = trying & ~accept
    p = jnp.where(reject[:, None], _normalised(jnp.maximum(p - q_i, 0.0), p), p)
    remaining = jnp.where(reject[:, None] & (jnp.arange(q.shape[-1])[None] == x[:, None]), 0.0,
                          remaining)
    accepted = jnp.where(accept, children[:, i], accepted)
  return accepted, p


def _walk_sampled(tree: TokenTree, branching: Tuple[int, ...], p: Array, q: Array,
                  tokens: Array, rng: Array) -> _Walk:
  """Recursive rejection sampling from the root: p [rows, nodes, vocab] the target's sampling
  distributions at every node, q [rows, inner nodes, vocab] the draft's."""
  rows = tokens.shape[0]
  accept_rng, extra_rng = jax.random.split(rng)
  uniform = jax.random.uniform(accept_rng, (rows, len(branching), max(branching)))
  node = jnp.zeros((rows,), jnp.int32)
  alive = jnp.ones((rows,), jnp.bool_)
  residual = p[:, 0]
  path, num_accepted = [node], jnp.zeros((rows,), jnp.int32)
  for depth, width in enumerate(branching):
    children = jnp.asarray(tree.children)[node][:, :width]
    child, after = _try_children(children, tokens, residual, q[jnp.arange(rows), node],
                                 uniform[:, depth, :width], alive)
    alive &= child >= 0
    node = jnp.where(alive, child, node)
    residual = jnp.where(alive[:, None], p[jnp.arange(rows), node], after)
    num_accepted += alive
    path.append(node)
  return _Walk(jnp.stack(path, axis=1), num_accepted, decoding._sample(extra_rng, residual))


def _node_distributions(cfg: decoding._LoopConfig, tree: TokenTree, logits: Array,
                        forced_chunk: Array) -> Tuple[Array, Array]:
  """(log p [rows, nodes, vocab] the target's sampling distributions with prompt tokens forced,
  log-probabilities for the score: the same, or the plain softmax without rescale_log_probs)."""
  forced = forced_chunk[:, jnp.asarray(tree.depths)]  # the token after each node
  log_p = decoding._force(
      decoding.sampling_log_probs(logits, cfg.temperature, cfg.topk, cfg.topp), forced)
  return log_p, log_p if cfg.rescale_log_probs else jax.nn.log_softmax(logits)


def _tree_loop(tree: TokenTree, branching: Tuple[int, ...], cfg: decoding._LoopConfig,
               inputs: Array, target_cache: PyTree, target_fn: Callable, draft_cache: PyTree,
               draft_fn: Callable, rng: Array, max_decode_steps: Optional[Union[int, Array]],
               initial_index: Optional[Array] = None
               ) -> Tuple[Array, Array, decoding.DecodeStats]:
  """`decoding._draft_verify_loop` with a token tree per call (module doc): the same results."""
  batch, max_len = inputs.shape
  depth = tree.max_depth
  rows = jnp.arange(batch)
  # The tree's slots start at the root's position: room for them past the last position.
  init, forced, limit = decoding.start_loop(
      inputs, target_cache.extend(tree.nodes), draft_cache.extend(tree.nodes), rng, depth,
      max_decode_steps, initial_index)

  def body(state: decoding.LoopState) -> decoding.LoopState:
    rng, draft_rng, walk_rng = jax.random.split(state.rng, 3)
    forced_chunk = forced[rows[:, None], state.length[:, None] + 1 + jnp.arange(depth + 1)]
    tokens, q, draft_cache = _draft_tree(cfg, tree, branching, state, draft_fn, forced_chunk,
                                         None if cfg.greedy else draft_rng)
    logits, target_cache = call_tree(target_fn, tokens, state.length, state.target_cache,
                                     state.sequences, tree, tree.nodes)
    log_p, log_probs = _node_distributions(cfg, tree, logits, forced_chunk)
    if cfg.greedy:
      walk = _walk_greedy(tree, branching, decoding.argmax(log_p), tokens)
    else:
      walk = _walk_sampled(tree, branching, jnp.exp(log_p), q, tokens, walk_rng)
    proposals = jnp.take_along_axis(tokens, walk.path[:, 1:], axis=1)  # [rows, depth]
    emitted = jnp.concatenate([proposals, jnp.zeros((batch, 1), jnp.int32)], axis=1)
    emitted = jnp.where(jnp.arange(depth + 1)[None] == walk.num_accepted[:, None],
                        walk.extra[:, None], emitted)
    # Token d is drawn at path node d (its parent): its log-probability there.
    parents = jnp.take_along_axis(log_probs, walk.path[..., None], axis=1)
    verdict = decoding.Verdict(
        accepted_at=(jnp.arange(depth)[None] < walk.num_accepted[:, None]).astype(jnp.int32),
        num_accepted=walk.num_accepted, extra=walk.extra,
        token_log_probs=decoding._at(parents, emitted))
    sequences, length, ended, count, log_prob = decoding._commit(cfg, state, verdict, proposals,
                                                                 forced_chunk, limit)
    # The draft fed every node above the leaves: a path through a leaf lacks its last token,
    # which the next draft phase feeds first.
    target_cache = target_cache.with_index(state.length).keep_tree_path(walk.path, count)
    draft_cache = draft_cache.with_index(state.length).keep_tree_path(
        walk.path[:, :depth], jnp.minimum(count, depth))
    return state.replace(sequences=sequences, length=length, ended=ended,
                         target_cache=target_cache, draft_cache=draft_cache,
                         log_prob=state.log_prob + log_prob, rng=rng,
                         stats=_count(state.stats, ~state.ended, tree, walk, count))

  final = jax.lax.while_loop(lambda s: ~jnp.all(s.ended), body, init)
  return final.sequences[:, 1:max_len + 1], final.log_prob, final.stats


def _count(stats: decoding.DecodeStats, active: Array, tree: TokenTree, walk: _Walk,
           count: Array) -> decoding.DecodeStats:
  """One call's statistics: `proposed` counts the tree's nodes below the root, `accepted` the
  accepted path's depth, `rollbacks` calls whose path ended above the leaves."""
  on = active.astype(jnp.int32)
  depth = tree.max_depth
  return decoding.DecodeStats(
      target_calls=stats.target_calls + on, draft_calls=stats.draft_calls + depth * on,
      proposed=stats.proposed + (tree.nodes - 1) * on,
      accepted=stats.accepted + walk.num_accepted * on,
      accepted_at=stats.accepted_at + (jnp.arange(depth)[None] <
                                       walk.num_accepted[:, None]) * on[:, None],
      emitted=stats.emitted + count, fallbacks=stats.fallbacks,
      rollbacks=stats.rollbacks + ((walk.num_accepted < depth) & active))


def tree_speculative_sample(inputs: Array, cache: PyTree, tokens_to_logits: Callable,
                            draft_cache: PyTree, draft_tokens_to_logits: Callable, eos_id: int,
                            decode_rng: Optional[Array] = None, num_decodes: int = 1,
                            branching: Sequence[int] = (2, 1, 1),
                            temperature: decoding.Temperature = 1.0, topk: int = 0,
                            topp: float = 0.0, cache_offset: int = 0,
                            initial_index: Optional[Array] = None,
                            max_decode_steps: Optional[Union[int, Array]] = None,
                            rescale_log_probs: bool = True, return_stats: bool = False):
  """Speculative sampling over a token tree: the target's distribution, more kept per call.

  Arguments and results are `decoding.speculative_sample`'s, with `branching` in place of
  gamma: the (static) children per node at each depth, e.g. (2, 1, 1) draws two distinct first
  tokens and a chain of two below each; the tree has 1 + b0 + b0 b1 + ... nodes, all scored
  in one target call, and a call emits at most len(branching) + 1 tokens. Both models'
  callables must accept `TreeDecodingState` and both caches be `network.DecoderCache`s
  (cache_offset 0). DecodeStats: `accepted` counts the accepted path's depth per call,
  `proposed` the tree's nodes, `rollbacks` the calls whose path stopped above the leaves.
  """
  branching = tuple(int(b) for b in branching)
  tree = token_tree(branching)
  check_tree_caches('tree_speculative_sample', cache, draft_cache, cache_offset)
  cfg = decoding._LoopConfig(gamma=tree.max_depth, rule=decoding.speculative_rule(),
                             temperature=temperature, topk=topk, topp=topp,
                             rescale_log_probs=rescale_log_probs, confidence_threshold=0.0,
                             adaptive_gamma=False, eos_id=eos_id)
  return decoding._decode(cfg, inputs, cache, tokens_to_logits, draft_cache,
                          draft_tokens_to_logits, decode_rng, num_decodes, cache_offset,
                          max_decode_steps, return_stats, initial_index,
                          loop=functools.partial(_tree_loop, tree, branching))
