"""gamma='auto': the draft length chosen per batch from measured decode times and a running alpha.

The paper's expected output tokens per target call, E(alpha, gamma) = (1 - alpha^(gamma + 1)) /
(1 - alpha), sets how many loop iterations a batch needs; what one iteration costs at each gamma
has to be measured. Timing single target and draft calls predicts it badly on a CPU (a verify
call inside the jitted loop costs far less than a dispatched call, and the loop's own per-round
work is not in either), so `calibrate` times the real thing: the job's first batches
(CALIBRATION_ROWS rows) decoded with every candidate gamma (0 = target-only), round-robin,
medians over `repeats` rounds of times relative to the target alone's in the same round.
Afterwards `GammaTuner` predicts a batch's time at each gamma as its measured time rescaled by
E(alpha_at_calibration, gamma) / E(alpha_now, gamma) as the running alpha (accepted /
(accepted + rejections), the paper's alpha) drifts, and picks the fastest.

The choice never changes a greedy output (every gamma gives the target's greedy decode). With
sampling the output distribution is the target's at every gamma, but which sample a given seed
draws depends on gamma, so a sampled job with gamma='auto' is not reproducible from its seed
alone; the infer job records the gamma of every batch.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Any, Callable, Dict, Mapping, Sequence, Tuple

import jax
import numpy as np

from speculative_t5x import decoding
from speculative_t5x import models

AUTO = 'auto'
# Candidates: target-only and gamma 1..MAX_GAMMA (each is one compilation of the decode loop).
MAX_GAMMA = 4
# Calibration decodes the first batches (at least CALIBRATION_ROWS rows) 6 (MAX_GAMMA + 1) times
# after compiling MAX_GAMMA + 1 loops: a job of fewer batches than MIN_BATCHES uses
# FALLBACK_GAMMA instead: the gamma every calibration of the embedded pair chose at batch 1 and 8
# on this project's CPU with the stage-2 draft; with the stage-3 draft gamma 1 and 2 measure
# within the machine's noise of each other (README, "Benchmark").
CALIBRATION_ROWS = 16
MIN_BATCHES = 16
FALLBACK_GAMMA = 1

# predict(batch) -> (decodes, aux) with aux['stats'] the per-row `decoding.DecodeStats` fields,
# for one fixed gamma; the tuner blocks on the result itself.
Predict = Callable[[Any], Tuple[Any, Mapping[str, Any]]]


def expected_tokens(alpha: float, gamma: int) -> float:
  """The paper's expected output tokens per target call: (1 - alpha^(gamma + 1)) / (1 - alpha)."""
  if alpha >= 1.0:
    return float(gamma + 1)
  return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def _counts(stats: Mapping[str, Any]) -> Tuple[int, int]:
  """(accepted draft tokens, rejections) of one decode's stats."""
  return int(np.sum(stats['accepted'])), int(np.sum(stats['rollbacks']))


@dataclasses.dataclass
class GammaTuner:
  """Chooses gamma for the next batch. batch_ms[g]: measured ms per batch at gamma g (0 =
  target-only); calibration_alpha[g]: alpha measured with it. accepted / rejected: running
  counts over every batch observed (calibration included)."""
  batch_ms: Dict[int, float]
  calibration_alpha: Dict[int, float]
  accepted: int = 0
  rejected: int = 0

  @property
  def alpha(self) -> float:
    return self.accepted / max(self.accepted + self.rejected, 1)

  def predicted_ms(self, gamma: int) -> float:
    """A batch's decode time at gamma under the running alpha."""
    if gamma == 0:
      return self.batch_ms[0]
    return self.batch_ms[gamma] * (expected_tokens(self.calibration_alpha[gamma], gamma) /
                                   expected_tokens(self.alpha, gamma))

  def choose(self) -> int:
    """The gamma with the smallest predicted time (0: speculation does not pay here)."""
    return min(self.batch_ms, key=self.predicted_ms)

  def observe(self, stats: Mapping[str, Any]) -> None:
    """Adds one decoded batch's `DecodeStats` fields (arrays per row) to the running alpha."""
    accepted, rejected = _counts(stats)
    self.accepted += accepted
    self.rejected += rejected

  def summary(self) -> Dict[str, Any]:
    return {'alpha': round(self.alpha, 4), 'choice': self.choose(),
            'batch_ms': {g: round(ms, 3) for g, ms in self.batch_ms.items()},
            'predicted_ms': {g: round(self.predicted_ms(g), 3) for g in self.batch_ms}}


