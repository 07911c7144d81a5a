r"""Training and draft distillation for T5 on Multi30k, in T5X's style, with optax and Orbax.

  python -m speculative_t5x.train \
    --gin_file=gin_configs/train/multi30k_target.gin \
    --gin.train.model_dir="'runs/target'"

What follows T5X: optax Adafactor with T5X's defaults (decay_rate 0.8, step offset 0, factored
second moments, parameter-scaled updates, update clipping 1.0, no momentum); the rsqrt learning
rate `scale / sqrt(max(step, warmup_steps))`; cross-entropy plus z-loss 1e-4 * log(Z)^2 on the
logits; packed examples with segment ids; checkpoints every N steps.

What is added: resumable training (params, optimizer state, step and data position are in every
Orbax checkpoint; a killed run continues with the batches and dropout masks an uninterrupted run
would have used), a wall-clock budget accumulated over restarts, validation loss and greedy BLEU
every M steps, and draft distillation (`distillation` = 'sequence' or 'token').

`train` is the job's outline; its parts are the helpers below it. The losses, greedy evaluation
and sequence distillation data are in `evaluation.py`; config.json, the Orbax run checkpoints'
reader and the bf16 weights files are in `checkpoints.py`.

Everything is numpy + JAX: no TensorFlow on the training path (see `data.py`).

Settings (gin: `train.NAME`):

  model_dir: run folder: checkpoints/, config.json, log of metrics (metrics.jsonl).
  config: the network's T5Config (vocab_size = the vocabulary rounded up to 128).
  data_dir: folder holding multi30k/ (default $SPECULATIVE_T5X_DATA or <repo>/../shared/data).
  mixture_or_task_name: read the data through this seqio task (e.g. 'multi30k_de_en', T5X's
    MIXTURE_OR_TASK_NAME) instead of the plain-Python reader; needs seqio + TensorFlow.
  data_files: {split: a TSV (input<TAB>target) or JSONL ({"inputs", "targets"}) file}, e.g.
    {'train': 'pairs.tsv', 'validation': 'dev.jsonl'}: those splits come from the files,
    tokenized as every split is (`data.encode`), the others as above.
  source_language, target_language: the plain reader's direction (ignored with a task).
  max_input_length, max_target_length: packed row lengths (and eval padding lengths).
  batch_size: packed rows per step.
  num_train_steps: stop at this step.
  max_train_seconds: also stop once this much training time (summed over restarts) is spent;
    the rsqrt schedule needs no total step count, so a time budget is a clean stop.
  learning_rate_scale, warmup_steps: lr = scale / sqrt(max(step, warmup_steps)).
  checkpoint_every: Orbax checkpoint interval in steps (also at the end and on SIGTERM).
  eval_every: validation loss (all of val) and greedy BLEU (first eval_bleu_examples) interval.
  final_eval_splits: splits evaluated in full (loss and BLEU) at the end, into results.json.
  export_path: if set, the final params as a bf16 weights file (see
    `checkpoints.export_weights`).
  distillation: 'none'; 'sequence' (targets = the teacher's greedy outputs for the training
    inputs, cached in `distillation_cache`); or 'token' (loss = (1 - kd_weight) * CE +
    kd_weight * T^2 D(teacher_T, student_T) over `kd_sequences`).
  kd_sequences: the sequences token distillation runs the teacher and student on: 'data' (the
    real targets), 'teacher' (the teacher's greedy outputs, as sequence distillation's, cached in
    `distillation_cache`: the prefixes greedy speculative decoding visits), 'teacher_samples'
    (one sample of the teacher's per input at kd_sample_temperature: the prefixes speculative
    sampling keeps), 'student_samples' (on-policy: one sample of the student's own, drawn from
    the params it starts from, so meant with init_from; chain runs for more rounds), or several
    joined by '+', each input once per source ('both' is 'data+teacher'). The teacher's samples
    are cached beside `distillation_cache` (its name + '.teacher_samples.npz'), the student's
    in model_dir (student_samples.npz: the samples of this run's start, reused on resume).
  kd_sample_temperature: the temperature of those samples.
  kd_divergence: D of token distillation: 'forward_kl', 'reverse_kl', 'jsd' or 'tv' (total
    variation, whose complement is speculative sampling's per-token acceptance).
  teacher: the teacher's exported weights file or training folder (distillation only).
  max_train_examples: use only the first n training pairs (also bounds the sequence
    distillation set, whose greedy decoding is the expensive part).
  init_from: start from these params (exported weights file or training folder; same config)
    instead of a random init, e.g. to fine-tune the undistilled draft on distillation data.
    Ignored when the run resumes from its own checkpoint.
  init_partial: take only init_from's parameters that match this config's by name and shape
    (the rest from the seeded init, listed in the log), e.g. a decoder-only draft started from
    a separate draft's decoder.
  encoder: for a decoder-only config (`T5Config.encoded_width`): the weights file or training
    folder of the model whose encoder output it reads (the target), frozen; its encoder runs
    inside every step and evaluation. Only for such a config.
  feature_passes: a feature draft's (`T5Config.feature_width`) passes per step: the first reads
    the target's features, each later one the draft's own from the pass before
    (`_feature_draft_loss`); it trains by token distillation with the target as teacher and
    encoder, without evaluation of its own.
  partitioner: the mesh and logical axis rules (`partitioning.Partitioner`, as the infer job's):
    the student, its optimizer slots, the teacher and the frozen encoder are split over
    'model' by their parameters' logical axes, each batch over 'data' (batch_size a multiple
    of its size); across hosts each process feeds its rows of every global batch (start the
    processes with --coordinator_address, as the infer job's). Default: one device.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import signal
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from absl import flags
from flax import traverse_util
import gin
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec
import orbax.checkpoint as ocp

import speculative_t5x
from speculative_t5x import checkpoints
from speculative_t5x import data
from speculative_t5x import evaluation
from speculative_t5x import gin_utils
from speculative_t5x import inputs as inputs_lib
from speculative_t5x import network
from speculative_t5x.errors import InferError
from speculative_t5x import partitioning

Array = jnp.ndarray
PyTree = Any
# {'params', 'opt_state', 'step'}: the training state every checkpoint holds.
State = Dict[str, Any]
# A packed training batch's features (`data.PackedBatches`), each [batch, length].
BATCH_FEATURES = ('encoder_input_tokens', 'encoder_segment_ids', 'decoder_input_tokens',
                  'decoder_target_tokens', 'decoder_segment_ids', 'decoder_loss_weights')
# A training step: (state, batch, ...) -> (state, metrics).
Step = Callable[..., Tuple[State, Dict[str, Array]]]
# A teacher's (config, params), or (None, None) without distillation.
Teacher = Tuple[Optional[network.T5Config], Optional[PyTree]]
# Where token distillation's sequences come from (`train`'s kd_sequences, joined by '+').
KD_SEQUENCES = ('data', 'teacher', 'teacher_samples', 'student_samples')

# Gin's handle on T5Config (`@network.T5Config()` in gin files); calling it applies the bindings.
GinT5Config = gin.external_configurable(network.T5Config, module='network')
# The mesh and rules, as the infer job's (`train.partitioner = @partitioning.Partitioner()`).
gin.external_configurable(partitioning.Partitioner, module='partitioning')
gin.external_configurable(partitioning.standard_logical_axis_rules, module='partitioning')


# ------------------------------------------------------------------------------------------------
# Optimizer and schedule.


def rsqrt_schedule(scale: float = 1.0, warmup_steps: int = 10000) -> Callable[[Array], Array]:
  """T5X's default schedule: `scale / sqrt(max(step, warmup_steps))` (constant during warmup)."""

  def schedule(step):
    return scale * jax.lax.rsqrt(jnp.maximum(jnp.asarray(step, jnp.float32), warmup_steps))

  return schedule


