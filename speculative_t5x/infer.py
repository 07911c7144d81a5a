r"""Gin-configured inference jobs, like `python -m t5x.infer`, for speculative and BiLD decoding.

  python -m speculative_t5x.infer \
    --gin_file=gin_configs/runs/infer_multi30k.gin \
    --gin_file=gin_configs/decoding/speculative_greedy.gin \
    --gin.INFER_OUTPUT_DIR="'/tmp/infer'"

(or the `speculative-t5x-infer` command). Gin files, checkpoints, vocabularies and input files
given as relative paths are found in the working directory first, then in the installed package
(`gin_utils.resolve_path`), so the packaged configs work from any directory.

Input: a seqio task (MIXTURE_OR_TASK_NAME, split) or a file (INPUT_FILE): plain text (one input
per line), TSV (input, optional target) or JSONL ({"inputs": ..., "targets": ...}).
Output, in INFER_OUTPUT_DIR, T5X's layout:

  <name>-predict_with_aux.jsonl-<shard>-of-<n>   one JSON object per example:
      {"index", "inputs": {"inputs_pretokenized", ["targets_pretokenized"]}, "prediction",
       ["prediction_tokens"], "aux": {"scores", "stats": {target_calls, accepted, ...}}}
  <that>.COMPLETED, <that>.summary.json (alpha, tokens per target call, rates, times, config),
  config.gin (the parsed config) and operative_config.gin (what the run used).

Resumability: examples are cut into chunks of `checkpoint_period` batches; a chunk's results are
written to a temporary file and atomically renamed into `tmp-<name>-<shard>-of-<n>/`. A rerun
of the same command skips committed chunks, so a job killed at any instant loses at most the
chunk in flight and duplicates nothing. Every batch has the same shape (the last is padded), so
the predict function is compiled once; its random key depends only on the chunk and batch
numbers, so a resumed run samples exactly what an uninterrupted one would.

Bad input gives one line on stderr and exit status 1 (or a logged, counted skip for empty
lines); see `InferError`.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import hashlib
import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from absl import flags
from absl import logging
import gin
import jax
import jax.numpy as jnp
import numpy as np

import speculative_t5x
from speculative_t5x import autogamma
from speculative_t5x import beam_search
from speculative_t5x import checkpoints
from speculative_t5x import data
from speculative_t5x import decoding
from speculative_t5x import gin_utils
from speculative_t5x import models
from speculative_t5x import network
from speculative_t5x import partitioning

PAD_ID = 0
_MODE = 'predict_with_aux'
# How many skipped/truncated example positions the summary lists (the counts are complete).
_MAX_LISTED = 50


class InferError(ValueError):
  """A problem with the job's input, config or environment, reported as one line."""


# ------------------------------------------------------------------------------------------------
# Gin registrations. Registering is idempotent for the same object, and gin's registry is the
# only state (train.py registers network.T5Config the same way).

gin.external_configurable(network.T5Config, module='network')
gin.external_configurable(models.EncoderDecoderModel, module='models')
gin.external_configurable(decoding.temperature_sample, module='decoding')
gin.external_configurable(decoding.speculative_sample, module='decoding')
gin.external_configurable(decoding.bild_decode, module='decoding')
gin.external_configurable(beam_search.beam_search, module='decoding')
gin.external_configurable(beam_search.speculative_beam_search, module='decoding')
gin.external_configurable(partitioning.Partitioner, module='partitioning')
gin.external_configurable(partitioning.standard_logical_axis_rules, module='partitioning')


