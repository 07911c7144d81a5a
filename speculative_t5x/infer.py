r"""Gin-configured inference jobs, like `python -m t5x.infer`, for speculative and BiLD decoding.

  python -m speculative_t5x.infer \
    --gin_file=gin_configs/runs/infer_multi30k.gin \
    --gin_file=gin_configs/decoding/speculative_greedy.gin \
    --gin.INFER_OUTPUT_DIR="'/tmp/infer'"

(or the `speculative-t5x-infer` command). Gin files, checkpoints, vocabularies and input files
given as relative paths are found in the working directory first, then in the installed package
(`gin_utils.resolve_path`), so the packaged configs work from any directory.

Input: a seqio task (MIXTURE_OR_TASK_NAME, split) or a file (INPUT_FILE): plain text (one input
per line), TSV (input<TAB>target on every line; a first line exactly `inputs<TAB>targets` is a
header, skipped) or JSONL ({"inputs": ..., "targets": ...}); the `inputs` module has the rules.
Output, in INFER_OUTPUT_DIR, T5X's layout:

  <name>-predict_with_aux.jsonl-<shard>-of-<n>   one JSON object per example:
      {"index", "inputs": {"inputs_pretokenized", ["targets_pretokenized"]}, "prediction",
       ["prediction_tokens"], "aux": {"scores", "stats": {target_calls, accepted, ...}}}
  <that>.COMPLETED, <that>.summary.json (alpha, tokens per target call, rates, times, config),
  config.gin (the parsed config) and operative_config.gin (what the run used).

Resumability: examples are cut into chunks of `checkpoint_period` batches; a chunk's results are
written to a temporary file and atomically renamed into `tmp-<name>-<shard>-of-<n>/`. A rerun
of the same command skips committed chunks, so a job killed at any instant loses at most the
chunk in flight and duplicates nothing. A completed job removes that folder: it leaves only the
files above. Every batch has the same shape (the last is padded), so the predict function is
compiled once; its random key depends only on the chunk and batch numbers, so a resumed run
samples exactly what an uninterrupted one would.

Settings (gin: `infer_script.infer.NAME`; T5X's macros in gin_configs/runs/infer.gin bind most):

  model: the target/draft model; its decode_fn and gin-bound decoding arguments decide the
    algorithm. Draft-using decoders need DRAFT_CONFIG and draft_checkpoint_path.
  output_dir: where outputs, chunks, summary and configs go (created if needed).
  target_checkpoint_path / draft_checkpoint_path: any format `checkpoints.load_checkpoint`
    reads; each is checked against its config.
  task_feature_lengths: {'inputs': encoder length, 'targets': maximum output length}.
  input_length_step: 0 pads every batch's inputs to task_feature_lengths['inputs'] (T5X's
    shapes); > 0 pads each batch only to its longest input rounded up to a multiple of it:
    the encoder and every step's cross-attention skip the rest of the padding (outputs
    unchanged), at one compilation per width met, when first met (counted in
    compile_seconds). Pays on long jobs of short inputs.
  mixture_or_task_name / mixture_or_task_module / split: a seqio source; or
  input_file / input_format ('auto' by extension, 'text', 'tsv', 'jsonl').
  batch_size: global batch size (a multiple of the mesh's 'data' size).
  checkpoint_period: batches per committed output chunk.
  partitioner: mesh and logical axis rules (default: all devices on 'data').
  shard_id / num_shards: this job's share when several independent jobs split the input.
  output_ids: also write `prediction_tokens`.
  dtype: activation and parameter dtype: 'auto' (float32 on CPU, else bfloat16), a dtype
    name, or None to keep the configs' dtypes and the checkpoints' parameter dtypes.
  seed: base of the per-batch random keys (sampling decoders).
  num_decodes: decodes per example, T5X's `predict_batch_with_aux(num_decodes=...)`: the beam
    size of beam_search / speculative_beam_search, samples per example otherwise; the best
    (highest score) is written.
  max_gamma: with gamma='auto' (`decoding.speculative_sample.gamma = 'auto'`), the largest
    gamma considered: gammas 0 (the target alone) to max_gamma are compiled, and
    `policy.DecodingPolicy` picks one per batch from the job's measured batch times (recorded
    per example as stats.gamma; with `decoding.speculative_beam_search.branching = 'auto'`,
    stats.branching; the schedule and measurements in the summary's "policy").
  calibration: the calibration.json of speculative-t5x-calibrate (its infer_schedule.gin binds
    it): with gamma='auto' the first batch runs its gamma for batch_size (the nearest
    calibrated size's) instead of the fixed fallback, the policy follows the model of that
    batch size as the job counts acceptance (and runs a token tree the calibration priced where
    the model predicts it fastest), and timing checks both; with branching='auto' a
    calibration made with --beam_size num_decodes starts at the tree (or plain beam search) its
    model predicts fastest.
  progress: show a progress bar (process 0).
  chunk_hook: called with a chunk's number right after it is committed (tests stop a job
    at a known chunk through it; monitoring may count progress).

Bad input gives one line on stderr and exit status 1 (or a logged, counted skip for empty
lines); see `InferError`.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import inspect
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from absl import flags
from absl import logging
import gin
import jax
import jax.numpy as jnp
import numpy as np

import speculative_t5x
from speculative_t5x import beam_search
from speculative_t5x import checkpoints
from speculative_t5x import chunks
from speculative_t5x import costs
from speculative_t5x import data
from speculative_t5x import decoding
from speculative_t5x import gin_utils
from speculative_t5x import inputs
from speculative_t5x import models
from speculative_t5x import network
from speculative_t5x import partitioning
from speculative_t5x import pipeline
from speculative_t5x import policy
from speculative_t5x import trees
from speculative_t5x.errors import InferError
from speculative_t5x.errors import must_be
from speculative_t5x.data import PAD_ID
# The vocabulary class gin files name `vocabularies.SentencePieceVocabulary`, also here for
# code that built it from this module.
from speculative_t5x.data import SentencePieceVocabulary  # pylint: disable=unused-import

# How many skipped/truncated example positions the summary lists (the counts are complete).
_MAX_LISTED = 50

# ------------------------------------------------------------------------------------------------
# Gin registrations. Registering is idempotent for the same object, and gin's registry is the
# only state (train.py registers network.T5Config the same way; data.py the vocabulary).

gin.external_configurable(network.T5Config, module='network')
gin.external_configurable(models.EncoderDecoderModel, module='models')
gin.external_configurable(decoding.temperature_sample, module='decoding')
gin.external_configurable(decoding.speculative_sample, module='decoding')
gin.external_configurable(decoding.bild_decode, module='decoding')
gin.external_configurable(beam_search.beam_search, module='decoding')
gin.external_configurable(beam_search.speculative_beam_search, module='decoding')
gin.external_configurable(trees.tree_speculative_sample, module='decoding')
gin.external_configurable(partitioning.Partitioner, module='partitioning')
gin.external_configurable(partitioning.standard_logical_axis_rules, module='partitioning')


@dataclasses.dataclass(frozen=True)
class Job:
  """The job's settings, checked, and what they fix before anything is read: shapes, mesh,
  processes, names (the infer job's `DatasetConfig`)."""
  name: str
  input_file: Optional[str]
  input_format: str
  task: Optional[str]
  task_module: Optional[str]
  split: str
  input_length: int
  target_length: int
  input_length_step: int
  batch_size: int
  checkpoint_period: int
  shard_id: int
  num_shards: int
  partitioner: partitioning.Partitioner
  process: int
  num_processes: int
  seed: int = 0
  num_decodes: int = 1
  dtype: Optional[jnp.dtype] = None

  @property
  def local_batch(self) -> int:
    return self.batch_size // self.num_processes

  def mine(self, rows: Sequence[Any]) -> Sequence[Any]:
    """This process's share of a global batch's rows."""
    return rows[self.process * self.local_batch:(self.process + 1) * self.local_batch]

  def summary(self) -> Dict[str, Any]:
    """The settings as the run summary records them."""
    return {'source': self.input_file or f'{self.task}:{self.split}',
            'task_feature_lengths': {'inputs': self.input_length, 'targets': self.target_length},
            'input_length_step': self.input_length_step, 'batch_size': self.batch_size,
            'checkpoint_period': self.checkpoint_period, 'mesh': dict(self.partitioner.mesh.shape),
            'processes': self.num_processes, 'devices': jax.device_count(),
            'backend': jax.default_backend(),
            'dtype': str(self.dtype) if self.dtype is not None else None, 'seed': self.seed,
            'num_decodes': self.num_decodes, 'shard': [self.shard_id, self.num_shards]}


def _check_job(task_feature_lengths: Any, task: Optional[str], input_file: Optional[str],
               shard_id: int, num_shards: int, batch_size: int, checkpoint_period: int,
               partitioner: Optional[partitioning.Partitioner], **settings: Any) -> Job:
  """The job's settings checked (InferError naming the setting), before anything is loaded.
  settings: the rest of `Job`'s fields, as `infer` names them."""
  if (task is None) == (input_file is None):
    raise InferError('set exactly one of MIXTURE_OR_TASK_NAME and INPUT_FILE')
  for key in ('inputs', 'targets'):
    if not isinstance(task_feature_lengths, Mapping) or key not in task_feature_lengths:
      raise InferError(f"TASK_FEATURE_LENGTHS needs a length for '{key}', got "
                       f'{task_feature_lengths!r}')
  if not 0 <= shard_id < num_shards:
    raise InferError(f'shard_id {shard_id} is not in [0, num_shards={num_shards})')
  for name, value in (('batch_size', batch_size), ('checkpoint_period', checkpoint_period)):
    if not isinstance(value, int) or value < 1:
      raise InferError(must_be(f'infer_script.infer.{name}', 'a whole number >= 1', value))
  return Job(name=task or Path(input_file).name, input_file=input_file, task=task,
             input_length=int(task_feature_lengths['inputs']),
             target_length=int(task_feature_lengths['targets']), batch_size=batch_size,
             checkpoint_period=checkpoint_period, shard_id=shard_id, num_shards=num_shards,
             partitioner=partitioner or partitioning.Partitioner(),
             process=jax.process_index(), num_processes=jax.process_count(),
             **{**settings, 'dtype': _resolve_dtype(settings.get('dtype'))})


def _check_batching(job: Job) -> None:
  if (job.batch_size % job.partitioner.data_size or job.batch_size % job.num_processes):
    raise InferError(f'batch_size {job.batch_size} must be a multiple of the mesh data size '
                     f'{job.partitioner.data_size} and of the process count {job.num_processes}')


def _check_vocabularies(model: models.EncoderDecoderModel) -> Any:
  """The output vocabulary, checked against the draft's and the target's size (cheap, first)."""
  vocabulary = model.output_vocabulary
  if vocabulary is None:
    raise InferError('the model has no vocabulary: set VOCABULARY')
  if model.uses_draft:
    draft_vocab = getattr(model, 'draft_output_vocabulary', None)
    if draft_vocab is not None and getattr(draft_vocab, 'digest', None) != getattr(
        vocabulary, 'digest', None):
      raise InferError(f'draft and target vocabularies differ: target {vocabulary.path} vs '
                       f'draft {draft_vocab.path}')
  if vocabulary.vocab_size > model.target_config.vocab_size:
    raise InferError(f'the vocabulary has {vocabulary.vocab_size} ids but the target '
                     f'vocab_size is {model.target_config.vocab_size}')
  return vocabulary


# Decoder arguments whose wrong values would decode nonsense silently or fail deep inside XLA:
# (test, what a valid value is). Only Python values are checked (gin gives those).
_DECODE_ARG_RULES = {
    'temperature': (lambda v: v >= 0, 'a number >= 0 (0 = greedy)'),
    'topk': (lambda v: float(v).is_integer() and v >= 0, 'a whole number >= 0 (0 = off)'),
    'topp': (lambda v: 0 <= v <= 1, 'a number in [0, 1] (0 = off)'),
    'gamma': (lambda v: v == policy.AUTO or (float(v).is_integer() and v >= 1),
              "a whole number >= 1 or 'auto'"),
    'lenience': (lambda v: 0 < v <= 1, 'a number in (0, 1] (1 = exact)'),
    'fallback_threshold': (lambda v: 0 <= v <= 1, 'a probability in [0, 1]'),
    'rollback_threshold': (lambda v: v >= 0, 'a number >= 0'),
    'max_small_steps': (lambda v: float(v).is_integer() and v >= 1, 'a whole number >= 1'),
    'alpha': (lambda v: v >= 0, 'a number >= 0'),
    'verification': (lambda v: v in decoding.VERIFICATION_CHOICES,
                     "'auto', 'token' or 'block'"),
}


def _check_decoding(model: models.EncoderDecoderModel, decode_kwargs: Mapping[str, Any],
                    num_decodes: int, max_gamma: int) -> None:
  """The decoder's arguments, the beam size / samples per example and max_gamma checked."""
  name = _decode_fn_name(model.decode_fn)
  for key, (valid, expected) in _DECODE_ARG_RULES.items():
    value = decode_kwargs.get(key)
    if value is None or not isinstance(value, (int, float, str)) or isinstance(value, bool):
      continue
    try:
      ok = bool(valid(value))
    except (TypeError, ValueError):  # a string where a number belongs (NaN fails the tests)
      ok = False
    if not ok:
      raise InferError(must_be(f'decoding.{name}.{key}', expected, value))
  if not isinstance(num_decodes, int) or num_decodes < 1:
    what = 'the beam size' if 'beam' in name else 'samples per example'
    raise InferError(must_be(f'infer_script.infer.num_decodes ({what})', 'a whole number >= 1',
                             num_decodes))
  if not isinstance(max_gamma, int) or max_gamma < 1:
    raise InferError(must_be('infer_script.infer.max_gamma', 'a whole number >= 1', max_gamma))


def _resolve_dtype(dtype: Optional[str]) -> Optional[jnp.dtype]:
  if dtype is None:
    return None
  if dtype == 'auto':
    # bfloat16 where matmuls are native (TPU, GPU); CPUs are faster and exact in float32.
    return jnp.dtype(jnp.float32 if jax.default_backend() == 'cpu' else jnp.bfloat16)
  return jnp.dtype(dtype)


def _with_activation_dtype(model: models.EncoderDecoderModel,
                           dtype: Optional[jnp.dtype]) -> models.EncoderDecoderModel:
  """A copy of `model` whose networks compute in `dtype` (None: as configured)."""
  if dtype is None:
    return model
  model = copy.copy(model)
  model.target_config = dataclasses.replace(model.target_config, dtype=dtype)
  model.module = network.Transformer(model.target_config)
  if model.draft_config is not None:
    model.draft_config = dataclasses.replace(model.draft_config, dtype=dtype)
    model.draft_module = network.Transformer(model.draft_config)
  return model


def _load(path: Optional[str], config: network.T5Config, dtype: Optional[jnp.dtype],
          role: str) -> Any:
  if not path:
    raise InferError(f'{role.upper()}_CHECKPOINT_PATH is not set')
  candidate = gin_utils.resolve_path(path)
  try:
    # Reading a training run imports speculative_t5x.train, which registers gin
    # configurables; gin refuses that once the parsed config is locked.
    with gin.unlock_config():
      return checkpoints.load_checkpoint(candidate, config, dtype)
  except FileNotFoundError:
    raise InferError(f'{role} checkpoint not found: {path}') from None
  except ValueError as e:
    raise InferError(f'{role} checkpoint: {str(e).splitlines()[0]}') from None


def _decode_fn_name(fn: Any) -> str:
  return getattr(getattr(fn, 'func', fn), '__name__', str(fn))


def _row_temperatures(model: models.EncoderDecoderModel, decode_kwargs: Mapping[str, Any],
                      examples: Sequence[inputs.Example]) -> Optional[float]:
  """None when no input has its own temperature; else the temperature of those that do not
  (the decoder's). InferError for a decoder without one (beam search)."""
  if all(ex.temperature is None for ex in examples):
    return None
  fn = getattr(model.decode_fn, 'func', model.decode_fn)
  parameter = inspect.signature(fn).parameters.get('temperature')
  if parameter is None:
    raise InferError(f'inputs with a "temperature" need a sampling decoder; '
                     f'{_decode_fn_name(fn)} has no temperature')
  default = decode_kwargs.get('temperature', parameter.default)
  return float(default)


def _key_tokens(ex: inputs.Example) -> Any:
  """What of an example fixes its decode: its tokens, and its temperature when it has one."""
  return ex.tokens if ex.temperature is None else [ex.tokens, ex.temperature]


# ------------------------------------------------------------------------------------------------
# The job.


@gin.configurable(module='infer_script')
def infer(*, model: models.EncoderDecoderModel = gin.REQUIRED, output_dir: str = gin.REQUIRED,
          target_checkpoint_path: str = gin.REQUIRED, draft_checkpoint_path: Optional[str] = None,
          task_feature_lengths: Mapping[str, int] = gin.REQUIRED, input_length_step: int = 0,
          mixture_or_task_name: Optional[str] = None,
          mixture_or_task_module: Optional[str] = None, input_file: Optional[str] = None,
          input_format: str = 'auto', split: str = 'test', batch_size: int = 32,
          checkpoint_period: int = 4, partitioner: Optional[partitioning.Partitioner] = None,
          shard_id: int = 0, num_shards: int = 1, output_ids: bool = False,
          dtype: Optional[str] = 'auto', seed: int = 0, num_decodes: int = 1,
          max_gamma: int = policy.MAX_GAMMA,
          calibration: Optional[str] = None, progress: bool = True,
          chunk_hook: Optional[Callable[[int], None]] = None) -> Dict[str, Any]:
  """Decodes every example of a task split or file; returns (and writes) the run summary.
  Each setting is described in this module's docstring ("Settings")."""
  wall_start = time.time()
  job = _check_job(task_feature_lengths, mixture_or_task_name, input_file, shard_id, num_shards,
                   batch_size, checkpoint_period, partitioner, input_format=input_format,
                   task_module=mixture_or_task_module, split=split, seed=seed, dtype=dtype,
                   input_length_step=input_length_step, num_decodes=num_decodes)
  chunks.check_writable(Path(output_dir))
  _check_batching(job)
  vocabulary = _check_vocabularies(model)
  decode_kwargs = _bound_decode_kwargs(model.decode_fn, model.decode_kwargs)
  _check_decoding(model, decode_kwargs, num_decodes, max_gamma)
  calibrated = _load_calibration(calibration)
  store = _output_store(job, Path(output_dir))
  done = store.completed_summary()
  if done is not None:
    return done
  examples, report = _read(job, model.input_vocabulary or vocabulary)
  default_temperature = _row_temperatures(model, decode_kwargs, examples)
  store.claim(chunks.run_key(gin.config_str(), [ex.index for ex in examples],
                             [_key_tokens(ex) for ex in examples], job.num_processes,
                             num_decodes), write=job.process == 0)
  model = _with_activation_dtype(model, job.dtype)
  params, load_seconds = _load_pair(model, target_checkpoint_path, draft_checkpoint_path,
                                    job.dtype, job.partitioner)
  compile_start = time.time()
  decoding_policy, decoders = policy.plan(model, decode_kwargs, max_gamma, calibrated,
                                          batch_size, num_decodes)
  predictor = pipeline.Predictor(decoders, params, job.partitioner, num_decodes,
                                 warm_up=decoding_policy.measured)
  run = _Run(job, predictor, decoding_policy, jax.random.PRNGKey(seed), default_temperature)
  run.compile_first(examples)
  run.compile_seconds = time.time() - compile_start
  resumed = run.decode_chunks(store, examples, vocabulary, output_ids, progress, chunk_hook)
  if job.process != 0:
    return {}
  return _write_summary(store, run, examples, model, decode_kwargs, report, wall_start,
                        load_seconds, resumed, (target_checkpoint_path, draft_checkpoint_path))


def _read(job: Job, vocabulary: Any) -> Tuple[List[inputs.Example], inputs.InputReport]:
  return inputs.read_examples(job.input_file, job.input_format, job.task, job.split,
                              job.task_module, vocabulary, job.input_length, job.shard_id,
                              job.num_shards)


# ------------------------------------------------------------------------------------------------
# The job's parts.


def _output_store(job: Job, output_dir: Path) -> chunks.ChunkStore:
  """The job's chunk store in output_dir, where process 0 first writes the parsed config
  (config.gin)."""
  store = chunks.ChunkStore(output_dir, job.name, job.shard_id, job.num_shards, job.num_processes)
  if job.process == 0:
    chunks.atomic_write(output_dir / 'config.gin', gin.config_str())
  return store


def _load_pair(model: models.EncoderDecoderModel, target_path: Optional[str],
               draft_path: Optional[str], dtype: Optional[jnp.dtype],
               partitioner: partitioning.Partitioner) -> Tuple[Any, float]:
  """The pair's parameters with their decode-time layouts, sharded; and the seconds it took."""
  start = time.time()
  params = {'target': _load(target_path, model.target_config, dtype, 'target')}
  if model.uses_draft:
    params['draft'] = _load(draft_path, model.draft_config, dtype, 'draft')
  # Decode-time weight layouts once per job, not once per batch (eager: each process computes
  # its full copy, as it holds full parameters before sharding).
  try:
    vocabulary = checkpoints.load_draft_vocabulary(draft_path) if model.uses_draft else None
  except ValueError as e:
    raise InferError(f'draft vocabulary: {e}') from None
  params = model.with_decode_variables(params, draft_vocabulary=vocabulary)
  load_seconds = time.time() - start
  shardings = partitioner.pair_shardings(model, params)
  return partitioning.shard_params(params, shardings), load_seconds


class _Run:
  """The decoding of one job: batches, the compiled predictor, the policy, and their times."""

  def __init__(self, job: Job, predictor: pipeline.Predictor,
               decoding_policy: policy.DecodingPolicy, rng: jax.Array,
               default_temperature: Optional[float] = None):
    self.job, self.predictor, self.policy, self.rng = job, predictor, decoding_policy, rng
    # Set when inputs carry their own temperatures: the temperature of the rows that do not.
    self.default_temperature = default_temperature
    self.compile_seconds = 0.0

  def num_chunks(self, examples: Sequence[inputs.Example]) -> int:
    return -(-len(examples) // (self.job.batch_size * self.job.checkpoint_period))

  def make_batch(self, rows: Sequence[inputs.Example]) -> Any:
    """This process's rows of the global batch `rows`, padded and sharded; the encoder width
    comes from all of `rows`, so that every process builds the same global shape."""
    width = data.input_width([ex.tokens for ex in rows], self.job.input_length,
                             self.job.input_length_step)
    enc = np.zeros((self.job.local_batch, width), np.int32)
    for row, ex in enumerate(self.job.mine(rows)):
      enc[row, :len(ex.tokens)] = ex.tokens
    batch = {'encoder_input_tokens': enc,
             'decoder_input_tokens': np.zeros((self.job.local_batch, self.job.target_length),
                                              np.int32)}
    if self.default_temperature is not None:
      batch[models.TEMPERATURE_FEATURE] = np.full((self.job.local_batch,),
                                                  self.default_temperature, np.float32)
      for row, ex in enumerate(self.job.mine(rows)):
        if ex.temperature is not None:
          batch[models.TEMPERATURE_FEATURE][row] = ex.temperature
    return partitioning.shard_batch(batch, self.job.partitioner.mesh)

  def predict(self, choice: Any, batch: Any, rng: Optional[jax.Array] = None,
              compile_only: bool = False) -> Any:
    """Decodes one batch (dispatches it); a (choice, width) met for the first time is compiled
    first (counted apart from decoding). compile_only: whether it compiled, nothing decoded."""
    compiled_before = self.predictor.compile_seconds
    compiled = self.predictor.prepare(choice, batch, self.rng)
    self.compile_seconds += self.predictor.compile_seconds - compiled_before
    if compile_only:
      return compiled
    return self.predictor(choice, batch, self.rng if rng is None else rng)

  def compile_first(self, examples: Sequence[inputs.Example]) -> None:
    first = self.make_batch(examples[:self.job.batch_size])
    self.predictor.compile(self.policy.fallback, first, self.rng)  # others when first chosen
    logging.info('Compiled the predict function in %.1f s.', self.predictor.compile_seconds)

  def decode_chunks(self, store: chunks.ChunkStore, examples: Sequence[inputs.Example],
                    vocabulary: Any, output_ids: bool, progress: bool,
                    chunk_hook: Optional[Callable[[int], None]]) -> int:
    """Decodes and commits every chunk not committed yet; returns how many were."""
    per_chunk = self.job.batch_size * self.job.checkpoint_period
    bar = None
    if progress and self.job.process == 0:
      from tqdm import tqdm  # pylint: disable=g-import-not-at-top
      bar = tqdm(total=len(examples), unit='sent', dynamic_ncols=True, file=sys.stderr)
    resumed = 0
    for c in range(self.num_chunks(examples)):
      members = examples[c * per_chunk:(c + 1) * per_chunk]
      if store.committed(c):
        resumed += 1
        if bar is not None:
          bar.update(len(members))
        continue
      records, seconds = self.decode_chunk(c, members, examples, vocabulary, output_ids, bar)
      store.commit(c, self.job.process, records, seconds)
      if chunk_hook is not None:
        chunk_hook(c)
    if bar is not None:
      bar.close()
    if self.job.num_processes > 1:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      multihost_utils.sync_global_devices('speculative_t5x.infer chunks written')
    return resumed

  def decode_chunk(self, c: int, members: Sequence[inputs.Example],
                   examples: Sequence[inputs.Example], vocabulary: Any, output_ids: bool,
                   bar: Any) -> Tuple[List[Dict[str, Any]], float]:
    """This process's records of chunk c and its decode seconds (compilation excluded).

    A batch's random key depends only on the chunk and batch numbers, so a resumed run samples
    exactly what an uninterrupted one would.
    """
    start, compiled_before = time.time(), self.compile_seconds

    def batches():  # made while the batches before are decoding
      for b in range(-(-len(members) // self.job.batch_size)):
        rows = members[b * self.job.batch_size:(b + 1) * self.job.batch_size]
        yield rows, jax.random.fold_in(jax.random.fold_in(self.rng, c), b), self.make_batch(rows)

    records = []
    for (rows, _, _), choice, outputs in self.policy.stream(
        batches(), lambda choice, item: self.predict(choice, item[2], item[1]),
        lambda choice, item: self.predict(choice, item[2], compile_only=True)):
      decodes, aux = _process_rows(outputs, self.job.process, self.job.local_batch)
      for row, ex in enumerate(self.job.mine(rows)):
        stats = {k: v[row] for k, v in aux.get('stats', {}).items()}
        if self.policy.setting is not None:
          stats[self.policy.setting] = list(choice) if isinstance(choice, tuple) else choice
        records.append(_json_record(ex, decodes[row], aux['scores'][row], stats, vocabulary,
                                    output_ids))
      if bar is not None:
        bar.update(len(rows))
    return records, time.time() - start - (self.compile_seconds - compiled_before)


def _json_record(ex: inputs.Example, tokens: np.ndarray, score: float,
                 stats: Mapping[str, Any], vocabulary: Any, output_ids: bool) -> Dict[str, Any]:
  inputs_ = {'inputs_pretokenized': ex.inputs}
  if ex.targets is not None:
    inputs_['targets_pretokenized'] = ex.targets
  record = {'index': ex.index, 'inputs': inputs_, 'prediction': vocabulary.decode(tokens)}
  if output_ids:
    ids = [int(t) for t in tokens]
    record['prediction_tokens'] = ids[:ids.index(PAD_ID)] if PAD_ID in ids else ids
  record['aux'] = {'scores': float(score),
                   'stats': {k: np.asarray(v).tolist() for k, v in stats.items()}}
  return record


def _policy_summary(records: Sequence[Dict[str, Any]], decoding_policy: policy.DecodingPolicy,
                    batch_size: int, decode_kwargs: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
  """gamma / branching='auto': the schedule (examples per choice, from the records on disk, so
  that a resumed run's summary covers every chunk), the verifier each speculative gamma ran
  ('auto' resolves per gamma; 'tree' for a token tree the model chose) and this run's
  measurements; else None."""
  setting = decoding_policy.setting
  if setting is None:
    return None
  used = collections.Counter(str(r['aux']['stats'][setting]) for r in records)
  out = {'batch_size': batch_size, 'examples_by_choice': dict(sorted(used.items()))}
  if setting == 'gamma':
    verification = decode_kwargs.get('verification', decoding.AUTO_VERIFICATION)
    out['verification'] = {g: 'tree' if g.startswith('[') else decoding.resolve_verification(
        verification, int(g), decode_kwargs.get('temperature', 1.0)) for g in sorted(used)
        if g.startswith('[') or int(g) > 0}
  return {**out, **decoding_policy.summary()}


def _process_rows(outputs: Any, process: int, local_batch: int) -> Any:
  """This process's rows of the global predict outputs, as numpy."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    outputs = multihost_utils.process_allgather(outputs, tiled=True)
  outputs = jax.tree.map(np.asarray, outputs)
  return jax.tree.map(lambda x: x[process * local_batch:(process + 1) * local_batch], outputs)


def _write_summary(store: chunks.ChunkStore, run: _Run, examples: Sequence[inputs.Example],
                   model: models.EncoderDecoderModel, decode_kwargs: Mapping[str, Any],
                   report: inputs.InputReport, wall_start: float, load_seconds: float,
                   resumed: int, checkpoint_paths: Tuple[str, Optional[str]]) -> Dict[str, Any]:
  """Process 0's end of the job: merges the committed chunks into the predictions file and
  writes the run summary (returned) and the operative config beside it.

  wall_start: time.time() when the job began; resumed: the chunks an earlier run committed;
  checkpoint_paths: (target, draft) as given.
  """
  num_chunks = run.num_chunks(examples)
  records, decode_seconds = store.merge(num_chunks, [ex.index for ex in examples])
  target_path, draft_path = checkpoint_paths
  summary = _summary(records, model, decode_kwargs, report, {
      'wall_seconds': time.time() - wall_start, 'compile_seconds': run.compile_seconds,
      'load_seconds': load_seconds, 'decode_seconds': decode_seconds,
      'resumed_chunks': resumed, 'chunks': num_chunks}, {
          'target_checkpoint': target_path,
          'draft_checkpoint': draft_path if model.uses_draft else None, **run.job.summary()})
  summary['policy'] = _policy_summary(records, run.policy, run.job.batch_size, decode_kwargs)
  store.finish(records, summary, gin.operative_config_str())
  logging.info('Wrote %d predictions to %s', len(records), store.output_path)
  return summary


def _summary(records: List[Dict[str, Any]], model: models.EncoderDecoderModel,
             decode_kwargs: Mapping[str, Any], report: inputs.InputReport,
             times: Dict[str, float], run: Dict[str, Any]) -> Dict[str, Any]:
  """Corpus-level statistics of a finished run (ratios of sums, not means of ratios)."""
  total = lambda key: int(sum(r['aux']['stats'].get(key, 0) for r in records))
  emitted, target_calls = total('emitted'), total('target_calls')
  proposed, accepted = total('proposed'), total('accepted')
  decode_seconds = max(times['decode_seconds'], 1e-9)
  return {
      'examples': len(records),
      'alpha': accepted / proposed if proposed else None,
      'tokens_per_target_call': emitted / target_calls if target_calls else None,
      'accepted_per_target_call': accepted / target_calls if target_calls else None,
      'sentences_per_second': len(records) / decode_seconds,
      'tokens_per_second': emitted / decode_seconds,
      'emitted_tokens': emitted, 'target_calls': target_calls, 'draft_calls': total('draft_calls'),
      'proposed': proposed, 'accepted': accepted, 'fallbacks': total('fallbacks'),
      'rollbacks': total('rollbacks'),
      **{k: round(v, 3) if isinstance(v, float) else v for k, v in times.items()},
      'skipped_empty': {'count': len(report.skipped_empty),
                        'indices': report.skipped_empty[:_MAX_LISTED]},
      'truncated_inputs': {'count': len(report.truncated),
                           'indices': report.truncated[:_MAX_LISTED],
                           'longest_input_tokens': report.longest_input},
      'config': {
          'decode_fn': _decode_fn_name(model.decode_fn),
          'decode_kwargs': decode_kwargs,
          'target': checkpoints.config_to_dict(model.target_config),
          'draft': checkpoints.config_to_dict(model.draft_config) if model.uses_draft else None,
          **run,
      },
  }


def _load_calibration(path: Optional[str]) -> Optional[costs.Calibration]:
  """speculative-t5x-calibrate's figures (None without a path); one line if unreadable."""
  if path is None:
    return None
  try:
    return costs.load_calibration(gin_utils.resolve_path(path))
  except (ValueError, FileNotFoundError) as e:
    raise InferError(f'infer_script.infer.calibration: {e}') from None


def _bound_decode_kwargs(fn: Any, explicit: Mapping[str, Any]) -> Dict[str, Any]:
  """The decode function's gin-bound arguments (as registered above) plus the model's
  decode_kwargs."""
  return {**gin_utils.bound_arguments(f'decoding.{_decode_fn_name(fn)}'), **dict(explicit)}


# ------------------------------------------------------------------------------------------------
# Command line.

# The run config most users start from, named by --help and by the error for a missing config.
EXAMPLE_ARGS = ('--gin_file=gin_configs/runs/infer_multi30k.gin',
                '--gin_file=gin_configs/decoding/speculative_greedy.gin',
                '--gin.INFER_OUTPUT_DIR="\'/tmp/infer\'"')
# The macros of gin_configs/runs/infer.gin, for --help (tests/test_bad_inputs.py checks that
# these are exactly the file's).
RUN_MACROS = {
    'INFER_OUTPUT_DIR': 'required: the folder of the predictions, summary and configs, e.g. '
                        '--gin.INFER_OUTPUT_DIR="\'/tmp/infer\'" (string values need quotes)',
    'INPUT_FILE': '.txt (one input per line), .tsv (input<TAB>target; a first line exactly '
                  'inputs<TAB>targets is a header) or .jsonl ({"inputs", "targets"}); '
                  'infer_multi30k.gin: the bundled caption sample',
    'MIXTURE_OR_TASK_NAME': 'a seqio task or mixture instead of INPUT_FILE (set INPUT_FILE=None; '
                            'needs the data extra)',
    'MIXTURE_OR_TASK_MODULE': 'the module that registers that task',
    'TASK_FEATURE_LENGTHS': "{'inputs': encoder length, 'targets': longest output}, default "
                            "{'inputs': 64, 'targets': 64}",
    'TARGET_CHECKPOINT_PATH': 'required: the target weights, any format checkpoints reads '
                              '(T5X, Orbax, export_weights file, training run, Hugging Face '
                              'folder); infer_multi30k.gin: the embedded target',
    'DRAFT_CHECKPOINT_PATH': 'the draft weights, for the draft-using decoders',
    'TARGET_CONFIG': "the target's network.T5Config (a pair file sets it)",
    'DRAFT_CONFIG': "the draft's network.T5Config (a pair file sets it)",
    'VOCABULARY': 'the SentencePiece vocabulary of both models (a pair file sets it)',
    'DRAFT_VOCABULARY': "the draft's vocabulary, checked to be the target's (default None)",
    'MODEL': 'the models.EncoderDecoderModel built from the macros above',
}
# infer's parameters that gin_configs/runs/infer.gin binds to RUN_MACROS (or that are no user's).
_SET_BY_MACROS = ('model', 'output_dir', 'target_checkpoint_path', 'draft_checkpoint_path',
                  'task_feature_lengths', 'mixture_or_task_name', 'mixture_or_task_module',
                  'input_file', 'chunk_hook')
# Bindings of the decoders most runs change (each decoding file sets its own).
DECODING_BINDINGS = {
    'decoding.speculative_sample.gamma': "draft tokens per target call: a whole number >= 1, "
                                         "or 'auto' (the job picks gamma 0 = the target alone "
                                         'to infer_script.infer.max_gamma per batch)',
    'decoding.speculative_sample.temperature': '0 = greedy (exact: the target\'s greedy '
                                               'output); > 0 samples the target\'s distribution',
    'decoding.speculative_beam_search.branching': "draft tree children per depth, or 'auto'",
}


def _help_text() -> str:
  """--help: the flags, the packaged gin files, the macros and bindings a user sets."""
  settings = ', '.join(f'{name}={p.default!r}' for name, p in
                       inspect.signature(infer).parameters.items()
                       if name not in _SET_BY_MACROS and p.default is not gin.REQUIRED)
  entries = lambda table: '\n'.join(gin_utils.help_entry(k, v) for k, v in table.items())
  return '\n'.join([
      'usage: speculative-t5x-infer --gin_file=RUN.gin [--gin_file=DECODING.gin] '
      '[--gin.NAME=VALUE ...] [flags]', '',
      __doc__.split('\n\n')[0], '',
      'e.g. the bundled German captions with the embedded pair, greedy speculative decoding:',
      '  speculative-t5x-infer ' + ' \\\n      '.join(EXAMPLE_ARGS), '',
      'flags:', gin_utils.flags_help(_FLAG_NAMES), '',
      'gin files (relative paths: the working directory first, then the packaged ones):',
      gin_utils.gin_files_help(['runs', 'pairs', 'decoding']),
      gin_utils.help_entry('gin_configs/models/...', "T5X's T5 1.1 and mT5 sizes, each under "
                           'its own scope (e.g. @t5_1_1_xl/network.T5Config())'), '',
      'macros of gin_configs/runs/infer.gin (--gin.NAME=VALUE):', entries(RUN_MACROS), '',
      'bindings of the decoders (the decoding files set them):', entries(DECODING_BINDINGS),
      '', 'the job\'s other settings:',
      gin_utils.help_entry('infer_script.infer.*', f'{settings} (the defaults; `python -m pydoc '
                           'speculative_t5x.infer` describes each, under "Settings")'),
  ])


def _check_run_config(gin_files: Sequence[str]) -> None:
  """InferError naming what is missing when no gin file binds infer's required settings (gin's
  own error for them is a RuntimeError with a traceback)."""
  unbound = []
  for name, parameter in inspect.signature(infer).parameters.items():
    if parameter.default is gin.REQUIRED:
      try:
        gin.query_parameter(f'infer_script.infer.{name}')
      except ValueError:
        unbound.append(name)
  if unbound:
    what = (f'infer_script.infer.{{{", ".join(unbound)}}} not bound (gin_configs/runs/infer.gin '
            'binds them)' if gin_files else 'no gin file given')
    raise InferError(f'{what}: a run needs a run config and an output folder, e.g. '
                     f'{" ".join(EXAMPLE_ARGS)} (see --help)')


_FLAG_NAMES = ('gin_file', 'gin_bindings', 'gin_search_paths', *gin_utils.PROCESS_FLAGS)


def _define_flags() -> None:
  gin_utils.define_gin_flags()
  gin_utils.define_process_flags()


def main(argv: Sequence[str]) -> None:
  del argv
  flags_ = flags.FLAGS
  try:
    gin_utils.initialize_processes()
    try:
      gin_utils.parse_gin_flags(flags_.gin_file, flags_.gin_bindings, flags_.gin_search_paths)
    except (ValueError, KeyError, IOError, SyntaxError) as e:
      raise InferError(f'gin config: {gin_utils.error_line(e)}') from None
    _check_run_config(flags_.gin_file)
    try:
      summary = infer()
    except (InferError, speculative_t5x.MissingExtraError):
      raise
    except (ValueError, RuntimeError, TypeError) as e:
      # Errors raised while gin builds the configured objects (missing/invalid bindings,
      # draft/target mismatch in the model) carry gin's context lines.
      if 'gin' in str(e) or 'In call to configurable' in str(e) or isinstance(e, ValueError):
        raise InferError(gin_utils.error_line(e)) from None
      raise
  except InferError as e:
    gin_utils.exit_with_error(str(e).splitlines()[0])  # without gin's context lines
  except speculative_t5x.MissingExtraError as e:
    gin_utils.exit_with_error(str(e).splitlines()[0])  # without gin's context lines
  if summary:
    keys = ('examples', 'alpha', 'tokens_per_target_call', 'sentences_per_second',
            'tokens_per_second', 'wall_seconds', 'compile_seconds')
    print(json.dumps({k: summary.get(k) for k in keys}), flush=True)


def run(argv: Optional[Sequence[str]] = None) -> None:
  """The `speculative-t5x-infer` command (argv: sys.argv's form, the program first)."""
  _define_flags()
  gin_utils.run(main, argv, help_text=_help_text)


if __name__ == '__main__':
  run()