def make_optimizer(learning_rate_scale: float, warmup_steps: int) -> optax.GradientTransformation:
  """Adafactor as T5X configures it by default (factored, decay_rate 0.8, step_offset 0)."""
  return optax.adafactor(
      learning_rate=rsqrt_schedule(learning_rate_scale, warmup_steps),
      min_dim_size_to_factor=128, decay_rate=0.8, decay_offset=0,
      multiply_by_parameter_scale=True, clipping_threshold=1.0, momentum=None, eps=1e-30,
      factored=True)


# ------------------------------------------------------------------------------------------------
# Examples: plain Python, or a seqio task.


def load_examples(split: str, source_language: str, target_language: str,
                  max_input_length: int, max_target_length: int,
                  data_dir: Optional[str] = None, mixture_or_task_name: Optional[str] = None,
                  max_examples: Optional[int] = None, data_file: Optional[str] = None
                  ) -> Tuple[List[str], List[str], List[List[int]], List[List[int]]]:
  """(source texts, reference texts, input ids, target ids) of a split; ids end in EOS.

  With `data_file` (TSV or JSONL, `inputs.read_input_file`'s formats, every line with a
  target) the split is that file's pairs. Else without `mixture_or_task_name` Multi30k's files
  are read and tokenized in plain Python; with it, the examples come from the registered seqio
  task (TensorFlow), unshuffled and unpacked, in file order; both give the same ids
  (tests/test_data.py checks the tasks against the plain path).
  """
  if data_file is not None:
    sources, references = inputs_lib.read_pairs(data_file)
    sources, references = sources[:max_examples], references[:max_examples]
    return (sources, references,
            *data.tokenize_pairs(sources, references, max_input_length, max_target_length))
  if mixture_or_task_name is None:
    sources, references = data.load_split(split, source_language, target_language, data_dir)
    if max_examples is not None:
      sources, references = sources[:max_examples], references[:max_examples]
    inputs, targets = data.tokenize_pairs(sources, references, max_input_length,
                                          max_target_length)
    return sources, references, inputs, targets
  seqio = speculative_t5x.require('seqio', 'data', 'seqio tasks')  # TensorFlow: only this path
  if mixture_or_task_name not in seqio.TaskRegistry.names():
    data.register_tasks(data_dir)
  task = seqio.get_mixture_or_task(mixture_or_task_name)
  dataset = task.get_dataset({'inputs': max_input_length, 'targets': max_target_length},
                             split=split, shuffle=False)
  if max_examples is not None:
    dataset = dataset.take(max_examples)
  sources, references, inputs, targets = [], [], [], []
  for ex in dataset.as_numpy_iterator():
    sources.append(ex['inputs_pretokenized'].decode('utf-8'))
    references.append(ex['targets_pretokenized'].decode('utf-8'))
    inputs.append(ex['inputs'].tolist())
    targets.append(ex['targets'].tolist())
  return sources, references, inputs, targets


# ------------------------------------------------------------------------------------------------
# The job: `train` and its parts.