@gin.configurable(module='vocabularies')
class SentencePieceVocabulary:
  """A SentencePiece vocabulary without TensorFlow (the seqio class's name and arguments).

  Ids: pieces as in the model file (T5: pad 0, EOS 1, UNK 2), then `extra_ids` sentinels.
  A relative path is tried against the working directory, then the package (`gin_utils.resolve_path`).
  """

  def __init__(self, sentencepiece_model_file: str, extra_ids: int = 0):
    import sentencepiece as spm  # pylint: disable=g-import-not-at-top
    path = gin_utils.resolve_path(sentencepiece_model_file)
    if str(sentencepiece_model_file).startswith('gs://') or not path.is_file():
      raise InferError(f'vocabulary file not found: {sentencepiece_model_file} (a local '
                       'path is needed; copy gs:// files first)')
    self.path = path
    self.model_bytes = path.read_bytes()
    self._sp = spm.SentencePieceProcessor(model_proto=self.model_bytes)
    self.extra_ids = extra_ids

  @property
  def eos_id(self) -> int:
    return int(self._sp.eos_id())

  @property
  def unk_id(self) -> int:
    return int(self._sp.unk_id())

  @property
  def vocab_size(self) -> int:
    return int(self._sp.get_piece_size()) + self.extra_ids

  @property
  def digest(self) -> str:
    """Identity of the vocabulary: same pieces and extra ids <=> same digest."""
    return hashlib.sha256(self.model_bytes + str(self.extra_ids).encode()).hexdigest()[:16]

  def encode(self, text: str) -> List[int]:
    return list(self._sp.encode(text))

  def decode(self, ids: Sequence[int]) -> str:
    """Text of ids up to the first EOS; padding and sentinel ids are dropped."""
    ids = [int(i) for i in ids]
    if self.eos_id in ids:
      ids = ids[:ids.index(self.eos_id)]
    size = self._sp.get_piece_size()
    return self._sp.decode([i for i in ids if 0 < i < size])


# ------------------------------------------------------------------------------------------------
# Input.


@dataclasses.dataclass
class Example:
  """One input: `index` is its position in the source (line number - 1 for files)."""
  index: int
  inputs: str
  targets: Optional[str] = None
  tokens: Optional[List[int]] = None


@dataclasses.dataclass
class InputReport:
  """What reading and tokenizing did besides producing examples."""
  skipped_empty: List[int] = dataclasses.field(default_factory=list)
  truncated: List[int] = dataclasses.field(default_factory=list)
  longest_input: int = 0


def _input_format(path: Path, input_format: str) -> str:
  if input_format != 'auto':
    if input_format not in ('text', 'tsv', 'jsonl'):
      raise InferError(f"input_format must be 'auto', 'text', 'tsv' or 'jsonl', got "
                       f'{input_format!r}')
    return input_format
  return {'.tsv': 'tsv', '.jsonl': 'jsonl', '.json': 'jsonl'}.get(path.suffix.lower(), 'text')


def read_input_file(path: os.PathLike, input_format: str = 'auto',
                    report: Optional[InputReport] = None) -> List[Example]:
  """Examples of a text, TSV or JSONL file, in order; empty inputs are skipped and recorded.

  Raises InferError naming the line for undecodable bytes (not UTF-8), malformed JSON or a
  JSON line without a string "inputs".
  """
  path = gin_utils.resolve_path(path)
  report = InputReport() if report is None else report
  try:
    raw = path.read_bytes()
  except FileNotFoundError:
    raise InferError(f'input file not found: {path}') from None
  except OSError as e:
    raise InferError(f'cannot read input file {path}: {e.strerror}') from None
  fmt = _input_format(path, input_format)
  lines = raw.split(b'\n')
  if lines and lines[-1] == b'':
    lines.pop()  # The newline that ends the last line does not start another.
  examples = []
  for i, line in enumerate(lines):
    where = f'{path}:{i + 1}'
    try:
      text = line.decode('utf-8').rstrip('\r')
    except UnicodeDecodeError as e:
      raise InferError(f'{where}: undecodable bytes (not UTF-8) at byte {e.start}: '
                       f'{line[e.start:e.start + 4]!r}') from None
    targets = None
    if fmt == 'tsv':
      fields = text.split('\t')
      text, targets = fields[0], (fields[1] if len(fields) > 1 else None)
    elif fmt == 'jsonl':
      if not text.strip():
        report.skipped_empty.append(i)
        logging.warning('%s: empty line skipped', where)
        continue
      try:
        obj = json.loads(text)
      except json.JSONDecodeError as e:
        raise InferError(f'{where}: invalid JSON ({e.msg} at column {e.colno})') from None
      if not isinstance(obj, dict) or not isinstance(obj.get('inputs'), str):
        raise InferError(f'{where}: a JSON object with a string "inputs" is needed')
      text, targets = obj['inputs'], obj.get('targets')
      if targets is not None and not isinstance(targets, str):
        raise InferError(f'{where}: "targets" must be a string')
    if not text.strip():
      report.skipped_empty.append(i)
      logging.warning('%s: empty input skipped', where)
      continue
    examples.append(Example(i, text, targets))
  return examples


