"""A model of a speculative decode's time: measured step costs and observed acceptance.

The first paper chooses gamma from expected tokens per target call over a call's cost; this is
that model with the costs measured on the machine instead of assumed. One iteration of a decode
loop at one batch size costs

  gamma = 0 (the target alone):  target(1) + plain overhead
  gamma >= 1:                    draft(2) + (gamma - 1) draft(1) + target(gamma + 1)
                                 + overhead + gamma * overhead per draft token

where target(k) / draft(k) are one cached step appending k tokens per row, measured in
isolation (`calibrate.step_costs`; a draft phase's first call feeds 2 tokens), as are the
encoders a batch runs once; the overheads are what a real loop's iteration costs beyond its
steps (sampling, acceptance, cache bookkeeping, dispatch), fitted from a few real loops (`fit`). An iteration emits on average
(1 - a^(gamma + 1)) / (1 - a) tokens per row, a the acceptance; a batch's loop runs until its
longest row is done, so the acceptance that predicts a batch is an effective one, solved from
the batch's own count (`effective_alpha`: output positions / loop iterations) -- it absorbs the
spread of the rows. Time per output position is iteration ms over tokens per iteration, plus
what a batch costs once (the encoders, the dispatch) over its positions.

Counting is exact where timing is noisy: a policy that knows the step costs follows a change
of acceptance from one batch's counts, where telling two gammas 4% apart by their batch times
takes dozens of batches.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, Iterable, Mapping, Optional, Sequence

import numpy as np


def expected_tokens(alpha: float, gamma: int) -> float:
  """The paper's expected output tokens per target call: (1 - alpha^(gamma + 1)) / (1 - alpha)."""
  if alpha >= 1.0:
    return float(gamma + 1)
  return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def effective_alpha(tokens_per_iteration: float, gamma: int) -> float:
  """The acceptance a with expected_tokens(a, gamma) == tokens_per_iteration (clipped to the
  achievable range [1, gamma + 1]); bisection, as the map is increasing in a."""
  if gamma < 1:
    raise ValueError(f'effective_alpha needs gamma >= 1, got {gamma}.')
  target = min(max(tokens_per_iteration, 1.0), gamma + 1.0)
  low, high = 0.0, 1.0
  for _ in range(50):
    mid = (low + high) / 2
    low, high = (mid, high) if expected_tokens(mid, gamma) < target else (low, mid)
  return (low + high) / 2


@dataclasses.dataclass(frozen=True)
class StepCosts:
  """What one batch size's decode is made of, in ms (module docstring).

  target_ms: {k: one cached target step appending k tokens per row}, k = 1..max gamma + 1.
  draft_ms: {1: one draft step, 2: a two-token one}.
  batch_ms: what a batch costs once: both encoders and their caches, measured in isolation
    (host work and dispatch go into the fitted overheads).
  plain_overhead_ms, overhead_ms, overhead_per_token_ms: fitted from real loops (`fit`).
  """
  batch_size: int
  target_ms: Mapping[int, float]
  draft_ms: Mapping[int, float]
  batch_ms: float = 0.0
  plain_overhead_ms: float = 0.0
  overhead_ms: float = 0.0
  overhead_per_token_ms: float = 0.0

  @property
  def max_gamma(self) -> int:
    return max(self.target_ms) - 1

  def steps_ms(self, gamma: int) -> float:
    """The steps of one iteration at `gamma` (0: the target alone), without loop overhead."""
    if gamma == 0:
      return self.target_ms[1]
    if gamma + 1 not in self.target_ms:
      raise ValueError(f'no measured {gamma + 1}-token target step (max gamma '
                       f'{self.max_gamma}).')
    return self.draft_ms[2] + (gamma - 1) * self.draft_ms[1] + self.target_ms[gamma + 1]

  def iteration_ms(self, gamma: int) -> float:
    if gamma == 0:
      return self.steps_ms(0) + self.plain_overhead_ms
    return self.steps_ms(gamma) + self.overhead_ms + gamma * self.overhead_per_token_ms

  def ms_per_position(self, gamma: int, alpha: float, positions: float = 0.0) -> float:
    """Predicted ms per output position at `gamma` with acceptance `alpha` (effective: see
    `effective_alpha`), the batch's one-off cost spread over `positions` when given."""
    tokens = 1.0 if gamma == 0 else expected_tokens(alpha, gamma)
    once = self.batch_ms / positions if positions else 0.0
    return self.iteration_ms(gamma) / tokens + once

  def best(self, alpha: float, gammas: Optional[Iterable[int]] = None) -> int:
    """The gamma with the lowest predicted ms per position (ties: the smaller gamma)."""
    gammas = range(self.max_gamma + 1) if gammas is None else gammas
    return min(gammas, key=lambda g: (self.ms_per_position(g, alpha), g))

  def to_json(self) -> Dict[str, Any]:
    out = dataclasses.asdict(self)
    out['target_ms'] = {str(k): v for k, v in self.target_ms.items()}
    out['draft_ms'] = {str(k): v for k, v in self.draft_ms.items()}
    return out

  @classmethod
  def from_json(cls, values: Mapping[str, Any]) -> 'StepCosts':
    values = dict(values)
    values['target_ms'] = {int(k): float(v) for k, v in values['target_ms'].items()}
    values['draft_ms'] = {int(k): float(v) for k, v in values['draft_ms'].items()}
    return cls(**values)


