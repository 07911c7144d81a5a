"""Greedy evaluation (teacher-forced loss, greedy BLEU), the training losses and distillation data.

What the training job measures and what it learns from, apart from the loop itself (`train.py`):

  * `cross_entropy_with_z_loss` (T5X's loss) and `distillation_loss` (token distillation's
    divergence: forward or reverse KL, JSD or total variation), and `Objective`, what a training
    step minimises, built from them (the trainer's and the T5X adapter's distillation model's);
  * `translate`: greedy outputs (or samples) through the decoders' own loop
    (`decoding.temperature_sample`), in fixed shapes;
  * `evaluate`: per-token loss and accuracy over a split, and corpus BLEU of greedy outputs;
  * `sequence_distillation_targets`: a model's greedy outputs (or samples) as a draft's training
    targets, cached.

Shapes: `batch` rows, `length` token positions, `vocab` output classes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from speculative_t5x import data
from speculative_t5x import decoding
from speculative_t5x import models
from speculative_t5x import network

Array = jnp.ndarray
PyTree = Any
# (config, params) of the model whose encoder a decoder-only model reads (`T5Config.encoded_width`);
# None for a model with its own encoder.
Encoder = Optional[Tuple[network.T5Config, PyTree]]


# ------------------------------------------------------------------------------------------------
# Losses.


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
  return distillation_loss(logits, teacher_logits, weights, temperature, 'forward_kl')


DIVERGENCES = ('forward_kl', 'reverse_kl', 'jsd', 'tv')


def _divergence(t_logp: Array, s_logp: Array, divergence: str) -> Array:
  """Per-token divergence [...] between teacher p and student q given as log-probs [..., vocab]."""
  p, q = jnp.exp(t_logp), jnp.exp(s_logp)
  if divergence == 'forward_kl':
    return jnp.sum(p * (t_logp - s_logp), axis=-1)
  if divergence == 'reverse_kl':
    return jnp.sum(q * (s_logp - t_logp), axis=-1)
  if divergence == 'jsd':
    # JSD(p, q) = (KL(p || m) + KL(q || m)) / 2 with m the mixture; log m stays finite.
    log_m = jnp.logaddexp(t_logp, s_logp) - jnp.log(2.0)
    return 0.5 * jnp.sum(p * (t_logp - log_m) + q * (s_logp - log_m), axis=-1)
  if divergence == 'tv':
    # 1 - TV(p, q) = sum min(p, q) is the speculative acceptance probability of this position.
    return 0.5 * jnp.sum(jnp.abs(p - q), axis=-1)
  raise ValueError(f'divergence must be one of {DIVERGENCES}, not {divergence!r}.')


def distillation_loss(logits: Array, teacher_logits: Array, weights: Array, temperature: float,
                      divergence: str = 'forward_kl') -> Array:
  """Summed token divergence(teacher_T, student_T) times T^2: token-level distillation's term.

  divergence: 'forward_kl' KL(p || q) (covers the teacher's mass), 'reverse_kl' KL(q || p)
  (mode-seeking), 'jsd' (Jensen-Shannon) or 'tv' (total variation: 1 - TV is exactly the
  per-token acceptance of speculative sampling at this temperature, DistillSpec's link).
  logits, teacher_logits [batch, length, vocab]; weights [batch, length].
  """
  t_logp = jax.nn.log_softmax(teacher_logits / temperature, axis=-1)
  s_logp = jax.nn.log_softmax(logits / temperature, axis=-1)
  return jnp.sum(_divergence(t_logp, s_logp, divergence) * weights) * temperature**2


@dataclasses.dataclass(frozen=True)
class Objective:
  """What a training step minimises: the one loss of `speculative-t5x-train` and of the T5X
  adapter's distillation model (`python -m t5x.train`). Hashable: a compiled step is cached on
  it.

  config: the trained model's. distillation: 'none' (cross-entropy plus z-loss on the targets;
    sequence distillation only changes the targets) or 'token' (`(1 - kd_weight) * CE +
    kd_weight * D(teacher, student)`, the teacher `teacher_config`'s). encoder_config: the
    frozen encoder a decoder-only config reads. feature_passes: a feature draft's
    (`_feature_draft_loss`).
  """
  config: network.T5Config
  z_loss: float = 1e-4
  label_smoothing: float = 0.0
  distillation: str = 'none'
  teacher_config: Optional[network.T5Config] = None
  kd_weight: float = 1.0
  kd_temperature: float = 1.0
  kd_divergence: str = 'forward_kl'
  encoder_config: Optional[network.T5Config] = None
  feature_passes: int = 1

  def loss(self, params: PyTree, batch: Dict[str, Array], rng: Array,
           teacher_params: Optional[PyTree] = None, encoder_params: Optional[PyTree] = None
           ) -> Tuple[Array, Dict[str, Array]]:
    """(loss per target token, metrics summed over tokens) of `params` on a batch
    ([batch, length] features; segment ids optional), dropout drawn from `rng` (none without
    one, as T5X's evaluation asks). The teacher and the encoder are frozen: no gradient reaches
    them; without `encoder_params` a student reading its teacher's encoder reads
    `teacher_params`."""
    model = network.Transformer(self.config)
    teacher = network.Transformer(self.teacher_config) if self.teacher_config else None
    if encoder_params is None and self.encoder_config is not None and (
        self.encoder_config == self.teacher_config):
      encoder_params = teacher_params  # the student reads its teacher's encoder: one copy
    args = (batch['encoder_input_tokens'], batch['decoder_input_tokens'],
            batch['decoder_target_tokens'], batch.get('encoder_segment_ids'),
            batch.get('decoder_segment_ids'))
    weights = batch['decoder_loss_weights']
    encoded = encode_for(self.encoder_config, encoder_params, args[0], args[3])
    if self.config.feature_width:
      return _feature_draft_loss(model, params, teacher, teacher_params, args, encoded, weights,
                                 rng, self.feature_passes, self.kd_temperature,
                                 self.kd_divergence)
    logits = model.apply({'params': params}, *args, encoded=encoded, **_dropout(rng))
    loss, metrics = cross_entropy_with_z_loss(
        logits, args[2], weights, self.z_loss, self.label_smoothing)
    if self.distillation == 'token':
      teacher_logits = jax.lax.stop_gradient(
          teacher.apply({'params': teacher_params}, *args, enable_dropout=False))
      kd = distillation_loss(logits, teacher_logits, weights, self.kd_temperature,
                             self.kd_divergence)
      metrics['kd_loss'] = kd
      loss = (1.0 - self.kd_weight) * loss + self.kd_weight * kd
    # Per-token mean: Adafactor is scale-invariant anyway, and the value reads as a per-token
    # loss whatever the batch's token count.
    return loss / jnp.maximum(metrics['tokens'], 1.0), metrics


def previous_positions(x: Array, segment_ids: Array) -> Array:
  """x [batch, length, width] moved one position on: row p holds row p - 1 of the same packed
  segment, zero at a segment's first position (a feature draft's input at p is the feature of
  p - 1, and the first position has none)."""
  shifted = jnp.pad(x, ((0, 0), (1, 0), (0, 0)))[:, :-1]
  same = jnp.pad(segment_ids, ((0, 0), (1, 0)))[:, :-1] == segment_ids
  return jnp.where(same[..., None], shifted, 0).astype(x.dtype)


def _dropout(rng: Optional[Array]) -> Dict[str, Any]:
  return {'enable_dropout': rng is not None, 'rngs': {'dropout': rng} if rng is not None else None}


def _feature_draft_loss(model: network.Transformer, params: PyTree, teacher: network.Transformer,
                        teacher_params: PyTree, args: Tuple[Array, ...], encoded: Array,
                        weights: Array, rng: Array, passes: int, temperature: float,
                        divergence: str) -> Tuple[Array, Dict[str, Array]]:
  """Token distillation of a feature draft, summed over tokens, with training-time test.

  The teacher (the target) gives its distributions and the hidden states the draft reads (its
  top one, or also lower layers'); pass 1 reads those (each position the target's of the
  position before, as the draft's first call of an iteration does), pass k > 1 the draft's own
  top hidden states from pass k - 1 (as its later calls read their own). The loss is the mean
  over passes of `distillation_loss`, gradients flowing through the passes (EAGLE-3's
  training-time test; HASS).
  """
  teacher_logits, features = jax.lax.stop_gradient(teacher.apply(
      {'params': teacher_params}, *args, encoded=encoded,
      return_features=model.config.feature_layers))
  segments = args[4] if args[4] is not None else jnp.ones(args[1].shape, jnp.int32)
  inputs = {'features': previous_positions(features, segments)}
  total, metrics = 0.0, {}
  for k in range(passes):
    pass_rng = jax.random.fold_in(rng, k) if rng is not None else None
    logits, hidden = model.apply({'params': params}, *args, encoded=encoded,
                                 return_features=1, **inputs, **_dropout(pass_rng))
    kd = distillation_loss(logits, teacher_logits, weights, temperature, divergence)
    metrics[f'kd_loss_pass_{k + 1}'] = kd
    agree = jnp.argmax(logits, -1) == jnp.argmax(teacher_logits, -1)
    metrics[f'agreement_pass_{k + 1}'] = jnp.sum(agree * weights)
    total += kd / passes
    if not k:  # (the record's cross-entropy and accuracy: pass 1's, on the real targets)
      metrics.update(cross_entropy_with_z_loss(logits, args[2], weights, 0.0)[1])
    inputs = {'own_features': previous_positions(hidden, segments)}
  metrics['kd_loss'] = total
  return total / jnp.maximum(metrics['tokens'], 1.0), metrics


# ------------------------------------------------------------------------------------------------
# Decoding: the decoders' own loop (decoding.temperature_sample).


@functools.partial(jax.jit, static_argnames=('config', 'max_length', 'temperature',
                                             'encoder_config'))
def _decode(config: network.T5Config, params: PyTree, encoder_input_tokens: Array,
            max_length: int, rng: jax.Array, temperature: float = 0.0,
            encoder_config: Optional[network.T5Config] = None,
            encoder_params: Optional[PyTree] = None) -> Array:
  """Outputs [batch, max_length] for encoder_input_tokens [batch, enc_length]: greedy at
  temperature 0 (rng unused), else samples at that temperature.

  Each row stops at its EOS (later positions are 0); rows that are all padding decode nothing.
  """
  model = models.EncoderDecoderModel(config, decode_fn=decoding.temperature_sample,
                                     # topk 0: T5X's default of 1 would be greedy.
                                     decode_kwargs={'temperature': temperature, 'topk': 0},
                                     eos_id=data.EOS_ID, encoder_config=encoder_config)
  batch = {'encoder_input_tokens': encoder_input_tokens,
           'decoder_input_tokens': jnp.zeros((encoder_input_tokens.shape[0], max_length),
                                             jnp.int32)}
  return model.predict_batch({'target': params, 'encoder': encoder_params}, batch, rng)


def _encoder_args(encoder: Encoder) -> Dict[str, Any]:
  return {} if encoder is None else {'encoder_config': encoder[0], 'encoder_params': encoder[1]}


def translate(config: network.T5Config, params: PyTree, token_inputs: Sequence[Sequence[int]],
              max_input_length: int, max_length: int, batch_size: int = 128,
              log_every: int = 0, encoder: Encoder = None, temperature: float = 0.0,
              seed: int = 0) -> List[List[int]]:
  """Token outputs (up to and including EOS) for each tokenized input, in fixed shapes: greedy
  at temperature 0, else one sample each at that temperature (batch k drawn with
  fold_in(PRNGKey(seed), k): the same inputs, batch size and seed give the same samples)."""
  outputs = []
  for start in range(0, len(token_inputs), batch_size):
    chunk = token_inputs[start:start + batch_size]
    enc = data.pad_batch(chunk, None, max_input_length, max_length, batch_size)
    rng = jax.random.fold_in(jax.random.PRNGKey(seed), start // batch_size)
    out = np.asarray(_decode(config, params, jnp.asarray(enc['encoder_input_tokens']),
                             max_length, rng, temperature, **_encoder_args(encoder)))
    for row in out[:len(chunk)]:
      row = row.tolist()
      outputs.append(row[:row.index(data.EOS_ID) + 1] if data.EOS_ID in row else row)
    if log_every and (start // batch_size) % log_every == 0:
      what = 'greedy' if temperature == 0 else f'sampled at T={temperature:g}'
      print(f'  {what}: {start + len(chunk)}/{len(token_inputs)}', flush=True)
  return outputs


# ------------------------------------------------------------------------------------------------
# Evaluation.


def evaluate(config: network.T5Config, params: PyTree, sources: Sequence[str],
             references: Sequence[str], max_input_length: int, max_target_length: int,
             batch_size: int = 128, loss_batches: bool = True,
             bleu_examples: Optional[int] = None, encoder: Encoder = None) -> Dict[str, float]:
  """Per-token loss / accuracy (teacher forced) over all pairs, and greedy BLEU on the first
  `bleu_examples` (all when None)."""
  inputs, targets = data.tokenize_pairs(sources, references, max_input_length, max_target_length)
  results = {}
  if loss_batches:
    totals = {'cross_entropy': 0.0, 'accuracy': 0.0, 'tokens': 0.0}
    for start in range(0, len(inputs), batch_size):
      batch = data.pad_batch(inputs[start:start + batch_size], targets[start:start + batch_size],
                             max_input_length, max_target_length, batch_size)
      metrics = _eval_step(config, params, {k: jnp.asarray(v) for k, v in batch.items()},
                           **_encoder_args(encoder))
      for k in totals:
        totals[k] += float(metrics[k])
    results['loss'] = totals['cross_entropy'] / totals['tokens']
    results['accuracy'] = totals['accuracy'] / totals['tokens']
  n = len(inputs) if bleu_examples is None else min(bleu_examples, len(inputs))
  if n:
    outputs = translate(config, params, inputs[:n], max_input_length, max_target_length,
                        batch_size, encoder=encoder)
    results['bleu'] = data.corpus_bleu(data.decode(outputs), references[:n])
    results['bleu_examples'] = n
  return results


@functools.partial(jax.jit, static_argnames=('config', 'encoder_config'))
def _eval_step(config: network.T5Config, params: PyTree, batch: Dict[str, Array],
               encoder_config: Optional[network.T5Config] = None,
               encoder_params: Optional[PyTree] = None) -> Dict[str, Array]:
  """Teacher-forced metrics of one padded batch, summed over tokens (no dropout, no z-loss)."""
  encoded = encode_for(encoder_config, encoder_params, batch['encoder_input_tokens'])
  logits = network.Transformer(config).apply(
      {'params': params}, batch['encoder_input_tokens'], batch['decoder_input_tokens'],
      batch['decoder_target_tokens'], enable_dropout=False, encoded=encoded)
  _, metrics = cross_entropy_with_z_loss(logits, batch['decoder_target_tokens'],
                                         batch['decoder_loss_weights'], 0.0)
  return metrics


def encode_for(encoder_config: Optional[network.T5Config], encoder_params: Optional[PyTree],
               encoder_input_tokens: Array, encoder_segment_ids: Optional[Array] = None
               ) -> Optional[Array]:
  """The frozen encoder output a decoder-only model reads (no gradient), or None without one."""
  if encoder_config is None:
    return None
  return jax.lax.stop_gradient(network.Transformer(encoder_config).apply(
      {'params': encoder_params}, encoder_input_tokens, encoder_segment_ids,
      method=network.Transformer.encode))


# ------------------------------------------------------------------------------------------------
# Sequence-level distillation data.


def sequence_distillation_targets(config: network.T5Config, params: PyTree,
                                  inputs: Sequence[Sequence[int]], max_input_length: int,
                                  max_target_length: int, cache_path: Optional[os.PathLike] = None,
                                  batch_size: int = 256, temperature: float = 0.0,
                                  seed: int = 0, encoder: Encoder = None) -> List[List[int]]:
  """A model's outputs (ending in EOS) for tokenized inputs, as training targets, cached in .npz.

  Greedy (temperature 0), the teacher's are BiLD's "aligned" training set: the draft learns
  what the target would say, which is what greedy speculative decoding accepts. Sampled, the
  teacher's are the prefixes speculative sampling keeps (each kept token is distributed as the
  target's), and a student's own are on-policy sequences (DistillSpec). Outputs that hit
  max_target_length without EOS get EOS as their last token (as truncation does for real
  targets). The cache is keyed by the number of inputs, a checksum of them, the temperature and
  the seed, so a stale file is recomputed.
  """
  checksum = int(sum((i + 1) * sum(x) for i, x in enumerate(inputs[:1000])) % (2**31))
  key = {'num': len(inputs), 'checksum': checksum, 'temperature': float(temperature),
         'seed': int(seed) if temperature else 0}
  cached = _read_targets(cache_path, key)
  if cached is not None:
    return cached
  start = time.time()
  # Decode in order of input length: a batch's loop runs until its longest output ends, and
  # output length follows input length, so sorted batches waste far fewer steps on finished rows.
  order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
  sorted_outputs = translate(config, params, [inputs[i] for i in order], max_input_length,
                             max_target_length, batch_size, log_every=20, encoder=encoder,
                             temperature=temperature, seed=seed)
  outputs: List[List[int]] = [[] for _ in inputs]
  for i, row in zip(order, sorted_outputs):
    if not row or row[-1] != data.EOS_ID:
      row = row[:max_target_length - 1] + [data.EOS_ID]
    outputs[i] = row
  what = 'greedy outputs' if not temperature else f'samples at T={temperature:g}'
  print(f'Sequence distillation: {len(outputs)} {what} in {time.time() - start:.0f}s.',
        flush=True)
  if cache_path is not None:
    tokens = np.zeros((len(outputs), max_target_length), np.int32)
    for i, row in enumerate(outputs):
      tokens[i, :len(row)] = row
    Path(cache_path).parent.mkdir(parents=True, exist_ok=True)
    np.savez(cache_path, tokens=tokens, lengths=np.array([len(r) for r in outputs], np.int32),
             **key)
  return outputs


def _read_targets(cache_path: Optional[os.PathLike], key: Dict[str, Any]
                  ) -> Optional[List[List[int]]]:
  """The cached targets if `cache_path` holds those of `key`, else None (a file written before
  the temperature was part of the key holds greedy outputs)."""
  if cache_path is None or not Path(cache_path).exists():
    return None
  cached = np.load(cache_path)
  found = {'temperature': 0.0, 'seed': 0, **{k: cached[k].item() for k in cached.files
                                              if k in key}}
  if found != key:
    print(f'Distillation cache {cache_path} does not match the inputs; recomputing.', flush=True)
    return None
  tokens, lengths = cached['tokens'], cached['lengths']
  return [tokens[i, :lengths[i]].tolist() for i in range(len(lengths))]