def calibrate(predicts: Mapping[int, Predict], batches: Sequence[Any], repeats: int = 5,
              clock: Callable[[], float] = time.perf_counter) -> GammaTuner:
  """Times predicts[g] over `batches` for every candidate gamma g, round-robin, `repeats`
  rounds after one untimed pass each, and returns the tuner: ms per batch for each gamma, the
  target alone's median times the median over rounds of the candidate's time relative to it.

  predicts must include 0 (target-only). Use at least CALIBRATION_ROWS rows in all: one short
  sentence says little about alpha, and this machine's speed drifts between passes. clock is
  injectable for tests.
  """
  if 0 not in predicts:
    raise ValueError('calibrate needs the target-only decoder (gamma 0) as a candidate.')
  if repeats < 1 or not batches:
    raise ValueError(f'calibrate needs batches and repeats >= 1, got {len(batches)} batches '
                     f'and repeats={repeats}.')
  counts = {}
  for gamma, predict in predicts.items():
    outputs = jax.block_until_ready([predict(batch) for batch in batches])
    counts[gamma] = tuple(sum(_counts(aux['stats'])[i] for _, aux in outputs) for i in (0, 1))
  gammas = list(predicts)
  times = np.zeros((repeats, len(gammas)))  # ms per batch, [round, candidate]
  for r in range(repeats):
    for i, gamma in enumerate(gammas):
      start = clock()
      jax.block_until_ready([predicts[gamma](batch) for batch in batches])
      times[r, i] = 1e3 * (clock() - start) / len(batches)
  # The machine's speed drifts between rounds: compare candidates within each round (time over
  # the target alone's time in that round), then take medians.
  relative = np.median(times / times[:, [gammas.index(0)]], axis=0)
  baseline_ms = float(np.median(times[:, gammas.index(0)]))
  speculative = [g for g in predicts if g > 0]
  return GammaTuner(
      batch_ms={g: baseline_ms * float(relative[i]) for i, g in enumerate(gammas)},
      calibration_alpha={g: counts[g][0] / max(sum(counts[g]), 1) for g in speculative},
      accepted=sum(counts[g][0] for g in speculative),
      rejected=sum(counts[g][1] for g in speculative))


def candidates(num_batches: int, max_gamma: int = MAX_GAMMA,
               min_batches: int = MIN_BATCHES) -> Tuple[int, ...]:
  """The gammas a job of num_batches batches compiles: 0 (target alone) to max_gamma, to be
  `calibrate`d, or only FALLBACK_GAMMA for a job too short to pay for the calibration."""
  if num_batches < min_batches:
    return (FALLBACK_GAMMA,)
  return tuple(range(max_gamma + 1))


def calibration_batches(batch_size: int, available: int) -> int:
  """How many batches of batch_size rows `calibrate` should use (of `available`)."""
  return max(1, min(available, -(-CALIBRATION_ROWS // batch_size)))


def wants_auto(model: models.EncoderDecoderModel, decode_kwargs: Mapping[str, Any]) -> bool:
  """Whether `model` decodes with speculative_sample and gamma='auto' in decode_kwargs (the
  effective arguments: gin-bound ones and the model's own)."""
  fn = getattr(model.decode_fn, 'func', model.decode_fn)
  return (getattr(fn, '__name__', None) == decoding.speculative_sample.__name__ and
          decode_kwargs.get('gamma') == AUTO)


def decoders(model: models.EncoderDecoderModel, decode_kwargs: Mapping[str, Any],
             max_gamma: int = MAX_GAMMA) -> Dict[int, models.EncoderDecoderModel]:
  """The candidates of a gamma='auto' model: {gamma: a copy of model decoding at that gamma}.

  0 is the target alone (`decoding.temperature_sample` with the same temperature, topk and
  topp), 1..max_gamma speculative_sample. decode_kwargs: the effective arguments of
  model.decode_fn (gin-bound and the model's). Only exact speculative sampling qualifies: a
  lenience below 1 or a custom rule would make the choice change the output distribution.
  """
  if max_gamma < 1:
    raise ValueError(f'max_gamma must be >= 1, got {max_gamma}.')
  if decode_kwargs.get('lenience', 1.0) != 1.0 or decode_kwargs.get('rule') is not None:
    raise ValueError("gamma='auto' needs exact speculative sampling (lenience 1, no custom "
                     'rule): it also considers the target alone.')
  target_only = {k: decode_kwargs[k] for k in ('temperature', 'topk', 'topp', 'rescale_log_probs',
                                               'max_decode_steps') if k in decode_kwargs}
  target_only.setdefault('topk', 0)  # speculative_sample's default, not T5X's topk=1
  out = {0: models.EncoderDecoderModel(
      model.target_config, model.draft_config, decode_fn=decoding.temperature_sample,
      decode_kwargs=target_only, input_vocabulary=model.input_vocabulary,
      output_vocabulary=model.output_vocabulary,
      draft_output_vocabulary=model.draft_output_vocabulary, eos_id=model.eos_id,
      draft_eos_id=model.draft_eos_id)}
  for gamma in range(1, max_gamma + 1):
    out[gamma] = copy.copy(model)
    out[gamma].decode_kwargs = {**model.decode_kwargs, 'gamma': gamma}
  return out