@dataclasses.dataclass(frozen=True)
class LoopRun:
  """Real loops of one gamma over some batches: their wall ms (encoders included), loop
  iterations (the batch's most target calls of a row) and output positions (its longest row),
  summed over the batches."""
  gamma: int
  batches: int
  ms: float
  iterations: int
  positions: int

  @property
  def tokens_per_iteration(self) -> float:
    return self.positions / max(self.iterations, 1)

  @property
  def ms_per_position(self) -> float:
    return self.ms / max(self.positions, 1)


def fit(costs: StepCosts, runs: Sequence[LoopRun]) -> StepCosts:
  """`costs` with the loops' overheads fitted to `runs`: the target alone's per iteration from
  its runs, the speculative loop's (fixed and per draft token) by least squares on
  ms - batches * batch_ms - iterations * steps = iterations * (overhead + gamma * per token),
  each run weighted by 1 / ms (relative errors count alike); negative fits clipped to 0.

  Needs the target alone (gamma 0) and a speculative gamma; two or more fit the growth with
  gamma, one leaves it 0.
  """
  gammas = {r.gamma for r in runs}
  if 0 not in gammas or not gammas - {0}:
    raise ValueError(f'fit needs gamma 0 and a speculative gamma, got {sorted(gammas)}.')

  def rest(r: LoopRun) -> float:  # what the run's loop iterations cost beyond their steps
    return r.ms - r.batches * costs.batch_ms - r.iterations * costs.steps_ms(r.gamma)

  plain = [r for r in runs if r.gamma == 0]
  plain_overhead = sum(rest(r) for r in plain) / sum(r.iterations for r in plain)
  spec = [r for r in runs if r.gamma > 0]
  columns = [[r.iterations for r in spec]]
  if len({r.gamma for r in spec}) > 1:
    columns.append([r.iterations * r.gamma for r in spec])
  weights = np.array([1 / r.ms for r in spec])
  solution = np.linalg.lstsq(np.array(columns, float).T * weights[:, None],
                             np.array([rest(r) for r in spec]) * weights, rcond=None)[0]
  overhead, per_token = (list(np.maximum(solution, 0.0)) + [0.0])[:2]
  return dataclasses.replace(costs, plain_overhead_ms=max(float(plain_overhead), 0.0),
                             overhead_ms=float(overhead), overhead_per_token_ms=float(per_token))


