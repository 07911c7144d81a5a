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

Everything is numpy + JAX: no TensorFlow on the training path (see `data.py`).
"""

from __future__ import annotations

import functools
import json
import math
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from absl import flags
import flax
import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax

import speculative_t5x
from speculative_t5x import data
from speculative_t5x import decoding
from speculative_t5x import gin_utils
from speculative_t5x import models
from speculative_t5x import network

Array = jnp.ndarray
PyTree = Any

# Gin's handle on T5Config (`@network.T5Config()` in gin files); calling it applies the bindings.
GinT5Config = gin.external_configurable(network.T5Config, module='network')



# ------------------------------------------------------------------------------------------------
# Optimizer, schedule and loss.


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


def cross_entropy_with_z_loss(logits: Array, targets: Array, weights: Array, z_loss: float,
                              label_smoothing: float = 0.0) -> Tuple[Array, Dict[str, Array]]:
  """Summed token cross-entropy + z-loss, T5X's `cross_entropy_with_logits` arithmetic.

  logits [batch, length, vocab] float32, targets [batch, length] int, weights [batch, length].
  With label smoothing the constant entropy of the smoothed distribution is subtracted (as T5X),
  so a perfect model has loss 0. Returns (summed loss, metrics summed over tokens).
  """
  vocab = logits.shape[-1]
  log_z = jax.nn.logsumexp(logits, axis=-1)
  log_probs = logits - log_z[..., None]
  confidence = 1.0 - label_smoothing
  low = label_smoothing / (vocab - 1)
  normalizing = -(confidence * math.log(confidence) +
                  (vocab - 1) * low * math.log(low + 1e-20)) if label_smoothing > 0 else 0.0
  target_lp = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
  if label_smoothing > 0:
    ce = -(confidence * target_lp + low * (jnp.sum(log_probs, axis=-1) - target_lp)) - normalizing
  else:
    ce = -target_lp
  z = z_loss * jnp.square(log_z)
  loss = jnp.sum((ce + z) * weights)
  metrics = {
      'cross_entropy': jnp.sum(-target_lp * weights),
      'z_loss': jnp.sum(z * weights),
      'accuracy': jnp.sum((jnp.argmax(logits, -1) == targets) * weights),
      'tokens': jnp.sum(weights),
  }
  return loss, metrics


def soft_cross_entropy(logits: Array, teacher_logits: Array, weights: Array,
                       temperature: float) -> Array:
  """Summed token KL(teacher || student) at `temperature`, times T^2 (Hinton et al.'s scaling).

  The teacher's entropy is subtracted so the term is a KL (0 when the distributions agree); it
  does not change the gradient. logits, teacher_logits [batch, length, vocab]; weights
  [batch, length].
  """
  t_logp = jax.nn.log_softmax(teacher_logits / temperature, axis=-1)
  s_logp = jax.nn.log_softmax(logits / temperature, axis=-1)
  kl = jnp.sum(jnp.exp(t_logp) * (t_logp - s_logp), axis=-1)
  return jnp.sum(kl * weights) * temperature**2


# ------------------------------------------------------------------------------------------------
# Greedy decoding: the decoders' own loop (decoding.temperature_sample at temperature 0).


@functools.partial(jax.jit, static_argnames=('config', 'max_length'))
def _greedy_decode(config: network.T5Config, params: PyTree, encoder_input_tokens: Array,
                   max_length: int) -> Array:
  """Greedy outputs [batch, max_length] for encoder_input_tokens [batch, enc_length].

  Each row stops at its EOS (later positions are 0); rows that are all padding decode nothing.
  """
  model = models.EncoderDecoderModel(config, decode_fn=decoding.temperature_sample,
                                     decode_kwargs={'temperature': 0.0}, eos_id=data.EOS_ID)
  batch = {'encoder_input_tokens': encoder_input_tokens,
           'decoder_input_tokens': jnp.zeros((encoder_input_tokens.shape[0], max_length),
                                             jnp.int32)}
  return model.predict_batch({'target': params}, batch)


def greedy_translate(config: network.T5Config, params: PyTree, token_inputs: Sequence[Sequence[int]],
                     max_input_length: int, max_length: int, batch_size: int = 128,
                     log_every: int = 0) -> List[List[int]]:
  """Greedy token outputs (up to and including EOS) for each tokenized input, in fixed shapes."""
  outputs = []
  for start in range(0, len(token_inputs), batch_size):
    chunk = token_inputs[start:start + batch_size]
    enc = data.pad_batch(chunk, None, max_input_length, max_length, batch_size)
    out = np.asarray(_greedy_decode(config, params, jnp.asarray(enc['encoder_input_tokens']),
                                    max_length))
    for row in out[:len(chunk)]:
      row = row.tolist()
      outputs.append(row[:row.index(data.EOS_ID) + 1] if data.EOS_ID in row else row)
    if log_every and (start // batch_size) % log_every == 0:
      print(f'  greedy: {start + len(chunk)}/{len(token_inputs)}', flush=True)
  return outputs


# ------------------------------------------------------------------------------------------------
# Weights export (bf16) and loading (fp32).


def export_weights(params: PyTree, config: network.T5Config, path: os.PathLike,
                   extra: Optional[Dict[str, Any]] = None) -> int:
  """Writes params as bfloat16 plus the config in one msgpack file; returns its size in bytes.

  bf16 halves the file (the repository budget is 35 MB for all weights and the vocabulary); the
  loss of precision is ~3 significant digits, which greedy outputs tolerate.
  """
  payload = {
      'config': _config_to_json(config),
      'extra': json.dumps(extra or {}),
      'params': jax.tree_util.tree_map(lambda x: np.asarray(x, jnp.bfloat16), params),
  }
  raw = flax.serialization.msgpack_serialize(flax.serialization.to_state_dict(payload))
  Path(path).parent.mkdir(parents=True, exist_ok=True)
  Path(path).write_bytes(raw)
  return len(raw)


def load_weights(path: os.PathLike) -> Tuple[network.T5Config, PyTree, Dict[str, Any]]:
  """(config, float32 params, extra metadata) from an `export_weights` file."""
  payload = flax.serialization.msgpack_restore(Path(path).read_bytes())
  config = network.T5Config(**json.loads(payload['config']))
  params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), payload['params'])
  return config, params, json.loads(payload.get('extra', '{}'))


def _config_to_json(config: network.T5Config) -> str:
  cfg = {f.name: getattr(config, f.name) for f in config.__dataclass_fields__.values()}
  cfg['dtype'] = str(jnp.dtype(cfg['dtype']))
  cfg['mlp_activations'] = list(cfg['mlp_activations'])
  return json.dumps(cfg)


def restore_params(model_dir: os.PathLike, config: Optional[network.T5Config] = None,
                   step: Optional[int] = None) -> Tuple[network.T5Config, PyTree, int]:
  """(config, params, step) from the latest (or `step`) Orbax checkpoint of a training run."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  model_dir = Path(model_dir).resolve()
  if config is None:
    config = network.T5Config(**json.loads((model_dir / 'config.json').read_text()))
  with ocp.CheckpointManager(model_dir / 'checkpoints') as manager:
    step = manager.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f'No checkpoint in {model_dir / "checkpoints"}.')
    restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
  params = jax.tree_util.tree_map(jnp.asarray, restored['state']['params'])
  return config, params, int(step)


