"""The decoding policy: which compiled decoder each batch of a job runs, fixed or measured.

A fixed decoder runs every batch as configured. gamma='auto' chooses the draft length per batch
from measured decode times and a running alpha:

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
from typing import Any, Callable, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

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


def round_robin(passes: Mapping[Hashable, Callable[[], Any]], repeats: int,
                clock: Callable[[], float] = time.perf_counter) -> Dict[Hashable, List[float]]:
  """Seconds of every pass in each of `repeats` rounds, blocking on each pass's result.

  The passes take turns within a round, so that slow phases of a shared machine hit all of them
  alike; compare them within a round (`relative_medians`), never across runs. Warm the passes
  up (compile them) first. The one timing primitive of the project: the policy's calibration,
  the translate command and the benchmarks all time with it.
  """
  times = {key: [] for key in passes}
  for _ in range(repeats):
    for key, one_pass in passes.items():
      start = clock()
      jax.block_until_ready(one_pass())
      times[key].append(clock() - start)
  return times


def relative_medians(times: Mapping[Hashable, Sequence[float]], base: Hashable
                     ) -> Dict[Hashable, float]:
  """For each key, the median over rounds of its time over `base`'s time in the same round."""
  base_times = np.asarray(times[base])
  return {key: float(np.median(np.asarray(t) / base_times)) for key, t in times.items()}


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
  times = round_robin({g: (lambda p=p: [p(batch) for batch in batches])
                       for g, p in predicts.items()}, repeats, clock)
  relative = relative_medians(times, 0)
  baseline_ms = 1e3 * float(np.median(times[0])) / len(batches)
  speculative = [g for g in predicts if g > 0]
  return GammaTuner(
      batch_ms={g: baseline_ms * relative[g] for g in predicts},
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


class DecodingPolicy:
  """Which decoder each batch of a job runs: the job's one fixed decoder, or gamma='auto'.

  `choices` are the keys of the job's compiled decoders (`plan` makes them): `(None,)` for a
  fixed decoder, gammas for gamma='auto' (0 = the target alone). The job calls `calibrate` once
  on its first batches (a no-op for a single choice), then `choose` before and `observe` after
  every batch. Every process of a multi-host job gets process 0's choice, since all of them
  must run the same program.
  """

  def __init__(self, choices: Sequence[Optional[int]]):
    if not choices:
      raise ValueError('DecodingPolicy needs at least one choice.')
    self.choices = tuple(choices)
    self.tuner: Optional[GammaTuner] = None
    self.calibration_seconds = 0.0

  @property
  def measured(self) -> bool:
    """Whether batches choose between several decoders (after `calibrate`)."""
    return len(self.choices) > 1

  def calibrate(self, run: Callable[[Optional[int], Any], Any], batches: Sequence[Any],
                clock: Callable[[], float] = time.perf_counter) -> None:
    """Times every choice on `batches` (run(choice, batch) decodes one; compile first)."""
    if not self.measured:
      return
    start = clock()
    self.tuner = calibrate({g: (lambda batch, g=g: run(g, batch)) for g in self.choices},
                           batches, clock=clock)
    self.calibration_seconds = clock() - start

  def choose(self) -> Optional[int]:
    """The choice for the next batch."""
    if self.tuner is None:
      return self.choices[0]
    choice = self.tuner.choose()
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      choice = int(multihost_utils.broadcast_one_to_all(np.int32(choice)))
    return choice

  def observe(self, stats: Mapping[str, Any]) -> None:
    """Adds one decoded batch's per-row `DecodeStats` fields (this process's rows)."""
    if self.tuner is not None:
      self.tuner.observe(stats)

  def summary(self) -> Dict[str, Any]:
    """The calibration's figures and the current choice ({} for a single choice)."""
    return self.tuner.summary() if self.tuner is not None else {}


def plan(model: models.EncoderDecoderModel, decode_kwargs: Mapping[str, Any], num_batches: int,
         max_gamma: int = MAX_GAMMA, min_batches: int = MIN_BATCHES
         ) -> Tuple[DecodingPolicy, Dict[Optional[int], models.EncoderDecoderModel]]:
  """The policy of a job of `num_batches` batches and its decoders, {choice: model}.

  decode_kwargs: the effective arguments of model.decode_fn (gin-bound and the model's). A
  gamma='auto' model gets gammas 0..max_gamma when the job has at least min_batches batches,
  else FALLBACK_GAMMA alone (a job that short cannot pay for the calibration); any other model
  is its own single choice, None.
  """
  if not wants_auto(model, decode_kwargs):
    return DecodingPolicy((None,)), {None: model}
  gammas = candidates(num_batches, max_gamma, min_batches)
  decoders_ = decoders(model, decode_kwargs, max(max(gammas), 1))
  return DecodingPolicy(gammas), {g: decoders_[g] for g in gammas}