def read_task(name: str, split: str, module: Optional[str] = None) -> List[Example]:
  """The pretokenized examples of a seqio task or mixture split, in order."""
  # seqio and TensorFlow register gin configurables when first imported, which gin refuses
  # once the parsed config is locked.
  with gin.unlock_config():
    if module:
      importlib.import_module(module)
    seqio = speculative_t5x.require('seqio', 'data', 'seqio tasks')  # imports TensorFlow
  try:
    provider = seqio.get_mixture_or_task(name)
  except ValueError:
    raise InferError(f'unknown seqio task or mixture {name!r} (set MIXTURE_OR_TASK_MODULE to '
                     'the module that registers it)') from None
  ds = provider.get_dataset(sequence_length=None, split=split, shuffle=False, num_epochs=1)
  examples = []
  for i, ex in enumerate(ds.as_numpy_iterator()):
    text = ex.get('inputs_pretokenized', b'')
    target = ex.get('targets_pretokenized')
    as_str = lambda v: v.decode('utf-8') if isinstance(v, bytes) else v
    examples.append(Example(i, as_str(text), as_str(target) if target is not None else None))
  return examples


def tokenize(examples: List[Example], vocabulary: Any, max_length: int,
             report: InputReport) -> None:
  """Fills `tokens` (ids + EOS); longer inputs are cut to max_length - 1 ids + EOS, as seqio."""
  eos = vocabulary.eos_id
  for ex in examples:
    ids = vocabulary.encode(ex.inputs)
    report.longest_input = max(report.longest_input, len(ids) + 1)
    if len(ids) + 1 > max_length:
      report.truncated.append(ex.index)
      ids = ids[:max_length - 1]
    ex.tokens = ids + [eos]
  if report.truncated:
    logging.warning('%d input(s) longer than %d tokens were truncated (first: example %d).',
                    len(report.truncated), max_length, report.truncated[0])


# ------------------------------------------------------------------------------------------------
# Output files.


def _atomic_write(path: Path, text: str) -> None:
  """Writes `text` to `path` so that readers see either nothing or all of it."""
  tmp = path.with_name(f'{path.name}.tmp-{os.getpid()}')
  with open(tmp, 'w', encoding='utf-8') as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def check_writable(directory: Path) -> None:
  """Creates `directory` and proves a file can be written there (InferError if not)."""
  try:
    directory.mkdir(parents=True, exist_ok=True)
    probe = directory / f'.write-test-{os.getpid()}'
    probe.write_text('')
    probe.unlink()
  except OSError as e:
    raise InferError(f'output directory {directory} is not writable: '
                     f'{e.strerror or e}') from None