def load_model(source: os.PathLike) -> Tuple[network.T5Config, PyTree]:
  """A model from an exported weights file or a training run's folder (packaged files too, as
  `gin_utils.resolve_path` finds them: 'speculative_t5x/pretrained/...')."""
  source = gin_utils.resolve_path(source)
  if source.is_file():
    config, params, _ = load_weights(source)
  else:
    config, params, _ = restore_params(source)
  return config, params


# ------------------------------------------------------------------------------------------------
# Evaluation.


def evaluate(config: network.T5Config, params: PyTree, sources: Sequence[str],
             references: Sequence[str], max_input_length: int, max_target_length: int,
             batch_size: int = 128, loss_batches: bool = True,
             bleu_examples: Optional[int] = None) -> Dict[str, float]:
  """Per-token loss / accuracy (teacher forced) over all pairs, and greedy BLEU on the first
  `bleu_examples` (all when None)."""
  inputs, targets = data.tokenize_pairs(sources, references, max_input_length, max_target_length)
  results = {}
  if loss_batches:
    totals = {'cross_entropy': 0.0, 'accuracy': 0.0, 'tokens': 0.0}
    for start in range(0, len(inputs), batch_size):
      batch = data.pad_batch(inputs[start:start + batch_size], targets[start:start + batch_size],
                             max_input_length, max_target_length, batch_size)
      metrics = _eval_step(config, params, {k: jnp.asarray(v) for k, v in batch.items()})
      for k in totals:
        totals[k] += float(metrics[k])
    results['loss'] = totals['cross_entropy'] / totals['tokens']
    results['accuracy'] = totals['accuracy'] / totals['tokens']
  n = len(inputs) if bleu_examples is None else min(bleu_examples, len(inputs))
  if n:
    outputs = greedy_translate(config, params, inputs[:n], max_input_length, max_target_length,
                               batch_size)
    results['bleu'] = data.corpus_bleu(data.decode(outputs), references[:n])
    results['bleu_examples'] = n
  return results