def check(costs: StepCosts, runs: Sequence[LoopRun], alpha: float
          ) -> Dict[int, Dict[str, float]]:
  """Predicted against measured ms per output position for each run: {gamma: {predicted,
  measured, error}} (error = predicted / measured - 1), the batches' positions and `alpha`
  (effective) given."""
  out = {}
  for r in runs:
    predicted = (r.batches * costs.batch_ms + r.positions * costs.ms_per_position(r.gamma, alpha)
                 ) / r.positions
    out[r.gamma] = dict(predicted=predicted, measured=r.ms_per_position,
                        error=predicted / r.ms_per_position - 1.0)
  return out


def pooled_alpha(runs: Sequence[LoopRun]) -> float:
  """The effective acceptance of the speculative runs: each run's solved from its tokens per
  iteration, weighted by its iterations."""
  spec = [r for r in runs if r.gamma > 0]
  if not spec:
    raise ValueError('pooled_alpha needs a speculative run.')
  weights = np.array([r.iterations for r in spec], float)
  alphas = np.array([effective_alpha(r.tokens_per_iteration, r.gamma) for r in spec])
  return float(np.sum(weights * alphas) / max(weights.sum(), 1.0))


Schedule = Mapping[int, int]


def scheduled(schedule: Schedule, batch_size: int) -> Optional[int]:
  """The schedule's gamma for `batch_size`: its own entry, else the nearest calibrated batch
  size's (by ratio; ties: the smaller); None for an empty schedule."""
  if not schedule:
    return None
  if batch_size in schedule:
    return int(schedule[batch_size])
  nearest = min(schedule, key=lambda b: (abs(np.log(b / batch_size)), b))
  return int(schedule[nearest])


def parse_schedule(values: Mapping[Any, Any]) -> Dict[int, int]:
  """A schedule from gin or JSON ({batch size: gamma}, keys and values as ints); raises
  ValueError naming the entry that is not a positive batch size with a gamma >= 0."""
  out = {}
  for key, value in values.items():
    try:
      batch_size, gamma = int(key), int(value)
    except (TypeError, ValueError):
      raise ValueError(f'schedule entry {key!r}: {value!r} is not batch_size: gamma') from None
    if batch_size < 1 or gamma < 0:
      raise ValueError(f'schedule entry {key!r}: {value!r}: batch size must be >= 1 and gamma '
                       '>= 0')
    out[batch_size] = gamma
  return out


@dataclasses.dataclass(frozen=True)
class Calibration:
  """What speculative-t5x-calibrate measured (its calibration.json): {batch size: gamma} and
  {batch size: the fitted model} and {batch size: the acceptance it measured}, at `temperature`
  (a sampling loop's overheads and acceptance are not a greedy one's)."""
  schedule: Dict[int, int]
  models: Dict[int, StepCosts]
  temperature: float = 0.0
  alphas: Dict[int, float] = dataclasses.field(default_factory=dict)  # effective, per batch size

  def fits(self, temperature: Any) -> bool:
    """Whether a job at `temperature` (a scalar or per row) was calibrated for: every row at
    the calibrated temperature."""
    return bool(np.all(np.asarray(temperature, np.float32) == np.float32(self.temperature)))

  def model(self, batch_size: int) -> Optional[StepCosts]:
    """The model of exactly this batch size (step costs do not carry to another)."""
    return self.models.get(batch_size)


def load_calibration(path: os.PathLike) -> Calibration:
  """Reads a calibration.json; raises ValueError naming the file when it is not one."""
  try:
    values = json.loads(open(path, encoding='utf-8').read())
    return Calibration(parse_schedule(values['schedule']), {
        int(b): StepCosts.from_json(block['costs'])
        for b, block in values['batch_sizes'].items()}, float(values.get('temperature', 0.0)),
        {int(b): float(block['alpha']) for b, block in values['batch_sizes'].items()
         if block.get('alpha') is not None})
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise ValueError(f'{path} is not a readable calibration.json from '
                     f'speculative-t5x-calibrate ({type(e).__name__}: {e})') from None