@gin.configurable
def train(*,
          model_dir: str = gin.REQUIRED, config: network.T5Config = gin.REQUIRED,
          data_dir: Optional[str] = None, mixture_or_task_name: Optional[str] = None,
          data_files: Optional[Dict[str, str]] = None, source_language: str = 'de', target_language: str = 'en',
          max_input_length: int = 64, max_target_length: int = 64,
          batch_size: int = 64, pack: bool = True,
          num_train_steps: int = 100000, max_train_seconds: Optional[float] = None,
          learning_rate_scale: float = 1.0, warmup_steps: int = 10000,
          z_loss: float = 1e-4, label_smoothing: float = 0.0, seed: int = 0,
          log_every: int = 20, checkpoint_every: int = 200, keep_checkpoints: int = 2,
          eval_every: int = 500, eval_batch_size: int = 128, eval_bleu_examples: int = 256,
          final_eval_splits: Sequence[str] = ('validation', 'test'),
          export_path: Optional[str] = None,
          distillation: str = 'none', teacher: Optional[str] = None,
          kd_weight: float = 1.0, kd_temperature: float = 1.0,
          kd_divergence: str = 'forward_kl', kd_sequences: str = 'data',
          kd_sample_temperature: float = 1.0,
          distillation_cache: Optional[str] = None, max_train_examples: Optional[int] = None,
          init_from: Optional[str] = None, init_partial: bool = False,
          encoder: Optional[str] = None, feature_passes: int = 1,
          partitioner: Optional[partitioning.Partitioner] = None) -> Dict[str, Any]:
  """Trains (or resumes) a model; returns the final metrics.
  Each setting is described in this module's docstring ("Settings").
  """
  distill = _Distillation(distillation, teacher, kd_weight, kd_temperature, distillation_cache,
                          kd_divergence, kd_sequences, kd_sample_temperature)
  _check_feature_draft(config, distill, eval_every, final_eval_splits, feature_passes)
  placement = _Placement(partitioner)
  placement.check(batch_size)
  model_dir = _prepare_model_dir(model_dir, config)
  frozen_encoder = _load_encoder(config, encoder)
  dataset = _Dataset(source_language, target_language, max_input_length, max_target_length,
                     data_dir, mixture_or_task_name, batch_size, pack, seed,
                     tuple((data_files or {}).items()))
  state = _initial_state(config, make_optimizer(learning_rate_scale, warmup_steps), seed,
                         init_from, init_partial, placement)
  batches, num_pairs, teacher_model = _training_data(
      dataset, config, distill, max_train_examples, eval_batch_size,
      student=(config, state['params'], frozen_encoder), run_dir=model_dir)
  if encoder is not None and _same_file(encoder, teacher):
    frozen_encoder = teacher_model  # read once, placed once
  validation = dataset.load('validation')[:2]
  checkpointer = _Checkpointer(model_dir / 'checkpoints', checkpoint_every, keep_checkpoints,
                               batches)
  state, progress = checkpointer.restore(state)
  _print_summary(config, state, num_pairs, batches)
  objective = _objective(config, distill, teacher_model, z_loss, label_smoothing, frozen_encoder,
                         feature_passes)
  train_step = _train_step(placement, objective, learning_rate_scale, warmup_steps, seed, state,
                           teacher_model, frozen_encoder)
  evaluator = _Evaluator(config, dataset, validation, eval_batch_size, eval_every,
                         eval_bleu_examples, tuple(final_eval_splits), frozen_encoder)
  schedule = rsqrt_schedule(learning_rate_scale, warmup_steps)
  with _MetricsLog(model_dir / 'metrics.jsonl', schedule, log_every) as log, checkpointer:
    with _StopRule(num_train_steps, max_train_seconds) as stop:
      state, step = _run_steps(state, progress, train_step, batches, checkpointer, evaluator, log,
                               stop)
    results = {'step': step, 'train_seconds': progress['train_seconds'],
               'parameters': _num_params(state),
               'decode_flops_per_token': config.decode_flops_per_token()}
    if not stop.signalled:  # A signal means "stop now": no export or final evaluation.
      _finish(results, state['params'], config, export_path, distillation, evaluator, log,
              model_dir)
  return {**results, 'state': state}


def _check_feature_draft(config: network.T5Config, distill: _Distillation, eval_every: int,
                         final_eval_splits: Sequence[str], feature_passes: int) -> None:
  """One line for settings a feature draft cannot train with: it reads the target's features,
  so it learns from the target (token distillation, the target the teacher) and cannot decode
  alone (no BLEU evaluation, no samples of its own)."""
  if not config.feature_width:
    if feature_passes != 1:
      raise ValueError(f'feature_passes {feature_passes} is for a feature draft '
                       '(T5Config.feature_width); this config has none.')
    return
  if distill.mode != 'token' or 'student_samples' in distill.sources:
    raise ValueError("A feature draft learns by token distillation from its target: set "
                     "train.distillation = 'token' (kd_sequences without student_samples).")
  if eval_every or final_eval_splits:
    raise ValueError('A feature draft cannot decode alone: set train.eval_every = 0 and '
                     'train.final_eval_splits = [] (benchmarks.drafts measures it with its target).')
  if feature_passes < 1:
    raise ValueError(f'feature_passes must be >= 1, got {feature_passes}.')


def _prepare_model_dir(model_dir: str, config: network.T5Config) -> Path:
  """The run folder, created, holding config.json (and config.gin when gin configured the run)."""
  model_dir = Path(model_dir).resolve()
  model_dir.mkdir(parents=True, exist_ok=True)
  if jax.process_index() == 0:  # (every host has the same)
    (model_dir / 'config.json').write_text(checkpoints.config_to_json(config))
    if gin.config_str():
      (model_dir / 'config.gin').write_text(gin.config_str())
  vocab = data.vocab_size()
  if config.vocab_size < vocab:
    raise ValueError(f'config.vocab_size {config.vocab_size} < vocabulary size {vocab}.')
  return model_dir


def _same_file(a: Optional[str], b: Optional[str]) -> bool:
  return (a is not None and b is not None and
          gin_utils.resolve_path(a).resolve() == gin_utils.resolve_path(b).resolve())


