"""Strings in, strings out: a target/draft pair loaded once, compiled per shape, decoded by policy.

  from speculative_t5x import pipeline
  pipe = pipeline.Pipeline(pipeline.load_pair())           # the embedded Multi30k De->En pair
  result = pipe.decode(['Ein Hund rennt durch den Schnee.'])  # greedy speculative, gamma='auto'
  result.texts, result.stats['accepted'], result.schedule

`load_pair` reads the embedded pair by default, or any checkpoints `checkpoints.load_checkpoint`
reads (T5X msgpack/zarr or Orbax, Hugging Face folders, the project's weight files) with their
`network.T5Config`s and vocabulary. `Predictor` holds one compiled executable per (decoder choice,
encoder width); the infer job, the translate command and the benchmarks all decode through it,
with a `policy.DecodingPolicy` choosing the decoder of every batch.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import jax
import numpy as np

from speculative_t5x import beam_search
from speculative_t5x import checkpoints
from speculative_t5x import costs
from speculative_t5x import data
from speculative_t5x import decoding
from speculative_t5x import gin_utils
from speculative_t5x import models
from speculative_t5x import network
from speculative_t5x import partitioning
from speculative_t5x import policy
from speculative_t5x import trees

PathLike = Union[str, os.PathLike]
EMBEDDED_TARGET = data.EMBEDDED_TARGET
EMBEDDED_DRAFT = data.EMBEDDED_DRAFT
EMBEDDED_SEPARATE_DRAFT = data.EMBEDDED_SEPARATE_DRAFT

# The decoders a Pipeline offers by name, with the arguments each gets unless given: greedy.
# The target alone samples without T5X's topk=1 default, as speculative_sample does, so that
# a temperature means the same distribution for both.
DECODERS: Dict[str, Tuple[Callable, Dict[str, Any]]] = {
    'speculative': (decoding.speculative_sample, {'temperature': 0.0, 'gamma': policy.AUTO}),
    'target': (decoding.temperature_sample, {'temperature': 0.0, 'topk': 0}),
    'bild': (decoding.bild_decode, {'temperature': 0.0}),
    'beam': (beam_search.beam_search, {}),
    'speculative_beam': (beam_search.speculative_beam_search, {}),
    'speculative_tree': (trees.tree_speculative_sample, {}),
}


@dataclasses.dataclass(frozen=True)
class Pair:
  """A target and a draft with their vocabulary; params are prepared for decoding: {'target',
  'draft', 'decode'} (`EncoderDecoderModel.with_decode_variables`)."""
  target_config: network.T5Config
  draft_config: network.T5Config
  params: Dict[str, Any]
  vocabulary: data.SentencePieceVocabulary

  @property
  def configs(self) -> Dict[str, network.T5Config]:
    return {'target': self.target_config, 'draft': self.draft_config}

  def model(self, decode_fn: Callable = decoding.speculative_sample,
            decode_kwargs: Optional[Mapping[str, Any]] = None) -> models.EncoderDecoderModel:
    """The pair as a model decoding with `decode_fn(**decode_kwargs)`."""
    return models.EncoderDecoderModel(
        self.target_config, self.draft_config, decode_fn=decode_fn, decode_kwargs=decode_kwargs,
        input_vocabulary=self.vocabulary, output_vocabulary=self.vocabulary,
        draft_output_vocabulary=self.vocabulary)


def load_model(path: PathLike, config: Optional[network.T5Config] = None,
               dtype: Optional[Any] = None) -> Tuple[network.T5Config, Any]:
  """(config, params) of one model: a weights file or training run with its own config (float32
  params), or any checkpoint `checkpoints.load_checkpoint` reads for the given config."""
  if config is None:
    config, params = checkpoints.load_model(path)
    return config, (params if dtype is None else jax.tree.map(lambda x: x.astype(dtype), params))
  return config, checkpoints.load_checkpoint(gin_utils.resolve_path(path), config, dtype)


def load_pair(target: PathLike = EMBEDDED_TARGET, draft: PathLike = EMBEDDED_DRAFT, *,
              target_config: Optional[network.T5Config] = None,
              draft_config: Optional[network.T5Config] = None,
              vocabulary: PathLike = data.VOCAB_PATH, dtype: Optional[Any] = None) -> Pair:
  """Loads a target/draft pair (default: the embedded one) and prepares it for decoding once.

  Configs are needed for T5X and Hugging Face checkpoints and read from the project's weight
  files. dtype (e.g. 'bfloat16'): parameters and activations; None keeps both as loaded. Raises FileNotFoundError or a one-line ValueError for a checkpoint that is missing or
  does not match its config.
  """
  target_config, target_params = load_model(target, target_config, dtype)
  draft_config, draft_params = load_model(draft, draft_config, dtype)
  if dtype is not None:  # activations in dtype too, as the infer job's `dtype` does
    target_config = dataclasses.replace(target_config, dtype=dtype)
    draft_config = dataclasses.replace(draft_config, dtype=dtype)
  params = prepare_params(target_config, draft_config,
                          {'target': target_params, 'draft': draft_params},
                          draft_vocabulary=checkpoints.load_draft_vocabulary(draft))
  return Pair(target_config, draft_config, params,
              data.SentencePieceVocabulary(str(vocabulary)))


def prepare_params(target_config: network.T5Config, draft_config: network.T5Config,
                   params: Mapping[str, Any], fuse: bool = False,
                   draft_vocabulary: Optional[np.ndarray] = None) -> Dict[str, Any]:
  """{'target', 'draft'} params plus their decode-time layouts (`EncoderDecoderModel.
  with_decode_variables`), made once in one jitted call rather than once per batch."""
  prepare = functools.partial(models.EncoderDecoderModel(
      target_config, draft_config).with_decode_variables, fuse=fuse,
                              draft_vocabulary=draft_vocabulary)
  return jax.jit(prepare)({name: params[name] for name in ('target', 'draft')})


class Predictor:
  """One compiled `predict_batch_with_aux` per (decoder choice, encoder width), compiled (and
  warmed up) when a batch first needs it; `compile_seconds` keeps that apart from decoding.

  decoders: {choice: model} (`policy.plan`); params sharded for `partitioner`'s mesh.
  warm_up: run each new executable once, untimed, after compiling it: for a policy that times
  the choices (a fixed decoder needs no warm-up run; it would decode one batch twice).
  Call: predictor(choice, batch, rng) -> (decodes [batch, length], aux).
  """

  def __init__(self, decoders: Mapping[Any, models.EncoderDecoderModel], params: Any,
               partitioner: partitioning.Partitioner, num_decodes: int = 1,
               warm_up: bool = True):
    self.params = params
    self.warm_up = warm_up
    self._functions = {choice: partitioner.partition_predict(model, params,
                                                             num_decodes=num_decodes)
                       for choice, model in decoders.items()}
    self._compiled: Dict[Tuple[Any, int], Any] = {}
    self.compile_seconds = 0.0

  @property
  def choices(self) -> Tuple[Any, ...]:
    return tuple(self._functions)

  def compile(self, choice: Any, batch: Mapping[str, Any], rng: jax.Array) -> Any:
    """The executable for (choice, the batch's encoder width), compiled (and, with warm_up, run
    once untimed) when first needed: an executable's first run costs several times a later one (measured:
    9.6 against 2.5 ms per output position on the embedded pair at batch 8), a one-time cost
    like compilation, which must not count as the decoder's speed."""
    key = self._key(choice, batch)
    if key not in self._compiled:
      start = time.time()
      executable = self._functions[choice].lower(self.params, batch, rng).compile()
      if self.warm_up:
        jax.block_until_ready(executable(self.params, batch, rng))
      self._compiled[key] = executable
      self.compile_seconds += time.time() - start
    return self._compiled[key]

  def prepare(self, choice: Any, batch: Mapping[str, Any], rng: jax.Array) -> bool:
    """Compiles (choice, the batch's width) if it is new; whether it did (`DecodingPolicy.
    stream`'s prepare)."""
    new = self._key(choice, batch) not in self._compiled
    self.compile(choice, batch, rng)
    return new

  @staticmethod
  def _key(choice: Any, batch: Mapping[str, Any]) -> Tuple[Any, int]:
    return choice, batch['encoder_input_tokens'].shape[1]

  def __call__(self, choice: Any, batch: Mapping[str, Any], rng: jax.Array) -> Any:
    return self.compile(choice, batch, rng)(self.params, batch, rng)