@functools.partial(jax.jit, static_argnames=('config',))
def _eval_step(config: network.T5Config, params: PyTree, batch: Dict[str, Array]) -> Dict[str, Array]:
  logits = network.Transformer(config).apply(
      {'params': params}, batch['encoder_input_tokens'], batch['decoder_input_tokens'],
      batch['decoder_target_tokens'], enable_dropout=False)
  _, metrics = cross_entropy_with_z_loss(logits, batch['decoder_target_tokens'],
                                         batch['decoder_loss_weights'], 0.0)
  return metrics


# ------------------------------------------------------------------------------------------------
# Sequence-level distillation data.


def sequence_distillation_targets(teacher_config: network.T5Config, teacher_params: PyTree,
                                  inputs: Sequence[Sequence[int]], max_input_length: int,
                                  max_target_length: int, cache_path: Optional[os.PathLike] = None,
                                  batch_size: int = 256) -> List[List[int]]:
  """The teacher's greedy outputs (ending in EOS) for tokenized inputs, cached in an .npz file.

  This is BiLD's "aligned" training set: the draft learns what the target would say, which is
  what speculative decoding accepts. Outputs that hit max_target_length without EOS get EOS as
  their last token (as truncation does for real targets). The cache is keyed by the number of
  inputs and a checksum of them, so a stale file is recomputed.
  """
  checksum = int(sum((i + 1) * sum(x) for i, x in enumerate(inputs[:1000])) % (2**31))
  if cache_path is not None and Path(cache_path).exists():
    cached = np.load(cache_path)
    if int(cached['num']) == len(inputs) and int(cached['checksum']) == checksum:
      tokens, lengths = cached['tokens'], cached['lengths']
      return [tokens[i, :lengths[i]].tolist() for i in range(len(lengths))]
    print(f'Distillation cache {cache_path} does not match the inputs; recomputing.', flush=True)
  start = time.time()
  # Decode in order of input length: a batch's loop runs until its longest output ends, and
  # output length follows input length, so sorted batches waste far fewer steps on finished rows.
  order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
  sorted_outputs = greedy_translate(teacher_config, teacher_params, [inputs[i] for i in order],
                                    max_input_length, max_target_length, batch_size,
                                    log_every=20)
  outputs: List[List[int]] = [[] for _ in inputs]
  for i, row in zip(order, sorted_outputs):
    outputs[i] = row
  fixed = []
  for row in outputs:
    if not row or row[-1] != data.EOS_ID:
      row = row[:max_target_length - 1] + [data.EOS_ID]
    fixed.append(row)
  print(f'Sequence distillation: {len(fixed)} greedy outputs in {time.time() - start:.0f}s.',
        flush=True)
  if cache_path is not None:
    tokens = np.zeros((len(fixed), max_target_length), np.int32)
    for i, row in enumerate(fixed):
      tokens[i, :len(row)] = row
    Path(cache_path).parent.mkdir(parents=True, exist_ok=True)
    np.savez(cache_path, tokens=tokens, lengths=np.array([len(r) for r in fixed], np.int32),
             num=len(fixed), checksum=checksum)
  return fixed