def _load_encoder(config: network.T5Config, path: Optional[str]) -> evaluation.Encoder:
  """The frozen (config, params) whose encoder a decoder-only `config` reads; None otherwise."""
  if config.has_encoder:
    if path is not None:
      raise ValueError('train.encoder is only for a decoder-only config (encoded_width > 0).')
    return None
  if path is None:
    raise ValueError(f'A decoder-only config (encoded_width {config.encoded_width}) needs '
                     'train.encoder: the weights of the model whose encoder it reads.')
  encoder_config, encoder_params = checkpoints.load_model(path)
  if encoder_config.emb_dim != config.encoded_width:
    raise ValueError(f'train.encoder {path} has emb_dim {encoder_config.emb_dim}, but the config '
                     f'reads encoder outputs of width {config.encoded_width}.')
  return encoder_config, encoder_params


@dataclasses.dataclass(frozen=True)
class _Distillation:
  """What a draft learns from a teacher (`train`'s distillation, teacher, kd_* arguments)."""
  mode: str  # 'none', 'sequence' or 'token'
  teacher: Optional[str]
  weight: float
  temperature: float
  cache: Optional[str]
  divergence: str = 'forward_kl'
  sequences: str = 'data'  # token distillation's: KD_SEQUENCES joined by '+', or 'both'
  sample_temperature: float = 1.0

  def __post_init__(self):
    if self.mode not in ('none', 'sequence', 'token'):
      raise ValueError(
          f"distillation must be 'none', 'sequence' or 'token', not {self.mode!r}.")
    if self.divergence not in evaluation.DIVERGENCES:
      raise ValueError(f'kd_divergence must be one of {evaluation.DIVERGENCES}, not '
                       f'{self.divergence!r}.')
    if not set(self._sequence_sources) <= set(KD_SEQUENCES):
      raise ValueError(f"kd_sequences must be one of {KD_SEQUENCES} or several joined by '+', "
                       f'not {self.sequences!r}.')
    if self.sample_temperature <= 0:
      raise ValueError(f'kd_sample_temperature must be > 0, not {self.sample_temperature}.')

  @property
  def sources(self) -> Tuple[str, ...]:
    """Where the training targets come from, each giving one per input (KD_SEQUENCES)."""
    if self.mode != 'token':
      return ('teacher',) if self.mode == 'sequence' else ('data',)
    return self._sequence_sources

  @property
  def _sequence_sources(self) -> Tuple[str, ...]:
    return tuple(('data+teacher' if self.sequences == 'both' else self.sequences).split('+'))

  def cache_for(self, source: str, run_dir: Path) -> Optional[str]:
    """The cache file of a decoded source: the teacher's greedy outputs in `cache` itself, its
    samples beside it, the student's samples (of this run's starting params) in `run_dir`."""
    if source == 'student_samples':
      return str(run_dir / 'student_samples.npz')
    if self.cache is None or source == 'teacher':
      return self.cache
    return f'{self.cache}.{source}.npz'

  def load_teacher(self, config: network.T5Config) -> Teacher:
    """The teacher's (config, params), or (None, None) without distillation."""
    if self.mode == 'none':
      return None, None
    if self.teacher is None:
      raise ValueError('Distillation needs `teacher` (weights file or training folder).')
    teacher_config, teacher_params = checkpoints.load_model(self.teacher)
    if teacher_config.vocab_size != config.vocab_size:
      raise ValueError('Teacher and student must share the (padded) vocabulary.')
    return teacher_config, teacher_params


@dataclasses.dataclass(frozen=True)
class _Dataset:
  """Where the examples come from and how they are batched (T5X's DatasetConfig, for this job)."""
  source_language: str
  target_language: str
  max_input_length: int
  max_target_length: int
  data_dir: Optional[str]
  mixture_or_task_name: Optional[str]
  batch_size: int
  pack: bool
  seed: int
  files: Tuple[Tuple[str, str], ...] = ()  # (split, TSV or JSONL file)

  def load(self, split: str, max_examples: Optional[int] = None
           ) -> Tuple[List[str], List[str], List[List[int]], List[List[int]]]:
    """`load_examples` of `split`: (source texts, reference texts, input ids, target ids)."""
    return load_examples(split, self.source_language, self.target_language,
                         self.max_input_length, self.max_target_length, data_dir=self.data_dir,
                         mixture_or_task_name=self.mixture_or_task_name,
                         max_examples=max_examples, data_file=dict(self.files).get(split))

  def batches(self, inputs: Sequence[Sequence[int]],
              targets: Sequence[Sequence[int]]) -> data.PackedBatches:
    """The endless, seeded stream of packed [batch_size, length] batches of the pairs."""
    return data.PackedBatches(inputs, targets, self.batch_size, self.max_input_length,
                              self.max_target_length, seed=self.seed, pack=self.pack)


def _training_data(dataset: _Dataset, config: network.T5Config, distill: _Distillation,
                   max_examples: Optional[int], decode_batch_size: int,
                   student: Tuple[network.T5Config, PyTree, evaluation.Encoder],
                   run_dir: Path) -> Tuple[data.PackedBatches, int, Teacher]:
  """(training batches, number of training pairs, teacher).

  Each of the distillation's sources gives every training input a target: its real one, the
  teacher's greedy output or sample, or a sample of the student's own (`student`: its config,
  the params it starts from, the encoder it reads), decoded `decode_batch_size` rows at a time
  or read from the distillation cache. With several sources each input appears once per source.
  """
  _, _, inputs, targets = dataset.load('train', max_examples=max_examples)
  teacher = distill.load_teacher(config)
  all_inputs, all_targets = [], []
  for source in distill.sources:
    all_inputs += list(inputs)
    if source == 'data':
      all_targets += list(targets)
      continue
    model, reads = (teacher, None) if source.startswith('teacher') else (student[:2], student[2])
    all_targets += evaluation.sequence_distillation_targets(
        *model, inputs, dataset.max_input_length, dataset.max_target_length,
        distill.cache_for(source, run_dir), decode_batch_size,
        temperature=0.0 if source == 'teacher' else distill.sample_temperature,
        seed=dataset.seed, encoder=reads)
  return dataset.batches(all_inputs, all_targets), len(all_inputs), teacher