@dataclasses.dataclass
class Decoded:
  """What `Pipeline.decode` returns. tokens: [n, max_output_length] (0 after EOS); stats: the
  decoder's per-row `decoding.DecodeStats` fields, [n] each (empty for plain decoders);
  schedule: {batch size: {choice: batches}} (choice: the gamma or tree under 'auto', else
  None); policy: the policy's measurements (`DecodingPolicy.summary`), {} without one."""
  texts: List[str]
  tokens: np.ndarray
  scores: np.ndarray
  stats: Dict[str, np.ndarray]
  schedule: Dict[int, Dict[Any, int]]
  policy: Dict[str, Any]


def merge_stats(per_batch: Sequence[Mapping[str, Any]], rows: Sequence[int], n: int
                ) -> Dict[str, np.ndarray]:
  """The per-row `DecodeStats` fields of a job's batches as one array each, cut to n rows.

  Under a policy batches ran different decoders: one of the target alone has no statistics (its
  rows count zeros: nothing proposed or accepted), and accepted_at is [rows, gamma] per batch
  (padded with zeros to the widest). {} when no batch has statistics.
  """
  keys = next((list(s) for s in per_batch if s), [])
  if not keys:
    return {}
  widths = [np.shape(s['accepted_at'])[1] for s in per_batch if 'accepted_at' in s]
  out = {}
  for key in keys:
    parts = []
    for stats, count in zip(per_batch, rows):
      value = np.asarray(stats[key]) if key in stats else None
      if key == 'accepted_at':
        value = np.zeros((count, max(widths)), np.int32) if value is None else np.pad(
            value, ((0, 0), (0, max(widths) - value.shape[1])))
      parts.append(np.zeros(count, np.int32) if value is None else value)
    out[key] = np.concatenate(parts)[:n]
  return out