# ------------------------------------------------------------------------------------------------
# Examples: plain Python, or a seqio task.


def load_examples(split: str, source_language: str, target_language: str,
                  max_input_length: int, max_target_length: int,
                  data_dir: Optional[str] = None, mixture_or_task_name: Optional[str] = None,
                  max_examples: Optional[int] = None
                  ) -> Tuple[List[str], List[str], List[List[int]], List[List[int]]]:
  """(source texts, reference texts, input ids, target ids) of a split; ids end in EOS.

  Without `mixture_or_task_name` the files are read and tokenized in plain Python. With it, the
  examples come from the registered seqio task (TensorFlow), unshuffled and unpacked, in file
  order; both give the same ids (tests/test_data.py checks the tasks against the plain path).
  """
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
# The training loop.


class _StopFlag:
  """Set by SIGTERM/SIGINT so the loop checkpoints and exits cleanly instead of dying mid-step."""

  def __init__(self):
    self.stop = False

  def __call__(self, signum, frame):
    del frame
    print(f'Signal {signum}: checkpointing and stopping.', flush=True)
    self.stop = True


@functools.lru_cache(maxsize=8)
def _make_train_step(config: network.T5Config, learning_rate_scale: float, warmup_steps: int,
                     seed: int, z_loss: float, label_smoothing: float, distillation: str,
                     teacher_config: Optional[network.T5Config], kd_weight: float,
                     kd_temperature: float):
  """The jitted step: (state, batch, teacher_params) -> (state, metrics summed over tokens).

  Cached on its (hashable) hyperparameters so that runs in one process (a resumed run, tests)
  reuse the compiled step.
  """
  tx = make_optimizer(learning_rate_scale, warmup_steps)
  model = network.Transformer(config)
  teacher = network.Transformer(teacher_config) if teacher_config is not None else None

  def step_fn(state, batch, teacher_params):
    # Dropout masks depend only on (seed, step): a resumed run draws the same masks.
    rng = jax.random.fold_in(jax.random.PRNGKey(seed), state['step'])
    args = (batch['encoder_input_tokens'], batch['decoder_input_tokens'],
            batch['decoder_target_tokens'], batch['encoder_segment_ids'],
            batch['decoder_segment_ids'])
    weights = batch['decoder_loss_weights']

    def loss_fn(params):
      logits = model.apply({'params': params}, *args, enable_dropout=True,
                           rngs={'dropout': rng})
      loss, metrics = cross_entropy_with_z_loss(logits, batch['decoder_target_tokens'], weights,
                                                z_loss, label_smoothing)
      if distillation == 'token':
        teacher_logits = jax.lax.stop_gradient(
            teacher.apply({'params': teacher_params}, *args, enable_dropout=False))
        kd = soft_cross_entropy(logits, teacher_logits, weights, kd_temperature)
        metrics['kd_loss'] = kd
        loss = (1.0 - kd_weight) * loss + kd_weight * kd
      # Per-token mean: Adafactor is scale-invariant anyway, and the value reads as a per-token
      # loss whatever the batch's token count.
      return loss / jnp.maximum(metrics['tokens'], 1.0), metrics

    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
    updates, opt_state = tx.update(grads, state['opt_state'], state['params'])
    params = optax.apply_updates(state['params'], updates)
    metrics['loss'] = loss
    metrics['grad_norm'] = optax.tree.norm(grads)
    return {'params': params, 'opt_state': opt_state, 'step': state['step'] + 1}, metrics

  return jax.jit(step_fn, donate_argnums=(0,))