def _on_mesh(sharding: jax.sharding.Sharding, replicated: NamedSharding) -> jax.sharding.Sharding:
  """`sharding`, or `replicated` for one on a single device: optimizer slots computed from no
  parameter (Adafactor's count) come out of `tx.init` there."""
  return sharding if len(sharding.device_set) > 1 else replicated


@dataclasses.dataclass(frozen=True)
class _Placement:
  """Where a run's arrays live and its step runs (T5X's partitioner role, for this job): one
  device without a partitioner; with one, its mesh: each model's parameters split by their
  logical axes and the partitioner's rules (the same as the infer job's), the Adafactor slots
  where XLA's sharding propagation puts them from the parameters, the batch split over 'data'
  (each process feeding its own rows of the global batch, as T5X's per-host input pipeline)."""
  partitioner: Optional[partitioning.Partitioner] = None

  def check(self, batch_size: int) -> None:
    if self.partitioner is not None and batch_size % self.partitioner.data_size:
      raise ValueError(f'batch_size {batch_size} must be a multiple of the mesh\'s data size '
                       f'{self.partitioner.data_size}.')

  def params(self, config: network.T5Config, params: Optional[PyTree]) -> Optional[PyTree]:
    """`params` of a `config` model on the mesh (as given without a partitioner)."""
    if self.partitioner is None or params is None:
      return params
    mesh, rules = self.partitioner.mesh, self.partitioner.logical_axis_rules
    shardings = partitioning.params_shardings(
        params, partitioning.params_logical_axes(config), mesh, rules)
    return partitioning.shard_params(params, shardings)

  def state(self, params: PyTree, tx: optax.GradientTransformation) -> State:
    """Step 0's state of placed `params`: fresh optimizer slots, placed beside them."""
    if self.partitioner is None:
      return {'params': params, 'opt_state': tx.init(params), 'step': jnp.int32(0)}
    replicated = NamedSharding(self.partitioner.mesh, PartitionSpec())
    opt_state = jax.tree.map(lambda x: jax.device_put(x, _on_mesh(x.sharding, replicated)),
                             jax.jit(tx.init)(params))
    return {'params': params, 'opt_state': opt_state,
            'step': jax.device_put(jnp.int32(0), replicated)}

  def batch(self, batch: Dict[str, Any]) -> Dict[str, Array]:
    """A global host batch on the device(s): on a mesh, this process's rows split over 'data'."""
    if self.partitioner is None:
      return {k: jnp.asarray(v) for k, v in batch.items()}
    if jax.process_count() > 1:
      rows = len(next(iter(batch.values()))) // jax.process_count()
      start = jax.process_index() * rows
      batch = {k: v[start:start + rows] for k, v in batch.items()}
    return partitioning.shard_batch(batch, self.partitioner.mesh)

  def step(self, objective: evaluation.Objective, learning_rate_scale: float, warmup_steps: int,
           seed: int, state: State) -> Step:
    """`make_step` compiled for this placement: the state keeps `state`'s shardings."""
    if self.partitioner is None:
      return _single_device_step(objective, learning_rate_scale, warmup_steps, seed)
    shardings = jax.tree.map(lambda x: x.sharding, state)
    replicated = NamedSharding(self.partitioner.mesh, PartitionSpec())
    return jax.jit(make_step(objective, learning_rate_scale, warmup_steps, seed),
                   donate_argnums=(0,), out_shardings=(shardings, replicated))


def _initial_state(config: network.T5Config, tx: optax.GradientTransformation, seed: int,
                   init_from: Optional[str], partial: bool = False,
                   placement: _Placement = _Placement()) -> State:
  """Step 0: the params of `init_from` (same tree as config's; with `partial`, those that match)
  or a seeded init, fresh slots, placed."""
  params, _ = network.init_params(config, jax.random.PRNGKey(seed))
  if init_from is not None:
    init_config, init_params = checkpoints.load_model(init_from)
    if partial:
      params = _matching_params(params, init_params, init_from)
    elif jax.tree_util.tree_structure(init_params) != jax.tree_util.tree_structure(params) or any(
        a.shape != b.shape for a, b in zip(jax.tree_util.tree_leaves(init_params),
                                           jax.tree_util.tree_leaves(params))):
      raise ValueError(f'init_from={init_from} has config {init_config}, not {config}.')
    else:
      params = init_params
  return placement.state(placement.params(config, params), tx)


def _matching_params(params: PyTree, source: PyTree, name: str) -> PyTree:
  """`params` with every leaf that `source` has under the same name and shape taken from it."""
  flat = traverse_util.flatten_dict(params, sep='/')
  given = traverse_util.flatten_dict(source, sep='/')
  taken = {k for k, v in flat.items() if k in given and given[k].shape == v.shape}
  if not taken:
    raise ValueError(f'init_from={name} has no parameter of this config\'s names and shapes.')
  fresh = sorted(set(flat) - taken)
  print(f'init_from {name}: {len(taken)} of {len(flat)} parameters taken; fresh: '
        f'{", ".join(fresh) or "none"}', flush=True)
  return traverse_util.unflatten_dict(
      {k: jnp.asarray(given[k]) if k in taken else v for k, v in flat.items()}, sep='/')


def _num_params(state: State) -> int:
  return int(sum(x.size for x in jax.tree_util.tree_leaves(state['params'])))