def _json_record(ex: Example, tokens: np.ndarray, score: float, stats: Mapping[str, Any],
                 vocabulary: Any, output_ids: bool) -> Dict[str, Any]:
  inputs = {'inputs_pretokenized': ex.inputs}
  if ex.targets is not None:
    inputs['targets_pretokenized'] = ex.targets
  record = {'index': ex.index, 'inputs': inputs, 'prediction': vocabulary.decode(tokens)}
  if output_ids:
    ids = [int(t) for t in tokens]
    record['prediction_tokens'] = ids[:ids.index(PAD_ID)] if PAD_ID in ids else ids
  record['aux'] = {'scores': float(score),
                   'stats': {k: np.asarray(v).tolist() for k, v in stats.items()}}
  return record


# ------------------------------------------------------------------------------------------------
# Model set-up.


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


def _config_dict(config: Optional[network.T5Config]) -> Optional[Dict[str, Any]]:
  if config is None:
    return None
  out = dataclasses.asdict(config)
  out['dtype'] = str(jnp.dtype(out['dtype']))
  out['mlp_activations'] = list(out['mlp_activations'])
  return out


def _decode_fn_name(fn: Any) -> str:
  return getattr(getattr(fn, 'func', fn), '__name__', str(fn))


# ------------------------------------------------------------------------------------------------
# The job.