@gin.configurable
def train(*,
          model_dir: str = gin.REQUIRED,
          config: network.T5Config = gin.REQUIRED,
          data_dir: Optional[str] = None,
          mixture_or_task_name: Optional[str] = None,
          source_language: str = 'de',
          target_language: str = 'en',
          max_input_length: int = 64,
          max_target_length: int = 64,
          batch_size: int = 64,
          pack: bool = True,
          num_train_steps: int = 100000,
          max_train_seconds: Optional[float] = None,
          learning_rate_scale: float = 1.0,
          warmup_steps: int = 10000,
          z_loss: float = 1e-4,
          label_smoothing: float = 0.0,
          seed: int = 0,
          log_every: int = 20,
          checkpoint_every: int = 200,
          keep_checkpoints: int = 2,
          eval_every: int = 500,
          eval_batch_size: int = 128,
          eval_bleu_examples: int = 256,
          final_eval_splits: Sequence[str] = ('validation', 'test'),
          export_path: Optional[str] = None,
          distillation: str = 'none',
          teacher: Optional[str] = None,
          kd_weight: float = 1.0,
          kd_temperature: float = 1.0,
          distillation_cache: Optional[str] = None,
          max_train_examples: Optional[int] = None,
          init_from: Optional[str] = None) -> Dict[str, Any]:
  """Trains (or resumes) a model; returns the final metrics.

  Args:
    model_dir: run folder: checkpoints/, config.json, log of metrics (metrics.jsonl).
    config: the network's T5Config (vocab_size = the vocabulary rounded up to 128).
    data_dir: folder holding multi30k/ (default $SPECULATIVE_T5X_DATA or <repo>/../shared/data).
    mixture_or_task_name: read the data through this seqio task (e.g. 'multi30k_de_en', T5X's
      MIXTURE_OR_TASK_NAME) instead of the plain-Python reader; needs seqio + TensorFlow.
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
    export_path: if set, the final params as a bf16 weights file (see `export_weights`).
    distillation: 'none'; 'sequence' (targets = the teacher's greedy outputs for the training
      inputs, cached in `distillation_cache`); or 'token' (loss = (1 - kd_weight) * CE +
      kd_weight * T^2 KL(teacher_T || student_T) on the real targets).
    teacher: the teacher's exported weights file or training folder (distillation only).
    max_train_examples: use only the first n training pairs (also bounds the sequence
      distillation set, whose greedy decoding is the expensive part).
    init_from: start from these params (exported weights file or training folder; same config)
      instead of a random init, e.g. to fine-tune the undistilled draft on distillation data.
      Ignored when the run resumes from its own checkpoint.
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  if distillation not in ('none', 'sequence', 'token'):
    raise ValueError(f"distillation must be 'none', 'sequence' or 'token', not {distillation!r}.")
  model_dir = Path(model_dir).resolve()
  model_dir.mkdir(parents=True, exist_ok=True)
  (model_dir / 'config.json').write_text(_config_to_json(config))
  if gin.config_str():
    (model_dir / 'config.gin').write_text(gin.config_str())
  vocab = data.vocab_size()
  if config.vocab_size < vocab:
    raise ValueError(f'config.vocab_size {config.vocab_size} < vocabulary size {vocab}.')

  # ---- Data.
  load = functools.partial(load_examples, source_language=source_language,
                           target_language=target_language, max_input_length=max_input_length,
                           max_target_length=max_target_length, data_dir=data_dir,
                           mixture_or_task_name=mixture_or_task_name)
  _, _, inputs, targets = load('train', max_examples=max_train_examples)
  teacher_config = teacher_params = None
  if distillation != 'none':
    if teacher is None:
      raise ValueError('Distillation needs `teacher` (weights file or training folder).')
    teacher_config, teacher_params = load_model(teacher)
    if teacher_config.vocab_size != config.vocab_size:
      raise ValueError('Teacher and student must share the (padded) vocabulary.')
  if distillation == 'sequence':
    targets = sequence_distillation_targets(teacher_config, teacher_params, inputs,
                                            max_input_length, max_target_length,
                                            distillation_cache, eval_batch_size)
  batches = data.PackedBatches(inputs, targets, batch_size, max_input_length, max_target_length,
                               seed=seed, pack=pack)
  val_sources, val_references, _, _ = load('validation')

  # ---- State.
  tx = make_optimizer(learning_rate_scale, warmup_steps)
  params, _ = network.init_params(config, jax.random.PRNGKey(seed))
  if init_from is not None:
    init_config, init_params = load_model(init_from)
    if jax.tree_util.tree_structure(init_params) != jax.tree_util.tree_structure(params) or any(
        a.shape != b.shape for a, b in zip(jax.tree_util.tree_leaves(init_params),
                                           jax.tree_util.tree_leaves(params))):
      raise ValueError(f'init_from={init_from} has config {init_config}, not {config}.')
    params = init_params
  state = {'params': params, 'opt_state': tx.init(params), 'step': jnp.int32(0)}
  progress = {'train_seconds': 0.0, 'data': batches.state}
  options = ocp.CheckpointManagerOptions(max_to_keep=keep_checkpoints, create=True,
                                         enable_async_checkpointing=False)
  manager = ocp.CheckpointManager(model_dir / 'checkpoints', options=options)
  latest = manager.latest_step()
  if latest is not None:
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, state)
    restored = manager.restore(latest, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), progress=ocp.args.JsonRestore()))
    state, progress = restored['state'], restored['progress']
    batches.set_state(progress['data'])
    print(f'Resumed from step {latest} (data position {progress["data"]}, '
          f'{progress["train_seconds"]:.0f}s trained).', flush=True)

  def save(step: int) -> None:
    progress['data'] = batches.state
    manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                progress=ocp.args.JsonSave(progress)),
                 force=True)

  n_params = sum(x.size for x in jax.tree_util.tree_leaves(state['params']))
  print(f'{config}\n{n_params / 1e6:.2f}M parameters; decode FLOPs/token '
        f'{config.decode_flops_per_token() / 1e6:.2f}M; {len(inputs)} training pairs, '
        f'{batches.batches_per_epoch()} batches of {batch_size} packed rows per epoch.',
        flush=True)

  # Sequence distillation only changes the targets: it shares the plain step (and its compile).
  token_level = distillation == 'token'
  train_step = _make_train_step(config, learning_rate_scale, warmup_steps, seed, z_loss,
                                label_smoothing, 'token' if token_level else 'none',
                                teacher_config if token_level else None, kd_weight,
                                kd_temperature)
  stop = _StopFlag()
  previous_handlers = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
  metrics_file = open(model_dir / 'metrics.jsonl', 'a')
  schedule = rsqrt_schedule(learning_rate_scale, warmup_steps)

  def log(record: Dict[str, Any]) -> None:
    metrics_file.write(json.dumps(record) + '\n')
    metrics_file.flush()

  def run_eval(step: int, bleu_examples: Optional[int], splits=('validation',),
               params: Optional[PyTree] = None) -> Dict[str, Any]:
    params = state['params'] if params is None else params
    out = {}
    for split in splits:
      src, ref = ((val_sources, val_references) if split == 'validation' else
                  load(split)[:2])
      t0 = time.time()
      res = evaluate(config, params, src, ref, max_input_length, max_target_length,
                     eval_batch_size, bleu_examples=bleu_examples)
      res['seconds'] = time.time() - t0
      out[split] = res
      print(f'step {step} eval {split}: ' + ', '.join(
          f'{k} {v:.4f}' if isinstance(v, float) else f'{k} {v}' for k, v in res.items()),
            flush=True)
    log({'step': step, 'eval': out})
    return out

  step = int(state['step'])
  window_start, window_steps = time.time(), 0
  last_checkpoint = step
  try:
    while step < num_train_steps and not stop.stop:
      if max_train_seconds is not None and progress['train_seconds'] >= max_train_seconds:
        print(f'Training time budget {max_train_seconds:.0f}s spent at step {step}.', flush=True)
        break
      t0 = time.time()
      batch = {k: jnp.asarray(v) for k, v in next(batches).items()}
      state, metrics = train_step(state, batch, teacher_params if token_level else None)
      step += 1
      if step % log_every == 0 or step == 1:
        metrics = jax.device_get(metrics)  # Syncs here only, so dispatch stays asynchronous.
      else:
        metrics = None
      progress['train_seconds'] += time.time() - t0
      window_steps += 1
      if metrics is not None:
        elapsed = time.time() - window_start
        tokens = float(metrics['tokens'])
        record = {
            'step': step, 'loss': float(metrics['loss']),
            'cross_entropy': float(metrics['cross_entropy']) / tokens,
            'z_loss': float(metrics['z_loss']) / tokens,
            'accuracy': float(metrics['accuracy']) / tokens,
            'grad_norm': float(metrics['grad_norm']),
            'learning_rate': float(schedule(step - 1)),
            'steps_per_second': window_steps / elapsed,
            'train_seconds': progress['train_seconds'],
            'epoch': batches.epoch,
        }
        if 'kd_loss' in metrics:
          record['kd_loss'] = float(metrics['kd_loss']) / tokens
        log(record)
        print(f'step {step:6d} | loss {record["loss"]:.4f} | ce {record["cross_entropy"]:.4f} | '
              f'acc {record["accuracy"]:.3f} | lr {record["learning_rate"]:.2e} | '
              f'{record["steps_per_second"]:.3f} steps/s | epoch {batches.epoch} | '
              f'{progress["train_seconds"] / 60:.1f} min', flush=True)
        window_start, window_steps = time.time(), 0
      if step % checkpoint_every == 0:
        save(step)
        last_checkpoint = step
      if eval_every and step % eval_every == 0:
        run_eval(step, eval_bleu_examples)
        window_start, window_steps = time.time(), 0
  finally:
    if step != last_checkpoint or manager.latest_step() is None:
      save(step)
    manager.wait_until_finished()
    for s, h in previous_handlers.items():
      signal.signal(s, h)

  results: Dict[str, Any] = {'step': step, 'train_seconds': progress['train_seconds'],
                             'parameters': int(n_params),
                             'decode_flops_per_token': config.decode_flops_per_token()}
  if not stop.stop:
    eval_params = state['params']
    if export_path:
      size = export_weights(state['params'], config, export_path,
                            {'step': step, 'train_seconds': progress['train_seconds'],
                             'distillation': distillation})
      results['export'] = {'path': str(export_path), 'bytes': size}
      print(f'Exported bf16 weights to {export_path} ({size / 1e6:.2f} MB).', flush=True)
      # The final numbers describe what ships: the bf16-rounded weights, loaded back as fp32.
      eval_params = load_weights(export_path)[1]
    if final_eval_splits:
      results['eval'] = run_eval(step, None, tuple(final_eval_splits), eval_params)
    (model_dir / 'results.json').write_text(json.dumps(results, indent=2))
  metrics_file.close()
  manager.close()
  return {**results, 'state': state}


def main(argv: Sequence[str]) -> None:
  del argv
  try:
    gin_utils.parse_gin_flags(flags.FLAGS.gin_file, flags.FLAGS.gin_bindings,
                              flags.FLAGS.gin_search_paths)
  except (ValueError, KeyError, IOError, SyntaxError) as e:
    gin_utils.exit_with_error(f'gin config: {gin_utils.error_line(e)}')
  try:
    results = train()
  except speculative_t5x.MissingExtraError as e:
    gin_utils.exit_with_error(str(e).splitlines()[0])  # without gin's context lines
  results.pop('state', None)
  print(json.dumps(results, indent=2), flush=True)


def run() -> None:
  """The `speculative-t5x-train` command."""
  gin_utils.run(main)


if __name__ == '__main__':
  run()