def _print_summary(config: network.T5Config, state: State, num_pairs: int,
                   batches: data.PackedBatches) -> None:
  print(f'{config}\n{_num_params(state) / 1e6:.2f}M parameters; decode FLOPs/token '
        f'{config.decode_flops_per_token() / 1e6:.2f}M; {num_pairs} training pairs, '
        f'{batches.batches_per_epoch()} batches of {batches.batch_size} packed rows per epoch.',
        flush=True)


class _Checkpointer:
  """The run's Orbax checkpoints: the state, and the progress as JSON.

  Progress is the training time summed over restarts and the data position, so a resumed run
  continues with the batches (and, through the step, the dropout masks) an uninterrupted run
  would have used. Closing it (or leaving its `with` block) closes the Orbax manager.
  """

  def __init__(self, directory: Path, every: int, keep: int, batches: data.PackedBatches):
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                           enable_async_checkpointing=False)
    self._manager = ocp.CheckpointManager(directory, options=options)
    self._every = every
    self._batches = batches
    self._saved_step: Optional[int] = None

  def __enter__(self) -> _Checkpointer:
    return self

  def __exit__(self, *exc_info) -> None:
    self._manager.close()

  def restore(self, state: State) -> Tuple[State, Dict[str, Any]]:
    """(state, progress) of the latest checkpoint, with the batches moved to its data position;
    `state` and fresh progress when there is none. `state` gives the restored tree's structure."""
    progress = {'train_seconds': 0.0, 'data': self._batches.state}
    latest = self._manager.latest_step()
    if latest is not None:
      abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, state)
      restored = self._manager.restore(latest, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract), progress=ocp.args.JsonRestore()))
      state, progress = restored['state'], restored['progress']
      self._batches.set_state(progress['data'])
      print(f'Resumed from step {latest} (data position {progress["data"]}, '
            f'{progress["train_seconds"]:.0f}s trained).', flush=True)
    self._saved_step = int(state['step'])
    return state, progress

  def save(self, step: int, state: State, progress: Dict[str, Any]) -> None:
    progress['data'] = self._batches.state
    self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                      progress=ocp.args.JsonSave(progress)),
                       force=True)
    self._saved_step = step

  def save_if_due(self, step: int, state: State, progress: Dict[str, Any]) -> None:
    if step % self._every == 0:
      self.save(step, state, progress)

  def save_last(self, step: int, state: State, progress: Dict[str, Any]) -> None:
    """Checkpoints `step` unless it already is the latest checkpoint, and waits for the write."""
    if step != self._saved_step or self._manager.latest_step() is None:
      self.save(step, state, progress)
    self._manager.wait_until_finished()


@dataclasses.dataclass(frozen=True)
class _Evaluator:
  """Teacher-forced loss and greedy BLEU (`evaluation.evaluate`), printed per split."""
  config: network.T5Config
  dataset: _Dataset
  validation: Tuple[List[str], List[str]]  # (sources, references), read once for every eval
  batch_size: int
  every: int  # 0: no evaluation during training
  bleu_examples: int  # greedy BLEU during training on this many validation examples
  final_splits: Tuple[str, ...]
  encoder: evaluation.Encoder = None  # what a decoder-only config reads

  def due(self, step: int) -> bool:
    return bool(self.every) and step % self.every == 0

  def periodic(self, step: int, params: PyTree) -> Dict[str, Any]:
    """The evaluation during training: validation, BLEU on the first `bleu_examples`."""
    return self.record(step, params, self.bleu_examples, ('validation',))

  def final(self, step: int, params: PyTree) -> Dict[str, Any]:
    """The evaluation at the end: `final_splits` in full."""
    return self.record(step, params, None, self.final_splits)

  def record(self, step: int, params: PyTree, bleu_examples: Optional[int],
             splits: Sequence[str]) -> Dict[str, Any]:
    """The metrics.jsonl record {'step', 'eval': {split: metrics}} of `params` on `splits`;
    greedy BLEU on the first `bleu_examples` of each (all when None)."""
    out, params = {}, _on_host(params)
    for split in splits:
      src, ref = self.validation if split == 'validation' else self.dataset.load(split)[:2]
      start = time.time()
      res = evaluation.evaluate(self.config, params, src, ref, self.dataset.max_input_length,
                                self.dataset.max_target_length, self.batch_size,
                                bleu_examples=bleu_examples, encoder=self.encoder)
      res['seconds'] = time.time() - start
      out[split] = res
      print(f'step {step} eval {split}: ' + ', '.join(
          f'{k} {v:.4f}' if isinstance(v, float) else f'{k} {v}' for k, v in res.items()),
            flush=True)
    return {'step': step, 'eval': out}