@gin.configurable(module='infer_script')
def infer(*,
          model: models.EncoderDecoderModel = gin.REQUIRED,
          output_dir: str = gin.REQUIRED,
          target_checkpoint_path: str = gin.REQUIRED,
          draft_checkpoint_path: Optional[str] = None,
          task_feature_lengths: Mapping[str, int] = gin.REQUIRED,
          input_length_step: int = 0,
          mixture_or_task_name: Optional[str] = None,
          mixture_or_task_module: Optional[str] = None,
          input_file: Optional[str] = None,
          input_format: str = 'auto',
          split: str = 'test',
          batch_size: int = 32,
          checkpoint_period: int = 4,
          partitioner: Optional[partitioning.Partitioner] = None,
          shard_id: int = 0,
          num_shards: int = 1,
          output_ids: bool = False,
          dtype: Optional[str] = 'auto',
          seed: int = 0,
          num_decodes: int = 1,
          max_gamma: int = autogamma.MAX_GAMMA,
          auto_min_batches: int = autogamma.MIN_BATCHES,
          progress: bool = True) -> Dict[str, Any]:
  """Decodes every example of a task split or file; returns (and writes) the run summary.

  Args:
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
      gamma tried: gammas 0 (target alone) to max_gamma are compiled and timed on the first
      batches, then each batch uses the one `autogamma.GammaTuner` predicts fastest (recorded
      per example as stats.gamma, and in the summary). Jobs of fewer than auto_min_batches
      batches skip that and use autogamma.FALLBACK_GAMMA.
    progress: show a progress bar (process 0).
  """
  wall_start = time.time()
  if (mixture_or_task_name is None) == (input_file is None):
    raise InferError('set exactly one of MIXTURE_OR_TASK_NAME and INPUT_FILE')
  for key in ('inputs', 'targets'):
    if not isinstance(task_feature_lengths, Mapping) or key not in task_feature_lengths:
      raise InferError(f"TASK_FEATURE_LENGTHS needs an '{key}' length, got "
                       f'{task_feature_lengths!r}')
  input_length, target_length = (int(task_feature_lengths['inputs']),
                                 int(task_feature_lengths['targets']))
  if not 0 <= shard_id < num_shards:
    raise InferError(f'shard_id {shard_id} is not in [0, num_shards={num_shards})')
  output_dir = Path(output_dir)
  check_writable(output_dir)
  partitioner = partitioner or partitioning.Partitioner()
  process, num_processes = jax.process_index(), jax.process_count()
  if batch_size % partitioner.data_size or batch_size % num_processes:
    raise InferError(f'batch_size {batch_size} must be a multiple of the mesh data size '
                     f'{partitioner.data_size} and of the process count {num_processes}')

  # The vocabulary pair must be checked before anything expensive.
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

  name = mixture_or_task_name or Path(input_file).name
  output_fname = f'{name}-{_MODE}.jsonl-{shard_id:05}-of-{num_shards:05}'
  output_path = output_dir / output_fname
  summary_path = output_dir / f'{output_fname}.summary.json'
  if process == 0:
    _atomic_write(output_dir / 'config.gin', gin.config_str())
  if (output_dir / f'{output_fname}.COMPLETED').exists() and summary_path.exists():
    logging.info('%s is complete; nothing to do.', output_path)
    return json.loads(summary_path.read_text())

  # Input.
  report = InputReport()
  if input_file is not None:
    examples = read_input_file(input_file, input_format, report)
  else:
    examples = read_task(mixture_or_task_name, split, mixture_or_task_module)
    for ex in list(examples):
      if not ex.inputs.strip():
        report.skipped_empty.append(ex.index)
    examples = [ex for ex in examples if ex.inputs.strip()]
  examples = examples[shard_id::num_shards]
  tokenize(examples, model.input_vocabulary or vocabulary, input_length, report)
  if not examples:
    raise InferError(f'no examples to decode in {input_file or mixture_or_task_name} '
                     f'({len(report.skipped_empty)} empty skipped)')

  # Chunks are fixed by the input and these numbers alone; a rerun with other numbers must
  # not mix its chunks with these.
  run_key = hashlib.sha256(json.dumps({
      'gin': gin.config_str(), 'indices': [ex.index for ex in examples],
      'tokens': hashlib.sha256(json.dumps([ex.tokens for ex in examples]).encode()).hexdigest(),
      'processes': num_processes, 'num_decodes': num_decodes}, sort_keys=True).encode()).hexdigest()[:16]
  tmp_dir = output_dir / f'tmp-{name}-{shard_id:05}-of-{num_shards:05}'
  tmp_dir.mkdir(exist_ok=True)
  key_file = tmp_dir / 'run_key'
  if key_file.exists() and key_file.read_text().strip() != run_key:
    raise InferError(f'{tmp_dir} holds a partial run with a different config or input; '
                     'remove it or use another INFER_OUTPUT_DIR')
  if process == 0 and not key_file.exists():
    _atomic_write(key_file, run_key)

  # Model.
  dtype = _resolve_dtype(dtype)
  model = _with_activation_dtype(model, dtype)
  load_start = time.time()
  params = {'target': _load(target_checkpoint_path, model.target_config, dtype, 'target')}
  if model.uses_draft:
    params['draft'] = _load(draft_checkpoint_path, model.draft_config, dtype, 'draft')
  # Decode-time weight layouts once per job, not once per batch (eager: each process computes
  # its full copy, as it holds full parameters before sharding).
  params = model.with_decode_variables(params)
  load_seconds = time.time() - load_start
  shardings = partitioner.pair_shardings(model, params)
  params = partitioning.shard_params(params, shardings)

  local_batch = batch_size // num_processes

  def make_batch(rows: Sequence[Example]) -> Any:
    """This process's rows of the global batch `rows`, padded and sharded; the encoder width
    comes from all of `rows`, so that every process builds the same global shape."""
    mine = rows[process * local_batch:(process + 1) * local_batch]
    width = data.input_width([ex.tokens for ex in rows], input_length, input_length_step)
    enc = np.zeros((local_batch, width), np.int32)
    for row, ex in enumerate(mine):
      enc[row, :len(ex.tokens)] = ex.tokens
    return partitioning.shard_batch({
        'encoder_input_tokens': enc,
        'decoder_input_tokens': np.zeros((local_batch, target_length), np.int32)},
                                    partitioner.mesh)

  compile_start = time.time()
  rng0 = jax.random.PRNGKey(seed)
  decode_kwargs = _bound_decode_kwargs(model.decode_fn, model.decode_kwargs)
  candidates = {None: model}
  if autogamma.wants_auto(model, decode_kwargs):
    # One compiled predict per candidate gamma, timed on the job's first batches; a job too
    # short to pay for that decodes at the fallback gamma.
    decoders = autogamma.decoders(model, decode_kwargs, max_gamma)
    candidates = {g: decoders[g] for g in autogamma.candidates(
        -(-len(examples) // batch_size), max_gamma, auto_min_batches)}
    if len(candidates) == 1:
      logging.info("gamma='auto': %d examples make fewer than %d batches; gamma %d, no "
                   'calibration.', len(examples), auto_min_batches, autogamma.FALLBACK_GAMMA)
  partitioned = {gamma: partitioner.partition_predict(m, params, num_decodes=num_decodes)
                 for gamma, m in candidates.items()}
  compiled = {}  # (gamma, encoder width): executable
  compile_seconds = 0.0

  def predict(gamma: Optional[int], batch: Any) -> Any:
    nonlocal compile_seconds
    key = (gamma, batch['encoder_input_tokens'].shape[1])
    if key not in compiled:
      start = time.time()
      compiled[key] = partitioned[gamma].lower(params, batch, rng0).compile()
      compile_seconds += time.time() - start
    return compiled[key]

  first_batch = make_batch(examples[:batch_size])
  for gamma in partitioned:
    predict(gamma, first_batch)
  compile_seconds = time.time() - compile_start
  logging.info('Compiled the %s predict function%s in %.1f s.', _decode_fn_name(model.decode_fn),
               f's for gamma in {sorted(partitioned)}' if len(partitioned) > 1 else '',
               compile_seconds)
  tuner, calibration_seconds = None, 0.0

  # Decode, chunk by chunk.
  chunk_examples = batch_size * checkpoint_period
  num_chunks = -(-len(examples) // chunk_examples)
  chunk_file = lambda c, p: tmp_dir / f'chunk{c:05}-process{p:05}.jsonl'
  meta_file = lambda c, p: tmp_dir / f'chunk{c:05}-process{p:05}.meta.json'
  bar = None
  if progress and process == 0:
    from tqdm import tqdm  # pylint: disable=g-import-not-at-top
    bar = tqdm(total=len(examples), unit='sent', dynamic_ncols=True, file=sys.stderr)
  resumed = 0
  for c in range(num_chunks):
    members = examples[c * chunk_examples:(c + 1) * chunk_examples]
    if all(chunk_file(c, p).exists() for p in range(num_processes)):
      resumed += 1
      if bar is not None:
        bar.update(len(members))
      continue
    chunk_start, chunk_compile_start = time.time(), compile_seconds
    records = []
    for b in range(-(-len(members) // batch_size)):
      rows = members[b * batch_size:(b + 1) * batch_size]
      mine = rows[process * local_batch:(process + 1) * local_batch]
      batch = make_batch(rows)
      rng = jax.random.fold_in(jax.random.fold_in(rng0, c), b)
      gamma = next(iter(partitioned))
      if len(partitioned) > 1:
        if tuner is None:
          calibration_start, compiled_before = time.time(), compile_seconds
          tuner = _calibrate(predict, list(partitioned), params, examples, batch_size,
                             make_batch, rng0)
          calibration_seconds = (time.time() - calibration_start -
                                 (compile_seconds - compiled_before))
          chunk_start += calibration_seconds  # decode_seconds: decoding only
          logging.info('gamma=auto: %s', tuner.summary())
        gamma = tuner.choose()
        if num_processes > 1:  # every process must run the same program
          from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
          gamma = int(multihost_utils.broadcast_one_to_all(np.int32(gamma)))
      decodes, aux = predict(gamma, batch)(params, batch, rng)
      decodes, aux = _process_rows((decodes, aux), process, local_batch)
      if tuner is not None:  # the running alpha
        tuner.observe({k: v[:len(mine)] for k, v in aux['stats'].items()})
      for row, ex in enumerate(mine):
        stats = {k: v[row] for k, v in aux.get('stats', {}).items()}
        if gamma is not None:
          stats['gamma'] = gamma
        records.append(_json_record(ex, decodes[row], aux['scores'][row], stats, vocabulary,
                                    output_ids))
      if bar is not None:
        bar.update(len(rows))
    decode_seconds = time.time() - chunk_start - (compile_seconds - chunk_compile_start)
    _atomic_write(meta_file(c, process), json.dumps({'decode_seconds': decode_seconds,
                                                     'examples': len(records)}))
    # The rename of the chunk file is the commit point of this chunk.
    _atomic_write(chunk_file(c, process),
                  ''.join(json.dumps(r, ensure_ascii=False) + '\n' for r in records))
  if bar is not None:
    bar.close()
  if num_processes > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    multihost_utils.sync_global_devices('speculative_t5x.infer chunks written')
  if process != 0:
    return {}

  # Merge (in example order), then summarise from what is on disk, so that a resumed run's
  # summary covers every chunk.
  merged, decode_seconds = [], 0.0
  for c in range(num_chunks):
    for p in range(num_processes):
      merged += [json.loads(l) for l in chunk_file(c, p).read_text(encoding='utf-8').splitlines()]
      decode_seconds += json.loads(meta_file(c, p).read_text())['decode_seconds'] / num_processes
  merged.sort(key=lambda r: r['index'])
  indices = [r['index'] for r in merged]
  if indices != [ex.index for ex in examples]:
    raise InferError(f'chunk files in {tmp_dir} do not cover the input exactly; remove it')
  _atomic_write(output_path, ''.join(json.dumps(r, ensure_ascii=False) + '\n' for r in merged))
  summary = _summary(merged, model, report, examples, {
      'wall_seconds': time.time() - wall_start, 'compile_seconds': compile_seconds,
      'load_seconds': load_seconds, 'decode_seconds': decode_seconds,
      'resumed_chunks': resumed, 'chunks': num_chunks,
      'calibration_seconds': calibration_seconds}, {
          'target_checkpoint': target_checkpoint_path,
          'draft_checkpoint': draft_checkpoint_path if model.uses_draft else None,
          'source': input_file or f'{mixture_or_task_name}:{split}',
          'task_feature_lengths': {'inputs': input_length, 'targets': target_length},
          'input_length_step': input_length_step, 'batch_size': batch_size, 'checkpoint_period': checkpoint_period,
          'mesh': dict(partitioner.mesh.shape), 'processes': num_processes,
          'devices': jax.device_count(), 'backend': jax.default_backend(),
          'dtype': str(dtype) if dtype is not None else None, 'seed': seed,
          'num_decodes': num_decodes,
          'shard': [shard_id, num_shards]})
  # From the records on disk, so that a resumed run's summary covers every chunk.
  used = collections.Counter(r['aux']['stats']['gamma'] for r in merged
                             if 'gamma' in r['aux']['stats'])
  summary['gamma_auto'] = None if not used else {
      **(tuner.summary() if tuner else {}), 'examples_by_gamma': dict(sorted(used.items()))}
  _atomic_write(summary_path, json.dumps(summary, indent=2))
  _atomic_write(output_dir / 'operative_config.gin', gin.operative_config_str())
  _atomic_write(output_dir / f'{output_fname}.COMPLETED', '')
  logging.info('Wrote %d predictions to %s; summary %s', len(merged), output_path, summary_path)
  return summary


def _calibrate(predict: Callable[[int, Any], Any], gammas: Sequence[int], params: Any,
               examples: Sequence[Example], batch_size: int, make_batch: Callable,
               rng: jax.Array) -> autogamma.GammaTuner:
  """gamma='auto': times every candidate gamma on the job's first batches; predict(gamma,
  batch) is the executable for that gamma and the batch's shape."""
  count = autogamma.calibration_batches(batch_size, -(-len(examples) // batch_size))
  batches = [make_batch(examples[b * batch_size:(b + 1) * batch_size]) for b in range(count)]
  return autogamma.calibrate(
      {g: (lambda batch, g=g: predict(g, batch)(params, batch, rng)) for g in gammas}, batches)


def _process_rows(outputs: Any, process: int, local_batch: int) -> Any:
  """This process's rows of the global predict outputs, as numpy."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    outputs = multihost_utils.process_allgather(outputs, tiled=True)
  outputs = jax.tree.map(np.asarray, outputs)
  return jax.tree.map(lambda x: x[process * local_batch:(process + 1) * local_batch], outputs)


def _summary(records: List[Dict[str, Any]], model: models.EncoderDecoderModel,
             report: InputReport, examples: List[Example], times: Dict[str, float],
             run: Dict[str, Any]) -> Dict[str, Any]:
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
          'decode_kwargs': _bound_decode_kwargs(model.decode_fn, model.decode_kwargs),
          'target': _config_dict(model.target_config),
          'draft': _config_dict(model.draft_config) if model.uses_draft else None,
          **run,
      },
  }


def _bound_decode_kwargs(fn: Any, explicit: Mapping[str, Any]) -> Dict[str, Any]:
  """The decode function's gin-bound arguments plus the model's decode_kwargs."""
  name = _decode_fn_name(fn)
  bound = {}
  for key in ('temperature', 'topk', 'topp', 'gamma', 'lenience', 'adaptive_gamma',
              'draft_confidence_threshold', 'fallback_threshold', 'rollback_threshold',
              'max_small_steps', 'beam_size', 'alpha', 'branching'):
    try:
      bound[key] = gin.query_parameter(f'decoding.{name}.{key}')
    except ValueError:
      pass
  return {**bound, **dict(explicit)}


# ------------------------------------------------------------------------------------------------
# Command line.


def _define_flags() -> None:
  gin_utils.define_gin_flags()
  for name, default, help_text in (
      ('coordinator_address', None, 'host:port of process 0 for jax.distributed (multi-host), '
       "or 'auto' where JAX discovers the cluster (Cloud TPU, SLURM)."),
      ('process_count', None, 'Number of processes (jax.distributed).'),
      ('process_index', None, 'This process (jax.distributed).')):
    if name not in flags.FLAGS:
      flags.DEFINE_string(name, default, help_text)


def main(argv: Sequence[str]) -> None:
  del argv
  flags_ = flags.FLAGS
  try:
    if flags_.coordinator_address:
      # CPU processes need a collectives implementation to run one program together (tests,
      # CPU clusters); TPU and GPU ignore this setting.
      jax.config.update('jax_cpu_collectives_implementation', 'gloo')
      if flags_.coordinator_address == 'auto':
        jax.distributed.initialize()  # Cloud TPU / SLURM: JAX discovers the cluster itself.
      else:
        jax.distributed.initialize(flags_.coordinator_address, int(flags_.process_count),
                                   int(flags_.process_index))
    try:
      gin_utils.parse_gin_flags(flags_.gin_file, flags_.gin_bindings, flags_.gin_search_paths)
    except (ValueError, KeyError, IOError, SyntaxError) as e:
      raise InferError(f'gin config: {gin_utils.error_line(e)}') from None
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
    gin_utils.exit_with_error(str(e))
  except speculative_t5x.MissingExtraError as e:
    gin_utils.exit_with_error(str(e).splitlines()[0])  # without gin's context lines
  if summary:
    keys = ('examples', 'alpha', 'tokens_per_target_call', 'sentences_per_second',
            'tokens_per_second', 'wall_seconds', 'compile_seconds')
    print(json.dumps({k: summary.get(k) for k in keys}), flush=True)


def run() -> None:
  """The `speculative-t5x-infer` command."""
  _define_flags()
  gin_utils.run(main)


if __name__ == '__main__':
  run()