class Pipeline:
  """Decodes lists of strings with a pair: batches of at most `batch_size` rows, inputs cut to
  max_input_length tokens and padded to the longest rounded up to input_length_step (0: to
  max_input_length), outputs of at most max_output_length tokens. Compiled decoders and their
  policies (with what they measured) are kept for later calls with the same decoder, arguments
  and batch size."""

  def __init__(self, pair: Pair, *, batch_size: int = 8, max_input_length: int = 64,
               max_output_length: int = 64, input_length_step: int = 16,
               partitioner: Optional[partitioning.Partitioner] = None,
               calibration: Optional[Union[PathLike, costs.Calibration]] = None):
    if batch_size < 1:
      raise ValueError(f'batch_size must be at least 1, got {batch_size}.')
    self.pair = pair
    self.batch_size = batch_size
    self.max_input_length = max_input_length
    self.max_output_length = max_output_length
    self.input_length_step = input_length_step
    self.partitioner = partitioner or partitioning.Partitioner()
    self.calibration = (costs.load_calibration(calibration) if isinstance(
        calibration, (str, os.PathLike)) else calibration)
    model = pair.model()
    self.params = partitioning.shard_params(
        pair.params, self.partitioner.pair_shardings(model, pair.params))
    self._prepared: Dict[Any, Tuple[policy.DecodingPolicy, Predictor]] = {}

  def batches(self, texts: Sequence[str]) -> List[Dict[str, Any]]:
    """The texts as padded batches of min(batch_size, len(texts)) rows (the last padded)."""
    ids = [self.pair.vocabulary.encode(t)[:self.max_input_length - 1] +
           [self.pair.vocabulary.eos_id] for t in texts]
    rows = min(self.batch_size, len(ids))
    return [partitioning.shard_batch(data.pad_batch(
        ids[i:i + rows], None, self.max_input_length, self.max_output_length, rows,
        self.input_length_step), self.partitioner.mesh) for i in range(0, len(ids), rows)]

  def prepare(self, decoder: str, decode_kwargs: Mapping[str, Any], rows: int
              ) -> Tuple[policy.DecodingPolicy, Predictor]:
    """The policy and predictor of `decoder` with these arguments for batches of `rows` rows
    (made once, then reused: a policy's measurements hold for one batch size)."""
    if decoder not in DECODERS:
      raise ValueError(f'unknown decoder {decoder!r}; one of {", ".join(DECODERS)}')
    decode_fn, defaults = DECODERS[decoder]
    kwargs = {**defaults, **decode_kwargs}
    # The beam size (decodes per example) is predict's argument, as in T5X: it overrides the
    # decoder's own num_decodes.
    num_decodes = int(kwargs.pop('num_decodes', 1))
    model = self.pair.model(decode_fn, kwargs)
    decoding_policy, decoders = policy.plan(model, kwargs, calibration=self.calibration,
                                            batch_size=rows, num_decodes=num_decodes)
    key = (decoder, tuple(sorted(kwargs.items())), rows, num_decodes)
    if key not in self._prepared:
      self._prepared[key] = decoding_policy, Predictor(decoders, self.params, self.partitioner,
                                                       num_decodes=num_decodes,
                                                       warm_up=decoding_policy.measured)
    return self._prepared[key]

  def compile(self, texts: Sequence[str], decoder: str = 'speculative', *, seed: int = 0,
              **decode_kwargs: Any) -> float:
    """Compiles (and warms up) every choice of `decoder` for the batches of `texts` ahead, as
    `decode` would otherwise do when a choice is first met; returns the seconds it took. For
    timing decode calls without compilation in them."""
    batches = self.batches(texts)
    _, predictor = self.prepare(decoder, decode_kwargs, len(batches[0]['encoder_input_tokens']))
    before = predictor.compile_seconds
    for choice in predictor.choices:
      for batch in batches:
        predictor.compile(choice, batch, jax.random.PRNGKey(seed))
    return predictor.compile_seconds - before

  def decode(self, texts: Sequence[str], decoder: str = 'speculative', *, seed: int = 0,
             **decode_kwargs: Any) -> Decoded:
    """Decodes `texts` with a `DECODERS` name and its arguments (e.g. gamma, temperature); when
    sampling, batch i draws from fold_in(PRNGKey(seed), i)."""
    if not texts:
      raise ValueError('decode needs at least one text.')
    batches = self.batches(texts)
    rows = len(batches[0]['encoder_input_tokens'])
    decoding_policy, predictor = self.prepare(decoder, decode_kwargs, rows)
    # A key per batch, as the infer job has: batches sharing one would share their random draws,
    # and a sampled job's acceptance would be as noisy as a single batch's.
    rng = jax.random.PRNGKey(seed)
    keyed = [(jax.random.fold_in(rng, i), batch) for i, batch in enumerate(batches)]
    outputs, schedule = [], collections.Counter()
    for _, choice, out in decoding_policy.stream(  # a choice is compiled when first met, untimed
        keyed, lambda choice, item: predictor(choice, item[1], item[0]),
        lambda choice, item: predictor.prepare(choice, item[1], item[0])):
      outputs.append(jax.tree.map(np.asarray, out))
      schedule[choice] += 1
    return self._collect(outputs, len(texts), schedule, decoding_policy)

  def _collect(self, outputs: Sequence[Tuple[np.ndarray, Dict[str, Any]]], n: int,
               schedule: Mapping[Any, int], decoding_policy: policy.DecodingPolicy) -> Decoded:
    tokens = np.concatenate([d for d, _ in outputs])[:n]
    stats = merge_stats([a.get('stats', {}) for _, a in outputs],
                        [len(d) for d, _ in outputs], n)
    rows = len(outputs[0][0])
    return Decoded(texts=[self.pair.vocabulary.decode(row) for row in tokens], tokens=tokens,
                   scores=np.concatenate([a['scores'] for _, a in outputs])[:n], stats=stats,
                   schedule={rows: dict(schedule)}, policy=decoding_policy.summary())