class _MetricsLog:
  """metrics.jsonl (one JSON record per line, appended over restarts) and the console's lines.

  Also the steps/s clock: a training record's rate covers the steps since the previous record,
  and evaluations restart the clock.
  """

  def __init__(self, path: Path, schedule: Callable[[Array], Array], every: int):
    self._file = open(path, 'a') if jax.process_index() == 0 else None  # one log for all hosts
    self._schedule = schedule
    self._every = every
    self.restart_clock()

  def __enter__(self) -> _MetricsLog:
    return self

  def __exit__(self, *exc_info) -> None:
    if self._file:
      self._file.close()

  def due(self, step: int) -> bool:
    return step % self._every == 0 or step == 1

  def restart_clock(self) -> None:
    self._window_start, self._window_steps = time.time(), 0

  def count_step(self) -> None:
    self._window_steps += 1

  def write(self, record: Dict[str, Any]) -> None:
    if self._file:
      self._file.write(json.dumps(record) + '\n')
      self._file.flush()

  def train_metrics(self, step: int, metrics: Dict[str, Any], train_seconds: float,
                    epoch: int) -> None:
    """Writes and prints step's record from its host metrics (sums over tokens)."""
    elapsed = time.time() - self._window_start
    tokens = float(metrics['tokens'])
    record = {
        'step': step, 'loss': float(metrics['loss']),
        'cross_entropy': float(metrics['cross_entropy']) / tokens,
        'z_loss': float(metrics['z_loss']) / tokens,
        'accuracy': float(metrics['accuracy']) / tokens,
        'grad_norm': float(metrics['grad_norm']),
        'learning_rate': float(self._schedule(step - 1)),
        'steps_per_second': self._window_steps / elapsed,
        'train_seconds': train_seconds,
        'epoch': epoch,
    }
    for key in metrics:  # (token distillation's, and a feature draft's per pass)
      if key.startswith(('kd_loss', 'agreement_')):
        record[key] = float(metrics[key]) / tokens
    self.write(record)
    agreement = ''.join(f' | {k.replace("agreement_pass_", "agree")} {v:.3f}'
                        for k, v in record.items() if k.startswith('agreement_'))
    print(f'step {step:6d} | loss {record["loss"]:.4f} | ce {record["cross_entropy"]:.4f} | '
          f'acc {record["accuracy"]:.3f}{agreement} | lr {record["learning_rate"]:.2e} | '
          f'{record["steps_per_second"]:.3f} steps/s | epoch {epoch} | '
          f'{train_seconds / 60:.1f} min', flush=True)
    self.restart_clock()


class _StopRule:
  """When the loop stops: at num_train_steps, once max_train_seconds of training (summed over
  restarts) are spent, or after SIGTERM/SIGINT.

  Inside its `with` block it catches those signals, so the run checkpoints and exits cleanly
  instead of dying mid-step; the previous handlers come back on leaving it.
  """

  def __init__(self, num_train_steps: int, max_train_seconds: Optional[float]):
    self._num_train_steps = num_train_steps
    self._max_train_seconds = max_train_seconds
    self._previous_handlers = {}
    self.signalled = False

  def __enter__(self) -> _StopRule:
    self._previous_handlers = {s: signal.signal(s, self._on_signal)
                               for s in (signal.SIGTERM, signal.SIGINT)}
    return self

  def __exit__(self, *exc_info) -> None:
    for s, h in self._previous_handlers.items():
      signal.signal(s, h)

  def _on_signal(self, signum, frame) -> None:
    del frame
    print(f'Signal {signum}: checkpointing and stopping.', flush=True)
    self.signalled = True

  def __call__(self, step: int, train_seconds: float) -> bool:
    """Whether to stop before training step `step + 1`."""
    if step >= self._num_train_steps or self.signalled:
      return True
    if self._max_train_seconds is not None and train_seconds >= self._max_train_seconds:
      print(f'Training time budget {self._max_train_seconds:.0f}s spent at step {step}.',
            flush=True)
      return True
    return False


def _objective(config: network.T5Config, distill: _Distillation, teacher: Teacher,
               z_loss: float, label_smoothing: float, encoder: evaluation.Encoder,
               feature_passes: int) -> evaluation.Objective:
  """The run's objective: sequence distillation only changes the targets, so it is the plain
  one."""
  token_level = distill.mode == 'token'
  return evaluation.Objective(
      config, z_loss, label_smoothing, 'token' if token_level else 'none',
      teacher[0] if token_level else None, distill.weight, distill.temperature,
      distill.divergence, encoder[0] if encoder else None, feature_passes)


def make_step(objective: evaluation.Objective, learning_rate_scale: float, warmup_steps: int,
              seed: int) -> Step:
  """The step, not compiled: (state, batch, teacher_params, encoder_params) -> (state, metrics
  summed over tokens, with the per-token `loss` and the gradient's norm)."""
  tx = make_optimizer(learning_rate_scale, warmup_steps)

  def step_fn(state, batch, teacher_params, encoder_params):
    # Dropout masks depend only on (seed, step): a resumed run draws the same masks.
    rng = jax.random.fold_in(jax.random.PRNGKey(seed), state['step'])
    (loss, metrics), grads = jax.value_and_grad(objective.loss, has_aux=True)(
        state['params'], batch, rng, teacher_params, encoder_params)
    updates, opt_state = tx.update(grads, state['opt_state'], state['params'])
    params = optax.apply_updates(state['params'], updates)
    metrics['loss'] = loss
    metrics['grad_norm'] = optax.tree.norm(grads)
    return {'params': params, 'opt_state': opt_state, 'step': state['step'] + 1}, metrics

  return step_fn


def _train_step(placement: _Placement, objective: evaluation.Objective,
                learning_rate_scale: float, warmup_steps: int, seed: int, state: State,
                teacher: Teacher, encoder: evaluation.Encoder) -> Step:
  """(state, host batch) -> (state, metrics): the placed step, with the frozen teacher and
  encoder placed once."""
  step = placement.step(objective, learning_rate_scale, warmup_steps, seed, state)
  teacher_params = (placement.params(objective.teacher_config, teacher[1])
                    if objective.teacher_config else None)
  # One copy on the devices when the encoder read is the teacher's (Objective.loss's default).
  shared = teacher_params is not None and encoder is not None and encoder[1] is teacher[1]
  encoder_params = placement.params(*encoder) if encoder and not shared else None
  return lambda state, batch: step(state, placement.batch(batch), teacher_params, encoder_params)


@functools.lru_cache(maxsize=8)
def _single_device_step(objective: evaluation.Objective, learning_rate_scale: float,
                        warmup_steps: int, seed: int) -> Step:
  """`make_step` jitted for one device, cached so that runs in one process (a resumed run,
  tests) reuse the compiled step."""
  return jax.jit(make_step(objective, learning_rate_scale, warmup_steps, seed),
                 donate_argnums=(0,))


def compile_step(objective: evaluation.Objective, partitioner: partitioning.Partitioner,
                 batch_size: int, lengths: Tuple[int, int], dtype: str = 'float32') -> Any:
  """The step compiled ahead of time for `partitioner`'s mesh from shapes alone: nothing is
  allocated, and the devices may be ones this machine lacks (a TPU topology's, compiled by
  XLA:TPU here). Its `memory_analysis()` is what one device holds: the student in float32 (as
  its updates need), the frozen models in `dtype`, the batch [batch_size, lengths (inputs,
  targets)]. A student reading its teacher's encoder holds one copy of it (`Objective.loss`)."""
  mesh, rules = partitioner.mesh, partitioner.logical_axis_rules

  def placed(config, dtype=dtype):
    shapes = jax.eval_shape(lambda: network.init_params(config)[0])
    shardings = partitioning.params_shardings(
        shapes, partitioning.params_logical_axes(config), mesh, rules)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, jnp.dtype(dtype), sharding=s),
                        shapes, shardings)

  params, tx = placed(objective.config, 'float32'), make_optimizer(1.0, 1)
  replicated = NamedSharding(mesh, PartitionSpec())
  slots = jax.jit(tx.init).lower(params).compile().output_shardings
  state = {'params': params, 'step': jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
           'opt_state': jax.tree.map(
               lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                 sharding=_on_mesh(s, replicated)),
               jax.eval_shape(tx.init, params), slots)}
  batch = {k: jax.ShapeDtypeStruct((batch_size, lengths[k.startswith('decoder')]),
                                   jnp.float32 if k.endswith('weights') else jnp.int32,
                                   sharding=partitioning.batch_sharding(mesh))
           for k in BATCH_FEATURES}
  teacher = placed(objective.teacher_config) if objective.teacher_config else None
  encoder = (placed(objective.encoder_config)
             if objective.encoder_config not in (None, objective.teacher_config) else None)
  step = _Placement(partitioner).step(objective, 1.0, 1, 0, state)
  return step.lower(state, batch, teacher, encoder).compile()


def _run_steps(state: State, progress: Dict[str, Any], train_step: Callable,
               batches: data.PackedBatches, checkpointer: _Checkpointer, evaluator: _Evaluator,
               log: _MetricsLog, stop: _StopRule) -> Tuple[State, int]:
  """Trains until `stop` says so; returns (state, step).

  Logs, checkpoints and evaluates on their periods. The last step is checkpointed however the
  loop ends: the stop rule, a signal, or an exception.
  """
  step = int(state['step'])
  try:
    while not stop(step, progress['train_seconds']):
      start = time.time()
      state, metrics = train_step(state, next(batches))
      step += 1
      # Syncs on logged steps only, so dispatch stays asynchronous.
      metrics = jax.device_get(metrics) if log.due(step) else None
      progress['train_seconds'] += time.time() - start
      log.count_step()
      if metrics is not None:
        log.train_metrics(step, metrics, progress['train_seconds'], batches.epoch)
      checkpointer.save_if_due(step, state, progress)
      if evaluator.due(step):
        log.write(evaluator.periodic(step, state['params']))
        log.restart_clock()
  finally:
    checkpointer.save_last(step, state, progress)
  return state, step


def _finish(results: Dict[str, Any], params: PyTree, config: network.T5Config,
            export_path: Optional[str], distillation: str, evaluator: _Evaluator,
            log: _MetricsLog, model_dir: Path) -> None:
  """Exports the bf16 weights, evaluates the final splits, writes results.json (and `results`);
  across hosts, process 0 writes."""
  params, writes = _on_host(params), jax.process_index() == 0
  if export_path and writes:
    size = checkpoints.export_weights(params, config, export_path, {
        'step': results['step'], 'train_seconds': results['train_seconds'],
        'distillation': distillation})
    results['export'] = {'path': str(export_path), 'bytes': size}
    print(f'Exported bf16 weights to {export_path} ({size / 1e6:.2f} MB).', flush=True)
    # The final numbers describe what ships: the bf16-rounded weights, loaded back as fp32.
    params = checkpoints.load_weights(export_path)[1]
  if evaluator.final_splits:
    record = evaluator.final(results['step'], params)
    log.write(record)
    results['eval'] = record['eval']
  if writes:
    (model_dir / 'results.json').write_text(json.dumps(results, indent=2))


def _on_host(params: PyTree) -> PyTree:
  """`params` whole on this host: a multi-host run's arrays span the processes."""
  if jax.process_count() == 1:
    return params
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return jax.tree.map(lambda x: multihost_utils.process_allgather(x, tiled=True)
                      if isinstance(x, jax.Array) and not x.is_fully_addressable else x, params)


def main(argv: Sequence[str]) -> None:
  del argv
  gin_utils.initialize_processes()
  try:
    gin_utils.parse_gin_flags(flags.FLAGS.gin_file, flags.FLAGS.gin_bindings,
                              flags.FLAGS.gin_search_paths)
  except (ValueError, KeyError, IOError, SyntaxError) as e:
    gin_utils.exit_with_error(f'gin config: {gin_utils.error_line(e)}')
  try:
    results = train()
  except (speculative_t5x.MissingExtraError, InferError, ValueError, FileNotFoundError) as e:
    # Bad settings, files and checkpoints: one line, without gin's context lines.
    gin_utils.exit_with_error(gin_utils.error_line(e))
  results.pop('state', None)
  print(json.dumps(results, indent=2), flush=True)


def run() -> None:
  """The `speculative-t5x-train` command."""
  gin_utils.define_process_flags()
  gin_utils.run(main)


if __name__ == '__main__':
  run()
